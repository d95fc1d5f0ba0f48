"""The lower bound on a plan's extra time (``tensile_db.scheduler.bound``), checked by rules on
MLP and CNN timelines:

- its absences are the planners' own, before their first decision;
- it is 0 where the vanilla peak already meets the target, and infinite exactly where freeing
  every absence cannot (the bytes an op accesses exceed the target);
- no plan of any planner that meets the target takes less extra time, and whole swaps and
  recomputes (the mixed-integer program) never give a lower bound than fractional ones;
- a lower target never gives a smaller bound, free copies give none, and slow ones some;
  contention between copies and kernels never lowers it, and raises it where copies are needed;
- the same call gives the same answer, solves and iterations.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from model_helpers import RESIDUAL_CNN as CNN
from tensile_db.errors import InvalidArgument
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions
from tensile_db.scheduler.baselines import plan_capuchin, plan_checkpoint
from tensile_db.scheduler.bound import TOLERANCE, absences, lower_bound
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.curves import plan_global
from tensile_db.scheduler.planners import _State, plan_swap_score, plan_tensile
from tensile_db.scheduler.timeline import JobTrace, Timeline
from tensile_db.scheduler.trace import AccessSequence

MLP = ModelSpec(Architecture((Layer(96, "relu", 0.2), Layer(64, "tanh"), Layer(48, "relu"))), 16, 4, "classification")
COSTS = {
    "fast": CostModel(h2d_bytes_per_s=8e9, d2h_bytes_per_s=8e9),
    "slow": CostModel(h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6),          # copies cost more than recomputes
    "duplex": CostModel(h2d_bytes_per_s=3e7, d2h_bytes_per_s=2e7, latency_s=1e-4, duplex=True),
    # kernels and copies slow each other (Note [Contention]), more than the simulated GPUs' 5%
    "contended": CostModel(h2d_bytes_per_s=3e7, d2h_bytes_per_s=2e7, latency_s=1e-4, duplex=True, contention=0.3),
    "contended-one-channel": CostModel(h2d_bytes_per_s=3e7, d2h_bytes_per_s=3e7, contention=0.3),
    # every copy on the executor's thread, and each swap's issue too (cpu with the kernels on
    # every core: Note [Issue cost])
    "inline": CostModel(h2d_bytes_per_s=3e7, d2h_bytes_per_s=3e7, issue_s=2e-5, inline_nbytes=sys.maxsize),
    # the small copies on that thread, the larger ones on the channel
    "inline-small": CostModel(h2d_bytes_per_s=3e7, d2h_bytes_per_s=2e7, latency_s=1e-4, issue_s=2e-5,
                              inline_nbytes=4096),
    # no room on the host: every swap goes to the disk tier, whose copies take the channel even
    # where a host copy would have been made on the executor's thread
    "inline-disk": CostModel(h2d_bytes_per_s=3e7, d2h_bytes_per_s=3e7, issue_s=2e-5, inline_nbytes=sys.maxsize,
                             host_budget_nbytes=0, disk_read_bytes_per_s=3e7, disk_write_bytes_per_s=3e7),
}
#: the timelines small enough for the mixed-integer program
SMALL = ("cnn", "mlp-two-jobs")
PLANNERS = (plan_tensile, plan_global, plan_swap_score, plan_capuchin, plan_checkpoint)


def _sequence(spec, options, batch, seconds=1e-3) -> AccessSequence:
    seq = AccessSequence(build_training_program(spec, options, batch))
    for p in range(len(seq.program.ops)):
        seq.record(p, seconds * (1 + p % 3))
    seq.end_iteration()
    return seq


@pytest.fixture(scope="module")
def timelines() -> dict[str, Timeline]:
    """One small CNN; two MLP jobs, one at half the pace, out of phase; the CNN beside an MLP
    that runs two iterations per period."""
    mlp_options = TrainOptions(epochs=2, batch_size=64, optimizer="adam", lr=0.005, seed=11)
    cnn = _sequence(CNN, TrainOptions(optimizer="adam"), 6)
    mlp = _sequence(MLP, mlp_options, 64)
    return {
        "cnn": Timeline([JobTrace(1, cnn)]),
        "mlp-two-jobs": Timeline([JobTrace(1, mlp, 0, 0), JobTrace(2, _sequence(MLP, mlp_options, 64, 2e-3), 7, 1)]),
        "cnn-and-mlp-twice": Timeline([JobTrace(1, cnn, 0, 0), JobTrace(2, mlp, 5, 1, repeats=2)]),
    }


def _floor_nbytes(tl: Timeline) -> int:
    """The most bytes the op of any event accesses: no plan can hold less there."""
    accessed = np.zeros(tl.n, dtype=np.int64)
    for t in tl.tensors:
        for q in t.positions:
            accessed[tl.index[(t.job_id, q)]] += t.nbytes
    return int(accessed.max())


@pytest.mark.parametrize("name", ["cnn", "mlp-two-jobs", "cnn-and-mlp-twice"])
def test_absences_are_the_planners_gaps(timelines, name):
    tl = timelines[name]
    found = absences(tl)
    rows = _State(tl, COSTS["fast"])._rows
    assert len(found) == len(rows) > 0
    key = lambda tensor, a, b, nbytes, recipe_s: sorted(zip(tensor.tolist(), a.tolist(), b.tolist(), nbytes.tolist(),
                                                             np.nan_to_num(recipe_s, nan=-1.0).tolist()))
    assert key(found.tensor, found.a, found.b, found.nbytes, found.recipe_s) == \
        key(rows["order"] >> 32, rows["a"], rows["b"], rows["nbytes"], rows["recipe_s"])
    assert (~np.isnan(found.recipe_s)).any() and np.isnan(found.recipe_s).any()


@pytest.mark.parametrize("name", ["cnn", "cnn-and-mlp-twice"])
def test_no_extra_time_where_the_vanilla_peak_meets_the_target(timelines, name):
    tl = timelines[name]
    for target in (tl.vanilla_peak_nbytes(), tl.vanilla_peak_nbytes() + 1):
        bound = lower_bound(tl, COSTS["slow"], target)
        assert bound.extra_s == 0.0 and bound.feasible and bound.solves == 0
        assert bound.swap.shape == bound.recompute.shape == (len(bound.absences),)


@pytest.mark.parametrize("name", ["cnn", "mlp-two-jobs", "cnn-and-mlp-twice"])
def test_infinite_exactly_below_what_freeing_every_absence_allows(timelines, name):
    tl = timelines[name]
    floor = _floor_nbytes(tl)
    below = lower_bound(tl, COSTS["slow"], floor - 1)
    assert below.extra_s == math.inf and not below.feasible and below.solves == 0
    at = lower_bound(tl, COSTS["slow"], floor)
    assert at.feasible and at.extra_s > 0


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("cost", list(COSTS))
def test_whole_swaps_and_recomputes_never_lower_the_bound(timelines, name, cost):
    tl = timelines[name]
    positive = 0
    for fraction in (0.7, 0.5):
        target = max(int(fraction * tl.vanilla_peak_nbytes()), _floor_nbytes(tl))
        linear = lower_bound(tl, COSTS[cost], target)
        whole = lower_bound(tl, COSTS[cost], target, integer=True)
        assert whole.integer and not linear.integer
        assert whole.extra_s >= linear.extra_s - 1e-9 * linear.compute_s
        positive += linear.extra_s > 0
    if cost == "slow":
        assert positive


@pytest.mark.parametrize("name", ["cnn", "mlp-two-jobs", "cnn-and-mlp-twice"])
@pytest.mark.parametrize("cost", list(COSTS))
def test_no_plan_that_meets_the_target_beats_the_bound(timelines, name, cost):
    tl = timelines[name]
    checked = 0
    for fraction in (0.7, 0.5, 0.35):
        target = int(fraction * tl.vanilla_peak_nbytes())
        bounds = [lower_bound(tl, COSTS[cost], target)]
        if name in SMALL:
            bounds.append(lower_bound(tl, COSTS[cost], target, integer=True))
        for planner in PLANNERS:
            plan = planner(tl, COSTS[cost], target, None)
            if plan.predicted_peak_nbytes > target:
                continue
            checked += 1
            for bound in bounds:
                assert bound.extra_s <= plan.predicted_extra_s + 1e-9 * bound.compute_s, \
                    f"{plan.policy} at {fraction:.0%}: {plan.predicted_extra_s} s < bound {bound.extra_s} s"
    assert checked >= 3


@pytest.mark.parametrize("name", ["mlp-two-jobs", "cnn-and-mlp-twice"])
def test_a_lower_target_never_gives_a_smaller_bound(timelines, name):
    tl = timelines[name]
    cost = COSTS["slow"]
    previous = 0.0
    for fraction in (1.0, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3):
        bound = lower_bound(tl, cost, max(int(fraction * tl.vanilla_peak_nbytes()), _floor_nbytes(tl)))
        # the reported value is the lower end of an interval of the tolerance around the bound
        assert bound.extra_s >= previous - 1e-4 * bound.compute_s
        previous = bound.extra_s
    assert previous > 0


@pytest.mark.parametrize("name", ["cnn", "cnn-and-mlp-twice"])
def test_free_copies_cost_nothing_and_slow_ones_do(timelines, name):
    tl = timelines[name]
    target = int(0.7 * tl.vanilla_peak_nbytes())
    free = CostModel(h2d_bytes_per_s=1e30, d2h_bytes_per_s=1e30, duplex=True)
    assert lower_bound(tl, free, target).extra_s == 0.0
    assert lower_bound(tl, COSTS["slow"], target).extra_s > 0


@pytest.mark.parametrize("name", ["cnn", "mlp-two-jobs", "cnn-and-mlp-twice"])
def test_contention_never_lowers_the_bound_and_raises_it_where_copies_are_needed(timelines, name):
    tl = timelines[name]
    plain, contended = COSTS["duplex"], COSTS["contended"]
    raised = 0
    for fraction in (0.7, 0.5, 0.35):
        target = max(int(fraction * tl.vanilla_peak_nbytes()), _floor_nbytes(tl))
        without, with_ = lower_bound(tl, plain, target), lower_bound(tl, contended, target)
        assert with_.extra_s >= without.extra_s - 1e-4 * without.compute_s
        # where the relaxed plan copies, the kernels beside the copies lose c / (1 + c) of them
        copies_s = float((with_.swap * plain.swap_out_s(with_.absences.nbytes)).sum())
        raised += with_.extra_s > without.extra_s + 1e-3 * without.compute_s and copies_s > 0
    assert raised


@pytest.mark.parametrize("name", ["cnn", "mlp-two-jobs", "cnn-and-mlp-twice"])
def test_a_swap_s_own_seconds_on_the_compute_stream_count_whole(timelines, name):
    # where the copies are made on the compute stream no engine hides them: the relaxed plan's
    # swaps cost their issues and copies in full, recomputes their recipes, and the bound is at
    # least that; copies as fast on an engine of their own cost only their issues
    tl = timelines[name]
    inline = COSTS["inline"]
    engine = CostModel(h2d_bytes_per_s=inline.h2d_bytes_per_s, d2h_bytes_per_s=inline.d2h_bytes_per_s,
                       issue_s=inline.issue_s)
    raised = 0
    for fraction in (0.7, 0.5):
        target = max(int(fraction * tl.vanilla_peak_nbytes()), _floor_nbytes(tl))
        bound, hidden = lower_bound(tl, inline, target), lower_bound(tl, engine, target)
        gaps = bound.absences
        own_s = 2 * inline.issue_s + inline.swap_out_s(gaps.nbytes) + inline.swap_in_s(gaps.nbytes)
        paid_s = float((bound.swap * own_s).sum() + (bound.recompute * np.nan_to_num(gaps.recipe_s)).sum())
        assert bound.extra_s >= paid_s * (1 - 1e-6) - TOLERANCE * bound.compute_s
        assert hidden.extra_s >= float((hidden.swap * 2 * inline.issue_s).sum()) * (1 - 1e-6) - \
            TOLERANCE * hidden.compute_s
        assert bound.extra_s >= hidden.extra_s - TOLERANCE * bound.compute_s
        raised += bound.extra_s > hidden.extra_s + 0.01 * bound.compute_s
    assert raised


def test_the_guide_frees_the_peak(timelines):
    tl = timelines["cnn-and-mlp-twice"]
    target = int(0.5 * tl.vanilla_peak_nbytes())
    bound = lower_bound(tl, COSTS["slow"], target)
    assert bound.extra_s > 0
    for share in (bound.swap, bound.recompute):
        assert ((share >= 0) & (share <= 1)).all()
    assert (bound.swap + bound.recompute <= 1 + 1e-9).all()
    assert np.isnan(bound.absences.recipe_s[bound.recompute > 0]).sum() == 0
    # every absence that frees the peak spans it, so the bytes of those that span it suffice
    gaps, k = bound.absences, int(np.argmax(tl.usage([])))
    spans = (k - gaps.a) % tl.n
    spans = (spans > 0) & (spans < np.where(gaps.a == gaps.b, tl.n, (gaps.b - gaps.a) % tl.n))
    freed = ((bound.swap + bound.recompute) * gaps.nbytes)[spans].sum()
    assert freed >= (tl.usage([])[k] - target) * (1 - 1e-6)


def test_the_same_call_gives_the_same_answer(timelines):
    tl = timelines["cnn-and-mlp-twice"]
    target = int(0.5 * tl.vanilla_peak_nbytes())
    first, again = (lower_bound(tl, COSTS["duplex"], target) for _ in range(2))
    assert (first.extra_s, first.solves, first.iterations) == (again.extra_s, again.solves, again.iterations)
    assert np.array_equal(first.swap, again.swap) and np.array_equal(first.recompute, again.recompute)
    assert first.eor == first.extra_s / first.compute_s and first.compute_s == tl.durations_s.sum()


def test_a_negative_target_or_tolerance_is_refused(timelines):
    tl = timelines["cnn"]
    with pytest.raises(InvalidArgument, match="negative"):
        lower_bound(tl, COSTS["fast"], -1)
    with pytest.raises(InvalidArgument, match="not positive"):
        lower_bound(tl, COSTS["fast"], tl.vanilla_peak_nbytes() // 2, tolerance_s=0.0)
