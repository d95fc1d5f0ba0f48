"""Lifetime-planned offsets: the offline planner behind the planned pool.

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

:func:`replay_general_pool` runs a trace through the best-fit
:class:`~tensile_db.memory.arena.ArenaAllocator` for comparison. The traces come from the planned
pool's recording (:mod:`tensile_db.memory.planned`) or, offline, from a program and a swap
schedule (:func:`tensile_db.scheduler.allocations.allocations_of`). This module only computes:
it holds no state and allocates no device memory.

Note [Two placements of one rule]
---------------------------------
Rationale: the planned pool's search places the same allocations in many orders (a search of
:data:`~tensile_db.memory.planned.SEARCH_S` seconds on a thread beside the jobs), and where the
budget is the period's most live bytes only a packing at that bound fits at all. The MLP of
``bench/throughput.py`` at its largest working set (55 allocations): the randomised search
needed 15 to 228 tries (eight seeds) to reach the bound on one recorded period, at about 0.45 ms a
try, vectorised over the placed segments, where a dozen NumPy calls per allocation on arrays of
a few dozen elements cost more than the arithmetic; in one of six runs the search ended above the
bound and the pool's region never fitted.

Approach: the overlaps of every allocation are the same in every order, so
:func:`overlaps_of` works them out once per trace, and a sparse trace is placed in Python: each
placed block enters the sorted list of each allocation it overlaps, and a placement walks only
its own list. A try in Python costs about 0.14 µs per overlapping pair, a vectorised one about
13.5 µs per allocation (``bench/pool.py``'s single-job traces and two recorded periods, largest
first, best fit, on this project's 2-core machine): the small CNN of ``bench/throughput.py`` at
half its peak (132 allocations, 3,116 pairs) 0.6 against 1.8 ms; VGG-16 at an eighth of its
width, batch 64 (237 allocations, 43,456 pairs) 6.0 against 3.6 ms, with the swaps of half its
peak (267, 13,792) 2.3 against 3.7 ms; one ResNet-50 at an eighth (1,285 allocations, 1.4
million pairs) 313 against 32 ms. So a trace of at most :data:`SMALL_TRACE` allocations with at
most :data:`SPARSE_PAIRS` overlapping pairs per allocation is placed in Python, any other
vectorised (the overlaps of a larger trace are not worked out: that alone took 150 ms on the
ResNet-50). The count of allocations alone chose before: at most 128 in Python, which placed the
small CNN's period above (132) vectorised, and its planned pool's offset plan, at most 15 tries,
took 27 ms of a core instead of 10. Both give the same offsets for every order, strategy and
fixed allocation (a test says so), so a search reaches the same packings, sooner.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np

from .arena import ArenaAllocator


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


def _live_per_event(allocs: list[Allocation]) -> np.ndarray:
    """(events + 1,) int64: bytes held at each event of the trace."""
    end = max(b for a in allocs for _, b in a.segments) + 2
    diff = np.zeros(end, dtype=np.int64)
    for a in allocs:
        for s, e in a.segments:
            diff[s] += a.nbytes
            diff[e + 1] -= a.nbytes
    return np.cumsum(diff)


def max_live_nbytes(allocs: list[Allocation]) -> int:
    """The lower bound on any placement: the most bytes held at one event."""
    return int(_live_per_event(allocs).max()) if allocs else 0


def _breadth(allocs: list[Allocation]) -> dict:
    """key -> the most bytes live at any event of the allocation's lifetime (its "breadth")."""
    live = _live_per_event(allocs)
    return {a.key: max(int(live[s:e + 1].max()) for s, e in a.segments) for a in allocs}


#: orders in which :func:`plan_offsets` may place allocations: each maps the trace to a sort key
ORDERS = {
    "largest": lambda allocs: lambda a: (-a.nbytes, -a.length, str(a.key)),
    "area": lambda allocs: lambda a: (-a.nbytes * a.length, str(a.key)),
    "start": lambda allocs: lambda a: (a.segments[0][0], -a.nbytes, str(a.key)),
    # greedy by breadth (Pisarchyk and Lee, arXiv 2001.03288): the tensors of the fullest events first
    "breadth": lambda allocs: (lambda b: lambda a: (-b[a.key], -a.nbytes, str(a.key)))(_breadth(allocs)),
}


