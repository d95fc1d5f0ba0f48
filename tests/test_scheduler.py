"""The planned scheduler: combined timeline, planners, fair sharing, and the invariants of execution.

Invariants checked on real runs of the executor on ``cpu``: the budget is never exceeded under
any policy; training under every policy gives the same losses and weights as unlimited memory,
bit for bit (recompute included); every tensor an op touches is resident when the op runs; plans
are re-made when jobs arrive and leave and no job is lost; the plan's predicted combined peak
matches the measured one within 2%; jobs of very different program lengths share the device by
time (the short one runs many iterations per period) while the combined timeline stays periodic.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from conftest import TEST_DEVICE
from job_helpers import FAST, OPTIONS, SLOW, SPEC, assert_valid, budget_of, make_job, run, sequence
from model_helpers import RESIDUAL_CNN as CNN
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobState, TrainingJob
from tensile_db.errors import InvalidArgument
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.devices import make_device
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions, parse_architecture
from tensile_db.runtime.program import Op
from tensile_db.scheduler import POLICIES
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.curves import plan_global
from tensile_db.scheduler.planners import (
    _greedy_steps,
    _State,
    plan_swap_score,
    plan_tensile,
    plan_vdnn,
    tensile_choice,
)
from tensile_db.scheduler.reactive import FarthestNextUse
from tensile_db.scheduler.timeline import (
    MAX_STRETCH,
    JobTrace,
    Simulator,
    Timeline,
    iterations_per_period,
    period_of,
    round_of,
    simulate,
)
from tensile_db.scheduler.trace import AccessSequence
from tensile_db.settings import UNPLANNED_POLICIES

# --- timeline ---------------------------------------------------------------------------------


def test_single_job_timeline_peak_is_the_program_peak():
    seq = sequence()
    tl = Timeline([JobTrace(1, seq)])
    assert tl.n == len(seq.program.ops) and tl.events[0] == (1, 0)
    assert tl.vanilla_peak_nbytes() == seq.program.vanilla_peak_nbytes()


def test_round_robin_order_and_phases():
    long_seq, short_seq = sequence(), sequence(ModelSpec(Architecture((Layer(8, "relu"),)), 16, 4, "classification"))
    n_long, n_short = len(long_seq.program.ops), len(short_seq.program.ops)
    tl = Timeline([JobTrace(1, long_seq, phase=0, order=0), JobTrace(2, short_seq, phase=5, order=1)])
    assert tl.period == n_long and tl.n == n_long + n_short
    rounds = {e: ((5 if e[0] == 2 else 0) + e[1] * n_long // (n_short if e[0] == 2 else n_long)) % n_long
              for e in tl.events}
    keys = [(rounds[e], e[0]) for e in tl.events]
    assert keys == sorted(keys)                       # by round, then admission order
    for job in (1, 2):
        positions = [p for j, p in tl.events if j == job]
        start = positions.index(0)
        assert positions[start:] + positions[:start] == sorted(positions)   # each job in program order


def test_combined_peak_of_shifted_jobs_is_below_the_sum_of_peaks():
    seq = sequence()
    peak = seq.program.vanilla_peak_nbytes()
    aligned = Timeline([JobTrace(1, seq, 0, 0), JobTrace(2, seq, 0, 1)])
    shifted = Timeline([JobTrace(1, seq, 0, 0), JobTrace(2, seq, tl_half(seq), 1)])
    assert peak < aligned.vanilla_peak_nbytes() <= 2 * peak
    assert shifted.vanilla_peak_nbytes() < aligned.vanilla_peak_nbytes()


def tl_half(seq: AccessSequence) -> int:
    return len(seq.program.ops) // 2


def test_simulation_without_decisions_has_no_extra_time():
    seq = sequence()
    sim = simulate(Timeline([JobTrace(1, seq)]), [], FAST)
    assert sim.extra_s == pytest.approx(0.0, abs=1e-12)
    assert sim.period_s == pytest.approx(float(np.sum(seq.times_s)))


@pytest.mark.parametrize("cost", [
    CostModel(h2d_bytes_per_s=4e6, d2h_bytes_per_s=4e6),                       # copies queue on one channel
    CostModel(h2d_bytes_per_s=4e6, d2h_bytes_per_s=2e6, duplex=True),
    CostModel(h2d_bytes_per_s=4e6, d2h_bytes_per_s=4e6, host_budget_nbytes=40_000,   # some swaps to disk
              disk_read_bytes_per_s=1e6, disk_write_bytes_per_s=1e6),
    CostModel(h2d_bytes_per_s=4e6, d2h_bytes_per_s=4e6, host_budget_nbytes=40_000,   # and small ones inline
              disk_read_bytes_per_s=1e6, disk_write_bytes_per_s=1e6, issue_s=2e-5, inline_nbytes=4096),
], ids=["one channel", "duplex", "tiers", "tiers, issued, inline"])
def test_a_trial_weighs_a_candidate_as_its_full_simulation_does(cost):
    # Simulator.extra_s, the planners' trial, skips the op start times; it must price every
    # candidate (swaps wrapping around the period, recomputes, copies to disk) as simulate does.
    timeline = Timeline([JobTrace(1, sequence(), 0, 0, 2), JobTrace(2, sequence(seconds=3e-3), 0, 1)])
    plan = plan_tensile(timeline, cost, int(0.5 * timeline.vanilla_peak_nbytes()), None)
    assert {d.method for d in plan.decisions} == {"swap", "recompute"}
    assert any(d.back <= d.a for d in plan.decisions if d.method == "swap")       # a wrapping swap
    for i, d in enumerate(plan.decisions):
        trial = Simulator(timeline, cost, plan.decisions[:i]).extra_s(also=d)
        full = simulate(timeline, plan.decisions[:i + 1], cost)
        assert trial == pytest.approx(full.extra_s, rel=1e-9, abs=1e-12)
    assert full.disk_nbytes > 0 if cost.host_budget_nbytes else full.disk_nbytes == 0

SMALL_SPEC = ModelSpec(Architecture((Layer(8, "relu"),)), 16, 4, "classification")


def test_iterations_per_period_give_each_job_about_the_same_time():
    n_ops = {1: 2407, 2: 13, 3: 13}
    repeats = iterations_per_period({1: 1.0, 2: 0.01, 3: 0.6}, n_ops)
    assert repeats == {1: 1, 2: 100, 3: 1}          # floor: never more than the slowest job's time
    assert period_of(repeats, n_ops) == 2407
    capped = iterations_per_period({1: 1.0, 2: 1e-9, 3: 0.0}, n_ops)
    assert capped[2] == capped[3] == MAX_STRETCH * 2407 // 13
    assert iterations_per_period({1: 2.0, 2: 2.0}, {1: 28, 2: 28}) == {1: 1, 2: 1}


def test_round_of_spreads_a_period_of_ops_over_the_rounds_in_order():
    for n_ops, period in ((13, 2407), (2407, 2407), (130, 2407), (7, 7)):
        rounds = [round_of(q, n_ops, period) for q in range(n_ops)]
        assert rounds[0] == 0 and rounds[-1] < period
        assert all(a < b for a, b in zip(rounds, rounds[1:]))   # at most one op of a job per round


def test_a_timeline_holds_every_iteration_of_the_period():
    long_seq, short_seq = sequence(), sequence(SMALL_SPEC)
    n_long, n_short = len(long_seq.program.ops), len(short_seq.program.ops)
    k = 5
    tl = Timeline([JobTrace(1, long_seq, 0, 0), JobTrace(2, short_seq, 3, 1, repeats=k)],
                  period=max(n_long, k * n_short))
    assert tl.n == n_long + k * n_short
    positions = [q for j, q in tl.events if j == 2]
    start = positions.index(0)
    assert positions[start:] + positions[:start] == list(range(k * n_short))   # iterations in order
    assert tl.durations_s[tl.index[(2, n_short + 1)]] == short_seq.times_s[1]
    for name, slot in short_seq.program.slots.items():
        mine = [t for t in tl.tensors if (t.job_id, t.slot) == (2, name)]
        if slot.kind.persistent:                     # one tensor accessed in every iteration
            assert len(mine) == 1 and len(mine[0].positions) == k * len(short_seq.program.positions[name])
        else:                                        # one lifetime per iteration
            assert [t.repeat for t in mine] == list(range(k))
            assert all(t.positions[-1] < (t.repeat + 1) * n_short for t in mine)
    # the short job alone: k lifetimes of each activation, one at a time, so the peak is one iteration's
    alone = Timeline([JobTrace(2, short_seq, repeats=k)])
    assert alone.vanilla_peak_nbytes() == short_seq.program.vanilla_peak_nbytes()


@pytest.mark.parametrize("planner", [plan_tensile, plan_global, plan_swap_score, plan_vdnn])
def test_planners_plan_every_iteration_of_a_job_in_the_period(planner):
    k = 3
    tl = Timeline([JobTrace(1, sequence(), 0, 0), JobTrace(2, sequence(seconds=2e-3), 7, 1, repeats=k)],
                  period=k * len(sequence().program.ops))
    target = int(0.6 * tl.vanilla_peak_nbytes())
    plan = planner(tl, FAST, target)
    assert_valid(plan, tl)
    n_prog = len(tl.program(2).ops)
    repeats = {q // n_prog for job, q in plan.after if job == 2}
    if planner is plan_vdnn:
        assert repeats == set(range(k))            # every layer input of every iteration
    else:
        assert plan.predicted_peak_nbytes <= target
        assert repeats                              # actions keyed by period position


def test_farthest_next_use_counts_rounds_of_the_device():
    short, long_ = build_training_program(SMALL_SPEC, OPTIONS, 64), build_training_program(SPEC, OPTIONS, 64)
    policy = FarthestNextUse()
    policy.track(1, short)
    policy.track(2, long_)
    policy.pace(1, 0.25)                             # four ops of the short job per round
    for job_id, program in ((1, short), (2, long_)):
        policy.advance(job_id, 0)

    class T:
        def __init__(self, job_id, slot):
            self.job_id, self.slot = job_id, slot

    w_short, w_long = short.ops[1].reads[1], long_.ops[1].reads[1]     # the first layer's weights
    assert policy(T(1, w_short)) == 0.25 * short.next_use(w_short, 0)
    assert policy(T(2, w_long)) == long_.next_use(w_long, 0)
    assert policy(T(3, w_long)) == math.inf


# --- planners ---------------------------------------------------------------------------------


@pytest.mark.parametrize("planner", [plan_tensile, plan_global, plan_swap_score])
@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_planners_reach_a_reachable_target(planner, fraction):
    seqs = [sequence(), sequence(seconds=2e-3)]
    tl = Timeline([JobTrace(1, seqs[0], 0, 0), JobTrace(2, seqs[1], 7, 1)])
    target = int(fraction * tl.vanilla_peak_nbytes())
    plan = planner(tl, FAST, target)
    assert_valid(plan, tl)
    assert plan.predicted_peak_nbytes <= target < plan.vanilla_peak_nbytes
    assert plan.predicted_peak_nbytes == tl.usage(plan.decisions).max()
    if planner is plan_swap_score:
        assert {d.method for d in plan.decisions} == {"swap"}


def test_tensile_recomputes_when_swaps_are_expensive():
    seq = sequence()
    tl = Timeline([JobTrace(1, seq)])
    plan = plan_tensile(tl, SLOW, int(0.7 * tl.vanilla_peak_nbytes()))
    assert_valid(plan, tl)
    recomputed = [d for d in plan.decisions if d.method == "recompute"]
    assert recomputed
    for d in recomputed:
        assert seq.program.recipe(d.slot) is not None
    fast = plan_tensile(tl, FAST, int(0.7 * tl.vanilla_peak_nbytes()))
    assert plan.predicted_extra_s >= fast.predicted_extra_s


def test_parameters_and_optimizer_state_swap_across_iterations_when_the_peak_needs_it():
    seq = sequence()
    tl = Timeline([JobTrace(1, seq)])
    plan = plan_tensile(tl, FAST, int(0.35 * tl.vanilla_peak_nbytes()))
    across = [d for d in plan.decisions if seq.program.slots[d.slot].kind.persistent and d.b <= d.a]
    assert across, "expected a weight or optimizer state swapped from one iteration to the next"


def test_tensile_weighs_the_swap_of_most_slack_at_every_peak():
    """The swaps whose copies have the most room around the others' (weights and optimizer state,
    absent from one step to the next forward pass) are small and were ranked after every large
    activation; the choice at each peak now adds no more simulated time per byte than the swap
    of most slack would."""
    tl = Timeline([JobTrace(1, sequence(CNN, TrainOptions(optimizer="adam"), batch=6))])
    target = int(0.7 * tl.vanilla_peak_nbytes())
    choice, steps = tensile_choice(SLOW, target), []

    def choose(state, gaps, k):
        chosen = choice(state, gaps, k)
        opt, base_s, need = state.options(gaps, k), state.sim.extra_s, int(state.use[k]) - target
        most_slack = opt.swap(int(np.lexsort((-opt.nbytes, -opt.slack_s))[0]))[0]
        steps.append([max(state.trial(d) - base_s, 0.0) / min(d.nbytes, need) for d in (chosen, most_slack)])
        return chosen

    state = _State(tl, SLOW)
    for _ in _greedy_steps(state, target, choose, None):
        pass
    assert state.use.max() <= target and len(steps) > 10
    assert all(chosen <= most_slack + 1e-15 for chosen, most_slack in steps), steps


def test_vdnn_swaps_every_layer_input():
    seq = sequence()
    tl = Timeline([JobTrace(1, seq)])
    plan = plan_vdnn(tl, FAST)
    assert_valid(plan, tl)
    inputs = {op.reads[0] for op in seq.program.ops if op.name.startswith("dense") and "backward" not in op.name}
    assert {d.slot for d in plan.decisions} == inputs
    assert {d.method for d in plan.decisions} == {"swap"}


def test_vdnn_swaps_the_input_of_every_convolution_too():
    arch = {"input": {"shape": [2, 8, 8]}, "layers": [
        {"conv": 4, "padding": 1}, {"conv": 4, "padding": 1}, {"max_pool": 2}, {"conv": 8}, {"dense": 6}]}
    spec = ModelSpec(parse_architecture(arch), 128, 3, "classification")
    seq = sequence(spec, TrainOptions(), batch=4)
    tl = Timeline([JobTrace(1, seq)])
    plan = plan_vdnn(tl, FAST)
    assert_valid(plan, tl)
    layers = [op for op in seq.program.ops if op.name.startswith(("conv", "dense")) and "backward" not in op.name]
    assert len(layers) == 5
    assert {d.slot for d in plan.decisions} == {op.reads[0] for op in layers}


def test_unknown_policy_is_refused():
    with pytest.raises(InvalidArgument, match="'belady'.*tensile"):
        Executor(MemoryManager(CpuDevice(), 1 << 20), policy="belady", cost=FAST)


# --- execution --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vanilla():
    jobs = [make_job(seed=s) for s in (1, 2)]
    mm, _ = run(jobs, 64 * sum(j.vanilla_peak_nbytes for j in jobs), "reactive")
    return jobs, mm.peak_nbytes


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_stays_in_budget_and_matches_vanilla_bit_for_bit(vanilla, policy):
    reference, _ = vanilla
    jobs = [make_job(seed=s) for s in (1, 2)]
    budget = budget_of(jobs, 0.5)
    mm, ex = run(jobs, budget, policy, check_residency=True)
    assert mm.peak_nbytes <= budget
    assert all(j.memory.peak_nbytes <= budget for j in jobs)
    assert sum(j.memory.swap_outs for j in jobs) > 0
    if policy == "checkpoint":          # recomputes only, whatever the budget; the fallback swaps
        assert ex.scheduler.plans_made > 0 and sum(j.memory.recomputes for j in jobs) > 0
    elif policy not in UNPLANNED_POLICIES:
        assert ex.scheduler.plans_made > 0 and sum(j.memory.planned_swap_ins for j in jobs) > 0
    for ref, job in zip(reference, jobs):
        assert job.loss == ref.loss
        for name, value in ref.result.items():
            assert np.array_equal(job.result[name], value), f"{policy}: {name} differs"


# a layer without activation feeding dropout: its output is freed before the dropout output's
# last use, so the dropout output must not be recomputed from it
DROPOUT_SPEC = ModelSpec(Architecture((Layer(64, "none", 0.3), Layer(48, "sigmoid", 0.1), Layer(32, "relu"))),
                         16, 4, "classification")


@pytest.mark.parametrize("spec", [SPEC, DROPOUT_SPEC], ids=["relu-tanh-relu", "none-dropout"])
def test_recompute_reproduces_values_exactly(spec):
    reference = [make_job(spec, seed=s) for s in (1, 2)]
    run(reference, 64 * sum(j.vanilla_peak_nbytes for j in reference), "reactive")
    jobs = [make_job(spec, seed=s) for s in (1, 2)]
    mm, _ = run(jobs, budget_of(jobs, 0.5), "tensile", cost=SLOW, check_residency=True)
    assert sum(j.memory.recomputes for j in jobs) > 0
    for ref, job in zip(reference, jobs):
        assert job.loss == ref.loss
        for name, value in ref.result.items():
            assert np.array_equal(job.result[name], value), f"{name} differs after recompute"


def test_a_failing_planner_leaves_the_jobs_running_reactively(monkeypatch, caplog):
    from tensile_db.scheduler import engine, worker

    def broken(timeline, cost, target, max_seconds):
        raise RuntimeError("planner bug")

    monkeypatch.setitem(worker.PLANNERS, "tensile", broken)
    monkeypatch.setattr(engine, "PROCESS_MIN_OPS", 10 ** 9)     # on the planning thread, which sees the patch
    jobs = [make_job(seed=s) for s in (1, 2)]
    mm, ex = run(jobs, budget_of(jobs, 0.5), "tensile")
    assert all(j.state is JobState.DONE for j in jobs)
    assert ex.scheduler.plans_made == 0 and "planner bug" in caplog.text


def test_replans_on_arrival_and_departure_without_losing_a_job():
    options = TrainOptions(epochs=3, batch_size=64, optimizer="adam", lr=0.005, seed=11)
    jobs = [make_job(options=options, seed=s) for s in (1, 2, 3)]

    def after_three_iterations(ex, started):     # the cold start and the first warm iteration measure it
        while started[-1].iterations < 3 and started[-1].state is not JobState.DONE:
            time.sleep(0.001)

    mm, ex = run(jobs, budget_of(jobs, 0.5), "tensile", between=after_three_iterations)
    reasons = [reason for record in ex.scheduler.history for reason in record["reasons"]]
    for job in jobs:
        assert job.state is JobState.DONE
        assert f"job {job.id} arrived" in reasons
        assert f"job {job.id} measured" in reasons or f"job {job.id} left" in reasons
    assert any(r.endswith("left") for r in reasons)
    assert reasons.index(f"job {jobs[1].id} arrived") > reasons.index(f"job {jobs[0].id} measured")
    assert sum(j.memory.planned_swap_ins for j in jobs) > 0


def test_large_timelines_and_pool_periods_are_planned_in_the_planning_process(monkeypatch):
    """On cpu, plans of timelines above the size limit come from the planning process (their
    programs are skeletons: kernels do not pickle) and so do the pool's offset plans; training
    gives the same results as with every plan made in a thread."""
    from tensile_db.memory import planned
    from tensile_db.scheduler import engine, worker

    options = TrainOptions(epochs=24, batch_size=64, optimizer="adam", lr=0.005, seed=11)
    reference = [make_job(options=options, seed=s) for s in (1, 2)]
    run(reference, budget_of(reference, 0.6), "tensile")
    monkeypatch.setattr(engine, "PROCESS_MIN_OPS", 0)
    monkeypatch.setattr(planned, "OFFLOAD_MIN_ALLOCATIONS", 0)
    monkeypatch.setattr(engine, "HERE_MAX_OPS", -1)         # none made where the executor waits
    monkeypatch.setattr(planned, "HERE_MAX_ALLOCATIONS", -1)
    jobs = [make_job(options=options, seed=s) for s in (1, 2)]
    process, sent, offloaded = worker.shared(), [], []
    process.start().result()                 # started: short jobs would end before its first plan
    submit = process.submit

    def plan_there(policy, traces, *args):
        sent.append(policy)
        return submit(policy, traces, *args)

    monkeypatch.setattr(process, "submit", plan_there)

    def watch(jobs, mm):
        offload = mm.pool.offload

        def count(fn, *args):
            offloaded.append(fn)
            return offload(fn, *args)

        mm.pool.offload = count

    mm, ex = run(jobs, budget_of(jobs, 0.6), "tensile", prepare=watch)
    assert sent and ex.scheduler.plans_made >= 1
    assert offloaded                         # (installed or not: re-plans may dissolve the pool meanwhile)
    for ref, job in zip(reference, jobs):
        assert job.loss == ref.loss
        for name, value in ref.result.items():
            assert np.array_equal(job.result[name], value), name


@pytest.mark.parametrize("small", [True, False], ids=["small: on the executor's thread", "larger: in the process"])
def test_where_the_executor_waits_for_its_plans_it_makes_the_small_ones_itself(small, monkeypatch):
    """Note [Plans the waiting thread makes]: where the kernels take every core, a timeline of at
    most ``HERE_MAX_OPS`` ops is planned on the executor's thread, and the planned pool's period of
    at most ``HERE_MAX_ALLOCATIONS`` allocations at the boundary that waits for it, with the
    curves the process keeps; larger ones go to the planning process. Training gives the same
    results either way."""
    import threading

    from tensile_db.memory import planned
    from tensile_db.runtime.device import CpuDevice
    from tensile_db.scheduler import engine, worker

    if TEST_DEVICE != "cpu":
        pytest.skip("the executor waits for its plans where a cpu device's kernels take every core")
    monkeypatch.setattr(CpuDevice, "kernels_on_every_core", property(lambda self: True))
    if not small:
        monkeypatch.setattr(engine, "HERE_MAX_OPS", -1)
        monkeypatch.setattr(planned, "HERE_MAX_ALLOCATIONS", -1)
    planners, made, offsets = [], engine.make_plan_with_kept_curves, planned.plan_smallest
    monkeypatch.setattr(engine, "make_plan_with_kept_curves",
                        lambda *a: planners.append(threading.current_thread().name) or made(*a))
    monkeypatch.setattr(planned, "plan_smallest",
                        lambda *a, **k: planners.append(threading.current_thread().name) or offsets(*a, **k))
    monkeypatch.setattr(worker, "_CURVES", {})
    process, sent = worker.shared(), []
    process.start().result()
    submit, call = process.submit, process.call
    monkeypatch.setattr(process, "submit", lambda *a: sent.append("plan") or submit(*a))
    monkeypatch.setattr(process, "call", lambda *a: sent.append("offsets") or call(*a))
    options = TrainOptions(epochs=6, batch_size=64, optimizer="adam", lr=0.005, seed=11)
    jobs = [make_job(options=options, seed=1)]
    mm, ex = run(jobs, budget_of(jobs, 0.5), "tensile")
    assert ex.scheduler.waits_for_plans and ex.scheduler.plans_made >= 1 and mm.pool.periods_served > 0
    if small:       # the global planner's curves kept in this process, for the next executor's plans
        assert not sent and planners and set(planners) == {ex._thread.name} and worker._CURVES
    else:
        assert {"plan", "offsets"} <= set(sent) and not planners and not worker._CURVES
    reference = [make_job(options=options, seed=1)]
    run(reference, budget_of(reference, 4.0), "tensile")
    assert jobs[0].loss == reference[0].loss


def test_a_plan_that_can_take_no_action_is_not_sent_to_the_planning_process(monkeypatch):
    """Under a budget above the jobs' peaks summed the global planner takes no action: such a
    plan is made on the planning thread, and the planning process is sent nothing to plan."""
    from tensile_db.scheduler import engine, worker

    monkeypatch.setattr(engine, "PROCESS_MIN_OPS", 0)
    process, sent = worker.shared(), []
    submit = process.submit

    def plan_there(policy, traces, *args):
        sent.append(policy)
        return submit(policy, traces, *args)

    monkeypatch.setattr(process, "submit", plan_there)
    jobs = [make_job(seed=s) for s in (1, 2)]
    mm, ex = run(jobs, budget_of(jobs, 4.0), "tensile")
    made = [r for r in ex.scheduler.history if r["decisions"] is not None and r["wall_s"] is not None]
    assert ex.scheduler.plans_made >= 1 and all(r["decisions"] == 0 for r in made)
    assert not sent


def test_predicted_peak_matches_the_measured_peak():
    options = TrainOptions(epochs=8, batch_size=64, optimizer="adam", lr=0.005, seed=11)
    jobs = [make_job(options=options, seed=s) for s in (1, 2)]
    # the plan predicts live bytes; a planned pool's region adds its packing (see test_planned)
    mm = MemoryManager(make_device(TEST_DEVICE), budget_of(jobs, 0.5), pool="general")
    ex = Executor(mm, policy="tensile", cost=FAST)
    ex.scheduler.drift = math.inf                    # keep one plan once both jobs are measured
    ex.start()
    try:
        for job in jobs:
            ex.submit(job)

        def wait_iterations(n):
            while min(j.iterations for j in jobs) < n:
                assert all(j.state in (JobState.QUEUED, JobState.RUNNING) for j in jobs)
                time.sleep(0.001)

        wait_iterations(1)                           # both measured
        while ex.scheduler.plan is None or len(ex.scheduler.plan.timeline.traces) < 2:
            time.sleep(0.001)                        # the plan that covers both is installed
        made = None
        # until a plan holds for two iterations with none being made: the jobs' settling re-paces
        # them, and the plan asked when the second was measured may land after a plan on its estimate
        while ex.scheduler.plans_made != made or ex.scheduler._pending is not None:
            plan, made = ex.scheduler.plan, ex.scheduler.plans_made
            wait_iterations(min(j.iterations for j in jobs) + 2)
        mm.allocator.reset_peak()
        wait_iterations(min(j.iterations for j in jobs) + 4)
        measured = mm.peak_nbytes
        assert ex.scheduler.plans_made == made, ("re-planned while measuring", ex.scheduler.history)
    finally:
        ex.stop()
    assert measured <= mm.budget_nbytes
    assert abs(measured - plan.predicted_peak_nbytes) <= 0.02 * plan.predicted_peak_nbytes, \
        (measured, plan.predicted_peak_nbytes)


def test_transfer_engine_round_trip_and_measured_bandwidth():
    from tensile_db.scheduler.cost import measure_bandwidth

    device = CpuDevice()
    engine = device.copy_engine()
    try:
        host = np.arange(1 << 16, dtype=np.float32)
        dev = np.zeros_like(host)
        engine.to_device(host, dev).wait()
        back = engine.to_host(dev).wait().host
        assert np.array_equal(back, host) and back is not host
        cost = measure_bandwidth(device, engine, nbytes=1 << 20, repeats=2)
        assert cost.h2d_bytes_per_s > 0 and cost.d2h_bytes_per_s > 0 and cost.latency_s >= 0
        assert cost.swap_in_s(2 << 20) > cost.swap_in_s(1 << 20)
    finally:
        engine.close()


def test_tensile_staggers_an_arriving_job_away_from_the_running_peak():
    from tensile_db.scheduler import Scheduler

    a, b = make_job(seed=1), make_job(seed=2)
    period = len(a.program.ops)

    def peak(phase_b):
        return Timeline([JobTrace(a.id, AccessSequence(a.program), 0, 0),
                         JobTrace(b.id, AccessSequence(b.program), phase_b, 1)]).vanilla_peak_nbytes()

    for policy, staggers in (("tensile", True), ("reactive", False)):
        sched = Scheduler(MemoryManager(CpuDevice(), 1 << 24), policy, FAST)
        sched.admit(a)
        delay = sched.stagger(b, {a.id: 0}, period, now=period)
        if staggers:
            assert 0 < delay < period
            assert peak(delay) < peak(0)
            assert peak(delay) <= 1.05 * min(peak(d) for d in range(period))
        else:
            assert delay == 0
        sched.close()


def test_replans_when_measured_times_drift():
    from tensile_db.scheduler import Scheduler

    job = make_job(seed=1)
    sched = Scheduler(MemoryManager(CpuDevice(), job.vanilla_peak_nbytes // 2), "tensile", FAST,
                      drift=0.25, drift_every=2)
    sched.admit(job)
    n_ops = len(job.program.ops)

    def iteration(seconds):
        for p in range(n_ops):
            sched.after(job, p, seconds)
        sched.iteration_done(job)

    iteration(2e-3)                                    # the cold start: provisional times
    assert sched.replan_reasons == [f"job {job.id} arrived"]
    iteration(1e-3)                                    # the first warm iteration's replace them
    assert f"job {job.id} measured" in sched.replan_reasons
    sched.replan({job.id: 0}, n_ops, wait=True)
    assert job.schedule == "planned" and sched.plan is not None
    iteration(1.1e-3)                                  # within the drift: no re-plan
    iteration(1.1e-3)
    assert sched.replan_reasons == []
    iteration(20e-3)                                   # one iteration beside a planning thread, say
    iteration(5e-3)
    assert sched.replan_reasons == []                  # the median of the iterations has not moved
    iteration(5e-3)                                    # but now it has, past 25%
    assert sched.replan_reasons == [f"op times of job {job.id} drifted"]
    sched.close()


def test_a_plan_waited_for_beside_kernels_on_every_core_is_waited_for_no_longer_than_the_limit(monkeypatch):
    """Note [Plans beside kernels on every core]: where the executor waits for its plans, a plan
    not made within ``PLAN_WAIT_S`` (a planning process that hangs, say) lets the jobs go on, and
    it is installed once it is made."""
    import concurrent.futures
    import threading

    from tensile_db.runtime import workers
    from tensile_db.scheduler import Scheduler, engine

    monkeypatch.setattr(workers, "every_core", lambda: True)
    monkeypatch.setattr(engine, "PLAN_WAIT_S", 0.05)
    monkeypatch.setattr(engine, "HERE_MAX_OPS", -1)            # every timeline larger than that
    job = make_job(seed=1)
    sched = Scheduler(MemoryManager(CpuDevice(), job.vanilla_peak_nbytes // 2), "tensile", FAST)
    assert sched.waits_for_plans
    made = concurrent.futures.Future()
    monkeypatch.setattr(sched._planning, "submit", lambda fn, request: made)
    sched.admit(job)
    asking = threading.Thread(target=sched.replan, args=({job.id: 0}, len(job.program.ops)), daemon=True)
    asking.start()
    asking.join(10)
    assert not asking.is_alive(), "the executor waited for a plan that is never made"
    assert sched._pending is made and sched.plan is None
    request = sched._request
    made.set_result((request, sched._make(request)[1], 0.0))
    assert sched.poll() and sched._pending is None
    sched.close()


def test_a_warm_up_cold_start_is_measured_by_the_first_warm_iteration():
    """With ``warm_up`` the cold start's times are provisional: the sequence is measured only
    after the first warm iteration, whose times replace them (not averaged with them), and the
    moving average goes on from there; without it the cold start's times count at once."""
    from tensile_db.scheduler.trace import AccessSequence

    program = make_job(seed=1).program
    n_ops = len(program.ops)

    def iteration(seq, seconds):
        for p in range(n_ops):
            seq.record(p, seconds)
        seq.end_iteration()

    warm, plain = AccessSequence(program, warm_up=True), AccessSequence(program)
    for seq in (warm, plain):
        iteration(seq, 4e-3)                           # the cold start: first touch, library start-up
    assert plain.measured and not warm.measured
    for seq in (warm, plain):
        iteration(seq, 1e-3)
    assert warm.measured and warm.snapshot().measured
    assert np.all(warm.times_s == 1e-3)
    assert np.allclose(plain.times_s, 4e-3 + 0.2 * (1e-3 - 4e-3))
    iteration(warm, 2e-3)
    assert np.allclose(warm.times_s, 1e-3 + 0.2 * (2e-3 - 1e-3))
    assert np.all(warm.best_s == 1e-3) and np.all(plain.best_s == 1e-3)


