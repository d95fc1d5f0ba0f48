"""The baseline planners (``tensile_db.scheduler.baselines``), checked by rules on MLP and CNN timelines.

- every plan is valid: no absence covers an access of its tensor, a swap's swap-out, release,
  swap-in and next access come in that order, a recompute's recipe inputs are resident where it
  runs, and planning is deterministic;
- Capuchin reaches a target wherever TENSILE's planner does, swaps first the absence with the
  largest free time, and recomputes by MSPS when no swap can hide;
- checkpointing keeps the boundaries of about ``sqrt(n)`` segments, drops the rest of each where
  exactly recomputable, and its predicted memory equals a replay of the runtime's nested
  recomputes op by op;
- TENSILE as published plans each job alone against its share of the target, and its combined
  peak stays within the sum of the shares.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from job_helpers import FAST, SLOW, assert_valid, sequence
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions
from tensile_db.runtime.program import Kind
from tensile_db.scheduler.baselines import (
    BASELINE_PLANNERS,
    checkpoint_segments,
    plan_capuchin,
    plan_checkpoint,
    plan_tensile_published,
)
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.planners import plan_tensile
from tensile_db.scheduler.timeline import JobTrace, Timeline, simulate

#: copies far slower than any op: no swap hides
CRAWL = CostModel(h2d_bytes_per_s=1e3, d2h_bytes_per_s=1e3)

CNN = ModelSpec.parse({"input": {"shape": [1, 8, 8]}, "layers": [
    {"conv": 4, "padding": 1, "bias": False, "activation": "none"}, {"batch_norm": {}, "activation": "relu"},
    {"residual": [{"conv": 4, "padding": 1}, {"conv": 4, "padding": 1, "activation": "none"}], "activation": "relu"},
    {"max_pool": 2}, {"conv": 8, "padding": 1, "activation": "tanh"}, {"dense": 10}]}, 64, 10, "classification")

#: an MLP deep enough for segments of three
DEEP = ModelSpec(Architecture(tuple(Layer(24 - 2 * i, "relu") for i in range(6))), 16, 4, "classification")


def cnn_sequence(seconds=1e-3):
    return sequence(CNN, TrainOptions(optimizer="adam"), batch=6, seconds=seconds)


def deep_sequence():
    return sequence(DEEP)


def timelines() -> dict[str, Timeline]:
    cnn = cnn_sequence()
    return {
        "mlp-two-jobs": Timeline([JobTrace(1, sequence(), 0, 0), JobTrace(2, sequence(seconds=2e-3), 7, 1)]),
        "cnn": Timeline([JobTrace(1, cnn)]),
        "cnn-and-mlp-twice": Timeline([JobTrace(1, cnn, 0, 0), JobTrace(2, sequence(), 5, 1, repeats=2)]),
    }


def _assert_ordered(plan, timeline: Timeline) -> None:
    """Swaps: a < free < back <= b, cyclically from a; recomputes: absent from a + 1 to b; and a
    recompute's recipe inputs are not absent at the event where it runs."""
    n = timeline.n
    for d in plan.decisions:
        span = timeline.cyclic(d.a, d.b) or n
        if d.method == "swap":
            assert 0 < timeline.cyclic(d.a, d.free) < timeline.cyclic(d.a, d.back) <= span, d
        else:
            assert (d.free, d.back) == ((d.a + 1) % n, d.b) and d.recipe_s > 0, d
            for other in plan.decisions:
                if other.job_id == d.job_id and other.slot in d.recipe_inputs:
                    start, length = other.window(n)
                    assert timeline.cyclic(start, d.b) >= length, f"{other.slot} absent at the recompute of {d.slot}"


@pytest.mark.parametrize("name", list(BASELINE_PLANNERS))
@pytest.mark.parametrize("cost", [FAST, SLOW], ids=["fast", "slow"])
def test_every_baseline_plan_is_valid_and_deterministic(name, cost):
    planner = BASELINE_PLANNERS[name]
    for tl in timelines().values():
        target = int(0.6 * tl.vanilla_peak_nbytes())
        plan = planner(tl, cost, target)
        assert plan.policy == name and plan.decisions
        assert_valid(plan, tl)
        _assert_ordered(plan, tl)
        assert plan.predicted_peak_nbytes == tl.usage(plan.decisions).max()
        if name != "checkpoint":    # a fixed strategy: its recomputes' workspaces can raise the peak
            assert plan.predicted_peak_nbytes < plan.vanilla_peak_nbytes
        assert planner(tl, cost, target, None).decisions == plan.decisions      # the scheduler's call


