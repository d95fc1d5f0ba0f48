"""Demand-layered inference on the coordinator, without PostgreSQL: outputs against the host
forward pass and across prefetch windows, for MLPs and for convolutional networks with a residual
block and a concatenation; the window's memory bound and the exact size of a step; the weight
cache and its eviction order, cancellation, a failing node, model replacement, admission by
footprint, and several calls at once with a training job under one budget (no two blocks share a
byte, nothing exceeds the budget). The model files themselves are tests/test_model_files.py's."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from conftest import TEST_DEVICE, wait_done, wait_until
from job_helpers import FAST, make_job
from model_helpers import cnn_spec, features, spec_of, weights_of
from tensile_db.coordinator.executor import Executor
from tensile_db.errors import CorruptModel, DeviceOutOfMemory, InvalidArgument, JobCancelled
from tensile_db.inference import INFERENCE_JOB, layered
from tensile_db.inference.files import file_name
from tensile_db.inference.service import InferenceService
from tensile_db.memory.arena import round_up
from tensile_db.memory.manager import MemoryManager, Residency
from tensile_db.runtime import model as models
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.devices import make_device
from tensile_db.runtime.program import Kind, Slot


def service(budget=1 << 22) -> InferenceService:
    return InferenceService(MemoryManager(make_device(TEST_DEVICE), budget))


def predict(svc, model_id, spec, w, x, window, batch_size=64, cache=True, version="v1", name="m", **kw):
    model = svc.store.checkout(model_id, version) or svc.store.add(model_id, version, name, spec, w)
    return svc.predict(model, x, window, batch_size, cache, **kw)


def call_blocks(mm) -> list:
    return [t for _, _, t in mm.blocks() if t.job_id == INFERENCE_JOB]


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_every_window_gives_the_preloaded_outputs_bit_for_bit_and_agrees_with_the_host_forward(task, kind):
    spec = spec_of(task) if kind == "mlp" else cnn_spec(task)
    w, x = weights_of(spec), features(spec)
    svc = service()
    n_layers = len(spec.network.layered)
    preloaded, stats = predict(svc, 1, spec, w, x, window=n_layers, cache=False)
    assert stats.window == n_layers and stats.weight_loads == n_layers     # loaded once, kept for the call
    np.testing.assert_allclose(preloaded, models.forward(spec, w, x), rtol=1e-5, atol=1e-6)
    for window in range(1, n_layers + 3):
        out, stats = predict(svc, 1, spec, w, x, window=window, cache=False)
        assert np.array_equal(out, preloaded), f"window {window}"
        assert stats.window == min(window, n_layers)
    if task == "classification":
        assert np.allclose(preloaded.sum(axis=1), 1, atol=1e-5)
    assert svc.manager.in_use_nbytes == 0
    svc.manager.close()


def test_a_window_holds_at_most_w_plus_one_layers_and_one_batch_of_activations():
    spec = spec_of(hidden=[{"dense": 256}] * 8, n_features=256, n_outputs=256)
    w, x = weights_of(spec), features(spec, n=200)
    layer_nbytes = round_up((256 * 256 + 256) * 4)
    activations_nbytes = 2 * round_up(50 * 256 * 4)
    peaks = {}
    for window in (1, 2, 4, 9):
        svc = service(budget=1 << 24)
        _, stats = predict(svc, 1, spec, w, x, window=window, batch_size=50, cache=False)
        peaks[window] = svc.manager.peak_nbytes
        assert stats.device_peak_nbytes == peaks[window]                    # the call alone on the device
        assert peaks[window] <= min(window + 1, 9) * layer_nbytes + activations_nbytes, window
        assert stats.weight_loads == (9 if window == 9 else 9 * stats.batches)
        svc.manager.close()
    assert peaks[1] < peaks[2] < peaks[4] < peaks[9]
    assert peaks[9] >= 9 * layer_nbytes


def watched(mm, check):
    """``mm`` with ``check()`` and the manager's invariants run after every acquire; returns the
    list of acquires' ``what``."""
    original, seen = mm.acquire, []

    def acquire(*args, **kwargs):
        created = original(*args, **kwargs)
        mm.check()
        check()
        seen.append(kwargs.get("what", ""))
        return created

    mm.acquire = acquire
    return seen


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_a_cnn_window_holds_at_most_w_plus_one_layers_and_its_largest_step_of_activations(window):
    spec = cnn_spec()
    w, x = weights_of(spec), features(spec, n=200)
    svc = service(budget=1 << 24)
    mm = svc.manager
    model = svc.store.add(1, "v", "m", spec, w)
    n_layers = len(model.layers)

    def at_most_w_plus_one():
        assert sum(1 for t in model.layers if t.wanted) <= min(window + 1, n_layers)
        assert mm.in_use_nbytes <= mm.budget_nbytes

    seen = watched(mm, at_most_w_plus_one)
    _, stats = svc.predict(model, x, window, 50, cache=False)
    assert stats.device_peak_nbytes == mm.peak_nbytes                       # the call alone on the device
    layers = sorted((t.arena_nbytes for t in model.layers), reverse=True)
    assert mm.peak_nbytes <= sum(layers[:window + 1]) + max(layered.activations_nbytes(model, 50))
    assert len(seen) == len(spec.network.nodes) * stats.batches              # one acquire per node and batch
    assert "layer 3 (architecture.layers[2]) of model 'm' (batch of 50 rows)" in seen
    assert stats.weight_loads == (n_layers if window >= n_layers - 1 else n_layers * stats.batches)
    assert all(not t.pins and not t.wanted for t in mm.tensors()) and mm.in_use_nbytes == 0
    mm.close()


