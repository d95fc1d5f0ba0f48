"""Several devices under one coordinator: the placement rule (Note [Placement]), the
``tensile.devices`` setting, and a coordinator that drives two cpu devices, each with its own
budget, arena, manager and executor."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import wait_until
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.coordinator.placement import PRESSURE_EXTRA, Load, choose, iteration_s, remaining_s
from tensile_db.coordinator.server import Coordinator
from tensile_db.errors import DeviceOutOfMemory, InvalidArgument
from tensile_db.runtime import model as models
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.devices import kind_and_index
from tensile_db.settings import MAX_DEVICES, parse_devices, parse_max_pressure

MIB = 1 << 20


def test_a_device_whose_budget_cannot_hold_the_smallest_working_set_is_never_chosen():
    idle_small, busy_large = Load(1 * MIB), Load(64 * MIB, (60 * MIB,) * 3, (100.0,) * 3)
    assert choose([idle_small, busy_large], 2 * MIB, 2 * MIB, 1.0) == 1
    assert choose([idle_small], 2 * MIB, 2 * MIB, 1.0) is None


def test_jobs_spread_over_idle_devices_in_the_order_listed():
    assert choose([Load(8 * MIB), Load(8 * MIB)], MIB, MIB, 1.0) == 0
    assert choose([Load(8 * MIB, (MIB,), (1.0,)), Load(8 * MIB)], MIB, MIB, 1.0) == 1


def test_the_predicted_finish_is_that_of_processor_sharing():
    # beside a job with 10 s left a 2 s job ends after 4 s; beside two with 1 s left, after 4 s
    long, short = Load(8 * MIB, (MIB,), (10.0,)), Load(8 * MIB, (MIB, MIB), (1.0, 1.0))
    assert long.finish_s(MIB, 2.0) == pytest.approx(4.0) and short.finish_s(MIB, 2.0) == pytest.approx(4.0)
    assert long.finish_s(MIB, 3.0) == pytest.approx(6.0) and short.finish_s(MIB, 3.0) == pytest.approx(5.0)
    assert choose([long, short], MIB, MIB, 3.0) == 1
    assert choose([short, long], MIB, MIB, 0.5) == 1      # 1.0 against 1.5: the long job's device


def test_memory_pressure_stretches_the_finish_and_breaks_ties():
    tight, roomy = Load(4 * MIB, (4 * MIB,), (5.0,)), Load(16 * MIB, (4 * MIB,), (5.0,))
    assert tight.pressure(4 * MIB) == 2.0 and roomy.pressure(4 * MIB) == 0.5
    assert tight.finish_s(4 * MIB, 1.0) == pytest.approx(2.0 * (1.0 + PRESSURE_EXTRA))
    assert roomy.finish_s(4 * MIB, 1.0) == pytest.approx(2.0)
    assert choose([tight, roomy], 4 * MIB, MIB, 1.0) == 1
    # an over-budget device still wins when the wait elsewhere costs more than its scheduling
    assert choose([Load(4 * MIB, (4 * MIB,), (0.1,)), Load(16 * MIB, (MIB,) * 4, (50.0,) * 4)], 4 * MIB, MIB, 1.0) == 0


def test_the_flow_is_the_sum_of_every_jobs_finish_under_processor_sharing():
    one = Load(8 * MIB, (6 * MIB,), (10.0,))
    # a 1 s job beside it at 10/8 of the budget ends after 2 s, the running one after 11 s, both
    # stretched by 1.025; waiting, the running one ends after 10 s and the new one after 11 s
    assert one.finish_s(4 * MIB, 1.0) == pytest.approx(2.0 * (1.0 + PRESSURE_EXTRA * 0.25))
    assert one.flow_s(4 * MIB, 1.0) == pytest.approx(13.0 * (1.0 + PRESSURE_EXTRA * 0.25))
    assert one.flow_after_room_s(4 * MIB, 1.0) == pytest.approx(21.0)
    # an equal job: 20 s each sharing, stretched, against 10 s and 20 s waiting
    assert one.flow_s(4 * MIB, 10.0) == pytest.approx(40.0 * 1.025)
    assert one.flow_after_room_s(4 * MIB, 10.0) == pytest.approx(30.0)
    # a 6 s job would itself end sooner sharing (after 12 s, stretched, against 16 s), but it
    # would end the running one 6 s later: together they end sooner when it waits
    assert one.finish_s(4 * MIB, 6.0) == pytest.approx(12.0 * 1.025)
    assert one.flow_s(4 * MIB, 6.0) == pytest.approx(28.0 * 1.025)
    assert one.flow_after_room_s(4 * MIB, 6.0) == pytest.approx(26.0)
    # three running at 12/8: the two that must end first end after 3 and 5 s (stretched by 1.05),
    # then a 4 MiB job fits beside the last, which has 1 s left: both end 2 s later
    three = Load(8 * MIB, (4 * MIB,) * 3, (1.0, 2.0, 3.0))
    assert three.flow_after_room_s(4 * MIB, 1.0) == pytest.approx((3.0 + 5.0) * 1.05 + 2 * (5.0 * 1.05 + 2.0))
    # larger than the budget alone: it starts once every job has ended, and runs alone
    ended = 3.0 + 5.0 + 6.0
    assert three.flow_after_room_s(16 * MIB, 1.0) == pytest.approx(ended * 1.05 + 6.0 * 1.05 + 1.0 * (1.0 + PRESSURE_EXTRA))
    assert Load(8 * MIB).flow_after_room_s(MIB, 1.0) == Load(8 * MIB).flow_s(MIB, 1.0) == 1.0


@pytest.mark.parametrize("text, value", [("2", 2.0), (" 1.25 ", 1.25), ("None", None), ("1", 1.0)])
def test_the_pressure_bound_is_a_number_of_budgets_or_none(text, value):
    assert parse_max_pressure(text) == value


@pytest.mark.parametrize("text", ["0.5", "", "two", "-3", "inf", "nan"])
def test_a_pressure_bound_below_one_budget_is_refused(text):
    with pytest.raises(InvalidArgument, match="tensile.max_pressure is"):
        parse_max_pressure(text)


def _job(epochs: int = 2, rows: int = 64, width: int = 32) -> TrainingJob:
    spec = models.ModelSpec.parse({"layers": [{"dense": width}]}, 8, 2, "classification")
    rng = np.random.default_rng(0)
    return TrainingJob(JobInfo(1, "r", "m"), spec, models.parse_options({"epochs": epochs, "batch_size": 16}),
                       rng.normal(size=(rows, 8)).astype(np.float32), rng.integers(0, 2, rows).astype(np.int32))


def test_a_jobs_work_is_its_iterations_left_times_the_devices_estimate():
    job, device = _job(epochs=3), CpuDevice()
    one = iteration_s(job.program, device)
    assert one > 0 and remaining_s(job, device) == pytest.approx(3 * 4 * one)
    job.iterations = 5
    assert remaining_s(job, device) == pytest.approx(7 * one)


@pytest.mark.parametrize("text, names", [("", []), (" cpu:0 , cpu:1", ["cpu:0", "cpu:1"]), ("cuda:0", ["cuda:0"]),
                                         ("cpu:007", ["cpu:7"])])
def test_the_devices_setting_lists_devices_of_one_kind(text, names):
    assert parse_devices(text) == names


@pytest.mark.parametrize("text, message", [("gpu:0", "entry 'gpu:0' is not a device"), ("cpu", "'cpu' is not a device"),
                                           ("cpu:0,,cpu:1", "entry '' is not a device"),
                                           ("cpu:0, cuda:0", "mixes device kinds"), ("cpu:1, cpu:01", "twice"),
                                           (", ".join(f"cpu:{i}" for i in range(MAX_DEVICES + 1)), "at most")])
def test_the_devices_setting_refuses_what_it_cannot_drive(text, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_devices(text)


def test_a_devices_name_gives_its_kind_and_index():
    assert [kind_and_index(n) for n in ("cpu", "cuda", "cpu:3", "cuda:1")] == [("cpu", 0), ("cuda", 0), ("cpu", 3),
                                                                             ("cuda", 1)]


def test_a_budget_per_device_or_one_for_all(tmp_path):
    with pytest.raises(InvalidArgument, match="2 device budgets for 3 devices"):
        Coordinator(str(tmp_path / "c"), budget_nbytes=[MIB, MIB], devices=["cpu:0", "cpu:1", "cpu:2"])
    c = Coordinator(str(tmp_path / "d"), budget_nbytes=4 * MIB, devices=["cpu:0", "cpu:1"])
    assert c.budgets_nbytes == [4 * MIB, 4 * MIB]


@pytest.fixture
def two_devices(tmp_path, request):
    """A coordinator (in this process) driving cpu:0 and cpu:1, with the budgets of the test's
    ``budgets`` mark (default 8 MiB and 64 KiB)."""
    mark = request.node.get_closest_marker("budgets")
    c = Coordinator(str(tmp_path / "coordinator"), budget_nbytes=mark.args[0] if mark else [8 * MIB, 64 << 10],
                    devices=["cpu:0", "cpu:1"])
    listener = c.start()
    try:
        yield c
    finally:
        listener.close()
        for executor in c.executors:
            executor.stop()


def test_jobs_land_where_their_smallest_working_set_fits_and_cancel_frees_that_device(two_devices):
    c = two_devices
    roomy, tiny = c.executors
    jobs = [_job(epochs=10_000, width=2048) for _ in range(2)]
    assert jobs[0].min_working_set_nbytes > tiny.manager.budget_nbytes
    for job in jobs:
        assert c.training.submit(job) is roomy and job.device == "cpu:0"
    assert wait_until(lambda: all(j.state.value == "running" for j in jobs))
    rows = [c.memory_report(e) for e in c.executors]
    assert [r.device for r in rows] == ["cpu:0", "cpu:1"] and [r.running_jobs for r in rows] == [2, 0]
    assert rows[0].in_use_nbytes > 0 and rows[1].in_use_nbytes == 0 and rows[0].peak_nbytes <= 8 * MIB
    c.training.cancel(jobs[0])
    c.training.cancel(jobs[1])
    assert wait_until(lambda: roomy.manager.in_use_nbytes == 0 and not roomy.jobs())
    huge = _job()
    huge.__dict__["min_working_set_nbytes"] = 9 * MIB        # more than any budget holds
    with pytest.raises(DeviceOutOfMemory):
        c.training.submit(huge)


@pytest.mark.budgets([8 * MIB, 8 * MIB])
def test_concurrent_jobs_spread_over_the_devices(two_devices):
    c = two_devices
    jobs = [_job(epochs=10_000, width=2048) for _ in range(4)]
    assert [c.training.submit(j).name for j in jobs] == ["cpu:0", "cpu:1", "cpu:0", "cpu:1"]
    assert wait_until(lambda: all(j.state.value == "running" for j in jobs))
    assert [len(e.jobs()) for e in c.executors] == [2, 2]
    for job in jobs:
        c.training.cancel(job)
    assert wait_until(lambda: not any(e.jobs() for e in c.executors))
    assert all(c.memory_report(e).peak_nbytes <= 8 * MIB for e in c.executors)