# --- Capuchin ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, fraction", [("mlp-two-jobs", 0.7), ("mlp-two-jobs", 0.5), ("cnn", 0.7),
                                            ("cnn-and-mlp-twice", 0.7), ("cnn-and-mlp-twice", 0.5)])
@pytest.mark.parametrize("cost", [FAST, SLOW], ids=["fast", "slow"])
def test_capuchin_reaches_the_target_where_tensile_does(name, fraction, cost):
    tl = timelines()[name]
    target = int(fraction * tl.vanilla_peak_nbytes())
    assert plan_tensile(tl, cost, target).predicted_peak_nbytes <= target
    plan = plan_capuchin(tl, cost, target)
    assert plan.predicted_peak_nbytes <= target


def _absences_at_peak(tl: Timeline):
    """(tensor, event before, event after) of every absence that spans the vanilla peak."""
    k = int(np.argmax(tl.usage([])))
    for t in tl.tensors:
        events = [tl.index[(t.job_id, q)] for q in t.positions]
        pairs = list(zip(events, events[1:])) + ([(events[-1], events[0])] if t.persistent else [])
        for a, b in pairs:
            if 0 < tl.cyclic(a, k) < (tl.cyclic(a, b) or tl.n):
                yield t, a, b


def test_capuchin_swaps_first_the_absence_with_the_largest_free_time():
    tl = timelines()["mlp-two-jobs"]
    measured = simulate(tl, [], FAST)

    def free_time_s(t, a, b):
        back_s = measured.start_s[b] + (measured.period_s if b <= a else 0.0)
        return back_s - measured.start_s[a] - tl.durations_s[a] - FAST.swap_out_s(t.nbytes) - FAST.swap_in_s(t.nbytes)

    plan = plan_capuchin(tl, FAST, int(0.7 * tl.vanilla_peak_nbytes()))
    assert {d.method for d in plan.decisions} == {"swap"}            # fast copies hide everywhere
    first = plan.decisions[0]
    free_times = {(t.job_id, t.slot, a): free_time_s(t, a, b) for t, a, b in _absences_at_peak(tl)}
    assert free_times[(first.job_id, first.slot, first.a)] == pytest.approx(max(free_times.values()))


def test_capuchin_recomputes_by_msps_when_no_swap_hides():
    tl = Timeline([JobTrace(1, sequence())])
    prog, times_s = tl.program(1), tl.traces[1].sequence.times_s
    msps = {t.slot: t.nbytes / sum(times_s[p] for p in prog.recipe(t.slot))
            for t, a, b in _absences_at_peak(tl) if prog.recipe(t.slot) is not None}
    assert len(msps) >= 2
    plan = plan_capuchin(tl, CRAWL, int(0.8 * tl.vanilla_peak_nbytes()))
    first = plan.decisions[0]
    assert first.method == "recompute" and msps[first.slot] == max(msps.values())
    assert {d.method for d in plan.decisions} == {"recompute", "swap"}    # swaps once no recompute is left


# --- checkpointing ----------------------------------------------------------------------------


