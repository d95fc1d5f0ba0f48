"""The planned pool's benchmark: arena bytes of lifetime-planned offsets against the
lower bound, the general (best-fit) pool and the pool a CuPy user gets, and the cost of one
allocation.

Two kinds of trace:

- *single job*: one training iteration of one model (:func:`tensile_db.scheduler.allocations.allocations_of`)
  at two batch sizes, with and without a swap schedule (the tensile planner at 50% of the job's
  unscheduled peak). The models are the scheduler benchmark's uniform MLPs (every hidden layer
  the same width), two MLPs with mixed widths (an hourglass 2048-64-1024-32-512-128 with dropout
  after the wide layers, a funnel 2048 down to 64), and the convolutional networks of
  :mod:`cnn` on 3x32x32 images (a ResNet-50 and a VGG-16 at an eighth of their channels, the
  small residual CNN of the throughput benchmark), whose tensors are of mixed sizes (activations,
  im2col workspaces, per-channel statistics, argmax masks);
- *recorded*: the period the planned pool itself recorded and installed in a real executor run on
  ``cpu`` of three concurrent jobs of different models (so mixed sizes), unlimited or under
  tensile at 50% of their combined peak, until the jobs complete (40 iterations each; batch 256,
  the CNNs 16), the pool has installed a plan over all three, or ``RECORD_LIMIT_S`` seconds have
  passed; the largest-job-count plan of the run is taken, and a trace whose plan covers fewer
  jobs says so. Each
  recorded workload runs ``RECORD_REPEATS`` times (the schedule, and so the trace, depends on
  measured op times), one row per run.

Per trace:

- max live bytes: the lower bound on any arena;
- planned arena: best fit, largest first alone (the paper's order), and what the runtime installs
  (:func:`~tensile_db.memory.lifetimes.plan_smallest` with the planned pool's search time), best fit
  and first fit;
- the general pool's arena: the highest address the best-fit allocator touches serving the trace
  (its high-water mark of *allocated* bytes is max live, whatever the offsets; the address is
  what it must reserve);
- planned below general: 1 - planned arena / general pool's arena;
- CuPy pool: the bytes CuPy's default pool (``cupy.cuda.MemoryPool``) holds from the device at
  its peak serving the trace, repeated over several iterations, from a simulation of its policy
  (:mod:`cupy_pool`: 512-byte units, the smallest free chunk that fits, split, merged with free
  neighbours of the same cudaMalloc'ed segment, else a new segment, none given back);
- planned below CuPy: 1 - planned arena / CuPy pool;
- ns per allocation: the runtime's planned path (:meth:`PlannedPool.lookup` checking the
  recorded sequence, plus :meth:`PlannedPool.freed`) against the general pool's allocate + free,
  over the same sequence of events.

After the table, PASS/FAIL for the planned pool's targets: planned <= 1.05 x max live on every trace;
>= 10% below the general pool on the mixed-size traces, and on the CNN traces alone; >= 10% below
CuPy's default pool on the CNN traces; planned allocation >= 5x cheaper. A trace recorded several
times whose runs fall on both sides of a target leaves it not decided.

It draws the packing (:func:`draw_arena`: offset against event, one rectangle per lifetime
segment) of each recorded trace, of each mixed-size model at the largest batch with the swap
schedule, and of any trace over 1.05 x max live, to ``bench/out/pool_arena_*.png`` (outputs,
ignored by git).

    python bench/pool.py

Figures are of the machine named in the first line (``cpu``); arena bytes do not depend on it,
nanoseconds do.
"""

from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tabulate import tabulate

import cnn
from cupy_pool import replay_cupy_pool
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.memory import planned
from tensile_db.memory.arena import ArenaAllocator
from tensile_db.memory.lifetimes import (
    Allocation,
    PoolPlan,
    max_live_nbytes,
    plan_offsets,
    plan_smallest,
    replay_general_pool,
)
from tensile_db.memory.manager import MemoryManager
from tensile_db.memory.planned import PlannedPool
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions, parse_architecture
from tensile_db.scheduler.allocations import allocations_of
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.planners import plan_tensile
from tensile_db.scheduler.timeline import JobTrace, Timeline
from tensile_db.scheduler.trace import AccessSequence

