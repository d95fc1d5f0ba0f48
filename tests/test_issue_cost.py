"""The executor's seconds per swap action (Note [Issue cost] in ``tensile_db.scheduler.cost``):

- the planners' simulation adds the issue cost to the compute stream at each swap-out and each
  swap-in, and puts a copy the executor makes itself (``inline_nbytes``) on the compute stream,
  not on a copy channel and not slowed by contention; a swap to the disk tier is never inline;
- a plan made knowing the issue cost takes fewer swaps and is predicted faster under it;
- the start-up measurement finds a cost on ``cpu`` and the copies its engine makes inline, none
  on the simulated device, and closes its own memory manager however it ends; a negative cost
  is refused.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tensile_db.errors import InvalidArgument
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.simulated import SimDevice
from tensile_db.scheduler import cost as cost_module
from tensile_db.scheduler.cost import CostModel, measure_bandwidth, measure_issue
from tensile_db.scheduler.timeline import Decision, Simulator, simulate
from tensile_db.scheduler.worker import make_plan
from timeline_helpers import PLAIN, N, timeline

ISSUE_S = 20e-6
# out after event 2, released before 5, in before 18, needed at 22: 1 ms copies with room to hide
HIDDEN = Decision(1, "t", N, "swap", 2, 22, 5, 18)


def test_each_swap_costs_the_compute_stream_two_issues():
    tl = timeline()
    plain, issued = simulate(tl, [HIDDEN], PLAIN), simulate(tl, [HIDDEN], replace(PLAIN, issue_s=ISSUE_S))
    assert plain.extra_s == pytest.approx(0.0, abs=1e-12)
    assert issued.extra_s == pytest.approx(2 * ISSUE_S, rel=1e-9)
    assert issued.channel_busy_s == plain.channel_busy_s and issued.stall_s == 0.0


@pytest.mark.parametrize("contention", [0.0, 0.2])
def test_an_inline_copy_runs_on_the_compute_stream_at_its_own_speed(contention):
    tl = timeline()
    cost = replace(PLAIN, contention=contention, inline_nbytes=N)
    sim = simulate(tl, [HIDDEN], cost)
    assert sim.channel_busy_s == 0.0 and sim.stall_s == 0.0
    assert sim.extra_s == pytest.approx(PLAIN.swap_out_s(N) + PLAIN.swap_in_s(N), rel=1e-9)
    # one byte more than inline: on the channel, hidden again, but for the contention's loss
    wider = simulate(tl, [replace(HIDDEN, nbytes=N + 1)], cost).extra_s
    assert wider == pytest.approx(contention * PLAIN.swap_out_s(N + 1), rel=1e-9, abs=1e-12)


def _replayed_extra_s(sim: Simulator, also: Decision | None = None, instead: int | None = None) -> float:
    """:meth:`Simulator.extra_s` by the replay of the events, whatever the decisions."""
    _, period_s, _, _, _ = sim._replay(*sim._with(also, instead), len(sim.decisions) + 1, timed=False)
    return period_s - sim._compute_s


@pytest.mark.parametrize("recompute", [False, True])
def test_a_trial_of_inline_decisions_adds_their_seconds_as_the_replay_times_them(recompute):
    # Note [Inline plans add up]: every copy on the compute stream, one tier
    tl = timeline()
    cost = replace(PLAIN, issue_s=ISSUE_S, inline_nbytes=N)
    taken = [HIDDEN, Decision(1, "u", N // 2, "swap", 6, 3, 8, 1)]
    if recompute:
        taken.append(Decision(1, "r", N, "recompute", 10, 14, 11, 14, recipe_s=3e-4))
    sim = Simulator(tl, cost, taken)
    for also in (None, Decision(1, "v", N // 4, "swap", 12, 20, 13, 19),
                 Decision(1, "w", N, "recompute", 4, 9, 5, 9, recipe_s=5e-4)):
        steps = tl.work.steps
        added = sim.extra_s(also)
        assert tl.work.steps == steps + 1              # added up, not replayed
        assert added == pytest.approx(_replayed_extra_s(sim, also), rel=1e-12, abs=1e-15)
    expected = sum(2 * ISSUE_S + PLAIN.swap_in_s(d.nbytes) + PLAIN.swap_out_s(d.nbytes) if d.method == "swap"
                   else d.recipe_s for d in taken)
    assert sim.extra_s() == pytest.approx(expected, rel=1e-12)
    assert sim.simulate().extra_s == pytest.approx(expected, rel=1e-12)
    wider = replace(taken[1], back=0)                  # a re-timing of swap 1: swapped in an event sooner
    assert sim.extra_s(wider, instead=1) == pytest.approx(_replayed_extra_s(sim, wider, 1), rel=1e-12)
    sim.retime(1, wider)
    assert sim.extra_s() == pytest.approx(_replayed_extra_s(sim), rel=1e-12)
    assert sim.extra_s() == pytest.approx(expected, rel=1e-12)


def test_a_trial_replays_the_events_once_a_copy_takes_a_channel():
    tl = timeline()
    cost = replace(PLAIN, issue_s=ISSUE_S, inline_nbytes=N)
    sim = Simulator(tl, cost, [HIDDEN])
    wide = Decision(1, "x", 2 * N, "swap", 3, 12, 5, 10)      # above inline: its copies on the channel
    assert sim.extra_s(wide) == pytest.approx(_replayed_extra_s(sim, wide), rel=1e-12)
    sim.add(wide)
    steps = tl.work.steps
    assert sim.extra_s() == pytest.approx(_replayed_extra_s(sim), rel=1e-12)
    assert tl.work.steps > steps + 1              # replayed, not added up
    tiered = Simulator(tl, replace(cost, host_budget_nbytes=N, **TIERS), [HIDDEN])
    steps = tl.work.steps
    assert tiered.extra_s() == pytest.approx(_replayed_extra_s(tiered), rel=1e-12)
    assert tl.work.steps > steps + 1
    channels = Simulator(tl, replace(cost, inline_nbytes=0), [Decision(1, "r", N, "recompute", 10, 14, 11, 14, recipe_s=3e-4)])
    steps = tl.work.steps
    assert channels.extra_s() == pytest.approx(3e-4, rel=1e-9)
    assert tl.work.steps > steps + 1              # no copy on the compute stream: always replayed


TIERS = dict(disk_read_bytes_per_s=1e9, disk_write_bytes_per_s=1e9)


def test_a_swap_to_the_disk_tier_is_never_inline():
    tl = timeline()
    cost = replace(PLAIN, inline_nbytes=N, host_budget_nbytes=0, **TIERS)
    sim = simulate(tl, [HIDDEN], cost)
    assert sim.disk_nbytes == N
    assert sim.channel_busy_s == pytest.approx(cost.swap_out_s(N, disk=True) + cost.swap_in_s(N, disk=True), rel=1e-9)


def test_an_inline_swap_in_frees_its_host_bytes_when_done_though_an_earlier_one_is_still_copying():
    # X (5 MB, on the copy channel) is swapped in from before event 9 and lands after event 13;
    # Y (0.5 MB, inline) is swapped in at event 11, done at once. Z (0.5 MB) is swapped out
    # after event 12: with Y's bytes back, X and Z fit the host tier; with them still held, Z
    # goes to disk.
    tl = timeline()
    x = Decision(1, "x", 5 * N, "swap", 0, 20, 6, 9)
    y = Decision(1, "y", N // 2, "swap", 2, 16, 3, 11)
    z = Decision(1, "z", N // 2, "swap", 12, 21, 13, 19)
    cost = replace(PLAIN, inline_nbytes=N, host_budget_nbytes=5 * N + N // 2, **TIERS)
    assert simulate(tl, [x, y, z], cost).disk_nbytes == 0
    # Y on the channel, behind X: neither lands before Z's swap-out
    assert simulate(tl, [x, y, z], replace(cost, inline_nbytes=0)).disk_nbytes == N // 2


def test_a_plan_made_knowing_the_issue_cost_takes_fewer_swaps_and_runs_faster_under_it():
    costly = replace(PLAIN, issue_s=ISSUE_S)
    target = int(0.5 * timeline().vanilla_peak_nbytes())
    plans = {}
    for name, cost in (("blind", PLAIN), ("knowing", costly)):
        tl = timeline()
        decisions = make_plan("tensile", tl, cost, target, None, {}).decisions
        assert tl.usage(decisions).max() <= target
        plans[name] = ([d for d in decisions if d.method == "swap"], simulate(tl, decisions, costly).extra_s)
    assert len(plans["knowing"][0]) < len(plans["blind"][0])
    assert plans["knowing"][1] < plans["blind"][1]


def test_the_measurement_finds_a_cost_on_cpu_and_its_inline_copies():
    device = CpuDevice()
    manager = MemoryManager(device, 64 << 20)
    try:
        cost = measure_bandwidth(device, manager.engine, nbytes=4 << 20, repeats=2)
    finally:
        manager.close()
    assert 0.0 < cost.issue_s < 0.01
    assert cost.inline_nbytes == manager.engine.inline_nbytes > 0


def test_the_simulated_device_measures_no_issue_cost_and_no_inline_copy():
    device = SimDevice("h100", jitter=0.0)
    assert measure_issue(device) == 0.0
    manager = MemoryManager(device, 1 << 30)
    try:
        cost = measure_bandwidth(device, manager.engine)
    finally:
        manager.close()
    assert cost.issue_s == 0.0 and cost.inline_nbytes == 0


def test_without_inline_copies_an_empty_swap_is_on_the_channel():
    tl = timeline()
    slow = replace(PLAIN, latency_s=1e-3, contention=0.2)
    empty = replace(HIDDEN, nbytes=0)
    # hidden behind the kernels: only the contention's loss of its 1 ms copies
    assert simulate(tl, [empty], slow).extra_s == pytest.approx(0.2 * 1e-3, rel=1e-9)


@pytest.mark.parametrize("fails", [False, True])
def test_the_probe_closes_its_manager_even_when_a_swap_fails(monkeypatch, fails):
    made = []

    class Recorded(MemoryManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.closed = False
            made.append(self)

        def swap_out(self, t):
            if fails:
                raise OSError("the copy failed")
            super().swap_out(t)

        def close(self):
            self.closed = True
            super().close()

    monkeypatch.setattr(cost_module, "MemoryManager", Recorded)
    if fails:
        with pytest.raises(OSError, match="the copy failed"):
            measure_issue(CpuDevice(), cycles=4)
    else:
        assert measure_issue(CpuDevice(), cycles=4) > 0.0
    assert len(made) == 1 and made[0].closed


@pytest.mark.parametrize("field, value", [("issue_s", -1e-6), ("inline_nbytes", -1)])
def test_a_negative_issue_cost_or_inline_size_is_refused(field, value):
    with pytest.raises(InvalidArgument, match=f"{field} {value!r}"):
        CostModel(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, **{field: value})
