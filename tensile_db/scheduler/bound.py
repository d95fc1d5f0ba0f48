"""A lower bound on the extra time of any swap/recompute plan that meets a memory target.

This module owns the enumeration of a timeline's absences (:func:`absences`: every interval
between two consecutive accesses of a tensor, the candidates of every planner) and an optimal
reference for the planners (:func:`lower_bound`): linear programs, or mixed-integer ones for
small timelines, whose optimum no plan of swaps and recomputes (:class:`~.timeline.Decision`)
that keeps every event of the timeline at or below the target can beat. It promises that
``lower_bound(...).extra_s`` is at most the extra seconds per period of every such plan in the
periodic steady state, and that the answer does not depend on the machine: the solver runs
serial and the search makes the same solves every time. ``docs/bound.md`` shows the programs.

Note [Relaxation]
-----------------
Rationale: a planner's extra time alone says little, since nothing says how much less is
possible. An exact optimum over swaps, recomputes and their timing is a scheduling problem far
too large at the timelines' scale (Checkmate, Jain et al., MLSys 2020, solves recompute alone as
an integer program on one network's graph; POET, Patil et al., ICML 2022, adds paging to it).
Relaxed to linear programs, such formulations give a bound in seconds instead.

Approach: one variable per absence ``g`` of ``s_g`` bytes, ``w_g`` (swapped) and ``r_g``
(recomputed) in [0, 1], ``w_g + r_g <= 1``, ``r_g = 0`` where the program cannot recompute the
tensor there (the planners' rule). A recompute frees every event inside the absence and costs
its recipe's measured seconds on the compute stream. A swap frees event ``k`` inside the absence
only if, on the timeline's clock without a plan (start times ``t``, durations ``d``, cyclic),
its swap-out can end before ``k`` starts and its swap-in can end by the next access ``b``:
``t_k - (t_a + d_a) >= swap_out_s(s_g) - E_hat`` and ``t_b - (t_k + d_k) >= swap_in_s(s_g) -
E_hat``, where ``E_hat`` is the extra time allowed for (stalls and recomputes stretch the clock
between two events of one period by at most a period's extra time). So a swap frees a
contiguous, cyclic part of the absence. Every event ``k`` above the target ``M`` (vanilla bytes
``U_k``) needs ``sum s_g x_g >= U_k - M`` over the variables ``x_g`` that free it. The extra
time ``E`` is at least the recomputes' seconds, plus each swap's own seconds on the compute
stream, plus ``c / (1 + c)`` of each copy engine's busy seconds (the cost model's contention
``c``: while a copy is in flight the kernels run ``1 + c`` times slower, so the compute stream
loses at least that over a period; Note [Contention] in :mod:`~.cost`), and at least each copy
engine's busy seconds less the compute time ``T`` (an engine copies at most one period, ``T +
E``, per period; one channel for both directions unless the cost model is duplex). A swap's own
seconds are what the planners' simulation charges the compute stream for it (Note [Issue cost]
in :mod:`~.cost`): its swap-out's and swap-in's issue, ``2 issue_s``, and, where the cost model
makes its copies there (``inline_nbytes``: ``cpu`` with the kernels on every core), both
copies, which then take no copy engine and slow no kernel. Under a host budget a swap of that
size may go to the disk tier, whose copies take the channel: there its copies count as an
engine's, as every copy did before (a copy made on the compute stream meets those rows too,
since it adds its seconds to ``E``). Minimise ``E``: ``LP(E_hat)``.

Every plan of extra time ``E*`` is feasible in ``LP(E*)`` with ``E = E*``, so ``LP(E*) <= E*``.
``LP`` does not increase with ``E_hat`` (larger windows), so ``{e : LP(e) <= e}`` is an interval
``[B, inf)`` holding every plan's ``E*``, and ``B`` is the bound. A solve at ``e`` of value ``v``
places ``B`` between ``min(e, v)`` and ``max(e, v)``; bisection narrows that, and the lower end
is what :func:`lower_bound` reports. Where freeing the whole of every absence cannot bring an
event down to the target (the bytes the event's op accesses exceed it), no plan can: the bound
is infinite. The memory rows are written as differences between consecutive events above the
target, so each variable has at most three entries and the program stays near-linear in events
plus absences.

Limitations (each makes the bound lower, never wrong): copies are priced at the host tier (a
disk tier's copy costs more); a recompute's workspace is ignored, and so is whether its inputs
are held; an absence cut by the extra accesses of another tensor's recompute is priced as the
whole absence (its pieces free no more than the whole, at no less cost). :func:`~.timeline.simulate`
replays two periods, not the steady state: a plan whose copies fall behind by more than a period
would be simulated faster than it runs, and could then appear below this bound.

Note [Congestion]
-----------------
Rationale: ``LP`` limits a copy engine only by the period's length, so every swap that frees the
peak may copy at once. At 35% of one ResNet-50's peak on the simulated H100 it allowed 5.9% of
extra time (1% without contention), where the swap-outs that free the peak need more: each must
run between its tensor's last access before the peak and the peak.

Approach: for a few events above the target (one per :data:`WATCHED` stretch of the period, the
one of most excess there), a program of that event ``k`` alone: ``x_g`` for each absence that
spans it (swapped, freeing ``k``), ``r_g`` where recomputable, ``x_g + r_g <= 1``, the memory
row of ``k``, the recompute and engine rows as above, and the engines' congestion: the
swap-outs of the absences whose access ``a`` comes at or after any event ``s`` all run between
the end of ``s`` and the start of ``k``, so their seconds sum to at most ``t_k - (t_s + d_s) +
E``; the swap-ins of those whose next access ``b`` comes at or before any event ``e`` run
between the end of ``k`` and the start of ``e``, likewise. Copies made on the compute stream
are left out of these sums: they take no engine, and they stretch the very interval the engine's
copies fill, so a sum of both would bound nothing; their seconds are in the compute row. A
running sum per distinct ``a`` (and ``b``) keeps the program linear in the absences that span
``k``. Every plan frees ``k`` that
way, so each optimum bounds ``E`` from below, and the largest becomes a bound on the column
``E`` of ``LP`` (and the start of the search).

Limitations: only the watched events, each alone (the copies that free two of them are not
counted together), and the copies of swaps that do not free ``k`` are left out of its engines.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from ..errors import InvalidArgument
from .cost import CostModel
from .timeline import Timeline

#: most solves of the period's program in one search for the bound (each halves the interval)
MAX_SOLVES = 60
#: default tolerance of the search, as a fraction of the compute seconds of a period
TOLERANCE = 1e-4
#: equal stretches of the period, each with one event watched for the copy engines' congestion
#: (Note [Congestion])
WATCHED = 16


@dataclass(frozen=True)
class Absences:
    """Every absence of every tensor of a timeline with no plan: the events between two
    consecutive accesses (TENSILE, arXiv 2105.13336, section 4: the candidates of a swap or a
    recompute). Arrays of shape (g,), in the order of ``timeline.tensors`` and, per tensor, of
    its accesses (a persistent tensor's absence around the end of the period last).

    Attributes:
        tensor: int64 index into ``timeline.tensors``.
        a: int64 event of the access before the absence.
        b: int64 event of the access after it; the absence is the events from ``a + 1`` to
            ``b - 1``, cyclic (all but ``a`` when ``a == b``: a persistent tensor accessed once).
        nbytes: int64 arena bytes of the tensor.
        recipe_s: float64 seconds of the ops that recompute the tensor at ``b``; NaN where the
            program cannot (:meth:`~tensile_db.runtime.program.Program.recipe`: not exactly
            recomputable, between two of its writers, or around the end of the period).
    """

    tensor: np.ndarray
    a: np.ndarray
    b: np.ndarray
    nbytes: np.ndarray
    recipe_s: np.ndarray

    def __len__(self) -> int:
        return len(self.a)


def absences(timeline: Timeline) -> Absences:
    """The absences of ``timeline`` with no plan (:class:`Absences`): of a non-persistent tensor,
    between consecutive accesses within its lifetime; of a persistent one, also from its last
    access of the period to its first of the next. The same absences, recipes and seconds as the
    planners find before their first decision."""
    tensors = timeline.tensors
    event_of = {job: np.empty(trace.n_ops, dtype=np.int64) for job, trace in timeline.traces.items()}
    for k, (job, q) in enumerate(timeline.events):
        event_of[job][q] = k
    counts = np.array([len(t.positions) for t in tensors], dtype=np.int64)
    last = np.cumsum(counts) - 1
    q = np.fromiter(itertools.chain.from_iterable(t.positions for t in tensors), np.int64, int(counts.sum()))
    owner = np.repeat(np.arange(len(tensors)), counts)
    job = np.array([t.job_id for t in tensors])[owner]
    event = np.empty_like(q)
    for job_id, events in event_of.items():
        mine = job == job_id
        event[mine] = events[q[mine]]
    # each access and the next one of its tensor; a tensor's last access pairs with its first
    # if it is persistent, else with none
    before = np.arange(len(q))
    after = before + 1
    after[last] = last - counts + 1
    keep = np.ones(len(q), dtype=bool)
    keep[last] = [t.persistent for t in tensors]
    before, after = before[keep], after[keep]
    # recompute: (the recipe's last op, its seconds) per tensor, as the planners compute them
    recipes = {}
    for t in tensors:
        if (t.job_id, t.slot) not in recipes:
            recipe = timeline.program(t.job_id).recipe(t.slot)
            times = timeline.traces[t.job_id].sequence.times_s
            recipes[(t.job_id, t.slot)] = (math.inf, math.nan) if recipe is None else (
                recipe[-1], float(sum(times[p] for p in recipe)))
    last_op, seconds = np.array([recipes[(t.job_id, t.slot)] for t in tensors], dtype=np.float64).reshape(-1, 2).T
    n_ops = np.array([timeline.n_program_ops(t.job_id) for t in tensors])
    tensor, pa, pb = owner[before], q[before], q[after]
    recomputable = (pa % n_ops[tensor] >= last_op[tensor]) & (pb > pa)
    nbytes = np.array([t.nbytes for t in tensors], dtype=np.int64)
    return Absences(tensor, event[before], event[after], nbytes[tensor],
                    np.where(recomputable, seconds[tensor], np.nan))


@dataclass(frozen=True)
class Bound:
    """The lower bound of :func:`lower_bound` and how it was found.

    Attributes:
        extra_s: seconds per period that every plan meeting the target adds at least (inf when
            no plan can meet it).
        compute_s: the period's compute seconds, ``T`` (the sum of the ops' measured times).
        target_nbytes: the target, bytes.
        integer: whether the swaps and recomputes were whole (a mixed-integer program).
        solves: linear or mixed-integer programs solved (Note [Congestion]'s included).
        iterations: the solver's work summed over the solves, deterministic: simplex iterations
            of a linear program, branch-and-bound nodes of a mixed-integer one.
        swap: (g,) float64 in [0, 1], ``w`` of each absence of ``absences`` at the solve that
            closed the search from above (its extra time within its own windows, or the last
            feasible solve): a guide for a planner; 0 where an absence spans no event above the
            target, and all 0 when the bound is 0 without a solve or infinite.
        recompute: (g,) float64 in [0, 1], ``r`` of each absence, likewise.
        absences: the timeline's absences (:func:`absences`).
    """

    extra_s: float
    compute_s: float
    target_nbytes: int
    integer: bool
    solves: int
    iterations: int
    swap: np.ndarray
    recompute: np.ndarray
    absences: Absences

    @property
    def feasible(self) -> bool:
        """Whether some plan can meet the target."""
        return math.isfinite(self.extra_s)

    @property
    def eor(self) -> float:
        """The bound as an extra overhead ratio: ``extra_s / compute_s``."""
        return self.extra_s / self.compute_s


def lower_bound(timeline: Timeline, cost: CostModel, target_nbytes: int, integer: bool = False,
                tolerance_s: float | None = None) -> Bound:
    """A lower bound on the extra seconds per period of every plan of swaps and recomputes on
    ``timeline`` whose combined peak is at most ``target_nbytes`` bytes, with copies priced by
    ``cost`` (Note [Relaxation] and Note [Congestion]; after the integer programs of Checkmate,
    Jain et al., MLSys 2020, and POET, Patil et al., ICML 2022, relaxed to linear programs).

    ``integer``: whole swaps and recomputes in the period's program (``scipy.optimize.milp``;
    the programs of Note [Congestion] stay linear): a bound at least as high, for small
    timelines only (one small network, two jobs). ``tolerance_s``: the search stops
    when the bound is known within this many seconds (default :data:`TOLERANCE` of the compute
    seconds); the value reported is the lower end, never above the true bound of the relaxation.

    Raises:
        InvalidArgument: a negative target or a tolerance that is not positive.
    """
    if target_nbytes < 0:
        raise InvalidArgument(f"target {target_nbytes:,} bytes is negative; give the combined peak to reach, >= 0")
    compute_s = float(timeline.durations_s.sum())
    tolerance_s = TOLERANCE * compute_s if tolerance_s is None else tolerance_s
    if not tolerance_s > 0:
        raise InvalidArgument(f"tolerance {tolerance_s!r} s is not positive; give the precision wanted, in seconds")
    model = _Model(timeline, cost, target_nbytes, integer)
    gaps = model.gaps
    swap, recompute = np.zeros(len(gaps)), np.zeros(len(gaps))
    if model.m == 0 or not model.coverable:
        extra_s = 0.0 if model.m == 0 else math.inf
        return Bound(extra_s, compute_s, target_nbytes, integer, 0, 0, swap, recompute, gaps)
    solves, iterations = 0, 0
    for j in model.watched.tolist():
        seconds, work = model.congestion(j)
        model.least_s, solves, iterations = max(model.least_s, seconds), solves + 1, iterations + work
    # B lies in [low, high] (LP(e) >= least_s > e below least_s); a solve at e of value v narrows
    # it to [min(e, v), max(e, v)]
    low, high, e = model.least_s, math.inf, model.least_s
    closing, consistent = None, False          # the solution to report, and whether its v <= e
    for _ in range(MAX_SOLVES):
        value_low, value_high, solution, work = model.solve(e)
        solves, iterations = solves + 1, iterations + work
        low, high = max(low, min(e, value_low)), min(high, max(e, value_high))
        if solution is not None and (value_high <= e or not consistent):
            closing, consistent = solution, value_high <= e
        if high - low <= tolerance_s:
            break
        # infeasible so far: the swaps free whole absences at whole_s, where the target is met
        e = (low + high) / 2 if math.isfinite(high) else max(2 * e, model.whole_s, tolerance_s)
    swap[model.relevant], recompute[model.relevant] = closing
    return Bound(low, compute_s, target_nbytes, integer, solves, iterations, swap, recompute, gaps)


class _Rows:
    """Rows of a sparse system being built, each ``A x <= rhs`` or each ``A x = rhs``: blocks of
    entries (rows counted from the block's first) and each new row's right-hand side."""

    def __init__(self):
        self.n = 0
        self.rows, self.columns, self.values, self.rhs = [], [], [], []

    def add(self, rows, columns, values, rhs) -> None:
        """Append ``len(rhs)`` rows, with entries at ``rows`` (from 0 for the first new row)."""
        self.rows.append(self.n + np.asarray(rows, dtype=np.int64))
        self.columns.append(np.asarray(columns, dtype=np.int64))
        self.values.append(np.asarray(values, dtype=np.float64))
        self.rhs.append(np.atleast_1d(np.asarray(rhs, dtype=np.float64)))
        self.n += len(self.rhs[-1])

    def matrix(self, n_columns: int) -> scipy.sparse.csr_array:
        return scipy.sparse.csr_array((np.concatenate(self.values),
                                       (np.concatenate(self.rows), np.concatenate(self.columns))),
                                      shape=(self.n, n_columns))


class _Model:
    """The programs of Note [Relaxation] and Note [Congestion] for one timeline, cost model and
    target, in scaled units (bytes over the largest excess, seconds over the compute seconds).

    The period's program is solved at any ``E_hat`` (:meth:`solve`). Its columns: ``E``; the
    bytes ``y_j`` freed at each event above the target (the *hot* events, ``m`` of them); ``w``
    of the swaps that free some hot event at that ``E_hat``; ``r`` of the recomputable absences.
    Only the absences that span a hot event (the *relevant* ones) have columns: the others free
    nothing that matters. Each watched event's program is solved once (:meth:`congestion`)."""

    def __init__(self, timeline: Timeline, cost: CostModel, target_nbytes: int, integer: bool):
        self.cost, self.integer, self.n = cost, integer, timeline.n
        self.gaps = absences(timeline)
        excess = timeline.usage([]) - target_nbytes
        hot = np.flatnonzero(excess > 0)
        self.m = m = len(hot)
        if m == 0:
            return
        self.hot = np.concatenate([hot, hot + self.n])        # (2m,) over two periods
        scale_nbytes = float(excess[hot].max())
        self.need = excess[hot] / scale_nbytes                # (m,) bytes each hot event must free, scaled
        self.compute_s = float(timeline.durations_s.sum())
        # the clock without a plan over two periods, so that the events of an absence run forward
        durations = np.tile(timeline.durations_s, 2)
        self.end_s = np.cumsum(durations)                     # (2n,) float64 s
        self.start_s = self.end_s - durations
        self.eps_s = 1e-9 * self.compute_s                    # the sums' rounding: windows a little wider
        a, b = self.gaps.a, self.gaps.b
        b = np.where(b > a, b, b + self.n)                    # on a's clock
        first, stop = self._hot_range(a + 1, b)
        self.relevant = g = np.flatnonzero(stop > first)
        self.a, self.b, self.first, self.stop = a[g], b[g], first[g], stop[g]
        nbytes = self.gaps.nbytes[g]
        self.size = nbytes / scale_nbytes                     # (g,) scaled bytes
        self.out_s = np.broadcast_to(cost.swap_out_s(nbytes), nbytes.shape)    # (g,) s
        self.in_s = np.broadcast_to(cost.swap_in_s(nbytes), nbytes.shape)
        self.whole_s = float(np.maximum(self.out_s, self.in_s).max())          # an E_hat at which swaps free all
        # what a swap costs the compute stream itself (Note [Issue cost] in .cost): its two issues,
        # and its two copies where they are made there, which then take no copy engine; under a
        # host budget a swap may go to the disk tier instead, whose copies take the channel, so
        # there its copies count as an engine's (Note [Relaxation])
        self.inline = (cost.host_budget_nbytes is None) & cost.inline(nbytes)         # (g,) bool
        self.own_s = np.where(self.inline, cost.inline_swap_s(nbytes), 2 * cost.issue_s)
        self.recomputable = r = np.flatnonzero(~np.isnan(self.gaps.recipe_s[g]))
        self.recipe_s = self.gaps.recipe_s[g][r]
        # the most each hot event can free, bytes: every relevant absence whole
        freed = np.zeros(m, dtype=np.int64)
        rows, columns, signs = self._frees(self.first, self.stop)
        np.add.at(freed, rows, -signs.astype(np.int64) * nbytes[columns])
        self.coverable = bool((np.cumsum(freed) >= excess[hot]).all())
        # watched: the hot event of most excess in each of WATCHED equal stretches of the period
        stretch = hot * WATCHED // self.n
        ranked = np.lexsort((-excess[hot], stretch))
        self.watched = ranked[np.r_[True, stretch[ranked][1:] != stretch[ranked][:-1]]]
        self.least_s = 0.0                                    # E >= this (Note [Congestion])

    def _hot_range(self, first: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The hot events among events ``first`` to ``stop - 1`` of the two-period clock (fewer
        than a period of them), as a range of indices into ``hot`` (empty where ``stop <=
        first``)."""
        return np.searchsorted(self.hot, first), np.searchsorted(self.hot, np.maximum(first, stop))

    def _frees(self, first: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row, variable, sign) of the memory rows' entries of variables ``0 .. len(first) - 1``
        that free hot events ``first`` to ``stop - 1`` (a range of ``hot``, not empty). Row ``j
        >= 1`` is ``y_j - y_{j-1}``, less the bytes of the variables that start to free at ``j``,
        plus those that stop (sign -1 and +1), = 0; row 0 is ``y_0`` less the bytes of those
        that free hot event 0. So each variable has at most three entries."""
        m = self.m
        later = first >= m                                    # in the second period: the same hot events
        first, stop = np.where(later, first - m, first), np.where(later, stop - m, stop)
        whole = stop - first >= m
        end = stop % m
        frees_0, starts, stops = (first == 0) | (stop > m) | whole, (first > 0) & ~whole, (end > 0) & ~whole
        variable = np.arange(len(first))
        rows = np.concatenate([np.zeros(frees_0.sum(), np.int64), first[starts], end[stops]])
        variables = np.concatenate([variable[frees_0], variable[starts], variable[stops]])
        signs = np.concatenate([np.full(frees_0.sum() + starts.sum(), -1.0), np.ones(stops.sum())])
        return rows, variables, signs

    def _busy(self, swaps: np.ndarray) -> list[np.ndarray]:
        """Per copy engine, the seconds over the compute seconds that each of the relevant
        absences ``swaps`` keeps it busy if swapped: swap-outs' and swap-ins' engines, or one
        channel for both unless the cost model is duplex."""
        engine = np.where(self.inline[swaps], 0.0, 1.0 / self.compute_s)     # an inline copy takes none
        out_s, in_s = self.out_s[swaps] * engine, self.in_s[swaps] * engine
        return [out_s, in_s] if self.cost.duplex else [out_s + in_s]

    def _engines(self, ub: _Rows, w_at: np.ndarray, swaps: np.ndarray) -> None:
        """The copy engines' rows for the swap columns ``w_at`` (of the relevant absences
        ``swaps``), ``E`` in column 0: each engine is busy at most a period, ``T + E``."""
        for busy in self._busy(swaps):
            ub.add(np.zeros(1 + len(w_at)), np.r_[0, w_at], np.r_[-1.0, busy], 1.0)

    def _compute_stream(self, ub: _Rows, r_at: np.ndarray, recomputes: np.ndarray, w_at: np.ndarray,
                        swaps: np.ndarray) -> None:
        """The compute stream's rows for the recompute columns ``r_at`` (of ``recomputable[
        recomputes]``) and the swap columns ``w_at`` (of the relevant absences ``swaps``), ``E``
        in column 0: the recomputes' seconds add to it, each swap's own seconds there (its issues,
        and its copies where they are made there), and the kernels' loss to each copy engine's
        seconds (Note [Relaxation]: ``c / (1 + c)`` of them)."""
        recompute_s = self.recipe_s[recomputes] / self.compute_s
        own_s = self.own_s[swaps] / self.compute_s
        for busy in self._busy(swaps):
            ub.add(np.zeros(1 + len(r_at) + len(w_at)), np.r_[0, r_at, w_at],
                   np.r_[-1.0, recompute_s, own_s + self.cost.kernel_loss * busy], 0.0)

    def _one_of_two(self, ub: _Rows, swap_at: np.ndarray, r_at: np.ndarray, recomputes: np.ndarray) -> None:
        """``w + r <= 1`` for the recompute columns ``r_at`` (of ``recomputable[recomputes]``)
        whose absence has a swap column too (``swap_at``: by relevant absence, -1 for none)."""
        swaps = swap_at[self.recomputable[recomputes]]
        both = np.flatnonzero(swaps >= 0)
        ub.add(np.repeat(np.arange(len(both)), 2), np.column_stack([swaps[both], r_at[both]]).ravel(),
               np.ones(2 * len(both)), np.ones(len(both)))

    def solve(self, e_hat: float) -> tuple[float, float, tuple[np.ndarray, np.ndarray] | None, int]:
        """Solve the period's program at ``E_hat = e_hat`` seconds, with ``E >= least_s``: (a
        lower and an upper estimate of the optimum in seconds, both inf if infeasible; (w, r)
        over the relevant absences, or None; the solver's work: simplex iterations, or
        branch-and-bound nodes)."""
        m = self.m
        # the hot events each swap frees: its swap-out done before they start, its swap-in
        # issued after they end and done by the next access
        free_from = np.searchsorted(self.start_s, self.end_s[self.a] + self.out_s - e_hat - self.eps_s)
        free_to = np.searchsorted(self.end_s, self.start_s[self.b] - self.in_s + e_hat + self.eps_s, "right")
        first, stop = self._hot_range(np.maximum(free_from, self.a + 1), np.minimum(free_to, self.b))
        swaps = np.flatnonzero(stop > first)
        n_w, n_r = len(swaps), len(self.recomputable)
        w_at, r_at = 1 + m + np.arange(n_w), 1 + m + n_w + np.arange(n_r)
        eq, ub = _Rows(), _Rows()
        # memory: y_j - y_{j-1} -/+ the bytes that start/stop being freed at j = 0, y_j >= need_j
        y = np.arange(m)
        w_rows, w_vars, w_signs = self._frees(first[swaps], stop[swaps])
        r_rows, r_vars, r_signs = self._frees(self.first[self.recomputable], self.stop[self.recomputable])
        eq.add(np.concatenate([y, y[1:], w_rows, r_rows]),
               np.concatenate([1 + y, y[:-1] + 1, w_at[w_vars], r_at[r_vars]]),
               np.concatenate([np.ones(m), -np.ones(m - 1), w_signs * self.size[swaps][w_vars],
                               r_signs * self.size[self.recomputable][r_vars]]),
               np.zeros(m))
        self._compute_stream(ub, r_at, np.arange(n_r), w_at, swaps)
        self._engines(ub, w_at, swaps)
        swap_at = np.full(len(self.relevant), -1)
        swap_at[swaps] = w_at
        self._one_of_two(ub, swap_at, r_at, np.arange(n_r))
        lower = np.r_[self.least_s / self.compute_s, self.need, np.zeros(n_w + n_r)]
        upper = np.r_[np.full(1 + m, np.inf), np.ones(n_w + n_r)]
        x, values, work = self._solve(ub, eq, lower, upper, n_integer=n_w + n_r if self.integer else 0)
        if x is None:
            return math.inf, math.inf, None, work
        w, r = np.zeros(len(self.relevant)), np.zeros(len(self.relevant))
        w[swaps], r[self.recomputable] = x[w_at], x[r_at]
        low, high = (max(0.0, v) * self.compute_s for v in values)
        return low, high, (np.clip(w, 0.0, 1.0), np.clip(r, 0.0, 1.0)), work

    def congestion(self, j: int) -> tuple[float, int]:
        """The least extra seconds of freeing hot event ``j`` alone, with the copy engines'
        congestion before and after it (Note [Congestion]), by a linear program; and the simplex
        iterations it took. Columns: ``E``, ``x`` of the relevant absences that span the event,
        ``r`` of those recomputable, the engines' running sums."""
        k, m = int(self.hot[j]), self.m
        spans = np.flatnonzero(((self.first <= j) & (j < self.stop)) | ((self.first <= j + m) & (j + m < self.stop)))
        recomputes = np.flatnonzero(np.isin(self.recomputable, spans))
        c, n_r = len(spans), len(recomputes)
        x_at, r_at = 1 + np.arange(c), 1 + c + np.arange(n_r)
        eq, ub = _Rows(), _Rows()
        ub.add(np.zeros(c + n_r), np.r_[x_at, r_at],
               -np.r_[self.size[spans], self.size[self.recomputable[recomputes]]], -self.need[j])
        self._compute_stream(ub, r_at, recomputes, x_at, spans)
        self._engines(ub, x_at, spans)
        swap_at = np.full(len(self.relevant), -1)
        swap_at[spans] = x_at
        self._one_of_two(ub, swap_at, r_at, recomputes)
        # each engine: the copies of the absences nearest the event first, their running sums
        # within the seconds between (swap-outs: from the end of a to the start of the event;
        # swap-ins: from the end of the event to the start of b) and E; one sum per distinct a
        # (or b): Z_i - Z_{i-1} - (the seconds of group i) = 0, Z_i - E <= seconds between
        a, b = self.a[spans], self.b[spans]
        k_at = np.where(k > a, k, k + self.n)                 # on a's clock
        n_columns = 1 + c + n_r
        # a copy made on the compute stream takes no engine: its seconds are in the compute row
        engine = ~self.inline[spans]
        for seconds, between_s in ((self.out_s[spans] * engine, self.start_s[k_at] - self.end_s[a]),
                                   (self.in_s[spans] * engine, self.start_s[b] - self.end_s[k_at])):
            order = np.argsort(between_s, kind="stable")
            limit_s, group = np.unique(between_s[order], return_inverse=True)    # ascending
            i = np.arange(len(limit_s))
            sum_at = n_columns + i
            eq.add(np.r_[i, i[1:], group], np.r_[sum_at, sum_at[:-1], x_at[order]],
                   np.r_[np.ones(len(i)), -np.ones(len(i) - 1), -seconds[order] / self.compute_s], np.zeros(len(i)))
            ub.add(np.r_[i, i], np.r_[sum_at, np.zeros(len(i), np.int64)], np.r_[np.ones(len(i)), -np.ones(len(i))],
                   limit_s / self.compute_s)
            n_columns += len(i)
        lower = np.zeros(n_columns)
        upper = np.r_[np.inf, np.ones(c + n_r), np.full(n_columns - 1 - c - n_r, np.inf)]
        x, values, work = self._solve(ub, eq, lower, upper, n_integer=0)
        return (math.inf if x is None else max(0.0, values[0]) * self.compute_s), work

    @staticmethod
    def _solve(ub: _Rows, eq: _Rows, lower: np.ndarray, upper: np.ndarray,
               n_integer: int) -> tuple[np.ndarray | None, tuple[float, float], int]:
        """Minimise column 0 subject to ``ub`` (<=), ``eq`` (=) and the columns' bounds, the last
        ``n_integer`` columns whole. Returns (the solution or None, a lower and an upper estimate
        of the optimum, the solver's work)."""
        objective = np.zeros(len(lower))
        objective[0] = 1.0
        a_ub, a_eq = ub.matrix(len(lower)), eq.matrix(len(lower))
        b_ub, b_eq = np.concatenate(ub.rhs), np.concatenate(eq.rhs)
        if n_integer:
            integrality = np.zeros(len(lower))
            integrality[len(lower) - n_integer:] = 1
            result = milp(objective, integrality=integrality, bounds=Bounds(lower, upper),
                          constraints=[LinearConstraint(a_ub, -np.inf, b_ub), LinearConstraint(a_eq, b_eq, b_eq)])
            return result.x, (result.mip_dual_bound, result.fun), int(result.mip_node_count or 0)
        # dual simplex: serial in HiGHS, so the same iterations every time
        result = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq,
                         bounds=np.column_stack([lower, upper]), method="highs-ds")
        return (result.x if result.status == 0 else None), (result.fun, result.fun), int(result.nit)
