"""The global planner (``tensile_db.scheduler.curves``), the planners' counted work
(``tensile_db.scheduler.work``) and paid planning on the simulated device.

- jobs of one program share one curve, kept across re-plans; a curve's peaks fall and its
  decisions are a valid plan of the job alone;
- the combination reaches a target the greedy reaches, on jobs in different phases; a target
  under the largest working set holds each event to the target raised to its own op's;
- the counted work grows with the timeline and the model prices it;
- on the simulated device a plan is installed only once its modelled planning time has passed on
  the virtual clock;
- a job in its cold start gets op times predicted from other jobs' measured ops, and is planned
  with them when it arrives.
"""

from __future__ import annotations

import unittest.mock

import numpy as np
import pytest

from job_helpers import FAST, SLOW, assert_valid, image_job, make_job, run_sim, sequence
from tensile_db.runtime import builder
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions
from tensile_db.runtime.simulated import SimDevice
from tensile_db.scheduler import curves
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.curves import CurveBuilder, job_curve, plan_global
from tensile_db.scheduler.planners import _greedy_steps, _State, peak_above, plan_tensile, tensile_choice
from tensile_db.scheduler.timeline import JobTrace, Timeline
from tensile_db.scheduler.trace import AccessSequence, estimated
from tensile_db.scheduler.work import PLAN_OVERHEAD_S, SECONDS_PER_UNIT, PlanWork


def adam_mlp(seconds: float) -> AccessSequence:
    """The access sequence of an MLP whose largest working set is Adam's step on a 512 x 512 layer
    (4 MiB; 64-512-512-256-10, batch 128; every step in one group), each op taking ``seconds``."""
    spec = ModelSpec(Architecture((Layer(512, "relu"), Layer(512, "relu"), Layer(256, "relu"))), 64, 10,
                     "classification")
    with unittest.mock.patch.object(builder, "MAX_SUBGROUPS", 1):
        return sequence(spec, TrainOptions(epochs=1, batch_size=128, optimizer="adam", seed=0), 128, seconds)


def test_jobs_of_one_program_share_one_curve_across_replans():
    seq = sequence()
    memo = {}
    tl = Timeline([JobTrace(1, seq, 0, 0), JobTrace(2, seq.snapshot(), 9, 1)])
    plan = plan_global(tl, FAST, int(0.6 * tl.vanilla_peak_nbytes()), memo=memo)
    assert len(memo) == 1
    assert_valid(plan, tl)                              # each job's decisions are its own
    assert {d.job_id for d in plan.decisions} == {1, 2}
    again = Timeline([JobTrace(1, seq, 0, 0), JobTrace(2, seq.snapshot(), 9, 1), JobTrace(3, seq.snapshot(), 3, 2)])
    cold = Timeline(list(again.traces.values()))
    plan_global(again, FAST, int(0.6 * again.vanilla_peak_nbytes()), memo=memo)
    plan_global(cold, FAST, int(0.6 * cold.vanilla_peak_nbytes()), memo={})
    assert len(memo) == 1
    assert again.work.decisions < cold.work.decisions       # the kept curve is not planned again


def test_a_curve_lowers_its_peak_step_by_step_with_valid_decisions():
    trace = JobTrace(1, sequence())
    curve = job_curve(trace, FAST)
    assert len(curve.decisions) > 0 and len(curve.peak_nbytes) == len(curve.decisions) + 1
    assert curve.peak_nbytes[-1] < curve.peak_nbytes[0]
    assert np.all(np.diff(curve.peak_nbytes) <= 0)
    alone = Timeline([trace])
    assert int(alone.usage(curve.plan()).max()) == curve.peak_nbytes[-1]
    for i in range(len(curve.decisions) + 1):
        assert int(alone.usage(curve.plan(i)).max()) == curve.peak_nbytes[i]


