"""The scheduler benchmark: memory saved and time lost by each policy, side by side.

TENSILE's workload shapes (Zhang et al., arXiv 2105.13336) on our runtime: 1, 2, 3 and 4
identical concurrent training jobs of an MLP whose activations and gradients outweigh its weights
and optimizer state, a mixed set of three different MLPs that arrive one after another, and
convolutional networks (:mod:`cnn`): a ResNet-50 and a VGG-16 at an eighth of their channels on
generated 3x32x32 images (batch 16), alone and together, the VGG arriving after the ResNet.
Without ``--workloads``, the 2x and 3x series and the two CNNs together are left out (see
:data:`DEFAULT_WORKLOADS`; ``--workloads`` names any of them). Each
workload runs first with unlimited memory (vanilla: the reactive policy under a budget of 64x the
jobs' unscheduled peaks, which never evicts), then under budgets of 70%, 50% and 35% of the
vanilla run's measured peak with every policy of the same runtime: reactive (farthest next use),
vdnn (vDNN_all), swap_score (arXiv 1903.06631), capuchin (Peng et al., ASPLOS 2020: swaps whose
copies hide behind compute, else recomputes by memory saved per second), checkpoint (sqrt(n)
segments, Chen et al., arXiv 1604.06174), tensile_published (TENSILE as the paper runs it: each job
planned alone against its share of the budget) and tensile (the global planner over the combined
timeline). Every run uses the same cost model, measured once. Arrivals of the mixed workload
follow progress, not the clock: the next job is submitted once the previous one has completed a
third of its iterations, so every policy sees the same arrival pattern.

Every configuration runs ``--repeats`` times; the repeats are interleaved (each repeat runs every
workload under every configuration once), and a run's EOR is taken against the vanilla run of
its own repeat.

Printed: a header (device, cost model, models and their memory make-up), a Markdown table with
per configuration the peak device bytes, MSR = 1 - peak/vanilla peak, EOR = time/vanilla time - 1
(wall time from the first submit to the last job done; median over the repeats, with its spread
[min, max]), CBR = MSR/EOR (of the medians), planned and passive swap-ins, recomputes, bytes
swapped out, the plans made and the time spent making them (on the executor's thread, so it
counts in EOR) and whether every job completed (counts of the median run); then where the
recomputes were chosen: per run that planned or did any, the dropped tensors of the last plan
(the one over the most jobs) grouped by the ops that produce them, and the recomputes done per
iteration; then one line per target of the scheduler: PASS, FAIL, or not decided when the
spreads of the runs compared overlap the target (among them, for 4x deep and mixed, tensile's EOR
at 50% no higher than any baseline's: vdnn, swap_score, capuchin, checkpoint, tensile_published).
Written: a PNG of the device memory over time (per job, stacked) of one workload at 50% under
every policy, from separate runs sampled every millisecond (the table's runs are not sampled, so
the sampler does not perturb their times).

    python bench/scheduler.py [--quick] [--iterations 10] [--repeats 2] [--workloads ...] [--out bench/out/]
                              [--plot mixed] [--device cpu]

Times are wall-clock: on a machine shared with other work they are noisy; use --repeats. On
``cuda`` one unmeasured vanilla run of each workload comes first: CuPy compiles each kernel at its
first launch, which would otherwise land in the first (vanilla) run and make every EOR look negative.
"""

from __future__ import annotations

import argparse
import collections
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tabulate import tabulate

import cnn
import common
from common import spread, verdict
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import model as models
from tensile_db.runtime.devices import make_device
from tensile_db.scheduler.cost import CostModel, measure_bandwidth

FEATURES, CLASSES = 64, 10


