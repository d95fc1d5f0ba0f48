"""Training jobs placed over several simulated GPUs (Note [Placement]) against the placements users
would otherwise get: round robin, and a static split of each device's memory.

Sixteen jobs, four each of VGG-16, ResNet-50, Inception-V3 and DenseNet-121 (``bench/paper.py``'s:
3x224x224, batch 16, Adam), in that order, one arriving every solo iteration of ResNet-50; each
runs ``WARMUP`` iterations and then about ``MEASURED`` iterations of the slowest model's device
time (so each takes about the same device time). They run on 1, 2 and 4 simulated GPUs of one
profile, each with a budget of ``FRACTION`` of the four models' unscheduled peaks together (each
device holds what ``bench/paper.py``'s mixed arrival holds at that fraction), under the
``tensile`` policy, ``max_active_jobs`` 8 per device and the default ``tensile.max_pressure``
(Note [Admission by memory pressure]). Placements:

- ``placement``: the coordinator's rule (:class:`~tensile_db.coordinator.training.TrainingService`
  places each job as it arrives);
- ``placement, no pressure bound``: the same with every job admitted at once (``max_pressure``
  none), as before the bound existed;
- ``round robin``: job ``k`` on device ``k mod D``;
- ``static split``: each device's memory split into ``SLOTS`` fixed parts, each running one job at a
  time in its part (Apache MADlib gives each database segment a fixed share of a GPU, 0.9 /
  segments per GPU); a job goes to the part with the fewest jobs, running or waiting. Two parts,
  so that VGG-16's largest op fits one.

The executors of all devices run in one thread, each round on the executor whose virtual clock is
earliest, so that a job is placed when every device's clock has reached its arrival.

Measures: makespan (virtual seconds until the last job ends) and its ratio to the ideal, the
jobs' vanilla work over the devices: the seconds one device computed and waited for copies (the
jobs' first loads of their weights and optimizer state) in the vanilla run of all of them on
one device, over the number of devices; the mean of the jobs' seconds from arrival to end
(waiting included); each job's EOR: the device's seconds in the job's own
ops (from each op's ``before`` hook to its ``after`` hook: its stalls, recomputes and evictions
included, the other jobs' ops not) per iteration from its ``WARMUP``-th on, over the same in a run
of the same jobs on the same devices with unlimited memory (vanilla), minus 1, so that the share
of the device a job gets beside others does not count, and the same seconds over its ops' own
kernels in the same run (each op's jittered time uncontended, without its stalls, recomputes
and evictions), minus 1: there the jitter of an op's time is on both sides, so a job that no
scheduling touched has an EOR of 0 (within the clock's rounding, ``CLOCK_RESOLUTION``), while the vanilla run draws other jitter (about
+-0.005 a job here), and copy contention, stalls, recomputes and evictions still count; each
device's peak over its budget.
Every figure is **simulated** and deterministic: two runs with the same arguments print the same
tables. The table is of ``--seed``; the placement on one device and on the most also runs with
``--repeats`` seeds in all (the devices' jitter), and each job's EOR there is given as the median
over them with its range.

Targets (on the most devices): makespan at most ``MAKESPAN_TARGET`` x the ideal, no job's EOR above
its EOR on one device, over its own kernels in the same run (above: the two ranges do not overlap;
a median above inside the ranges is not decided; the count over the vanilla run is printed too), every peak within its device's budget, and a shorter makespan than both
alternatives. Five seeds by default: two sets of three draws of one distribution fail to overlap
one time in ten (2 / C(6, 3)), so over sixteen jobs three seeds call about one job above, or
below, by the jitter alone; five draws each, one time in 126 (2 / C(10, 5)).

    python bench/placement.py [--devices 1,2,4] [--profile h100] [--seed 0] [--repeats 5]
                              [--max-pressure 2] [--jitter 0.03] [--first-run-error 0.05]
                              [--processes N] [--out bench/out]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from tabulate import tabulate

from common import better, median_and_range
from paper import BATCH, MODELS, WARMUP, iteration_s, jobs_of
from tensile_db.coordinator import jobs as jobs_module
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobState, TrainingJob
from tensile_db.coordinator.training import TrainingService
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import model as models
from tensile_db.runtime.gpus import PROFILES
from tensile_db.runtime.simulated import SimDevice
from tensile_db.settings import DEFAULT_MAX_PRESSURE

N_JOBS = 16
FRACTION = 0.5
SLOTS = 2
MAX_ACTIVE_JOBS = 8
#: The coordinator's placement, then the same without the executors' pressure bound (every job
#: admitted at once up to MAX_ACTIVE_JOBS), then what users would otherwise get.
PLACEMENTS = ("placement", "placement, no pressure bound", "round robin", "static split")
MAKESPAN_TARGET = 1.15
VANILLA_HEADROOM = 8            # vanilla: a budget of this many times the unscheduled peaks on a device
GiB = 1 << 30
#: The virtual clock's rounding, as a ratio: a job's seconds are sums of many float differences of
#: the clock (a job that no scheduling touched measured within 1e-12 of its kernels); an EOR over
#: its own kernels within it is 0.
CLOCK_RESOLUTION = 1e-9


@dataclass
class Run:
    """One run: virtual seconds, bytes; by job label where per job."""

    devices: int
    placement: str
    vanilla: bool
    assignment: dict = field(default_factory=dict)      # job label -> device index
    executor_of: dict = field(default_factory=dict)     # job label -> executor index (static split: a part)
    finish_s: dict = field(default_factory=dict)        # job label -> virtual s it ended
    arrival_s: dict = field(default_factory=dict)       # job label -> virtual s it arrived
    #: job label -> device seconds in its own ops (its stalls, recomputes and evictions included)
    #: per iteration, from its WARMUP-th to its last
    iteration_s: dict = field(default_factory=dict)
    #: job label -> device seconds of its ops' own kernels per iteration, over the same iterations:
    #: each op's jittered time uncontended, without its stalls, recomputes and evictions
    kernel_s: dict = field(default_factory=dict)
    peaks: list = field(default_factory=list)           # per device: (peak bytes, budget bytes)
    errors: list = field(default_factory=list)
    device_s: float = 0.0                               # the devices' seconds computing or waiting for copies
    wall_s: float = 0.0


def make_jobs(device: SimDevice) -> list[TrainingJob]:
    """The sixteen jobs, fresh, with their iterations (:func:`paper.jobs_of`) and arrivals (see
    the module docstring)."""
    jobs = jobs_of([MODELS[i % len(MODELS)] for i in range(N_JOBS)], device)
    arrival_s = iteration_s(device, jobs[MODELS.index("resnet50")])
    for i, job in enumerate(jobs):
        job.arrival_s = i * arrival_s
    return jobs


def device_budget(device: SimDevice) -> int:
    """Each device's budget: FRACTION of the four models' unscheduled peaks together."""
    return int(FRACTION * sum(j.vanilla_peak_nbytes for j in make_jobs(device)[:len(MODELS)]))


def run(n_devices: int, placement: str, args, assignment: dict | None = None, seed: int | None = None) -> Run:
    """The sixteen jobs on ``n_devices`` simulated GPUs under ``placement``; with ``assignment``
    (job label -> executor index, from a run of that placement) a vanilla run of the same
    assignment. ``seed``: the devices' jitter (``args.seed`` when None)."""
    started = time.perf_counter()
    # Job ids count up per process, and their values still change some of the scheduler's choices
    # among equals (four devices: makespan 1.394 s from id 1, 1.366 s from id 17): every run
    # starts from id 1, so that a run's figures do not depend on the runs its process made before.
    jobs_module._job_ids = itertools.count(1)
    vanilla = assignment is not None
    seed = args.seed if seed is None else seed
    devices = [SimDevice(args.profile, seed=1000 * seed + d, jitter=args.jitter, first_run_error=args.first_run_error)
               for d in range(n_devices)]
    jobs = make_jobs(devices[0])
    slots = SLOTS if placement == "static split" else 1
    budget = (VANILLA_HEADROOM * sum(j.vanilla_peak_nbytes for j in jobs) if vanilla
              else device_budget(devices[0])) // slots
    max_pressure = None if placement.endswith("no pressure bound") else args.max_pressure
    executors = [Executor(MemoryManager(device, budget), MAX_ACTIVE_JOBS if slots == 1 else 1,
                          policy="reactive" if vanilla else "tensile", name=f"sim:{d}" + (f".{s}" if slots > 1 else ""),
                          max_pressure=max_pressure)
                 for d, device in enumerate(devices) for s in range(slots)]
    result = Run(n_devices, placement, vanilla, arrival_s={j.info.model_name: j.arrival_s for j in jobs})
    own_s = {j.id: 0.0 for j in jobs}                   # job id -> device seconds in its own ops so far
    kernel_s = {j.id: 0.0 for j in jobs}                # job id -> device seconds in its ops' own kernels so far
    done: dict[int, list] = {j.id: [] for j in jobs}     # job id -> (own_s, kernel_s, iterations done) per iteration
    latest = {id(d.clock): _latest_kernel_s(d) for d in devices}
    for e in executors:
        _measure_own_time(e, own_s, kernel_s, latest[id(e.manager.device.clock)], done)
    service = TrainingService(executors, models.Limits(), "tensile")
    _drive(executors, jobs, lambda k, job: _place(placement, service, executors, k, job, assignment), result)
    for e in executors:
        e.stop()
    result.device_s = sum(d.clock.busy_s + d.clock.stall_s for d in devices)
    result.peaks = [(sum(e.manager.peak_nbytes for e in executors[d * slots:(d + 1) * slots]), budget * slots)
                    for d in range(n_devices)]
    for job in jobs:
        mine = {n: (t, k) for t, k, n in done[job.id]}
        if job.state is JobState.DONE and WARMUP in mine:
            last = max(mine)
            result.iteration_s[job.info.model_name] = (mine[last][0] - mine[WARMUP][0]) / (last - WARMUP)
            result.kernel_s[job.info.model_name] = (mine[last][1] - mine[WARMUP][1]) / (last - WARMUP)
    result.wall_s = time.perf_counter() - started
    return result