@pytest.mark.parametrize("seconds", [1e-5, 1e-4])
def test_a_target_under_the_largest_working_set_is_kept_wherever_the_ops_allow(seconds):
    """The MLP whose largest working set is Adam's step on a 512 x 512 layer (4 MiB), with a
    target 3% under it (Note [Targets under the floor]): each event's target is raised to its own
    op's working set only, and the plan reaches every one, where a plan at the floor leaves
    events above them; its peak is the floor, at Adam's step."""
    seq = adam_mlp(seconds)
    floor = seq.program.min_working_set_nbytes
    target = int(0.97 * floor)
    tl = Timeline([JobTrace(1, seq)])
    targets = tl.targets(target)
    assert tl.floor_nbytes.tolist() == [seq.program.working_set_nbytes(q) for _, q in tl.events]
    assert targets.tolist() == [max(target, ws) for ws in tl.floor_nbytes.tolist()] and targets.max() == floor
    at_floor, under = plan_global(tl, FAST, floor), plan_global(tl, FAST, target)
    assert_valid(under, tl)
    assert np.count_nonzero(tl.usage(at_floor.decisions) > targets) > 0
    assert np.all(tl.usage(under.decisions) <= targets) and not under.partial
    assert under.predicted_peak_nbytes == floor


def test_the_peak_above_a_per_event_target_leaves_out_the_events_passed_over():
    use = np.array([10, 50, 40, 30], dtype=np.int64)
    assert peak_above(use, 35, np.zeros(4, dtype=bool)) == (1, 15)
    assert peak_above(use, 50, np.zeros(4, dtype=bool)) is None
    targets = np.array([5, 45, 20, 30], dtype=np.int64)
    passed = np.zeros(4, dtype=bool)
    assert peak_above(use, targets, passed) == (1, 5)               # the fullest above its own target
    passed[1] = True
    assert peak_above(use, targets, passed) == (2, 20)
    passed[2] = True
    assert peak_above(use, targets, passed) == (0, 5)
    passed[0] = True
    assert peak_above(use, targets, passed) is None


def test_an_event_out_of_reach_is_passed_over_and_the_others_still_freed(monkeypatch):
    """Per-event targets: the greedy and the combination pass over an event nothing frees (here
    the first peak, refused by a stub) instead of ending the plan, and never come back to it."""
    seq = adam_mlp(1e-4)
    tl = Timeline([JobTrace(1, seq)])
    targets = tl.targets(int(0.97 * seq.program.min_working_set_nbytes))
    state, asked = _State(tl, FAST), []
    choice = tensile_choice(FAST, targets)

    def refusing_the_first(state, gaps, k):
        asked.append(k)
        return None if k == asked[0] else choice(state, gaps, k)

    taken = list(_greedy_steps(state, targets, refusing_the_first, None))
    assert taken and asked.count(asked[0]) == 1
    cheapest, first = curves._cheapest_step, []

    def no_step_for_the_first(timeline, carried, level, k, need):
        first.append(k) if not first else None
        return None if k == first[0] else cheapest(timeline, carried, level, k, need)

    monkeypatch.setattr(curves, "_cheapest_step", no_step_for_the_first)
    plan = plan_global(tl, FAST, int(0.97 * seq.program.min_working_set_nbytes))
    assert plan.decisions and np.count_nonzero(tl.usage(plan.decisions) <= targets) > tl.n // 2


def test_two_jobs_under_the_floor_are_held_to_each_events_target_where_their_curves_reach():
    """Two of the MLPs below, in different phases, with a target 3% under their largest working
    set: the plan passes over the events no curve frees and goes on with the others, where a
    plan at the floor stops at the first of them; a target at the floor takes the uniform path."""
    seq = adam_mlp(1e-4)
    floor = seq.program.min_working_set_nbytes

    def two() -> Timeline:
        return Timeline([JobTrace(1, seq, 0, 0), JobTrace(2, seq.snapshot(), 7, 1)])

    uniform = two()
    at_floor = plan_global(uniform, FAST, floor)
    assert "floor_nbytes" not in uniform.__dict__                   # no per-event target was made
    tl = two()
    under = plan_global(tl, FAST, int(0.97 * floor))
    assert_valid(under, tl)
    targets = tl.targets(int(0.97 * floor))
    held, held_at_floor = tl.usage(under.decisions) <= targets, tl.usage(at_floor.decisions) <= targets
    assert held.sum() > tl.n // 2 and held.sum() > held_at_floor.sum()
    assert under.predicted_peak_nbytes < at_floor.predicted_peak_nbytes


