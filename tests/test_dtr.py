"""The ``dtr`` policy (Dynamic Tensor Rematerialization, Kirisame et al., ICLR 2021), by rules.

- Its order: the tensor of least h = cost / (bytes x staleness) is evicted, whatever its size,
  age or next use; one whose job can recompute it and has run every writer of its recipe is
  dropped, any other copied out; a tensor between its writer ops is never dropped.
- On real values (``cpu``), an MLP and a CNN with residual joins, one job at half its unscheduled
  peak and two jobs at 35% of their combined one, end with the losses and weights of unlimited
  memory, bit for bit: tensors were dropped (some by the other job's allocations) and every one
  was recomputed, no drop caught a tensor between its writers or one an op was about to read,
  and the manager's invariants held after every op.
- On the simulated device, two ResNet-50 jobs complete under it at half their peaks, with no plan.
- It is the ``tensile`` policy's on-demand eviction too (what no plan covers): evictions drop
  there, never under a baseline, and the jobs still end bit for bit as with unlimited memory.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from conftest import wait_done
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.memory.arena import UNIT_NBYTES
from tensile_db.memory.manager import MemoryManager, Residency
from tensile_db.runtime import model as models
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions
from tensile_db.runtime.program import Kind, Op, Slot
from tensile_db.runtime.simulated import SimDevice
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.dtr import STALENESS_EPSILON_S, Rematerialization
from tensile_db.scheduler.reactive import FarthestNextUse
from tensile_db.scheduler.trace import AccessSequence

MLP = ModelSpec(Architecture((Layer(96, "relu", 0.2), Layer(64, "tanh"), Layer(48, "relu"))), 16, 4,
                "classification")
#: a convolution with batch normalisation, then residual blocks (joins of two recomputable inputs;
#: convolutions followed by their in-place activations, recipes of two writers): deep enough
#: that its largest working set (a convolution's backward) is 44% of its unscheduled peak
BLOCK = {"residual": [{"conv": 4, "padding": 1}, {"conv": 4, "padding": 1, "activation": "none"}], "activation": "relu"}
CNN = ModelSpec.parse({"input": {"shape": [1, 8, 8]}, "layers": [
    {"conv": 4, "padding": 1, "bias": False, "activation": "none"}, {"batch_norm": {}, "activation": "relu"},
    *[BLOCK] * 6, {"max_pool": 2}, {"conv": 8, "padding": 1, "activation": "tanh"}, {"dense": 10}]},
    64, 10, "classification")
OPTIONS = TrainOptions(epochs=2, batch_size=64, optimizer="adam", lr=0.005, seed=11)
CNN_OPTIONS = TrainOptions(epochs=2, batch_size=16, optimizer="adam", lr=0.005, seed=11)
FAST = CostModel(h2d_bytes_per_s=8e9, d2h_bytes_per_s=8e9)
SLOW = CostModel(h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6)      # a copy costs more than any recompute
#: a scratch block of one arena unit
ONE_UNIT = Slot("scratch", Kind.WORKSPACE, (UNIT_NBYTES // 4,))


def make_job(spec: ModelSpec, seed: int) -> TrainingJob:
    """A job of ``spec`` on random rows: 2 epochs of 8 steps."""
    options = CNN_OPTIONS if spec is CNN else OPTIONS
    rng = np.random.default_rng(seed)
    n = 8 * options.batch_size
    x = rng.normal(size=(n, spec.n_features)).astype(np.float32)
    y = rng.integers(0, spec.n_outputs, n).astype(np.int32)
    return TrainingJob(JobInfo(1, "tester", f"m{seed}"), spec, options, x, y)


def train(jobs: list[TrainingJob], budget_nbytes: int, policy: str, cost: CostModel = FAST) -> dict:
    """Run ``jobs`` to completion on a fresh cpu executor. Every op asserts that what it touches is
    resident, and the manager's invariants are checked after every op. Returns what happened:
    ``manager``, ``executor`` and ``drops``, (tensor, id of the job whose op was running, the
    owner's next op, the tensor's keeps, whether an eviction made it rather than a plan) for every
    drop."""
    mm = MemoryManager(CpuDevice(), budget_nbytes)
    ex = Executor(mm, policy=policy, cost=cost)
    running, drops, evicting = [None], [], [False]
    before, after, drop, evict = ex.scheduler.before, ex.scheduler.after, mm.drop, mm.evict

    def on_before(job, position):
        running[0] = job.id
        before(job, position)

    def on_after(job, position, seconds):
        after(job, position, seconds)
        mm.check()

    def on_drop(t):
        owner = next(j for j in jobs if j.id == t.job_id)
        drops.append((t, running[0], owner.next_position, t.keeps, evicting[0]))
        drop(t)

    def on_evict(t, drop=False):
        evicting[0] = True
        try:
            evict(t, drop)
        finally:
            evicting[0] = False

    ex.scheduler.before, ex.scheduler.after, mm.drop, mm.evict = on_before, on_after, on_drop, on_evict
    for job in jobs:
        _assert_resident_in_ops(job)
        ex.submit(job)
    ex.start()
    try:
        for job in jobs:
            wait_done(job, f"job {job.id} under {policy}")
    finally:
        ex.stop()
    assert mm.in_use_nbytes == 0
    return {"manager": mm, "executor": ex, "drops": drops}


def _assert_resident_in_ops(job: TrainingJob) -> None:
    """Wrap every op of the job (its replays stay as they are) so that it asserts that each tensor
    it touches is on the device with no copy in flight."""
    def wrap(op: Op) -> Op:
        def run(arrays, ctx):
            for s in op.accesses:
                t = job.tensors.get(s)            # a recompute's workspaces are not the job's
                assert t is None or (t.residency is Residency.DEVICE and t.transfer is None), \
                    f"{op.name}: {s} is {t.residency.value}"
            op.run(arrays, ctx)
        return dataclasses.replace(op, run=run)

    job.program.ops[:] = [wrap(op) for op in job.program.ops]


def budget_of(jobs, fraction: float) -> int:
    """``fraction`` of the jobs' combined unscheduled peak (at least the largest working set),
    bytes, in whole arena units."""
    budget = max(max(j.min_working_set_nbytes for j in jobs), int(fraction * sum(j.vanilla_peak_nbytes for j in jobs)))
    return -(-budget // UNIT_NBYTES) * UNIT_NBYTES


# --- the order --------------------------------------------------------------------------------


class Clock:
    """A device clock the test sets (seconds)."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def policy_on(position: int, op_s: dict[int, float], cost: CostModel = SLOW):
    """A manager on a cpu device whose clock the test sets, ranked by DTR for job 1 of the MLP's
    program, which has just run op ``position``; ``op_s``: measured seconds of some ops (the rest
    1 ms). Returns (manager, policy, program, clock)."""
    program = build_training_program(MLP, OPTIONS, 8)
    sequence = AccessSequence(program)
    for p in range(len(program.ops)):
        sequence.record(p, op_s.get(p, 1e-3))
    positions = FarthestNextUse()
    positions.track(1, program)
    positions.advance(1, position)
    clock, device = Clock(), CpuDevice()
    device.now = clock
    dtr = Rematerialization(positions, {1: sequence}, cost, clock)
    mm = MemoryManager(device, 1 << 20, next_use=dtr, pool="general")
    mm.droppable = dtr.drops
    mm.register_job(1)
    return mm, dtr, program, clock


