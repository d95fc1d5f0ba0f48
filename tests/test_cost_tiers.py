"""The cost model's three tiers (device, host, disk) and the simulator that decides them.

A swap-out goes to the host tier if the host's swapped-out bytes now plus its own fit the host
budget, else to the disk tier; its swap-in reads it from there (Note [Tiers] in
:mod:`tensile_db.scheduler.cost`). Checked on hand-made decisions over a timeline of 1 ms ops,
where each period's length and copy-channel time can be worked out by hand, and on real plans:
a host budget that holds every swap changes nothing, one of 0 sends every swap to disk.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from tensile_db.errors import DiskError, DiskFull, InvalidArgument
from tensile_db.memory.spill import SpillFile
from tensile_db.memory.tiers import HostTier
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions
from tensile_db.scheduler.cost import DEFAULT_DISK_BYTES_PER_S, CostModel, measure_disk, measure_disk_tier
from tensile_db.scheduler.engine import Scheduler
from tensile_db.scheduler.planners import plan_tensile
from tensile_db.scheduler.timeline import Decision, JobTrace, Timeline, simulate
from tensile_db.scheduler.trace import AccessSequence

SPEC = ModelSpec(Architecture((Layer(96, "relu"), Layer(64, "tanh"), Layer(48, "relu"))), 16, 4, "classification")
OPTIONS = TrainOptions(epochs=1, batch_size=64, optimizer="adam", lr=0.005, seed=11)
OP_S = 1e-3
N = 1_000_000                   # bytes of each hand-made swap
# Host copies of N bytes take 1 ms, disk writes 5 ms, disk reads 10 ms.
COST = CostModel(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, disk_read_bytes_per_s=1e8, disk_write_bytes_per_s=2e8)
HOST_S, WRITE_S, READ_S = 1e-3, 5e-3, 10e-3


def timeline(jobs: int = 1, op_s=lambda p: OP_S) -> Timeline:
    """``jobs`` jobs of SPEC's training program, op ``p`` taking ``op_s(p)`` seconds."""
    traces = []
    for j in range(jobs):
        seq = AccessSequence(build_training_program(SPEC, OPTIONS, 64))
        for p in range(len(seq.program.ops)):
            seq.record(p, op_s(p))
        seq.end_iteration()
        traces.append(JobTrace(j + 1, seq, phase=5 * j, order=j))
    return Timeline(traces)


def swap(a: int, free: int, back: int, b: int, nbytes: int = N) -> Decision:
    """A hand-made swap: out after event ``a``, released before ``free``, in before ``back``,
    needed at ``b`` (the simulator reads only the events and the bytes)."""
    return Decision(1, f"t{a}", nbytes, "swap", a, b, free, back)


def tiered(cost: CostModel, host_budget_nbytes: int | None) -> CostModel:
    return replace(cost, host_budget_nbytes=host_budget_nbytes)


# --- the cost model -------------------------------------------------------------------------------


def test_disk_copies_cost_the_disk_and_on_a_separate_device_the_host_copy_too():
    assert COST.swap_out_s(N, disk=True) == pytest.approx(WRITE_S)
    assert COST.swap_in_s(N, disk=True) == pytest.approx(READ_S)
    duplex = replace(COST, duplex=True)
    assert duplex.swap_out_s(N, disk=True) == pytest.approx(HOST_S + WRITE_S)
    assert duplex.swap_in_s(N, disk=True) == pytest.approx(READ_S + HOST_S)
    assert duplex.swap_out_s(N) == COST.swap_out_s(N) == pytest.approx(HOST_S)


@pytest.mark.parametrize("fields, what", [({"host_budget_nbytes": -1}, "negative"),
                                          ({"host_budget_nbytes": 0, "disk_read_bytes_per_s": None}, "disk_read"),
                                          ({"host_budget_nbytes": 0, "disk_write_bytes_per_s": 0.0}, "disk_write")])
def test_a_host_budget_needs_a_priced_disk_tier(fields, what):
    with pytest.raises(InvalidArgument, match=what):
        replace(COST, **fields)


# --- tiers in the simulation, by hand -------------------------------------------------------------


@pytest.mark.parametrize("duplex", [False, True])
def test_with_no_host_room_a_swap_costs_disk_time(duplex):
    tl = timeline()
    cost = replace(COST, duplex=duplex)
    out_s, in_s = (HOST_S + WRITE_S, READ_S + HOST_S) if duplex else (WRITE_S, READ_S)
    sim = simulate(tl, [swap(0, 1, 2, 3)], tiered(cost, 0))
    # The release before op 1 waits for the write; the swap-in, issued before op 2, has op 2's
    # 1 ms to hide behind, so op 3 waits for the rest of the read.
    assert sim.stall_s == pytest.approx(out_s + in_s - OP_S)
    assert sim.period_s == pytest.approx(sim.compute_s + out_s + in_s - OP_S)
    assert sim.channel_busy_s == pytest.approx(out_s + in_s)
    assert sim.disk_nbytes == N
    host = simulate(tl, [swap(0, 1, 2, 3)], cost)
    assert host.channel_busy_s == pytest.approx(2 * HOST_S) and host.disk_nbytes == 0


