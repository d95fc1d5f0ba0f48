"""Held-out rows in training: the per-epoch held-out loss, early stopping, a stop asked for by a
search, and the coordinator's ``search`` and ``train`` requests end to end, without PostgreSQL.

Jobs run on an :class:`Executor` over the ``cpu`` device (``TENSILE_TEST_DEVICE``) with a small budget. The held-out loss is
checked against a float64 forward pass written here (dense ReLU, dense, softmax cross-entropy),
so that the job's own loss code is not its own reference; early stopping is checked by its rule
on the recorded history, and by the stored weights giving the best epoch's loss. The search is
driven over a real ``multiprocessing.connection`` pipe as a backend drives it: messages in order,
at most ``parallel`` trials at once, every trial reported (a failed one too), halving stopping a
worse trial, and a cancel (or a closed connection) leaving no job and no device byte.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Pipe

import numpy as np
import pytest

from conftest import TEST_DEVICE, wait_until
from tensile_db.coordinator import jobs, protocol, training
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, JobState, TrainingJob
from tensile_db.coordinator.training import TrainingService
from tensile_db.errors import InvalidArgument, JobCancelled, ProtocolError, TensileError
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import model as models
from tensile_db.runtime import search
from tensile_db.runtime.devices import make_device
from tensile_db.runtime.preprocess import fit_scaling

BUDGET_NBYTES = 1 << 20
ARCH = {"layers": [{"dense": 16}]}
#: How long a test waits for one message or event, seconds.
WAIT_S = 30


@pytest.fixture
def executor():
    ex = Executor(MemoryManager(make_device(TEST_DEVICE), BUDGET_NBYTES), max_active_jobs=4)
    ex.start()
    yield ex
    ex.stop()


def separable(n: int = 240, n_val: int = 60, seed: int = 0):
    """Four features on different scales, the class by a linear rule: (x, y, x_val, y_val)."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n + n_val, 4)) * [1, 3, 0.5, 2] + [0, 10, -1, 0]).astype(np.float32)
    y = ((x[:, 0] + (x[:, 1] - 10) / 3) > 0).astype(np.int32)
    return x[:n], y[:n], x[n:], y[n:]


def make_job(x, y, x_val=None, y_val=None, arch=ARCH, scale_modes=None, **options) -> TrainingJob:
    spec = models.ModelSpec(models.parse_architecture(arch), x.shape[1], 2, "classification")
    opts = models.parse_options({"batch_size": 32, "lr": 0.05, **options})
    return TrainingJob(JobInfo(1, "tester", "heldout"), spec, opts, x, y, x_val, y_val, scale_modes)


def run(executor: Executor, job: TrainingJob, on_progress=None) -> list[dict]:
    """Submit ``job`` and wait for it to end; return its progress payloads."""
    executor.submit(job)
    progress = []
    while True:
        kind, payload = job.events.get(timeout=WAIT_S)
        if kind != "progress":
            assert kind == "done", payload
            return progress
        progress.append(payload)
        if on_progress:
            on_progress(payload)


def host_outputs(weights: dict, x: np.ndarray) -> np.ndarray:
    """Logits (N, C) float64 of a network of dense ReLU layers and a last dense layer, on raw
    features ``x`` scaled by the weights' ``x_mean`` / ``x_std``."""
    h = np.asarray(x, np.float64)
    if "x_mean" in weights:
        h = (h - weights["x_mean"]) / weights["x_std"]
    n_layers = sum(1 for k in weights if k.startswith("W"))
    for i in range(n_layers):
        h = h @ weights[f"W{i}"].astype(np.float64) + weights[f"b{i}"]
        if i < n_layers - 1:
            h = np.maximum(h, 0)
    return h


def host_val_loss(weights: dict, x: np.ndarray, y: np.ndarray) -> float:
    """Mean softmax cross-entropy, float64."""
    out = host_outputs(weights, x)
    top = out.max(axis=1)
    log_z = top + np.log(np.exp(out - top[:, None]).sum(axis=1))
    return float(np.mean(log_z - out[np.arange(len(y)), y]))


# --- the held-out loss of a job -----------------------------------------------------------------


