"""Shared set-up of the tests that run training jobs on an executor or plan their timelines: a
small MLP and its options, two cost models (swaps cheap, swaps dearer than recomputing), an
access sequence with made-up op times, a job on random data, a run of jobs to their end under a
policy and budget (every op checked to find its tensors resident, if asked), a budget as a
fraction of the jobs' peaks, and the validity of a plan."""

from __future__ import annotations

import math

import numpy as np

from conftest import TEST_DEVICE, wait_done
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.memory.arena import UNIT_NBYTES
from tensile_db.memory.manager import MemoryManager, Residency
from tensile_db.runtime import model as models
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.devices import make_device
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions
from tensile_db.runtime.program import Op
from tensile_db.runtime.simulated import SimDevice
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.timeline import Timeline
from tensile_db.scheduler.trace import AccessSequence

SPEC = ModelSpec(Architecture((Layer(96, "relu", 0.2), Layer(64, "tanh"), Layer(48, "relu"))), 16, 4,
                 "classification")
OPTIONS = TrainOptions(epochs=2, batch_size=64, optimizer="adam", lr=0.005, seed=11)
FAST = CostModel(h2d_bytes_per_s=8e9, d2h_bytes_per_s=8e9)
SLOW = CostModel(h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6)      # swaps cost more than recomputing


def sequence(spec=SPEC, options=OPTIONS, batch=64, seconds=1e-3) -> AccessSequence:
    seq = AccessSequence(build_training_program(spec, options, batch))
    for p in range(len(seq.program.ops)):
        seq.record(p, seconds * (1 + p % 3))
    seq.end_iteration()
    return seq


def make_job(spec=SPEC, options=OPTIONS, seed=0, n=512) -> TrainingJob:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, spec.n_features)).astype(np.float32)
    y = rng.integers(0, spec.n_outputs, n).astype(np.int32)
    return TrainingJob(JobInfo(1, "tester", f"m{seed}"), spec, options, x, y)


def run(jobs, budget_nbytes, policy, cost=FAST, check_residency=False, between=None, pool="planned", prepare=None):
    """Run ``jobs`` to completion on a fresh cpu executor with ``pool``; ``prepare(jobs, manager)``
    runs before the first submit. Returns (manager, executor)."""
    mm = MemoryManager(make_device(TEST_DEVICE), budget_nbytes, pool=pool)
    ex = Executor(mm, policy=policy, cost=cost)
    if check_residency:
        for job in jobs:
            _check_residency(job, mm)
    if prepare is not None:
        prepare(jobs, mm)
    ex.start()
    try:
        for i, job in enumerate(jobs):
            if between is not None and i:
                between(ex, jobs[:i])
            ex.submit(job)
        for job in jobs:
            wait_done(job, f"job {job.id} under {policy}")
    finally:
        ex.stop()
    assert mm.in_use_nbytes == 0
    return mm, ex


def _check_residency(job: TrainingJob, mm: MemoryManager) -> None:
    """Wrap every op of the job so it asserts that each tensor it touches is on the device with
    no copy in flight."""

    def wrap(op: Op) -> Op:
        def run(arrays, ctx):
            for s in op.accesses:
                t = job.tensors[s]
                assert t.residency is Residency.DEVICE and t.transfer is None, \
                    f"{op.name}: {s} is {t.residency.value}"
            op.run(arrays, ctx)
        return Op(op.name, op.reads, op.writes, run)

    job.program.ops[:] = [wrap(op) for op in job.program.ops]


def budget_of(jobs, fraction: float) -> int:
    total = sum(j.vanilla_peak_nbytes for j in jobs)
    budget = max(max(j.min_working_set_nbytes for j in jobs), int(fraction * total))
    return -(-budget // UNIT_NBYTES) * UNIT_NBYTES


def assert_valid(plan, timeline: Timeline) -> None:
    """No absent window covers an access of its tensor, each tensor has at most one decision
    per absence, and the accesses that bound it are its own job's."""
    seen = set()
    for d in plan.decisions:
        assert timeline.events[d.a][0] == timeline.events[d.b][0] == d.job_id, f"{d} is on another job's events"
        key = (d.job_id, d.slot, d.a)
        assert key not in seen
        seen.add(key)
        start, length = d.window(timeline.n)
        assert length > 0
        accesses = [q for t in timeline.tensors if (t.job_id, t.slot) == (d.job_id, d.slot) for q in t.positions]
        for q in accesses:
            k = timeline.index[(d.job_id, q)]
            assert timeline.cyclic(start, k) >= length, f"{d.slot} absent at its access at period position {q}"


def image_job(model: str, image: tuple, iterations: int, seed: int, width: float = 1.0) -> TrainingJob:
    arch = models.parse_architecture({"model": model, "width": width, "input": {"shape": list(image)}})
    spec = models.ModelSpec(arch, math.prod(image), 1000, "classification")
    options = models.parse_options({"epochs": iterations, "batch_size": 16, "seed": seed, "standardize": False})
    return TrainingJob(JobInfo(0, "test", f"{model} #{seed}"), spec, options,
                       np.zeros((16, math.prod(image)), np.float32), np.zeros(16, np.int32))


def run_sim(jobs, fraction: float, policy: str, check_every: int = 0, setup=None, **device_options):
    """Run ``jobs`` on a fresh simulated H100 under ``policy`` at ``fraction`` of their combined
    unscheduled peaks; every ``check_every`` ops, check the manager's invariants and that every
    pinned tensor (the op's own) is resident with no copy in flight; ``setup(executor)`` runs
    before the first job is submitted. Returns (manager, executor, device)."""
    device = SimDevice("h100", **device_options)
    mm = MemoryManager(device, int(fraction * sum(j.vanilla_peak_nbytes for j in jobs)))
    ex = Executor(mm, policy=policy)
    if setup is not None:
        setup(ex)
    if check_every:
        execute, count = device.execute, [0]

        def checked(op, arrays, ctx):
            count[0] += 1
            if count[0] % check_every == 0:
                mm.check()
                pinned = [t for t in mm.tensors() if t.pins]
                assert pinned and all(t.residency is Residency.DEVICE and t.transfer is None for t in pinned)
            execute(op, arrays, ctx)

        device.execute = checked
    for job in jobs:
        ex.submit(job)
    ex.start()
    try:
        for job in jobs:
            wait_done(job, f"{job.info.model_name} under {policy}", timeout_s=600)
    finally:
        ex.stop()
    assert mm.in_use_nbytes == 0
    return mm, ex, device