def test_a_host_budget_of_one_swap_sends_the_overlapping_second_to_disk():
    tl = timeline()
    first, second = swap(0, 1, 4, 5), swap(1, 2, 6, 7)       # second's swap-out: first is still out
    sim = simulate(tl, [first, second], tiered(COST, N))
    assert sim.disk_nbytes == N
    assert sim.channel_busy_s == pytest.approx(2 * HOST_S + WRITE_S + READ_S)
    # By hand, in ms on the one channel: the first's swap-out 1-2 (op 1 waits for it), the
    # second's write 3-8 (op 2 waits), the first's swap-in from host 10-11 (op 5 starts at 11;
    # from disk it would at 20), the second's read 12-22 (op 7 waits).
    assert sim.start_s[:8] * 1e3 == pytest.approx([0, 2, 8, 9, 10, 11, 12, 22])
    # Once the first's swap-in has completed, its host bytes are free for the next swap-out.
    later = swap(8, 9, 10, 11)
    apart = simulate(tl, [first, later], tiered(COST, N))
    assert apart.disk_nbytes == 0
    assert apart.channel_busy_s == pytest.approx(4 * HOST_S)


def test_host_bytes_held_across_the_end_of_the_period_count():
    tl = timeline()
    n = tl.n
    wraps = Decision(1, "w", N, "swap", n - 2, 2, n - 1, 1)   # out over the period's end, back before op 1
    sim = simulate(tl, [wraps, swap(0, 3, 4, 5)], tiered(COST, N))
    # At the swap-out after op 0 the wrapped swap's swap-in has not completed: no room for N more.
    assert sim.disk_nbytes == N
    assert sim.channel_busy_s == pytest.approx(2 * HOST_S + WRITE_S + READ_S)
    assert simulate(tl, [wraps, swap(0, 3, 4, 5)], tiered(COST, 2 * N)).disk_nbytes == 0


# --- tiers in the simulation of real plans ----------------------------------------------------------


@pytest.fixture(scope="module")
def planned():
    """Three jobs with ops of 1, 2 and 3 ms, and a tensile plan at 60% of their combined peak
    under copies slow enough to matter."""
    tl = timeline(3, op_s=lambda p: OP_S * (1 + p % 3))
    cost = replace(COST, h2d_bytes_per_s=2e7, d2h_bytes_per_s=2e7)
    plan = plan_tensile(tl, cost, int(0.6 * tl.vanilla_peak_nbytes()), max_seconds=None)
    swaps = [d for d in plan.decisions if d.method == "swap"]
    assert swaps, "the plan must swap for these tests to mean anything"
    return tl, cost, plan, swaps


@pytest.mark.parametrize("duplex", [False, True])
def test_a_host_budget_that_holds_every_swap_changes_nothing(planned, duplex):
    tl, cost, plan, swaps = planned
    cost = replace(cost, duplex=duplex)
    unbounded = simulate(tl, plan.decisions, cost)
    roomy = simulate(tl, plan.decisions, tiered(cost, sum(d.nbytes for d in swaps)))
    assert np.array_equal(roomy.start_s, unbounded.start_s)
    assert (roomy.period_s, roomy.stall_s, roomy.channel_busy_s) == \
        (unbounded.period_s, unbounded.stall_s, unbounded.channel_busy_s)
    assert roomy.disk_nbytes == unbounded.disk_nbytes == 0


def test_the_same_plan_with_a_host_budget_that_holds_every_swap(planned):
    tl, cost, plan, swaps = planned
    target = plan.target_nbytes
    again = plan_tensile(tl, tiered(cost, sum(d.nbytes for d in plan.decisions)), target, max_seconds=None)
    assert again.decisions == plan.decisions
    assert again.predicted_extra_s == plan.predicted_extra_s and again.predicted_disk_nbytes == 0


def test_with_a_host_budget_of_0_every_swap_goes_to_disk(planned):
    tl, cost, plan, swaps = planned
    sim = simulate(tl, plan.decisions, tiered(cost, 0))
    assert sim.disk_nbytes == sum(d.nbytes for d in swaps)
    disk_s = sum(cost.swap_out_s(d.nbytes, disk=True) + cost.swap_in_s(d.nbytes, disk=True) for d in swaps)
    assert sim.channel_busy_s == pytest.approx(disk_s)
    assert sim.period_s >= sim.compute_s + sim.recompute_s


