"""The executor: admission control and round-robin execution of every running job's ops.

One thread runs all jobs on the device, in rounds. Each round it admits queued jobs while fewer
than ``max_active_jobs`` run, then lets every running job run the ops that are due: with ``R``
the longest program among the running jobs, a job of ``L`` ops runs op ``p`` of an iteration in
round ``start + p * R // L``, so every job completes one iteration per ``R`` rounds. The ops of
concurrent jobs interleave as kernels of concurrent processes would on a GPU, the memory manager
sees one combined timeline, and that timeline repeats every ``R`` rounds, which is what the
scheduler plans (:mod:`tensile_db.scheduler`). A job whose smallest possible working set exceeds the budget is refused at
submission with the bytes it needs; a cancelled job is removed between two ops and its device
memory freed at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from ..errors import DeviceOutOfMemory, JobCancelled, TensileError
from ..memory.manager import MemoryManager
from ..scheduler.cost import CostModel
from ..scheduler.engine import Scheduler
from .jobs import JobState, TrainingJob

log = logging.getLogger(__name__)


class Executor:
    """Runs submitted jobs on ``manager``'s device; ``start()`` launches the thread.

    ``policy`` is the scheduler policy (:data:`tensile_db.scheduler.POLICIES`); ``cost`` the cost
    model (measured when None). Raises InvalidArgument for an unknown policy.
    """

    def __init__(self, manager: MemoryManager, max_active_jobs: int = 8, policy: str = "tensile",
                 cost: CostModel | None = None):
        self.manager = manager
        self.scheduler = Scheduler(manager, policy, cost)
        self.max_active_jobs = max_active_jobs
        self.round = 0
        self._iteration_start: dict[int, int] = {}      # job id -> round its iteration started
        self.queued: collections.deque[TrainingJob] = collections.deque()
        self.running: dict[int, tuple[TrainingJob, object]] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="tensile-executor", daemon=True)

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

    def submit(self, job: TrainingJob) -> None:
        """Queue a job. Raises DeviceOutOfMemory if even its smallest working set cannot fit."""
        need = job.min_working_set_nbytes
        if need > self.manager.budget_nbytes:
            raise DeviceOutOfMemory(need, self.manager.in_use_nbytes, self.manager.budget_nbytes,
                                    f"the largest operator of model {job.info.model_name!r} "
                                    f"(batch {job.batch})")
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
        while True:
            with self._cond:
                if self._stopping and not self.running:
                    return
                while self.queued and len(self.running) < self.max_active_jobs:
                    self._admit(self.queued.popleft())
                if not self.running:
                    if not self._stopping:
                        self._cond.wait()
                    continue
                turn = list(self.running.values())
            period = self.period
            plan = self.scheduler.plan
            try:
                if self.scheduler.replan_reasons:
                    self.scheduler.replan({j.id: self._iteration_start[j.id] % period for j, _ in turn}, period)
                self.scheduler.poll()
            except Exception:  # planning is an optimisation: never let it stop the jobs
                log.exception("scheduling failed; the jobs go on under the reactive fallback")
                self.scheduler.plan = None
            if self.scheduler.plan is not plan:
                self.manager.schedule_changed("the scheduler installed a new plan")
            if self.round % period == 0:
                self.manager.period_boundary()
            for job, ops in turn:
                if job.cancel_requested.is_set():
                    self._finish(job, JobState.CANCELLED, JobCancelled("cancelled by the caller"))
                    continue
                n_ops = len(job.program.ops)
                while self._iteration_start[job.id] + job.next_position * period // n_ops <= self.round:
                    try:
                        next(ops)
                    except StopIteration:
                        self._finish(job, JobState.DONE)
                        break
                    except Exception as exc:  # the job fails; the coordinator goes on
                        if not isinstance(exc, TensileError):
                            log.exception("job %s failed", job.id)
                        self._finish(job, JobState.FAILED, exc)
                        break
                    if job.next_position == 0:
                        self._iteration_start[job.id] += period
                        self.scheduler.iteration_done(job)
            self.round += 1

    @property
    def period(self) -> int:
        """Rounds per iteration of every running job: the longest running program, in ops."""
        return max((len(j.program.ops) for j, _ in list(self.running.values())), default=1)

    def describe(self) -> dict:
        """The scheduler's figures for ``tensile.memory`` (see :meth:`Scheduler.describe`)."""
        return self.scheduler.describe()

    def _admit(self, job: TrainingJob) -> None:
        period = max(self.period, len(job.program.ops))
        phases = {j: start % period for j, start in self._iteration_start.items()}
        delay = self.scheduler.stagger(job, phases, period, self.round)
        self.manager.register_job(job.id)
        self.scheduler.admit(job)
        job.state, job.started_at = JobState.RUNNING, time.time()
        self._iteration_start[job.id] = self.round + delay
        self.running[job.id] = (job, job.ops(self.manager, self.manager.device, self.scheduler))

    def _finish(self, job: TrainingJob, state: JobState, error: BaseException | None = None) -> None:
        with self._cond:
            self.running.pop(job.id, None)
        self._iteration_start.pop(job.id, None)
        self.scheduler.forget(job)
        job.memory = self.manager.release_job(job.id)
        job.state, job.error, job.finished_at = state, error, time.time()
        job.events.put(("done", None) if state is JobState.DONE else ("error", error))
