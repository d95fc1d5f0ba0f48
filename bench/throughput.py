"""Training throughput (samples per second) of our runtime beside PyTorch on the CPU.

Two workloads, each trained the same way on both sides (same network, batch, Adam, float32,
data):

- MLP: 64 features -> 512-512-256 relu -> 10 classes, batch 128, features from a normal
  distribution, classes from a random linear map;
- CNN: the small residual CNN of :data:`cnn.SMALL_CNN` (convolution, batch norm, a residual
  block, max pool, a concatenation, global average pool, dense) on generated 3x32x32 images
  (:func:`cnn.images`), batch 64.

Runs: PyTorch (the same network in ``torch.nn`` node for node, :func:`cnn.torch_module`;
``torch.optim.Adam``; ``torch.set_num_threads`` set to the threads of the BLAS our matrix products
run on) in a process of its own, and our runtime through the coordinator's executor and memory
manager (the ``tensile`` policy) with an unlimited budget and under budgets that are fractions of
the job's vanilla peak (raised to its largest working set where that is larger: no policy can go
below it). The runs of every configuration alternate within each repeat (the order reversed every
other repeat), so drift of the machine falls on all of them alike. PyTorch's process is spawned
once and makes the same data; it runs apart because its wheel bundles its own GNU OpenMP, a second
runtime beside the system's that oneDNN and our fused steps run on, and in one process the idle
threads of the two take each other's cores: after a PyTorch run beside it, our MLP took 6.2 ms an
iteration against 3.95 ms in a process without PyTorch (the coordinator never has PyTorch in it).
Our process fixes glibc's mmap threshold as the coordinator does (``fix_mmap_threshold``), so that
a swap-out's host copy costs what it costs there: with glibc's default the copies came from the
heap once PyTorch's frees had raised the threshold, and the budgeted runs looked faster than the
coordinator runs them.

samples/s counts the iterations after a run's first (the first touches a fresh arena and is the
scheduler's cold start: it is timed on neither side; our second, whose op times the first plan
is made on, runs under the cold start's arrangement too, and is timed). Printed per workload: the
median samples/s over the repeats with its spread (min to max), ours / PyTorch per repeat (median,
min to max), budget, peak device bytes, bytes swapped out and recomputes per iteration; then the
target lines (ours / PyTorch at least 0.8 on the MLP and 0.6 on the CNN, unlimited; at half the
peak at most 1.3 times the unlimited time per iteration, repeat by repeat; decided only when the
whole spread of the ratio lies on one side of the target) and a
profile of where our time goes: the op times the executor measures for each op (the scheduler's
``after`` hook) in the run of median samples/s, grouped by kind, per iteration, and the wall time
per iteration against the time in the ops, with the median time of the iterations from the first
that ended with the planned pool serving (the steady state; the iterations before it pay for the
plans being made on the machine's cores, and the targets count them), and under a budget what its
swaps cost by the cost model measured at start-up (their bytes at its bandwidths, each swap's
latency and issue): where every copy is the executor's thread's own, as where the kernels take
every core, the unlimited time per iteration plus that is the least the budget allows with those
swaps, however small the bookkeeping around them; and the lower bound of ``docs/bound.md`` on the
extra time of any plan of swaps and recomputes within the budget, by the same cost model, on the
run's timeline (its measured op times): the least any plan could add.

    python bench/throughput.py [--repeats 5] [--quick]
    TENSILE_ONEDNN=0 python bench/throughput.py      # our convolutions lowered on NumPy instead of oneDNN
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import multiprocessing
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tabulate import tabulate

import cnn
from common import decided, inline_copies
from tensile_db.coordinator.__main__ import fix_mmap_threshold
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.memory.manager import MemoryManager
from tensile_db.memory.planned import State
from tensile_db.runtime import fused, onednn, workers
from tensile_db.runtime import model as models
from tensile_db.runtime.device import CpuDevice
from tensile_db.scheduler import worker as planning
from tensile_db.scheduler.bound import lower_bound
from tensile_db.scheduler.cost import CostModel, measure_bandwidth

MiB = 1 << 20
POLICY = "tensile"
#: the targets: our samples/s at least this fraction of PyTorch's, unlimited budget, by workload
TARGET_RATIO = {"MLP": 0.8, "CNN": 0.6}
#: and at 50% of the vanilla peak, at most this many times the unlimited run's time per iteration
BUDGET_FRACTION, BUDGET_SLOWDOWN = 0.5, 1.3


@dataclass(frozen=True)
class Workload:
    """A network, its data and how it is run. ``iterations``: timed iterations per run (one more
    runs first, untimed); ``fractions``: our budgets, as fractions of the vanilla peak (None:
    unlimited)."""

    name: str
    architecture: dict
    n_features: int
    batch: int
    iterations: int
    fractions: tuple
    data: object = field(repr=False)           # (samples) -> (x (samples, n_features) float32, y int32)

    @property
    def spec(self) -> models.ModelSpec:
        return cnn.spec_of(self.architecture, self.n_features)

    def arrays(self):
        return self.data((self.iterations + 1) * self.batch)


def mlp_data(samples: int, features: int = 64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, features)).astype(np.float32)
    return x, (x @ rng.normal(size=(features, cnn.CLASSES))).argmax(axis=1).astype(np.int32)


def workloads(quick: bool) -> list[Workload]:
    scale = 4 if quick else 1
    return [Workload("MLP", {"layers": [{"dense": 512}, {"dense": 512}, {"dense": 256}]}, 64, 128, 64 // scale,
                     (None, 0.7, 0.5), mlp_data),
            Workload("CNN", cnn.SMALL_CNN, int(np.prod(cnn.IMAGE)), 64, 24 // scale, (None, 0.5), cnn.images)]


@dataclass
class Measured:
    """One run: samples/s after the first iteration; our runs also memory figures and op times."""

    samples_per_s: float
    budget_nbytes: int = 0
    peak_nbytes: int = 0
    swapped_out_nbytes_per_it: float = 0.0
    swapped_in_nbytes_per_it: float = 0.0
    swaps_per_it: float = 0.0                  # swap-outs and swap-ins
    recomputes_per_it: float = 0.0
    wall_s_per_it: float = 0.0
    op_s: dict = field(default_factory=dict)    # op name -> seconds over the timed iterations
    timed_iterations: int = 0
    served_from: int | None = None   # the first iteration that ended with the planned pool serving
    served_s_per_it: float | None = None   # median seconds of the iterations from that one on
    bound_s_per_it: float | None = None    # under a budget: the least any plan adds (lower_bound)


def budget_for(job: TrainingJob, fraction: float | None) -> int:
    """``fraction`` of the job's vanilla peak, at least its largest working set (None: 4 x the peak)."""
    if fraction is None:
        return 4 * job.vanilla_peak_nbytes
    return max(int(job.vanilla_peak_nbytes * fraction), job.min_working_set_nbytes)


