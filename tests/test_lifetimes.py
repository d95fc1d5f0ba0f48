"""The planned pool's offline planner: interval colouring of recurring allocations.

Checked on hand-made traces (gaps reused, best fit against first fit, allocations with two
lifetime segments), on random traces (no two allocations that live at the same time share a
byte, every block inside the arena, never below the lower bound), and on the traces of real
training programs with and without a swap schedule.
"""

from __future__ import annotations

import numpy as np
import pytest

from tensile_db.memory import lifetimes
from tensile_db.memory.arena import UNIT_NBYTES as U
from tensile_db.memory.lifetimes import (
    ORDERS,
    Allocation,
    PoolPlan,
    check_plan,
    max_live_nbytes,
    plan_offsets,
    plan_smallest,
    replay_general_pool,
)
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions
from tensile_db.scheduler.allocations import allocations_of
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.planners import plan_tensile
from tensile_db.scheduler.timeline import JobTrace, Timeline
from tensile_db.scheduler.trace import AccessSequence


def alloc(key, units, *segments):
    return Allocation(key, units * U, tuple(segments))


def test_blocks_of_disjoint_lifetimes_share_offsets():
    a = alloc("a", 4, (0, 3))
    b = alloc("b", 4, (4, 7))
    c = alloc("c", 2, (2, 5))                    # overlaps both
    plan = plan_offsets([a, b, c])
    check_plan([a, b, c], plan)
    assert plan.offsets["a"] == plan.offsets["b"] == 0 and plan.offsets["c"] == 4 * U
    assert plan.arena_nbytes == 6 * U == max_live_nbytes([a, b, c])