@pytest.mark.parametrize("make", [sequence, deep_sequence, cnn_sequence], ids=["mlp", "deep-mlp", "cnn"])
@pytest.mark.parametrize("repeats", [1, 2])
def test_checkpoint_drops_the_inside_of_sqrt_n_segments(make, repeats):
    seq = make()
    prog = seq.program
    tl = Timeline([JobTrace(1, seq, repeats=repeats)])
    first_backward = next(i for i, op in enumerate(prog.ops) if "backward" in op.name)
    recomputable = {s for s, slot in prog.slots.items() if slot.kind is Kind.ACTIVATION
                    and prog.positions[s][0] < first_backward <= prog.positions[s][-1] and prog.recipe(s)}
    segments = checkpoint_segments(prog)
    chain = [s for segment in segments for s in segment]
    n, size = len(chain), math.ceil(math.sqrt(len(chain)))
    assert set(chain) == recomputable and n == len(recomputable) >= 4
    assert [prog.positions[s][0] for s in chain] == sorted(prog.positions[s][0] for s in chain)
    assert len(segments) == math.ceil(n / size) and all(len(s) == size for s in segments[:-1])

    plan = plan_checkpoint(tl, SLOW, target_nbytes=None)
    assert plan.decisions == plan_checkpoint(tl, SLOW, 1).decisions          # whatever the target
    assert {d.method for d in plan.decisions} == {"recompute"}
    for i in range(repeats):
        mine = [d for d in plan.decisions if tl.events[d.a][1] // len(prog.ops) == i]
        assert sorted(d.slot for d in mine) == sorted(s for segment in segments for s in segment[:-1])
        for d in mine:
            q = tl.events[d.a][1] % len(prog.ops)
            assert q == max(p for p in prog.positions[d.slot] if p < first_backward)   # after the forward pass
    # the dropped tensors free their bytes; a recompute's workspaces take some back at its event
    assert plan.predicted_peak_nbytes <= plan.vanilla_peak_nbytes + max(d.workspace_nbytes for d in plan.decisions)


def _replayed_usage(tl: Timeline, plan) -> list[int]:
    """Arena bytes at each event of a one-job timeline, replaying the ops the way a job runs them:
    a dropped tensor that an op (or a recompute) reads is recomputed first, by its recipe, and
    stays until its last access; persistent tensors always count."""
    (job_id,) = tl.traces
    prog = tl.program(job_id)
    n_ops = len(prog.ops)
    nbytes = {s: slot.arena_nbytes for s, slot in prog.slots.items()}
    persistent = sum(b for s, b in nbytes.items() if prog.slots[s].kind.persistent)
    drops = {}
    for d in plan.decisions:
        drops.setdefault(d.a, []).append(d.slot)
    held, dropped, usage = set(), set(), []

    def recompute(name):
        for p in prog.recipe(name):
            for s in prog.replay(p).reads:
                if s != name and s in dropped:
                    recompute(s)
        dropped.remove(name)
        held.add(name)

    for k, (_, q) in enumerate(tl.events):
        op = prog.ops[q % n_ops]
        for s in op.reads:
            if s in dropped:
                recompute(s)
        assert not set(op.accesses) & dropped
        held.update(s for s in op.writes if not prog.slots[s].kind.persistent)
        workspaces = sum(d.workspace_nbytes for d in plan.decisions if d.b == k)   # the replays', counted at b
        usage.append(persistent + sum(nbytes[s] for s in held) + workspaces)
        held.difference_update(prog.frees_after[q % n_ops])
        for s in drops.get(k, ()):
            held.remove(s)
            dropped.add(s)
    return usage


@pytest.mark.parametrize("make", [deep_sequence, cnn_sequence], ids=["deep-mlp", "cnn"])
@pytest.mark.parametrize("repeats", [1, 2])
def test_checkpoint_memory_is_what_nested_recomputes_hold(make, repeats):
    tl = Timeline([JobTrace(1, make(), repeats=repeats)])
    plan = plan_checkpoint(tl, FAST)
    n_ops = len(tl.program(1).ops)
    nested = [d for d in plan.decisions if tl.events[d.b][1] % n_ops not in tl.program(1).positions[d.slot]]
    assert nested, "expected a tensor brought back by the recompute of a later one"
    assert _replayed_usage(tl, plan) == tl.usage(plan.decisions).tolist()


# --- TENSILE as published ---------------------------------------------------------------------


@pytest.mark.parametrize("cost", [FAST, SLOW], ids=["fast", "slow"])
def test_tensile_published_is_each_job_planned_alone_against_its_share(cost):
    traces = [JobTrace(1, cnn_sequence(), 0, 0), JobTrace(2, sequence(seconds=2e-3), 9, 1, repeats=2)]
    tl = Timeline(traces)
    target = int(0.8 * tl.vanilla_peak_nbytes())
    alone = {t.job_id: Timeline([JobTrace(t.job_id, t.sequence, repeats=t.repeats)]) for t in traces}
    peaks = {j: a.vanilla_peak_nbytes() for j, a in alone.items()}
    shares = {j: target * p // sum(peaks.values()) for j, p in peaks.items()}
    assert sum(shares.values()) <= target

    def by_position(decisions, timeline):
        """Decisions by period position; a recompute's free is implied (the event after its a)."""
        return sorted((d.job_id, d.slot, d.method, *(timeline.events[e] for e in (d.a, d.b, d.back)),
                       timeline.events[d.free] if d.method == "swap" else None) for d in decisions)

    plan = plan_tensile_published(tl, cost, target)
    expected, alone_peaks = [], 0
    for j, a in alone.items():
        own = plan_tensile(a, cost, shares[j], None, widen=False)
        assert own.predicted_peak_nbytes <= shares[j]
        expected += by_position(own.decisions, a)
        alone_peaks += own.predicted_peak_nbytes
    assert by_position(plan.decisions, tl) == sorted(expected)
    assert plan.predicted_peak_nbytes <= alone_peaks <= sum(shares.values())