def ours(w: Workload, x, y, fraction: float | None, cost: CostModel) -> Measured:
    """Train one epoch of ``x``/``y`` through the executor under ``fraction`` of the vanilla peak.
    Each op's measured seconds are taken from the scheduler's ``after`` hook."""
    options = models.parse_options({"epochs": 1, "batch_size": w.batch, "standardize": False})
    job = TrainingJob(JobInfo(0, "bench", w.name), w.spec, options, x, y)
    budget = budget_for(job, fraction)
    executor = Executor(MemoryManager(CpuDevice(), budget), policy=POLICY, cost=cost)
    n_ops, ends, op_s, serving = len(job.program.ops), [], collections.Counter(), []
    names = [op.name for op in job.program.ops]
    hook = executor.scheduler.after

    def after(j, position: int, seconds: float) -> None:
        hook(j, position, seconds)
        if j.iterations >= 1:                       # j.iterations: iterations completed before this op's
            op_s[names[position]] += seconds
        if position == n_ops - 1:
            ends.append(time.perf_counter())
            serving.append(executor.manager.pool.state is State.SERVING)

    executor.scheduler.after = after
    executor.start()
    try:
        executor.submit(job)
        while (event := job.events.get(timeout=600))[0] == "progress":
            pass
    finally:
        executor.stop()
    if event[0] != "done":
        raise RuntimeError(f"{w.name} at {fraction or 'unlimited'} budget failed: {event[1]!r}")
    timed = len(ends) - 1
    mem = job.memory
    plan = executor.scheduler.plan
    bound = (lower_bound(plan.timeline, cost, budget).extra_s
             if fraction is not None and plan is not None and plan.timeline is not None else None)
    served = next((i for i in range(1, len(ends)) if serving[i]), None)
    served_s = statistics.median(b - a for a, b in zip(ends[served - 1:], ends[served:])) if served else None
    return Measured(w.batch * timed / (ends[-1] - ends[0]), budget, mem.peak_nbytes,
                    mem.swapped_out_nbytes / len(ends), mem.swapped_in_nbytes / len(ends),
                    (mem.swap_outs + mem.swap_ins) / len(ends), mem.recomputes / len(ends),
                    (ends[-1] - ends[0]) / timed, dict(op_s), timed, served, served_s, bound)


