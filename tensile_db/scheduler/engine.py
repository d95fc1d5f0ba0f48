"""The scheduler the executor runs: records access sequences, makes plans, carries them out.

Around every op the executor calls :meth:`Scheduler.before` and :meth:`Scheduler.after`; they
take the plan's actions for that op (release and swap-in before, swap-out and drop after) through
the memory manager, fold the op's measured time into the job's access sequence, and follow the
job's position for the reactive fallback (Note [The tensile fallback]).
Plan actions are keyed by the op's period position (Note [Fair sharing] in
:mod:`~tensile_db.scheduler.timeline`): the executor says which iteration of the period a job is in
with :meth:`Scheduler.at_iteration`.

Fair sharing: :meth:`Scheduler.iterations_per_period` is the policy that gives every running job
about the same device time per period; the executor asks for it when a job arrives or leaves and
when :meth:`Scheduler.iteration_done` reports that a job's op times have settled, and reports the
pace it runs with :meth:`Scheduler.paced` (a change of pace is a reason to re-plan).

Re-planning (TENSILE, arXiv 2105.13336, section 4.3): the scheduler asks for a new plan when a job
arrives (the new job then runs its cold-start iteration under the reactive policy, in bytes the
plan reserves for it: its unscheduled peak; under ``tensile``, planned on estimated op times:
Note [Estimated cold starts]), when a job's op times are measured (after its cold-start iteration;
on a real device after the first warm one: Note [Warm-up iteration] in :mod:`~.trace`), when a job
leaves, and when a job's measured iteration time has drifted by more than ``drift`` since the plan
was made (Note [Drift of a median] in :mod:`~.trace`). The executor calls :meth:`Scheduler.replan`
between two rounds when :attr:`Scheduler.replan_reasons` is not empty; the plan is made on a
planning thread from a snapshot of the access sequences and installed by :meth:`Scheduler.poll`
when it is ready, so jobs never wait for the planner.

Note [Estimated cold starts]
----------------------------
Rationale: a job in its cold start has no measured op times, so a plan made on measured jobs
alone must set aside the new job's whole unscheduled peak, and the jobs already running are cut
to what is left. With jobs arriving one after another (the mixed arrival of four models) some job
is nearly always cold, the running ones are planned to a fraction of the budget, and each
arrival's reservation is re-planned away only after its first iteration and a planning time.

Approach: under the ``tensile`` policy a cold job is planned with the others at once, on op times
predicted from the ops of the measured jobs (:func:`~.trace.estimated`: a roofline fitted on
FLOPs and bytes, scaled per op unit). Its cold-start iteration then runs under the plan like any
other; its measured times replace the estimates at the re-plan its first iteration asks for
("measured"), as before. The baselines keep the published rule (plan the measured jobs,
reserve for the cold ones): that is how they are measured in their papers. Limitations: an
estimate off by much misplaces the cold job's swaps for one iteration (the reactive fallback
covers what the plan misses); before any job is measured there is nothing to fit, and the first
job's cold start runs reactively.

Note [The tensile fallback]
---------------------------
Rationale: a plan covers the jobs it was made for once it has landed; before that (a job's cold
start, the time between an arrival and the plan that follows it, a plan still being made) and
for whatever a plan misses, the memory manager evicts on demand (Note [Eviction order] in
:mod:`~tensile_db.memory.eviction`). Farthest next use copies every victim out and back in, and
an op waits for its copies: on the mixed arrival of four models on the simulated H100 with TF32
at 70%, the four jobs stalled 244 ms of the 382 ms before their first plan landed, and VGG-16,
which runs all its iterations then, had an EOR of +1.02.

Approach: under ``tensile`` the fallback ranks as the ``dtr`` policy does (:mod:`.dtr`: the least
recompute cost / (bytes x staleness) first, dropping a tensor its job can recompute exactly
and copying out any other; Kirisame et al., ICLR 2021), the best of the policies that make no
plan on that workload. On the workload above: EOR +0.243 -> +0.028 (dtr alone: +0.188). The
plan's actions are unchanged, and each is a no-op on a tensor the fallback dropped (the job
recomputes it before its next access). The baselines keep farthest next use, as published.
Limitation: where a plan lands inside a short run's measured iterations the two orders share
them, and there DTR's can be the worse: one ResNet-50 at 35% on the simulated H100, EOR +0.576
-> +0.596 (FP32) and +1.658 -> +1.792 (TF32), against TENSILE as published at +0.560 and +1.665.

Note [Paid planning]
--------------------
A plan is work the coordinator does while the jobs run on under the plan they have (or under the
reactive fallback): it takes effect only when it is made. On the simulated device
(:mod:`tensile_db.runtime.simulated`) the plan is made at once, in the executor's thread, bounded
by decisions rather than seconds so that a run does not depend on the machine that simulates
it, and is *installed* only once its modelled planning time
(:meth:`~.work.PlanWork.seconds`, Note [Planning cost model] in :mod:`~.work`) has passed on
the virtual clock, as one planning worker would: a request waits while an earlier one is being
made; a request superseded before it started costs nothing, and what it computed that later plans
can reuse (the global planner's curves) is charged to the next plan that uses it
(:meth:`~.curves.CurveBuilder.refund`), as a worker that never started it would compute it then;
one superseded while being made still occupies the worker to its end. On every device, a plan
superseded while being made is installed once it is made, if it covers a running job: it comes
from fresher measurements than the plan in force, and a plan may take longer than the jobs take
to arrive and be measured (on the mixed arrival of four models on the simulated H100 at 50%, every
plan of the four jobs was superseded and the jobs ran 0.8 s on the plan made before the third
arrived: EOR +0.201 -> +0.021).
:attr:`Scheduler.history` keeps, per request, its reasons, the
virtual seconds it was asked at and installed at, and the modelled and wall seconds of its
planning. Source of the rule: a real coordinator's planner is a CPU computation of that length
beside the device (TENSILE, arXiv 2105.13336, section 5, measures its planning time too). On
``cpu`` and ``cuda`` a large timeline is planned in the planning process (Note [Planning off the
GIL] in :mod:`~.worker`).

Note [Plans beside kernels on every core]
-----------------------------------------
Rationale: a plan made beside the jobs costs them nothing only where a core is free for the
planner. On ``cpu``, where the kernels' workers take every core
(:func:`~tensile_db.runtime.workers.every_core`), the planning process shares a core with a
thread of the kernels' OpenMP team, and each parallel region waits for that thread's turn on
it. On this project's 2-core machine the MLP of ``bench/throughput.py`` at half its peak took 41
to 49 ms to plan there, against 5 to 18 ms alone, and its iterations meanwhile 12 to 38 ms
against 5.5; a synchronous copy that splits over the team took about 1 ms instead of 0.06. The
planned pool's offsets, planned there too, stalled the iteration they fell in the same way.

Approach: where the device's kernels take every core
(:attr:`~tensile_db.runtime.device.Device.kernels_on_every_core`), the executor waits for each
plan it asks for (:meth:`Scheduler.replan` as with ``wait``), and the period boundary that ends
the planned pool's recorded period waits for its offsets and installs them there, instead of at
a later boundary (:attr:`~tensile_db.memory.planned.PlannedPool.waits_for_plans`), each wait
bounded (:data:`PLAN_WAIT_S`, :data:`~tensile_db.memory.planned.WAIT_S`; the small plans it makes
itself, by the planners' own limits: Note [Plans the waiting thread makes]). The jobs then lose the
plan's own time, on a core of its own. Elsewhere (``cuda``, whose kernels
run on the device; ``cpu`` with a core to spare) plans are made beside the jobs as before; the
simulated device plans synchronously anyway. ``bench/throughput.py`` (three alternated runs of
five repeats each): the pool served from the 4th iteration at half the peak (the 6th before, for
the CNN the 5th) and from the 2nd with unlimited memory (the 3rd or 4th); the CNN at half its peak
1.26, 1.23, 1.19 -> 1.17, 1.19, 1.23 times its unlimited time per iteration, the MLP 1.51, 1.42,
1.47 -> 1.45, 1.40, 1.45 (not decided). Over ten alternated runs of the small CNN at half its
peak (24 iterations each, in one process), the first eight iterations' time above the steady
state went from 84 ms (65 to 159) to 70 ms (50 to 83), and the time per iteration from 1.18
(1.13 to 1.29) to 1.14 (1.07 to 1.17) times the unlimited run's.

Limitations: every job waits for a plan of all of them, the longest ones' too (a timeline of
thousands of ops plans for a second or more; the wait ends after :data:`PLAN_WAIT_S`, and a plan
not made by then lands when it is, as elsewhere), and a job's cancel is seen once the plan is
made; beside the kernels the same plan would have slowed every job for longer. A plan stopped at
its time limit (:data:`~.planners.MAX_PLAN_SECONDS`) asks for its continuation, which the jobs
wait for again, and a plan that drifts and re-plans often costs its planning time each time.
The boundary waits for the offsets with the memory manager's lock held (as it did after
:data:`~tensile_db.memory.planned.PLAN_WAIT_PERIODS` before): an inference call that needs the
lock then waits too, a few milliseconds once per schedule.

Note [Plans the waiting thread makes]
-------------------------------------
Rationale: where the executor waits for a plan (Note [Plans beside kernels on every core]), the
round trip to the planning process buys nothing: nothing runs beside the plan for it to keep the
GIL from, and the traces and the plan still go through the pipe. The MLP of
``bench/throughput.py`` at half its peak waited 5.1 to 14.3 ms for its first plan, of which the
child's own time was 2.3 to 10.3 ms, and 4.6 to 8.5 ms for its pool's offsets (four runs), which
took 2.2 to 6.5 ms made on the executor's thread (three runs).

Approach: there, a timeline of at most :data:`HERE_MAX_OPS` ops per period is planned on the
executor's own thread, and a period of at most
:data:`~tensile_db.memory.planned.HERE_MAX_ALLOCATIONS` allocations by the boundary that waits
for its offsets; nothing else runs on the executor's thread meanwhile, so holding the GIL costs it
nothing. The global planner's curves are those the process keeps across every plan made in it,
as the planning process keeps its own (:func:`~.worker.make_plan_with_kept_curves`). Larger
timelines and periods still go to the planning process, the waits bounded as before: an inference
call's thread shares the GIL with a plan made here (a switch interval at a time), which for the
planners' seconds of a large timeline would slow it.

Measured (medians of twelve runs each, the code before and after alternated):

- the MLP of ``bench/throughput.py``, its first six iterations above six of its steady ones, the
  plans made here with the scheduler's own curves: 14.1 -> 7.5 ms with unlimited memory (9.5 to
  18.8 against 5.7 to 16.5), 34.6 -> 22.9 ms at half its peak (21.6 to 47.5 against 20.2 to 43.3);
- with those curves, which start empty with each executor, the small CNN (the bench makes an
  executor per run) waited 22.8 to 25.3 ms for its plan at half its peak in every run, against
  11.6 to 17.7 ms from the planning process once an earlier run had made its curves there; with
  the curves the process keeps, the CNN's waits at half its peak: its plan 12.3 -> 5.2 ms, its
  offsets 26.1 -> 8.8 ms; unlimited, 3.4 -> 1.7 ms and 12.9 -> 9.4 ms;
- ``bench/throughput.py`` itself (four alternated runs), the MLP's time per iteration over the
  run less that of the iterations once the pool served, at half its peak: 1.0, 0.5, 0.4, 0.5 ->
  0.4, 0.3, 0.2, 0.3 ms.

Limitations: the limits are guesses of where a plan stays within tens of milliseconds on this
project's 2-core machine (the small CNN's timeline has about 100 ops, ResNet-50's 474); a plan
made here is not bounded by :data:`PLAN_WAIT_S`, only by the planner's own limit
(:data:`~.planners.MAX_PLAN_SECONDS`), and offsets made here not by
:data:`~tensile_db.memory.planned.WAIT_S`, only by the search's
(:data:`~tensile_db.memory.planned.SEARCH_S`) after the fixed orders; a cancel is seen once the
plan is made, as before. A plan asked for while an earlier one is still being made on the
planning thread goes there too.

Note [Headroom for the pool]
----------------------------
A plan aims below the budget by ``headroom`` (3%), for the arena's fragmentation. With four jobs
of interleaved lifetimes that is too little: on four ResNet-50 on the simulated H100 at 50% of
their peak the planned pool's offsets needed 6.5% more than the live bytes, so its region did not
fit and was never installed, and the general pool, at 97% of the budget, compacted 2.3 GB of
blocks per period (11 ms of a 74 ms period; EOR +0.150 with its plan predicting +0.02). One job's
lifetimes pack closely, and there the same margin would only cost swaps (one ResNet-50 at 50%
with 6% headroom: EOR +0.136 -> +0.222). So the headroom follows what the pool measures: once
it has planned the offsets of a period (installed or not), the plans leave ``1 - 1 / ratio``
free when that is more, ``ratio`` being the offsets' arena over the period's most live bytes
(:attr:`~tensile_db.memory.planned.PlannedPool.packing_ratio`), so that the next region fits;
a re-plan follows when that raises the headroom by more than a point. The headroom only grows
while the same jobs run, so that plan and packing do not chase each other; an arrival or a
departure starts again from the configured one.

Note [The fallback's limit and the floor]
-----------------------------------------
Under ``tensile`` the reactive fallback starts evicting at the plans' headroom below the budget
(the manager's ``limit_nbytes``), so that what a plan keeps is not evicted for the room the arena
needs for fragmentation. But a plan cannot hold the events of its jobs' largest ops below their
working set (the *floor*), and where the floor is above the budget less the headroom, a plan
keeps more than the limit at those events by design (Note [Targets under the floor]; the other
policies' target is the floor), and the fallback evicted there what the plan kept. The MLP of ``bench/throughput.py`` at half its peak (the budget raised to its
largest working set, Adam on a 512 x 512 layer: 4 MiB) evicted a 1 MiB Adam moment at every
iteration and swapped it in again at the next, and since a period with an eviction is never
recorded for the planned pool (Note [Planned pool] in :mod:`tensile_db.memory.planned`), its
offsets were never planned and the general pool compacted about twice an iteration. So while a
plan is installed the limit is at least the plan's target, or the floor where the target lies
under it (at most the budget); fragmentation at such a budget is left to compaction and then to
the planned pool, whose offsets pack the recorded period's blocks into the budget when they can.

Note [Targets under the floor]
------------------------------
Rationale: a plan cannot hold an event below the working set of that event's own op, and the
plans' target was therefore raised to the largest working set of the jobs (the *floor*) wherever
the budget less the headroom lay under it. Then *no* event kept the headroom, though only the
ops whose working set is the floor need the whole budget: the planned pool had to pack the
period's blocks into exactly the budget. The small CNN of ``bench/throughput.py`` at half its
peak (its budget raised to its largest working set, 29,404,672 bytes): four recorded periods
packed to 29,409,792, 29,410,816, 31,142,400 and 33,585,152 bytes, none was installed (Note [A
region that does not fit] in :mod:`tensile_db.memory.planned`), and the general pool served every
allocation of the period, compacting five times an iteration: 6.8 to 7.9 ms of each iteration
went to the memory manager's allocations against 1.2 to 1.5 ms with unlimited memory.

Approach: the global planner (:func:`~.curves.plan_global`) takes the target as it is, and where
it lies under a job's smallest working set it holds each event to the target raised to its own
op's working set (:meth:`~.timeline.Timeline.targets`): every event but those of the largest
ops keeps the headroom, where the curves reach. Its curves then go on below the floor at the events whose ops allow it
(:class:`~.curves.CurveBuilder` with ``below_floor``), and an event that no curve frees is passed
over rather than ending the plan; redundant decisions are dropped and swaps re-timed against the
same per-event ceiling. A target at or above every job's floor plans exactly as before. The other
policies keep the target raised to the floor, as published. The small CNN's region then packed
to its budget and was installed in each of three runs. On the simulated H100 (``bench/paper.py``,
deterministic) one VGG-16 at 50% of its peak, whose budget less the headroom lies under its
largest working set, went from an EOR of +1.105 to +1.041, its pool asking for 6.9% above the
live bytes instead of 11.9%; the tables of one ResNet-50 and of the mixed arrival, whose targets
lie above the floor, are unchanged.

Limitations: the headroom costs swaps at the events it is kept at, which a packing that fits
without it would not need: the MLP of ``bench/throughput.py`` planned alone with copies at
1 MB/s (swaps dearer than recomputes) was predicted 25% more extra time at 0.999 of its floor
than at the floor (9.29 against 7.46 s per iteration; with copies at 8 GB/s, the same). The
curves are each job's alone, so with several jobs some events stay above their targets (two of
those MLPs in different phases at 97% of the floor: 7 of 50 events).

Policies (:data:`POLICIES`): ``tensile`` (the global planner of :func:`~.curves.plan_global`),
``swap_score`` (arXiv 1903.06631), ``vdnn`` (vDNN_all), the baselines of :mod:`.baselines`
(``capuchin``, ``checkpoint``, ``tensile_published``), and, making no plan, ``reactive`` and
``dtr`` (:mod:`.dtr`: evict the least h, dropping what recomputes). Unlimited
memory ("vanilla") is the reactive policy with a budget above the combined peak.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import InvalidArgument
from ..memory.arena import UNIT_NBYTES
from ..settings import DEFAULT_POLICY, POLICIES, UNPLANNED_POLICIES
from .cost import CostModel, measure_bandwidth, measure_disk_tier
from .dtr import Rematerialization
from .planners import ACTIONS, MAX_PLAN_SECONDS, Plan
from .reactive import FarthestNextUse
from .timeline import JobTrace, Timeline, iterations_per_period, round_of
from .trace import SETTLE_ITERATIONS, AccessSequence, estimated
from .work import PlanWork
from .worker import PROCESS_MIN_OPS, make_plan, make_plan_with_kept_curves, shared

log = logging.getLogger(__name__)

#: policies whose on-demand eviction ranks as DTR does (Note [The tensile fallback]); the others
#: evict the farthest next use
DTR_FALLBACK = ("dtr", "tensile")
#: most delays :meth:`Scheduler.stagger` compares (a period may be tens of thousands of rounds)
STAGGER_CANDIDATES = 256
#: Seconds the executor waits for a plan where it waits for them (Note [Plans beside kernels on
#: every core]): twice the planners' own limit; a plan not made by then lands when it is made.
PLAN_WAIT_S = 2 * MAX_PLAN_SECONDS
#: Where the executor waits for its plans, a timeline of at most this many ops per period is
#: planned on the executor's own thread (Note [Plans the waiting thread makes]); larger ones in the
#: planning process, the wait bounded by :data:`PLAN_WAIT_S`.
HERE_MAX_OPS = 256
#: What each plan action does to its tensor: the memory manager's operation of that name.
_ACTIONS = {"swap_out": lambda mm, t: mm.swap_out(t), "release": lambda mm, t: mm.release(t),
            "swap_in": lambda mm, t: mm.swap_in(t), "drop": lambda mm, t: mm.drop(t)}
if set(_ACTIONS) != set(ACTIONS):       # checked when the module loads, not when a plan first runs
    raise ImportError(f"the scheduler carries out {sorted(_ACTIONS)} but the planners emit {sorted(ACTIONS)}")


class Scheduler:
    """Scheduling state of one executor.

    Args:
        manager: the :class:`~tensile_db.memory.manager.MemoryManager`.
        policy: one of :data:`POLICIES`.
        cost: the cost model; measured through the manager's swap engine when None.
        drift: relative change of a job's iteration time that triggers a re-plan.
        drift_every: iterations of a job between two re-plans for its drift, at least.
        headroom: fraction of the budget the plans leave free (for fragmentation of the arena);
            under ``tensile`` the reactive fallback evicts at that limit too.

    Raises:
        InvalidArgument: an unknown policy.
    """

    def __init__(self, manager, policy: str = DEFAULT_POLICY, cost: CostModel | None = None,
                 drift: float = 0.5, drift_every: int = 16, headroom: float = 0.03):
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown scheduler policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.mm = manager
        self.policy = policy
        self.drift = drift
        self.drift_every = drift_every
        self.headroom = headroom
        self.deterministic = manager.device.virtual_time   # plan synchronously, without a time limit
        self.reactive = FarthestNextUse()
        manager.next_use = self.reactive
        # the fallback keeps the plans' headroom too (Note [The fallback's limit and the floor])
        self._limit_nbytes = manager.budget_nbytes
        if policy == "tensile":
            self._limit_nbytes = int(manager.budget_nbytes * (1.0 - headroom)) // UNIT_NBYTES * UNIT_NBYTES
            manager.limit_nbytes = self._limit_nbytes
        # Where the arena is host memory the probe's buffers (1.25 x nbytes with the contention's
        # kernel scratch) are too; elsewhere they come from the arena.
        nbytes = 16 << 20 if manager.device.arena_in_host_memory else min(16 << 20, max(manager.budget_nbytes // 4, 4096))
        self.cost = cost or self._measure(manager, nbytes)
        # Fields below are used by the executor's thread only, except ``plan`` (read by describe()).
        self.jobs: dict[int, object] = {}                 # running jobs, in admission order
        self.sequences: dict[int, AccessSequence] = {}
        if policy in DTR_FALLBACK:                        # evict the least h (Note [The tensile fallback])
            manager.next_use = Rematerialization(self.reactive, self.sequences, self.cost, manager.device.now)
            manager.droppable = manager.next_use.drops
        self._pool_headroom = 0.0                         # Note [Headroom for the pool]
        self._stale_ratio: float | None = None            # the pool's packing ratio of other jobs
        self._repeat: dict[int, int] = {}                 # job id -> its iteration of the period (0 to k - 1)
        self._period, self._repeats = 1, {}               # the executor's pace, as last reported to paced()
        self.plan: Plan | None = None
        self.plans_made = 0
        self.plan_seconds = 0.0                           # wall time spent planning, cumulative
        self.modelled_plan_seconds = 0.0                  # modelled planning time (simulated device), cumulative
        self.replan_reasons: list[str] = []              # why the next re-plan is wanted
        # recent re-plan requests (_Request.record): reasons, decisions of the plan installed (None
        # if not installed), virtual seconds asked at and installed at, modelled and wall seconds
        self.history: list[dict] = []
        self._worker_free_s = 0.0                         # simulated device: when the planning worker is free
        self._worker_request: _Request | None = None      # simulated device: the request last given to it
        # the global planner's curves: the planning thread's (and the executor's, on the simulated
        # device, where a plan is made while the executor waits: a refund); where the executor makes
        # its plans itself, the process's (Note [Plans the waiting thread makes])
        self._curves: dict = {}
        self._plan_sequences: dict[int, AccessSequence] = {}   # job id -> the snapshot its plan was made from
        self._plan_iteration: dict[int, int] = {}         # job id -> its iterations at the last plan
        self._planning = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensile-plan")
        if not self.deterministic:              # offset plans go to the planning process too
            manager.pool.offload = shared().call
            shared().start()                    # now, so that the first plan need not wait for it
        #: whether the executor waits for each plan it asks for (Note [Plans beside kernels on every core])
        self.waits_for_plans = not self.deterministic and manager.device.kernels_on_every_core
        manager.pool.waits_for_plans = self.waits_for_plans
        self._pending: concurrent.futures.Future | None = None
        self._request: _Request | None = None
        # superseded requests that were being made: installed when done (Note [Paid planning])
        self._landing: list[tuple[_Request, concurrent.futures.Future]] = []

    @staticmethod
    def _measure(manager, nbytes: int) -> CostModel:
        """The cost model measured through the manager's swap engine (copies of ``nbytes``
        bytes) and, where it has a disk tier, its spill I/O (:func:`~.cost.measure_disk_tier`), with its
        host budget."""
        cost = measure_bandwidth(manager.device, manager.engine, nbytes=nbytes)
        spill = manager.host_tier.spill
        disk = measure_disk_tier(spill) if spill is not None else (None, None)
        return replace(cost, host_budget_nbytes=manager.host_tier.budget_nbytes,
                       disk_read_bytes_per_s=disk[0], disk_write_bytes_per_s=disk[1])

    # -- job lifecycle -------------------------------------------------------------------------

    def admit(self, job) -> None:
        self._restart_pool_headroom()
        self.jobs[job.id] = job
        # a real device's cold start pays one-time costs; the simulated device's does not
        self.sequences[job.id] = AccessSequence(job.program, warm_up=not self.deterministic)
        self.reactive.track(job.id, job.program)
        job.policy = self.policy
        job.schedule = self.policy if self.policy in UNPLANNED_POLICIES else "cold start"
        self._want_replan(f"job {job.id} arrived")

    def forget(self, job) -> None:
        if self.jobs.pop(job.id, None) is not None:
            self._restart_pool_headroom()
            self._want_replan(f"job {job.id} left")
        self.sequences.pop(job.id, None)
        self._repeat.pop(job.id, None)
        self.reactive.forget(job.id)

    def iteration_done(self, job) -> bool:
        """The job completed an iteration. True when its op times have just settled
        (:data:`~.trace.SETTLE_ITERATIONS`): the iterations per period of the running jobs should
        be recomputed (:meth:`iterations_per_period`)."""
        seq = self.sequences[job.id]
        seq.end_iteration()
        if seq.iterations == seq.measured_iterations:
            self._want_replan(f"job {job.id} measured")
        elif (job.id in self._plan_sequences and seq.drift(self._plan_sequences[job.id]) > self.drift
                and seq.iterations - self._plan_iteration[job.id] >= self.drift_every):
            self._want_replan(f"op times of job {job.id} drifted")
            self._plan_iteration[job.id] = seq.iterations    # not again until drift_every more
        ratio = self.mm.pool.packing_ratio               # Note [Headroom for the pool]
        if (self.policy not in UNPLANNED_POLICIES and ratio is not None and ratio != self._stale_ratio
                and 1.0 - 1.0 / ratio > self._pool_headroom + 0.01):
            self._pool_headroom = 1.0 - 1.0 / ratio
            if self._pool_headroom > self.headroom + 0.01:
                self._want_replan(f"the planned pool's offsets need {ratio - 1:.1%} above the live bytes")
        return seq.iterations == SETTLE_ITERATIONS

    def _restart_pool_headroom(self) -> None:
        """The jobs changed: back to the configured headroom, and the pool's last plan, made for
        other jobs, no longer counts (Note [Headroom for the pool])."""
        self._pool_headroom, self._stale_ratio = 0.0, self.mm.pool.packing_ratio

    # -- fair sharing --------------------------------------------------------------------------

    def iterations_per_period(self) -> dict[int, int]:
        """Job id -> iterations per period for every running job, each getting about the same
        device time per period (:func:`~.timeline.iterations_per_period`). A job's iteration time
        is the sum of its ops' least measured times once they have settled
        (:attr:`~.trace.AccessSequence.best_iteration_s`, seconds); before that, its op count
        times the mean op time of the settled jobs (or its op count, if none is)."""
        if not self.jobs:
            return {}
        n_ops = {j: len(job.program.ops) for j, job in self.jobs.items()}
        settled = [j for j in self.jobs if self.sequences[j].settled]
        op_s = (sum(self.sequences[j].best_iteration_s for j in settled) / sum(n_ops[j] for j in settled)
                if settled else 1.0)
        iteration_s = {j: self.sequences[j].best_iteration_s if j in settled else n_ops[j] * op_s
                       for j in self.jobs}
        return iterations_per_period(iteration_s, n_ops)

    def paced(self, period: int, repeats: dict[int, int]) -> None:
        """The executor now runs ``repeats`` (job id -> iterations per period) in periods of
        ``period`` rounds. A change of either is a schedule change: re-plan. One op of a job of
        ``L`` ops takes ``period / (k * L)`` rounds, the unit in which the reactive fallback
        compares distances to the next use across jobs."""
        if (period, repeats) != (self._period, self._repeats):
            self._period, self._repeats = period, dict(repeats)
            self._want_replan("iterations per period changed")
        for job_id, k in repeats.items():
            self.reactive.pace(job_id, period / (k * len(self.jobs[job_id].program.ops)))

    def at_iteration(self, job, repeat: int) -> None:
        """The job's next ops belong to its iteration ``repeat`` (0 to k - 1) of the period: the
        plan's actions for op ``p`` are those at period position ``repeat * L + p``."""
        self._repeat[job.id] = repeat

    # -- around every op -----------------------------------------------------------------------

    def before(self, job, position: int) -> None:
        if self.plan is not None:
            self._act(self.plan.before.get((job.id, self._period_position(job, position)), ()))

    def after(self, job, position: int, seconds: float) -> None:
        self.sequences[job.id].record(position, seconds)
        self.reactive.advance(job.id, position)
        if self.plan is not None:
            self._act(self.plan.after.get((job.id, self._period_position(job, position)), ()))

    def _period_position(self, job, position: int) -> int:
        return self._repeat.get(job.id, 0) * len(job.program.ops) + position

    def _act(self, actions) -> None:
        for kind, job_id, slot in actions:
            job = self.jobs.get(job_id)
            tensor = job.tensors.get(slot) if job is not None else None
            if tensor is not None:
                _ACTIONS[kind](self.mm, tensor)

    # -- planning ------------------------------------------------------------------------------

    def stagger(self, job, phases: dict[int, int], period: int, now: int,
                repeats: dict[int, int] | None = None) -> int:
        """Rounds (0 to ``period - 1``) to hold a newly admitted job back so that its memory peak
        falls where the running jobs' combined usage is lowest: the shortest delay among those
        whose combined unscheduled peak, counted per round, is least (at most
        :data:`STAGGER_CANDIDATES` delays, evenly spaced, are tried). ``phases``: running job id ->
        round (mod ``period``) its period starts in; ``now``: the current round; ``repeats``: job
        id -> iterations per period (1 for a job not in it). Only the ``tensile`` policy
        staggers; TENSILE itself starts a job whenever it arrives."""
        if self.policy != "tensile" or not phases:
            return 0
        repeats = repeats or {}
        combined = np.zeros(period)
        for job_id, phase in phases.items():
            combined += np.roll(_round_usage(self.sequences[job_id].program, period, repeats.get(job_id, 1)), phase)
        mine = _round_usage(job.program, period, repeats.get(job.id, 1))
        delays = range(0, period, -(-period // STAGGER_CANDIDATES))
        peaks = [float(np.max(combined + np.roll(mine, (now + delay) % period))) for delay in delays]
        return delays[int(np.argmin(peaks))]

    def replan(self, phases: dict[int, int], period: int, repeats: dict[int, int] | None = None,
               wait: bool = False) -> None:
        """Start making a new plan for the running jobs, on the planning thread (or, for a small
        timeline where the executor waits for its plans, on this one: Note [Plans the waiting
        thread makes]), from a snapshot of their access sequences; :meth:`poll` installs it when
        it is ready (with ``wait``, at once). ``phases``: job id -> the round (mod ``period``, the
        executor's rounds per period) its current period started in; ``repeats``: job id ->
        iterations per period (1 for a job not in it). Jobs run meanwhile under the previous plan, so planning never stalls them,
        except where the device's kernels take every core (:attr:`waits_for_plans`: Note [Plans
        beside kernels on every core])."""
        reasons, self.replan_reasons = tuple(self.replan_reasons), []
        measured = [j for j in self.jobs.values() if self.sequences[j.id].measured]
        estimate = self.policy == "tensile"              # Note [Estimated cold starts]
        planned = list(self.jobs.values()) if estimate else measured
        cold = [j for j in self.jobs.values() if j not in planned]
        request = _Request(reasons, {j.id: self.sequences[j.id].iterations for j in measured})
        if self.policy != "reactive" and measured:
            reserve = sum(j.vanilla_peak_nbytes for j in cold)
            request.floor = max(j.min_working_set_nbytes for j in planned)
            headroom = max(self.headroom, self._pool_headroom)     # Note [Headroom for the pool]
            target = int((self.mm.budget_nbytes - reserve) * (1.0 - headroom))
            # the global planner holds each event to its own floor (Note [Targets under the floor])
            request.target = max(target, 0 if self.policy == "tensile" else request.floor)
            request.period = period
            request.traces = self.traces(phases, repeats, estimate)
        request.record["asked_s"] = self.mm.device.now()
        previous = self._request if self._pending is not None else None
        self._request = request
        self.history = (self.history + [request.record])[-64:]
        if previous is not None and not self._pending.cancel():   # superseded: skip it if not started yet
            if not self.deterministic or previous.started_s <= self.mm.device.now():
                self._landing.append((previous, self._pending))   # being made: it still lands
            else:                       # made when asked, but on one worker it never started
                _, plan, _ = self._pending.result()
                for key, charge in (plan.curve_work if plan is not None else {}).items():
                    self._curves[key].refund(charge)
        # not while the planning thread may be in _make (a request landing): one plan at a time
        if self.waits_for_plans and request.ops <= HERE_MAX_OPS and all(f.done() for _, f in self._landing):
            self._pending = concurrent.futures.Future()     # Note [Plans the waiting thread makes]
            self._pending.set_result(self._make(request, here=True))
        else:
            self._pending = self._planning.submit(self._make, request)
        if self.deterministic:
            self._pending.result()
            self._schedule_on_worker(request)
        if wait:
            request.ready_s = None
            self._pending.result()
            self.poll()
        elif self.waits_for_plans:
            concurrent.futures.wait([self._pending], timeout=PLAN_WAIT_S)
            self.poll()

    def traces(self, phases: dict[int, int], repeats: dict[int, int] | None = None,
               estimate: bool = False) -> list[JobTrace]:
        """The measured running jobs on the combined timeline, in admission order, with snapshots
        of their access sequences: what a plan is made from (``phases`` and ``repeats`` as for
        :meth:`replan`). ``Timeline(traces, period)`` is the timeline the planners see. With
        ``estimate``, the jobs in their cold start too, with op times predicted from the measured
        ones (:func:`~.trace.estimated`; Note [Estimated cold starts]), once one is measured."""
        order = {job_id: i for i, job_id in enumerate(self.jobs)}
        done = {j: s.snapshot() for j, s in self.sequences.items() if s.measured}
        out = []
        for j in self.jobs.values():
            seq = done.get(j.id) or (estimated(j.program, list(done.values())) if estimate and done else None)
            if seq is not None:
                out.append(JobTrace(j.id, seq, phases[j.id], order[j.id], (repeats or {}).get(j.id, 1)))
        return out

    def _schedule_on_worker(self, request: "_Request") -> None:
        """The simulated device: when ``request``, made already, would be ready on one planning
        worker (Note [Paid planning]), after the request it supersedes if that one had started."""
        now = self.mm.device.now()
        previous = self._worker_request
        if previous is not None and previous.ready_s is not None and previous.started_s > now:
            self._worker_free_s = previous.started_s     # it never started: called off, no cost
        request.started_s = max(now, self._worker_free_s)
        request.ready_s = request.started_s + request.modelled_s
        self._worker_free_s = request.ready_s
        self._worker_request = request

    def poll(self) -> bool:
        """Install a finished plan (the executor calls this every round); True if one was."""
        installed = False
        while self._landing and self._made(*self._landing[0]):
            request, future = self._landing.pop(0)
            _, plan, seconds = future.result()
            if plan is not None and any(j in self.jobs for j in plan.timeline.traces):
                self._install(request, plan, seconds)    # superseded, but fresher than the plan in force
                installed = True
        if self._pending is not None and self._made(self._request, self._pending):
            _, plan, seconds = self._pending.result()    # the pending future is the latest request's
            self._pending = None
            self._install(self._request, plan, seconds)
            installed = True
        return installed

    def _made(self, request: "_Request", future: concurrent.futures.Future) -> bool:
        """Whether ``request``'s plan is made, and on the simulated device its modelled
        planning time has passed (Note [Paid planning])."""
        return future.done() and (request.ready_s is None or self.mm.device.now() >= request.ready_s)

    def _install(self, request: "_Request", plan: Plan | None, seconds: float) -> None:
        request.record["installed_s"] = self.mm.device.now()
        self.plan = plan
        if self.policy == "tensile":        # Note [The fallback's limit and the floor]
            target = (max(plan.target_nbytes, request.floor)     # Note [Targets under the floor]
                      if plan is not None and plan.target_nbytes is not None else 0)
            self.mm.limit_nbytes = max(self._limit_nbytes, min(target, self.mm.budget_nbytes))
        self.plan_seconds += seconds
        self.modelled_plan_seconds += request.modelled_s
        self.plans_made += plan is not None
        self._plan_sequences = {t.job_id: t.sequence for t in request.traces
                            if t.job_id in request.iterations}      # estimated ones re-plan when measured
        self._plan_iteration = request.iterations
        for j in self.jobs.values():
            j.schedule = ("planned" if plan is not None and j.id in plan.timeline.traces
                          else "reactive" if self.policy == "reactive" else "cold start")
        request.record["decisions"] = len(plan.decisions) if plan else 0
        if plan is not None and plan.partial and request is self._request:
            self._want_replan("the last plan stopped at its budget")     # its curves go on from there
        if plan is not None:
            log.info("plan %d (%s, %s): %d decisions, predicted peak %d of target %d bytes, "
                     "predicted extra %.4f s per period, %.3f s to plan", self.plans_made, self.policy,
                     "; ".join(request.reasons), len(plan.decisions), plan.predicted_peak_nbytes,
                     plan.target_nbytes, plan.predicted_extra_s, seconds)

    def close(self) -> None:
        """Stop the planning thread."""
        self._planning.shutdown(wait=True, cancel_futures=True)

    def _make(self, request: "_Request", here: bool = False):
        """Make ``request``'s plan on this thread (the planning thread's, or with ``here`` the
        executor's, which waits for it), or in the planning process; returns (request, plan or
        None, wall seconds)."""
        started = time.perf_counter()
        plan = None
        work = PlanWork()
        if request.traces:
            try:
                # where the jobs' peaks, summed, fit the target, the global planner takes no action:
                # made here, the plan costs a timeline and one simulation of it on this thread, less
                # than the planning process's round trip (the traces pickled, a core taken there;
                # Note [Planning off the GIL])
                idle = self.policy == "tensile" and request.target >= sum(
                    t.sequence.program.vanilla_peak_nbytes() for t in request.traces)
                if not self.deterministic and not here and request.ops > PROCESS_MIN_OPS and not idle:
                    plan, _ = shared().submit(self.policy, request.traces, request.period, self.cost,
                                              request.target, MAX_PLAN_SECONDS).result()
                    work = plan.timeline.work
                else:
                    timeline = Timeline(request.traces, request.period)
                    work = timeline.work
                    if here:                # with the curves the process keeps, as the planning process's
                        plan = make_plan_with_kept_curves(self.policy, timeline, self.cost, request.target,
                                                          MAX_PLAN_SECONDS)
                    else:
                        plan = make_plan(self.policy, timeline, self.cost, request.target,
                                         None if self.deterministic else MAX_PLAN_SECONDS, self._curves)
            except Exception:  # a failed plan leaves the jobs under the reactive fallback
                log.exception("planning failed (%s); jobs run reactively until the next plan",
                              "; ".join(request.reasons))
        seconds = time.perf_counter() - started
        request.modelled_s = work.seconds()
        request.record.update(modelled_s=request.modelled_s, wall_s=seconds)
        return request, plan, seconds

    def _want_replan(self, reason: str) -> None:
        if self.policy not in UNPLANNED_POLICIES:      # reactive and dtr never plan
            self.replan_reasons.append(reason)

    def describe(self) -> dict:
        """JSON-able figures for ``tensile.memory``."""
        plan = self.plan
        return {
            "policy": self.policy,
            "h2d_bytes_per_s": self.cost.h2d_bytes_per_s,
            "d2h_bytes_per_s": self.cost.d2h_bytes_per_s,
            "disk_read_bytes_per_s": self.cost.disk_read_bytes_per_s,
            "disk_write_bytes_per_s": self.cost.disk_write_bytes_per_s,
            "plans_made": self.plans_made,
            "predicted_peak_nbytes": plan.predicted_peak_nbytes if plan else None,
            "predicted_extra_s": plan.predicted_extra_s if plan else None,
        }


@dataclass(eq=False)
class _Request:
    """What one plan is made from: the measured jobs' traces (with copied op times), the target
    and the floor, bytes."""

    reasons: tuple[str, ...]
    iterations: dict[int, int]
    traces: list[JobTrace] = field(default_factory=list)
    target: int = 0
    floor: int = 0                      # the jobs' largest working set, bytes
    period: int | None = None
    record: dict = field(default_factory=dict)
    modelled_s: float = 0.0             # the planning time the cost model gives its work, seconds
    started_s: float = 0.0              # simulated device: virtual seconds the worker starts it at
    ready_s: float | None = None        # simulated device: virtual seconds it may be installed at

    def __post_init__(self):
        self.record = {"reasons": self.reasons, "decisions": None, "asked_s": None, "installed_s": None,
                       "modelled_s": None, "wall_s": None}

    @property
    def ops(self) -> int:
        """Ops per period of the timeline its traces make."""
        return sum(len(t.sequence.program.ops) * t.repeats for t in self.traces)


@functools.lru_cache(maxsize=64)
def _op_usage(program) -> np.ndarray:
    """(ops,) int64: bytes a job of ``program`` holds at each op of an iteration, alone."""
    return Timeline([JobTrace(0, AccessSequence(program))]).usage([])


def _round_usage(program, period: int, repeats: int = 1) -> np.ndarray:
    """(period,) float64: bytes a job of ``program`` holds in each round of a period of
    ``period`` rounds in which it runs ``repeats`` iterations (the largest at its ops in that
    round; an empty round keeps the previous op's)."""
    per_op = _op_usage(program)
    q = np.arange(repeats * len(per_op))
    rounds = np.full(period, -1.0)
    np.maximum.at(rounds, round_of(q, len(q), period), per_op[q % len(per_op)])
    last_filled = np.maximum.accumulate(np.where(rounds >= 0, np.arange(period), 0))
    return rounds[last_filled]