def test_the_steps_are_the_live_activations_of_the_graph():
    svc = service()
    model = svc.store.add(1, "v", "m", cnn_spec(), weights_of(cnn_spec()))
    steps = layered.plan(model)
    # 0 conv, 1 batch norm, 2 conv, 3 add(2, 1), 4 max pool, 5 conv, 6 concat(4, 5), 7 pool, 8 dense
    assert [s.live for s in steps] == [(-1,), (0,), (1,), (1, 2), (3,), (4,), (4, 5), (6,), (7,)]
    assert [s.frees for s in steps] == [(-1,), (0,), (), (1, 2), (3,), (), (4, 5), (6,), (7, 8)]
    assert [s.layer for s in steps] == [0, 1, 2, None, None, 3, None, None, 4]
    network, rows = model.spec.network, 10
    act = [round_up(rows * int(np.prod(n.shape)) * 4) for n in network.nodes]
    conv2 = network.nodes[2]
    assert layered.activations_nbytes(model, rows)[2] == (act[1] + act[2]
                                                          + round_up(conv2.workspace_nelems(rows) * 4))
    assert layered.step_nbytes(model, rows)[2] == model.layers[2].arena_nbytes + layered.activations_nbytes(model,
                                                                                                         rows)[2]
    assert layered.step_nbytes(model, rows)[3] == act[1] + act[2] + act[3]
    svc.store.checkin(model)
    svc.manager.close()


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_budget_of_the_largest_step_is_enough_and_one_unit_less_is_refused_naming_the_node(kind):
    spec = spec_of() if kind == "mlp" else cnn_spec()
    w, x = weights_of(spec), features(spec, n=200)
    expected = predict(service(), 1, spec, w, x, window=1, batch_size=50)[0]
    sizing = service()
    need = max(layered.step_nbytes(sizing.store.add(1, "v", "m", spec, w), 50))
    sizing.manager.close()
    for window in (1, 3):
        svc = service(budget=need)
        mm = svc.manager
        watched(mm, lambda: None)
        out, stats = predict(svc, 1, spec, w, x, window=window, batch_size=50)
        assert np.array_equal(out, expected) and mm.peak_nbytes <= need == mm.budget_nbytes
        assert stats.device_peak_nbytes <= need
        mm.close()
    svc = service(budget=need - round_up(1))
    with pytest.raises(DeviceOutOfMemory, match=r"layer \d+ \((architecture\.layers\[\d+\]\S*|the output layer)\) "
                                                r"of model 'm' with a batch of 50 rows \(lower options.batch_size\)"):
        predict(svc, 1, spec, w, x, window=1, batch_size=50)
    assert svc.manager.in_use_nbytes == 0
    svc.manager.close()
    svc = service(budget=round_up(1) * 2)
    with pytest.raises(DeviceOutOfMemory,
                       match=r"of model 'm' even with a batch of 1 row \(raise tensile.device_budget\)"):
        predict(svc, 1, spec, w, x, window=1, batch_size=50)
    svc.manager.close()