@pytest.mark.parametrize("seconds", [1e-5, 1e-4])
def test_a_plan_reaches_the_largest_working_set_by_widening_its_swaps(seconds):
    """An MLP whose largest working set is Adam's step on a 512 x 512 layer (4 MiB), planned
    down to it: the swaps taken for earlier peaks are re-timed (released sooner or swapped in
    later) to free the last ones, so the plan reaches the floor; each prefix of the curve is a
    valid plan with the peak it records."""
    seq = adam_mlp(seconds)
    floor = seq.program.min_working_set_nbytes
    tl = Timeline([JobTrace(1, seq)])
    plan = plan_global(tl, FAST, floor)
    assert_valid(plan, tl)
    assert plan.predicted_peak_nbytes == floor
    curve = job_curve(JobTrace(1, seq), FAST, depth=0.5)
    widened = [i for i, d in enumerate(curve.decisions)
               if any((e.slot, e.a) == (d.slot, d.a) for e in curve.decisions[:i])]
    assert widened and curve.peak_nbytes[-1] == floor
    alone = Timeline([JobTrace(1, seq)])
    for i in (widened[0], widened[0] + 1, len(curve.decisions)):
        steps = curve.plan(i)
        assert len({(d.slot, d.a) for d in steps}) == len(steps)
        assert int(alone.usage(steps).max()) == curve.peak_nbytes[i]


@pytest.mark.parametrize("fraction", [0.8, 0.6])
def test_the_combination_reaches_what_the_greedy_reaches_on_staggered_jobs(fraction):
    tl = Timeline([JobTrace(1, sequence(), 0, 0), JobTrace(2, sequence(seconds=2e-3), 11, 1, repeats=2)])
    target = int(fraction * tl.vanilla_peak_nbytes())
    greedy = plan_tensile(Timeline(list(tl.traces.values())), FAST, target, None)
    plan = plan_global(tl, FAST, target)
    assert_valid(plan, tl)
    assert greedy.predicted_peak_nbytes <= target
    assert plan.predicted_peak_nbytes <= target


@pytest.mark.parametrize("cost", [FAST, SLOW], ids=["fast", "slow"])
@pytest.mark.parametrize("budget_s", [None, 5e-3], ids=["whole", "partial"])
def test_the_global_plan_keeps_no_decision_that_the_others_make_redundant(cost, budget_s, monkeypatch):
    def timeline():
        return Timeline([JobTrace(1, sequence(), 0, 0), JobTrace(2, sequence(seconds=2e-3), 11, 1, repeats=2)])

    target = int(0.6 * timeline().vanilla_peak_nbytes())
    tl = timeline()
    plan = plan_global(tl, cost, target, budget_s=budget_s)
    assert_valid(plan, tl)
    assert plan.partial == (budget_s is not None)
    ceiling = max(target, plan.predicted_peak_nbytes)
    use = tl.usage(plan.decisions)
    for d in plan.decisions:                 # left out, each would put some event above the ceiling
        without = use.copy()
        tl.add_window(without, *d.window(tl.n), d.nbytes)
        without[d.b] -= d.workspace_nbytes
        assert without.max() > ceiling, f"{d} is redundant"
    monkeypatch.setattr(curves, "drop_redundant", lambda timeline, decisions, cost, ceiling: decisions)
    taken = plan_global(timeline(), cost, target, budget_s=budget_s)
    assert len(taken.decisions) > len(plan.decisions)
    assert plan.predicted_peak_nbytes <= max(target, taken.predicted_peak_nbytes)
    assert plan.predicted_extra_s <= taken.predicted_extra_s + 1e-12


@pytest.mark.parametrize("duplex", [False, True], ids=["one channel", "duplex"])
def test_the_global_plan_retimes_the_swaps_that_wait_on_the_copy_queue(duplex, monkeypatch):
    cost = CostModel(h2d_bytes_per_s=4e6, d2h_bytes_per_s=4e6, duplex=duplex)       # copies of ops' length

    def timeline():
        return Timeline([JobTrace(1, sequence(), 0, 0), JobTrace(2, sequence(seconds=2e-3), 11, 1, repeats=2)])

    target = int(0.5 * timeline().vanilla_peak_nbytes())
    tl = timeline()
    plan = plan_global(tl, cost, target)
    assert_valid(plan, tl)
    assert plan.predicted_peak_nbytes <= target
    monkeypatch.setattr(curves, "retime_swaps", lambda timeline, decisions, cost, ceiling: decisions)
    untimed = plan_global(timeline(), cost, target)
    assert plan.predicted_extra_s < untimed.predicted_extra_s
    assert len(plan.decisions) == len(untimed.decisions)
    moved = 0
    for d, u in zip(plan.decisions, untimed.decisions):
        assert (d.job_id, d.slot, d.method, d.a, d.b) == (u.job_id, u.slot, u.method, u.a, u.b)
        start, length = d.window(tl.n)
        u_start, u_length = u.window(tl.n)
        assert tl.cyclic(u_start, start) + length <= u_length       # released later, back earlier
        moved += (start, length) != (u_start, u_length)
    assert moved > 0


