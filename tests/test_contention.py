"""Contention between copies and kernels (Note [Contention] in ``tensile_db.scheduler.cost``):

- the start-up measurement finds the simulated device's contention, and none where it has none;
  on ``cpu`` it is a fraction within the cap, and its swap-outs (for the bandwidth and beside the
  kernels) copy into one buffer kept warm, as the coordinator's copy into spare host buffers;
- a negative contention is refused with the value named;
- the planners' simulation prices it: a swap that hides alone costs the kernels beside it
  ``c`` of its copy's seconds, and copies arrive later by the same factor.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tensile_db.errors import InvalidArgument
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import gpus
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.simulated import SimDevice
from tensile_db.scheduler.cost import MAX_CONTENTION, CostModel, measure_bandwidth
from tensile_db.scheduler.planners import plan_swap_score
from tensile_db.scheduler.timeline import Decision, simulate
from timeline_helpers import PLAIN, N, timeline

C = 0.2
CONTENDED = replace(PLAIN, contention=C)


@pytest.mark.parametrize("contention", [gpus.CONTENTION, 0.0])
def test_the_measurement_finds_the_simulated_devices_contention(contention):
    device = SimDevice("h100", jitter=0.0, contention=contention)
    cost = measure_bandwidth(device, MemoryManager(device, 1 << 30).engine)
    assert cost.contention == pytest.approx(contention, abs=1e-9)


def test_on_cpu_the_measurement_is_a_fraction_within_the_cap():
    device = CpuDevice()
    manager = MemoryManager(device, 64 << 20)
    try:
        contention = measure_bandwidth(device, manager.engine, nbytes=4 << 20, repeats=2).contention
    finally:
        manager.close()
    assert 0.0 <= contention <= MAX_CONTENTION


def test_on_cpu_the_measured_swap_outs_copy_into_one_warm_buffer(monkeypatch):
    device = CpuDevice()
    manager = MemoryManager(device, 64 << 20)
    engine, into = manager.engine, []
    to_host = engine.to_host

    def recorded(array, host=None):
        into.append(None if host is None else host.__array_interface__["data"][0])
        return to_host(array, host)

    monkeypatch.setattr(engine, "to_host", recorded)
    try:
        measure_bandwidth(device, engine, nbytes=4 << 20, repeats=2)
    finally:
        manager.close()
    # the bandwidth's and the latency's, and the contention's where the engine copies on a thread of
    # its own (where it copies on the caller's, a thread copies beside the kernels, into a buffer of
    # its own)
    assert len(into) >= (4 if engine.inline_nbytes >= 4 << 20 else 6) and None not in into
    assert len(set(into)) == 1


def test_a_negative_contention_is_refused():
    with pytest.raises(InvalidArgument, match="contention -0.1"):
        CostModel(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, contention=-0.1)


def test_a_hidden_swap_costs_the_kernels_beside_it_c_of_its_copy():
    tl = timeline()
    # out after event 2, released before 5, in before 18, needed at 22: 1 ms copies with room
    d = Decision(1, "t", N, "swap", 2, 22, 5, 18)
    plain, contended = simulate(tl, [d], PLAIN), simulate(tl, [d], CONTENDED)
    assert plain.stall_s == 0.0 and contended.stall_s == 0.0
    # both engines copy (1 + C) ms beside the kernels: the busier one's C ms are lost once
    assert contended.extra_s - plain.extra_s == pytest.approx(C * PLAIN.swap_out_s(N), rel=1e-9)
    assert contended.channel_busy_s == pytest.approx((1 + C) * plain.channel_busy_s, rel=1e-9)


def test_a_swap_with_no_room_to_spare_waits_longer_for_its_slower_copy():
    tl = timeline()
    # released at the next event, 1 ms after its swap-out starts: the copy takes 1 ms alone
    d = Decision(1, "t", N, "swap", 2, 22, 3, 18)
    plain, contended = simulate(tl, [d], PLAIN), simulate(tl, [d], CONTENDED)
    assert contended.stall_s == pytest.approx(plain.stall_s + C * PLAIN.swap_out_s(N), rel=1e-9)


def test_no_copies_no_loss():
    tl = timeline()
    assert simulate(tl, [], CONTENDED).extra_s == simulate(tl, [], PLAIN).extra_s


def test_a_plans_loss_is_at_least_c_of_its_busier_engines_seconds():
    tl = timeline()
    plan = plan_swap_score(tl, PLAIN, int(0.6 * tl.vanilla_peak_nbytes()), None)
    swaps = [d for d in plan.decisions if d.method == "swap"]
    assert swaps
    busier_s = max(sum(PLAIN.swap_out_s(d.nbytes) for d in swaps), sum(PLAIN.swap_in_s(d.nbytes) for d in swaps))
    plain, contended = simulate(tl, plan.decisions, PLAIN), simulate(tl, plan.decisions, CONTENDED)
    assert contended.extra_s >= plain.extra_s + C * busier_s * (1 - 1e-9)
    assert np.all(np.diff(contended.start_s) > 0)