def test_history_has_the_held_out_loss_of_every_epoch(executor):
    x, y, x_val, y_val = separable()
    modes = ["standardize", "minmax", "none", "standardize"]
    job = make_job(x, y, x_val, y_val, scale_modes=modes, epochs=6)
    progress = run(executor, job)
    assert [h["epoch"] for h in job.history] == [1, 2, 3, 4, 5, 6] and job.epoch == 6
    assert all(set(h) == {"epoch", "loss", "val_loss"} for h in job.history)
    assert [p["val_loss"] for p in progress] == [h["val_loss"] for h in job.history]
    assert [p["epochs"] for p in progress] == [6] * 6
    # the scaling stored with the weights is the training rows' under the given modes
    center, spread = fit_scaling(x, modes)
    assert np.array_equal(job.result["x_mean"], center) and np.array_equal(job.result["x_std"], spread)
    # without patience the result is the last epoch's: its held-out loss is the last one recorded
    assert host_val_loss(job.result, x_val, y_val) == pytest.approx(job.history[-1]["val_loss"], rel=1e-4)
    val = [h["val_loss"] for h in job.history]
    assert job.best_epoch == 1 + int(np.argmin(val)) and job.stopped is None
    assert val[-1] < val[0]                                       # a separable rule is being learnt
    assert executor.manager.in_use_nbytes == 0


def test_without_held_out_rows_no_held_out_loss(executor):
    x, y, _, _ = separable()
    job = make_job(x, y, epochs=2)
    run(executor, job)
    assert [sorted(h) for h in job.history] == [["epoch", "loss"]] * 2
    assert job.best_epoch is None and job.stopped is None
    empty = make_job(x, y, x[:0], y[:0], epochs=1)               # zero held-out rows: the same
    run(executor, empty)
    assert "val_loss" not in empty.history[0]