@dataclass(frozen=True)
class Model:
    """A model of the benchmark: its architecture (JSON as a user writes it), the values per row
    of its data and its batch. Images (an ``input`` shape) come from :func:`cnn.images`; vectors
    are normal features with classes from a random linear map."""

    architecture: dict
    n_features: int
    batch: int

    @property
    def images(self) -> bool:
        return "input" in self.architecture

    def describe(self) -> str:
        """The layers: ``8 x (256 relu)`` for the MLPs (hidden layers all alike), else :func:`cnn.describe`."""
        if self.images:
            return cnn.describe(self.architecture)
        layers = self.architecture["layers"]
        dropout = f" dropout {layers[0]['dropout']}" if layers[0].get("dropout") else ""
        return f"{len(layers)} x ({layers[0]['dense']} {layers[0]['activation']}{dropout})"

    def data(self, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        if self.images:
            return cnn.images(rows, cnn.IMAGE, CLASSES, seed)
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(rows, self.n_features)).astype(np.float32)
        return x, (x @ rng.normal(size=(self.n_features, CLASSES))).argmax(axis=1).astype(np.int32)


IMAGE_FEATURES = int(np.prod(cnn.IMAGE))
MODELS = {   # name -> model; all deep or wide enough that activations dominate memory
    "deep": Model({"layers": [{"dense": 256, "activation": "relu"}] * 8}, FEATURES, 1024),
    "wide": Model({"layers": [{"dense": 512, "activation": "relu", "dropout": 0.1}] * 4}, FEATURES, 1024),
    "tanh": Model({"layers": [{"dense": 256, "activation": "tanh"}] * 6}, FEATURES, 1024),
    "resnet50": Model(cnn.RESNET, IMAGE_FEATURES, 16),
    "vgg16": Model(cnn.VGG, IMAGE_FEATURES, 16),
}
WORKLOADS = {   # name -> models of its jobs, in submission order
    "1x deep": ["deep"],
    "2x deep": ["deep"] * 2,
    "3x deep": ["deep"] * 3,
    "4x deep": ["deep"] * 4,
    "mixed": ["deep", "wide", "tanh"],
    "1x resnet50": ["resnet50"],
    "1x vgg16": ["vgg16"],
    "resnet50 + vgg16": ["resnet50", "vgg16"],
}
#: what runs without --workloads, to keep the run short on two cores: the extremes of
#: the identical-jobs series, the mixed MLPs, and each CNN alone (the two CNNs together take as long
#: again: budgets below the ResNet's peak make it swap thousands of small tensors an iteration)
DEFAULT_WORKLOADS = ["1x deep", "4x deep", "mixed", "1x resnet50", "1x vgg16"]
STAGGERED = {"mixed", "resnet50 + vgg16"}   # workloads whose jobs arrive one after another
BUDGET_FRACTIONS = (0.70, 0.50, 0.35)
POLICIES = tuple(p for p in common.POLICIES if p != "dtr")      # DTR is measured by paper.py
BASELINES = tuple(p for p in common.RIVALS if p in POLICIES)     # tensile's EOR target is against these
EOR_TARGET_WORKLOADS = ("4x deep", "mixed")   # the workloads of that target
VANILLA_HEADROOM = 64               # the vanilla budget: this many times the jobs' unscheduled peaks
MiB = 1 << 20


@dataclass
class Run:
    """One run of a workload under one policy and budget. Bytes throughout; times in seconds."""

    workload: str
    policy: str
    budget_nbytes: int
    seconds: float
    peak_nbytes: int
    completed: bool
    errors: list[str]
    planned_swap_ins: int = 0
    passive_swap_ins: int = 0
    recomputes: int = 0
    swapped_out_nbytes: int = 0
    plans_made: int = 0
    plan_s: float = 0.0                 # seconds the executor spent planning (counted in EOR)
    iterations: int = 0                 # iterations completed, all jobs together
    names: dict[int, str] = field(default_factory=dict)            # job id -> label
    samples: list[tuple[float, dict[int, int]]] = field(default_factory=list)  # (s, job id -> bytes)
    #: the recompute decisions of the last plan over the most jobs: (job label, slot, producer, bytes)
    planned_recomputes: list[tuple[str, str, str, int]] = field(default_factory=list)
    #: recomputes done: (job label, producer) -> count
    recomputed: collections.Counter = field(default_factory=collections.Counter)


