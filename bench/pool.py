"""The planned pool's benchmark (issue 4, first part): arena bytes of lifetime-planned offsets
against the lower bound and the general (best-fit) pool, and the cost of one allocation.

For MLPs of the scheduler benchmark at two batch sizes, with and without a swap schedule (the
tensile planner at 50% of the job's unscheduled peak), on the allocation trace of one training
iteration (:func:`tensile_db.memory.pool.allocations_of`):

- max live bytes: the lower bound on any arena;
- planned arena, best fit and first fit, largest first (the paper's order) and the smallest over
  the orders tried;
- the general pool's arena: the highest address the best-fit allocator touches serving the trace;
- ns per allocation: a planned lookup (a dict) against the general pool's allocate + free.

    python bench/pool.py
"""

from __future__ import annotations

import time

from tabulate import tabulate

from tensile_db.memory.arena import ArenaAllocator
from tensile_db.memory.pool import allocations_of, max_live_nbytes, plan_offsets, plan_smallest, replay_general_pool
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions
from tensile_db.runtime.program import build_training_program
from tensile_db.scheduler.cost import CostModel
from tensile_db.scheduler.planners import plan_tensile
from tensile_db.scheduler.timeline import JobTrace, Timeline
from tensile_db.scheduler.trace import AccessSequence

MODELS = {
    "deep 8x256 relu": Architecture(tuple([Layer(256, "relu")] * 8)),
    "wide 4x512 relu dropout 0.1": Architecture(tuple([Layer(512, "relu", 0.1)] * 4)),
    "tanh 6x256": Architecture(tuple([Layer(256, "tanh")] * 6)),
}
BATCHES = (256, 1024)
COST = CostModel(1e10, 1e10)      # only the choice of swaps depends on it, not the trace's shape


def ns_per_call(allocs, plan, repeats: int = 20) -> tuple[float, float]:
    """(planned lookup, general pool allocate + free), nanoseconds per allocation."""
    keys = [a.key for a in allocs]
    sizes = [a.nbytes for a in allocs]
    offsets = plan.offsets
    start = time.perf_counter_ns()
    for _ in range(repeats):
        for k in keys:
            offsets[k]
    lookup = (time.perf_counter_ns() - start) / (repeats * len(keys))
    arena = ArenaAllocator(4 * sum(sizes))
    start = time.perf_counter_ns()
    for _ in range(repeats):
        blocks = [arena.allocate(n) for n in sizes]
        for b in blocks:
            arena.free(b)
    general = (time.perf_counter_ns() - start) / (repeats * len(keys))
    return lookup, general


def main() -> None:
    rows = []
    for name, arch in MODELS.items():
        spec = ModelSpec(arch, 64, 10, "classification")
        for batch in BATCHES:
            program = build_training_program(spec, TrainOptions(), batch)
            seq = AccessSequence(program)
            for p in range(len(program.ops)):
                seq.record(p, 1e-3)
            seq.end_iteration()
            timeline = Timeline([JobTrace(0, seq)])
            for schedule in ("none", "swaps at 50%"):
                decisions = [] if schedule == "none" else \
                    plan_tensile(timeline, COST, timeline.vanilla_peak_nbytes() // 2).decisions
                allocs = allocations_of(program, decisions)
                bound = max_live_nbytes(allocs)
                largest_bf = plan_offsets(allocs, "best_fit", "largest").arena_nbytes
                best_bf = plan_smallest(allocs, "best_fit")
                best_ff = plan_smallest(allocs, "first_fit").arena_nbytes
                _, general = replay_general_pool(allocs)
                lookup_ns, general_ns = ns_per_call(allocs, best_bf)
                rows.append([name, batch, schedule, len(allocs), bound, largest_bf / bound,
                             best_bf.arena_nbytes / bound, best_ff / bound, general / bound,
                             1 - best_bf.arena_nbytes / general, lookup_ns, general_ns])
    print(tabulate(rows, headers=["model", "batch", "schedule", "allocations", "max live bytes",
                                  "best fit, largest first / max live", "best fit, best order / max live",
                                  "first fit, best order / max live", "general pool / max live",
                                  "planned below general", "lookup ns", "general pool ns"],
                   tablefmt="github", floatfmt=".3f", intfmt=","))


if __name__ == "__main__":
    main()