def test_a_timeline_of_one_job_computes_its_curve_only_a_few_decisions_ahead(monkeypatch):
    trace = JobTrace(1, sequence())
    target = int(0.6 * Timeline([trace]).vanilla_peak_nbytes())
    plans, curve_lengths, work = [], [], []
    for lookahead in (curves.LOOKAHEAD_ALONE, curves.LOOKAHEAD):
        monkeypatch.setattr(curves, "LOOKAHEAD_ALONE", lookahead)
        tl, memo = Timeline([trace]), {}
        plans.append(plan_global(tl, FAST, target, memo=memo))
        (builder,) = memo.values()
        curve_lengths.append(len(builder.curve.decisions))
        work.append(tl.work.decisions)
    assert plans[0].predicted_peak_nbytes <= target
    assert plans[0].decisions == plans[1].decisions                   # alone, the lookahead changes nothing
    assert curve_lengths[0] < curve_lengths[1] and work[0] < work[1]  # but costs work


def test_counted_work_grows_with_the_timeline_and_is_priced():
    small = Timeline([JobTrace(1, sequence())])
    large = Timeline([JobTrace(j, sequence(), 3 * j, j) for j in range(1, 4)])
    for tl in (small, large):
        plan_tensile(tl, FAST, int(0.6 * tl.vanilla_peak_nbytes()), None)
    assert all(large.work.counts()[u] >= small.work.counts()[u] for u in ("items", "events", "rows"))
    assert large.work.seconds() > small.work.seconds() > PLAN_OVERHEAD_S
    work = PlanWork(items=10, decisions=2)
    assert work.seconds() == pytest.approx(PLAN_OVERHEAD_S + 10 * SECONDS_PER_UNIT["items"]
                                           + 2 * SECONDS_PER_UNIT["decisions"])
    work.add(PlanWork(items=5))
    assert work.items == 15


def test_a_plan_on_the_simulated_device_takes_effect_after_its_planning_time():
    jobs = [image_job("resnet50", (3, 64, 64), 40, seed, width=0.25) for seed in (1, 2)]
    _, executor, _ = run_sim(jobs, 0.5, "tensile")
    history = executor.scheduler.history
    installed = [r for r in history if r["installed_s"] is not None]
    assert any(r["decisions"] for r in installed)
    for r in installed:
        assert r["installed_s"] >= r["asked_s"] + r["modelled_s"] - 1e-12
    assert executor.scheduler.modelled_plan_seconds == pytest.approx(sum(r["modelled_s"] for r in installed))