def test_the_plans_leave_the_headroom_the_planned_pools_packing_needs(monkeypatch):
    """Once the pool has planned the offsets of a period of these jobs, a packing that needs more
    than the configured headroom raises it (and asks for a re-plan); a packing of the jobs before
    an arrival does not count, and a smaller one does not lower it."""
    from tensile_db.memory.planned import PlannedPool
    from tensile_db.scheduler import Scheduler

    ratio = [None]
    monkeypatch.setattr(PlannedPool, "packing_ratio", property(lambda self: ratio[0]))
    job = make_job(seed=1)
    sched = Scheduler(MemoryManager(CpuDevice(), job.vanilla_peak_nbytes // 2), "tensile", FAST)
    budget, n_ops = sched.mm.budget_nbytes, len(job.program.ops)

    def iteration():
        for p in range(n_ops):
            sched.after(job, p, 1e-3)
        sched.iteration_done(job)

    ratio[0] = 1.25                                    # the pool's last plan, of jobs gone
    sched.admit(job)
    iteration()                                        # the cold start
    iteration()                                        # and the first warm iteration
    sched.replan({job.id: 0}, n_ops, wait=True)
    assert sched.history[-1]["reasons"] == (f"job {job.id} arrived", f"job {job.id} measured")
    assert sched._request.target == int(budget * (1 - sched.headroom))
    ratio[0] = 1.10                                    # a plan of this job's period
    iteration()
    assert sched.replan_reasons == ["the planned pool's offsets need 10.0% above the live bytes"]
    sched.replan({job.id: 0}, n_ops, wait=True)
    assert sched._request.target == pytest.approx(budget / 1.10, abs=1)
    ratio[0] = 1.02
    iteration()
    assert sched.replan_reasons == []
    sched.close()


def test_the_fallback_does_not_evict_below_a_plan_at_the_largest_working_set():
    """With the budget at the job's largest working set the plan's target is the budget less the
    headroom, under that floor (Note [Targets under the floor]): while the plan is in force the
    fallback's limit is the floor, and goes back to the headroom's without a plan."""
    from tensile_db.scheduler import Scheduler

    job = make_job(seed=1)
    sched = Scheduler(MemoryManager(CpuDevice(), job.min_working_set_nbytes), "tensile", FAST)
    budget, n_ops = sched.mm.budget_nbytes, len(job.program.ops)
    below = sched.mm.limit_nbytes
    assert below < budget
    sched.admit(job)
    for _ in range(2):                                 # the cold start and the first warm iteration
        for p in range(n_ops):
            sched.after(job, p, 1e-3)
        sched.iteration_done(job)
    sched.replan({job.id: 0}, n_ops, wait=True)
    assert sched._request.target == int(budget * (1 - sched.headroom)) < sched._request.floor == budget
    assert sched.plan is not None and sched.mm.limit_nbytes == budget
    sched._install(sched._request, None, 0.0)
    assert sched.mm.limit_nbytes == below
    sched.close()


# --- fair sharing -------------------------------------------------------------------------------

LONG_SPEC = ModelSpec(Architecture(tuple(Layer(16, "relu") for _ in range(30))), 16, 4, "classification")


def _record_rounds(job: TrainingJob, ex: Executor, log: list) -> None:
    """Wrap every op of the job so it appends (round, job id, position, period, iterations per
    period of every job) to ``log`` when it runs."""

    def wrap(position: int, op: Op) -> Op:
        def run(arrays, ctx):
            log.append((ex.round, job.id, position, ex.period, tuple(sorted(ex.iterations_per_period().items()))))
            op.run(arrays, ctx)
        return Op(op.name, op.reads, op.writes, run)

    job.program.ops[:] = [wrap(p, op) for p, op in enumerate(job.program.ops)]


def test_a_short_job_beside_a_long_one_runs_many_iterations_per_period_on_a_periodic_timeline():
    long_job = make_job(LONG_SPEC, TrainOptions(epochs=10_000, batch_size=64, seed=1), seed=1)
    short = make_job(SMALL_SPEC, TrainOptions(epochs=40, batch_size=64, seed=2), seed=2)     # 320 iterations
    n_long, n_short = len(long_job.program.ops), len(short.program.ops)
    ex = Executor(MemoryManager(CpuDevice(), 1 << 26, pool="general"), policy="tensile", cost=FAST)
    log: list = []
    for job in (long_job, short):
        _record_rounds(job, ex, log)
    ex.start()
    try:
        ex.submit(long_job)
        while long_job.iterations < 4:                # its op times have settled
            time.sleep(0.001)
        ex.submit(short)
        long_before = long_job.iterations
        while (event := short.events.get(timeout=120))[0] == "progress":
            pass
        assert event[0] == "done"
        long_during = long_job.iterations - long_before
    finally:
        ex.stop()
    # the short job did not wait for one iteration of the long one per iteration of its own
    assert long_during < short.iterations / 4
    # the longest unbroken stretch of rounds with both jobs at one pace
    stretches: list[list] = []
    for record in log:
        if stretches and stretches[-1][0][3:] == record[3:]:
            stretches[-1].append(record)
        else:
            stretches.append([record])
    steady = max((rs for rs in stretches if len(rs[0][4]) == 2), key=len)
    period, repeats = steady[0][3], dict(steady[0][4])
    assert repeats[long_job.id] == 1 and repeats[short.id] >= 4
    assert period == max(n_long, repeats[short.id] * n_short)
    # after one period, the short job has started whatever stagger delay admission gave it
    r0 = steady[0][0] + period + 1
    assert steady[-1][0] >= r0 + 2 * period, "expected two whole periods at one pace"
    windows = [[(r - start, job, p) for r, job, p, *_ in steady if start <= r < start + period]
               for start in (r0, r0 + period)]
    assert windows[0] == windows[1]                  # the combined timeline repeats every period
    ops = [job for _, job, _ in windows[0]]
    assert ops.count(long_job.id) == n_long and ops.count(short.id) == repeats[short.id] * n_short


@pytest.mark.parametrize("policy", POLICIES)
def test_jobs_of_different_lengths_stay_in_budget_and_match_vanilla_bit_for_bit(policy):
    def jobs():
        return [make_job(LONG_SPEC, TrainOptions(epochs=1, batch_size=64, optimizer="adam", lr=0.005, seed=11), seed=1),
                make_job(SMALL_SPEC, TrainOptions(epochs=8, batch_size=64, optimizer="adam", lr=0.005, seed=12), seed=2)]

    reference = jobs()
    run(reference, 64 * sum(j.vanilla_peak_nbytes for j in reference), "reactive")
    mine = jobs()
    budget = budget_of(mine, 0.5)
    mm, _ = run(mine, budget, policy, check_residency=True)
    assert mm.peak_nbytes <= budget and sum(j.memory.swap_outs for j in mine) > 0
    assert mine[1].finished_at < mine[0].finished_at    # the short job is not held to the long one's pace
    for ref, job in zip(reference, mine):
        assert job.loss == ref.loss
        for name, value in ref.result.items():
            assert np.array_equal(job.result[name], value), f"{policy}: {name} differs"