def pytorch(w: Workload, x, y, threads: int) -> Measured:
    """The same training in PyTorch on ``threads`` threads; samples/s after the first iteration."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = cnn.torch_module(w.spec.network)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    ends = []
    for i in range(len(x) // w.batch):
        idx = order[i * w.batch:(i + 1) * w.batch]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(xt[idx]), yt[idx]).backward()
        opt.step()
        ends.append(time.perf_counter())
    return Measured(w.batch * (len(ends) - 1) / (ends[-1] - ends[0]))


_DATA: dict = {}          # in PyTorch's process: each workload's arrays, made once


def pytorch_apart(name: str, quick: bool, threads: int, samples: int | None = None) -> Measured:
    """:func:`pytorch` of workload ``name`` on its data (the first ``samples`` rows, all when
    None), in PyTorch's own process (see the module)."""
    w = next(w for w in workloads(quick) if w.name == name)
    if name not in _DATA:
        _DATA[name] = w.arrays()
    x, y = _DATA[name]
    return pytorch(w, x[:samples], y[:samples], threads)


def configurations(w: Workload) -> list[tuple[str, float | None]]:
    """("pytorch", None), then ("ours", fraction) per budget."""
    return [("pytorch", None)] + [("ours", f) for f in w.fractions]


def label(w: Workload, kind: str, fraction: float | None, job_budget: int, vanilla: int) -> str:
    if kind == "pytorch":
        return "PyTorch 2.13, CPU"
    if fraction is None:
        return "tensile_db, unlimited"
    actual = job_budget / vanilla
    raised = f", raised to the largest working set: {actual:.0%}" if actual > fraction + 0.005 else ""
    return f"tensile_db, {fraction:.0%} of the vanilla peak{raised}"


def report(w: Workload, runs: dict, cost: CostModel) -> None:
    """The workload's table, its target lines and the profile of our unlimited runs."""
    spec = w.spec
    options = models.parse_options({"epochs": 1, "batch_size": w.batch})
    probe = TrainingJob(JobInfo(0, "bench", w.name), spec, options, *w.data(w.batch))
    vanilla = probe.vanilla_peak_nbytes
    base = [m.samples_per_s for m in runs[("pytorch", None)]]
    repeats = len(base)
    print(f"\n## {w.name}: {cnn.describe(w.architecture)}, {spec.n_parameters():,} parameters (the same in "
          f"PyTorch), batch {w.batch}, Adam, float32, {w.iterations} timed iterations per run after one untimed, "
          f"{repeats} repeats; vanilla peak {vanilla:,} bytes, largest working set "
          f"{probe.min_working_set_nbytes:,} bytes ({probe.min_working_set_nbytes / vanilla:.0%})\n")
    rows = []
    for kind, fraction in configurations(w):
        ms = runs[(kind, fraction)]
        rates = [m.samples_per_s for m in ms]
        ratios = [m.samples_per_s / b for m, b in zip(ms, base)]
        mem = kind == "ours"
        rows.append([label(w, kind, fraction, ms[0].budget_nbytes, vanilla), f"{statistics.median(rates):,.0f}",
                     f"{min(rates):,.0f} to {max(rates):,.0f}",
                     "-" if not mem else f"{statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f})",
                     f"{ms[0].budget_nbytes:,}" if mem else "-", f"{max(m.peak_nbytes for m in ms):,}" if mem else "-",
                     f"{statistics.median(m.swapped_out_nbytes_per_it for m in ms) / MiB:.1f}" if mem else "-",
                     f"{statistics.median(m.recomputes_per_it for m in ms):.1f}" if mem else "-"])
    print(tabulate(rows, headers=["runtime", "samples/s (median)", "spread (min to max)", "ours / PyTorch",
                                  "budget bytes", "peak device bytes", "swapped out MiB / iteration",
                                  "recomputes / iteration"],
                   tablefmt="github", disable_numparse=True, colalign=("left",) + ("right",) * 7))
    targets(w, runs, base)
    profile(w, runs, cost)