MODELS = {
    "deep 8x256 relu": Architecture(tuple([Layer(256, "relu")] * 8)),
    "wide 4x512 relu dropout 0.1": Architecture(tuple([Layer(512, "relu", 0.1)] * 4)),
    "tanh 6x256": Architecture(tuple([Layer(256, "tanh")] * 6)),
    "hourglass 2048-64-1024-32-512-128 relu dropout 0.1": Architecture((
        Layer(2048, "relu", 0.1), Layer(64), Layer(1024, "relu", 0.1), Layer(32), Layer(512, "relu", 0.1), Layer(128))),
    "funnel 2048-1024-512-256-128-64 relu": Architecture(tuple(Layer(w) for w in (2048, 1024, 512, 256, 128, 64))),
    "resnet50 width 0.125 on 3x32x32": parse_architecture(cnn.RESNET),
    "vgg16 width 0.125 on 3x32x32": parse_architecture(cnn.VGG),
    "small residual CNN on 3x32x32": parse_architecture(cnn.SMALL_CNN),
}
MLP_FEATURES = 64                  # values per row of the MLPs' data
BATCHES = (256, 1024)              # of the MLPs
CNN_BATCHES = (16, 64)
SCHEDULES = ("none", "swaps at 50%")
#: recorded workloads: three concurrent jobs each (model names of MODELS), their batch and iterations per job
RECORDED = {
    "deep + wide + tanh": (["deep 8x256 relu", "wide 4x512 relu dropout 0.1", "tanh 6x256"], 256, 40),
    "hourglass + funnel + deep": (["hourglass 2048-64-1024-32-512-128 relu dropout 0.1",
                                   "funnel 2048-1024-512-256-128-64 relu", "deep 8x256 relu"], 256, 40),
    "resnet + vgg + small CNN": (["resnet50 width 0.125 on 3x32x32", "vgg16 width 0.125 on 3x32x32",
                                  "small residual CNN on 3x32x32"], 16, 40),
}
RECORDED_BUDGETS = {"unlimited": 8.0, "tensile at 50%": 0.5}
RECORD_REPEATS = 2
#: most seconds of one recorded run
RECORD_LIMIT_S = 60.0
COST = CostModel(1e10, 1e10)      # only the choice of swaps depends on it, not the trace's shape
OUT = Path(__file__).parent / "out"
KIB, MIB = 1 << 10, 1 << 20
#: colours of the tensor kinds in :func:`draw_arena`
KIND_COLORS = {"input": "tab:gray", "weight": "tab:blue", "optimizer_state": "tab:purple",
               "activation": "tab:orange", "gradient": "tab:green", "workspace": "tab:brown"}


@dataclass
class TraceResult:
    """One trace's measures: bytes, arenas as ratios to max live, ns per allocation."""

    model: str
    sizes: str                       # "uniform" or "mixed" tensor sizes
    cnn: bool                        # of convolutional networks
    batch: int
    schedule: str
    n_allocations: int
    max_live_nbytes: int
    largest_bf: float
    best_bf: float
    best_ff: float
    general: float
    cupy: float
    lookup_ns: float
    general_ns: float

    @property
    def below_general(self) -> float:
        return 1 - self.best_bf / self.general

    @property
    def below_cupy(self) -> float:
        return 1 - self.best_bf / self.cupy

    def row(self) -> list:
        return [self.model, self.sizes, self.batch, self.schedule, self.n_allocations, self.max_live_nbytes,
                self.largest_bf, self.best_bf, self.best_ff, self.general, self.below_general,
                self.cupy, self.below_cupy, self.lookup_ns, self.general_ns]


HEADERS = ["trace", "sizes", "batch", "schedule", "allocations", "max live bytes",
           "best fit, largest first / max live", "planned (best fit) / max live",
           "planned (first fit) / max live", "general pool / max live", "planned below general",
           "CuPy pool / max live", "planned below CuPy", "planned ns", "general pool ns"]


def events_of(allocs: list[Allocation]) -> list[tuple[str, tuple, int]]:
    """The trace as a linear sequence of ("a" | "f", key, bytes), one key per lifetime segment
    (keys shaped as the manager's: job, name, position)."""
    timed = []
    for a in allocs:
        for i, (first, last) in enumerate(a.segments):
            key = (0, f"{a.key}/{i}", first)
            timed.append((first, 0, ("a", key, a.nbytes)))
            timed.append((last, 1, ("f", key, a.nbytes)))
    return [e for *_, e in sorted(timed, key=lambda t: (t[0], t[1]))]


