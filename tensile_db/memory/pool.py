"""Lifetime-planned offsets: the planned pool's offline planner (issue 4, first part).

Training repeats the same allocations every iteration, so once one iteration has been recorded
every recurring allocation's size and lifetime are known and its arena offset can be fixed in
advance (Zhang, Yeung, Shu, He, Wang, "Efficient Memory Management for GPU-based Deep Learning
Systems", arXiv 1903.06631, section III). Placing them is interval colouring, NP-complete in
general; :func:`plan_offsets` uses the paper's kind of heuristic: allocations largest first, each
put in a gap left by the already placed allocations whose lifetimes overlap its own, the best
fitting gap (``best_fit``) or the lowest one (``first_fit``), else on top of them.

An allocation may have several lifetime *segments* that must share one offset: a tensor that
lives across the end of the iteration (a weight swapped out after the optimizer step and back in
before the forward pass) is one block over two segments of the linear trace.

:func:`allocations_of` derives the trace of one job from its program and a plan's decisions (a
swapped-out tensor is a new allocation after each swap-in, a recomputed one after each
recompute), on the events of one iteration. :func:`replay_general_pool` runs the same trace
through the best-fit :class:`~tensile_db.memory.arena.ArenaAllocator` for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arena import ArenaAllocator, round_up


@dataclass(frozen=True)
class Allocation:
    """One recurring allocation: ``nbytes`` (rounded to the arena unit) held over the inclusive
    event ranges ``segments`` ((first, last) pairs, disjoint)."""

    key: tuple
    nbytes: int
    segments: tuple[tuple[int, int], ...]

    def overlaps(self, other: "Allocation") -> bool:
        return any(a0 <= b1 and b0 <= a1 for a0, a1 in self.segments for b0, b1 in other.segments)

    @property
    def length(self) -> int:
        return sum(b - a + 1 for a, b in self.segments)


@dataclass
class PoolPlan:
    """Offsets (bytes) of every allocation and the arena they need (bytes)."""

    strategy: str
    offsets: dict
    arena_nbytes: int


def max_live_nbytes(allocs: list[Allocation]) -> int:
    """The lower bound on any placement: the most bytes held at one event."""
    if not allocs:
        return 0
    end = max(b for a in allocs for _, b in a.segments) + 2
    diff = np.zeros(end, dtype=np.int64)
    for a in allocs:
        for s, e in a.segments:
            diff[s] += a.nbytes
            diff[e + 1] -= a.nbytes
    return int(np.cumsum(diff).max())


#: orders in which :func:`plan_offsets` may place allocations
ORDERS = {
    "largest": lambda a: (-a.nbytes, -a.length, str(a.key)),
    "area": lambda a: (-a.nbytes * a.length, str(a.key)),
    "start": lambda a: (a.segments[0][0], -a.nbytes, str(a.key)),
}


def plan_offsets(allocs: list[Allocation], strategy: str = "best_fit", order: str = "largest") -> PoolPlan:
    """Place ``allocs`` in ``order`` (default largest first, longer lifetime first among equal
    sizes; see :data:`ORDERS`). Each goes into a gap between the already placed allocations whose
    lifetimes overlap its own: the smallest gap that fits (``best_fit``) or the lowest
    (``first_fit``); with no gap that fits, above all of them. Returns a :class:`PoolPlan`;
    O(n^2) in the number of allocations.

    Raises:
        ValueError: an unknown strategy or order.
    """
    if strategy not in ("best_fit", "first_fit"):
        raise ValueError(f"unknown strategy {strategy!r}; use 'best_fit' or 'first_fit'")
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; use one of {', '.join(ORDERS)}")
    placed: list[tuple[Allocation, int]] = []
    offsets = {}
    for a in sorted(allocs, key=ORDERS[order]):
        busy = sorted((off, off + b.nbytes) for b, off in placed if a.overlaps(b))
        gaps, cursor = [], 0
        for start, end in busy:
            if start - cursor >= a.nbytes:
                gaps.append((start - cursor, cursor))
            cursor = max(cursor, end)
        if gaps:
            offset = min(gaps)[1] if strategy == "best_fit" else min(g[1] for g in gaps)
        else:
            offset = cursor
        offsets[a.key] = offset
        placed.append((a, offset))
    arena = max((off + a.nbytes for a, off in placed), default=0)
    return PoolPlan(f"{strategy}/{order}", offsets, arena)


def plan_smallest(allocs: list[Allocation], strategy: str = "best_fit") -> PoolPlan:
    """The smallest arena of :func:`plan_offsets` over every order of :data:`ORDERS` (the plan
    is made once per schedule, so trying a few orders is cheap)."""
    return min((plan_offsets(allocs, strategy, order) for order in ORDERS), key=lambda p: p.arena_nbytes)


def check_plan(allocs: list[Allocation], plan: PoolPlan) -> None:
    """Raise AssertionError if two allocations with overlapping lifetimes share a byte, or if one
    lies outside ``[0, plan.arena_nbytes)``."""
    by_key = {a.key: a for a in allocs}
    items = sorted(((plan.offsets[k], plan.offsets[k] + a.nbytes, a) for k, a in by_key.items()),
                   key=lambda t: t[0])
    for start, end, a in items:
        assert 0 <= start and end <= plan.arena_nbytes, f"{a.key} at [{start}, {end}) outside the arena"
    for i, (s1, e1, a) in enumerate(items):
        for s2, e2, b in items[i + 1:]:
            if s2 >= e1:
                break
            assert not a.overlaps(b), f"{a.key} and {b.key} overlap in time and share bytes [{s2}, {min(e1, e2)})"


def allocations_of(program, decisions=()) -> list[Allocation]:
    """The recurring allocations of one iteration of ``program`` on its own (events = op
    positions), under ``decisions`` (a single-job plan's :class:`Decision` list, made on a
    timeline of this program alone). Persistent tensors without absences are one allocation over
    the whole iteration."""
    from ..scheduler.timeline import JobTrace, Timeline
    from ..scheduler.trace import AccessSequence

    tl = Timeline([JobTrace(0, AccessSequence(program))])
    n = tl.n
    absent: dict[str, list[tuple[int, int]]] = {}
    for d in decisions:
        absent.setdefault(d.slot, []).append(d.window(n))
    allocs = []
    for t in tl.tensors:
        start, length = tl.lifetime(t)
        held = np.zeros(n, dtype=bool)
        held[[(start + i) % n for i in range(length)]] = True
        for s, ln in absent.get(t.slot, ()):
            held[[(s + i) % n for i in range(ln)]] = False
        for k, segments in enumerate(_runs(held)):
            allocs.append(Allocation((t.slot, k), round_up(t.nbytes), segments))
    return allocs


def _runs(held: np.ndarray) -> list[tuple[tuple[int, int], ...]]:
    """Maximal cyclic runs of True in ``held``, each as linear segments (a run that wraps the end
    of the iteration is two segments)."""
    n = len(held)
    if held.all():
        return [((0, n - 1),)]
    first_false = int(np.argmin(held))
    runs: list[list[int]] = []
    current: list[int] = []
    for i in range(1, n + 1):                       # one lap, starting just after a False
        k = (first_false + i) % n
        if held[k]:
            current.append(k)
        elif current:
            runs.append(current)
            current = []
    out = []
    for run in runs:
        split = next((j for j in range(1, len(run)) if run[j] != run[j - 1] + 1), len(run))
        parts = [run[:split], run[split:]] if split < len(run) else [run]
        out.append(tuple(sorted((p[0], p[-1]) for p in parts)))
    return out


def replay_general_pool(allocs: list[Allocation]) -> tuple[int, int]:
    """Serve the trace, event by event, from a best-fit :class:`ArenaAllocator` of unbounded
    size, as the general pool would: every segment is allocated when it starts and freed after
    it ends (allocations starting at an event are made before those ending there are freed).
    Returns (high-water mark of allocated bytes, highest address used = the arena it needs)."""
    total = sum(a.nbytes for a in allocs)
    arena = ArenaAllocator(max(total, 1) * 2)
    starts, ends = {}, {}
    for a in allocs:
        for i, (s, e) in enumerate(a.segments):
            starts.setdefault(s, []).append((a, i))
            ends.setdefault(e, []).append((a, i))
    live, top = {}, 0
    for k in range(max(ends, default=-1) + 1):
        for a, i in sorted(starts.get(k, ()), key=lambda x: -x[0].nbytes):
            off = arena.allocate(a.nbytes)
            live[(a.key, i)] = off
            top = max(top, off + a.nbytes)
        for a, i in ends.get(k, ()):
            arena.free(live.pop((a.key, i)))
    return arena.peak_nbytes, top