def targets(w: Workload, runs: dict, base: list[float]) -> None:
    """The target lines: ours / PyTorch, unlimited (:data:`TARGET_RATIO`); our time per
    iteration at :data:`BUDGET_FRACTION` of the peak over the unlimited run's, repeat by repeat
    (:data:`BUDGET_SLOWDOWN`). Decided only where the whole spread lies on one side."""
    print()
    if w.name in TARGET_RATIO:
        target = TARGET_RATIO[w.name]
        ratios = [m.samples_per_s / b for m, b in zip(runs[("ours", None)], base)]
        print(f"Target: {w.name} samples/s at least {target}x PyTorch's, unlimited: ours / PyTorch "
              f"{statistics.median(ratios):.2f} (spread {min(ratios):.2f} to {max(ratios):.2f}): "
              f"{decided(min(ratios), max(ratios), target)}")
    if ("ours", BUDGET_FRACTION) in runs:
        slow = [b.wall_s_per_it / u.wall_s_per_it for b, u in zip(runs[("ours", BUDGET_FRACTION)], runs[("ours", None)])]
        verdict = decided(min(slow), max(slow), BUDGET_SLOWDOWN, higher_is_better=False)
        print(f"Target: {w.name} at {BUDGET_FRACTION:.0%} of the peak (at least its largest working set) at most "
              f"{BUDGET_SLOWDOWN}x the unlimited time per iteration: {statistics.median(slow):.2f}x (spread {min(slow):.2f} to {max(slow):.2f}): {verdict}")


def swaps_s(m: Measured, cost: CostModel) -> float:
    """What the cost model measured at start-up prices ``m``'s swaps at, seconds per iteration:
    the bytes out and in at its bandwidths, and each swap's latency and issue (the executor's
    bookkeeping: Note [Issue cost] in ``tensile_db.scheduler.cost``)."""
    return (m.swapped_out_nbytes_per_it / cost.d2h_bytes_per_s + m.swapped_in_nbytes_per_it / cost.h2d_bytes_per_s
            + m.swaps_per_it * (cost.latency_s + cost.issue_s))