def ns_per_call(allocs: list[Allocation], repeats: int = 20) -> tuple[float, float]:
    """(planned, general) nanoseconds per allocation, its free included, over the trace's events:
    a planned pool serving the recorded sequence against the best-fit general pool."""
    events = events_of(allocs)
    n_allocations = sum(kind == "a" for kind, _, _ in events)
    live = {(0, "always live", 0): 512}
    pool = PlannedPool(lambda plan, keys, reserve: 0, lambda: None)
    pool.boundary(lambda: (live, 0))
    for kind, key, nbytes in events:                 # record one period
        pool.allocated(key, nbytes) if kind == "a" else pool.freed(key, nbytes)
    pool.boundary(lambda: (live, 0))
    pool.wait_for_plan()
    pool.boundary(lambda: (live, 0))                           # serving from here
    start = time.perf_counter_ns()
    for _ in range(repeats):
        for kind, key, nbytes in events:
            pool.lookup(key) if kind == "a" else pool.freed(key, nbytes)
        pool.boundary(lambda: (live, 0))
    planned_ns = (time.perf_counter_ns() - start) / (repeats * n_allocations)
    assert pool.mismatches == 0 and pool.planned_allocations == repeats * n_allocations
    pool.close()
    arena = ArenaAllocator(4 * sum(a.nbytes for a in allocs))
    start = time.perf_counter_ns()
    for _ in range(repeats):
        blocks = {}
        for kind, key, nbytes in events:
            if kind == "a":
                blocks[key] = arena.allocate(nbytes)
            else:
                arena.free(blocks.pop(key))
    general_ns = (time.perf_counter_ns() - start) / (repeats * n_allocations)
    return planned_ns, general_ns


def sizes_of(arch: Architecture) -> str:
    """"uniform" if the layers are dense layers all of the same width, else "mixed"."""
    dense = all(isinstance(l, Layer) for l in arch.layers)
    return "uniform" if dense and len({l.units for l in arch.layers}) == 1 else "mixed"


def is_cnn(arch: Architecture) -> bool:
    return arch.input_shape is not None and len(arch.input_shape) == 3


def spec_of(arch: Architecture) -> ModelSpec:
    return ModelSpec(arch, arch.n_features or MLP_FEATURES, 10, "classification")


def measure(name: str, sizes: str, cnn_trace: bool, batch: int, schedule: str, allocs) -> tuple[TraceResult, PoolPlan]:
    """The table's measures of one trace, and the plan the runtime would install."""
    bound = max_live_nbytes(allocs)
    best_bf = plan_smallest(allocs, "best_fit", planned.SEARCH_S)
    _, general_nbytes = replay_general_pool(allocs)
    planned_ns, general_ns = ns_per_call(allocs)
    result = TraceResult(name, sizes, cnn_trace, batch, schedule, len(allocs), bound,
                         plan_offsets(allocs, "best_fit", "largest").arena_nbytes / bound,
                         best_bf.arena_nbytes / bound,
                         plan_smallest(allocs, "first_fit", planned.SEARCH_S).arena_nbytes / bound,
                         general_nbytes / bound, replay_cupy_pool(allocs) / bound, planned_ns, general_ns)
    return result, best_bf


