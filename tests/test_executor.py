"""The executor's admission control: queueing beyond ``max_active_jobs`` and beyond its memory pressure
bound (Note [Admission by memory pressure]) with a visible state,
cancellation of queued and running jobs, refusal of a job that can never fit, and stop()."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import TEST_DEVICE
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, JobState, TrainingJob
from tensile_db.errors import DeviceOutOfMemory, JobCancelled
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import model as models
from tensile_db.runtime.devices import make_device


def make_job(name: str, epochs: int = 2, width: int = 32) -> TrainingJob:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    spec = models.ModelSpec(models.parse_architecture({"layers": [{"dense": width}]}), 8, 2, "classification")
    return TrainingJob(JobInfo(1, "tester", name), spec, models.parse_options({"epochs": epochs, "batch_size": 32}), x, y)


def wait_running(job: TrainingJob) -> None:
    deadline = time.monotonic() + 10
    while job.state is JobState.QUEUED and time.monotonic() < deadline:
        time.sleep(0.005)
    assert job.state is JobState.RUNNING


def wait_done(job: TrainingJob) -> str:
    while True:
        kind, _ = job.events.get(timeout=30)
        if kind != "progress":
            return kind


@pytest.fixture
def executor():
    ex = Executor(MemoryManager(make_device(TEST_DEVICE), 1 << 20), max_active_jobs=1)
    ex.start()
    yield ex
    ex.stop()


def test_jobs_beyond_the_limit_wait_queued(executor):
    first, second = make_job("first", epochs=200), make_job("second")
    executor.submit(first)
    wait_running(first)
    executor.submit(second)
    assert second.state is JobState.QUEUED
    assert [j.describe(executor.manager, executor.name).state for j in executor.jobs()] == ["running", "queued"]
    executor.cancel(first)
    assert wait_done(first) == "error" and isinstance(first.error, JobCancelled)
    assert wait_done(second) == "done" and second.state is JobState.DONE
    assert second.started_at >= first.finished_at


def test_cancel_while_queued_and_memory_is_freed(executor):
    running, queued = make_job("running", epochs=500), make_job("queued")
    executor.submit(running)
    executor.submit(queued)
    executor.cancel(queued)
    assert queued.state is JobState.CANCELLED and wait_done(queued) == "error"
    executor.cancel(running)
    assert wait_done(running) == "error" and running.state is JobState.CANCELLED
    assert executor.manager.in_use_nbytes == 0 and executor.jobs() == []


def test_a_job_that_can_never_fit_is_refused(executor):
    huge = make_job("huge", width=1 << 14)
    with pytest.raises(DeviceOutOfMemory) as info:
        executor.submit(huge)
    assert info.value.requested_nbytes == huge.min_working_set_nbytes > executor.manager.budget_nbytes
    assert "model 'huge'" in str(info.value) and executor.jobs() == []


def test_stop_cancels_running_jobs():
    ex = Executor(MemoryManager(make_device(TEST_DEVICE), 1 << 20))
    ex.start()
    job = make_job("long", epochs=10_000)
    ex.submit(job)
    ex.stop()
    assert job.state is JobState.CANCELLED and ex.manager.in_use_nbytes == 0


def test_beyond_the_budget_a_job_joins_only_when_it_is_predicted_to_end_sooner_that_way():
    # Two equal long jobs: sharing would end the second later than waiting for the first, so it
    # waits although the bound would let it in; a short job beside a long one joins at once (the
    # test above, at 8 budgets).
    first, second = make_job("first", epochs=500, width=512), make_job("second", epochs=500, width=512)
    budget = first.vanilla_peak_nbytes
    assert budget < first.vanilla_peak_nbytes + second.vanilla_peak_nbytes <= 8.0 * budget
    ex = Executor(MemoryManager(make_device(TEST_DEVICE), budget), max_pressure=8.0)
    ex.start()
    try:
        ex.submit(first)
        wait_running(first)
        ex.submit(second)
        time.sleep(0.2)
        assert second.state is JobState.QUEUED and first.state is JobState.RUNNING
        ex.cancel(first)
        wait_running(second)
        ex.cancel(second)
        assert wait_done(second) == "error"
    finally:
        ex.stop()


@pytest.mark.parametrize("max_pressure, together", [(None, True), (8.0, True), (1.5, False)])
def test_a_job_waits_while_the_running_jobs_peaks_leave_no_room(max_pressure, together):
    first, second = make_job("first", epochs=500, width=512), make_job("second", width=512)
    budget = first.vanilla_peak_nbytes
    assert 1.5 * budget < first.vanilla_peak_nbytes + second.vanilla_peak_nbytes <= 8.0 * budget
    ex = Executor(MemoryManager(make_device(TEST_DEVICE), budget), max_pressure=max_pressure)
    ex.start()
    try:
        ex.submit(first)
        wait_running(first)
        ex.submit(second)
        if together:
            wait_running(second)
        else:
            time.sleep(0.2)
            assert second.state is JobState.QUEUED and first.state is JobState.RUNNING
        ex.cancel(first)
        assert wait_done(second) == "done"
        assert (second.started_at < first.finished_at) == together
    finally:
        ex.stop()
