"""The scheduler benchmark: memory saved and time lost by each policy, side by side.

TENSILE's workload shapes (Zhang et al., arXiv 2105.13336) on our runtime: 1, 2, 3 and 4
identical concurrent training jobs of an MLP whose activations and gradients outweigh its weights
and optimizer state, and a mixed set of three different MLPs that arrive one after another. Each
workload runs first with unlimited memory (vanilla: the reactive policy under a budget of 64x the
jobs' unscheduled peaks, which never evicts), then under budgets of 70%, 50% and 35% of the
vanilla run's measured peak with every policy of the same runtime: reactive (farthest next use),
vdnn (vDNN_all), swap_score (arXiv 1903.06631) and tensile (the global planner). Every run uses the
same cost model, measured once. Arrivals of the mixed workload follow progress, not the clock: the
next job is submitted once the previous one has completed a third of its iterations, so every
policy sees the same arrival pattern.

Printed: a header (device, cost model, models and their memory make-up), a Markdown table with
per run the peak device bytes, MSR = 1 - peak/vanilla peak, EOR = time/vanilla time - 1 (wall time
from the first submit to the last job done), CBR = MSR/EOR, planned and passive swap-ins,
recomputes, bytes swapped out, the plans made and the time spent making them (on the executor's
thread, so it counts in EOR) and whether every job completed, then one PASS/FAIL line per target
of the scheduler. Written: a PNG of the device memory over time (per job, stacked) of one workload at
50% under every policy, from separate runs sampled every millisecond (the table's runs are not
sampled, so the sampler does not perturb their times).

    python bench/scheduler.py [--quick] [--iterations 24] [--repeats 1] [--out bench/out/]
                              [--plot mixed] [--device cpu]

Times are wall-clock: on a machine shared with other work they are noisy; use --repeats.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tabulate import tabulate

from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import model as models
from tensile_db.runtime.device import Device
from tensile_db.scheduler.cost import CostModel, measure_bandwidth

FEATURES, CLASSES, BATCH = 64, 10, 1024
MODELS = {   # name -> architecture; all deep or wide enough that activations dominate memory
    "deep": {"layers": [{"dense": 256, "activation": "relu"}] * 8},
    "wide": {"layers": [{"dense": 512, "activation": "relu", "dropout": 0.1}] * 4},
    "tanh": {"layers": [{"dense": 256, "activation": "tanh"}] * 6},
}
WORKLOADS = {   # name -> models of its jobs, in submission order
    "1x deep": ["deep"],
    "2x deep": ["deep"] * 2,
    "3x deep": ["deep"] * 3,
    "4x deep": ["deep"] * 4,
    "mixed": ["deep", "wide", "tanh"],
}
STAGGERED = {"mixed"}               # workloads whose jobs arrive one after another
BUDGET_FRACTIONS = (0.70, 0.50, 0.35)
POLICIES = ("reactive", "vdnn", "swap_score", "tensile")
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
    names: dict[int, str] = field(default_factory=dict)            # job id -> label
    samples: list[tuple[float, dict[int, int]]] = field(default_factory=list)  # (s, job id -> bytes)


def make_job(model: str, seed: int, iterations: int, label: str) -> TrainingJob:
    """A job training MODELS[model] for ``iterations`` iterations of batch BATCH (one epoch) on
    generated data: (BATCH * iterations, FEATURES) float32 normal features, classes from a random
    linear map."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH * iterations, FEATURES)).astype(np.float32)
    y = (x @ rng.normal(size=(FEATURES, CLASSES))).argmax(axis=1).astype(np.int32)
    spec = models.ModelSpec(models.parse_architecture(MODELS[model]), FEATURES, CLASSES, "classification")
    options = models.parse_options({"epochs": 1, "batch_size": BATCH, "seed": seed})
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
    finish within ``timeout_s`` of the first submit, makes ``completed`` False and its error is kept."""
    jobs = make_jobs(workload, iterations)
    if budget_nbytes is None:
        budget_nbytes = VANILLA_HEADROOM * sum(j.vanilla_peak_nbytes for j in jobs)
    manager = MemoryManager(Device(device), budget_nbytes)
    executor = Executor(manager, policy="reactive" if policy == "vanilla" else policy, cost=cost)
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
    return Run(workload, policy, manager.budget_nbytes, seconds, manager.peak_nbytes, not errors, errors,
               planned_swap_ins=sum(m.planned_swap_ins for m in mems),
               passive_swap_ins=sum(m.passive_swap_ins for m in mems),
               recomputes=sum(m.recomputes for m in mems),
               swapped_out_nbytes=sum(m.swapped_out_nbytes for m in mems),
               plans_made=executor.scheduler.plans_made, plan_s=executor.scheduler.plan_seconds,
               names={j.id: j.info.model_name for j in jobs}, samples=samples)


def median_run(repeats: int, *args, **kwargs) -> Run:
    """Run ``repeats`` times; the run of median time (the lower one for an even count), with its
    time replaced by the median time. A failure in any repeat is kept."""
    runs = sorted((run(*args, **kwargs) for _ in range(repeats)), key=lambda r: r.seconds)
    chosen = runs[(len(runs) - 1) // 2]
    chosen.seconds = statistics.median(r.seconds for r in runs)
    chosen.errors = [e for r in runs for e in r.errors]
    chosen.completed = not chosen.errors
    return chosen


def budget_for(workload: str, fraction: float, vanilla_peak_nbytes: int) -> int:
    """``fraction`` of the vanilla peak, raised to the largest working set of any job if below."""
    floor = max(j.min_working_set_nbytes for j in make_jobs(workload, 1))
    return max(int(fraction * vanilla_peak_nbytes), floor)


def measures(r: Run, vanilla: Run) -> tuple[float, float, float]:
    """(MSR, EOR, CBR) of ``r`` against ``vanilla``; CBR is inf when EOR <= 0 < MSR, nan when
    both are <= 0."""
    msr = 1 - r.peak_nbytes / vanilla.peak_nbytes
    eor = r.seconds / vanilla.seconds - 1
    cbr = msr / eor if eor > 0 else (float("inf") if msr > 0 else float("nan"))
    return msr, eor, cbr


def table_row(r: Run, vanilla: Run) -> list:
    msr, eor, cbr = measures(r, vanilla)
    budget = "-" if r.policy == "vanilla" else f"{100 * r.budget_nbytes / vanilla.peak_nbytes:.0f}"
    return [r.workload, budget, r.policy, f"{r.peak_nbytes:,}", f"{msr:.3f}", f"{eor:+.3f}",
            "-" if np.isnan(cbr) else "inf" if np.isinf(cbr) else f"{cbr:.2f}", f"{r.seconds:.2f}",
            r.planned_swap_ins, r.passive_swap_ins, r.recomputes, f"{r.swapped_out_nbytes / MiB:.0f}",
            f"{r.plans_made} ({r.plan_s:.2f})" if r.plans_made else "-", "yes" if r.completed else "NO"]


HEADERS = ["workload", "budget %", "policy", "peak bytes", "MSR", "EOR", "CBR", "time s",
           "planned swap-ins", "passive swap-ins", "recomputes", "swapped out MiB",
           "plans (s planning)", "all done"]


def print_header(args, cost: CostModel, iterations: int) -> None:
    """Device, cost model, and the memory make-up of every model."""
    print(f"# Scheduler benchmark on {args.device} ({os.cpu_count()} CPU cores; wall-clock times, "
          f"noisy when other work shares the machine)\n")
    print(f"Cost model (measured once, shared by every run): host->device "
          f"{cost.h2d_bytes_per_s / 1e9:.1f} GB/s, device->host {cost.d2h_bytes_per_s / 1e9:.1f} GB/s, "
          f"latency {cost.latency_s * 1e6:.0f} us per copy.\n")
    rows = []
    for name, arch in MODELS.items():
        job = make_job(name, 0, 1, name)
        layer = arch["layers"][0]       # the hidden layers of each model are all alike
        dropout = f" dropout {layer['dropout']}" if layer.get("dropout") else ""
        rows.append([name, f"{len(arch['layers'])} x ({layer['dense']} {layer['activation']}{dropout})", f"{job.vanilla_peak_nbytes:,}",
                     f"{job.program.persistent_nbytes:,}", f"{job.min_working_set_nbytes:,}",
                     f"{activation_ratio(job):.2f}"])
    print(f"Models: MLPs of {FEATURES} features -> {CLASSES} classes, batch {BATCH}, Adam, float32; "
          f"{iterations} iterations per job; mixed: next job submitted once the previous one has completed "
          f"{max(1, iterations // 3)} iterations; times are medians of {args.repeats} run(s).\n")
    print(tabulate(rows, headers=["model", "hidden layers", "unscheduled peak bytes", "weights+optimizer bytes",
                                  "largest working set bytes", "activations+gradients / weights+optimizer at peak"],
                   tablefmt="github", colalign=("left", "left", "right", "right", "right", "right")))
    print()


def checks(results: dict[str, dict], fractions) -> list[str]:
    """PASS/FAIL lines for the scheduler's targets (and the budget invariant)."""
    runs = [r for res in results.values() for r in [res["vanilla"], *res["runs"].values()]]
    failed = [f"{r.workload}/{r.policy}/{100 * r.budget_nbytes / results[r.workload]['vanilla'].peak_nbytes:.0f}%: "
              f"{'; '.join(r.errors)}" for r in runs if not r.completed]
    lines = [f"- every job completes under every budget: {'PASS' if not failed else 'FAIL'}"
             + "".join(f"\n    {f}" for f in failed)]
    over = [f"{r.workload}/{r.policy}" for r in runs if r.policy != "vanilla" and r.peak_nbytes > r.budget_nbytes]
    lines.append(f"- peak <= budget in every run: {'PASS' if not over else 'FAIL: ' + ', '.join(over)}")
    if 0.5 not in fractions:
        return lines
    for workload, res in results.items():
        vanilla = res["vanilla"]
        got = {p: measures(res["runs"][(0.5, p)], vanilla) for p in ("tensile", "reactive", "vdnn")}
        (t_msr, t_eor, _), (r_msr, r_eor, _), (v_msr, v_eor, _) = got["tensile"], got["reactive"], got["vdnn"]
        ok = t_eor <= 0.5 * r_eor and t_eor < v_eor and t_msr >= r_msr and t_msr >= v_msr
        peaks = [res["runs"][(0.5, p)].peak_nbytes for p in ("tensile", "reactive", "vdnn")]
        lines.append(f"- at 50%, {workload}: tensile EOR {t_eor:+.3f} <= 0.5 x reactive {r_eor:+.3f} "
                     f"{'yes' if t_eor <= 0.5 * r_eor else 'no'}, < vdnn {v_eor:+.3f} {'yes' if t_eor < v_eor else 'no'}; "
                     f"MSR >= reactive's and vdnn's (peak {peaks[0]:,} <= {peaks[1]:,} and {peaks[2]:,} bytes) "
                     f"{'yes' if t_msr >= max(r_msr, v_msr) else 'no'}: {'PASS' if ok else 'FAIL'}")
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
    parser.add_argument("--quick", action="store_true", help="fewer iterations per job (8 instead of 24)")
    parser.add_argument("--iterations", type=int, help="iterations per job (default 24, 8 with --quick)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration; the median time is reported")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out", help="folder of the PNG")
    parser.add_argument("--plot", choices=list(WORKLOADS), default="mixed", help="workload of the timeline plot")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    iterations = args.iterations or (8 if args.quick else 24)
    started = time.perf_counter()

    probe = MemoryManager(Device(args.device), 64 * MiB)
    cost = measure_bandwidth(probe.device, probe.engine)
    probe.close()
    print_header(args, cost, iterations)

    results: dict[str, dict] = {}
    for workload in WORKLOADS:
        vanilla = median_run(args.repeats, workload, "vanilla", None, iterations, cost, args.device)
        res = results[workload] = {"vanilla": vanilla, "runs": {}}
        for fraction in BUDGET_FRACTIONS:
            budget = budget_for(workload, fraction, vanilla.peak_nbytes)
            for policy in POLICIES:
                r = median_run(args.repeats, workload, policy, budget, iterations, cost, args.device)
                res["runs"][(fraction, policy)] = r
                print(f"  {workload:8s} {fraction:4.0%} {policy:10s} {r.seconds:6.2f} s "
                      f"(vanilla {vanilla.seconds:.2f} s)", file=sys.stderr, flush=True)

    rows = []
    for res in results.values():
        rows.append(table_row(res["vanilla"], res["vanilla"]))
        rows += [table_row(r, res["vanilla"]) for r in res["runs"].values()]
    print(tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True,
                   colalign=("left", "right", "left") + ("right",) * (len(HEADERS) - 4) + ("center",)))
    print("\nTargets of the scheduler:")
    print("\n".join(checks(results, BUDGET_FRACTIONS)))

    budget = budget_for(args.plot, 0.5, results[args.plot]["vanilla"].peak_nbytes)
    sampled = [run(args.plot, "vanilla", None, iterations, cost, args.device, sample=True)]
    sampled += [run(args.plot, p, budget, iterations, cost, args.device, sample=True) for p in POLICIES]
    path = args.out / f"scheduler_timeline_{args.plot.replace(' ', '')}_50.png"
    plot(sampled, sampled[0], budget, path)
    print(f"\nWrote {path} (memory timeline of {args.plot!r} at 50%). "
          f"Benchmark took {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