def _latest_kernel_s(device: SimDevice) -> list[float]:
    """A cell that holds the uncontended seconds of the latest kernel ``device`` ran (its clock's
    ``compute`` wrapped)."""
    cell, compute = [0.0], device.clock.compute

    def on_compute(seconds: float) -> float:
        cell[0] = seconds
        return compute(seconds)
    device.clock.compute = on_compute
    return cell


def _measure_own_time(executor: Executor, own_s: dict, kernel_s: dict, latest: list, done: dict) -> None:
    """Count, per job of ``executor``, the virtual seconds from the start of each of its ops'
    ``before`` hook to the end of its ``after`` hook (its stalls, recomputes and evictions
    included, the other jobs' ops not) and the uncontended seconds of the op's own kernel (the
    last its device ran before the ``after`` hook: ``latest``), and record the sums at each of
    its iterations' ends."""
    scheduler, device = executor.scheduler, executor.manager.device
    before, after, iteration_done = scheduler.before, scheduler.after, scheduler.iteration_done
    began = {}

    def on_before(job, position) -> None:
        began[job.id] = device.now()
        before(job, position)

    def on_after(job, position, seconds) -> None:
        kernel_s[job.id] += latest[0]
        after(job, position, seconds)
        own_s[job.id] += device.now() - began[job.id]

    def on_iteration(job) -> bool:
        done[job.id].append((own_s[job.id], kernel_s[job.id], job.iterations))
        return iteration_done(job)
    scheduler.before, scheduler.after, scheduler.iteration_done = on_before, on_after, on_iteration


