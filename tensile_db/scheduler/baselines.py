"""Baseline planners: published policies that a benchmark compares :func:`~.planners.plan_tensile` with.

Each is a planner like those of :mod:`~tensile_db.scheduler.planners`: ``plan(timeline, cost,
target_nbytes, max_seconds=None) -> Plan`` over the combined timeline of the measured jobs, built
from the same :class:`~.timeline.Decision` swaps and recomputes (a recompute only of a tensor that
:meth:`Program.recipe` re-produces exactly), so the executor runs any of them unchanged. By
default each is deterministic: its work is bounded by counts (:data:`~.planners.MAX_DECISIONS`),
not by a clock; a ``max_seconds`` bounds it by time as well, as the scheduler asks of every
planner.

- :func:`plan_capuchin`: Capuchin (Peng et al., ASPLOS 2020): swap where the absence hides the
  copies, otherwise recompute by memory saving per second (MSPS).
- :func:`plan_checkpoint`: checkpointing with ``sqrt(n)`` segments (Chen et al., arXiv
  1604.06174), whatever the target.
- :func:`plan_tensile_published`: TENSILE as the paper runs it: every job planned alone against
  its share of the target, so that the memory is the sum of the per-job peaks.

:data:`BASELINE_PLANNERS` names them.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..runtime.program import Kind, Program
from .cost import CostModel
from .planners import Plan, _Gap, _greedy, _State, plan_tensile
from .timeline import Decision, Simulation, Timeline, simulate

# --- Capuchin -------------------------------------------------------------------------------------


def _free_time_s(timeline: Timeline, measured: Simulation, a: np.ndarray, b: np.ndarray, nbytes: np.ndarray,
                 cost: CostModel) -> np.ndarray:
    """Capuchin's free time (FT) of swapping each absence (accesses at events ``a`` and ``b``,
    tensors of ``nbytes``; arrays of shape (g,)), seconds: the absence on the measured clock
    (``measured``: the timeline simulated without a plan), from the end of the access before it
    to the start of the access after it (a period later if it wraps), less the swap-out and
    swap-in times. FT >= 0: the copies can hide behind compute."""
    start_s = measured.start_s
    end_a_s = start_s[a] + timeline.durations_s[a]
    b_s = start_s[b] + np.where(b <= a, measured.period_s, 0.0)
    copies_s = 2 * cost.latency_s + nbytes / cost.d2h_bytes_per_s + nbytes / cost.h2d_bytes_per_s
    return b_s - end_a_s - copies_s


def plan_capuchin(timeline: Timeline, cost: CostModel, target_nbytes: int, max_seconds: float | None = None) -> Plan:
    """Capuchin's hybrid policy (Peng et al., "Capuchin: Tensor-based GPU Memory Management for
    Deep Learning", ASPLOS 2020, section 5) over the combined timeline. ``target_nbytes``: the
    combined peak to reach, bytes; ``max_seconds``: as for :func:`~.planners.plan_tensile` (None,
    the default: bounded by :data:`~.planners.MAX_DECISIONS` alone, so the plan is deterministic).

    From the measured access sequence, while the peak is above the target, the candidates are the
    absences (intervals between two accesses of a tensor) that span the peak event. A swap whose
    free time (FT: the absence on the measured clock, less the swap-out and swap-in times) is
    >= 0 hides its swap-out and swap-in: the one with the largest free time is evicted first.
    When none hides, the recompute with the largest MSPS (bytes saved per second of recompute) is
    taken, unless a swap exposes fewer seconds than that recompute costs (the paper's choice of
    the cheaper of the two for what swaps cannot hide).

    Departures from the paper: Capuchin ranks all candidates of one iteration at once and
    corrects its swap-in triggers on-line from feedback; here candidates are ranked anew at each
    peak of the combined timeline, with swaps timed by the simulator as in
    :func:`~.planners.plan_tensile`. MSPS counts a recipe's own ops only: a recompute never
    needs a source that is itself absent (:meth:`~.planners._State.recompute` refuses it), where
    Capuchin adds the cost of recomputing evicted sources.
    """
    measured = simulate(timeline, [], cost)     # no plan: the measured access sequence's clock

    def choose(state: _State, gaps: list[_Gap], k: int) -> Decision | None:
        opt = state.options(gaps, k)                # every swap frees k
        free_s = _free_time_s(timeline, measured, opt.a, np.array([g.b for g in gaps], dtype=np.int64),
                              opt.nbytes, cost)
        best = int(np.argmax(free_s))
        if free_s[best] >= 0:
            return opt.swap(best)[0]                # a swap that hides: the largest free time
        with np.errstate(divide="ignore", invalid="ignore"):
            msps = np.where(opt.recipe_s > 0, opt.nbytes / opt.recipe_s, np.inf)      # B/s
        msps[np.isnan(opt.recipe_s)] = -np.inf     # the program cannot recompute these
        for i in np.argsort(-msps, kind="stable").tolist():
            if msps[i] == -np.inf:
                break
            recompute = state.recompute(gaps[i])
            if recompute is not None:               # the best MSPS whose inputs are held
                if recompute.recipe_s <= -free_s[best]:
                    return recompute
                break
        return opt.swap(best)[0]                    # exposes less time than recomputing

    return _greedy("capuchin", timeline, cost, target_nbytes, choose, max_seconds)


# --- checkpointing with sqrt(n) segments ----------------------------------------------------------


def _first_backward(program: Program) -> int:
    """Index of the program's first backward op."""
    return next(i for i, op in enumerate(program.ops) if op.name.endswith("_backward"))