def test_a_call_that_names_no_batch_size_streams_the_most_rows_whose_steps_fit():
    spec = cnn_spec()
    w, x = weights_of(spec), features(spec, n=200)
    sizing = service()
    model = sizing.store.add(1, "v", "m", spec, w)
    need = {rows: max(layered.step_nbytes(model, rows)) for rows in (37, 38)}
    sizing.manager.close()
    svc = service(budget=need[37])
    assert need[38] > need[37]                           # else the budget would not decide the rows
    out, stats = predict(svc, 1, spec, w, x, window=1, batch_size=None)
    assert stats.batch_size == 37 and svc.manager.peak_nbytes <= need[37]
    assert np.array_equal(out, predict(service(), 1, spec, w, x, window=1, batch_size=37)[0])
    svc.manager.close()
    roomy = service(budget=1 << 26)
    assert predict(roomy, 1, spec, w, x, window=1, batch_size=None)[1].batch_size == 200      # all rows, <= 256
    roomy.manager.close()


def test_a_cnn_call_shares_a_tight_budget_with_a_training_job_without_overlap():
    spec = cnn_spec()
    w, x = weights_of(spec), features(spec, n=300)
    expected = predict(service(), 1, spec, w, x, window=2, batch_size=64)[0]
    job = make_job(seed=4)
    sizing = service()
    need = max(layered.step_nbytes(sizing.store.add(1, "v", "m", spec, w), 64))
    sizing.manager.close()
    mm = MemoryManager(make_device(TEST_DEVICE), round_up(job.min_working_set_nbytes + need))
    watched(mm, lambda: None)
    ex = Executor(mm, cost=FAST)
    svc = InferenceService(mm)
    ex.start()
    try:
        ex.submit(job)
        outs = [predict(svc, 1, spec, w, x, window=window, batch_size=64)[0] for window in (1, 2, 5)]
        wait_done(job, f"job {job.id}")
    finally:
        ex.stop()
    assert all(np.array_equal(out, expected) for out in outs)
    assert mm.peak_nbytes <= mm.budget_nbytes
    assert mm.jobs[INFERENCE_JOB].device_nbytes == mm.cache_nbytes()
    mm.close()


