"""Training requests on the coordinator: one model (``train``) or a hyperparameter search whose
trials train at the same time (``search``), and the metrics each trained model is stored with.

``train``: header ``model_name``, ``role``, ``backend_pid``, ``architecture``, ``options``,
``task``, ``n_outputs``, optionally ``scale`` (each input column's scaling,
:func:`~tensile_db.runtime.preprocess.fit_scaling`) and ``classes`` (the class labels, for the
per-class metrics); arrays ``x`` (N, F) float32 and ``y`` (N,) int32 class indices or (N, 1)
float32 targets, and optionally the held-out ``x_test`` / ``y_test`` of the same kinds. Where
the coordinator's ``pong`` says ``"rows": true``, a backend may send instead every row's inputs
as ``x`` with ``rows`` (N,) and ``test_rows`` (M,) int32 or int64, the indices in ``x`` of the
training and of the held-out rows (the held-out ones gathered here): the rows as the backend's
scan wrote them, sent without a copy (Note [Shared arrays] in :mod:`.protocol`).
Answered by ``accepted``, a ``progress`` message per epoch (with the held-out ``val_loss``),
then ``result`` with the metrics and the weights as arrays, or ``error``.

Each job runs on the device :func:`.placement.choose` picks when it is submitted (Note
[Placement]); ``accepted`` names it (``device``) and its budget.

``search``: the same, with ``trials`` (each ``{"architecture", "options", "params"}``, built by
the backend from :mod:`tensile_db.runtime.search`), ``parallel`` and ``halving``. At most
``parallel`` trials run at once as jobs of the executors, sharing the devices' budgets with every
other job; the others wait here. Each is placed as it is submitted, so trials spread over the
devices; ``accepted`` lists the devices and their budgets (``devices``). Answered by ``accepted`` (the trials' job ids as they are
submitted arrive in ``progress``), ``progress`` per epoch of any trial (with ``trial``), a
``trial`` message as each trial ends (its metrics and weights, or its error), then ``result``.
A trial whose held-out loss at a rung is in the worse half stops there when ``halving``
(:class:`~tensile_db.runtime.search.Halving`). A ``cancel`` message or a closed connection
cancels every trial, running or waiting, and frees their device memory.

Every trial is checked against the limits before any is submitted, so a search either starts
whole or not at all.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..errors import JobCancelled, ProtocolError, TensileError
from ..runtime import metrics as heldout
from ..runtime import model as models
from ..runtime import search as searching
from ..runtime.search import MAX_TRIALS, Halving
from . import placement, protocol
from .jobs import JobInfo, TrainingJob, chunk_rows

log = logging.getLogger(__name__)

#: How often a training connection looks for a cancel while waiting for progress, seconds.
POLL_S = 0.05


@dataclass
class _Data:
    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    scale: list[str] | None
    classes: list | None
    rows: np.ndarray | None = None       # the training rows' indices in x, when it holds others too


def _data(header: dict, arrays: dict) -> _Data:
    try:
        x, y = arrays["x"], arrays["y"]
    except KeyError as exc:
        raise ProtocolError(f"train request without {exc}") from None
    if x.ndim != 2:
        raise ProtocolError(f"train request with features of shape {x.shape}")
    x_test, y_test = arrays.get("x_test"), arrays.get("y_test")
    rows, test_rows = (_indices(arrays, name, len(x)) for name in ("rows", "test_rows"))
    if test_rows is not None:
        if x_test is not None or rows is None:
            raise ProtocolError("train request with held-out rows' indices besides held-out rows, or without the "
                                "training rows' indices")
        held = np.zeros(len(x), bool)
        held[test_rows] = True
        if held[rows].any():
            raise ProtocolError("train request whose held-out rows are training rows too")
        x_test = np.take(x, test_rows, axis=0)
    if (x_test is None) != (y_test is None) or (x_test is not None and (x_test.ndim != 2 or x_test.shape[1] != x.shape[1])):
        raise ProtocolError("train request with held-out rows that do not match its training rows")
    scale = header.get("scale")
    if scale is not None and (not isinstance(scale, list) or len(scale) != x.shape[1]):
        raise ProtocolError(f"train request with {len(scale) if isinstance(scale, list) else scale!r} scale modes "
                            f"for {x.shape[1]} input columns")
    classes = header.get("classes")
    return _Data(x, y, x_test, y_test, scale, classes if isinstance(classes, list) else None, rows)


def _indices(arrays: dict, name: str, n: int) -> np.ndarray | None:
    """``arrays[name]``, row indices into n rows, or None; raises ProtocolError for anything else."""
    rows = arrays.get(name)
    if rows is not None and (rows.ndim != 1 or rows.dtype.kind not in "iu" or len(rows) > n
                             or (len(rows) and (rows.min() < 0 or rows.max() >= n))):
        raise ProtocolError(f"train request whose {name} ({rows.dtype}, shape {rows.shape}) are not indices of "
                            f"its {n:,} rows")
    return rows


class TrainingService:
    """Serves ``train`` and ``search`` requests with ``executors`` (one per device, a list of
    :class:`~.executor.Executor`) under ``limits``; ``policy`` is their scheduler policy, which
    every model's metrics carry with its device and that device's budget."""

    def __init__(self, executors: list, limits: models.Limits, policy: str):
        self.executors = executors
        self.limits = limits
        self.policy = policy
        self._by_name = {e.name: e for e in executors}
        self._placing = threading.Lock()       # a choice and its submission, one job at a time

    def describe(self, job: TrainingJob) -> dict:
        """The figures a model's metrics carry about where it was trained: device, budget, policy."""
        return {"device": job.device, "budget_nbytes": self._by_name[job.device].manager.budget_nbytes,
                "policy": self.policy}

    def check_fits(self, job: TrainingJob) -> None:
        """Raise DeviceOutOfMemory when no device's budget holds the job's smallest working set."""
        max(self.executors, key=lambda e: e.manager.budget_nbytes).check_fits(job)

    def submit(self, job: TrainingJob):
        """Queue ``job`` on the device placement chooses (Note [Placement]) and return that
        device's executor. Raises DeviceOutOfMemory when no device's budget holds the job's
        smallest working set."""
        with self._placing:
            device = self.executors[0].manager.device          # one kind: one estimate for all
            chosen = placement.choose([placement.load_of(e) for e in self.executors], job.vanilla_peak_nbytes,
                                      job.min_working_set_nbytes, placement.remaining_s(job, device))
            if chosen is None:
                self.check_fits(job)                           # raises, naming the largest budget
            executor = self.executors[chosen]
            job.device = executor.name
            executor.submit(job)
        log.info("job %d (%r) placed on %s", job.id, job.info.model_name, executor.name)
        return executor

    def cancel(self, job: TrainingJob) -> None:
        """Cancel ``job`` on its device, or before it was submitted."""
        if job.device is None:
            job.cancel_requested.set()
        else:
            self._by_name[job.device].cancel(job)

    def _job(self, header: dict, data: _Data, architecture, options, name: str,
             data_of: TrainingJob | None = None) -> TrainingJob:
        """A job for one model, checked against the limits. Raises InvalidArgument or ProtocolError."""
        try:
            spec = models.ModelSpec.parse(architecture, data.x.shape[1], header["n_outputs"], header["task"])
            info = JobInfo(int(header.get("backend_pid", 0)), str(header.get("role", "")), name)
        except KeyError as exc:
            raise ProtocolError(f"train request without {exc}") from None
        opts = models.parse_options(options)
        self.limits.check(spec, name)
        if data_of is not None and opts.standardize != data_of.options.standardize:
            data_of = None
        job = TrainingJob(info, spec, opts, data.x, data.y, data.x_test, data.y_test, data.scale, data_of, data.rows)
        self.limits.check_job(job.vanilla_peak_nbytes, job.batch, name)
        return job

    def train(self, conn, header: dict, arrays: dict) -> None:
        data = _data(header, arrays)
        job = self._job(header, data, header.get("architecture"), header.get("options"),
                        str(header.get("model_name", "")))
        executor = self.submit(job)
        try:
            protocol.send(conn, {"type": "accepted", "job_id": job.id, "vanilla_peak_nbytes": job.vanilla_peak_nbytes,
                                 "min_working_set_nbytes": job.min_working_set_nbytes, "device": executor.name,
                                 "budget_nbytes": executor.manager.budget_nbytes})
            self._relay(conn, {job.id: job})
        except BaseException:
            executor.cancel(job)                 # the backend has gone or broke the protocol: free the job
            job.discard_result()                 # if it had finished already
            raise
        if job.error is not None:
            raise job.error if isinstance(job.error, TensileError) else TensileError(f"training failed: {job.error!r}")
        try:
            protocol.send(conn, {"type": "result", "metrics": self.metrics(job, data)}, job.result)
        finally:
            job.discard_result()

    def search(self, conn, header: dict, arrays: dict) -> None:
        data = _data(header, arrays)
        trials, parallel = header.get("trials"), header.get("parallel")
        if not isinstance(trials, list) or not 1 <= len(trials) <= MAX_TRIALS or not isinstance(parallel, int) \
                or parallel < 1:
            raise ProtocolError("search request without 1 to 64 trials and a parallel count")
        name = str(header.get("model_name", ""))
        jobs: list[TrainingJob] = []
        for i, t in enumerate(trials):       # the trials share one scaled copy of the rows
            jobs.append(self._job(header, data, t.get("architecture"), t.get("options"), f"{name} trial {i + 1}",
                                  jobs[0] if jobs else None))
        searching.check_weights_nbytes(sum(searching.weights_nbytes(j.spec) for j in jobs), len(jobs), self.limits)
        for job in jobs:                           # admission, before any starts: each must fit a budget alone
            self.check_fits(job)
        if header.get("halving"):              # decided at each epoch's end, on the executor's one thread
            halvings = {}                      # trials of one epoch count are compared at its rungs
            for job in jobs:
                job.keep_going = halvings.setdefault(job.options.epochs, Halving(job.options.epochs)).keeps
        trial_of = {j.id: i for i, j in enumerate(jobs)}
        protocol.send(conn, {"type": "accepted", "job_ids": [j.id for j in jobs],
                             "vanilla_peak_nbytes": [j.vanilla_peak_nbytes for j in jobs],
                             "devices": {e.name: e.manager.budget_nbytes for e in self.executors}})
        waiting, running = list(jobs), {}
        started = time.monotonic()
        try:
            while waiting or running:
                while waiting and len(running) < parallel:
                    job = waiting.pop(0)
                    self.submit(job)
                    running[job.id] = job
                for job in self._relay(conn, running, trial_of):
                    del running[job.id]
                    self._send_trial(conn, job, trial_of[job.id], data)
        except BaseException:
            for job in jobs:
                self.cancel(job)                   # running or still waiting here: none is left
                job.discard_result()               # a finished trial's, not sent
            raise
        protocol.send(conn, {"type": "result", "wall_s": time.monotonic() - started, "trials": len(jobs)})

    def _send_trial(self, conn, job: TrainingJob, trial: int, data: _Data) -> None:
        if job.error is not None:
            protocol.send(conn, {"type": "trial", "trial": trial, "error": str(job.error),
                                 "error_class": type(job.error).__name__})
            return
        try:
            protocol.send(conn, {"type": "trial", "trial": trial, "metrics": self.metrics(job, data)}, job.result)
        finally:
            job.discard_result()                   # sent: the search holds no trained weights

    def _relay(self, conn, jobs: dict[int, TrainingJob], trial_of: dict[int, int] | None = None) -> list[TrainingJob]:
        """Forward the jobs' progress until one or more end; return those. Acts on a ``cancel``
        from the backend (raises JobCancelled for a search, cancels a single job)."""
        while True:
            ended = []
            idle = True
            for job in list(jobs.values()):
                try:
                    kind, payload = job.events.get_nowait()
                except queue.Empty:
                    continue
                idle = False
                if kind != "progress":
                    ended.append(job)
                    continue
                message = {"type": "progress", **payload}
                if trial_of is not None:
                    message.update(trial=trial_of[job.id], job_id=job.id)
                protocol.send(conn, message)
            if ended:
                return ended
            if idle:
                if conn.poll(POLL_S):
                    header, _ = protocol.recv(conn)
                    if header["type"] == "cancel":
                        if trial_of is not None:
                            raise JobCancelled("the search was cancelled by its backend")
                        for job in jobs.values():
                            self.cancel(job)

    def metrics(self, job: TrainingJob, data: _Data) -> dict:
        """The metrics a trained model is stored with: held-out metrics when there are held-out
        rows (:mod:`tensile_db.runtime.metrics`; ``score`` and ``score_name``), the fit on the
        training rows, the per-epoch ``history``, and the job's memory and scheduling figures."""
        fit = _fit(job, data.y)
        test = {}
        if data.x_test is not None and len(data.x_test):
            out = models.forward(job.spec, job.result, data.x_test, chunk_rows(job.spec, job.result))
            if job.spec.task == "classification":
                classes = data.classes or list(range(job.spec.n_outputs))
                test = heldout.classification_metrics(np.asarray(data.y_test).reshape(-1), out, classes)
            else:
                test = heldout.regression_metrics(np.asarray(data.y_test, np.float64).reshape(-1),
                                                  out.reshape(-1).astype(np.float64))
            test["test_samples"] = test.pop("n", len(data.x_test))
        m = job.memory
        return dict(test, **fit, train_loss=job.loss, epochs=job.epoch, samples=len(data.y), batch_size=job.batch,
                    history=job.history, best_epoch=job.best_epoch, stopped=job.stopped,
                    train_time_s=job.finished_at - job.started_at, queued_s=job.started_at - job.created_at,
                    **self.describe(job), peak_device_nbytes=m.peak_nbytes, vanilla_peak_nbytes=job.vanilla_peak_nbytes,
                    min_working_set_nbytes=job.min_working_set_nbytes,
                    swapped_out_nbytes=m.swapped_out_nbytes, swapped_in_nbytes=m.swapped_in_nbytes,
                    swap_outs=m.swap_outs, swap_ins=m.swap_ins, spilled_nbytes=m.spilled_nbytes,
                    disk_read_nbytes=m.disk_read_nbytes,
                    planned_swap_ins=m.planned_swap_ins, passive_swap_ins=m.passive_swap_ins,
                    recomputes=m.recomputes, n_parameters=job.spec.n_parameters())