def place(mm: MemoryManager, program, slot: str, at_s: float, clock: Clock):
    """Register the tensor of ``slot`` for job 1 with its last access at ``at_s`` seconds."""
    clock.now_s = at_s
    (t,) = mm.acquire(1, [], [program.slots[slot]])
    mm.unpin([t])
    return t


def squeeze(mm: MemoryManager) -> None:
    """Make the bytes in use the limit, so that the next allocation of one unit evicts one tensor."""
    mm.limit_nbytes = mm.in_use_nbytes


def test_the_tensor_of_least_h_is_evicted_not_the_oldest_or_the_largest():
    # after relu2 (op 8): h0 (ops 1-2), h1 (5-6) and h2 (7-8) are complete; h0's ops are slow
    mm, dtr, program, clock = policy_on(8, {1: 0.5, 2: 0.5})
    h0 = place(mm, program, "h0", 0.0, clock)       # the largest and the oldest
    h1 = place(mm, program, "h1", 5.0, clock)
    h2 = place(mm, program, "h2", 9.0, clock)
    clock.now_s = 10.0
    by_hand = {t: cost_s / (t.arena_nbytes * (10.0 - at_s + STALENESS_EPSILON_S))
               for t, cost_s, at_s in ((h0, 1.0, 0.0), (h1, 2e-3, 5.0), (h2, 2e-3, 9.0))}
    assert {t: dtr.h(t) for t in by_hand} == pytest.approx(by_hand)
    least = min(by_hand, key=by_hand.get)
    assert least is h1                               # neither the oldest (h0) nor the largest (h0)
    squeeze(mm)
    mm.acquire(1, [], [ONE_UNIT])                    # one eviction
    assert [t.residency for t in (h0, h1, h2)] == [Residency.DEVICE, Residency.DROPPED, Residency.DEVICE]
    assert (mm.jobs[1].drops, mm.jobs[1].swap_outs) == (1, 0)
    mm.check()