def test_the_weight_cache_serves_a_second_call_and_gives_way_first():
    spec = spec_of()
    w, x = weights_of(spec), features(spec)
    svc = service(budget=1 << 20)
    mm = svc.manager
    first, stats = predict(svc, 1, spec, w, x, window=1)
    assert stats.weight_loads >= len(spec.network.layered)
    second, stats = predict(svc, 1, spec, w, x, window=1)
    assert stats.weight_loads == 0 and stats.cache_hits > 0 and np.array_equal(first, second)
    cached = mm.cache_nbytes()
    assert cached == sum(t.arena_nbytes for t in call_blocks(mm)) > 0
    assert svc.describe()["weight_cache_nbytes"] == cached and svc.describe()["inference_nbytes"] == 0

    # A training tensor that is resident but unused, then a request that needs nearly everything:
    # the cached layers go first, for free, and the training tensor is swapped out only after them.
    mm.register_job(7)
    (kept,) = mm.acquire(7, [], [Slot("kept", Kind.ACTIVATION, (1024,))])
    mm.unpin([kept])
    (big,) = mm.acquire(7, [], [Slot("big", Kind.ACTIVATION, ((mm.budget_nbytes - cached) // 4,))])
    assert mm.jobs[INFERENCE_JOB].cache_evictions > 0
    assert mm.cache_nbytes() < cached
    assert mm.jobs[7].swap_outs == 0 and kept.residency is Residency.DEVICE
    assert all(t.source is not None for t in mm.tensors(INFERENCE_JOB))      # every layer is read again from its file
    mm.unpin([big])
    mm.release_job(7)
    third, _ = predict(svc, 1, spec, w, x, window=1)         # reloaded (the manager's host cache or the file)
    assert np.array_equal(first, third)
    mm.close()


def test_cancelling_a_call_releases_everything_it_held():
    spec = spec_of()
    w, x = weights_of(spec), features(spec, n=1000)
    svc = service()
    polls = []
    with pytest.raises(JobCancelled):
        predict(svc, 1, spec, w, x, window=3, batch_size=32, cancelled=lambda: polls.append(1) or len(polls) > 10)
    mm = svc.manager
    assert all(not t.pins and not t.wanted for t in mm.tensors())
    assert mm.jobs[INFERENCE_JOB].device_nbytes == mm.cache_nbytes()
    assert not svc.describe()["inference_calls"] and svc.store.get(1, "v1").users == 0
    mm.check()
    mm.close()


def test_bad_calls_are_refused_with_the_value_named():
    spec = spec_of()
    w, x = weights_of(spec), features(spec)
    svc = service(budget=256 * 1024)
    with pytest.raises(InvalidArgument, match="window must be an integer >= 1.*got 0"):
        predict(svc, 1, spec, w, x, window=0)
    with pytest.raises(InvalidArgument, match="batch_size must be from 1 to 65536, got 0"):
        predict(svc, 1, spec, w, x, window=1, batch_size=0)
    with pytest.raises(InvalidArgument, match="expects 20 per row"):
        predict(svc, 1, spec, w, x[:, :5], window=1)
    with pytest.raises(DeviceOutOfMemory, match="lower options.batch_size"):
        predict(svc, 1, spec, w, x, window=1, batch_size=65536)
    broken = dict(w, W2=w["W2"][:, :3])
    with pytest.raises(CorruptModel, match=r"W2 must be a float array of shape \(64, 128\)"):
        svc.store.add(2, "v1", "broken", spec, broken)
    assert os.listdir(svc.store.files.directory) == [file_name(1, "v1")]     # none for the refused model
    assert svc.store.get(1, "v1").users == 0
    assert svc.manager.jobs[INFERENCE_JOB].device_nbytes == svc.manager.cache_nbytes()
    svc.manager.close()


def test_a_call_on_a_replaced_model_finishes_on_the_old_version_which_is_then_forgotten():
    spec = spec_of()
    old_w, new_w, x = weights_of(spec, 0), weights_of(spec, 5), features(spec, n=400)
    svc = service()
    old_model = svc.store.add(10, "v1", "m", spec, old_w)
    steps = []

    def replace_midway():
        steps.append(1)
        if len(steps) == 5:        # the old call is between two layers: the model is replaced
            new_model = svc.store.add(11, "v1", "m", spec, new_w)
            assert old_model.retired and not new_model.retired
            out, _ = svc.predict(new_model, x, 2, 64)
            assert np.array_equal(out, predict(service(), 11, spec, new_w, x, window=2)[0])
        return False

    out, _ = svc.predict(old_model, x, 2, 64, cancelled=replace_midway)
    assert np.array_equal(out, predict(service(), 10, spec, old_w, x, window=2)[0])
    assert svc.store.get(10, "v1") is None and svc.store.get(11, "v1") is not None
    registered = svc.manager.tensors()
    assert all(t not in registered and t.residency is Residency.FREED for t in old_model.layers)
    # The old version deployed again (a rollback): it is served, and the other version, unused, is forgotten.
    back = svc.store.add(10, "v1", "m", spec, old_w)
    assert not back.retired and svc.store.get(11, "v1") is None
    svc.store.checkin(back)
    assert svc.store.get(10, "v1") is back
    svc.manager.close()


def test_concurrent_calls_and_a_training_job_share_a_small_budget_without_overlap():
    specs = [spec_of(hidden=[{"dense": 64 + 32 * i}] * (3 + i)) for i in range(4)]
    weights = [weights_of(s, seed=i) for i, s in enumerate(specs)]
    xs = [features(s, n=500, seed=i) for i, s in enumerate(specs)]
    expected = [predict(service(), i, s, w, x, window=1, batch_size=100)[0] for i, (s, w, x) in enumerate(zip(specs, weights, xs))]

    job = make_job(seed=3)
    one_model = max(sum(t.arena_nbytes for t in service().store.add(0, "v", "m", s, w).layers)
                    for s, w in zip(specs, weights))
    budget = round_up(job.min_working_set_nbytes + 3 * one_model // 2)
    mm = MemoryManager(make_device(TEST_DEVICE), budget)
    checks = {"acquires": 0}
    original = mm.acquire

    def checked_acquire(*args, **kwargs):
        created = original(*args, **kwargs)
        mm.check()                            # no two blocks share bytes, the counters add up
        checks["acquires"] += 1
        return created

    mm.acquire = checked_acquire
    ex = Executor(mm, cost=FAST)
    svc = InferenceService(mm)
    ex.start()
    try:
        ex.submit(job)
        results, errors = [None] * 8, []

        def call(k):
            i = k % 4
            try:
                results[k] = predict(svc, i, specs[i], weights[i], xs[i], window=1 + k // 4, batch_size=100)[0]
            except BaseException as exc:      # reported below
                errors.append(exc)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        wait_done(job, f"job {job.id}")
    finally:
        ex.stop()
    for k in range(8):
        assert np.array_equal(results[k], expected[k % 4]), k
    assert checks["acquires"] > 100
    assert mm.jobs[INFERENCE_JOB].cache_evictions > 0          # the budget was contended: the cache gave way
    assert mm.jobs[INFERENCE_JOB].device_nbytes == mm.cache_nbytes()


def test_an_acquire_waits_for_another_threads_pins_instead_of_failing():
    mm = MemoryManager(CpuDevice(), 8 * 1024)
    for job in (1, 2):
        mm.register_job(job)
    (held,) = mm.acquire(1, [], [Slot("a", Kind.ACTIVATION, (1536,))])      # 6 KiB pinned by this thread
    got = []
    other = threading.Thread(target=lambda: got.append(mm.acquire(2, [], [Slot("b", Kind.ACTIVATION, (1024,))],
                                                                  wait=True)))
    other.start()
    other.join(0.3)
    assert other.is_alive() and not got                                       # waiting, not failed
    mm.unpin([held])
    other.join(10)
    assert got and got[0][0].offset is not None
    assert mm.jobs[1].swap_outs == 1                                          # made room once unpinned
    mm.close()


def test_calls_whose_models_do_not_fit_together_start_one_after_the_other():
    spec = spec_of(hidden=[{"dense": 128}] * 4)
    w0, w1, x = weights_of(spec, 0), weights_of(spec, 1), features(spec, n=256)
    model_nbytes = sum(round_up(sum(np.prod(s) for s in node.weights.values()) * 4) for node in spec.network.layered)
    svc = service(budget=round_up(model_nbytes * 3 // 2))
    first, second = svc.store.add(1, "v", "a", spec, w0), svc.store.add(2, "v", "b", spec, w1)
    paused, resume, results = threading.Event(), threading.Event(), {}

    def pause_once():
        if not paused.is_set():
            paused.set()
            resume.wait(10)
        return False

    a = threading.Thread(target=lambda: results.update(a=svc.predict(first, x, 1, 64, cancelled=pause_once)[0]))
    a.start()
    assert paused.wait(10)
    b = threading.Thread(target=lambda: results.update(b=svc.predict(second, x, 1, 64)[0]))
    b.start()
    assert wait_until(lambda: svc.admission()[1])          # b waits for memory while a runs
    assert svc.admission() == (1, 1) and svc.describe()["inference_calls"] == 2
    resume.set()
    a.join(10)
    b.join(10)
    assert np.array_equal(results["b"], predict(service(), 2, spec, w1, x, window=1, batch_size=64)[0])
    assert np.array_equal(results["a"], predict(service(), 1, spec, w0, x, window=1, batch_size=64)[0])
    assert svc.admission() == (0, 0)
    svc.manager.close()


def test_a_waiting_acquire_drains_other_threads_pins_that_keep_coming_back(monkeypatch):
    monkeypatch.setattr("tensile_db.memory.pins.PIN_WAIT_S", 5.0)
    mm = MemoryManager(CpuDevice(), 64 * 1024)
    for job in (1, 2):
        mm.register_job(job)
    stop, ops = threading.Event(), []

    def busy():            # pins 40 KiB, computes, unpins, and at once pins again
        (t,) = mm.acquire(1, [], [Slot("a", Kind.ACTIVATION, (10 * 1024,))], wait=True)
        mm.unpin([t])
        while not stop.is_set():
            mm.acquire(1, [t], [], wait=True)
            time.sleep(0.002)
            mm.unpin([t])
            ops.append(1)

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        assert wait_until(lambda: len(ops) > 10)
        (big,) = mm.acquire(2, [], [Slot("b", Kind.ACTIVATION, (12 * 1024,))], wait=True)   # needs a's bytes
        assert big.offset is not None and mm.jobs[1].swap_outs >= 1
        mm.unpin([big])
    finally:
        stop.set()
        worker.join(10)
    mm.close()


# fails at the third dense layer; at the residual's add of the second batch (two branches alive)
@pytest.mark.parametrize("kind, fail_at", [("mlp", 3), ("cnn", 9 + 4)])
def test_a_failing_node_leaves_nothing_behind(monkeypatch, kind, fail_at):
    spec = spec_of() if kind == "mlp" else cnn_spec()
    w, x = weights_of(spec), features(spec)
    svc = service()
    calls = []
    real = layered.evaluate

    def failing(node, *args):
        calls.append(node)
        if len(calls) == fail_at:
            raise FloatingPointError("a kernel failed")
        real(node, *args)

    monkeypatch.setattr(layered, "evaluate", failing)
    with pytest.raises(FloatingPointError):
        predict(svc, 1, spec, w, x, window=2)
    assert calls[-1].op == ("dense" if kind == "mlp" else "add")
    mm = svc.manager
    assert all(t.readonly for t in mm.tensors())                             # no activation or workspace left
    assert all(not t.pins and not t.wanted for t in mm.tensors())
    mm.check()
    assert mm.jobs[INFERENCE_JOB].device_nbytes == mm.cache_nbytes()
    mm.close()


def test_eviction_takes_layers_no_window_holds_first_and_a_prefetch_never_takes_a_held_one():
    spec = spec_of(hidden=[{"dense": 64}] * 3)
    svc = service(budget=1 << 20)
    mm = svc.manager
    model = svc.store.add(1, "v", "m", spec, weights_of(spec))
    held, loose, other = model.layers[0], model.layers[1], model.layers[2]
    for t in (held, loose):
        mm.cache.prefetch(t)
    mm.cache.unwant(loose)                                      # cached, in no window
    for t in (held, loose):
        mm.to_host(t)                                     # let the loads land
    assert mm.eviction.rank(loose) > mm.eviction.rank(held)
    mm.limit_nbytes = mm.in_use_nbytes                    # no room left for the third layer
    assert mm.cache.prefetch(other)                             # loaded by evicting the loose layer only
    assert loose.offset is None and held.offset is not None
    mm.cache.unwant(held, keep=False)
    assert held.offset is not None or not held.wanted     # freed unless another window held it
    mm.cache.prefetch(held)
    mm.cache.unwant(held, keep=False)
    mm.cache.unwant(other, keep=False)
    assert held.offset is None and other.offset is None
    svc.store.checkin(model)
    mm.close()
