"""What the coordinator's connections call for inference: the model store, the running calls and
their figures for ``tensile.memory``.

Each ``predict`` request runs on its own connection thread (:func:`tensile_db.inference.layered.run`),
concurrently with the executor's training ops and with the other calls; the memory manager's
lock serialises their allocations and its eviction order gives the weight cache up first.

A layer whose file region fails its checksum when it is read ends the call with CorruptModel;
the model is discarded from the store (its file deleted), so that the coordinator can ask the
backend for the weights again and the backend can repeat the call (nothing was returned yet).

Admission: calls start in arrival order while the *footprints* of the running calls fit the
budget together — a call's footprint is what it needs to run without reloading a layer: all its
model's layers when it caches them (the default), else its window's layers, plus the activations
of its largest step (:func:`layered.activations_nbytes`: one node's live activations, output and
workspace on one batch). A call that does not fit waits (its backend has already sent its rows),
unless no call runs, so one call always does, streaming its layers through the window whatever
the budget. Without this, calls on more models than the budget holds take turns layer by layer and
every batch reloads every layer: on ``cpu``, 8 such calls took twice as long as the same calls
one after another. Training does not wait for inference: its allocations evict the cache first.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from ..errors import CorruptModel, JobCancelled
from ..memory.manager import MemoryManager
from ..settings import DEFAULT_PREDICT_BATCH_ROWS
from . import INFERENCE_JOB, layered
from .store import FILES_LIMIT_NBYTES, ModelStore, ServedModel


class InferenceService:
    """Demand-layered inference on ``manager``'s device; one per device of a coordinator. The served models'
    files go in ``models_dir`` (a 0700 directory; None: a private temporary one), up to
    ``files_limit_nbytes`` bytes of them (:class:`~.store.ModelStore`)."""

    def __init__(self, manager: MemoryManager, models_dir: str | None = None,
                 files_limit_nbytes: int = FILES_LIMIT_NBYTES):
        self.manager = manager
        manager.register_job(INFERENCE_JOB)
        self.store = ModelStore(manager, models_dir, files_limit_nbytes)
        self.cache_hits = 0            # layer uses served by a resident copy, cumulative; guarded by _lock
        self._calls: set[int] = set()             # calls running or waiting to start; guarded by _lock
        self._ids = itertools.count(1)            # guarded by _lock
        self._lock = threading.Lock()
        self._admission = threading.Condition(self._lock)
        self._waiting: list[int] = []              # calls waiting to start, in arrival order; guarded by _lock
        self._footprints: dict[int, int] = {}      # running call id -> its footprint, bytes; guarded by _lock

    def predict(self, model: ServedModel, x: np.ndarray, window: int, batch_size: int, cache: bool = True,
                cancelled=None, on_accept=None) -> tuple[np.ndarray, layered.CallStats]:
        """Run one call (see :func:`layered.run`) on a model checked out of :attr:`store`, and
        check it back in. ``on_accept(call_id, window, batches)`` runs once the call is admitted.
        ``batch_size`` None: the most rows up to :data:`DEFAULT_PREDICT_BATCH_ROWS` whose steps fit
        the budget (:func:`layered.fitting_batch`). Raises DeviceOutOfMemory at once if one step
        of the call cannot fit the budget, and CorruptModel when a layer read from the model's
        file is corrupt: the model is then discarded from the store (``model.corrupt`` says so),
        so the caller may send the weights again and repeat the call."""
        try:
            if batch_size is None:
                batch_size = layered.fitting_batch(model, len(x), self.manager.budget_nbytes,
                                                   DEFAULT_PREDICT_BATCH_ROWS)
            layered.check(model, x, window, batch_size)
            effective_window, rows, batches = layered.call_shape(model, len(x), window, batch_size)
            layered.check_fits(model, rows, self.manager.budget_nbytes, self.manager.in_use_nbytes)
            with self._lock:
                call_id = next(self._ids)
                self._calls.add(call_id)
            try:
                if on_accept is not None:
                    on_accept(call_id, effective_window, batches)
                self._admit(call_id, self._footprint(model, rows, effective_window, cache), cancelled)
                try:
                    outputs, stats = layered.run(self.manager, model, x, window, batch_size, cache, cancelled)
                except CorruptModel:
                    if model.corrupt:
                        self.store.discard(model)
                    raise
                with self._lock:
                    self.cache_hits += stats.cache_hits
                return outputs, stats
            finally:
                with self._admission:
                    self._calls.remove(call_id)
                    self._footprints.pop(call_id, None)
                    self._admission.notify_all()
        finally:
            self.store.checkin(model)

    @staticmethod
    def _footprint(model: ServedModel, rows: int, window: int, cache: bool) -> int:
        """Bytes a call of ``rows`` rows per batch needs to run without reloading a layer (see
        the module docstring)."""
        layers = sorted((t.arena_nbytes for t in model.layers), reverse=True)
        kept = layers if cache else layers[:min(window + 1, len(layers))]
        return sum(kept) + max(layered.activations_nbytes(model, rows))

    def _admit(self, call_id: int, footprint: int, cancelled) -> None:
        """Wait until the call may start: it is the first waiting and fits beside the running
        calls, or none runs. Polls ``cancelled()`` (outside the lock) every 0.05 s meanwhile and
        raises JobCancelled when it says so."""
        with self._admission:
            self._waiting.append(call_id)
        try:
            while True:
                with self._admission:
                    if self._waiting[0] == call_id and (
                            not self._footprints or
                            sum(self._footprints.values()) + footprint <= self.manager.budget_nbytes):
                        self._footprints[call_id] = footprint
                        return
                    self._admission.wait(0.05)
                if cancelled is not None and cancelled():
                    raise JobCancelled("cancelled by the caller while waiting for device memory")
        finally:
            with self._admission:
                self._waiting.remove(call_id)
                self._admission.notify_all()

    def admission(self) -> tuple[int, int]:
        """(calls admitted and running, calls waiting to be admitted), counts."""
        with self._lock:
            return len(self._footprints), len(self._waiting)

    def calls(self) -> int:
        """Predict calls running or waiting to start."""
        with self._lock:
            return len(self._calls)

    def describe(self) -> dict:
        """Figures for ``tensile.memory``: calls running or waiting to start, the device bytes
        they hold, the weight cache (resident layers no call is using), and the cumulative loads,
        hits and evictions."""
        counters = self.manager.jobs[INFERENCE_JOB]
        cached = self.manager.cache_nbytes()
        with self._lock:
            calls, hits = len(self._calls), self.cache_hits
        return {"inference_calls": calls, "inference_nbytes": counters.device_nbytes - cached,
                "weight_cache_nbytes": cached, "weight_loads": counters.weight_loads,
                "weight_cache_hits": hits, "weight_cache_evictions": counters.cache_evictions,
                **self.store.describe()}