def _bound_order(allocs: list[Allocation]) -> list[Allocation]:
    """The order :func:`plan_smallest` tries after those of :data:`ORDERS`: by breadth, then
    size, then the longer lifetime. The MLP of ``bench/throughput.py`` at its largest working set
    (55 allocations) packs to its bound so, 167,936 bytes above by every order of :data:`ORDERS`,
    where the randomised search took 4 to 256 tries (by seed) to reach it. Its packing is kept
    only where it is smaller than theirs: as an order of :data:`ORDERS`, first among equals, it
    packed the mixed arrival's periods on the simulated H100 differently, and ``tensile``'s EOR
    there at 70% went from +0.000 to +0.074 (``bench/paper.py``). Kept where smaller, it packed the
    period of the three jobs left after VGG-16 in 1.048 times its most live bytes, against 1.054
    by the orders of :data:`ORDERS` and four randomised ones, and ``tensile``'s EOR there went
    +0.053 -> +0.042 at 70%, +0.073 -> +0.062 at 50% and +0.314 -> +0.301 at 35%, every other
    policy's a little lower too, and on four ResNet-50s at 35% +0.070 -> +0.061 (the default
    workloads and VGG-16, seed 0: nothing else changed)."""
    breadth = _breadth(allocs)
    return sorted(allocs, key=lambda a: (-breadth[a.key], -a.nbytes, -a.length, str(a.key)))


#: Allocations up to which :func:`plan_offsets` may place in Python over the overlaps worked out
#: once (Note [Two placements of one rule])
SMALL_TRACE = 512
#: Overlapping pairs per allocation up to which it does
SPARSE_PAIRS = 96