def make_job(model: str, seed: int, iterations: int, label: str) -> TrainingJob:
    """A job training MODELS[model] for ``iterations`` iterations of its batch (one epoch) on
    generated data (:meth:`Model.data`)."""
    m = MODELS[model]
    x, y = m.data(m.batch * iterations, seed)
    spec = models.ModelSpec(models.parse_architecture(m.architecture), m.n_features, CLASSES, "classification")
    options = models.parse_options({"epochs": 1, "batch_size": m.batch, "seed": seed})
    return TrainingJob(JobInfo(0, "bench", label), spec, options, x, y)


def make_jobs(workload: str, iterations: int) -> list[TrainingJob]:
    """Fresh jobs of ``workload``, labelled ``model #i``; the same seeds on every call."""
    return [make_job(m, seed, iterations, f"{m} #{seed + 1}") for seed, m in enumerate(WORKLOADS[workload])]


def activation_ratio(job: TrainingJob) -> float:
    """At the job's unscheduled peak: bytes of activations, gradients and workspace over bytes of
    weights and optimizer state (the program's slot sizes, rounded to the arena unit)."""
    persistent = job.program.persistent_nbytes
    return (job.vanilla_peak_nbytes - persistent) / persistent


class Sampler(threading.Thread):
    """Polls ``manager.snapshot()`` every ``period_s`` seconds and keeps (seconds since ``t0``,
    job id -> device bytes) until :meth:`stop`."""

    def __init__(self, manager: MemoryManager, t0: float, period_s: float = 0.001):
        super().__init__(name="bench-sampler", daemon=True)
        self.manager, self.t0, self.period_s = manager, t0, period_s
        self.samples: list[tuple[float, dict[int, int]]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            jobs = self.manager.snapshot()["jobs"]
            self.samples.append((time.perf_counter() - self.t0,
                                 {job_id: j["device_nbytes"] for job_id, j in jobs.items()}))
            time.sleep(self.period_s)

    def stop(self) -> list[tuple[float, dict[int, int]]]:
        self._done.set()
        self.join()
        return self.samples


def run(workload: str, policy: str, budget_nbytes: int | None, iterations: int, cost: CostModel,
        device: str, sample: bool = False, timeout_s: float = 600.0) -> Run:
    """Train the jobs of ``workload`` concurrently under ``policy`` and a budget of
    ``budget_nbytes`` (None: vanilla, i.e. the reactive policy with VANILLA_HEADROOM times the
    jobs' unscheduled peaks). A staggered workload submits each job once the previous one has
    completed a third of its iterations. Returns the :class:`Run`; a job that fails, or does not
    finish within ``timeout_s`` of the first submit, makes ``completed`` False and its error is kept.
    The plans the scheduler installs and the recomputes the jobs do are recorded by wrapping
    ``Scheduler.poll`` and ``MemoryManager.note_recompute``."""
    jobs = make_jobs(workload, iterations)
    if budget_nbytes is None:
        budget_nbytes = VANILLA_HEADROOM * sum(j.vanilla_peak_nbytes for j in jobs)
    manager = MemoryManager(make_device(device), budget_nbytes)
    executor = Executor(manager, policy="reactive" if policy == "vanilla" else policy, cost=cost)
    by_id = {j.id: j for j in jobs}
    recomputed: collections.Counter = collections.Counter()
    note_recompute, poll, plans = manager.note_recompute, executor.scheduler.poll, []

    def noting(tensor) -> None:
        job = by_id[tensor.job_id]
        recomputed[(job.info.model_name, cnn.producer(job.program, tensor.slot))] += 1
        note_recompute(tensor)

    def polling() -> bool:
        installed = poll()
        if installed and executor.scheduler.plan is not None:
            plans.append(executor.scheduler.plan)
        return installed

    manager.note_recompute, executor.scheduler.poll = noting, polling
    executor.start()
    errors: list[str] = []
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    sampler = Sampler(manager, t0) if sample else None
    if sampler:
        sampler.start()
    arrival_after = max(1, iterations // 3) if workload in STAGGERED else 0
    submitted = []
    for job in jobs:
        if submitted and arrival_after:
            previous = submitted[-1]
            while (previous.iterations < arrival_after and previous.finished_at is None
                   and time.perf_counter() < deadline):
                time.sleep(0.0005)
        try:
            executor.submit(job)
            submitted.append(job)
        except Exception as exc:
            errors.append(f"{job.info.model_name}: {exc}")
    for job in submitted:
        try:
            while (event := job.events.get(timeout=max(deadline - time.perf_counter(), 0.001)))[0] == "progress":
                pass
            if event[0] != "done":
                errors.append(f"{job.info.model_name}: {event[1]!r}")
        except queue.Empty:
            errors.append(f"{job.info.model_name}: not done after {timeout_s:.0f} s")
    seconds = time.perf_counter() - t0
    samples = sampler.stop() if sampler else []
    executor.stop()
    manager.close()
    mems = [j.memory for j in jobs if j.memory is not None]
    steady = max(reversed(plans), key=lambda p: len(p.timeline.traces), default=None)
    planned = [(by_id[d.job_id].info.model_name, d.slot, cnn.producer(by_id[d.job_id].program, d.slot), d.nbytes)
               for d in (steady.decisions if steady else []) if d.method == "recompute"]
    return Run(workload, policy, manager.budget_nbytes, seconds, manager.peak_nbytes, not errors, errors,
               planned_swap_ins=sum(m.planned_swap_ins for m in mems),
               passive_swap_ins=sum(m.passive_swap_ins for m in mems),
               recomputes=sum(m.recomputes for m in mems),
               swapped_out_nbytes=sum(m.swapped_out_nbytes for m in mems),
               plans_made=executor.scheduler.plans_made, plan_s=executor.scheduler.plan_seconds,
               iterations=sum(j.iterations for j in jobs), names={j.id: j.info.model_name for j in jobs},
               samples=samples, planned_recomputes=planned, recomputed=recomputed)


def budget_for(workload: str, fraction: float, vanilla_peak_nbytes: int) -> int:
    """``fraction`` of the vanilla peak, raised to the largest working set of any job if below."""
    floor = max(j.min_working_set_nbytes for j in make_jobs(workload, 1))
    return max(int(fraction * vanilla_peak_nbytes), floor)


def measures(r: Run, vanilla: Run) -> tuple[float, float, float]:
    """(MSR, EOR, CBR) of ``r`` against ``vanilla``; CBR is inf when EOR <= 0 < MSR, nan when
    both are <= 0."""
    msr = 1 - r.peak_nbytes / vanilla.peak_nbytes
    eor = r.seconds / vanilla.seconds - 1
    return msr, eor, cbr_of(msr, eor)


def cbr_of(msr: float, eor: float) -> float:
    return msr / eor if eor > 0 else (float("inf") if msr > 0 else float("nan"))


@dataclass
class Repeated:
    """The repeats of one configuration (``runs``) beside the vanilla run of the same repeat
    (``vanillas``); the figures of the table come from here."""

    runs: list[Run]
    vanillas: list[Run]

    def msrs(self) -> list[float]:
        return [measures(r, v)[0] for r, v in zip(self.runs, self.vanillas)]

    def eors(self) -> list[float]:
        return [measures(r, v)[1] for r, v in zip(self.runs, self.vanillas)]

    @property
    def median(self) -> Run:
        """The run of median time (the lower one for an even count)."""
        return sorted(self.runs, key=lambda r: r.seconds)[(len(self.runs) - 1) // 2]

    @property
    def completed(self) -> bool:
        return all(r.completed for r in self.runs)

    @property
    def errors(self) -> list[str]:
        return [e for r in self.runs for e in r.errors]


def table_row(rep: Repeated, vanilla_peak_nbytes: int) -> list:
    r, msrs, eors = rep.median, rep.msrs(), rep.eors()
    cbr = cbr_of(statistics.median(msrs), statistics.median(eors))
    budget = "-" if r.policy == "vanilla" else f"{100 * r.budget_nbytes / vanilla_peak_nbytes:.0f}"
    return [r.workload, budget, r.policy, f"{r.peak_nbytes:,}", f"{statistics.median(msrs):.3f}", spread(eors, "+.3f"),
            "-" if np.isnan(cbr) else "inf" if np.isinf(cbr) else f"{cbr:.2f}",
            f"{statistics.median(x.seconds for x in rep.runs):.2f}",
            r.planned_swap_ins, r.passive_swap_ins, r.recomputes, f"{r.swapped_out_nbytes / MiB:.0f}",
            f"{r.plans_made} ({r.plan_s:.2f})" if r.plans_made else "-", "yes" if rep.completed else "NO"]


HEADERS = ["workload", "budget %", "policy", "peak bytes", "MSR", "EOR [min, max]", "CBR", "time s",
           "planned swap-ins", "passive swap-ins", "recomputes", "swapped out MiB",
           "plans (s planning)", "all done"]


def print_header(args, cost: CostModel, iterations: int) -> None:
    """Device, cost model, and the memory make-up of every model."""
    print(f"# Scheduler benchmark on {cnn.machine() if args.device == 'cpu' else args.device} (wall-clock times, "
          f"noisy when other work shares the machine)\n")
    print(f"Cost model (measured once, shared by every run): host->device "
          f"{cost.h2d_bytes_per_s / 1e9:.1f} GB/s, device->host {cost.d2h_bytes_per_s / 1e9:.1f} GB/s, "
          f"latency {cost.latency_s * 1e6:.0f} us per copy, {cost.issue_s * 1e6:.1f} us of the executor's thread to "
          f"issue each swap-out and swap-in, {common.inline_copies(cost)} on that thread.\n")
    rows = []
    for name, m in MODELS.items():
        job = make_job(name, 0, 1, name)
        rows.append([name, m.describe(), f"{job.spec.n_parameters():,}", m.batch, f"{job.vanilla_peak_nbytes:,}",
                     f"{job.program.persistent_nbytes:,}", f"{job.min_working_set_nbytes:,}",
                     f"{job.min_working_set_nbytes / job.vanilla_peak_nbytes:.0%}", f"{activation_ratio(job):.2f}"])
    print(f"Models: MLPs of {FEATURES} features and CNNs of generated {'x'.join(map(str, cnn.IMAGE))} images, "
          f"-> {CLASSES} classes, Adam, float32; {iterations} iterations per job; staggered workloads "
          f"({', '.join(sorted(STAGGERED))}): next job submitted once the previous one has completed "
          f"{max(1, iterations // 3)} iterations; {args.repeats} interleaved repeat(s) per configuration.\n")
    print(tabulate(rows, headers=["model", "layers", "parameters", "batch", "unscheduled peak bytes",
                                  "weights+optimizer bytes", "largest working set bytes", "of the peak",
                                  "activations+gradients / weights+optimizer at peak"],
                   tablefmt="github", disable_numparse=True, colalign=("left", "left") + ("right",) * 7))
    print()


def recompute_rows(results: dict[str, dict]) -> list[list]:
    """Per run that planned or did recomputes (the median run of its configuration): the dropped
    tensors of its last plan over the most jobs, grouped by what produces them (count, MiB, slots),
    and the recomputes done per iteration, grouped the same way."""
    rows = []
    for res in results.values():
        vanilla_peak = res["vanilla"].median.peak_nbytes
        for (fraction, policy), rep in res["runs"].items():
            r = rep.median
            if not r.planned_recomputes and not r.recomputed:
                continue
            groups: dict[tuple[str, str], list] = collections.defaultdict(list)
            for label, slot, what, nbytes in r.planned_recomputes:
                groups[(label.split(" #")[0], what)].append((slot, nbytes))
            planned = "; ".join(f"{m} {what}: {len(v)} ({sum(n for _, n in v) / MiB:.1f} MiB: "
                                f"{' '.join(sorted({s for s, _ in v}, key=_natural)[:6])}{' ...' if len(v) > 6 else ''})"
                                for (m, what), v in sorted(groups.items())) or "-"
            done = collections.Counter()
            for (label, what), count in r.recomputed.items():
                done[(label.split(" #")[0], what)] += count
            per_it = "; ".join(f"{m} {what}: {n / max(r.iterations, 1):.1f}" for (m, what), n in sorted(done.items())) or "-"
            rows.append([r.workload, f"{100 * r.budget_nbytes / vanilla_peak:.0f}", policy, len(r.planned_recomputes),
                         planned, f"{sum(done.values()) / max(r.iterations, 1):.1f}", per_it])
    return rows


def _natural(slot: str):
    """Sort key: ``h3`` before ``h12``."""
    head = slot.rstrip("0123456789.")
    tail = slot[len(head):].split(".")[0]
    return head, int(tail) if tail else -1


def compare(low_a: float, high_a: float, low_b: float, high_b: float) -> str:
    """``yes`` if every value of spread a is <= every value of spread b, ``no`` if every value of a
    is above every value of b, else ``not decided`` (the spreads overlap)."""
    return "yes" if high_a <= low_b else "no" if low_a > high_b else "not decided"


def checks(results: dict[str, dict], fractions) -> list[str]:
    """One line per target of the scheduler (and the budget invariant): PASS, FAIL, or not
    decided where the spreads over the repeats of the runs compared overlap."""
    reps = [rep for res in results.values() for rep in [res["vanilla"], *res["runs"].values()]]
    failed = [f"{rep.median.workload}/{rep.median.policy}/"
              f"{100 * rep.median.budget_nbytes / results[rep.median.workload]['vanilla'].median.peak_nbytes:.0f}%: "
              f"{'; '.join(rep.errors)}" for rep in reps if not rep.completed]
    lines = [f"- every job completes under every budget: {'PASS' if not failed else 'FAIL'}"
             + "".join(f"\n    {f}" for f in failed)]
    over = [f"{r.workload}/{r.policy}" for rep in reps for r in rep.runs
            if r.policy != "vanilla" and r.peak_nbytes > r.budget_nbytes]
    lines.append(f"- peak <= budget in every run: {'PASS' if not over else 'FAIL: ' + ', '.join(over)}")
    if 0.5 not in fractions:
        return lines
    for workload, res in results.items():
        fraction = res["same"].get(0.5, 0.5)
        got = {p: res["runs"][(fraction, p)] for p in ("tensile", "reactive", "vdnn")}
        t_eor, r_eor, v_eor = (got[p].eors() for p in ("tensile", "reactive", "vdnn"))
        t_msr, r_msr, v_msr = (got[p].msrs() for p in ("tensile", "reactive", "vdnn"))
        half = compare(min(t_eor), max(t_eor), 0.5 * min(r_eor), 0.5 * max(r_eor))
        below = compare(min(t_eor), max(t_eor), min(v_eor), max(v_eor))
        if below == "yes" and max(t_eor) == min(v_eor):
            below = "no"                                        # strictly below
        msr = [compare(min(m), max(m), min(t_msr), max(t_msr)) for m in (r_msr, v_msr)]
        msr_ok = "yes" if all(a == "yes" for a in msr) else "no" if "no" in msr else "not decided"
        peaks = [got[p].median.peak_nbytes for p in ("tensile", "reactive", "vdnn")]
        actual = 100 * got["tensile"].median.budget_nbytes / res["vanilla"].median.peak_nbytes
        raised = f" (raised to the largest working set, {actual:.0f}%)" if actual > 50.5 else ""
        lines.append(f"- at 50%{raised}, {workload}: tensile EOR {spread(t_eor, '+.3f')} <= 0.5 x reactive "
                     f"{spread(r_eor, '+.3f')}: {half}; < vdnn {spread(v_eor, '+.3f')}: {below}; "
                     f"MSR >= reactive's and vdnn's (peak {peaks[0]:,} <= {peaks[1]:,} and {peaks[2]:,} bytes): "
                     f"{msr_ok}: {verdict((half, below, msr_ok))}")
        if workload in EOR_TARGET_WORKLOADS:
            base = {p: res["runs"][(fraction, p)].eors() for p in BASELINES}
            each = {p: compare(min(t_eor), max(t_eor), min(e), max(e)) for p, e in base.items()}
            lines.append(f"- at 50%{raised}, {workload}: tensile's EOR {spread(t_eor, '+.3f')} no higher than any "
                         f"baseline's: " + "; ".join(f"{p} {spread(e, '+.3f')}: {each[p]}" for p, e in base.items())
                         + f": {verdict(each.values())}")
    return lines


def plot(runs: list[Run], vanilla: Run, budget_nbytes: int, path: Path) -> None:
    """One subplot per run: per-job device MiB over time (stacked), the budget line; shared axes.
    EOR and MSR in the titles are against ``vanilla`` (the sampled vanilla run)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.4 * len(runs)), sharex=True, sharey=True)
    colors = plt.get_cmap("tab10").colors
    for ax, r in zip(axes, runs):
        t = np.array([s[0] for s in r.samples])
        ids = list(r.names)
        stacks = [np.array([s[1].get(i, 0) for s in r.samples]) / MiB for i in ids]
        ax.stackplot(t, *stacks, labels=[r.names[i] for i in ids], colors=colors[:len(ids)], alpha=0.85)
        label = "budget" if r.policy != "vanilla" else "budget of the other runs (vanilla: unlimited)"
        ax.axhline(budget_nbytes / MiB, color="crimson", linestyle="--", linewidth=1.2, label=label)
        msr, eor, _ = measures(r, vanilla)
        ax.set_title(f"{r.policy}: EOR {eor:+.2f}, peak {r.peak_nbytes / MiB:.1f} MiB (MSR {msr:.2f}), "
                     f"{r.seconds:.2f} s{'' if r.completed else ', A JOB FAILED'}", fontsize=10, loc="left")
        ax.set_ylabel("device MiB")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8, ncol=len(ids) + 1)
    axes[-1].set_xlabel("time since first submit (s)")
    fig.suptitle(f"Device memory per job, workload {runs[0].workload!r}, budget {budget_nbytes / MiB:.1f} MiB "
                 f"(50% of the table's vanilla peak)\nruns sampled every ms, separate from the table's runs",
                 fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations per job (6 instead of 10)")
    parser.add_argument("--iterations", type=int, help="iterations per job (default 10, 6 with --quick)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per configuration")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=DEFAULT_WORKLOADS,
                        help=f"the workloads to run (default: {', '.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out", help="folder of the PNG")
    parser.add_argument("--plot", choices=list(WORKLOADS), default="mixed", help="workload of the timeline plot")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    iterations = args.iterations or (6 if args.quick else 10)
    started = time.perf_counter()

    probe = MemoryManager(make_device(args.device), 64 * MiB)
    cost = measure_bandwidth(probe.device, probe.engine)
    probe.close()
    print_header(args, cost, iterations)

    if args.device == "cuda":   # CuPy compiles each kernel at its first launch: not in any timed run
        for workload in args.workloads:
            run(workload, "vanilla", None, 1, cost, args.device)

    results: dict[str, dict] = {w: {"vanilla": Repeated([], []), "runs": {}, "same": {}} for w in args.workloads}
    budgets: dict[tuple[str, float], int] = {}
    for repeat in range(args.repeats):              # interleaved: each repeat runs every configuration once
        for workload in args.workloads:
            res = results[workload]
            vanilla = run(workload, "vanilla", None, iterations, cost, args.device)
            res["vanilla"].runs.append(vanilla)
            res["vanilla"].vanillas.append(vanilla)
            for fraction in BUDGET_FRACTIONS:
                budget = budgets.setdefault((workload, fraction), budget_for(workload, fraction, vanilla.peak_nbytes))
                same = next((f for f in BUDGET_FRACTIONS if f > fraction and budgets.get((workload, f)) == budget), None)
                if same is not None:            # raised to the same budget as a larger fraction: not run again
                    res["same"][fraction] = same
                    continue
                for policy in POLICIES:
                    r = run(workload, policy, budget, iterations, cost, args.device)
                    rep = res["runs"].setdefault((fraction, policy), Repeated([], []))
                    rep.runs.append(r)
                    rep.vanillas.append(vanilla)
                    print(f"  repeat {repeat + 1}: {workload:12s} {fraction:4.0%} {policy:17s} {r.seconds:6.2f} s "
                          f"(vanilla {vanilla.seconds:.2f} s)", file=sys.stderr, flush=True)

    rows = []
    for res in results.values():
        vanilla_peak = res["vanilla"].median.peak_nbytes
        rows.append(table_row(res["vanilla"], vanilla_peak))
        rows += [table_row(rep, vanilla_peak) for rep in res["runs"].values()]
    print(tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True,
                   colalign=("left", "right", "left") + ("right",) * (len(HEADERS) - 4) + ("center",)))
    for workload, res in results.items():
        for fraction, same in res["same"].items():
            print(f"\n{workload}: {fraction:.0%} of the vanilla peak is below the largest working set; raised to it, "
                  f"the budget of {same:.0%} (the row at {100 * budgets[(workload, same)] / res['vanilla'].median.peak_nbytes:.0f}%), "
                  "which is not run again")
    print("\nWhere recompute is chosen. Tensors a recompute can reproduce (an activation whose producing ops "
          "can run again from inputs still held), per model run here, by the ops that produce them:")
    for name in dict.fromkeys(m for w in args.workloads for m in WORKLOADS[w]):
        program = make_job(name, 0, 1, name).program
        groups = collections.Counter(cnn.producer(program, slot) for slot in program.slots if program.recipe(slot))
        print(f"- {name}: {sum(groups.values())} of {len(program.slots)} slots: "
              + ", ".join(f"{what} {n}" for what, n in groups.most_common()))
    recomputes = recompute_rows(results)
    if recomputes:
        print("\nRuns that planned or did recomputes (the median run of each configuration; planned: the "
              "recompute decisions of its last plan over the most jobs, by the ops that produce the dropped "
              "tensor, with their bytes and slots; done: recomputes per iteration):\n")
        print(tabulate(recomputes, headers=["workload", "budget %", "policy", "planned recomputes",
                                            "planned, by producer (MiB: slots)", "done / iteration",
                                            "done / iteration, by producer"],
                       tablefmt="github", disable_numparse=True))
    else:
        print("\nNo plan of any run chose a recompute, and no job recomputed a tensor: every planned absence "
              "is a swap.")
    print("\nTargets of the scheduler:")
    print("\n".join(checks(results, BUDGET_FRACTIONS)))

    if args.plot in results:
        budget = budget_for(args.plot, 0.5, results[args.plot]["vanilla"].median.peak_nbytes)
        sampled = [run(args.plot, "vanilla", None, iterations, cost, args.device, sample=True)]
        sampled += [run(args.plot, p, budget, iterations, cost, args.device, sample=True) for p in POLICIES]
        path = args.out / f"scheduler_timeline_{args.plot.replace(' ', '')}_50.png"
        plot(sampled, sampled[0], budget, path)
        print(f"\nWrote {path} (memory timeline of {args.plot!r} at 50%).")
    print(f"\nBenchmark took {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