def test_best_fit_takes_the_tightest_gap_first_fit_the_lowest():
    # placed in start order: q [0,2), p1 [2,10), r [10,12), p2 [12,15), s [15,16) units; when
    # "late" starts, p1 and p2 have ended and left holes of 8 and 3 units
    allocs = [alloc("q", 2, (0, 9)), alloc("p1", 8, (1, 4)), alloc("r", 2, (2, 9)), alloc("p2", 3, (3, 4)),
              alloc("s", 1, (3, 9)), alloc("late", 3, (6, 9))]
    best = plan_offsets(allocs, "best_fit", "start")
    first = plan_offsets(allocs, "first_fit", "start")
    for plan in (best, first):
        check_plan(allocs, plan)
    assert [best.offsets[k] // U for k in ("q", "p1", "r", "p2", "s")] == [0, 2, 10, 12, 15]
    assert first.offsets["late"] == 2 * U                          # the lowest hole that fits
    assert best.offsets["late"] == 12 * U                          # the 3-unit hole exactly


def test_two_segments_share_one_offset_and_collide_with_neither_neighbour():
    wrap = alloc("w", 4, (0, 2), (8, 9))         # lives across the end of the iteration
    inside = alloc("i", 4, (3, 7))               # fits in its absence
    clash = alloc("c", 4, (1, 1))
    plan = plan_offsets([wrap, inside, clash])
    check_plan([wrap, inside, clash], plan)
    assert plan.offsets["i"] == plan.offsets["w"]
    assert plan.offsets["c"] != plan.offsets["w"]


def test_check_plan_finds_shared_bytes_and_blocks_outside_the_arena():
    a, b = alloc("a", 4, (0, 5)), alloc("b", 4, (5, 9))
    with pytest.raises(AssertionError, match="share bytes"):
        check_plan([a, b], PoolPlan("x", {"a": 0, "b": 2 * U}, 8 * U))
    with pytest.raises(AssertionError, match="outside"):
        check_plan([a, b], PoolPlan("x", {"a": 0, "b": 4 * U}, 6 * U))
    with pytest.raises(ValueError, match="'worst_fit'"):
        plan_offsets([a], "worst_fit")


@pytest.mark.parametrize("seed", range(12))
def test_random_traces(seed):
    rng = np.random.default_rng(seed)
    allocs = []
    for i in range(int(rng.integers(5, 60))):
        start = int(rng.integers(0, 40))
        segments = [(start, start + int(rng.integers(0, 15)))]
        if rng.random() < 0.2 and segments[0][1] + 3 < 60:
            later = segments[0][1] + int(rng.integers(2, 6))
            segments.append((later, later + int(rng.integers(0, 8))))
        allocs.append(Allocation(i, int(rng.choice([1, 1, 2, 3, 8, 16])) * U, tuple(segments)))
    bound = max_live_nbytes(allocs)
    for strategy in ("best_fit", "first_fit"):
        for order in ORDERS:
            plan = plan_offsets(allocs, strategy, order)
            check_plan(allocs, plan)
            assert plan.arena_nbytes >= bound
        assert plan_smallest(allocs, strategy).arena_nbytes == min(
            plan_offsets(allocs, strategy, o).arena_nbytes for o in ORDERS)
    hwm, top = replay_general_pool(allocs)
    assert hwm == bound <= top


@pytest.mark.parametrize("seed", range(6))
def test_the_two_placements_give_the_same_offsets(seed, monkeypatch):
    """In Python over the overlaps (small traces) and vectorised (large ones), the placement is
    one rule: the same offsets for every order, strategy and fixed allocation."""
    rng = np.random.default_rng(seed)
    allocs = []
    for i in range(int(rng.integers(5, 80))):
        start = int(rng.integers(0, 50))
        segments = [(start, start + int(rng.integers(0, 20)))]
        if rng.random() < 0.2:
            segments = [(0, int(rng.integers(0, 4))), (int(rng.integers(5, 50)), 60)]
        allocs.append(Allocation(i, int(rng.choice([0, 1, 2, 3, 8, 16])) * U, tuple(segments)))
    fixed = {allocs[0].key: 5 * U}
    searched = [allocs[i] for i in rng.permutation(len(allocs))]
    plans = []
    for small in (lifetimes.SMALL_TRACE, 0):
        monkeypatch.setattr(lifetimes, "SMALL_TRACE", small)
        plans.append([(p.strategy, p.offsets, p.arena_nbytes)
                      for strategy in ("best_fit", "first_fit")
                      for order in [*ORDERS, searched]
                      for p in (plan_offsets(allocs, strategy, order), plan_offsets(allocs, strategy, order, fixed))])
    assert plans[0] == plans[1]


def test_a_trace_is_placed_in_python_where_its_overlaps_are_sparse():
    """Overlaps are worked out, and placed over in Python, for at most SMALL_TRACE allocations
    with at most SPARSE_PAIRS overlapping pairs each on average; else None (vectorised)."""
    n = lifetimes.SPARSE_PAIRS + 10
    chain = [alloc(i, 1, (i, i + 1)) for i in range(lifetimes.SMALL_TRACE)]   # each overlaps two
    assert lifetimes.small_overlaps(chain) == lifetimes.overlaps_of(chain)
    assert lifetimes.small_overlaps(chain + [alloc("one more", 1, (0, 1))]) is None
    together = [alloc(i, 1, (0, 9)) for i in range(n)]          # each overlaps every other
    assert lifetimes.small_overlaps(together) is None
    assert lifetimes.small_overlaps(together[:lifetimes.SPARSE_PAIRS + 1]) is not None
    assert plan_offsets(together).offsets == plan_offsets(together, overlaps=None).offsets \
        == plan_offsets(together, overlaps=lifetimes.overlaps_of(together)).offsets     # vectorised, then in Python


@pytest.mark.parametrize("small", [True, False], ids=["in Python", "vectorised"])
def test_blocks_at_one_offset_are_read_in_the_order_they_were_placed(small, monkeypatch):
    """Two blocks at one offset, the second empty: the gap after them starts at the end of the
    first, whichever of the two placements runs (an empty allocation fits the 5-unit gap there,
    not the empty one between the two)."""
    monkeypatch.setattr(lifetimes, "SMALL_TRACE", 128 if small else 0)
    whole = ((0, 9),)
    allocs = [alloc("b", 5, *whole), alloc("z", 0, *whole), alloc("c", 3, *whole), alloc("n", 0, *whole)]
    plan = plan_offsets(allocs, "best_fit", allocs, fixed={"b": 10 * U, "z": 10 * U, "c": 20 * U})
    assert plan.offsets["n"] == 15 * U


@pytest.mark.parametrize("seed", range(6))
def test_fixed_allocations_stay_where_they_are_and_the_others_fit_around_them(seed):
    # blocks live all period, scattered as a general pool leaves them, and short-lived ones
    rng = np.random.default_rng(seed)
    whole = [alloc(("w", i), int(rng.choice([1, 2, 4])), (0, 59)) for i in range(6)]
    fixed, top = {}, 0
    for a in whole:
        top += int(rng.integers(0, 4)) * U               # a gap the general pool left
        fixed[a.key], top = top, top + a.nbytes
    short = [alloc(i, int(rng.choice([1, 2, 8])), (s, s + int(rng.integers(0, 12))))
             for i, s in enumerate(rng.integers(0, 48, 30).tolist())]
    allocs = whole + short
    for order in ORDERS:
        plan = plan_offsets(allocs, "best_fit", order, fixed=fixed)
        check_plan(allocs, plan)
        assert all(plan.offsets[k] == o for k, o in fixed.items())
        assert plan.arena_nbytes >= max(max_live_nbytes(allocs), top)
    assert plan_offsets(allocs, "best_fit", fixed=fixed).strategy == "best_fit/largest/kept"


SPEC = ModelSpec(Architecture((Layer(96, "relu", 0.2), Layer(64, "tanh"), Layer(48, "relu"))), 16, 4,
                 "classification")


@pytest.mark.parametrize("scheduled", [False, True], ids=["unscheduled", "swap schedule"])
def test_training_program_traces(scheduled):
    program = build_training_program(SPEC, TrainOptions(), 64)
    seq = AccessSequence(program)
    for p in range(len(program.ops)):
        seq.record(p, 1e-3)
    seq.end_iteration()
    timeline = Timeline([JobTrace(0, seq)])
    decisions = plan_tensile(timeline, CostModel(1e10, 1e10), timeline.vanilla_peak_nbytes() // 2).decisions \
        if scheduled else []
    assert bool(decisions) == scheduled
    allocs = allocations_of(program, decisions)
    bound = max_live_nbytes(allocs)
    assert bound == timeline.usage(decisions).max()
    if not scheduled:
        assert bound == program.vanilla_peak_nbytes()
        assert len(allocs) == len(program.slots)
    else:
        assert len(allocs) > len(program.slots)      # a swapped tensor is a new block after its swap-in
    plan = plan_smallest(allocs)
    check_plan(allocs, plan)
    assert plan.arena_nbytes >= bound


def test_a_packing_within_enough_bytes_ends_the_search_before_it_starts(monkeypatch):
    """The allocations below, without the order that reaches their bound: where the fixed orders'
    packing is enough, it is taken as it is, one unit above the bound, with no randomised try;
    where it is not, the search goes on to the bound. The order that reaches the bound comes first
    where it does."""
    allocs = [alloc("t0", 3, (4, 4)), alloc("t1", 3, (2, 6)), alloc("t2", 2, (4, 8)), alloc("t3", 2, (3, 5)),
              alloc("t4", 4, (1, 3)), alloc("t5", 1, (2, 6))]
    bound = max_live_nbytes(allocs)
    fixed = min(plan_offsets(allocs, "best_fit", order).arena_nbytes for order in ORDERS)
    assert plan_smallest(allocs, "best_fit", max_tries=0, enough_nbytes=fixed).arena_nbytes == bound
    monkeypatch.setattr(lifetimes, "_bound_order", lambda allocs: sorted(allocs, key=ORDERS["largest"](allocs)))
    plan = plan_smallest(allocs, "best_fit", search_s=1e9, max_tries=1000, enough_nbytes=fixed)
    check_plan(allocs, plan)
    assert plan.arena_nbytes == fixed > bound
    assert plan_smallest(allocs, "best_fit", search_s=1e9, max_tries=1000, enough_nbytes=fixed - 1).arena_nbytes == bound


def test_the_order_for_the_bound_is_kept_where_it_packs_smaller_short_of_the_bound():
    """Every fixed order packs these in 15 units, the order by breadth, then size, then lifetime
    in 13, and none of them in the 12 live at once: its packing is the one kept, with no
    randomised try to beat it."""
    allocs = [alloc("t0", 3, (1, 1)), alloc("t1", 3, (2, 9)), alloc("t2", 3, (1, 7)), alloc("t3", 4, (8, 8)),
              alloc("t4", 4, (1, 1)), alloc("t5", 3, (6, 7)), alloc("t6", 3, (3, 9)), alloc("t7", 2, (0, 3))]
    assert max_live_nbytes(allocs) == 12 * U
    assert min(plan_offsets(allocs, "best_fit", order).arena_nbytes for order in ORDERS) == 15 * U
    plan = plan_smallest(allocs, "best_fit", max_tries=0)
    check_plan(allocs, plan)
    assert plan.arena_nbytes == 13 * U


def test_a_packing_at_the_lower_bound_ends_the_search_before_it_starts():
    """Every fixed order packs these a unit above the most bytes live at once; the order by
    breadth, then size, then lifetime reaches it, and is taken with no randomised try."""
    allocs = [alloc("t0", 3, (4, 4)), alloc("t1", 3, (2, 6)), alloc("t2", 2, (4, 8)), alloc("t3", 2, (3, 5)),
              alloc("t4", 4, (1, 3)), alloc("t5", 1, (2, 6))]
    bound = max_live_nbytes(allocs)
    assert min(plan_offsets(allocs, "best_fit", order).arena_nbytes for order in ORDERS) > bound
    plan = plan_smallest(allocs, "best_fit", max_tries=0)
    check_plan(allocs, plan)
    assert plan.arena_nbytes == bound