def _segments(allocs: list[Allocation]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(owner, first event, last event) of every lifetime segment of ``allocs``, in their order:
    int64 arrays; the owner is the allocation's index."""
    owner = np.array([i for i, a in enumerate(allocs) for _ in a.segments], dtype=np.int64)
    start = np.array([s for a in allocs for s, _ in a.segments], dtype=np.int64)
    end = np.array([e for a in allocs for _, e in a.segments], dtype=np.int64)
    return owner, start, end


def _hit(a: Allocation, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Which of the segments ``start``..``end`` (inclusive) overlap a lifetime segment of ``a``."""
    hit = np.zeros(len(start), dtype=bool)
    for s, e in a.segments:
        hit |= (start <= e) & (s <= end)
    return hit


def overlaps_of(allocs: list[Allocation]) -> list[list[int]]:
    """For each allocation of ``allocs``, by index, the indices of the others whose lifetimes
    overlap its own (ascending): the same for every order :func:`plan_offsets` places them in."""
    owner, start, end = _segments(allocs)
    out = []
    for i, a in enumerate(allocs):
        owners = np.unique(owner[_hit(a, start, end)])
        out.append(owners[owners != i].tolist())
    return out


def small_overlaps(allocs: list[Allocation]) -> list[list[int]] | None:
    """:func:`overlaps_of` ``allocs`` where :func:`plan_offsets` places them in Python (at most
    :data:`SMALL_TRACE` allocations with at most :data:`SPARSE_PAIRS` overlapping pairs each, on
    average), else None: what a caller that places one trace in several orders passes to each."""
    if len(allocs) > SMALL_TRACE:
        return None
    overlaps = overlaps_of(allocs)
    return overlaps if sum(map(len, overlaps)) <= SPARSE_PAIRS * len(allocs) else None


def plan_offsets(allocs: list[Allocation], strategy: str = "best_fit", order="largest",
                 fixed: dict | None = None, overlaps: list[list[int]] | None | str = "auto") -> PoolPlan:
    """Place ``allocs`` in ``order`` (a name in :data:`ORDERS`, default largest first, longer
    lifetime first among equal sizes; or a list of the allocations in the order to place them).
    Each goes into a gap between the already placed allocations whose lifetimes overlap its own:
    the smallest gap that fits (``best_fit``) or the lowest (``first_fit``); with no gap that
    fits, above all of them. ``fixed``: key -> offset (bytes) of allocations placed there first,
    before the others (the caller keeps them apart: blocks live together where they lie now).
    ``overlaps``: :func:`small_overlaps` ``allocs``, for a caller that places the same
    allocations in many orders (a list: the placement runs in Python over it; None: vectorised;
    ``"auto"``: worked out here; Note [Two placements of one rule]). Returns a
    :class:`PoolPlan`; vectorised O(n * s) in n allocations and s segments, in Python O(e * d)
    in e overlapping pairs and d the most allocations one overlaps.

    Raises:
        ValueError: an unknown strategy or order, or ``overlaps`` not of ``allocs``' length.
    """
    if strategy not in ("best_fit", "first_fit"):
        raise ValueError(f"unknown strategy {strategy!r}; use 'best_fit' or 'first_fit'")
    if isinstance(order, str):
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}; use one of {', '.join(ORDERS)}")
        ordered, name = sorted(allocs, key=ORDERS[order](allocs)), order
    else:
        ordered, name = list(order), "searched"
    kept = [a for a in ordered if a.key in fixed] if fixed else []
    if kept:
        ordered = kept + [a for a in ordered if a.key not in fixed]
        name += "/kept"
    if overlaps == "auto":
        overlaps = small_overlaps(allocs)
    if overlaps is not None and len(overlaps) != len(allocs):
        raise ValueError(f"overlaps of {len(overlaps)} allocations for a trace of {len(allocs)}: pass "
                         "overlaps_of(allocs) of the same list")
    if overlaps is not None:
        offsets = _place_small(allocs, ordered, strategy, len(kept), fixed, overlaps)
    else:
        offsets = _place_vectorised(ordered, strategy, len(kept), fixed)
    arena = max((offsets[a.key] + a.nbytes for a in ordered), default=0)
    return PoolPlan(f"{strategy}/{name}", offsets, arena)


def _place_small(allocs: list[Allocation], ordered: list[Allocation], strategy: str, n_kept: int,
                 fixed: dict | None, overlaps: list[list[int]]) -> dict:
    """:func:`plan_offsets`' placement over the overlaps of each allocation, in Python: key ->
    offset. The first ``n_kept`` of ``ordered`` lie at their offsets in ``fixed``. Each placed
    allocation enters the list of every allocation it overlaps, sorted by offset and then by
    placement (as the vectorised placement's stable sort has them), so a placement reads only the
    blocks in its way."""
    index = {a.key: i for i, a in enumerate(allocs)}
    in_way: list[list[tuple[int, int, int]]] = [[] for _ in allocs]   # (offset, placed as, end)
    out = {}
    for k, a in enumerate(ordered):
        i = index[a.key]
        if k < n_kept:
            at = fixed[a.key]
        else:
            below, at, best_gap = 0, None, None
            for lo, _, hi in in_way[i]:
                gap = lo - below
                if gap >= a.nbytes and (best_gap is None or gap < best_gap):
                    at, best_gap = below, gap
                    if strategy == "first_fit":
                        break
                if hi > below:
                    below = hi
            if at is None:
                at = below
        out[a.key] = at
        block = (at, k, at + a.nbytes)
        for j in overlaps[i]:
            bisect.insort(in_way[j], block)
    return out


def _place_vectorised(ordered: list[Allocation], strategy: str, n_kept: int, fixed: dict | None) -> dict:
    """:func:`plan_offsets`' placement vectorised over the placed segments: key -> offset. The
    first ``n_kept`` of ``ordered`` lie at their offsets in ``fixed``."""
    seg_owner, seg_start, seg_end = _segments(ordered)
    sizes = np.array([a.nbytes for a in ordered], dtype=np.int64)
    offsets = np.zeros(len(ordered), dtype=np.int64)
    placed = np.zeros(len(seg_owner), dtype=bool)
    offsets[:n_kept] = [fixed[a.key] for a in ordered[:n_kept]]          # placed first, where they lie
    first_seg = sum(len(a.segments) for a in ordered[:n_kept])
    placed[:first_seg] = True
    for i, a in enumerate(ordered[n_kept:], n_kept):
        owners = seg_owner[_hit(a, seg_start, seg_end) & placed]                 # ascending: segments are in placement order
        owners = owners[np.concatenate(([True], owners[1:] != owners[:-1]))] if len(owners) else owners
        lo = offsets[owners]
        rank = np.argsort(lo, kind="stable")
        lo, hi = lo[rank], lo[rank] + sizes[owners][rank]
        below = np.concatenate(([0], np.maximum.accumulate(hi)[:-1])) if len(hi) else hi
        gap = lo - below
        fits = np.flatnonzero(gap >= a.nbytes)
        if len(fits):
            j = fits[np.argmin(gap[fits])] if strategy == "best_fit" else fits[0]
            offsets[i] = below[j]
        else:
            offsets[i] = hi.max() if len(hi) else 0
        placed[first_seg:first_seg + len(a.segments)] = True
        first_seg += len(a.segments)
    return {a.key: int(o) for a, o in zip(ordered, offsets)}


def best_fixed_order(allocs: list[Allocation], strategy: str, bound_nbytes: int, fixed: dict | None = None,
                     overlaps: list[list[int]] | None | str = "auto") -> PoolPlan:
    """The smallest arena of :func:`plan_offsets` over the orders of :data:`ORDERS` (``fixed`` and
    ``overlaps`` as there), in their order; the first that reaches ``bound_nbytes`` (the lower
    bound, :func:`max_live_nbytes`) at once, since none of the others can be smaller."""
    overlaps = small_overlaps(allocs) if overlaps == "auto" else overlaps
    best = None
    for order in ORDERS:
        plan = plan_offsets(allocs, strategy, order, fixed=fixed, overlaps=overlaps)
        if best is None or plan.arena_nbytes < best.arena_nbytes:
            best = plan
        if best.arena_nbytes <= bound_nbytes:
            break
    return best


def plan_smallest(allocs: list[Allocation], strategy: str = "best_fit", search_s: float = 0.0,
                  seed: int = 0, max_tries: int | None = None, overlaps: list[list[int]] | None | str = "auto",
                  enough_nbytes: int = 0) -> PoolPlan:
    """The smallest arena of :func:`plan_offsets` over every order of :data:`ORDERS`, then, for up
    to ``search_s`` seconds, over randomised orders: by size, or by size times lifetime, each
    scaled by a seeded random factor in [0.25, 1.75). Fixed greedy orders can miss by 20% or more
    when sizes and lifetimes are mixed; a plan is made once per schedule, so a short search is
    affordable. Stops at the lower bound, :func:`max_live_nbytes` (among the fixed orders too: the
    first that reaches it is the one the smallest of them all would be), and after ``max_tries``
    randomised orders when given. Before the search, one more order (:func:`_bound_order`) is
    tried: taken at once where it reaches the bound, which no search can beat, and kept where it
    packs smaller than the fixed orders. Deterministic
    for a given ``seed`` and number of tries (so with ``max_tries`` and an unbounded
    ``search_s``). ``overlaps``: as for :func:`plan_offsets` (worked out here once by default).
    ``enough_nbytes``: after the fixed orders and that one, an arena of at most this many bytes
    ends the search, or makes it needless (Note [A search the jobs wait for] in
    :mod:`~tensile_db.memory.planned`); 0, the default: only the bound does."""
    bound = max_live_nbytes(allocs)
    goal = max(bound, enough_nbytes)
    overlaps = small_overlaps(allocs) if overlaps == "auto" else overlaps
    best = best_fixed_order(allocs, strategy, bound, overlaps=overlaps)
    if best.arena_nbytes <= bound:
        return best
    at_bound = plan_offsets(allocs, strategy, _bound_order(allocs), overlaps=overlaps)
    if at_bound.arena_nbytes < best.arena_nbytes:
        best = at_bound
        if best.arena_nbytes <= bound:
            return best
    keys = (np.array([a.nbytes for a in allocs], dtype=np.float64),
            np.array([a.nbytes * a.length for a in allocs], dtype=np.float64))
    rng = np.random.default_rng(seed)
    deadline = time.perf_counter() + search_s
    tries = 0
    while best.arena_nbytes > goal and time.perf_counter() < deadline and tries != max_tries:
        weight = keys[tries % 2] * rng.uniform(0.25, 1.75, len(allocs))
        order = [allocs[i] for i in np.lexsort((np.arange(len(allocs)), -weight))]
        plan = plan_offsets(allocs, strategy, order, overlaps=overlaps)
        if plan.arena_nbytes < best.arena_nbytes:
            best = plan
        tries += 1
    return best


def check_plan(allocs: list[Allocation], plan: PoolPlan) -> None:
    """Raise AssertionError (also under ``python -O``) if two allocations with overlapping
    lifetimes share a byte, or if one lies outside ``[0, plan.arena_nbytes)``."""
    by_key = {a.key: a for a in allocs}
    items = sorted(((plan.offsets[k], plan.offsets[k] + a.nbytes, a) for k, a in by_key.items()),
                   key=lambda t: t[0])
    for start, end, a in items:
        if start < 0 or end > plan.arena_nbytes:
            raise AssertionError(f"{a.key} at [{start}, {end}) outside the arena")
    for i, (s1, e1, a) in enumerate(items):
        for s2, e2, b in items[i + 1:]:
            if s2 >= e1:
                break
            if a.overlaps(b):
                raise AssertionError(f"{a.key} and {b.key} overlap in time and share bytes [{s2}, {min(e1, e2)})")


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


def period_allocations(events, sizes: dict, start_live: dict) -> list[Allocation] | None:
    """A recorded period as allocations: ``events`` its ``("a" | "f", key)`` allocations and frees in
    order, ``sizes`` key -> bytes, ``start_live`` key -> bytes of the blocks live at its start. The allocations over events 0 (its start) to len(events) + 1 (its
    end); a block live across the boundary has its two segments. None if the events do not pair
    up (a free of a key not live, a key allocated twice)."""
    end = len(events) + 1
    open_ = dict.fromkeys(start_live, 0)
    segments: dict[object, list[tuple[int, int]]] = {}
    for i, (kind, key) in enumerate(events, start=1):
        if kind == "a":
            if key in open_:
                return None
            open_[key] = i
        else:
            if key not in open_:
                return None
            segments.setdefault(key, []).append((open_.pop(key), i))
    for key, start in open_.items():
        segments.setdefault(key, []).append((start, end))
    allocs = []
    for key, segs in segments.items():
        segs.sort()
        nbytes = start_live.get(key) or sizes[key]
        allocs.append(Allocation(key, nbytes, tuple(segs)))
    return allocs


def packing_figures(allocs: list[Allocation], plan: PoolPlan) -> dict:
    """Planned arena, lower bound and general-pool high-water mark (highest byte the best-fit
    pool touches on the same trace), for all jobs together and for each job alone. A job alone is
    planned with the fixed orders only, without the randomised search: the figures are a report,
    and with many jobs a search per job cost more than the plan itself (eight jobs: 0.2 s a plan,
    on the planning thread beside the executor's); one job's figures are the whole's."""
    _, general = replay_general_pool(allocs)
    jobs = sorted({a.key[0] for a in allocs})
    if len(jobs) == 1:                  # the job alone is the whole
        whole = {"planned_arena_nbytes": plan.arena_nbytes, "max_live_nbytes": max_live_nbytes(allocs),
                 "general_pool_nbytes": general}
        return {**whole, "per_job": {jobs[0]: dict(whole)}}
    per_job = {}
    for job in jobs:
        mine = [a for a in allocs if a.key[0] == job]
        per_job[job] = {"planned_arena_nbytes": plan_smallest(mine, "best_fit").arena_nbytes,
                        "max_live_nbytes": max_live_nbytes(mine),
                        "general_pool_nbytes": replay_general_pool(mine)[1]}
    return {"planned_arena_nbytes": plan.arena_nbytes, "max_live_nbytes": max_live_nbytes(allocs),
            "general_pool_nbytes": general, "per_job": per_job}
