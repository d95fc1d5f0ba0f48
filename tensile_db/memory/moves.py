"""Moving blocks within the arena: the planned region's install and dissolve, and the orders in
which blocks move (a region install's, a compaction's).

:class:`RegionInstaller` performs what the planned pool (:mod:`tensile_db.memory.planned`) asks of
the arena: for a plan the pool made, it computes where the region goes and which blocks move
(:func:`region_layout`) and carries the moves out on the manager's blocks. It owns no state of its own: every field it
changes (the tensors' offsets, the allocator's layout, the host tier's count of staged copies) is
the memory manager's, guarded by the manager's lock, which the pool holds when it calls.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .arena import ArenaAllocator
from .lifetimes import PoolPlan
from .planned import NoRoom

#: most of a planned region an install may move through host memory (RegionInstaller.install)
MAX_STAGED_FRACTION = 0.05


class RegionInstaller:
    """The planned pool's install and dissolve on ``manager``'s arena (a
    :class:`~tensile_db.memory.manager.MemoryManager`; see the module docstring)."""

    def __init__(self, manager):
        self.mm = manager

    def install(self, plan, live_keys: set, reserve_nbytes: int) -> int | str:
        """The planned pool's install: let the copies in flight land, take the layout the pool
        computes (:func:`region_layout`), evict the cached blocks it
        leaves out and perform its moves. Returns the region's offset, or why it was not installed
        (nothing changed then): a :class:`~.planned.NoRoom` where the region finds no room.

        A block moves device to device when its new place overlaps no block still to move; where
        the moves form cycles, one block is parked in arena bytes free before and after the
        install (:func:`order_moves`); what is left moves through host memory (each copied out,
        then all copied in).
        Through the host, every byte crosses the host link twice: on four ResNet-50 on the
        simulated H100 at 35% of their peak, an install that staged 0.97 GiB of the 1.59 GiB it
        moved took 94 ms, a whole period, and that one period doubled the run's EOR (+0.59, against
        +0.28 on the general pool). So an install that would stage more than
        :data:`MAX_STAGED_FRACTION` of the region is not made, except where the arena is host
        memory (``cpu``) and a staged move costs what a direct one does; the pool records
        again after its back-off, when the blocks may lie better."""
        mm = self.mm
        mm.land_copies()
        layout = region_layout(plan, [t for t in mm._tensors.values() if t.offset is not None],
                               live_keys, reserve_nbytes, mm.budget_nbytes)
        if layout is None:
            return NoRoom(f"a planned region of {plan.arena_nbytes:,} bytes and {reserve_nbytes:,} bytes "
                          "of library temporaries do not fit beside the blocks in use")
        # scratch: bytes no block holds before or after the install, among them the region's
        # bytes that no live block takes (nothing else is placed until the install ends)
        after = [(new, t.arena_nbytes) for t, new in layout.placed.items()]
        scratch = free_in_both(mm.allocator.blocks(), after, mm.budget_nbytes)
        copies, pending = order_moves(layout.moves, scratch)
        staged = sum(t.arena_nbytes for t, _ in pending)
        if not mm.device.arena_in_host_memory and staged > MAX_STAGED_FRACTION * plan.arena_nbytes:
            return (f"installing a planned region of {plan.arena_nbytes:,} bytes would move {staged:,} "
                    "bytes through host memory")
        for t in layout.evicted:
            mm.evict(t)
        for t, old, new in copies:
            if new < old:
                mm.device.move_down(mm.buffer, old, new, t.arena_nbytes)
            else:
                mm.device.copy_within(mm.buffer, old, new, t.arena_nbytes)
            t.offset = new
        self._stage(pending)
        for t in layout.placed:
            t.planned = t.key in live_keys
        mm.allocator.relayout(layout.used)
        return layout.base

    def _stage(self, pending: list) -> None:
        """Move each ``(tensor, new offset)`` of ``pending`` (whose places overlap each other's)
        through a copy outside the arena: all copied out, then all copied in. The copies are host
        memory when the host tier has room for them all (counted in it while they exist), else
        slots of the tensors' spill files, so a region install never takes host memory beyond the
        host budget."""
        mm = self.mm
        if not pending:
            return
        nbytes = sum(t.arena_nbytes for t, _ in pending)
        if mm.take_host(nbytes):
            try:
                staged = [mm.device.to_host(mm._block(t)) for t, _ in pending]
                for (t, new), host in zip(pending, staged):
                    t.offset = new
                    mm.device.to_device(host, mm._block(t))
            finally:
                mm.give_host(nbytes)
            return
        slots = []
        try:
            for t, _ in pending:
                slots.append(mm.host_tier.spill_now(t, mm._block(t)))
        except BaseException:
            for (t, _), (file, offset) in zip(pending, slots):
                file.release(offset, t.arena_nbytes)
            raise
        for (t, new), (file, offset) in zip(pending, slots):
            t.offset = new
            mm.engine.read_now(lambda out, f=file, o=offset: f.read_into(o, out), mm._block(t))
            file.release(offset, t.arena_nbytes)

    def dissolve(self) -> None:
        """Turn the planned region back into general-pool blocks: each live planned block stays
        where it is as an ordinary block; the rest of the region becomes free."""
        mm = self.mm
        used = {t.offset: t.arena_nbytes for t in mm._tensors.values() if t.offset is not None}
        for t in mm._tensors.values():
            t.planned = False
        mm.allocator.relayout(used)


def order_moves(moves: list, scratch: list | None = None) -> tuple[list, list]:
    """Order the moves of a region install. ``moves``: (tensor, new offset) pairs, each tensor at
    its current ``offset``, of ``arena_nbytes``, the new places disjoint; ``scratch``: (start,
    end) byte ranges free before and after the install (so no block is there and none goes
    there). Returns (copies, staged): ``copies``, (tensor, from, to) device-to-device copies in an
    order in which each is safe, since its destination overlaps no block still to move (its own
    excepted when it moves down, which :meth:`Device.move_down` copies correctly); and
    ``staged``, the (tensor, new offset) moves left, to go through host memory. Where the moves
    left form cycles, a block of one is parked in a scratch range that fits it (a copy, then its
    move from there), which breaks the cycle. The pending blocks' ranges are kept sorted, so each
    check is a bisection."""
    at = {id(t): t.offset for t, _ in moves}            # where each block is now
    pending = sorted((t.offset, t.offset + t.arena_nbytes, id(t)) for t, _ in moves)
    starts = [p[0] for p in pending]
    scratch = sorted(scratch or [])
    left, copies, parked = list(moves), [], set()

    def leave(t) -> None:
        if id(t) not in parked:                        # a parked block is in no pending range
            k = bisect.bisect_left(starts, at[id(t)])
            del pending[k], starts[k]

    while left:
        stuck = []
        for t, new in left:
            end, old, size = new + t.arena_nbytes, at[id(t)], t.arena_nbytes
            first = max(bisect.bisect_right(starts, new) - 1, 0)
            last = bisect.bisect_left(starts, end)
            if any(p[1] > new and p[2] != id(t) for p in pending[first:last]) or old < new < old + size:
                stuck.append((t, new))
                continue
            copies.append((t, old, new))
            leave(t)
        if len(stuck) == len(left):                   # cycles: park a block once, if a range fits it
            fits = ((t, k) for t, _ in stuck if id(t) not in parked
                    for k, (lo, hi) in enumerate(scratch) if hi - lo >= t.arena_nbytes)
            t, room = next(fits, (None, None))
            if t is None:
                return copies, stuck
            lo, hi = scratch[room]
            scratch[room] = (lo + t.arena_nbytes, hi)
            copies.append((t, at[id(t)], lo))
            leave(t)
            at[id(t)] = lo                              # outside every destination: blocks nothing
            parked.add(id(t))
        left = stuck
    return copies, []


def coalesced(moves: list) -> list:
    """The ``(old, new, size)`` moves of a compaction (in copy order, each down) as fewer copies:
    adjacent blocks that slide by the same distance make one copy while its span stays within that
    distance, so that no copy overlaps itself. A compaction slides runs of adjacent blocks, one
    copy (one launch) each: on four ResNet-50 at 50% on the simulated H100, 21,257 block moves
    became 2,487 copies."""
    out: list[tuple[int, int, int]] = []
    for old, new, size in moves:
        if out:
            o, n, s = out[-1]
            if old == o + s and old - new == o - n and s + size <= old - new:
                out[-1] = (o, n, s + size)
                continue
        out.append((old, new, size))
    return out


def free_in_both(before: list, after: list, capacity: int) -> list:
    """(start, end) byte ranges of ``[0, capacity)`` that neither the ``before`` nor the
    ``after`` blocks ((offset, size) pairs) touch."""
    edges = sorted((o, o + size) for o, size in list(before) + list(after))
    out, cursor = [], 0
    for lo, hi in edges:
        if lo > cursor:
            out.append((cursor, lo))
        cursor = max(cursor, hi)
    if cursor < capacity:
        out.append((cursor, capacity))
    return out


@dataclass
class RegionLayout:
    """Where the planned region goes and how the live blocks move to install a plan. Offsets and
    sizes in bytes; tensors are the manager's."""

    base: int                    # arena offset of the region
    moves: list                  # (tensor, new offset) of every block that moves, in copy order
    placed: dict                 # tensor -> offset of every unpinned block that stays on the device
    evicted: list                # cached read-only tensors that no longer fit: the manager evicts them
    used: dict                   # offset -> size of every allocator block after the install


def region_layout(plan: PoolPlan, blocks: list, live_keys: set, reserve_nbytes: int,
                  budget_nbytes: int) -> RegionLayout | None:
    """The layout that installs ``plan``: the region of ``plan.arena_nbytes`` bytes at the lowest
    offset clear of pinned blocks; every block of ``blocks`` (tensors with ``offset``,
    ``arena_nbytes``, ``pins``, ``key``, ``readonly``) whose key is in ``live_keys`` at its planned
    offset; the other unpinned blocks packed around it, larger first, cached read-only ones last
    and left out (evicted) if they do not fit; ``reserve_nbytes`` kept free for unkeyed blocks
    within the budget (not the manager's limit: that headroom is for the general pool's
    fragmentation, and the region's packing is exact). None if the plan cannot be installed
    now: a live keyed block is pinned, or the region, the blocks and the reserve do not fit."""
    pinned = {t.offset: t.arena_nbytes for t in blocks if t.pins}
    if any(t.pins and t.key in live_keys for t in blocks):
        return None
    base, cursor = None, 0
    for offset, size in sorted(pinned.items()) + [(budget_nbytes, 0)]:
        if offset - cursor >= plan.arena_nbytes:
            base = cursor
            break
        cursor = max(cursor, offset + size)
    if base is None:
        return None
    layout = ArenaAllocator(budget_nbytes)
    layout.relayout({**pinned, base: plan.arena_nbytes})
    placed = {t: base + plan.offsets[t.key] for t in blocks if t.key in live_keys}
    evicted = []
    for t in sorted((t for t in blocks if not t.pins and t not in placed),
                    key=lambda t: (t.readonly, -t.arena_nbytes)):
        offset = layout.allocate(t.arena_nbytes)
        if offset is None and not t.readonly:
            return None
        if offset is None:
            evicted.append(t)
        else:
            placed[t] = offset
    if layout.in_use_nbytes + reserve_nbytes > budget_nbytes:
        return None
    moves = [(t, new) for t, new in placed.items() if new != t.offset]
    return RegionLayout(base, moves, placed, evicted, dict(layout.blocks()))