#: Training rows the fit is measured on at most: beyond it, this many evenly spaced ones (an
#: accuracy's standard error at most 0.002); the forward pass over 800,000 rows of the ingest
#: benchmark's model took 0.07 to 0.14 s after training.
FIT_ROWS = 65536


def _fit(job: TrainingJob, y: np.ndarray) -> dict:
    """Accuracy (classification) or RMSE (regression) on the training rows ``y``, the labels as
    sent, or on at most :data:`FIT_ROWS` of them evenly spaced where there are more: the network
    runs on the job's rows, each chunk scaled with the result's scaling as it goes (the outputs
    :func:`.models.forward` computes from the rows as sent). A row's class is its largest output,
    before the softmax, which keeps the order; where two outputs are within rounding of each
    other, the softmax's largest (what predict returns) may be the other one."""
    step = -(-job.n_rows // FIT_ROWS)
    x, y = job.training_rows(step), y[::step]
    h = job.spec.network.forward(job.result, x, chunk_rows(job.spec, job.result),
                                 functools.partial(models.standardize, job.result))
    if job.spec.task == "classification":
        return {"train_accuracy": float((h.argmax(axis=1) == y.reshape(-1)).mean())}
    out = models.finish(job.spec, job.result, h)
    error = out.reshape(-1).astype(np.float64) - y.reshape(-1).astype(np.float64)   # float64: labels near float32's limit
    return {"train_rmse": float(np.sqrt(np.mean(error ** 2)))}