def test_a_tensor_its_job_cannot_recompute_is_copied_out_at_the_cost_of_the_copies():
    mm, dtr, program, clock = policy_on(8, {}, cost=FAST)
    weight = next(name for name, slot in program.slots.items() if slot.kind is Kind.WEIGHT)
    w = place(mm, program, weight, 0.0, clock)      # a weight: no recipe
    h2 = place(mm, program, "h2", 9.0, clock)
    clock.now_s = 10.0
    assert not dtr.drops(w) and dtr.drops(h2)
    assert dtr.h(w) == pytest.approx((FAST.swap_out_s(w.nbytes) + FAST.swap_in_s(w.nbytes))
                                     / (w.arena_nbytes * (10.0 + STALENESS_EPSILON_S)))
    assert dtr.h(w) < dtr.h(h2)
    squeeze(mm)
    mm.acquire(1, [], [ONE_UNIT])
    assert (w.residency, h2.residency) == (Residency.HOST, Residency.DEVICE)
    assert (mm.jobs[1].drops, mm.jobs[1].swap_outs) == (0, 1)
    mm.check()


def test_a_tensor_between_its_writer_ops_is_copied_out_never_dropped():
    # h0 is written by dense0 (op 1) and then in place by relu0 (op 2)
    assert build_training_program(MLP, OPTIONS, 8).recipe("h0") == (1, 2)
    mm, dtr, program, clock = policy_on(1, {})
    h0 = place(mm, program, "h0", 0.0, clock)
    clock.now_s = 1.0
    assert not dtr.drops(h0)
    squeeze(mm)
    mm.acquire(1, [], [ONE_UNIT])
    assert h0.residency is Residency.HOST and mm.jobs[1].drops == 0
    mm, dtr, program, clock = policy_on(2, {})       # once relu0 has run, it is complete
    assert dtr.drops(place(mm, program, "h0", 0.0, clock))


def test_kept_values_are_never_dropped_and_a_tensor_accessed_just_now_has_a_finite_h():
    mm, dtr, program, clock = policy_on(8, {})
    h2 = place(mm, program, "h2", 3.0, clock)
    assert math.isfinite(dtr.h(h2)) and dtr.h(h2) > 0
    mm.keep([h2])
    squeeze(mm)
    mm.acquire(1, [], [ONE_UNIT])
    assert h2.residency is Residency.HOST and mm.jobs[1].drops == 0     # copied out instead
    mm.let_go([h2])
    with pytest.raises(AssertionError, match="not kept"):
        mm.let_go([h2])


# --- training on real values ------------------------------------------------------------------


