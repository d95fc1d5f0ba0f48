"""The global planner: per-model curves of memory against time, combined over all running jobs.

Note [Curves and their combination]
-----------------------------------
A plan is paid for on the clock (Note [Paid planning] in :mod:`~tensile_db.scheduler.engine`): a
planner that takes a second is a second of jobs run without its plan, longer than many a job.
The greedy planner of :func:`~.planners.plan_tensile` over the combined timeline of four
ResNet-50 jobs took about 0.6 s of this machine's time and the mixed arrival of four models
several seconds, at every arrival and departure. This planner splits the work in two:

1. **A curve per model** (:func:`job_curve`): one job alone (one iteration, its measured op
   times) planned by TENSILE's choice at each peak (:func:`~.planners.tensile_choice`) from no
   plan down to a depth, recording after each decision the job's peak and the simulated extra
   seconds of its iteration. The depth is a quarter of its peak (:data:`CURVE_DEPTH`), or, where
   the target less the other jobs' whole peaks leaves the job more, :data:`DEPTH_MARGIN` of that:
   no combination can need the job lower, and a curve's planning is paid on the clock (one
   ResNet-50 alone on the simulated H100 with TF32 at 70%: a curve to a quarter took 197 ms of
   modelled planning and landed after the steady state began, EOR +1.32; to the target's depth,
   74 ms and +0.20). Jobs of the same program with op times within
   :data:`TIMES_BUCKET` of each other share one curve, and a coordinator keeps its curves
   (``memo``) across re-plans: an arrival, a departure or a new pace re-plans from them.
   A curve is computed lazily (:class:`CurveBuilder`), :data:`LOOKAHEAD` decisions beyond those
   the combination has taken (:data:`LOOKAHEAD_ALONE` when the timeline holds one job: the
   lookahead lets the combination weigh one job's later steps against another's; one job
   alone, each of the seed papers' four models at 70%, 50% and 35% on both H100 profiles, got
   plans of the same predicted time with 4 as with 32, at up to 31% less modelled work, and
   1% more in two of the 24 cases), and within a budget per plan (:data:`CURVE_WORK_S` of modelled
   work): a plan that reaches the budget lands as it is, *partial*, and asks for the next, which
   goes on along the same curves from where they stopped. A plan that waits for whole curves
   lands after the jobs it is for have run under the reactive fallback: on the mixed arrival
   of four models on the simulated H100 with TF32 at 50%, the first plan of the four cost
   1,248 ms of modelled planning in a run of about 1 s and never landed (EOR +0.927); within
   0.1 s per plan the first landed at 269 ms (EOR +0.502; 0.05 s: +0.508, 0.2 s: +0.555,
   0.025 s: +0.623).
2. **The combination** (:func:`plan_global`): every job's curve carried onto the combined
   timeline (each of its iterations in the period, at its phase); starting from no decision,
   while the combined peak is above the target, the job whose next steps free the peak event at
   the least extra seconds per byte advances to them, counting only the bytes the peak still needs
   above the target (as :func:`~.planners.tensile_choice` does): a curve's later steps free more
   at a flat cost, and counted whole they drew the combination past the target (one ResNet-50 on
   the simulated H100 at 35% of its peak: 27% below the target, 14.1 ms of predicted extra time
   per iteration, against 8.7 ms when capped). A job whose memory at the combined peak is
   low, because its own peak falls elsewhere (the executor staggers arrivals so that peaks do not
   coincide: Zico, Lim et al., USENIX ATC 2021), is cut less than its share: the combined
   timeline, not the sum of per-job peaks that TENSILE (arXiv 2105.13336, section 4) budgets.

The choice between swapping and recomputing is made within each curve by simulation (the
greedy's), so a curve's early steps are the swaps its copy engines hide and the cheap recomputes.
Limitations: each curve assumes the copy engines are its job's alone; on the combined timeline a
job's ops are spread over a longer period, so its copies have as much more time as other jobs'
copies take, which holds while the jobs' copy demands are alike. The combined plan is simulated
once at the end (its predicted extra time), not while combining. Before that, the decisions that
the others make redundant are left out (Note [Redundant decisions] in :mod:`~.planners`): a
curve's prefix holds the cheap swaps taken before the large ones that cover them. Then the swaps
are re-timed on the copy queues of the combined plan (Note [Re-timed swaps]), since each curve
timed its swaps alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .cost import CostModel
from .planners import (
    MAX_DECISIONS,
    Plan,
    _greedy_steps,
    _State,
    applied,
    drop_redundant,
    peak_above,
    retime_swaps,
    tensile_choice,
    widened_key,
)
from .timeline import Decision, JobTrace, Timeline
from .work import PLAN_OVERHEAD_S, PlanWork

#: op times within this factor of each other share a curve (relative, on the iteration's time).
#: Wide on purpose: a job's times move after its cold start (estimated, then measured, then
#: settled) and with the jobs beside it; a curve is an order of choices, which such moves barely
#: change, and the combined plan is simulated on the current times. At 1.10 the mixed arrival
#: re-made curves at most re-plans and its plans landed late (EOR +0.555 against +0.213 at 50%).
TIMES_BUCKET = 1.5
#: a curve goes down to this fraction of its job's peak (or its smallest working set, if larger;
#: below the floor, each event's own op's working set): its last steps are its most expensive to
#: plan and, with staggered peaks, rarely needed
CURVE_DEPTH = 0.25
#: decisions of a job's curve the combination sees beyond those it has taken: a curve is
#: computed only that far ahead (:class:`CurveBuilder`), and further as the combination takes it
LOOKAHEAD = 32
#: the same where the timeline holds one job (Note [Curves and their combination])
LOOKAHEAD_ALONE = 4
#: modelled seconds of curve work one plan may spend (Note [Curves and their combination]): a plan
#: that stops there lands early, partial, and the next one goes on from where its curves stopped
CURVE_WORK_S = 0.1
#: a curve goes this much below the least its job can need (the target less the other jobs' whole
#: peaks), for the difference between a program's peak and its job's on the timeline
DEPTH_MARGIN = 0.75


@dataclass(frozen=True)
class Curve:
    """One job's plans alone, each a prefix of :attr:`decisions` (events are its op positions in
    one iteration; a step may widen an earlier swap: :meth:`plan`). ``peak_nbytes[i]`` and ``extra_s[i]``: its peak (bytes) and simulated extra
    seconds per iteration with the first ``i`` decisions, for ``i`` from 0 to ``len(decisions)``
    ((d + 1,) int64 and float64)."""

    decisions: tuple[Decision, ...]
    peak_nbytes: np.ndarray
    extra_s: np.ndarray

    def plan(self, steps: int | None = None) -> list[Decision]:
        """The decisions of the first ``steps`` (None: all), a widening in place of the swap it
        widens (:func:`~.planners.applied`)."""
        return applied(list(self.decisions[:steps]))


def _signature(trace: JobTrace) -> tuple:
    """What makes two jobs' curves the same: the program's structure and the bucket of its
    iteration time."""
    program = trace.sequence.program
    key = getattr(program, "_curve_key", None)
    if key is None:
        key = hash((tuple((op.name, op.reads, op.writes) for op in program.ops),
                    tuple((name, slot.kind, slot.shape, slot.dtype) for name, slot in program.slots.items())))
        program._curve_key = key
    seconds = float(np.nansum(trace.sequence.times_s))
    return key, round(math.log(seconds) / math.log(TIMES_BUCKET)) if seconds > 0 else 0


class CurveBuilder:
    """One job's curve (:func:`job_curve`), computed lazily: :meth:`extend` takes TENSILE's
    choice at the peak for a few more decisions, from where it stopped, so that a combination
    computes only as much of each curve as it looks at and a plan's budget allows (Note [Curves
    and their combination]). Its decisions do not depend on how far, or in how many plans, it is
    extended. With ``below_floor`` each event's target is the depth raised to that event's own
    working set, not to the job's largest (Note [Targets under the floor] in
    :mod:`~tensile_db.scheduler.engine`), so the curve goes on below the floor where the ops
    allow."""

    def __init__(self, trace: JobTrace, cost: CostModel, depth: float = CURVE_DEPTH, below_floor: bool = False):
        self._alone = Timeline([replace(trace, phase=0, order=0, repeats=1)])
        self._state = _State(self._alone, cost)
        depth_nbytes = int(depth * self._state.use.max())
        if below_floor:     # each event down to the depth or its own working set (Note [Targets under the floor])
            floor = self._alone.targets(depth_nbytes)
        else:
            floor = max(trace.sequence.program.min_working_set_nbytes, depth_nbytes)
        self._steps = _greedy_steps(self._state, floor, tensile_choice(cost, floor), None)
        self._peaks, self._extras = [int(self._state.use.max())], [self._state.sim.extra_s]
        self._counted = PlanWork()          # the work done so far that some plan was charged for
        self._owed = PlanWork()             # work charged to a plan that never ran: the next one pays
        self.done = False                   # nothing left to take: the depth, or nothing frees the peak
        self.curve = Curve((), np.array(self._peaks, dtype=np.int64), np.array(self._extras))

    def extend(self, decisions: int, work: PlanWork, within=lambda: True) -> bool:
        """Take up to ``decisions`` more decisions while ``within()`` (the plan's budget) says so;
        the work they took, and any work :meth:`refund`-ed, is counted to ``work``. Returns
        whether the curve grew."""
        self._charge(work)
        grown = 0
        while grown < decisions and not self.done and within():
            if next(self._steps, None) is None:
                self.done = True
                break
            self._peaks.append(int(self._state.use.max()))
            self._extras.append(self._state.sim.extra_s)
            grown += 1
            self._charge(work)
        if grown:
            self.curve = Curve(tuple(self._state.steps), np.array(self._peaks, dtype=np.int64),
                               np.array(self._extras))
        return grown > 0

    def _charge(self, work: PlanWork) -> None:
        done = self._alone.work.counts()
        work.add(PlanWork(**{u: n - getattr(self._counted, u) for u, n in done.items()}))
        work.add(self._owed)
        self._counted, self._owed = PlanWork(**done), PlanWork()

    def refund(self, work: PlanWork) -> None:
        """``work`` was charged to a plan that was called off before it started: the next plan
        that uses this curve pays for it (on the simulated device the curve is computed when the
        plan is asked for, Note [Paid planning] in :mod:`~tensile_db.scheduler.engine`)."""
        self._owed.add(work)


def job_curve(trace: JobTrace, cost: CostModel, work=None, depth: float = CURVE_DEPTH,
              below_floor: bool = False) -> Curve:
    """The curve of the job of ``trace`` alone (Note [Curves and their combination]): TENSILE's
    choice at each peak, from no plan down to ``depth`` (a fraction in (0, 1]) of its peak (or its
    smallest working set) or until nothing frees the peak; with ``below_floor`` (as for
    :class:`CurveBuilder`) each event down to the depth or its own op's working set, an event
    nothing frees passed over, so its peaks need not fall at every step. ``work``: a
    :class:`~.work.PlanWork` that counts the work too."""
    builder = CurveBuilder(trace, cost, depth, below_floor)
    builder.extend(MAX_DECISIONS, PlanWork() if work is None else work)
    return builder.curve


def _carry(curve: Curve, timeline: Timeline, job_id: int, start: int = 0) -> dict[str, np.ndarray | list]:
    """The curve's decisions from index ``start`` on the combined timeline: each one in each of
    the job's iterations of the period (a decision whose absence wraps from the end of an
    iteration goes on to the next one, the last to the first). Returns the decisions and, per
    decision, its curve index, first absent event, absent events and bytes, and the first absent
    event and absent events of the swap it widens (a length of 0 for none; Note [Widened
    absences] in :mod:`~.planners`)."""
    trace, n_prog = timeline.traces[job_id], timeline.n_program_ops(job_id)
    out, index, widened = [], [], []
    earlier = {key: d for d in curve.decisions[:start] if (key := widened_key(d)) is not None}
    for i, d in enumerate(curve.decisions[start:], start):
        key = widened_key(d)
        before = earlier.get(key)
        if key is not None:
            earlier[key] = d
        for r in range(trace.repeats):
            def at(p: int) -> int:
                later = p <= d.a                       # after the wrap: the next iteration
                return timeline.index[(job_id, ((r + later) % trace.repeats) * n_prog + p)]
            a = timeline.index[(job_id, r * n_prog + d.a)]
            b = at(d.b)
            if d.method == "swap":                     # the curve may be another job's of the same model
                carried = replace(d, job_id=job_id, a=a, b=b, free=at(d.free), back=at(d.back))
            else:                                      # a drop frees at once
                carried = replace(d, job_id=job_id, a=a, b=b, free=(a + 1) % timeline.n, back=b)
            out.append(carried)
            index.append(i)
            widened.append((0, 0) if before is None else
                           (at(before.free), (at(before.back) - at(before.free)) % timeline.n))
    windows = np.array([c.window(timeline.n) for c in out], dtype=np.int64).reshape(-1, 2)
    widened = np.array(widened, dtype=np.int64).reshape(-1, 2)
    return {"decisions": out, "index": np.array(index, dtype=np.int64), "free": windows[:, 0],
            "length": windows[:, 1], "nbytes": np.array([c.nbytes for c in out], dtype=np.int64),
            "widened_free": widened[:, 0], "widened_length": widened[:, 1]}


def _cheapest_step(timeline: Timeline, carried: dict, level: dict[int, int], k: int, need_nbytes: int):
    """Among the jobs' curves (``carried``: job -> (curve, its decisions on the timeline), the
    first ``level[job]`` taken), the next step that frees event ``k`` at the least extra time
    per byte of the ``need_nbytes`` still needed there (ties: the most bytes): (ratio, bytes
    freed, job, curve index to take up to), or None when no curve frees ``k``."""
    best, n = None, timeline.n
    for job_id, (curve, c) in carried.items():
        repeats = timeline.traces[job_id].repeats
        timeline.work.rows += len(c["index"])
        covers = ((c["index"] >= level[job_id]) & ((k - c["free"]) % n < c["length"])
                  & ((k - c["widened_free"]) % n >= c["widened_length"]))     # not freed by the swap it widens
        if not covers.any():
            continue
        # each candidate end of the step: a curve index whose decisions free event k
        per_index = np.bincount(c["index"][covers], weights=c["nbytes"][covers])
        ends = np.flatnonzero(per_index)
        freed = np.cumsum(per_index[ends])
        extra = np.maximum(curve.extra_s[ends + 1] - curve.extra_s[level[job_id]], 0.0) * repeats
        ratio = extra / np.minimum(freed, need_nbytes)    # bytes beyond the need earn nothing
        i = int(np.argmin(ratio))
        if best is None or (ratio[i], -freed[i]) < (best[0], -best[1]):
            best = (ratio[i], freed[i], job_id, int(ends[i]) + 1)
    return best


def _take(timeline: Timeline, use: np.ndarray, chosen: list[Decision], swaps: dict, d: Decision) -> None:
    """Add ``d`` to the plan ``chosen`` and its absence to ``use``, in place; a widening (Note
    [Widened absences] in :mod:`~.planners`) replaces the swap it widens. ``swaps``: (job, slot,
    a) of each swap chosen -> its index in ``chosen``."""
    key = widened_key(d)
    if key in swaps:
        old = chosen[swaps[key]]
        timeline.add_window(use, *old.window(timeline.n), old.nbytes)
        chosen[swaps[key]] = d
    else:
        if key is not None:
            swaps[key] = len(chosen)
        chosen.append(d)
    timeline.add_decision(use, d)


def plan_global(timeline: Timeline, cost: CostModel, target_nbytes: int, max_seconds: float | None = None,
                memo: dict | None = None, budget_s: float | None = None) -> Plan:
    """The global planner (Note [Curves and their combination]). ``target_nbytes``: the combined
    peak to reach, bytes; ``memo``: curves kept by the caller across re-plans (a dict it owns;
    None: none kept); ``budget_s``: modelled seconds of curve work this plan may spend (Note
    [Planning cost model] in :mod:`~.work`; None: :data:`CURVE_WORK_S`); ``max_seconds`` is
    accepted for the planners' common signature and unused: the work is bounded by ``budget_s``.

    A target under a job's smallest working set holds each event to the target raised to its
    own op's working set (:meth:`~.timeline.Timeline.targets`; Note [Targets under the floor] in
    :mod:`~tensile_db.scheduler.engine`): the curves go on below the floor where the ops allow,
    and an event out of reach is passed over.

    Returns a :class:`~.planners.Plan` whose predicted peak may stay above the target when no
    curve frees the peak event any more (the reactive fallback covers the rest); it is
    :attr:`~.planners.Plan.partial` when the budget stopped a curve that could have gone on, and
    :attr:`~.planners.Plan.curve_work` says what each curve cost it."""
    if timeline.vanilla_peak_nbytes() <= target_nbytes:         # nothing to plan: no curve is worth its cost
        return Plan.build("tensile", timeline, [], cost, target_nbytes)
    per_event = target_nbytes < max(t.sequence.program.min_working_set_nbytes for t in timeline.traces.values())
    targets = timeline.targets(target_nbytes) if per_event else None
    memo = {} if memo is None else memo
    work = timeline.work
    charges: dict[tuple, PlanWork] = {}                 # memo key -> curve work of this plan
    budget_s = CURVE_WORK_S if budget_s is None else budget_s

    def within() -> bool:
        return sum(w.seconds() - PLAN_OVERHEAD_S for w in charges.values()) < budget_s

    carried, builders = {}, {}
    lookahead = LOOKAHEAD if len(timeline.traces) > 1 else LOOKAHEAD_ALONE
    peaks = {job_id: trace.sequence.program.vanilla_peak_nbytes() for job_id, trace in timeline.traces.items()}
    all_peaks = sum(peaks.values())
    for job_id, trace in timeline.traces.items():
        # no job need go below the target less every other job's whole peak
        need = (target_nbytes - (all_peaks - peaks[job_id])) / peaks[job_id]
        depth = round(min(max(CURVE_DEPTH, DEPTH_MARGIN * need), 1.0), 2)
        key = (*_signature(trace), depth, per_event)
        work.items += len(trace.sequence.program.ops) + len(trace.sequence.program.slots)
        builder = memo.get(key)
        if builder is None:
            builder = memo[key] = CurveBuilder(trace, cost, depth, per_event)
        charge = charges.setdefault(key, PlanWork())
        builders[job_id] = (builder, charge)
        builder.extend(lookahead - len(builder.curve.decisions), charge, within)
        carried[job_id] = (builder.curve, _carry(builder.curve, timeline, job_id))
        work.items += len(carried[job_id][1]["decisions"])

    def look_ahead(job_id: int, decisions: int) -> bool:
        """Extend the job's curve to ``decisions`` past the ones taken; whether it grew."""
        (curve, c), (builder, charge) = carried[job_id], builders[job_id]
        if not builder.extend(level[job_id] + decisions - len(curve.decisions), charge, within):
            return False
        more = _carry(builder.curve, timeline, job_id, len(curve.decisions))
        work.items += len(more["decisions"])
        carried[job_id] = (builder.curve, {
            name: c[name] + more[name] if name == "decisions" else np.concatenate([c[name], more[name]])
            for name in c})
        return True

    use = timeline.usage([])
    level = {job_id: 0 for job_id in carried}           # decisions of its curve taken
    chosen: list[Decision] = []
    swaps: dict[tuple[int, str, int], int] = {}         # (job, slot, a) of a chosen swap -> its index in chosen
    n = timeline.n
    aim = targets if per_event else target_nbytes
    passed = np.zeros(n, dtype=bool)                    # per event: events no curve frees, passed over
    for _ in range(MAX_DECISIONS):
        peak = peak_above(use, aim, passed)
        if peak is None:
            break
        k = peak[0]
        best = _cheapest_step(timeline, carried, level, k, peak[1])
        if best is None:
            if not any([look_ahead(job_id, 2 * lookahead) for job_id in carried]):
                if not per_event:
                    break                               # nothing frees the peak: reactive covers the rest
                passed[k] = True
            continue
        _, _, job_id, upto = best
        c = carried[job_id][1]
        for j in np.flatnonzero((c["index"] >= level[job_id]) & (c["index"] < upto)).tolist():
            _take(timeline, use, chosen, swaps, c["decisions"][j])
        work.items += upto - level[job_id]              # a window added each: not the greedy's bookkeeping
        work.events += n
        level[job_id] = upto
        if len(carried[job_id][0].decisions) - upto < lookahead // 2:
            look_ahead(job_id, lookahead)
    for charge in charges.values():
        work.add(charge)
    ceiling = np.maximum(targets, use) if per_event else max(target_nbytes, int(use.max()))
    chosen = retime_swaps(timeline, drop_redundant(timeline, chosen, cost, ceiling), cost, ceiling)
    plan = Plan.build("tensile", timeline, chosen, cost, target_nbytes)
    plan.curve_work = charges
    short = bool(np.any(timeline.usage(chosen) > targets)) if per_event else plan.predicted_peak_nbytes > target_nbytes
    plan.partial = short and not all(b.done for b, _ in builders.values())
    return plan
