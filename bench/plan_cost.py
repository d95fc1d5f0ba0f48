"""Calibration of the planning cost model: the planners' counted work against their wall time.

On the simulated device a plan takes effect only after its *modelled* planning time has passed on
the virtual clock (Note [Planning cost model] in :mod:`tensile_db.scheduler.work`). This benchmark
makes every plan that ``bench/paper.py``'s policies make of the paper workloads' combined timelines
(one ResNet-50; four ResNet-50; the mixed four models, each at the iterations per period the
executor gives them) at 70%, 50% and 35% of the timeline's peak, with the simulated H100's op
times, and prints for each its wall time on this machine (the least of ``--repeats``), its counted
work and the modelled seconds; then a fit of the per-unit costs by non-negative least squares on
the relative error (what the constants in :mod:`tensile_db.scheduler.work` come from) and the
spread of modelled over measured seconds under the constants in force.

    python bench/plan_cost.py [--repeats 2] [--policies tensile checkpoint ...] [--quick]

Wall times are this machine's: noisy on a shared machine, hence the least of the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).parent))
from common import PLANNED  # noqa: E402  (beside this one)
from paper import make_jobs  # noqa: E402  (a benchmark beside this one)
from tensile_db.memory.manager import MemoryManager  # noqa: E402
from tensile_db.runtime.simulated import SimDevice  # noqa: E402
from tensile_db.scheduler.cost import measure_bandwidth  # noqa: E402
from tensile_db.scheduler.timeline import JobTrace, Timeline  # noqa: E402
from tensile_db.scheduler.trace import AccessSequence  # noqa: E402
from tensile_db.scheduler.work import PLAN_OVERHEAD_S, SECONDS_PER_UNIT, PlanWork  # noqa: E402
from tensile_db.scheduler.worker import PLANNERS  # noqa: E402

#: workload -> iterations per period of each job (as the executor paces the paper's jobs)
WORKLOADS = {"1x resnet50": [1], "4x resnet50": [1, 1, 1, 1], "mixed": [1, 2, 3, 2]}
FRACTIONS = (0.70, 0.50, 0.35)
POLICIES = PLANNED


def traces(workload: str, device: SimDevice) -> list[JobTrace]:
    """The jobs of ``workload`` on a timeline, their op times the profile's (no jitter), spread in
    phase as the executor admits them one after another."""
    out = []
    jobs = make_jobs(workload, device)
    for i, (job, repeats) in enumerate(zip(jobs, WORKLOADS[workload])):
        seq = AccessSequence(job.program)
        seq.times_s[:] = [device.op_seconds(op) for op in job.program.ops]
        seq.iterations = 1
        out.append(JobTrace(i, seq, phase=0, order=i, repeats=repeats))
    return out


def measure(policy: str, workload: str, fraction: float, repeats: int, device, cost) -> tuple[float, PlanWork, int]:
    """(least wall seconds, the work counted, decisions) of one plan made ``repeats`` times."""
    best, work, decisions = float("inf"), None, 0
    for _ in range(repeats):
        timeline = Timeline(traces(workload, device))          # its construction is part of the work
        target = int(timeline.vanilla_peak_nbytes() * fraction)
        start = time.perf_counter()
        timeline = Timeline(list(timeline.traces.values()))
        plan = PLANNERS[policy](timeline, cost, target, None)
        seconds = time.perf_counter() - start
        if seconds < best:
            best, work, decisions = seconds, timeline.work, len(plan.decisions)
    return best, work, decisions


def fit(rows: list[tuple[float, PlanWork]]) -> dict[str, float]:
    """Per-unit seconds minimising the squared *relative* error of the modelled seconds, >= 0
    (scipy's NNLS); the overhead is held at :data:`PLAN_OVERHEAD_S`."""
    from scipy.optimize import nnls

    units = list(SECONDS_PER_UNIT)
    a = np.array([[w.counts()[u] / s for u in units] for s, w in rows])
    b = np.array([(s - PLAN_OVERHEAD_S) / s for s, _ in rows])
    x, _ = nnls(a, b)
    return dict(zip(units, x.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--quick", action="store_true", help="one ResNet-50 and four ResNet-50 only")
    args = parser.parse_args()
    device = SimDevice("h100")
    cost = measure_bandwidth(device, MemoryManager(device, 1 << 30).engine)
    workloads = [w for w in WORKLOADS if not (args.quick and w == "mixed")]
    table, rows = [], []
    for workload in workloads:
        for fraction in FRACTIONS:
            for policy in args.policies:
                seconds, work, decisions = measure(policy, workload, fraction, args.repeats, device, cost)
                rows.append((seconds, work))
                table.append([workload, f"{fraction:.0%}", policy, decisions, f"{seconds:.3f}",
                              f"{work.seconds():.3f}", f"{work.seconds() / seconds:.2f}",
                              *work.counts().values()])
                print(*table[-1], sep=" | ", flush=True, file=sys.stderr)
    print("# Planning cost model: counted work against wall time (this machine)\n")
    print(tabulate(table, ["workload", "target", "policy", "decisions", "wall s", "modelled s", "modelled / wall",
                           *PlanWork().counts()], tablefmt="github"))
    ratios = [w.seconds() / s for s, w in rows]
    print(f"\nModelled / wall under the constants in force: median {statistics.median(ratios):.2f}, "
          f"range [{min(ratios):.2f}, {max(ratios):.2f}] over {len(rows)} plans")
    fitted = fit(rows)
    print("\nRefitted seconds per unit (non-negative least squares on the relative error):\n")
    print(tabulate([[u, f"{SECONDS_PER_UNIT[u]:.3g}", f"{fitted[u]:.3g}"] for u in SECONDS_PER_UNIT],
                   ["unit", "in force", "refitted"], tablefmt="github"))


if __name__ == "__main__":
    main()