@pytest.mark.parametrize("spec", [MLP, CNN], ids=["mlp", "cnn"])
@pytest.mark.parametrize("cost", [FAST, SLOW], ids=["fast-copies", "slow-copies"])
@pytest.mark.parametrize("seeds, fraction", [((1,), 0.5), ((1, 2), 0.35)], ids=["one-job", "two-jobs"])
def test_dtr_well_below_the_vanilla_peak_matches_unlimited_memory_bit_for_bit(spec, cost, seeds, fraction):
    reference = [make_job(spec, seed) for seed in seeds]
    train(reference, 64 * sum(j.vanilla_peak_nbytes for j in reference), "reactive")
    jobs = [make_job(spec, seed) for seed in seeds]
    budget = budget_of(jobs, fraction)
    assert budget <= 0.75 * max(j.vanilla_peak_nbytes for j in jobs)
    ran = train(jobs, budget, "dtr", cost)
    mm, ex, drops = ran["manager"], ran["executor"], ran["drops"]
    assert mm.peak_nbytes <= budget and ex.scheduler.plans_made == 0
    assert all(j.schedule == "dtr" and j.policy == "dtr" for j in jobs)
    assert sum(j.memory.drops for j in jobs) > 0
    for job in jobs:                                  # every dropped tensor is read again: recomputed
        assert job.memory.recomputes == job.memory.drops
    for t, _, next_op, keeps, _ in drops:
        recipe = next(j for j in jobs if j.id == t.job_id).program.recipe(t.slot)
        assert recipe is not None and recipe[-1] < next_op, f"{t.slot} dropped before op {recipe[-1]} ran"
        assert keeps == 0, f"{t.slot} dropped while an op was about to read it"
    if len(jobs) > 1:                                 # some by the other job's allocations
        assert any(t.job_id != running for t, running, _, _, _ in drops)
    for ref, job in zip(reference, jobs):
        assert job.loss == ref.loss
        for name, value in ref.result.items():
            assert np.array_equal(job.result[name], value), f"{name} differs"


def test_reactive_never_drops():
    jobs = [make_job(MLP, seed) for seed in (1, 2)]
    ran = train(jobs, budget_of(jobs, 0.35), "reactive", SLOW)
    assert not ran["drops"] and sum(j.memory.swap_outs for j in jobs) > 0


# --- the simulated device ---------------------------------------------------------------------


def test_two_resnet50_jobs_complete_under_dtr_on_the_simulated_device():
    image = (3, 64, 64)

    def job(seed: int) -> TrainingJob:
        arch = models.parse_architecture({"model": "resnet50", "width": 0.25, "input": {"shape": list(image)}})
        spec = models.ModelSpec(arch, math.prod(image), 1000, "classification")
        options = models.parse_options({"epochs": 3, "batch_size": 16, "seed": seed, "standardize": False})
        return TrainingJob(JobInfo(0, "test", f"resnet50 #{seed}"), spec, options,
                           np.zeros((16, math.prod(image)), np.float32), np.zeros(16, np.int32))

    jobs = [job(seed) for seed in (1, 2)]
    device = SimDevice("h100", jitter=0.03, first_run_error=0.05)
    mm = MemoryManager(device, budget_of(jobs, 0.5))
    ex = Executor(mm, policy="dtr")
    for j in jobs:
        ex.submit(j)
    ex.start()
    try:
        for j in jobs:
            while (event := j.events.get(timeout=600))[0] == "progress":
                pass
            assert event[0] == "done", f"{j.info.model_name}: {event[1]!r}"
    finally:
        ex.stop()
    assert mm.peak_nbytes <= mm.budget_nbytes and ex.scheduler.plans_made == 0
    assert all(j.iterations == 3 and j.memory.recomputes == j.memory.drops > 0 for j in jobs)


@pytest.mark.parametrize("policy", ["tensile", "checkpoint"])
def test_the_tensile_fallback_drops_as_dtr_does_and_the_baselines_fallback_never_drops(policy):
    """What no plan covers (the cold start, the time before a plan lands) the memory manager
    evicts on demand: under ``tensile`` by DTR's order, dropping what recomputes, under the
    baselines by farthest next use."""
    reference = [make_job(CNN, seed) for seed in (1, 2)]
    train(reference, 64 * sum(j.vanilla_peak_nbytes for j in reference), "reactive")
    jobs = [make_job(CNN, seed) for seed in (1, 2)]
    ran = train(jobs, budget_of(jobs, 0.35), policy, SLOW)
    on_demand = sum(by_eviction for *_, by_eviction in ran["drops"])
    assert ran["manager"].peak_nbytes <= budget_of(jobs, 0.35)
    assert on_demand > 0 if policy == "tensile" else on_demand == 0
    for job in jobs:
        assert job.memory.recomputes == job.memory.drops
    for ref, job in zip(reference, jobs):
        assert job.loss == ref.loss
        for name, value in ref.result.items():
            assert np.array_equal(job.result[name], value), f"{name} differs"
