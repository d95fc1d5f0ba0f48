"""The scheduler the executor runs: records access sequences, makes plans, carries them out.

Around every op the executor calls :meth:`Scheduler.before` and :meth:`Scheduler.after`; they
take the plan's actions for that op (release and swap-in before, swap-out and drop after) through
the memory manager, fold the op's measured time into the job's access sequence, and follow the
job's position for the reactive fallback (farthest next use, :mod:`~tensile_db.scheduler.reactive`).

Re-planning (TENSILE, arXiv 2105.13336, section 4.3): the scheduler asks for a new plan when a job
arrives (the new job then runs its cold-start iteration under the reactive policy, in bytes the
plan reserves for it: its unscheduled peak), when a job's cold-start iteration completes (its times
are now known), when a job leaves, and when a job's measured iteration time has drifted by more
than ``drift`` since the plan was made. The executor calls :meth:`Scheduler.replan` between two
rounds when :attr:`Scheduler.replan_reasons` is not empty.

Policies (:data:`POLICIES`): ``tensile`` (the planner of :func:`~.planners.plan_tensile`),
``swap_score`` (arXiv 1903.06631), ``vdnn`` (vDNN_all) and ``reactive`` (no plan). Unlimited
memory ("vanilla") is the reactive policy with a budget above the combined peak.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..errors import InvalidArgument
from .cost import CostModel, measure_bandwidth
from .planners import Plan, plan_swap_score, plan_tensile, plan_vdnn
from .reactive import FarthestNextUse
from .timeline import JobTrace, Timeline
from .trace import AccessSequence

log = logging.getLogger(__name__)

POLICIES = ("tensile", "reactive", "vdnn", "swap_score")
_PLANNERS = {"tensile": plan_tensile, "swap_score": plan_swap_score, "vdnn": plan_vdnn}


class Scheduler:
    """Scheduling state of one executor.

    Args:
        manager: the :class:`~tensile_db.memory.manager.MemoryManager`.
        policy: one of :data:`POLICIES`.
        cost: the cost model; measured through the manager's swap engine when None.
        drift: relative change of a job's iteration time that triggers a re-plan.
        drift_every: iterations of a job between two re-plans for its drift, at least.
        headroom: fraction of the budget the plan leaves free (for fragmentation of the arena).

    Raises:
        InvalidArgument: an unknown policy.
    """

    def __init__(self, manager, policy: str = "tensile", cost: CostModel | None = None,
                 drift: float = 0.25, drift_every: int = 8, headroom: float = 0.03):
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown scheduler policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.mm = manager
        self.policy = policy
        self.drift = drift
        self.drift_every = drift_every
        self.headroom = headroom
        self.reactive = FarthestNextUse()
        manager.next_use = self.reactive
        self.cost = cost or measure_bandwidth(manager.device, manager.engine,
                                              nbytes=min(16 << 20, max(manager.budget_nbytes // 4, 4096)))
        self.jobs: dict[int, object] = {}                 # running jobs, in admission order
        self.sequences: dict[int, AccessSequence] = {}
        self.plan: Plan | None = None
        self.plans_made = 0
        self.plan_seconds = 0.0                           # time spent planning, cumulative
        self.replan_reasons: list[str] = []              # why the next re-plan is wanted
        self.history: list[tuple[tuple[str, ...], int]] = []   # (reasons, decisions) of recent re-plans
        self._plan_times: dict[int, np.ndarray] = {}
        self._plan_iteration: dict[int, int] = {}         # job id -> its iterations at the last plan

    # -- job lifecycle -------------------------------------------------------------------------

    def admit(self, job) -> None:
        self.jobs[job.id] = job
        self.sequences[job.id] = AccessSequence(job.program)
        self.reactive.track(job.id, job.program)
        job.policy = self.policy
        job.schedule = "reactive" if self.policy == "reactive" else "cold start"
        self._want_replan(f"job {job.id} arrived")

    def forget(self, job) -> None:
        if self.jobs.pop(job.id, None) is not None:
            self._want_replan(f"job {job.id} left")
        self.sequences.pop(job.id, None)
        self.reactive.forget(job.id)

    def iteration_done(self, job) -> None:
        seq = self.sequences[job.id]
        seq.end_iteration()
        if self.policy == "reactive":
            return
        if seq.iterations == 1:
            self._want_replan(f"job {job.id} measured")
        elif (job.id in self._plan_times and seq.drift(self._plan_times[job.id]) > self.drift
              and seq.iterations - self._plan_iteration[job.id] >= self.drift_every):
            self._want_replan(f"op times of job {job.id} drifted")

    # -- around every op -----------------------------------------------------------------------

    def before(self, job, position: int) -> None:
        if self.plan is not None:
            self._act(self.plan.before.get((job.id, position), ()))

    def after(self, job, position: int, seconds: float) -> None:
        self.sequences[job.id].record(position, seconds)
        self.reactive.advance(job.id, position)
        if self.plan is not None:
            self._act(self.plan.after.get((job.id, position), ()))

    def _act(self, actions) -> None:
        for kind, job_id, slot in actions:
            job = self.jobs.get(job_id)
            tensor = job.tensors.get(slot) if job is not None else None
            if tensor is not None:
                getattr(self.mm, kind)(tensor)

    # -- planning ------------------------------------------------------------------------------

    def stagger(self, job, phases: dict[int, int], period: int, now: int) -> int:
        """Rounds (0 to ``period - 1``) to hold a newly admitted job back so that its memory peak
        falls where the running jobs' combined usage is lowest: the shortest delay among those
        whose combined unscheduled peak is least. ``phases``: running job id -> round (mod
        ``period``) its iteration starts in; ``now``: the current round. Only the ``tensile``
        policy staggers; TENSILE itself starts a job whenever it arrives."""
        if self.policy != "tensile" or not phases:
            return 0
        order = {job_id: i for i, job_id in enumerate(self.jobs)}
        running = [JobTrace(j, self.sequences[j], phases[j], order[j]) for j in phases]
        new = AccessSequence(job.program)
        best, best_peak = 0, None
        for delay in range(period):
            trace = JobTrace(job.id, new, (now + delay) % period, len(order))
            peak = Timeline(running + [trace]).vanilla_peak_nbytes()
            if best_peak is None or peak < best_peak:
                best, best_peak = delay, peak
        return best

    def replan(self, phases: dict[int, int]) -> Plan | None:
        """Make a new plan for the running jobs. ``phases``: job id -> the round (mod the period)
        its current iteration started in. Returns the plan (None under ``reactive`` or while no
        job is measured)."""
        reasons, self.replan_reasons = tuple(self.replan_reasons), []
        started = time.perf_counter()
        measured = [j for j in self.jobs.values() if self.sequences[j.id].measured]
        cold = [j for j in self.jobs.values() if not self.sequences[j.id].measured]
        plan = None
        if self.policy != "reactive" and measured:
            reserve = sum(j.vanilla_peak_nbytes for j in cold)
            target = max(int((self.mm.budget_nbytes - reserve) * (1.0 - self.headroom)), 0)
            order = {job_id: i for i, job_id in enumerate(self.jobs)}
            timeline = Timeline([JobTrace(j.id, self.sequences[j.id], phases[j.id], order[j.id]) for j in measured])
            plan = _PLANNERS[self.policy](timeline, self.cost, target)
            self.plans_made += 1
        self.plan = plan
        self._plan_times = {j.id: self.sequences[j.id].times_s.copy() for j in measured}
        self._plan_iteration = {j.id: self.sequences[j.id].iterations for j in measured}
        for j in self.jobs.values():
            j.schedule = ("planned" if plan is not None and j.id in plan.timeline.traces
                          else "reactive" if self.policy == "reactive" else "cold start")
        self.plan_seconds += time.perf_counter() - started
        self.history = (self.history + [(reasons, len(plan.decisions) if plan else 0)])[-64:]
        if plan is not None:
            log.info("plan %d (%s, %s): %d decisions, predicted peak %d of target %d bytes, "
                     "predicted extra %.4f s per period", self.plans_made, self.policy, "; ".join(reasons),
                     len(plan.decisions), plan.predicted_peak_nbytes, plan.target_nbytes,
                     plan.predicted_extra_s)
        return plan

    def _want_replan(self, reason: str) -> None:
        self.replan_reasons.append(reason)

    def describe(self) -> dict:
        """JSON-able figures for ``tensile.memory``."""
        plan = self.plan
        return {
            "policy": self.policy,
            "h2d_bytes_per_s": self.cost.h2d_bytes_per_s,
            "d2h_bytes_per_s": self.cost.d2h_bytes_per_s,
            "plans_made": self.plans_made,
            "predicted_peak_nbytes": plan.predicted_peak_nbytes if plan else None,
            "predicted_extra_s": plan.predicted_extra_s if plan else None,
        }