def _measured(jobs):
    """A ``tensile`` scheduler on a simulated H100 at half the jobs' combined peak, with ``jobs``
    admitted and measured (1 ms per op), and ``ask()``: a re-plan of them all at phase 0; it
    returns the request and its plan (made at once on the simulated device, installed later)."""
    from tensile_db.memory.manager import MemoryManager
    from tensile_db.scheduler import Scheduler

    device = SimDevice("h100", jitter=0.0)
    sched = Scheduler(MemoryManager(device, sum(j.vanilla_peak_nbytes for j in jobs) // 2), "tensile", FAST)
    n_ops = len(jobs[0].program.ops)
    for job in jobs:
        sched.admit(job)
        for p in range(n_ops):
            sched.after(job, p, 1e-3)
        sched.iteration_done(job)

    def ask():
        sched.replan({job.id: 0 for job in jobs}, len(jobs) * n_ops)
        return sched._request, sched._pending.result()[1]

    return sched, device, ask


def test_a_plan_superseded_while_being_made_is_installed_when_made():
    """One planning worker: a request superseded while being made still lands (its plan is
    fresher than the plan in force); one superseded before it started is called off."""
    job = make_job(seed=1)
    sched, device, ask = _measured([job])
    first, _ = ask()
    assert first.ready_s > device.now()
    device.clock.idle_until(first.started_s + first.modelled_s / 2)
    second, _ = ask()                                  # while the first is being made
    third, _ = ask()                                   # before the second started: called off
    assert third.started_s == pytest.approx(first.ready_s)
    assert not sched.poll() and sched.plan is None
    device.clock.idle_until(first.ready_s)
    assert sched.poll() and first.record["installed_s"] == device.now()
    installed = sched.plan
    assert installed is not None and job.id in installed.timeline.traces
    device.clock.idle_until(third.ready_s)
    assert sched.poll() and sched.plan is not installed
    assert third.record["installed_s"] == device.now() and second.record["installed_s"] is None
    assert sched.plans_made == 2
    sched.forget(job)
    sched.close()


def test_cold_start_times_are_estimated_from_other_models_measured_ops():
    device = SimDevice("h100", jitter=0.0)
    resnet, densenet = (image_job(m, (3, 64, 64), 1, 1, width=0.25).program for m in ("resnet50", "densenet121"))
    measured = AccessSequence(resnet)
    for position, op in enumerate(resnet.ops):
        measured.record(position, device.op_seconds(op))
    measured.end_iteration()
    guess = estimated(densenet, [measured])
    truth = np.array([device.op_seconds(op) for op in densenet.ops])
    assert guess.iterations == 0 and not guess.measured and np.all(guess.times_s > 0)
    assert guess.iteration_s == pytest.approx(truth.sum(), rel=0.25)
    assert estimated(densenet, []) is None


def test_an_arriving_job_is_planned_at_once_on_estimated_times():
    jobs = [image_job("resnet50", (3, 64, 64), 8, 1, width=0.25), image_job("densenet121", (3, 64, 64), 4, 2, width=0.25)]
    device = SimDevice("h100")
    jobs[1].arrival_s = 1.5 * sum(device.op_seconds(op) for op in jobs[0].program.ops)
    cold_plans = []

    def watch(executor):
        scheduler, make = executor.scheduler, executor.scheduler._make

        def made(request):
            out = make(request)
            sequence = scheduler.sequences.get(jobs[1].id)
            if out[1] is not None and sequence is not None and not sequence.measured:
                cold_plans.append(out[1])
            return out
        scheduler._make = made

    run_sim(jobs, 0.5, "tensile", setup=watch)
    assert any(jobs[1].id in plan.timeline.traces and any(d.job_id == jobs[1].id for d in plan.decisions)
               for plan in cold_plans)


def test_a_plan_stopped_by_its_curve_budget_is_partial_and_the_next_goes_on_along_the_same_curve():
    seq = sequence()

    def timeline():
        return Timeline([JobTrace(1, seq, 0, 0), JobTrace(2, seq.snapshot(), 9, 1)])

    target = int(0.6 * timeline().vanilla_peak_nbytes())
    memo, plans = {}, []
    while not plans or plans[-1].partial:
        plans.append(plan_global(timeline(), FAST, target, memo=memo, budget_s=1e-4))
        assert len(plans) < 500
    assert plans[0].partial and plans[0].predicted_peak_nbytes > target
    assert plans[-1].predicted_peak_nbytes <= target
    whole = {}
    plan_global(timeline(), FAST, target, memo=whole)           # the default budget: one plan
    (key, builder), = memo.items()
    shorter, longer = sorted((builder.curve.decisions, whole[key].curve.decisions), key=len)
    assert len(shorter) > 0 and longer[:len(shorter)] == shorter  # one curve, however it was split


def test_curve_work_refunded_is_charged_to_the_next_plan_that_extends_the_curve():
    builder = CurveBuilder(JobTrace(1, sequence()), FAST)
    first = PlanWork()
    assert builder.extend(3, first) and first.decisions == 3
    builder.refund(first)
    again = PlanWork()
    builder.extend(0, again)
    assert again.counts() == first.counts()


def test_a_partial_plan_asks_for_the_next_and_a_called_off_one_leaves_its_curve_work_owed(monkeypatch):
    monkeypatch.setattr(curves, "CURVE_WORK_S", 2e-4)
    sched, device, ask = _measured([make_job(seed=1), make_job(seed=2)])
    first, _ = ask()
    _, second = ask()                                  # while the first is being made
    (key, charge), = second.curve_work.items()
    taken = len(sched._curves[key].curve.decisions)
    third, third_plan = ask()                          # before the second started: called off
    assert charge.decisions > 0
    assert third_plan.curve_work[key].counts() == charge.counts()  # it pays the second's work, its budget
    assert len(sched._curves[key].curve.decisions) == taken         # and has none left for more
    device.clock.idle_until(third.ready_s)
    sched.replan_reasons.clear()
    assert sched.poll() and sched.plan.partial and first.record["installed_s"] is not None
    assert sched.replan_reasons == ["the last plan stopped at its budget"]
    sched.close()
