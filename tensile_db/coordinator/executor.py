"""The executor: admission control and fair, periodic execution of every running job's ops.

One thread runs all jobs on the device, in rounds. Each round it admits queued jobs while fewer
than ``max_active_jobs`` run, then lets every running job run the op that is due. The rounds form
periods (Note [Fair sharing] in :mod:`tensile_db.scheduler.timeline`): in a period of ``R`` rounds
a job runs ``k`` iterations, its *iterations per period*, chosen by the scheduler so that every
job gets about the same device time per period; its op at period position ``q`` is due in round
``start + round_of(q, k * L, R)``. So a small model beside a long one completes many iterations
while the long one completes one, and a job's progress does not depend on the length of the
others' programs. The ops of concurrent jobs interleave as kernels of concurrent processes would
on a GPU, the memory manager sees one combined timeline, and that timeline repeats every period,
which is what the scheduler plans (:mod:`tensile_db.scheduler`).

The iterations per period and the period change only when a job arrives or leaves and when a
job's measured op times settle; a job whose pace changes is re-anchored so that its next op is
due at once (no stall, no burst), the memory manager is told that the schedule changed, and the
scheduler re-plans for the new timeline. A job whose smallest possible working set exceeds the
budget is refused at submission with the bytes it needs; a cancelled job is removed between two
ops and its device memory freed at once.

Note [Admission by memory pressure]
-----------------------------------
Rationale: the scheduler fits any set of jobs into the budget, but what it costs grows fast with
how far their unscheduled peaks exceed it, and the device runs one op at a time: jobs that share
it beyond its memory gain no throughput, they only add swaps and recomputes. Sixteen jobs of the
four seed models on four simulated H100s, at half the four models' peaks per device
(``bench/placement.py``), ran 28% over the ideal makespan with every job admitted at once (eight
per device), 12% over it when each device admitted a job only while its running jobs' peaks
stayed within twice its budget, and 5% over it with the rule below. What sharing beyond the
budget does buy is time for a short job behind a long one: it need not wait for the long one
to end.

Approach: a queued job is admitted, in arrival order, when fewer than ``max_active_jobs`` run
and one of these holds:

1. none runs, or the unscheduled peaks of the running jobs and its own fit the budget;
2. they stay within ``max_pressure`` times the budget (``tensile.max_pressure``, default 2:
   where the planners still do well; ``bench/paper.py``'s jobs at 50% of their peak), and the
   jobs of the device, it and the running ones, are predicted to end sooner, summed, if it
   shares the device now than if it waits until enough running jobs have ended for it to fit
   (:meth:`.placement.Load.flow_s` against :meth:`~.placement.Load.flow_after_room_s`: the
   processor-sharing finish times of Note [Placement], stretched by the scheduler's predicted
   extra time). Equal jobs wait for each other; a job much shorter than the running ones joins
   them; a job that would itself end sooner sharing, but would delay the running ones by more
   than it gains, waits. The sum of the finish times is what shortest-remaining-work scheduling
   minimises (SRPT: Schrage, "A proof of the optimality of the shortest remaining processing
   time discipline", Operations Research 16(3), 1968); here it decides one admission at a time.
   Weighing the new job's own finish alone admitted jobs that made the running ones pay: on
   ``bench/placement.py``'s four simulated H100s, two ResNet-50s joined a VGG-16 beyond the
   budget, each predicted to end sooner so, and the VGG-16 ran +0.035 over its vanilla time
   (median of three seeds) against +0.018 on one device; weighing the sum, no device went
   beyond its budget there (highest peak 0.818 of it), and the makespan went from 1.053 to
   1.050 x the ideal (two devices: 1.058 to 1.051; one: 1.040 to 1.013), the mean time from
   arrival to end from 0.731 to 0.716 s.

A job above the budget alone runs alone. ``max_pressure`` None (the executors that
``bench/paper.py`` builds to measure the scheduler under many jobs at once) admits every job up
to ``max_active_jobs``. Limitations: the jobs queued behind it are not weighed; the wait is
stretched by the pressure of all the running jobs, also after some have ended; the queue is
first come, first served, so a large job at its head holds smaller ones behind it until it can
start; the work of every job is estimated from its ops' FLOPs and bytes
(:meth:`~tensile_db.runtime.device.Device.op_seconds`), not from its measured times.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

from ..errors import DeviceOutOfMemory, JobCancelled, TensileError
from ..memory.manager import MemoryManager
from ..scheduler.cost import CostModel
from ..scheduler.engine import Scheduler
from ..scheduler.timeline import period_of, round_of
from ..settings import DEFAULT_MAX_ACTIVE_JOBS, DEFAULT_POLICY
from . import placement
from .jobs import JobState, TrainingJob

log = logging.getLogger(__name__)


@dataclass
class _Pace:
    """Where a running job is in the executor's periods: the round its current period started in
    (its phase, mod the period), its iterations per period, and the iterations of the current
    period it has completed."""

    start: int
    repeats: int
    iteration: int = 0

    def offset(self, job: TrainingJob, period: int) -> int:
        """Rounds from the start of the job's period to the round its next op is due in."""
        n_prog = len(job.program.ops)
        return round_of(self.iteration * n_prog + job.next_position, self.repeats * n_prog, period)


