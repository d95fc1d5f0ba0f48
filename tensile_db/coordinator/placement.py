"""Which device a training job runs on, when the coordinator drives several (``tensile.devices``).

Note [Placement]
----------------
Rationale: each device has its own budget, arena, memory manager, executor and plans; a job is
never split across devices, so where it starts decides both how long it waits behind the others
and how hard its device's scheduler must cut memory. Round robin ignores both; a static split of
each device's memory among a fixed number of slots (Apache MADlib's rule for GPUs shared by
database segments) ignores what the jobs need.

Rule, for a job of unscheduled peak ``P`` bytes, smallest working set ``W`` bytes and estimated
work ``w`` seconds (its iterations times the device's estimate of its ops,
:meth:`~tensile_db.runtime.device.Device.op_seconds`):

1. Only a device whose budget holds ``W`` may take it (the job could never run elsewhere). If
   none does, it is refused with the bytes it needs, as on one device.
2. On each of those, its predicted finish under the executor's fair sharing, which gives every
   running job about the same device time (processor sharing: a job of work ``w`` beside jobs
   with ``r_j`` left finishes after ``w + sum_j min(r_j, w)``), stretched by the extra time
   the device's scheduler is predicted to add: ``F = (w + sum_j min(r_j, w)) * (1 + e)``, with
   ``e`` the larger of ``PRESSURE_EXTRA * max(0, (P + sum_j P_j) / budget - 1)``, over the
   unscheduled peaks ``P_j`` of the jobs there (running or queued), and the extra seconds per
   second of compute that the device's latest plan predicts for the jobs it already has.
3. The least ``F``; among equal ones the least memory pressure ``(P + sum_j P_j) / budget``;
   then the first device listed. A job placed where the device's admission (Note [Admission by
   memory pressure] in :mod:`.executor`) holds it back waits there: ``F`` counts the jobs running
   and waiting alike. Ranking the devices instead by the sooner of ``F`` and the job's finish
   after waiting for room there was tried and dropped (measured when the admission weighed that
   finish): on ``bench/placement.py`` two simulated H100s ran 1.129 x the ideal makespan against
   1.058 (four: 1.053 either way); on two devices it sent more jobs to wait where one had room.
   Preferring the devices where a job would start at once was tried and dropped too: on
   ``bench/placement.py``'s sixteen jobs it balanced the devices' work worse (four simulated
   H100s: makespan 1.179 x the ideal against 1.117 without it; two: 1.143 either way; measured
   when the devices admitted jobs by the pressure bound alone).

So jobs spread while there is room, and a device already over its budget takes a job only when
the wait elsewhere costs more than its scheduling would. A search's trials are placed one by one
as each is submitted, so they spread over the devices too.

A predict call (:func:`choose_for_predict`) goes where its model's layers are cheapest to reach:
the device whose model store holds that version open (its layers possibly in the device's weight
cache), else one whose models directory has its file, else anywhere (the backend then sends the
weights); among equals, the device with the fewest predict calls and training jobs, then the
first listed. So a model's repeated calls reuse one device's cache, and the files of a version
are written once. A call's layers never spread over devices.

Sources: earliest finish time list scheduling (HEFT: Topcuoglu, Hariri and Wu, IEEE TPDS 13(3),
2002), with the finish time of processor sharing (Kleinrock, "Time-shared systems", JACM 14(2),
1967), which the executor's periods approximate (Note [Fair sharing] in
:mod:`tensile_db.scheduler.timeline`). ``PRESSURE_EXTRA`` is a coarse prior from
``bench/paper.py``'s ``tensile`` rows on the simulated H100 (FP32): at a pressure of 1.43, 2 and
2.86 (70%, 50% and 35% of the peak) four ResNet-50 ran +0.000, +0.035 and +0.138 and one
ResNet-50 +0.052, +0.143 and +0.509; 0.1 per unit of pressure lies between them.

Limitations: the work is estimated before the job runs, from FLOPs and bytes, and the jobs
already running are estimated the same way, not by their measured times; ``max_active_jobs``
(per device) queueing and stopping early (patience, halving) are not foreseen.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Extra time per unit of memory pressure above 1 that placement expects a device's scheduler to
#: add (Note [Placement]).
PRESSURE_EXTRA = 0.1


@dataclass(frozen=True)
class Load:
    """One device as placement sees it: its budget (bytes) and, per job there (running or
    queued), its unscheduled peak (bytes) and its estimated remaining work (seconds)."""

    budget_nbytes: int
    peaks_nbytes: tuple[int, ...] = ()
    remaining_s: tuple[float, ...] = ()
    planned_extra: float = 0.0          # the latest plan's predicted extra seconds per second of compute

    def pressure(self, peak_nbytes: int) -> float:
        """The unscheduled peaks of its jobs and one more of ``peak_nbytes``, over the budget."""
        return (peak_nbytes + sum(self.peaks_nbytes)) / self.budget_nbytes

    def stretch(self, peak_nbytes: int) -> float:
        """1 + the extra time per second of compute predicted here with one more job of
        ``peak_nbytes`` (0: none), Note [Placement], step 2."""
        return 1.0 + max(PRESSURE_EXTRA * max(0.0, self.pressure(peak_nbytes) - 1.0), self.planned_extra)

    def finish_s(self, peak_nbytes: int, work_s: float) -> float:
        """The predicted seconds until a job of ``peak_nbytes`` and ``work_s`` placed here ends
        (Note [Placement], step 2)."""
        return (work_s + sum(min(r, work_s) for r in self.remaining_s)) * self.stretch(peak_nbytes)

    def flow_s(self, peak_nbytes: int, work_s: float) -> float:
        """The predicted seconds until each job here and one more of ``peak_nbytes`` and
        ``work_s``, starting now, ends, summed: under processor sharing the job with ``r_k`` left
        ends after ``sum_j min(r_j, r_k)``, stretched (Note [Admission by memory pressure] in
        :mod:`.executor`)."""
        works = (*self.remaining_s, work_s)
        return sum(_shared_end_s(works, r_k) for r_k in works) * self.stretch(peak_nbytes)

    def flow_after_room_s(self, peak_nbytes: int, work_s: float) -> float:
        """:meth:`flow_s` if the job starts only once the jobs here leave room for it within the
        budget (or, larger than the budget, once none is left): the jobs that end first end as
        without it, stretched by their own predicted extra time; it then runs beside those left,
        with ``r_j - r_k`` each."""
        jobs = sorted(zip(self.remaining_s, self.peaks_nbytes))
        stretch = self.stretch(0)
        ends_s = [_shared_end_s([r for r, _ in jobs], r_i) for r_i, _ in jobs]    # each job's, unstretched
        for k, (r_k, _) in enumerate(jobs):
            left = jobs[k + 1:]
            if left and peak_nbytes + sum(p for _, p in left) > self.budget_nbytes:
                continue
            ended_s = sum(ends_s[:k + 1]) * stretch
            waited_s = ends_s[k] * stretch
            after = Load(self.budget_nbytes, tuple(p for _, p in left), tuple(r - r_k for r, _ in left))
            return ended_s + (len(left) + 1) * waited_s + after.flow_s(peak_nbytes, work_s)
        return self.flow_s(peak_nbytes, work_s)          # no job here


def _shared_end_s(works, r_k: float) -> float:
    """Seconds until the job with ``r_k`` seconds of work left ends when it shares the device with
    jobs of ``works`` seconds left (itself among them), under processor sharing: ``sum_j min(r_j,
    r_k)`` (Note [Placement], step 2; unstretched)."""
    return sum(min(r, r_k) for r in works)


def choose(loads: list[Load], peak_nbytes: int, min_working_set_nbytes: int, work_s: float) -> int | None:
    """The index into ``loads`` of the device a job goes to (Note [Placement]), or None when no
    budget holds its smallest working set ``min_working_set_nbytes``. ``peak_nbytes``: its
    unscheduled peak, bytes; ``work_s``: its estimated work, seconds."""
    fits = [i for i, load in enumerate(loads) if load.budget_nbytes >= min_working_set_nbytes]
    if not fits:
        return None
    return min(fits, key=lambda i: (loads[i].finish_s(peak_nbytes, work_s), loads[i].pressure(peak_nbytes), i))


def iteration_s(program, device) -> float:
    """The device's estimate of one iteration of ``program``, seconds (:meth:`Device.op_seconds`)."""
    return sum(device.op_seconds(op) for op in program.ops)