# --- measuring the disk tier ------------------------------------------------------------------------


class StandInSpill:
    """The spill file's interface over a NumPy array, counting what is reserved."""

    def __init__(self, nbytes: int):
        self.data = np.zeros(nbytes, np.uint8)
        self.reserved: dict[int, int] = {}

    def reserve(self, nbytes: int) -> int:
        offset = sum(self.reserved.values())
        self.reserved[offset] = nbytes
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        assert self.reserved.pop(offset) == nbytes

    def write_from(self, offset: int, array) -> None:
        assert array.dtype == np.uint8 and array.flags.c_contiguous
        self.data[offset:offset + array.nbytes] = array

    def read_into(self, offset: int, array) -> None:
        array[...] = self.data[offset:offset + array.nbytes]


def test_measure_disk_gives_positive_finite_bandwidths_and_releases_its_bytes():
    spill = StandInSpill(1 << 20)
    read, write = measure_disk(spill, nbytes=1 << 20, repeats=2)
    assert 0 < read < math.inf and 0 < write < math.inf
    assert spill.reserved == {} and spill.data.min() == 1       # the bytes written went there


def test_measure_disk_through_a_spill_file(tmp_path):
    spill = SpillFile(str(tmp_path / "scratch.spill"))
    try:
        read, write = measure_disk(spill, nbytes=1 << 20, repeats=2)
        assert 0 < read < math.inf and 0 < write < math.inf
        assert spill.in_use_nbytes == 0
        cost = replace(COST, host_budget_nbytes=0, disk_read_bytes_per_s=read, disk_write_bytes_per_s=write)
        assert cost.swap_out_s(N, disk=True) > 0
    finally:
        spill.close()


class StandInSpillDir:
    """The spill directory's ``open_scratch`` and ``free_nbytes``, remembering the files it opened
    and closed; ``fail`` is raised by ``open_scratch`` when given."""

    def __init__(self, free_nbytes: int = 1 << 30, fail: Exception | None = None):
        self.root, self.free, self.fail = "/stand-in", free_nbytes, fail
        self.opened, self.closed = [], []

    def free_nbytes(self) -> int:
        return self.free

    def open_scratch(self):
        if self.fail is not None:
            raise self.fail
        file = StandInSpill(32 << 20)
        file.close = lambda: self.closed.append(file)
        self.opened.append(file)
        return file


def test_the_disk_tier_is_measured_with_at_most_half_its_free_bytes():
    spill = StandInSpillDir(free_nbytes=5 << 20)
    read, write = measure_disk_tier(spill)
    assert 0 < read < math.inf and 0 < write < math.inf
    (file,) = spill.opened
    assert spill.closed == [file] and file.reserved == {}
    assert file.data[:(5 << 20) // 2 // 4096 * 4096].min() == 1 and file.data.max() == 1
    assert file.data[(5 << 20) // 2 // 4096 * 4096:].max() == 0       # nothing beyond half the free bytes


@pytest.mark.parametrize("spill", [StandInSpillDir(free_nbytes=0), StandInSpillDir(free_nbytes=(1 << 21) - 1),
                                   StandInSpillDir(fail=DiskFull("full")), StandInSpillDir(fail=DiskError("broken"))],
                         ids=["nothing-free", "too-little-free", "full", "failing"])
def test_a_disk_tier_that_cannot_be_measured_takes_the_default(spill, caplog):
    with caplog.at_level(logging.WARNING, logger="tensile_db.scheduler.cost"):
        assert measure_disk_tier(spill) == (DEFAULT_DISK_BYTES_PER_S, DEFAULT_DISK_BYTES_PER_S)
    assert spill.opened == [] and "not measured" in caplog.text and "/stand-in" in caplog.text


@pytest.mark.parametrize("host_budget_nbytes", [None, 0, 1 << 20])
def test_the_scheduler_measures_the_disk_tier_and_carries_the_host_budget(host_budget_nbytes):
    device = CpuDevice()
    spill = StandInSpillDir()
    manager = SimpleNamespace(device=device, engine=device.copy_engine(), budget_nbytes=1 << 22,
                              host_tier=HostTier(host_budget_nbytes, spill, None), pool=SimpleNamespace(offload=None))
    scheduler = Scheduler(manager, policy="reactive")
    try:
        cost = scheduler.cost
        assert cost.host_budget_nbytes == host_budget_nbytes
        assert 0 < cost.disk_read_bytes_per_s < math.inf and 0 < cost.disk_write_bytes_per_s < math.inf
        assert spill.closed == spill.opened and len(spill.opened) == 1      # the scratch file is removed
    finally:
        scheduler.close()
        manager.engine.close()