def profile(w: Workload, runs: dict, cost: CostModel) -> None:
    """Where our time goes (unlimited budget): the op seconds per iteration of the run of median
    samples/s, grouped by op kind; then the ops' share of the wall time, per budget (medians), and
    under a budget what its swaps cost by the cost model (:func:`swaps_s`) against the unlimited
    run's time per iteration, where every copy is the executor's thread's own (``cpu`` with the
    kernels on every core): the least slowdown those swaps allow, whatever the bookkeeping."""
    ms = runs[("ours", None)]
    m = sorted(ms, key=lambda r: r.samples_per_s)[(len(ms) - 1) // 2]
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for name, seconds in m.op_s.items():
        by_kind[cnn.op_kind(name)][0] += seconds
        by_kind[cnn.op_kind(name)][1] += 1
    total = sum(s for s, _ in by_kind.values())
    rows, cumulative = [], 0.0
    for kind, (seconds, count) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        cumulative += seconds
        rows.append([kind, count, f"{1e3 * seconds / m.timed_iterations:.2f}", f"{seconds / total:.1%}",
                     f"{cumulative / total:.1%}"])
    print(f"\nProfile of tensile_db, {w.name}, unlimited budget: the run of median samples/s ({m.timed_iterations} "
          "timed iterations; op times as the executor measures them, around each op's arithmetic):\n")
    print(tabulate(rows, headers=["op kind", "ops per iteration", "ms per iteration", "share of op time",
                                  "cumulative"], tablefmt="github", disable_numparse=True,
                   colalign=("left", "right", "right", "right", "right")))
    print()
    for kind, fraction in configurations(w)[1:]:
        ms = runs[(kind, fraction)]
        wall = statistics.median(m.wall_s_per_it for m in ms)
        in_ops = statistics.median(sum(m.op_s.values()) / m.timed_iterations for m in ms)
        served = [m for m in ms if m.served_s_per_it is not None]
        steady = (f"; from the first iteration that ended with the planned pool serving (iteration "
                  f"{statistics.median(m.served_from for m in served):.0f}, median; the ones before run while "
                  f"the plans are made, the first of them under the reactive fallback): "
                  f"{1e3 * statistics.median(m.served_s_per_it for m in served):.1f} ms per iteration (median)"
                  if served else "")
        swaps = ""
        if fraction is not None and cost.inline_nbytes >= sys.maxsize:
            priced = statistics.median(swaps_s(m, cost) for m in ms)
            unlimited = statistics.median(m.wall_s_per_it for m in runs[("ours", None)])
            swaps = (f". Its swaps ({statistics.median(m.swaps_per_it for m in ms):.1f} an iteration, "
                     f"{statistics.median(m.swapped_out_nbytes_per_it for m in ms) / MiB:.1f} MiB out and "
                     f"{statistics.median(m.swapped_in_nbytes_per_it for m in ms) / MiB:.1f} MiB in) cost "
                     f"{1e3 * priced:.2f} ms an iteration by the cost model measured at start-up, all on the "
                     f"executor's thread: {(unlimited + priced) / unlimited:.2f}x the unlimited time per iteration "
                     f"with them alone")
            bounds = [m.bound_s_per_it for m in ms if m.bound_s_per_it is not None]
            if bounds:
                least = statistics.median(bounds)
                swaps += (f"; no plan of swaps and recomputes within the budget adds less than {1e3 * least:.2f} ms "
                          f"an iteration by that cost model (the lower bound of docs/bound.md on the run's "
                          f"measured op times, median): {(unlimited + least) / unlimited:.2f}x")
        print(f"- {'unlimited' if fraction is None else f'{fraction:.0%} budget'}: {1e3 * wall:.1f} ms per iteration "
              f"(median), of which {1e3 * in_ops:.1f} ms in the ops' arithmetic ({in_ops / wall:.0%}); the rest is "
              f"the executor, memory manager, scheduler, swap waits and recomputes{steady}{swaps}")


def main() -> None:
    workers.with_blas_environment()                           # as the coordinator runs its kernels
    fix_mmap_threshold()                                      # and allocates its host copies
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of every configuration, interleaved")
    parser.add_argument("--quick", action="store_true", help="a quarter of the iterations per run")
    args = parser.parse_args()
    started = time.perf_counter()
    threads = workers.count()
    probe = MemoryManager(CpuDevice(), 64 * MiB)
    cost = measure_bandwidth(probe.device, probe.engine)
    probe.close()
    loads = workloads(args.quick)
    data = {w.name: w.arrays() for w in loads}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as apart:
        def theirs(w: Workload, samples: int | None = None) -> Measured:
            return apart.submit(pytorch_apart, w.name, args.quick, threads, samples).result()

        for w in loads:                                        # warm-up: imports, first-touch of the kernels
            theirs(w, 2 * w.batch)
            ours(w, data[w.name][0][:2 * w.batch], data[w.name][1][:2 * w.batch], None, cost)
        planning.shared().start().result()     # the planning process, ready, as the coordinator's is
        runs: dict[str, dict] = {w.name: collections.defaultdict(list) for w in loads}
        for r in range(args.repeats):
            for w in loads:
                order = configurations(w)
                for kind, fraction in order if r % 2 == 0 else order[::-1]:
                    m = theirs(w) if kind == "pytorch" else ours(w, *data[w.name], fraction, cost)
                    runs[w.name][(kind, fraction)].append(m)
    print(f"# Training throughput on {cnn.machine()}\n")
    kernels = (f"float32 convolutions and dense products of {onednn.MATMUL_MIN_MACS:,} multiply-adds or more run on "
               f"oneDNN's primitives, on that many OpenMP threads, and so do Adam's steps and the relu's backward "
               f"passes of {fused.PARALLEL_MIN_NELEMS:,} elements or more"
               if onednn.enabled() else
               "float32 convolutions are lowered to matrix products, their batch chunks on that many threads, each "
               "product on one")
    print(f"PyTorch runs in a process of its own with torch.set_num_threads({threads}), the threads of the BLAS "
          f"behind our matrix products (our {kernels}; our other elementwise kernels run on one thread, or split over the kernel workers from "
          f"{workers.SPLIT_NELEMS:,} elements). Our runs: "
          "the coordinator's executor, with its BLAS environment, "
          f"policy {POLICY}, swaps to host memory at {cost.d2h_bytes_per_s / 1e9:.1f} GB/s out and "
          f"{cost.h2d_bytes_per_s / 1e9:.1f} GB/s in, {cost.issue_s * 1e6:.1f} us of the executor's thread to issue "
          f"each, {inline_copies(cost)} on that thread (measured once). Wall-clock times: "
          "noisy where other "
          "work shares the machine; hence medians and spreads over interleaved repeats.")
    for w in loads:
        report(w, runs[w.name], cost)
    print(f"\nBenchmark took {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