def checkpoint_segments(program: Program) -> list[list[str]]:
    """Chen et al.'s segments of one iteration: the exactly recomputable activations
    (:meth:`Program.recipe`) that the forward pass produces and the backward pass reads again,
    ``n`` of them in the order they are produced, cut into runs of ``ceil(sqrt(n))`` (about
    ``sqrt(n)`` segments). The last of each segment is its boundary (kept); the others are
    dropped."""
    first_backward = _first_backward(program)
    chain = sorted((name for name, slot in program.slots.items() if slot.kind is Kind.ACTIVATION
                    and program.positions[name][0] < first_backward <= program.positions[name][-1]
                    and program.recipe(name) is not None),
                   key=lambda name: program.positions[name][0])
    size = max(1, math.ceil(math.sqrt(len(chain))))
    return [chain[i:i + size] for i in range(0, len(chain), size)]


def plan_checkpoint(timeline: Timeline, cost: CostModel, target_nbytes: int | None = None,
                    max_seconds: float | None = None) -> Plan:
    """Gradient checkpointing with ``sqrt(n)`` segments (Chen, Xu, Zhang, Guestrin, "Training
    Deep Nets with Sublinear Memory Cost", arXiv 1604.06174, section 4.1) on every job and every
    iteration of the period; ignores the target, as the paper's fixed strategy does (and
    ``max_seconds``: its work is one decision per dropped tensor).

    Every activation inside a segment (:func:`checkpoint_segments`) is dropped after its last
    forward access and recomputed from the segment's kept boundary when the backward pass first
    needs it. Recomputes nest as in the paper: a dropped tensor read by the recompute of a later
    one in its segment comes back then, and stays until its own backward use; the decisions
    record exactly that (each is made after those of the tensors produced later, so its absence
    ends at the first recompute that reads it).

    Departures from the paper: segments count tensors, not layers (an in-place activation shares
    its layer's tensor); an activation that is not exactly recomputable (:meth:`Program.recipe`
    is None: a branch point read after its recipe's inputs are gone, batch-norm statistics, the
    loss) is kept and not counted in ``n``; the boundaries are fixed, not searched for the
    cheapest.
    """
    state = _State(timeline, cost)
    for job_id in timeline.traces:
        program = timeline.program(job_id)
        n_ops, first_backward = len(program.ops), _first_backward(program)
        dropped = {name for segment in checkpoint_segments(program) for name in segment[:-1]}
        # the tensors produced last first: a tensor's absence ends where a later one's recompute reads it
        for t in sorted((t for t in timeline.tensors if t.job_id == job_id and t.slot in dropped),
                        key=lambda t: -t.positions[0]):
            last_forward = max(q for q in t.positions if q % n_ops < first_backward)
            gap = next((g for g in state.gaps(t) if g.pa == last_forward), None)
            decision = state.recompute(gap) if gap is not None else None
            if decision is not None and decision.window(timeline.n)[1] > 0:
                state.add(decision)
    return Plan.build("checkpoint", timeline, state.decisions, cost, target_nbytes)


# --- TENSILE as published -------------------------------------------------------------------------


def job_timelines(timeline: Timeline) -> dict[int, Timeline]:
    """job id -> a timeline of that job alone: its trace (access sequence, iterations per period)
    from period position 0."""
    return {job_id: Timeline([replace(trace, phase=0, order=0)]) for job_id, trace in timeline.traces.items()}


def job_targets(timeline: Timeline, target_nbytes: int) -> dict[int, int]:
    """job id -> its share of ``target_nbytes``, bytes: the target split in proportion to the
    jobs' vanilla peaks planned alone (rounded down, so the shares sum to at most the target)."""
    peaks = {job_id: alone.vanilla_peak_nbytes() for job_id, alone in job_timelines(timeline).items()}
    total = sum(peaks.values())
    return {job_id: target_nbytes * peak // total for job_id, peak in peaks.items()}


def plan_tensile_published(timeline: Timeline, cost: CostModel, target_nbytes: int,
                           max_seconds: float | None = None) -> Plan:
    """TENSILE as Zhang et al. describe it (arXiv 2105.13336, section 4): each job planned on its
    own access sequence (:func:`job_timelines`) by :func:`~.planners.plan_tensile`, against its
    share of the target (:func:`job_targets`), so that memory is budgeted as the sum of the
    per-job peaks. The per-job decisions are carried onto the combined timeline by period
    position, ``(job_id, q)`` -> event, and built into one plan there (its predicted peak is the
    combined one: at most the sum of the per-job peaks, since a job's memory between two of its
    ops is at most what it holds at the first). ``max_seconds``: the time for choosing, split
    evenly over the jobs (None, the default: no time limit, a deterministic plan).

    Departures from the paper: the target split in proportion to the vanilla peaks is this
    module's reading of how a budget is shared; the per-job planner keeps
    :func:`~.planners.plan_tensile`'s own departures (measured bandwidth, simulated candidates)
    but not its widened absences (Note [Widened absences] in :mod:`~.planners`), which this
    project added.
    """
    decisions: list[Decision] = []
    targets = job_targets(timeline, target_nbytes)
    seconds = None if max_seconds is None else max_seconds / len(targets)
    for job_id, alone in job_timelines(timeline).items():
        to_combined = [timeline.index[event] for event in alone.events]
        decided = plan_tensile(alone, cost, targets[job_id], seconds, widen=False).decisions
        timeline.work.add(alone.work)
        for d in decided:
            a = to_combined[d.a]
            free = to_combined[d.free] if d.method == "swap" else (a + 1) % timeline.n   # a drop frees at once
            decisions.append(replace(d, a=a, b=to_combined[d.b], free=free, back=to_combined[d.back]))
    return Plan.build("tensile_published", timeline, decisions, cost, target_nbytes)


#: The baseline planners by policy name.
BASELINE_PLANNERS = {"capuchin": plan_capuchin, "checkpoint": plan_checkpoint,
                     "tensile_published": plan_tensile_published}
