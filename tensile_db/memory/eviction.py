"""The eviction policy: which tensor leaves the arena when a block does not fit, and when to compact.

Correctness never depends on a plan. When an allocation does not fit, :meth:`Eviction.make_room`
evicts unpinned resident tensors in the order of Note [Eviction order] until the block fits: a
swap-out, or a drop where the scheduler's ``droppable`` says the tensor's job recomputes it.
When the free bytes would suffice but no free block does, it compacts the arena instead (after
letting the copies in flight land, so that their blocks can move too). If the free space is too
fragmented for an op's working set even then, :meth:`Eviction.pack` evicts everything else and
places the working set from offset 0, largest first.

The policy owns no state. It talks to the manager's core
(:class:`~tensile_db.memory.manager.MemoryManager`) through a narrow interface, always with the
manager's lock held: ``tensors()``, ``held(t)``, ``evict(t)``, ``release(t)``, ``land_copies()``,
``compact(movable)``, ``make_resident(t)``, the ``allocator`` and its ``limit_nbytes`` and
``budget_nbytes``, the planned pool's state, ``next_use`` (the scheduler's eviction scores),
``droppable`` (the scheduler's choice of a drop over a swap-out) and the weight cache's ranking
(:mod:`tensile_db.memory.cache`).

Note [Eviction order]
---------------------
Rank, highest evicted first: (1) read-only tensors no call holds in its prefetch window, least
recently used first: a free, and a later load if they are used again; (2) read-only tensors in
some call's window: a free and a certain reload, cheaper than any copy out; most recently used
first, since a call streams its layers in order and the one it used last is the one it needs
last; (3) the other tensors, by the scheduler's ``next_use``, highest first, larger first among
equals: under ``reactive`` and the baselines the farthest next use (Belady's rule across jobs),
a copy out and a copy back; under ``dtr`` and ``tensile`` (Note [The tensile fallback] in
:mod:`tensile_db.scheduler.engine`) the least h = cost / (bytes x staleness) (Kirisame et al.,
ICLR 2021; :mod:`tensile_db.scheduler.dtr`), where a tensor its job can recompute exactly, and
whose writers have all run, is dropped (cost: its recompute) and any other is copied out (cost:
the copy out and back). So a training job that needs memory takes the device weight cache first.
A prefetch evicts only (1): it never pushes out a layer a window holds. The ranks of (1) and (2)
are the weight cache's (:meth:`tensile_db.memory.cache.WeightCache.rank`).
"""

from __future__ import annotations

from ..errors import DeviceOutOfMemory
from ..runtime.units import round_up
from .planned import State
from .tensors import Residency, Tensor


class Fragmented(Exception):
    """No free block fits and nothing unpinned is left to evict."""


class Eviction:
    """The eviction and compaction policy of ``manager`` (see the module docstring)."""

    def __init__(self, manager):
        self.mm = manager

    def rank(self, t: Tensor) -> tuple:
        """Higher is evicted first (Note [Eviction order])."""
        if t.readonly:
            return self.mm.cache.rank(t)
        return (0, self.mm.next_use(t), t.arena_nbytes)

    def make_room(self, nbytes: int, clean_only: bool = False) -> int:
        """An arena offset for ``nbytes`` (rounded up to the unit), keeping the bytes in use within
        ``limit_nbytes`` while anything can be evicted (and within the budget always). When no
        free block fits: if the free bytes suffice, compact the arena (letting the copies in
        flight land if that is not enough); else complete the swap-outs in flight ahead of their
        planned release; else evict (Note [Eviction order]). With ``clean_only`` only read-only
        tensors that no prefetch window holds are evicted and nothing waits for a copy.

        Raises:
            Fragmented: no block can be made (with ``clean_only``: by evicting such tensors).
        """
        mm, size = self.mm, round_up(nbytes)
        allocator = mm.allocator
        if allocator.in_use_nbytes + size <= mm.limit_nbytes:    # the common case
            offset = allocator.allocate(size)
            if offset is not None:
                return offset
        if clean_only or mm.pool.state is State.SERVING:
            # the region was admitted against the budget, not the limit; the cache gives way first
            ceiling = mm.limit_nbytes if clean_only else mm.budget_nbytes
            offset = self._evict_clean(size, ceiling, unwanted_only=clean_only)
            if offset is not None:
                return offset
            if clean_only:
                raise Fragmented
            mm.pool.disturb(f"a general-pool block of {size:,} bytes did not fit beside the planned region")
        while True:
            tensors = mm.tensors()
            victims = [t for t in tensors if t.residency is Residency.DEVICE and not mm.held(t)]
            leaving = [t for t in tensors if t.residency is Residency.SWAPPING_OUT and not mm.held(t)]
            within = allocator.in_use_nbytes + size <= mm.limit_nbytes or not (victims or leaving)
            if within:
                offset = allocator.allocate(size)
                if offset is not None:
                    return offset
                if allocator.free_nbytes >= size:
                    if self.compact(size):          # around the blocks copies still use
                        continue
                    if mm.land_copies() and self.compact(size):   # now their blocks can move too
                        continue
            if leaving:
                mm.pool.disturb("swap-outs finished ahead of their planned release")
                for t in leaving:
                    mm.release(t)
                continue
            if not victims:
                raise Fragmented
            victim = max(victims, key=self.rank)
            mm.evict(victim, drop=mm.droppable(victim))

    def _evict_clean(self, size: int, ceiling: int, unwanted_only: bool = False) -> int | None:
        """A block of ``size`` bytes with the bytes in use within ``ceiling``, evicting read-only
        tensors (Note [Eviction order]; with ``unwanted_only``, only those no window holds) while
        that is not yet possible; None if they run out."""
        mm = self.mm
        while True:
            if mm.allocator.in_use_nbytes + size <= ceiling:
                offset = mm.allocator.allocate(size)
                if offset is not None:
                    return offset
            clean = [t for t in mm.tensors() if mm.cache.evictable(t, unwanted_only)]
            if not clean:
                return None
            mm.evict(max(clean, key=self.rank))

    def compact(self, need_nbytes: int | None = None) -> bool:
        """Defragment: slide the blocks that may move (no op pins them, no copy reads them, not
        in the planned region, not :attr:`~tensile_db.memory.tensors.Tensor.fixed`) toward the
        start of the arena; with ``need_nbytes``, only the run of them whose sliding opens a free
        block that large at the least bytes moved (a full compaction moved tens of GB an
        iteration on four ResNet-50 jobs). Returns whether anything moved."""
        return self.mm.compact([t for t in self.mm.tensors()
                                if t.offset is not None and not t.pins and not t.planned and not t.fixed
                                and (t.transfer is None or t.transfer.done())], need_nbytes)

    def pack(self, working_set: list[Tensor], what: str) -> None:
        """Last resort when nothing is left to evict: let the copies in flight land (calling the
        swap-outs off), evict every other unpinned tensor, then place the working set largest
        first (compacting the arena as needed).

        Raises:
            DeviceOutOfMemory: the working set does not fit beside the pinned blocks.
        """
        mm = self.mm
        mm.land_copies(call_off=True)
        for t in [t for t in mm.tensors() if t.residency is Residency.DEVICE and not t.pins]:
            if not mm.held(t):
                mm.evict(t, drop=mm.droppable(t))
        try:
            for t in sorted(working_set, key=lambda t: -t.arena_nbytes):
                mm.make_resident(t)
        except Fragmented:
            need = sum(t.arena_nbytes for t in working_set)
            raise DeviceOutOfMemory(need, mm.allocator.in_use_nbytes, mm.budget_nbytes, what) from None