def remaining_s(job, device) -> float:
    """The estimated seconds of the iterations ``job`` (a :class:`~.jobs.TrainingJob`) has left;
    its iteration's estimate is made once, on the first device asked (one kind for all)."""
    if job.iteration_estimate_s is None:
        job.iteration_estimate_s = iteration_s(job.program, device)
    left = max(job.options.epochs * job.steps_per_epoch - job.iterations, 0)
    return left * job.iteration_estimate_s


def load_of(executor, jobs: list | None = None) -> Load:
    """What an :class:`~.executor.Executor`'s device holds now, for :func:`choose`: its jobs,
    running and queued, or only ``jobs``."""
    jobs = executor.jobs() if jobs is None else jobs
    device = executor.manager.device
    plan = executor.scheduler.plan
    simulation = plan.simulation if plan is not None and jobs else None
    planned = simulation.extra_s / simulation.compute_s if simulation is not None and simulation.compute_s > 0 else 0.0
    return Load(executor.manager.budget_nbytes, tuple(j.vanilla_peak_nbytes for j in jobs),
                tuple(remaining_s(j, device) for j in jobs), planned)


def choose_for_predict(executors: list, services: list, model_id: int, version: str) -> int:
    """The index of the device a predict call of the registry row ``model_id`` at ``version``
    goes to (Note [Placement]); ``executors`` and ``services`` (their
    :class:`~tensile_db.inference.service.InferenceService`) one per device, in order."""
    def rank(i: int) -> tuple:
        store = services[i].store
        held = 0 if store.get(model_id, version) is not None else 1 if store.has_file(model_id, version) else 2
        return held, services[i].calls() + len(executors[i].jobs()), i
    return min(range(len(services)), key=rank)