def draw_arena(allocs, plan: PoolPlan, path: Path, title: str, kinds: dict | None = None) -> None:
    """Draw the packing ``plan`` of ``allocs`` as a PNG: one rectangle per lifetime segment (x:
    events, y: offset), dashed lines at the planned arena and at max live. Colour by tensor kind
    (``kinds``: allocation key -> kind) if given, else by a stable hash of the key."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    unit, unit_name = (MIB, "MiB") if plan.arena_nbytes >= MIB else (KIB, "KiB")
    palette = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(12, 5.5))
    for a in allocs:
        color = KIND_COLORS.get(kinds[a.key]) if kinds else palette[zlib.crc32(repr(a.key).encode()) % len(palette)]
        for first, last in a.segments:
            ax.add_patch(Rectangle((first, plan.offsets[a.key] / unit), last - first + 1, a.nbytes / unit,
                                   facecolor=color, edgecolor="black", linewidth=0.3, alpha=0.85))
    bound = max_live_nbytes(allocs)
    ax.axhline(plan.arena_nbytes / unit, color="crimson", linestyle="--", linewidth=2.5,
               label=f"planned arena ({plan.strategy})")
    ax.axhline(bound / unit, color="black", linestyle="--", linewidth=1, label="max live = lower bound")
    handles = ax.get_legend_handles_labels()[0]
    if kinds:
        handles += [Patch(color=KIND_COLORS[k], label=k) for k in sorted({kinds[a.key] for a in allocs})]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_xlim(0, max(last for a in allocs for _, last in a.segments) + 1)
    ax.set_ylim(0, 1.08 * max(plan.arena_nbytes, bound) / unit)
    ax.set_xlabel("event (allocation or free of the period)" if kinds and len(next(iter(kinds))) == 3
                  else "event (op of the iteration)")
    ax.set_ylabel(f"arena offset ({unit_name})")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def checks(results: list[TraceResult]) -> list[str]:
    """One line per target: PASS when every trace meets it, FAIL when a trace misses it in every
    run, else not decided (a recorded trace that met it in one run and missed it in another);
    naming the traces that do not meet it."""
    def line(text: str, meets, of: list[TraceResult]) -> str:
        runs: dict[tuple, list[bool]] = {}
        for r in of:      # runs of one recorded workload are one trace, whichever jobs their plan covers
            runs.setdefault((r.model.split(" (plan over")[0], r.batch, r.schedule), []).append(meets(r))
        missed = [k for k, v in runs.items() if not any(v)]
        split = [k for k, v in runs.items() if any(v) and not all(v)]
        verdict = "FAIL" if missed else "not decided" if split else "PASS"
        names = "".join(f"\n    {m} / {b} / {s}{' (in some runs)' if (m, b, s) in split else ''}"
                        for m, b, s in missed + split)
        return f"- {text}: {verdict} ({len(runs) - len(missed) - len(split)} of {len(runs)} traces meet it){names}"

    mixed = [r for r in results if r.sizes == "mixed"]
    convolutional = [r for r in results if r.cnn]
    return [line("planned <= 1.05 x max live, every trace", lambda r: r.best_bf <= 1.05, results),
            line("planned >= 10% below the general pool, mixed-size traces", lambda r: r.below_general >= 0.10, mixed),
            line("planned >= 10% below the general pool, CNN traces", lambda r: r.below_general >= 0.10,
                 convolutional),
            line("planned >= 10% below CuPy's default pool, CNN traces", lambda r: r.below_cupy >= 0.10,
                 convolutional),
            line("planned allocation >= 5x cheaper than the general pool's, every trace",
                 lambda r: r.general_ns >= 5 * r.lookup_ns, results)]


def should_draw(r: TraceResult) -> bool:
    """Draw the mixed-size models at the largest batch with the swap schedule, and any trace whose
    plan misses the 1.05 x max live target."""
    largest = max(CNN_BATCHES if r.cnn else BATCHES)
    return (r.sizes == "mixed" and r.batch == largest and r.schedule == SCHEDULES[-1]) or r.best_bf > 1.05


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def single_job_traces():
    """(name, sizes, cnn, batch, schedule, allocations, key -> kind) of every single-job trace."""
    for name, arch in MODELS.items():
        spec = spec_of(arch)
        for batch in CNN_BATCHES if is_cnn(arch) else BATCHES:
            program = build_training_program(spec, TrainOptions(), batch)
            seq = AccessSequence(program)
            for p in range(len(program.ops)):
                seq.record(p, 1e-3)
            seq.end_iteration()
            timeline = Timeline([JobTrace(0, seq)])
            for schedule in SCHEDULES:
                decisions = [] if schedule == "none" else \
                    plan_tensile(timeline, COST, timeline.vanilla_peak_nbytes() // 2).decisions
                allocs = allocations_of(program, decisions)
                yield name, sizes_of(arch), is_cnn(arch), batch, schedule, allocs, \
                    {a.key: program.slots[a.key[0]].kind.value for a in allocs}


def recorded_trace(models: list[str], fraction: float, batch: int = 256, iterations: int = 40,
                   limit_s: float = RECORD_LIMIT_S):
    """Run three concurrent jobs on ``cpu`` (tensile policy) under ``fraction`` of their combined
    unscheduled peak until they complete ``iterations`` each, the planned pool installs a plan
    over all of them, or ``limit_s`` seconds pass, whichever comes first. Returns the allocations
    and plan of the installed plan that covers the most jobs, key -> kind, and how many jobs that
    plan covers; None if none was installed."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, batch * 4).astype(np.int32)
    options = TrainOptions(epochs=iterations // 4, batch_size=batch, optimizer="adam", lr=1e-3)
    jobs = []
    for m in models:
        spec = spec_of(MODELS[m])
        x = rng.normal(size=(batch * 4, spec.n_features)).astype(np.float32)
        jobs.append(TrainingJob(JobInfo(0, "bench", m), spec, options, x, y))
    budget = int(fraction * sum(j.vanilla_peak_nbytes for j in jobs))
    manager = MemoryManager(CpuDevice(), max(budget, max(j.min_working_set_nbytes for j in jobs)))
    executor = Executor(manager, policy="tensile", cost=COST)
    executor.start()
    deadline = time.perf_counter() + limit_s
    try:
        for job in jobs:
            executor.submit(job)
        while time.perf_counter() < deadline and any(j.finished_at is None for j in jobs):
            history = manager.pool.history
            if history and len({a.key[0] for a in history[-1][0]}) == len(jobs):
                break
            time.sleep(0.02)
    finally:
        executor.stop()
    if not manager.pool.history:
        return None
    allocs, plan = max(manager.pool.history, key=lambda h: len({a.key[0] for a in h[0]}))
    kinds = {a.key: next(j for j in jobs if j.id == a.key[0]).program.slots[a.key[1]].kind.value for a in allocs}
    return allocs, plan, kinds, len({a.key[0] for a in allocs})


def main() -> None:
    started = time.perf_counter()
    print(f"# Planned pool against the general (best-fit) pool and CuPy's default pool (simulated), on {cnn.machine()}\n")
    results, drawn = [], []
    for name, sizes, convolutional, batch, schedule, allocs, kinds in single_job_traces():
        result, plan = measure(name, sizes, convolutional, batch, schedule, allocs)
        results.append(result)
        if should_draw(result):
            drawn.append(draw(result, allocs, plan, kinds))
    for repeat in range(RECORD_REPEATS):          # interleaved: every recorded workload once per repeat
        for workload, (models, batch, iterations) in RECORDED.items():
            convolutional = all(is_cnn(MODELS[m]) for m in models)
            for schedule, fraction in RECORDED_BUDGETS.items():
                recorded = recorded_trace(models, fraction, batch, iterations)
                if recorded is None:
                    print(f"{workload}, {schedule}, run {repeat + 1}: no plan was installed")
                    continue
                allocs, plan, kinds, covered = recorded
                name = f"recorded: {workload}" + (f" (plan over {covered} of {len(models)} jobs)"
                                                  if covered < len(models) else "")
                result, _ = measure(name, "mixed", convolutional, batch, schedule, allocs)
                results.append(result)
                if repeat == 0:
                    drawn.append(draw(result, allocs, plan, kinds))
    print(tabulate([r.row() for r in results], headers=HEADERS, tablefmt="github", floatfmt=".3f", intfmt=","))
    print("\nTargets of the planned pool:")
    print("\n".join(checks(results)))
    print("\n" + "\n".join(f"Wrote {p.relative_to(Path.cwd()) if p.is_relative_to(Path.cwd()) else p}" for p in drawn))
    print(f"\nBenchmark took {time.perf_counter() - started:.0f} s.")


def draw(result: TraceResult, allocs, plan: PoolPlan, kinds: dict) -> Path:
    path = OUT / f"pool_arena_{slug(result.model)}_{result.batch}_{slug(result.schedule)}.png"
    draw_arena(allocs, plan, path, f"{result.model}, batch {result.batch}, {result.schedule}\n{plan.strategy}: "
               f"arena {result.best_bf:.3f} x max live, {result.below_general:.1%} below the general pool", kinds)
    return path


if __name__ == "__main__":
    main()
