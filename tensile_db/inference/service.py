"""What the coordinator's connections call for inference: the model store, the running calls and
their figures for ``tensile.memory``.

Each ``predict`` request runs on its own connection thread (:func:`tensile_db.inference.layered.run`),
concurrently with the executor's training ops and with the other calls; the memory manager's
lock serialises their allocations and its eviction order gives the weight cache up first.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from ..errors import DeviceOutOfMemory
from ..memory.manager import MemoryManager
from . import INFERENCE_JOB, layered
from .store import HOST_LIMIT_NBYTES, ModelStore, ServedModel


class InferenceService:
    """Demand-layered inference on ``manager``'s device; one per coordinator."""

    def __init__(self, manager: MemoryManager, host_limit_nbytes: int = HOST_LIMIT_NBYTES):
        self.manager = manager
        manager.register_job(INFERENCE_JOB)
        self.store = ModelStore(manager, host_limit_nbytes)
        self.calls_served = 0
        self.cache_hits = 0            # layer uses served by a resident copy, cumulative
        self._running: dict[int, dict] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def predict(self, model: ServedModel, x: np.ndarray, window: int, batch_size: int, cache: bool = True,
                cancelled=None, on_accept=None) -> tuple[np.ndarray, layered.CallStats]:
        """Run one call (see :func:`layered.run`) on a model checked out of :attr:`store`, and
        check it back in. ``on_accept(call_id, window, batches)`` runs once the call is admitted.
        Raises DeviceOutOfMemory at once if one step of the call cannot fit the budget."""
        try:
            layered.check(model, x, window, batch_size)
            need = layered.working_set_nbytes(model, min(batch_size, max(len(x), 1)))
            if need > self.manager.budget_nbytes:
                raise DeviceOutOfMemory(need, self.manager.in_use_nbytes, self.manager.budget_nbytes,
                                        f"the largest layer of model {model.name!r} with a batch of {batch_size} "
                                        f"rows (lower options.batch_size)")
            with self._lock:
                call_id = next(self._ids)
                self._running[call_id] = {"model_name": model.name, "rows": len(x)}
            try:
                if on_accept is not None:
                    n_layers = len(model.layers)
                    on_accept(call_id, min(window, n_layers), -(-len(x) // max(min(batch_size, len(x)), 1)))
                outputs, stats = layered.run(self.manager, model, x, window, batch_size, cache, cancelled)
                with self._lock:
                    self.cache_hits += stats.cache_hits
                return outputs, stats
            finally:
                with self._lock:
                    del self._running[call_id]
                    self.calls_served += 1
        finally:
            self.store.checkin(model)

    def describe(self) -> dict:
        """Figures for ``tensile.memory``: running calls, the device bytes they hold, the weight
        cache (resident layers no call is using), and the cumulative loads, hits and evictions."""
        counters = self.manager.snapshot()["jobs"][INFERENCE_JOB]
        cached = self.manager.cache_nbytes()
        with self._lock:
            running, hits = len(self._running), self.cache_hits
        return {"inference_calls": running, "inference_nbytes": counters["device_nbytes"] - cached,
                "weight_cache_nbytes": cached, "weight_loads": counters["weight_loads"],
                "weight_cache_hits": hits, "weight_cache_evictions": counters["cache_evictions"],
                **self.store.describe()}
