"""Fair sharing benchmark: a small job's wall time alone and beside long programs.

A small MLP (64 features, one hidden layer of 64, 5 epochs of 320 rows in batches of 32: 50
iterations) trains alone, beside a 100-dense-layer model and beside a 400-dense-layer model (64
units per layer). The long model is submitted first and trains for the whole measurement: the
small one is submitted once the long one has run a few iterations (its op times measured and
settled), and the long one is cancelled once the small one is done. The executor, memory manager
and scheduler are driven directly (no PostgreSQL), on ``cpu``, with a budget far above the jobs'
peaks so that no tensor is swapped: what is measured is how the device is shared.

Printed: per configuration the small job's wall time (submit to done) as the median over the
repeats with [min, max], and its slowdown against alone (median over median, and the range from
the extremes); a configuration whose times overlap those alone is "not decided". Then whether the
small job's time depends on the long program's length: beside 400 layers against beside 100.
The configurations are interleaved within each repeat.

    python bench/fairness.py [--repeats 3] [--policy tensile]

Times are wall-clock: on a machine shared with other work they are noisy; use --repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from tabulate import tabulate

from common import spread
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import model as models
from tensile_db.runtime.device import CpuDevice
from tensile_db.scheduler.cost import CostModel, measure_bandwidth

FEATURES, CLASSES, WIDTH = 64, 2, 64
SMALL_ROWS, BATCH, SMALL_EPOCHS = 320, 32, 5
LONG_LAYERS = (100, 400)             # the long programs, in dense layers
LONG_WARMUP_ITERATIONS = 4           # iterations of the long job before the small one arrives
BUDGET_HEADROOM = 8                  # the budget: this many times the jobs' unscheduled peaks
TIMEOUT_S = 120.0                    # a small job not done by then is reported as such


def make_job(name: str, layers: int, epochs: int, rows: int, seed: int) -> TrainingJob:
    """A classifier of ``layers`` dense layers of WIDTH units on ``rows`` random rows."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    spec = models.ModelSpec(models.parse_architecture({"layers": [{"dense": WIDTH}] * layers}),
                            FEATURES, CLASSES, "classification")
    options = models.parse_options({"epochs": epochs, "batch_size": BATCH, "seed": seed})
    return TrainingJob(JobInfo(0, "bench", name), spec, options, x, y)


def run(beside: int | None, policy: str, cost: CostModel) -> float:
    """Seconds from submitting the small job to its completion, alone (``beside`` None) or beside
    a model of ``beside`` dense layers that keeps training meanwhile. Raises RuntimeError if the
    small job fails or is not done within TIMEOUT_S."""
    small = make_job("small", 1, SMALL_EPOCHS, SMALL_ROWS, seed=1)
    long_job = make_job(f"{beside} layers", beside, 100_000, 4 * BATCH, seed=2) if beside else None
    jobs = [small] + ([long_job] if long_job else [])
    budget = BUDGET_HEADROOM * sum(j.vanilla_peak_nbytes for j in jobs)
    executor = Executor(MemoryManager(CpuDevice(), budget), policy=policy, cost=cost)
    executor.start()
    try:
        if long_job is not None:
            executor.submit(long_job)
            while long_job.iterations < LONG_WARMUP_ITERATIONS:
                if long_job.error is not None:
                    raise RuntimeError(f"the long job failed: {long_job.error!r}")
                time.sleep(0.001)
        start = time.perf_counter()
        executor.submit(small)
        while (event := small.events.get(timeout=TIMEOUT_S))[0] == "progress":
            pass
        seconds = time.perf_counter() - start
        if event[0] != "done":
            raise RuntimeError(f"the small job failed: {event[1]!r}")
        return seconds
    finally:
        executor.stop()


def compare(slow: list[float], fast: list[float]) -> tuple[str, str]:
    """(ratio of medians with [min ratio, max ratio], verdict) of ``slow`` against ``fast``."""
    ratio = statistics.median(slow) / statistics.median(fast)
    low, high = min(slow) / max(fast), max(slow) / min(fast)
    if low > 1:
        verdict = "slower (decided)"
    elif high < 1:
        verdict = "faster (decided)"
    else:
        verdict = "not decided"
    return f"{ratio:.2f}x [{low:.2f}, {high:.2f}]", verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policy", default="tensile")
    args = parser.parse_args()
    probe = MemoryManager(CpuDevice(), 1 << 20)
    cost = measure_bandwidth(probe.device, probe.engine)     # measured once, shared by every run
    probe.close()
    configs: list[int | None] = [None, *LONG_LAYERS]
    times: dict[int | None, list[float]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for beside in configs:
            times[beside].append(run(beside, args.policy, cost))
    print(f"# Fair sharing on cpu ({os.cpu_count()} CPU cores; wall-clock times, noisy when other "
          f"work shares the machine), policy {args.policy}, {args.repeats} repeats interleaved\n")
    print(f"Small job: {FEATURES} features, one hidden layer of {WIDTH}, {SMALL_EPOCHS} epochs of "
          f"{SMALL_ROWS} rows in batches of {BATCH}. Long jobs: dense layers of {WIDTH} units, "
          f"training throughout.\n")
    rows = []
    for beside in configs:
        ratio, verdict = compare(times[beside], times[None]) if beside else ("1.00x", "-")
        rows.append(["alone" if beside is None else f"beside {beside} layers", spread(times[beside]), ratio, verdict])
    print(tabulate(rows, headers=["small job", "time s, median [min, max]", "slowdown vs alone", "difference"],
                   tablefmt="github"))
    ratio, verdict = compare(times[LONG_LAYERS[-1]], times[LONG_LAYERS[0]])
    print(f"\nThe small job beside {LONG_LAYERS[-1]} layers against beside {LONG_LAYERS[0]} layers: "
          f"{ratio}, {verdict}; a job's progress should not depend on the length of the other "
          f"programs.")


if __name__ == "__main__":
    main()