def noisy(seed: int = 1, noise: float = 0.3):
    """A rule learnt from 96 rows with a share ``noise`` of their labels flipped, judged on 64
    clean held-out rows: a wide network memorises the flips, and the held-out loss rises."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(160, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    y_noisy = np.where(rng.random(160) < noise, 1 - y, y).astype(np.int32)
    return x[:96], y_noisy[:96], x[96:], y[96:]


def test_patience_stops_early_and_keeps_the_best_epoch(executor):
    x, y, x_val, y_val = noisy()
    patience, epochs = 4, 60
    job = make_job(x, y, x_val, y_val, arch={"layers": [{"dense": 64}, {"dense": 64}]}, epochs=epochs,
                   batch_size=16, lr=0.03, optimizer="adam", patience=patience)
    run(executor, job)
    val = [h["val_loss"] for h in job.history]
    assert job.stopped == "patience" and job.state is JobState.DONE
    assert len(val) == job.epoch < epochs
    # the rule: the first epoch that is ``patience`` epochs past the best so far ends training
    best_so_far = [1 + int(np.argmin(val[:e])) for e in range(1, len(val) + 1)]
    ends = [e for e, b in enumerate(best_so_far, start=1) if e - b >= patience]
    assert ends[0] == job.epoch and job.best_epoch == best_so_far[-1] == job.epoch - patience
    # the stored weights are the best epoch's, not the last epoch's
    got = host_val_loss(job.result, x_val, y_val)
    assert got == pytest.approx(val[job.best_epoch - 1], rel=1e-4)
    assert got < val[-1] - 1e-3
    assert set(job.result) == {"W0", "b0", "W1", "b1", "W2", "b2", "x_mean", "x_std"}


def test_stop_requested_ends_after_the_current_epoch(executor):
    x, y, x_val, y_val = separable()
    job = make_job(x, y, x_val, y_val, epochs=100_000)
    run(executor, job, on_progress=lambda _: job.stop_requested.set())
    assert job.stopped == "halving" and job.state is JobState.DONE
    assert 1 <= job.epoch < 100_000 and len(job.history) == job.epoch
    # no patience: the weights are the last epoch's
    assert host_val_loss(job.result, x_val, y_val) == pytest.approx(job.history[-1]["val_loss"], rel=1e-4)

    early = make_job(x, y, x_val, y_val, epochs=5)
    early.stop_requested.set()                                   # asked before the first epoch ends
    run(executor, early)
    assert (early.epoch, early.stopped, len(early.history)) == (1, "halving", 1)

    last = make_job(x, y, x_val, y_val, epochs=1)
    last.stop_requested.set()                                    # nothing left to stop
    run(executor, last)
    assert (last.epoch, last.stopped) == (1, None)


# --- a search over a connection -----------------------------------------------------------------


def search_request(params: dict, parallel: int, halving: bool = False, **options) -> tuple[dict, dict]:
    """A ``search`` request as a backend builds it, its trials from :mod:`.runtime.search`."""
    x, y, x_val, y_val = separable()
    call = {"batch_size": 32, **options, "search": {"params": params}}
    trials = []
    for p in search.combinations(search.parse(call["search"]), seed=0):
        architecture, trial_options = search.trial_inputs(p, ARCH, call)
        trials.append({"architecture": architecture, "options": trial_options, "params": p})
    header = {"type": "search", "model_name": "m", "role": "tester", "backend_pid": 1, "task": "classification",
              "n_outputs": 2, "scale": ["standardize"] * 4, "classes": ["no", "yes"], "trials": trials,
              "parallel": parallel, "halving": halving}
    return header, {"x": x, "y": y, "x_test": x_val, "y_test": y_val}


class Backend:
    """The backend's end of a connection to a :class:`TrainingService` serving one request on a
    thread, as the coordinator's connection thread serves it (an error goes back as a message)."""

    def __init__(self, executor: Executor, header: dict, arrays: dict):
        self.conn, server_end = Pipe()
        service = TrainingService([executor], models.Limits(), "test")
        self.failure: BaseException | None = None

        def serve():
            try:
                getattr(service, header["type"])(server_end, header, arrays)
            except TensileError as exc:
                protocol.send_error(server_end, exc)
            except (EOFError, OSError) as exc:           # the backend has gone
                self.failure = exc
            finally:
                server_end.close()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def recv(self) -> tuple[dict, dict]:
        assert self.conn.poll(WAIT_S), "no message from the coordinator"
        return protocol.recv(self.conn)

    def messages(self, until=("result", "error"), on=None) -> list[tuple[dict, dict]]:
        """Every message up to one whose type is in ``until``."""
        got = []
        while True:
            header, arrays = self.recv()
            got.append((header, arrays))
            if on:
                on(header)
            if header["type"] in until:
                return got

    def close(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        self.conn.close()


def assert_nothing_left(executor: Executor) -> None:
    assert wait_until(lambda: executor.jobs() == [] and executor.manager.in_use_nbytes == 0)
    assert executor.manager.jobs == {}
    executor.manager.check()


def test_a_search_reports_every_trial_then_the_result(executor):
    header, arrays = search_request({"lr": [0.02, 0.05, 0.1]}, parallel=2, epochs=4)
    assert [t["options"]["lr"] for t in header["trials"]] == [0.02, 0.05, 0.1]
    backend = Backend(executor, header, arrays)
    messages = backend.messages()
    backend.close()
    kinds = [h["type"] for h, _ in messages]
    assert kinds[0] == "accepted" and kinds[-1] == "result" and kinds.count("trial") == 3
    assert set(kinds) == {"accepted", "progress", "trial", "result"}
    job_ids = messages[0][0]["job_ids"]
    assert len(job_ids) == 3 and messages[-1][0]["trials"] == 3

    progress = [h for h, _ in messages if h["type"] == "progress"]
    for i in range(3):
        mine = [p for p in progress if p["trial"] == i]
        assert [p["epoch"] for p in mine] == [1, 2, 3, 4]
        assert all(p["job_id"] == job_ids[i] and p["epochs"] == 4 and "val_loss" in p for p in mine)
    # parallel 2: a third trial starts only after one has ended
    first_end = kinds.index("trial")
    assert len({h["trial"] for h, _ in messages[:first_end] if h["type"] == "progress"}) <= 2

    trials = {h["trial"]: (h, a) for h, a in messages if h["type"] == "trial"}
    assert sorted(trials) == [0, 1, 2]
    for i, (h, weights) in trials.items():
        m = h["metrics"]
        assert "error" not in h and set(weights) == {"W0", "b0", "W1", "b1", "x_mean", "x_std"}
        assert m["score_name"] == "f1_macro" and m["score"] == m["f1_macro"] and m["test_samples"] == 60
        assert m["epochs"] == 4 and [e["epoch"] for e in m["history"]] == [1, 2, 3, 4]
        assert [e["val_loss"] for e in m["history"]] == [p["val_loss"] for p in progress if p["trial"] == i]
        assert m["stopped"] is None and m["best_epoch"] in (1, 2, 3, 4)
        # the metrics are those of the weights sent with them, on the held-out rows
        predicted = host_outputs(weights, arrays["x_test"]).argmax(axis=1)
        assert m["accuracy"] == pytest.approx(float((predicted == arrays["y_test"]).mean()))
        assert m["accuracy"] > 0.8 and set(m["per_class"]) == {"no", "yes"}
        assert m["device"] == executor.name and m["samples"] == 240
    assert_nothing_left(executor)


def test_halving_stops_a_worse_trial_at_a_rung(executor):
    # one trial at a time: the first sets every rung's loss, the second learns almost nothing
    header, arrays = search_request({"lr": [0.05, 1e-7]}, parallel=1, halving=True, epochs=100)
    backend = Backend(executor, header, arrays)
    messages = backend.messages()
    backend.close()
    good, bad = (next(h["metrics"] for h, _ in messages if h["type"] == "trial" and h["trial"] == i) for i in (0, 1))
    assert good["stopped"] is None and good["epochs"] == 100
    # rungs 12, 25 and 50: the second trial is worse at 12 and stops there (decided at the
    # epoch's end, on the executor's thread)
    assert bad["stopped"] == "halving" and bad["epochs"] == 12 and len(bad["history"]) == 12
    assert bad["history"][11]["val_loss"] > good["history"][11]["val_loss"]
    assert_nothing_left(executor)


def test_cancel_ends_a_search_and_frees_everything(executor):
    header, arrays = search_request({"lr": [0.02, 0.05, 0.1]}, parallel=2, epochs=100_000)
    backend = Backend(executor, header, arrays)
    sent = []

    def cancel_once(h):
        if h["type"] == "progress" and not sent:
            protocol.send(backend.conn, {"type": "cancel"})
            sent.append(h)

    messages = backend.messages(on=cancel_once)
    backend.close()
    last = messages[-1][0]
    assert sent and last["type"] == "error" and last["error"] == "JobCancelled"
    with pytest.raises(JobCancelled, match="the search was cancelled by its backend"):
        protocol.raise_if_error(last)
    assert not any(h["type"] in ("trial", "result") for h, _ in messages)
    assert_nothing_left(executor)


def test_a_closed_connection_cancels_the_search(executor):
    header, arrays = search_request({"lr": [0.02, 0.05, 0.1]}, parallel=2, epochs=100_000)
    backend = Backend(executor, header, arrays)
    assert backend.recv()[0]["type"] == "accepted"
    assert backend.recv()[0]["type"] == "progress"
    backend.conn.close()
    backend.thread.join(WAIT_S)
    assert not backend.thread.is_alive() and isinstance(backend.failure, (EOFError, OSError))
    assert_nothing_left(executor)


def test_a_search_starts_whole_or_not_at_all(executor):
    header, arrays = search_request({"lr": [0.02, 0.05, 0.1]}, parallel=2, epochs=2)
    header["trials"][2]["options"]["momentum"] = 2.0
    backend = Backend(executor, header, arrays)
    (last, _), = backend.messages()
    backend.close()
    with pytest.raises(InvalidArgument, match=r"options\.momentum must be in \[0, 1\), got 2\.0"):
        protocol.raise_if_error(last)
    assert executor.jobs() == [] and executor.manager.in_use_nbytes == 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")      # as in production: inf and NaN, then "diverged"
def test_a_failed_trial_is_reported_and_the_others_go_on(executor):
    header, arrays = search_request({"lr": [0.05, 1e30]}, parallel=2, epochs=3)
    backend = Backend(executor, header, arrays)
    messages = backend.messages()
    backend.close()
    trials = {h["trial"]: h for h, _ in messages if h["type"] == "trial"}
    assert trials[0]["metrics"]["epochs"] == 3
    assert trials[1]["error_class"] == "InvalidArgument" and "training diverged" in trials[1]["error"]
    assert "metrics" not in trials[1] and messages[-1][0]["type"] == "result"
    assert_nothing_left(executor)


# --- one model over a connection ----------------------------------------------------------------


def train_request(**options) -> tuple[dict, dict]:
    x, y, x_val, y_val = noisy()
    header = {"type": "train", "model_name": "m", "role": "tester", "backend_pid": 1, "task": "classification",
              "n_outputs": 2, "architecture": {"layers": [{"dense": 64}, {"dense": 64}]},
              "options": {"batch_size": 16, "lr": 0.03, "optimizer": "adam", **options}}
    return header, {"x": x, "y": y, "x_test": x_val, "y_test": y_val}


def test_train_with_patience_returns_the_best_epoch(executor):
    header, arrays = train_request(epochs=60, patience=4)
    backend = Backend(executor, header, arrays)
    messages = backend.messages()
    backend.close()
    (result, weights) = messages[-1]
    assert [h["type"] for h, _ in messages[:1]] == ["accepted"] and result["type"] == "result"
    m = result["metrics"]
    val = [h["val_loss"] for h in m["history"]]
    assert m["stopped"] == "patience" and m["epochs"] == len(val) == m["best_epoch"] + 4 < 60
    assert [h["val_loss"] for h, _ in messages if h["type"] == "progress"] == val
    assert host_val_loss(weights, arrays["x_test"], arrays["y_test"]) == pytest.approx(val[m["best_epoch"] - 1],
                                                                                        rel=1e-4)
    # the held-out metrics are those of the weights returned
    predicted = host_outputs(weights, arrays["x_test"]).argmax(axis=1)
    assert m["accuracy"] == pytest.approx(float((predicted == arrays["y_test"]).mean()))
    assert m["log_loss"] == pytest.approx(val[m["best_epoch"] - 1], rel=1e-3)
    # and the fit on the training rows too, on the rows as sent
    fitted = host_outputs(weights, arrays["x"]).argmax(axis=1)
    assert m["train_accuracy"] == pytest.approx(float((fitted == arrays["y"]).mean()))
    assert_nothing_left(executor)


def test_the_fit_of_many_training_rows_is_measured_on_rows_evenly_spaced(executor, monkeypatch):
    monkeypatch.setattr(training, "FIT_ROWS", 50)
    header, arrays = train_request(epochs=2)
    backend = Backend(executor, header, arrays)
    (result, weights) = backend.messages()[-1]
    backend.close()
    step = -(-len(arrays["x"]) // 50)
    assert step > 1
    fitted = host_outputs(weights, arrays["x"][::step]).argmax(axis=1)
    assert result["metrics"]["train_accuracy"] == pytest.approx(float((fitted == arrays["y"][::step]).mean()))
    assert_nothing_left(executor)


def test_cancel_ends_a_training(executor):
    header, arrays = train_request(epochs=100_000)
    backend = Backend(executor, header, arrays)
    assert backend.recv()[0]["type"] == "accepted"
    assert backend.recv()[0]["type"] == "progress"
    protocol.send(backend.conn, {"type": "cancel"})
    last = backend.messages()[-1][0]
    backend.close()
    with pytest.raises(JobCancelled):
        protocol.raise_if_error(last)
    assert_nothing_left(executor)


def test_the_trials_of_a_search_share_the_rows_and_their_scaling(executor):
    x, y, xv, yv = separable()
    first = make_job(x, y, xv, yv)
    spec = models.ModelSpec(models.parse_architecture({"layers": [{"dense": 8}]}), 4, 2, "classification")
    other = TrainingJob(JobInfo(1, "tester", "t2"), spec, models.parse_options({"lr": 0.01}), x, y, xv, yv,
                        data_of=first)
    assert other.x is first.x and other.x_val is first.x_val and other.scaling is first.scaling
    assert np.shares_memory(first.x, x)                              # the rows as sent: scaled batch by batch
    progress = run(executor, other)
    assert len(progress) == other.options.epochs and all("val_loss" in p for p in progress)


def by_index(arrays: dict, seed: int = 3) -> dict:
    """The rows of a ``train`` request's arrays shuffled together into one ``x``, sent with the
    indices of the training and the held-out rows in it, as a backend sends a scan's rows."""
    x = np.concatenate([arrays["x"], arrays["x_test"]])
    at = np.random.default_rng(seed).permutation(len(x))         # row k of x is row at[k] of the concatenation
    where = np.argsort(at)
    n = len(arrays["x"])
    return {"x": x[at], "rows": where[:n].astype(np.int32), "y": arrays["y"],
            "test_rows": where[n:].astype(np.int64), "y_test": arrays["y_test"]}


def in_sealed_file(x: np.ndarray) -> np.ndarray:
    """``x`` copied into a sealed memory file at an offset past its start, as the backend's scan
    writes rows: a view of the file's mapping (:func:`protocol.map_sealed`)."""
    fd = os.memfd_create("scan", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, (1 << 20) + x.nbytes)
        assert os.pwrite(fd, np.ascontiguousarray(x).tobytes(), 1 << 20) == x.nbytes
        mapping = protocol.map_sealed(fd)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, x.dtype, count=x.size, offset=1 << 20).reshape(x.shape)


@pytest.mark.parametrize("scale", [None, ["standardize", "minmax", "none", "standardize"]])
def test_rows_sent_by_index_train_the_same_model_as_rows_sent_gathered(executor, scale, monkeypatch):
    monkeypatch.setattr(training, "FIT_ROWS", 50)            # the fit and the per-epoch loss on rows
    monkeypatch.setattr(jobs, "VALIDATION_ROWS", 20)         # evenly spaced: strided, gathered
    header, arrays = train_request(epochs=3)
    if scale:
        header["scale"] = scale
    indexed = by_index(arrays)
    indexed["x"] = in_sealed_file(indexed["x"])              # as the scan wrote them: sent as they lie
    ours, theirs = Pipe()
    protocol.accept_shared(ours, files=2)
    protocol.send(ours, header, indexed)
    _, received = protocol.recv(theirs)                       # x a view of the coordinator's mapping of that file
    ours.close()
    theirs.close()
    assert received["x"].tobytes() == indexed["x"].tobytes() and not received["x"].flags.writeable
    results = []
    for sent in (arrays, received):
        backend = Backend(executor, header, sent)
        (result, weights) = backend.messages()[-1]
        backend.close()
        assert result["type"] == "result", result
        results.append((result["metrics"], weights))
    (gathered, w_gathered), (indexed, w_indexed) = results
    assert list(w_gathered) == list(w_indexed)
    for name in w_gathered:                                     # the same bits: same rows, order, scaling
        assert w_gathered[name].tobytes() == w_indexed[name].tobytes(), name
    timing = {"train_time_s", "queued_s"}
    assert {k: v for k, v in gathered.items() if k not in timing} == {k: v for k, v in indexed.items() if k not in timing}
    assert indexed["samples"] == len(arrays["y"]) and indexed["test_samples"] == len(arrays["y_test"])
    assert_nothing_left(executor)


@pytest.mark.parametrize("rows, message", [
    (np.array([0, 1, 10_000], np.int64), "not indices of its"),
    (np.array([-1, 0, 1], np.int32), "not indices of its"),
    (np.array([0.0, 1.0, 2.0]), "not indices of its"),
])
def test_a_train_request_whose_rows_are_not_indices_of_its_rows_is_refused(executor, rows, message):
    header, arrays = train_request(epochs=1)
    assert_refused(executor, header, {"x": arrays["x"], "rows": rows, "y": arrays["y"][:3]}, message)


def assert_refused(executor: Executor, header: dict, sent: dict, message: str) -> None:
    """The request of ``header`` with the arrays ``sent`` is answered by a ProtocolError matching
    ``message``, and leaves nothing behind."""
    backend = Backend(executor, header, sent)
    (last, _) = backend.messages()[-1]
    backend.close()
    with pytest.raises(ProtocolError, match=message):
        protocol.raise_if_error(last)
    assert_nothing_left(executor)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop("rows"), "without the training rows' indices"),
    (lambda a: a.update(x_test=a["x"][:3]), "besides held-out rows"),
    (lambda a: a.update(test_rows=np.append(a["test_rows"][1:], a["rows"][0])), "are training rows too"),
])
def test_held_out_rows_by_index_that_do_not_fit_the_training_rows_are_refused(executor, change, message):
    header, arrays = train_request(epochs=1)
    sent = by_index(arrays)
    change(sent)
    assert_refused(executor, header, sent, message)
