"""The device weight cache: the rules for read-only tensors, owned by the inference package.

A *read-only* tensor (:meth:`MemoryManager.adopt` with ``readonly=True``: a dense layer of a
served model, :mod:`tensile_db.inference.store`) keeps its host copy for good, so its device copy
is a cache: loading one keeps the host copy, and evicting one frees its block without a copy. A
running call holds the layers of its *prefetch window* (:mod:`tensile_db.inference.layered`):
:meth:`WeightCache.prefetch` starts loading a layer as it enters the window and
:meth:`WeightCache.unwant` lets it go; a layer no window holds stays cached until its bytes are
needed. The eviction policy (:mod:`tensile_db.memory.eviction`) ranks read-only tensors by
:meth:`WeightCache.rank` (Note [Eviction order]).

This module is the inference package's, placed in the memory layer so the manager and its
eviction policy reach it without importing upward; nothing in :mod:`tensile_db.inference` is
imported here; being the manager's own policy, it takes the manager's lock. It keeps no state of its own: ``Tensor.wanted`` (windows holding a tensor) is its
counter on each tensor, guarded by the manager's lock like every other tensor field.
"""

from __future__ import annotations

from .tensors import Residency, Tensor


class WeightCache:
    """The weight cache of ``manager`` (see the module docstring)."""

    def __init__(self, manager):
        self.mm = manager

    @staticmethod
    def rank(t: Tensor) -> tuple:
        """Eviction rank of the read-only tensor ``t``, higher first: in no window, least recently
        used first, above in some window, most recently used first (Note [Eviction order])."""
        return (1, t.last_used, 0) if t.wanted else (2, -t.last_used, 0)

    def evictable(self, t: Tensor, unwanted_only: bool = False) -> bool:
        """Whether ``t`` is a resident read-only tensor that may be given up now (with
        ``unwanted_only``: that no window holds either). The caller holds the manager's lock."""
        return (t.readonly and t.residency is Residency.DEVICE and not self.mm.held(t)
                and not (unwanted_only and t.wanted))

    def prefetch(self, t: Tensor) -> bool:
        """Hold the read-only tensor ``t`` in a call's prefetch window and start loading it if it
        is not on the device (on the swap engine: the copy thread on ``cpu``, the copy stream on
        ``cuda``). Room is made by evicting only read-only tensors no window holds; if that is not
        enough the load is left to the acquire that needs it. Returns whether a load was started.
        Undo with :meth:`unwant`. Raises AssertionError if ``t`` is not read-only."""
        with self.mm._lock:
            assert t.readonly, f"prefetch of {t.slot}, which is not read-only"
            t.wanted += 1
            return self.mm.start_load(t, clean_only=True)

    def unwant(self, t: Tensor, keep: bool = True) -> None:
        """A call's prefetch window has let go of the read-only tensor ``t``. With ``keep`` its
        device copy stays as cache (evicted first when room is needed); without, it is freed
        unless another call holds it. Raises AssertionError if no window holds ``t``."""
        with self.mm._lock:
            assert t.wanted > 0, f"unwant of {t.slot}, which no window holds"
            t.wanted -= 1
            if not keep and not t.wanted and not t.pins and t.offset is not None:
                self.mm.drop_device_copy(t)

    def nbytes(self) -> int:
        """Arena bytes of the weight cache: read-only tensors with a block (resident or still
        loading) that no op pins and no prefetch window holds, bytes."""
        with self.mm._lock:
            return sum(t.arena_nbytes for t in self.mm.tensors()
                       if t.readonly and t.offset is not None and not t.pins and not t.wanted)