def _place(placement: str, service: TrainingService, executors: list, k: int, job: TrainingJob,
           assignment: dict | None) -> int:
    """Submit the ``k``-th job to its executor under ``placement``; returns the executor's index."""
    if assignment is not None:
        i = assignment[job.info.model_name]
    elif placement.startswith("placement"):
        i = executors.index(service.submit(job))
        return i
    elif placement == "round robin":
        i = k % len(executors)
    else:
        i = min(range(len(executors)), key=lambda i: (len(executors[i].jobs()), i))
    job.device = executors[i].name
    executors[i].submit(job)
    return i


def _drive(executors: list, jobs: list, place, result: Run) -> None:
    """Run the executors in step until every job has ended: a round on the executor of the
    earliest virtual clock (of those with jobs; the least stepped among equals, so parts of one
    device alternate), and each job placed once every clock with a job has reached its arrival
    (an idle device's clock is moved to it)."""
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    steps = [0] * len(executors)
    where: dict[int, int] = {}

    def now(i: int) -> float:
        return executors[i].manager.device.now()

    k = 0
    while pending or any(e.jobs() for e in executors):
        active = [i for i, e in enumerate(executors) if e.jobs()]
        earliest = min((now(i) for i in active), default=math.inf)
        if pending and pending[0].arrival_s <= earliest:
            job = pending.pop(0)
            for i, e in enumerate(executors):
                if not e.jobs() and now(i) < job.arrival_s:
                    e.manager.device.idle_until(job.arrival_s)
            try:
                where[job.id] = place(k, job)
            except Exception as exc:          # no budget holds its smallest working set
                result.errors.append(f"{job.info.model_name}: {type(exc).__name__}")
            k += 1
            continue
        i = min(active, key=lambda i: (now(i), steps[i]))
        executors[i].step()
        steps[i] += 1
        for job in jobs:
            if where.get(job.id) == i and job.state is not JobState.QUEUED and job.state is not JobState.RUNNING \
                    and job.info.model_name not in result.finish_s:
                result.finish_s[job.info.model_name] = now(i)
                if job.state is not JobState.DONE:
                    result.errors.append(f"{job.info.model_name}: {job.state.value} {job.error!r}")
    per_part = len(executors) // result.devices
    result.executor_of = {j.info.model_name: where[j.id] for j in jobs if j.id in where}
    result.assignment = {name: i // per_part for name, i in result.executor_of.items()}


def eors(r: Run, vanilla: Run) -> dict[str, float]:
    """Each job's EOR in ``r`` over the vanilla run of its assignment."""
    return {name: s / vanilla.iteration_s[name] - 1.0 for name, s in r.iteration_s.items()
            if name in vanilla.iteration_s}


def same_run_eors(r: Run) -> dict[str, float]:
    """Each job's EOR in ``r`` over its ops' own kernels in ``r``; 0 within ``CLOCK_RESOLUTION``."""
    out = {name: s / r.kernel_s[name] - 1.0 for name, s in r.iteration_s.items() if r.kernel_s.get(name)}
    return {name: 0.0 if abs(x) < CLOCK_RESOLUTION else x for name, x in out.items()}


def _job(config: tuple) -> tuple:
    n_devices, placement, args, assignment, seed = config
    return (n_devices, placement, assignment is not None, seed), run(n_devices, placement, args, assignment, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="1,2,4", help="device counts, comma-separated")
    parser.add_argument("--profile", default="h100", choices=sorted(PROFILES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jitter", type=float, default=0.03)
    parser.add_argument("--first-run-error", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=5,
                        help="seeds (from --seed) of the placement on one device and on the most, for each job's EOR")
    parser.add_argument("--max-pressure", type=float, default=DEFAULT_MAX_PRESSURE,
                        help="the executors' pressure bound (Note [Admission by memory pressure])")
    parser.add_argument("--processes", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                        help="directory of placement_runs.json, every run's figures")
    args = parser.parse_args()
    counts = sorted({1} | {int(c) for c in args.devices.split(",")})      # one device: the reference
    configs = [(d, p) for d in counts for p in PLACEMENTS if not (d == 1 and p == "round robin")]
    # every configuration with args.seed; the placement on one device and on the most, with the
    # repeats' seeds too (each job's EOR against its EOR on one device, with its spread)
    seeded = [(d, p, args.seed) for d, p in configs] + [
        (d, "placement", s) for s in seeds_of(args)[1:] for d in sorted({1, counts[-1]})]
    runs: dict[tuple, Run] = {}
    with concurrent.futures.ProcessPoolExecutor(args.processes) as pool:
        for key, r in pool.map(_job, [(d, p, args, None, s) for d, p, s in seeded]):
            runs[key] = r
        for key, r in pool.map(_job, [(d, p, args, runs[(d, p, False, s)].executor_of, s) for d, p, s in seeded]):
            runs[key] = r
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "placement_runs.json"), "w") as f:     # the figures, before any is printed
        json.dump([dataclasses.asdict(r) for r in runs.values()], f)
    report(runs, counts, configs, args)


def seeds_of(args) -> list[int]:
    """The seeds of the repeats: ``--seed`` and the next ``--repeats`` - 1."""
    return [args.seed + k for k in range(args.repeats)]


def job_eors(runs: dict, d: int, seeds: list[int], same_run: bool = False) -> dict[str, list[float]]:
    """Each job's EOR under the placement on ``d`` devices, one a seed of ``seeds``: over its
    vanilla run, or with ``same_run`` over its own kernels."""
    out: dict[str, list[float]] = {}
    for seed in seeds:
        r = runs[(d, "placement", False, seed)]
        for name, x in (same_run_eors(r) if same_run else eors(r, runs[(d, "placement", True, seed)])).items():
            out.setdefault(name, []).append(x)
    return out


def eor_verdict(top: list[float], one: list[float]) -> str:
    """A job's EOR on the most devices against one device, over the seeds: ``above`` or
    ``below`` where the ranges do not overlap, ``not above`` where its median is not above,
    else ``not decided`` (above, inside the spread)."""
    side = better(top, one, higher_is_better=False)
    if side is not None:
        return "below" if side == "ours" else "above"
    return "not above" if statistics.median(top) <= statistics.median(one) else "not decided"


def report(runs: dict, counts: list[int], configs: list[tuple], args) -> None:
    """Print the tables and the targets of ``runs`` ((devices, placement, vanilla, seed) -> Run)."""
    profile = SimDevice(args.profile)
    budget = device_budget(profile)
    seeds = seeds_of(args)
    print(f"# Placement over several devices ({profile.describe()}; seed {args.seed}, jitter "
          f"{args.jitter}, first-run error +{args.first_run_error})\n")
    print(f"{N_JOBS} jobs ({', '.join(MODELS)} in turn, batch {BATCH}, Adam), one every solo ResNet-50 iteration; "
          f"each device's budget {budget / GiB:.3f} GiB ({FRACTION:.0%} of the four models' unscheduled peaks "
          f"together), policy tensile, {MAX_ACTIVE_JOBS} jobs at once per device, beyond the budget admitted while the "
          f"running jobs' unscheduled peaks stay within {args.max_pressure:g} x the budget and the job is predicted to "
          f"end sooner than by waiting (static split: {SLOTS} parts of one job each).\n")
    work_s = runs[(1, "placement", True, args.seed)].device_s
    rows, verdicts = [], {}
    for d, p in configs:
        r, v = runs[(d, p, False, args.seed)], runs[(d, p, True, args.seed)]
        e = eors(r, v)
        makespan = max(r.finish_s.values(), default=math.nan)
        in_system = statistics.mean(r.finish_s[n] - r.arrival_s[n] for n in r.finish_s) if r.finish_s else math.nan
        ideal = work_s / d
        peak = max(pk / b for pk, b in r.peaks)
        rows.append([d, p, f"{makespan:.3f}", f"{ideal:.3f}", f"{makespan / ideal:.3f}", f"{in_system:.3f}",
                     f"{statistics.median(e.values()):+.3f}" if e else "-", f"{max(e.values()):+.3f}" if e else "-",
                     f"{peak:.3f}", " ".join(str(sum(1 for a in r.assignment.values() if a == i)) for i in range(d)),
                     "yes" if not r.errors else "; ".join(r.errors)])
        verdicts[(d, p)] = (makespan, ideal, peak, not r.errors)
    print(tabulate(rows, headers=["devices", "placement", "makespan s", "ideal s", "/ ideal", "mean job s", "median job EOR",
                                  "max job EOR", "max peak / budget", "jobs per device", "completed"],
                   disable_numparse=True))
    top = counts[-1]
    if top > 1 and (top, "placement") in verdicts:
        print(f"\n## Each job's EOR on 1 device and on {top} (placement; median [min, max] over seeds "
              f"{', '.join(map(str, seeds))}): over the vanilla run of the same assignment, and over its own kernels "
              f"in the same run (judged)\n")
        one, many = job_eors(runs, 1, seeds), job_eors(runs, top, seeds)
        one_same, many_same = job_eors(runs, 1, seeds, same_run=True), job_eors(runs, top, seeds, same_run=True)
        judged = {n: eor_verdict(many_same[n], one_same[n]) for n in many_same if n in one_same}
        by_vanilla = {n: eor_verdict(many[n], one[n]) for n in many if n in one}
        assignment = runs[(top, "placement", False, args.seed)].assignment
        print(tabulate([[n, *median_and_range(one.get(n, [math.nan]), "+.3f"), *median_and_range(many[n], "+.3f"),
                         *median_and_range(one_same.get(n, [math.nan]), "+.3f"),
                         *median_and_range(many_same.get(n, [math.nan]), "+.3f"), judged.get(n, "-"),
                         assignment.get(n, "-")] for n in many],
                       headers=["job", "vanilla run: on 1 device", "[min, max]", f"on {top}", "[min, max]",
                                "same run: on 1 device", "[min, max]", f"on {top}", "[min, max]", f"on {top}",
                                f"device (seed {args.seed})"], disable_numparse=True))
        vanilla_above = sum(v == "above" for v in by_vanilla.values())
        vanilla_open = sum(v == "not decided" for v in by_vanilla.values())
        makespan, ideal, peak, complete = verdicts[(top, "placement")]
        others = {p: verdicts[(top, p)][0] for p in PLACEMENTS if not p.startswith("placement") and (top, p) in verdicts}
        above = [n for n, v in judged.items() if v == "above"]
        open_ = [n for n, v in judged.items() if v == "not decided"]
        eor_result = "FAIL" if above or len(judged) < N_JOBS else "not decided" if open_ else "PASS"
        print("\n## Targets\n")
        print(f"{'PASS' if makespan <= MAKESPAN_TARGET * ideal else 'FAIL'}: on {top} devices the makespan is at most "
              f"{MAKESPAN_TARGET} x the ideal (got {makespan / ideal:.3f})")
        print(f"{eor_result}: no job's EOR on {top} devices above its EOR on one, over its own kernels in the same "
              f"run ({len(above)} above, {len(open_)} above inside the spread"
              + (f": {', '.join(above + open_)}" if above or open_ else "")
              + f"; over the vanilla run: {vanilla_above} above, {vanilla_open} above inside the spread)")
        print(f"{'PASS' if peak <= 1.0 else 'FAIL'}: every device's peak within its budget (highest {peak:.3f})")
        for p, m in others.items():
            print(f"{'PASS' if makespan < m and complete else 'FAIL'}: ahead of {p} on {top} devices "
                  f"(makespan {makespan:.3f} s against {m:.3f} s)")
    print("\n## Wall clock of this machine (not simulated)\n")
    print(tabulate([[d, p, seed, f"{runs[(d, p, False, seed)].wall_s:.1f}", f"{runs[(d, p, True, seed)].wall_s:.1f}"]
                    for d, p, vanilla, seed in runs if not vanilla], headers=["devices", "placement", "seed", "run s", "vanilla run s"],
                   disable_numparse=True))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