class Executor:
    """Runs submitted jobs on ``manager``'s device; ``start()`` launches the thread.

    ``policy`` is the scheduler policy (:data:`tensile_db.scheduler.POLICIES`); ``cost`` the cost
    model (measured when None); ``name`` the device's name in the views (``cpu:1``; by default
    the device's kind); ``max_pressure`` the bound of Note [Admission by memory pressure] (None:
    none, every job admitted up to ``max_active_jobs``). Raises InvalidArgument for an unknown
    policy.
    """

    def __init__(self, manager: MemoryManager, max_active_jobs: int = DEFAULT_MAX_ACTIVE_JOBS,
                 policy: str = DEFAULT_POLICY, cost: CostModel | None = None, name: str | None = None,
                 max_pressure: float | None = None):
        self.manager = manager
        self.name = name or manager.device.name
        self.max_pressure = max_pressure
        self.scheduler = Scheduler(manager, policy, cost)
        self.max_active_jobs = max_active_jobs
        # ``_cond`` guards ``queued``, ``running``, ``_stopping`` and which jobs ``_pace`` holds;
        # the executor's thread alone changes ``round``, ``period``, ``_repace`` and the paces.
        self.round = 0
        self.period = 1                                 # rounds per period
        self._pace: dict[int, _Pace] = {}               # running job id -> its place in the periods
        self._repace = False                            # recompute the paces before the next round
        self.queued: collections.deque[TrainingJob] = collections.deque()
        self.running: dict[int, tuple[TrainingJob, object]] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"tensile-executor {self.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel every job and end the thread; the planning threads and the manager's swap
        engine stop too."""
        for job in self.jobs():
            self.cancel(job)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        self.scheduler.close()
        self.manager.close()

    def check_fits(self, job: TrainingJob) -> None:
        """Raise DeviceOutOfMemory if even the job's smallest working set cannot fit the budget."""
        need = job.min_working_set_nbytes
        if need > self.manager.budget_nbytes:
            raise DeviceOutOfMemory(need, self.manager.in_use_nbytes, self.manager.budget_nbytes,
                                    f"the largest operator of model {job.info.model_name!r} "
                                    f"(batch {job.batch})")

    def submit(self, job: TrainingJob) -> None:
        """Queue a job. Raises DeviceOutOfMemory if even its smallest working set cannot fit."""
        self.check_fits(job)
        job.policy = self.scheduler.policy
        with self._cond:
            self.queued.append(job)
            self._cond.notify()

    def cancel(self, job: TrainingJob) -> None:
        """Ask for the job to stop; it is removed before its next op."""
        job.cancel_requested.set()
        with self._cond:
            if job in self.queued:
                self.queued.remove(job)
                self._finish(job, JobState.CANCELLED, JobCancelled("cancelled while queued"))
            self._cond.notify()

    def jobs(self) -> list[TrainingJob]:
        with self._cond:
            return [j for j, _ in self.running.values()] + list(self.queued)

    # -- the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        with self.manager.device.using():
            while self.step() is not None:
                pass

    def step(self) -> bool | None:
        """One round: admit the queued jobs that are due, then run every running job's ops that
        are due in it. True when a round ran, False when none could (after idling or waiting),
        None once stopped with no job left. The thread of :meth:`start` calls it in a loop; a
        driver of several executors on simulated devices calls it instead, to keep their virtual
        clocks in step (``bench/placement.py``). On a device with a wall clock it waits while no
        job is queued."""
        turn = self._next_turn()
        if turn is None:
            return None
        if not turn:
            return False
        period = self.period
        self._schedule(turn, period)
        for job, ops in turn:
            self._advance(job, ops, period)
        self.round += 1
        return True

    def _next_turn(self) -> list | None:
        """Admit the queued jobs that are due and may run; the running jobs with their op
        iterators for this round, ``[]`` when none runs yet (after idling or waiting), or None
        once stopped with no job left."""
        with self._cond:
            if self._stopping and not self.running:
                return None
            while (self.queued and len(self.running) < self.max_active_jobs and self._due(self.queued[0])
                   and self._room_for(self.queued[0])):
                self._admit(self.queued.popleft())
            if not self.running:
                if self.queued and self.manager.device.virtual_time:    # idle until it arrives
                    self.manager.device.idle_until(self.queued[0].arrival_s)
                elif not self._stopping:
                    self._cond.wait(None if not self.queued else 0.01)
                return []
            if self._repace:
                self._set_paces()
            return list(self.running.values())

    def _schedule(self, turn: list, period: int) -> None:
        """Before a round: re-plan where the scheduler asks for it, install a plan that is ready,
        and mark the planned pool's period boundary."""
        plan = self.scheduler.plan
        try:
            if self.scheduler.replan_reasons:
                self.scheduler.replan({j.id: self._pace[j.id].start % period for j, _ in turn}, period,
                                      {j.id: self._pace[j.id].repeats for j, _ in turn})
            self.scheduler.poll()
        except Exception:  # planning is an optimisation: never let it stop the jobs
            log.exception("scheduling failed; the jobs go on under the reactive fallback")
            self.scheduler.plan = None
        installed = self.scheduler.plan
        if installed is not plan:
            # a plan of no actions (under a budget above the peaks) changes nothing of the period
            # the planned pool records: the same as none
            same = installed.same_actions(plan) if installed is not None else plan.same_actions(None)
            if not same:
                self.manager.schedule_changed("the scheduler installed a new plan")
        if self.round % period == 0:
            try:
                self.manager.period_boundary()
            except Exception:   # a failed spill write: the copies are called off, the jobs go on
                log.exception("the planned pool's period boundary failed")

    def _advance(self, job: TrainingJob, ops, period: int) -> None:
        """Run ``job``'s ops that its pace puts at or before this round; finish it when it is
        cancelled, done or failed."""
        if job.cancel_requested.is_set():
            self._finish(job, JobState.CANCELLED, JobCancelled("cancelled by the caller"))
            return
        pace = self._pace[job.id]
        while pace.start + pace.offset(job, period) <= self.round:
            try:
                next(ops)
            except StopIteration:
                self._finish(job, JobState.DONE)
                return
            except Exception as exc:  # the job fails; the coordinator goes on
                if not isinstance(exc, TensileError):
                    log.exception("job %s failed", job.id)
                self._finish(job, JobState.FAILED, exc)
                return
            if job.next_position == 0:
                pace.iteration += 1
                if pace.iteration == pace.repeats:
                    pace.start, pace.iteration = pace.start + period, 0
                self._repace |= self.scheduler.iteration_done(job)
                self.scheduler.at_iteration(job, pace.iteration)

    def _room_for(self, job: TrainingJob) -> bool:
        """Whether the running jobs leave room for ``job`` (Note [Admission by memory pressure])."""
        if self.max_pressure is None or not self.running:
            return True
        running = [j for j, _ in self.running.values()]
        budget = self.manager.budget_nbytes
        peaks = job.vanilla_peak_nbytes + sum(j.vanilla_peak_nbytes for j in running)
        if peaks <= budget:
            return True
        if peaks > self.max_pressure * budget:
            return False
        load = placement.load_of(self, running)
        work_s = placement.remaining_s(job, self.manager.device)
        return load.flow_s(job.vanilla_peak_nbytes, work_s) < load.flow_after_room_s(job.vanilla_peak_nbytes, work_s)

    def _due(self, job: TrainingJob) -> bool:
        """Whether the device clock has reached the job's arrival time (if it has one)."""
        return job.arrival_s is None or self.manager.device.now() >= job.arrival_s

    def describe(self) -> dict:
        """The scheduler's figures for ``tensile.memory`` (see :meth:`Scheduler.describe`)."""
        return self.scheduler.describe()

    def traces(self) -> tuple[list, int]:
        """(traces, period): the measured running jobs as the planners see them now
        (:meth:`Scheduler.traces`) and the executor's rounds per period, so that
        ``Timeline(traces, period)`` is the timeline a plan would be made on. Call it from the
        executor's thread (a scheduler hook), where the paces cannot change under it."""
        phases = {job_id: pace.start % self.period for job_id, pace in self._pace.items()}
        repeats = {job_id: pace.repeats for job_id, pace in self._pace.items()}
        return self.scheduler.traces(phases, repeats), self.period

    def iterations_per_period(self) -> dict[int, int]:
        """Running job id -> its iterations per period now."""
        with self._cond:
            return {job_id: pace.repeats for job_id, pace in self._pace.items()}

    def _set_paces(self) -> None:
        """Give every admitted job the iterations per period the scheduler asks for now, and the
        period that follows; a running job whose pace changes is re-anchored so that its next op
        is due in this round. A newly admitted job (no pace yet) gets one starting now."""
        self._repace = False
        jobs = self.scheduler.jobs
        repeats = self.scheduler.iterations_per_period()
        period = period_of(repeats, {j: len(job.program.ops) for j, job in jobs.items()})
        changed = False
        for job_id, k in repeats.items():
            job, pace = jobs[job_id], self._pace.get(job_id)
            if pace is None:
                self._pace[job_id] = _Pace(self.round, k)
            elif (pace.repeats, self.period) != (k, period):
                pace.repeats, pace.iteration = k, pace.iteration % k
                pace.start = self.round - pace.offset(job, period)
                self.scheduler.at_iteration(job, pace.iteration)
                changed = True
        self.period = period
        self.scheduler.paced(period, repeats)
        if changed:
            self.manager.schedule_changed("the jobs' iterations per period changed")

    def _admit(self, job: TrainingJob) -> None:
        self.manager.register_job(job.id)
        self.scheduler.admit(job)
        self._set_paces()
        phases = {j: pace.start % self.period for j, pace in self._pace.items() if j != job.id}
        repeats = {j: pace.repeats for j, pace in self._pace.items()}
        self._pace[job.id].start += self.scheduler.stagger(job, phases, self.period, self.round, repeats)
        self.scheduler.at_iteration(job, 0)
        job.state, job.started_at = JobState.RUNNING, time.time()
        self.running[job.id] = (job, job.ops(self.manager, self.manager.device, self.scheduler))

    def _finish(self, job: TrainingJob, state: JobState, error: BaseException | None = None) -> None:
        with self._cond:
            if self.running.pop(job.id, None) is not None:
                self._repace = True
            self._pace.pop(job.id, None)
        self.scheduler.forget(job)
        if state is not JobState.DONE or job.cancel_requested.is_set():
            job.discard_result()                 # copies of its weights no one will send
        job.memory = self.manager.release_job(job.id)
        job.state, job.error, job.finished_at = state, error, time.time()
        job.events.put(("done", None) if state is JobState.DONE else ("error", error))
