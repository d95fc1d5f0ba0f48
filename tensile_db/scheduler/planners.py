"""Planners: which tensors leave the device between two of their accesses, how, and when.

Every planner returns a :class:`Plan` over the combined timeline of the measured jobs
(:mod:`tensile_db.scheduler.timeline`); the executor carries it out and the memory manager's
reactive eviction covers whatever the plan misses. A job that runs several iterations per period
is planned in each of them: its activations have one lifetime per iteration, and the plan's
actions are keyed by period position, so each iteration gets its own swaps and recomputes.

- :func:`plan_tensile` (TENSILE, Zhang et al., arXiv 2105.13336, section 4, changed where noted):
  while the combined timeline's peak is above the target, take the event at the peak and, among
  the tensors held there but not accessed, the absence that frees the peak at the least predicted
  extra time. A swap is timed so that the swap-out follows the last access before the absence and
  the swap-in completes before the next access (zero predicted stall where the absence is long
  enough for both copies); a recompute (an activation re-produced by its forward ops,
  :meth:`Program.recipe`) costs those ops' measured time. Parameters and optimizer state are
  ordinary candidates: their absence from the optimizer step to the next iteration's forward pass
  wraps around the period. Departures from the paper: the peak is the *combined* one (the paper
  sums per-job peaks), the bandwidth is measured, and the cheapest few swaps, the cheapest few
  recomputes (seconds per byte) and the few swaps of most slack (time between the swap-out's
  completion and the swap-in's latest start) are compared by simulating them with the copy
  channels shared (the paper scores each swap alone): the one that adds the least simulated time
  per byte of what the peak still needs wins. Ranking swaps by their stall predicted alone never let a
  recompute win where the copy channel was already busy: on the simulated H100, one ResNet-50
  at 70% of its peak lost 80% of its speed to swaps where checkpointing lost 24%; with the
  recomputes simulated beside the swaps it loses 6%.
- :func:`plan_swap_score`: the swap selection of Zhang, Yeung, Shu, He, Wang (arXiv 1903.06631,
  section IV): at the peak, rank the swappable tensors by duration of absence, by area of absence
  (bytes x duration) and by size, and swap the one with the best summed rank (a Borda majority
  vote of the three scores); swaps only, no recompute, each timed as above.
- :func:`plan_vdnn` (Rhu et al., vDNN, MICRO 2016, "vDNN_all"): every layer's (dense layer's or
  convolution's) input is swapped out
  after its last forward use, released when the next layer's forward starts, and prefetched when
  the backward pass of the layer above starts, whatever the budget.

With a host budget (Note [Tiers] in :mod:`~tensile_db.scheduler.cost`), the planners still time
and rank candidate swaps by the host tier's copy times: which tier a swap gets depends on the
other swaps in flight, so the simulation, which decides it, is what compares the candidates
(:func:`plan_tensile`) and predicts the plan's time and its bytes on disk.

Note [Redundant decisions]
--------------------------
Rationale: a greedy that frees one peak event at a time keeps every decision it took, though a
later one can free all that an earlier one freed. Cheap swaps come first, each hidden alone;
the peak that is left then needs large ones, which also cover the events the small ones were
taken for. On the simulated H100 (FP32), TENSILE's choice brings one VGG-16 to 70% of its peak
with 56 decisions, predicting +1.07 of extra time per iteration. 27 of them are redundant once
fc6's 392 MiB tensors are swapped. Without them the plan predicts +0.90: fewer copies share the
engines, so the large swap-ins stall less.

Approach (:func:`drop_redundant`, the global planner's last step): the reverse-delete pass of
greedy covering (as for set cover; compare Kruskal's reverse-delete). Go over the decisions, the
costliest first (the seconds of a swap's two copies, or of a recompute's ops), and leave one out
wherever every event of its absence still stays at or below the ceiling without it. The ceiling
is the target, or the plan's peak where a partial plan has not reached it. A left-out decision
only keeps its tensor on the device over its absence. Every remaining recompute still finds its
inputs held, and every other absence is unchanged. On the planners' simulation
(:class:`~.timeline.Simulator`), fewer copies in FIFO order and fewer recomputes never delay an
event, so the predicted time does not grow (with a host budget a swap's tier can change, so
there it is not guaranteed). Only the device bytes are checked, one vectorised
test per decision; the work is counted and paid like the rest (Note [Planning cost model] in
:mod:`~.work`).

Limitations: one pass in one order, not the smallest redundant-free subset.

Note [Widened absences]
-----------------------
Rationale: the greedy times a swap for the peak it is taken at: released once its swap-out has
completed, swapped in as late as its copy allows (:meth:`_State._options_of`). Its absence can
then end before a later peak within the same gap between the tensor's accesses, and the gap, once
taken, was no candidate there; where every tensor spanning that peak was taken so, the greedy
stopped above its target. The MLP of ``bench/throughput.py`` with its budget at its largest
working set (Adam's step on the 512 x 512 layer, 4 MiB): the swap of the next layer's weights,
taken for a peak of the backward pass, was swapped in before the step of that layer, since the
op between (the bias's step) was too short to hide the copy; the plan stopped at 5,242,880 of a
4,194,304-byte target and the reactive fallback evicted at every iteration.

Approach: at a peak, each swap taken whose gap spans the peak event but whose absence does not is
a candidate too, re-timed to free it: released at the event where its release came after it,
else swapped in right after it (:meth:`_State.widenings`), and weighed by the same simulation as
the others (the stall of a copy it no longer hides is its cost). Taking one replaces the swap it
widens (:meth:`_State.add`); a curve keeps it as a step of its own, so each prefix of a curve is
still a plan (:func:`applied`), and the combination replaces the swap in its plan. A widening
never covers an event where a recompute planned since reads the tensor. The MLP's plan reaches
its target (4,194,304 bytes, 29 decisions). On the simulated H100 (``bench/paper.py``) the EOR of
``tensile`` went, on the mixed arrival of four models, from +0.008 to +0.000 at 70%, +0.099 to
+0.070 at 50% and +0.307 to +0.302 at 35%; on one ResNet-50 at 35% from +0.521 to +0.456; on
four at 35% from +0.140 to +0.143; elsewhere unchanged. TENSILE as published (the
``tensile_published`` baseline) does not widen.

Limitations: recomputes are not widened; of the widenings at a peak, the
:data:`SIMULATED_CANDIDATES` largest are simulated.

Note [Re-timed swaps]
---------------------
Rationale: the greedy times each swap alone (:meth:`_State._options_of`): its release at the
first event after its swap-out completes and its swap-in at the last event from which the copy
still completes in time, each on an idle copy engine. The copies of a plan queue behind each
other, so a swap-in issued at that last moment waits behind the ones issued before it, and the
op that needs the tensor waits too. On the simulated H100 with TF32, one ResNet-50 at 50% of
its peak had 3.4 ms of such waits in a 8.9 ms iteration. Its six swaps had each several
milliseconds between their swap-out and swap-in to spare.

Approach (:func:`retime_swaps`, after :func:`drop_redundant` in the global planner): simulate
the plan (:class:`~.timeline.Simulator` records how long each release and each access waited in
the second period). Each swap whose swap-in was late by ``w`` is issued at the event ``w``
earlier on the simulated clock. Each release that waited ``w`` for its swap-out moves to the event
``w`` later. Each move goes only as far as every event it adds to the tensor's residency stays
at or below the ceiling, so the plan's peak never rises. Longer waits come first, and the rounds
repeat (at most :data:`RETIME_ROUNDS`) while something moves. The fastest simulated round is
kept, so the predicted time never grows. On the roofline timelines of the simulated H100, with
targets of 95% of 35% or 50% of the peak, the global planner's predicted extra time per
iteration with both passes against neither: one ResNet-50 at 35%, +0.54 -> +0.38 (FP32) and
+1.63 -> +1.32 (TF32); four ResNet-50 at 35%, +0.26 -> +0.16 (FP32); one Inception-V3 at 50%,
+0.32 -> +0.22 (FP32).

Limitations: a moved copy changes when the others run, so one round's moves can make another
copy late; the rounds and the choice of the fastest bound that. A swap that no room lets move
keeps its wait.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from .cost import CostModel
from .timeline import Decision, Simulation, Simulator, TensorInfo, Timeline, simulate

#: candidates compared by a full simulation per step of :func:`plan_tensile`
SIMULATED_CANDIDATES = 4
#: swaps of the most slack also simulated per step, beyond those ranked first
SLACK_CANDIDATES = 2
#: rounds of re-timing the swaps of a global plan on the copy queues (Note [Re-timed swaps])
RETIME_ROUNDS = 4
#: upper bounds on one plan: decisions, and seconds spent choosing them
MAX_DECISIONS = 4096
MAX_PLAN_SECONDS = 2.0


#: The actions a plan takes, by name: the memory manager's asynchronous operations.
ACTIONS = ("swap_out", "release", "swap_in", "drop")


@dataclass
class Plan:
    """A schedule of swap-outs, releases, swap-ins and drops over one period (:data:`ACTIONS`).

    Attributes:
        policy: the planner's name.
        decisions: the planned absences.
        before: (job_id, q) -> actions to take before the op at period position ``q`` of the
            job (:class:`~.timeline.Timeline`): ``("release", job, slot)`` then
            ``("swap_in", job, slot)``.
        after: (job_id, q) -> ``("swap_out", job, slot)`` and ``("drop", job, slot)``.
        predicted_peak_nbytes: the combined peak of the measured jobs under the plan.
        vanilla_peak_nbytes: the same without a plan.
        target_nbytes: the peak the planner aimed for.
        simulation: predicted timing (:class:`Simulation`).
        partial: the planner stopped for its budget before the target with more to take: a
            re-plan goes on from where it stopped (:func:`~.curves.plan_global`).
        curve_work: the global planner's curve work in this plan, by curve (its memo key ->
            :class:`~.work.PlanWork`).
    """

    policy: str
    timeline: Timeline | None = None
    decisions: list[Decision] = field(default_factory=list)
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    predicted_peak_nbytes: int | None = None
    vanilla_peak_nbytes: int | None = None
    target_nbytes: int | None = None
    simulation: Simulation | None = None
    partial: bool = False
    curve_work: dict = field(default_factory=dict)

    @classmethod
    def build(cls, policy: str, timeline: Timeline, decisions: list[Decision], cost: CostModel,
              target_nbytes: int | None) -> "Plan":
        plan = cls(policy, timeline, decisions, target_nbytes=target_nbytes)
        for d in decisions:
            at = timeline.events
            if d.method == "swap":
                plan.after.setdefault(at[d.a], []).append(("swap_out", d.job_id, d.slot))
                plan.before.setdefault(at[d.free], []).append(("release", d.job_id, d.slot))
                plan.before.setdefault(at[d.back], []).append(("swap_in", d.job_id, d.slot))
            else:
                plan.after.setdefault(at[d.a], []).append(("drop", d.job_id, d.slot))
        for actions in plan.before.values():
            actions.sort(key=lambda a: a[0] != "release")        # free before taking
        plan.predicted_peak_nbytes = int(timeline.usage(decisions).max())
        plan.vanilla_peak_nbytes = timeline.vanilla_peak_nbytes()
        plan.simulation = simulate(timeline, decisions, cost)
        return plan

    def same_actions(self, other: "Plan | None") -> bool:
        """Whether ``other`` takes the same actions at the same period positions as this plan
        (None, no plan, takes none): the memory's events over a period are then the same under
        either, so what was recorded of them (the planned pool's lifetimes) still holds when one
        replaces the other."""
        if other is None:
            return not self.before and not self.after
        return self.before == other.before and self.after == other.after

    @property
    def predicted_extra_s(self) -> float | None:
        return self.simulation.extra_s if self.simulation else None

    @property
    def predicted_disk_nbytes(self) -> int | None:
        """Bytes the plan swaps out to the disk tier per period, predicted (0 without a host budget)."""
        return self.simulation.disk_nbytes if self.simulation else None


# --- absences -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Gap:
    tensor: TensorInfo
    a: int                 # event of the access before the absence
    b: int                 # event of the access after it
    pa: int                # the same as period positions of the job
    pb: int
    # (inputs, seconds, workspace bytes) of recomputing the tensor at ``b``, if the program allows it there
    recipe: tuple[tuple[str, ...], float, int] | None = field(default=None, compare=False)


@dataclass
class _Options:
    """What each of some gaps, all spanning event ``k``, could become under the decisions so far:
    the swap that frees ``k`` (:meth:`_State.swap`) and the seconds of a recompute. One entry per
    gap; arrays of shape (g,)."""

    gaps: list[_Gap]
    k: int
    a: np.ndarray              # int64 event of the access before the absence
    nbytes: np.ndarray         # int64 bytes
    free: np.ndarray           # int64 event: released before it
    back: np.ndarray           # int64 event: swap-in issued before it
    back_s: np.ndarray         # float64 s, start of the next access on the clock of the one before
    stall_s: np.ndarray        # float64 s, the swap's predicted stall
    slack_s: np.ndarray        # float64 s, from the swap-out's completion to the swap-in's latest start
    recipe_s: np.ndarray       # float64 s, the recompute's ops; NaN where the program cannot

    @functools.cached_property
    def position(self) -> dict[int, int]:
        """id(gap) -> its entry."""
        return {id(g): i for i, g in enumerate(self.gaps)}

    @functools.cached_property
    def _swaps(self) -> list[tuple[int, int, float]]:
        """(free, back, stall_s) of each entry, as Python numbers."""
        return list(zip(self.free.tolist(), self.back.tolist(), self.stall_s.tolist()))

    def swap(self, i: int) -> tuple[Decision, float]:
        """Entry ``i``'s swap, and its predicted stall in seconds."""
        g, (free, back, stall_s) = self.gaps[i], self._swaps[i]
        return Decision(g.tensor.job_id, g.tensor.slot, g.tensor.nbytes, "swap", g.a, g.b, free, back), stall_s


#: A gap in the store of :class:`_State`: its events, the events from ``a`` to ``b`` (``n`` when
#: they are equal), its tensor's bytes, its place in the candidates' order (tensor index, place
#: among the tensor's gaps), its recompute's seconds (NaN where the program cannot), and whether
#: it is still a gap (a decision replaces those of the slots it touches).
_GAP_ROW = np.dtype([("a", np.int64), ("b", np.int64), ("span", np.int64), ("nbytes", np.int64),
                     ("order", np.int64), ("recipe_s", np.float64), ("live", np.bool_)])


class _State:
    """The planner's working state: decisions so far, accesses added by recomputes, the usage and
    the simulation under the decisions, and every absence not decided yet.

    The absences (gaps) of all tensors live in one store of arrays, so that those spanning an
    event are found and their swaps timed at once. A decision replaces the gaps of the slots it
    touches (its own, and the inputs a recompute reads); the replaced ones stay in the store,
    marked dead.
    """

    def __init__(self, timeline: Timeline, cost: CostModel):
        self.tl = timeline
        self.cost = cost
        self.decisions: list[Decision] = []
        self.steps: list[Decision] = []                     # every decision taken, widenings too, in order
        self.taken: set[tuple[int, str, int]] = set()       # (job, slot, a) already decided
        self._swap_index: dict[tuple[int, str, int], int] = {}   # (job, slot, a) of a swap -> its index in decisions
        self.extra: dict[tuple[int, str], set[int]] = {}    # positions read by planned recomputes
        self.use = timeline.usage([])                       # (n,) int64 bytes per event under the decisions
        self._absent: dict[tuple[int, str], list[tuple[int, int]]] = {}   # (job, slot) -> its windows
        self._recipes: dict[tuple[int, str], tuple[int, tuple[str, ...], float] | None] = {}
        self._options: _Options | None = None                        # of the last candidates
        self._simulator = Simulator(timeline, cost)                  # the decisions, to simulate
        self._set_sim(self._simulator.simulate())
        # the store: every gap found, by index (_Gap objects, and their rows of _GAP_ROW)
        self._gaps = np.empty(0, dtype=object)
        self._rows = np.empty(0, dtype=_GAP_ROW)
        self._index: dict[int, int] = {}                    # id(gap) -> index
        self._of_tensor: list[list[int]] = [[] for _ in timeline.tensors]
        self._tensor_index = {(t.job_id, t.slot, t.repeat): i for i, t in enumerate(timeline.tensors)}
        self._tensors_of: dict[tuple[int, str], list[int]] = {}       # (job, slot) -> tensor indices
        for i, t in enumerate(timeline.tensors):
            self._tensors_of.setdefault((t.job_id, t.slot), []).append(i)
        self._renew(range(len(timeline.tensors)))

    def _set_sim(self, sim: Simulation) -> None:
        self.sim = sim
        # (2n,) float64 s: every event's start in the simulated period, then a period later
        self._clock_s = np.concatenate([sim.start_s, sim.start_s + sim.period_s])
        self._options = None

    # --- gaps

    def gaps(self, t: TensorInfo) -> list[_Gap]:
        """The absences of ``t`` not decided yet."""
        return [self._gaps[i] for i in self._of_tensor[self._tensor_index[(t.job_id, t.slot, t.repeat)]]]

    def _find_gaps(self, t: TensorInfo) -> list[_Gap]:
        extra = self.extra.get((t.job_id, t.slot), set())
        if not t.persistent:                                # only the reads within this lifetime
            extra = {q for q in extra if t.positions[0] <= q <= t.positions[-1]}
        pos = sorted(set(t.positions) | extra)
        pairs = list(zip(pos, pos[1:]))
        if t.persistent:
            pairs.append((pos[-1], pos[0]))
        out = []
        for pa, pb in pairs:
            a, b = self.tl.index[(t.job_id, pa)], self.tl.index[(t.job_id, pb)]
            if (t.job_id, t.slot, a) not in self.taken:
                out.append(_Gap(t, a, b, pa, pb, self._recipe_at(t, pa, pb)))
        return out

    def _renew(self, tensors) -> None:
        """Replace the gaps of the tensors (indices into ``timeline.tensors``) by those found now."""
        gaps, rows = [], []
        for ti in tensors:
            self._rows["live"][self._of_tensor[ti]] = False
            self._of_tensor[ti] = []
            for j, g in enumerate(self._find_gaps(self.tl.tensors[ti])):
                index = len(self._gaps) + len(gaps)
                self._of_tensor[ti].append(index)
                self._index[id(g)] = index
                gaps.append(g)
                rows.append((g.a, g.b, self.tl.cyclic(g.a, g.b) or self.tl.n, g.tensor.nbytes, ti << 32 | j,
                             math.nan if g.recipe is None else g.recipe[1], True))
        self.tl.work.items += len(gaps)
        new = np.empty(len(gaps), dtype=object)
        new[:] = gaps
        self._gaps = np.concatenate([self._gaps, new])
        self._rows = np.concatenate([self._rows, np.array(rows, dtype=_GAP_ROW)])

    def candidates(self, k: int) -> list[_Gap]:
        """The gaps with event ``k`` strictly between their accesses, in the order of
        ``timeline.tensors`` (each tensor's in the order of its accesses); their
        :meth:`options` are computed with them."""
        rows = self._rows
        self.tl.work.rows += len(rows)
        after = (k - rows["a"]) % self.tl.n
        index = np.flatnonzero(rows["live"] & (after > 0) & (after < rows["span"]))
        index = index[np.argsort(rows["order"][index], kind="stable")]
        gaps = self._gaps[index].tolist()
        self._options = self._options_of(gaps, index, k)
        return gaps

    # --- what a gap can become

    def options(self, gaps: list[_Gap], k: int) -> _Options:
        """The swaps that free event ``k`` and the recompute seconds of ``gaps`` (all spanning
        ``k``), on the current simulation."""
        if self._options is not None and self._options.gaps is gaps and self._options.k == k:
            return self._options
        return self._options_of(gaps, np.array([self._index[id(g)] for g in gaps], dtype=np.int64), k)

    def _options_of(self, gaps: list[_Gap], index: np.ndarray, k: int) -> _Options:
        """Each swap timed as early/late as the copies allow: the release at the first event from
        ``a + 1`` (at the latest ``k``) that starts once the swap-out has completed, the swap-in
        at the last event up to ``b`` (at the earliest ``k + 1``) that starts early enough for it
        to complete by the start of ``b``; the stall is what either misses by. So every swap
        frees ``k`` (``free <= k < back``). On the clock of event ``a`` (events from ``a + 1``
        on, a period later once they wrap: ``_clock_s``), start times never decrease, so both
        events are found by bisection."""
        n, clock_s, rows = self.tl.n, self._clock_s, self._rows[index]
        a, b, nbytes = rows["a"], rows["b"], rows["nbytes"]
        k_at = np.where(k > a, k, k + n)                    # k, b and the events found, on a's clock
        b_at = np.where(b > a, b, b + n)
        out_done_s = self.sim.start_s[a] + self.tl.durations_s[a] + self.cost.swap_out_s(nbytes)
        back_s = clock_s[b_at]
        need_by_s = back_s - self.cost.swap_in_s(nbytes)
        free = np.minimum(np.maximum(a + 1, np.searchsorted(clock_s, out_done_s, "left")), k_at)
        back = np.maximum(np.minimum(b_at, np.searchsorted(clock_s, need_by_s, "right") - 1), k_at + 1)
        stall_s = np.maximum(0.0, out_done_s - clock_s[free]) + np.maximum(0.0, clock_s[back] - need_by_s)
        return _Options(gaps, k, a, nbytes, free % n, back % n, back_s, stall_s, need_by_s - out_done_s,
                        rows["recipe_s"])

    def swap(self, gap: _Gap, k: int) -> tuple[Decision, float]:
        """The swap of ``gap`` that frees event ``k``, timed as early/late as the copies allow
        (:meth:`_options_of`), with its predicted stall in seconds."""
        options = self._options
        i = options.position.get(id(gap)) if options is not None and options.k == k else None
        if i is None:
            options, i = self.options([gap], k), 0
        return options.swap(i)

    def _recipe(self, job_id: int, slot: str) -> tuple[int, tuple[str, ...], float, int] | None:
        """(the recipe's last op, the slots it reads, its ops' measured seconds, its workspace
        bytes) of the slot, or None if it is not recomputable (:meth:`Program.recipe`)."""
        key = (job_id, slot)
        if key not in self._recipes:
            prog = self.tl.program(job_id)
            recipe = prog.recipe(slot)
            times = self.tl.traces[job_id].sequence.times_s
            self._recipes[key] = None if recipe is None else (
                recipe[-1], tuple(sorted(prog.recipe_inputs_of(recipe, slot))), float(sum(times[p] for p in recipe)),
                prog.recipe_workspace_nbytes(recipe))
        return self._recipes[key]

    def _recipe_at(self, t: TensorInfo, pa: int, pb: int) -> tuple[tuple[str, ...], float, int] | None:
        """(inputs, seconds, workspace bytes) of recomputing ``t`` at period position ``pb`` after its absence
        from ``pa``, if the program allows it there: the recipe ran before the absence, which
        does not wrap."""
        recipe = self._recipe(t.job_id, t.slot)
        if recipe is None or pa % self.tl.n_program_ops(t.job_id) < recipe[0] or pb <= pa:
            return None
        return recipe[1], recipe[2], recipe[3]

    def recompute(self, gap: _Gap) -> Decision | None:
        """The recompute of ``gap``'s tensor at its next access, if the program allows it there
        and the recipe's inputs are held at that event under the decisions so far."""
        if gap.recipe is None:
            return None
        t, (inputs, seconds, workspace) = gap.tensor, gap.recipe
        for name in (t.slot, *inputs):
            for start, length in self._absent.get((t.job_id, name), ()):
                if self.tl.cyclic(start, gap.b) < length:
                    return None
        return Decision(t.job_id, t.slot, t.nbytes, "recompute", gap.a, gap.b, (gap.a + 1) % self.tl.n,
                        gap.b, seconds, inputs, workspace)

    # --- decisions

    def widenings(self, k: int) -> list[Decision]:
        """The swaps decided so far whose gap spans event ``k`` but whose absence does not, each
        re-timed to free ``k`` too: released at ``k`` where its release came after it, else
        swapped in at ``k + 1`` (Note [Widened absences]); largest first."""
        n, out = self.tl.n, []
        self.tl.work.rows += len(self._swap_index)
        for i in self._swap_index.values():
            d = self.decisions[i]
            after = (k - d.a) % n
            start, length = d.window(n)
            if not 0 < after < ((d.b - d.a) % n or n) or (k - start) % n < length:
                continue
            wide = replace(d, free=k) if after < (start - d.a) % n else replace(d, back=(k + 1) % n)
            reads = self.extra.get((d.job_id, d.slot), ())        # by recomputes planned since
            first, events = wide.window(n)
            if not any((self.tl.index[(d.job_id, q)] - first) % n < events for q in reads):
                out.append(wide)
        return sorted(out, key=lambda d: -d.nbytes)

    def trial(self, d: Decision) -> float:
        """The simulated extra seconds per period of the decisions so far and ``d`` (in place of
        the swap it re-times, for a widening) (:meth:`~.timeline.Simulator.extra_s`: no op start
        times, so a trial costs the events with actions only; :meth:`add` simulates the one taken
        in full)."""
        return self._simulator.extra_s(also=d, instead=self._swap_index.get(widened_key(d)))

    def add(self, d: Decision) -> None:
        """Take ``d``: a new decision, or a widening of a swap taken before (:meth:`widenings`),
        which replaces it."""
        self.steps.append(d)
        self.tl.work.decisions += 1
        swap = widened_key(d)
        if swap in self._swap_index:
            self._widen(self._swap_index[swap], d)
            return
        if swap is not None:
            self._swap_index[swap] = len(self.decisions)
        self.decisions.append(d)
        self.taken.add((d.job_id, d.slot, d.a))
        window = d.window(self.tl.n)
        self.tl.add_decision(self.use, d)
        self._absent.setdefault((d.job_id, d.slot), []).append(window)
        touched = [d.slot]
        if d.method == "recompute":
            pb = self.tl.events[d.b][1]
            for name in d.recipe_inputs:
                self.extra.setdefault((d.job_id, name), set()).add(pb)
                touched.append(name)
        self._renew(i for name in dict.fromkeys(touched) for i in self._tensors_of[(d.job_id, name)])
        self._simulator.add(d)
        self._set_sim(self._simulator.simulate())

    def _widen(self, i: int, d: Decision) -> None:
        """Replace swap ``i`` by ``d``, the same swap with a longer absence."""
        n, old = self.tl.n, self.decisions[i]
        self.decisions[i] = d
        self.tl.add_window(self.use, *old.window(n), old.nbytes)
        self.tl.add_window(self.use, *d.window(n), -d.nbytes)
        windows = self._absent[(d.job_id, d.slot)]
        windows[windows.index(old.window(n))] = d.window(n)
        self._simulator.retime(i, d)
        self._set_sim(self._simulator.simulate())


def widened_key(d: Decision) -> tuple[int, str, int] | None:
    """(job, slot, a) of a swap, None for a recompute: a swap taken later with the same key is a
    widening of it, and stands in its place (Note [Widened absences])."""
    return (d.job_id, d.slot, d.a) if d.method == "swap" else None


def applied(steps: list[Decision]) -> list[Decision]:
    """The plan that a sequence of decisions taken makes (a curve's prefix, :attr:`_State.steps`):
    each widening (:func:`widened_key`) stands in the earlier swap's place."""
    plan: list[Decision] = []
    where: dict[tuple[int, str, int], int] = {}
    for d in steps:
        key = widened_key(d)
        if key in where:
            plan[where[key]] = d
            continue
        if key is not None:
            where[key] = len(plan)
        plan.append(d)
    return plan


def _greedy_steps(state: _State, target_nbytes: int | np.ndarray, choose, max_seconds: float | None):
    """Take decisions into ``state`` while its peak is above ``target_nbytes``: at the peak event,
    ``choose(state, candidates, k)`` picks one (None: the target is out of reach). Yields after
    each decision taken; stops at :data:`MAX_DECISIONS` or after ``max_seconds`` (None: no limit).
    ``target_nbytes`` may be an (n,) array of per-event targets (:meth:`~.timeline.Timeline.targets`,
    Note [Targets under the floor] in :mod:`~tensile_db.scheduler.engine`): then the fullest
    event above its own target is the peak, and one out of reach is passed over, not the end."""
    passed = np.zeros(state.use.shape, dtype=bool)
    deadline = time.monotonic() + (math.inf if max_seconds is None else max_seconds)
    while len(state.steps) < MAX_DECISIONS and time.monotonic() < deadline:
        peak = peak_above(state.use, target_nbytes, passed)
        if peak is None:
            return
        k = peak[0]
        candidates = state.candidates(k)
        decision = choose(state, candidates, k) if candidates or getattr(choose, "widens", False) else None
        if decision is None:
            if isinstance(target_nbytes, np.ndarray):
                passed[k] = True
                continue
            return                              # the target is out of reach; reactive covers the rest
        state.add(decision)
        yield decision


def peak_above(use: np.ndarray, target_nbytes: int | np.ndarray, passed: np.ndarray) -> tuple[int, int] | None:
    """The event a planner frees next and the bytes it needs there: (k, bytes above its target)
    of the fullest event of ``use`` ((n,) bytes) above ``target_nbytes``, or None when none is
    above. ``target_nbytes``: bytes, one for every event, or an (n,) array of each event's, where
    the events marked in ``passed`` ((n,) bool) are left out."""
    if not isinstance(target_nbytes, np.ndarray):
        k = int(np.argmax(use))
        return (k, int(use[k]) - target_nbytes) if use[k] > target_nbytes else None
    over = (use > target_nbytes) & ~passed
    if not over.any():
        return None
    k = int(np.argmax(np.where(over, use, -1)))
    return k, int(use[k] - target_nbytes[k])


def target_at(target_nbytes: int | np.ndarray, k: int) -> int:
    """Event ``k``'s target, bytes: ``target_nbytes`` itself, or its ``k``-th entry where it is
    per event."""
    return int(target_nbytes[k]) if isinstance(target_nbytes, np.ndarray) else target_nbytes


def _greedy(policy: str, timeline: Timeline, cost: CostModel, target_nbytes: int, choose,
            max_seconds: float | None) -> Plan:
    state = _State(timeline, cost)
    for _ in _greedy_steps(state, target_nbytes, choose, max_seconds):
        pass
    return Plan.build(policy, timeline, state.decisions, cost, target_nbytes)


def drop_redundant(timeline: Timeline, decisions: list[Decision], cost: CostModel,
                   ceiling_nbytes: int | np.ndarray) -> list[Decision]:
    """The decisions less those the others make redundant (Note [Redundant decisions]): each in
    turn, the costliest first (a swap's two copies' seconds, a recompute's ops'), is left out if
    without it no event holds more than ``ceiling_nbytes`` bytes (one for every event, or an (n,)
    array of each event's). Returns a new list, in the order of ``decisions``; the work is
    counted on ``timeline.work``."""
    use = timeline.usage(decisions)
    per_event = isinstance(ceiling_nbytes, np.ndarray)
    seconds = [cost.swap_out_s(d.nbytes) + cost.swap_in_s(d.nbytes) if d.method == "swap" else d.recipe_s
               for d in decisions]
    dropped = set()
    for i in sorted(range(len(decisions)), key=lambda i: -seconds[i]):
        d = decisions[i]
        start, length = d.window(timeline.n)
        window = np.arange(start, start + length)
        held = use.take(window, mode="wrap")            # the absence, cyclic
        timeline.work.items += 2           # the check and its bookkeeping, about 5 us here (NumPy's part is small)
        if held.size and (bool(np.any(held + d.nbytes > ceiling_nbytes.take(window, mode="wrap"))) if per_event
                          else int(held.max()) + d.nbytes > ceiling_nbytes):     # ``b`` lies after the window
            continue
        timeline.add_window(use, start, length, d.nbytes)
        use[d.b] -= d.workspace_nbytes
        dropped.add(i)
    return [d for i, d in enumerate(decisions) if i not in dropped]


def retime_swaps(timeline: Timeline, decisions: list[Decision], cost: CostModel, ceiling_nbytes: int | np.ndarray,
                 rounds: int = RETIME_ROUNDS) -> list[Decision]:
    """The decisions with their swaps re-timed on the copy queues (Note [Re-timed swaps]): where
    the simulation has the op that needs a swapped tensor wait for its swap-in, the swap-in is
    issued earlier by the time waited, and where a release waits for its swap-out, the release
    comes later by as much, each only as far as every event stays at or below
    ``ceiling_nbytes`` bytes (one for every event, or an (n,) array of each event's). Up to
    ``rounds`` rounds, each simulated; returns the decisions of the round that simulated fastest
    (``decisions`` itself if none beat it), a new list. The work is counted on
    ``timeline.work``."""
    current = list(decisions)
    best, best_s = current, math.inf
    for done in range(rounds + 1):
        simulator = Simulator(timeline, cost, current)
        sim = simulator.simulate()
        if sim.extra_s < best_s - 1e-12:
            best, best_s = list(current), sim.extra_s
        if done == rounds or not simulator.waited_s or not _retime_round(timeline, current, sim, simulator.waited_s,
                                                                         ceiling_nbytes):
            break
    return best


def _retime_round(timeline: Timeline, decisions: list[Decision], sim: Simulation, waited_s: dict[int, float],
                  ceiling_nbytes: int | np.ndarray) -> bool:
    """One round of :func:`retime_swaps` on ``decisions``, in place, from ``sim`` and the waits
    of its second period (:attr:`~.timeline.Simulator.waited_s`); returns whether a swap moved."""
    n, start_s, period_s = timeline.n, sim.start_s, sim.period_s
    use = timeline.usage(decisions)
    ceiling = np.broadcast_to(ceiling_nbytes, use.shape)
    moved = False
    for key, late_s in sorted(waited_s.items(), key=lambda kv: -kv[1]):
        i = key if key >= 0 else ~key
        d = decisions[i]
        if key < 0:                     # its swap-in came late: issue it earlier
            issue_s, e = start_s[d.back] - late_s, d.back
            while True:
                before = (e - 1) % n
                if before == d.free or use[before] + d.nbytes > ceiling[before]:
                    break
                e = before
                use[e] += d.nbytes
                if start_s[e] - (period_s if e > d.back else 0.0) <= issue_s:
                    break
            timeline.work.items += (d.back - e) % n
            if e != d.back:
                decisions[i], moved = replace(d, back=e), True
        else:                           # its release waited for the swap-out: release later
            want_s, f = start_s[d.free] + late_s, d.free
            while True:
                after = (f + 1) % n
                if after == d.back or use[f] + d.nbytes > ceiling[f]:
                    break
                use[f] += d.nbytes
                f = after
                if start_s[f] + (period_s if f < d.free else 0.0) >= want_s:
                    break
            timeline.work.items += (f - d.free) % n
            if f != d.free:
                decisions[i], moved = replace(d, free=f), True
    return moved


def tensile_choice(cost: CostModel, target_nbytes: int | np.ndarray, widen: bool = True):
    """TENSILE's choice at a peak (see the module docstring), as ``choose(state, gaps, k)`` for
    :func:`_greedy_steps`: the decision that adds the least simulated time per byte of what the
    peak still needs above ``target_nbytes`` (one for every event, or per event: :func:`target_at`);
    with ``widen``, a widening of a swap taken before among the candidates (Note [Widened
    absences])."""

    def choose(state: _State, gaps: list[_Gap], k: int) -> Decision | None:
        # Option 2i is gap i's swap, 2i + 1 its recompute where the program allows one. Swaps are
        # ranked by (predicted stall, -bytes, transfer seconds), recomputes by seconds per byte;
        # the first few swaps and the first few recomputes whose inputs are held are simulated
        # (a swap's stall is predicted alone, so on a busy copy channel a recompute can be the
        # cheaper of the two only by simulation), and so are the few swaps of most slack not yet
        # among them; the one that adds the least simulated time per byte it frees of what the
        # peak needs wins (ties: the most bytes). Ranked by stall then bytes alone, the large
        # activations whose swaps are predicted to hide came first, and the optimizer state and
        # weights, absent from one step to the next forward pass with room for their copies
        # around everyone's, were never simulated: one ResNet-50 at 35% of its peak swapped 5 of
        # its 161 Adam moments and recomputed activations instead.
        opt = state.options(gaps, k)
        m = len(gaps)
        first, nbytes, transfer_s = np.empty(2 * m), np.repeat(-opt.nbytes, 2), np.zeros(2 * m)
        first[0::2], first[1::2] = opt.stall_s, opt.recipe_s / opt.nbytes
        transfer_s[0::2] = cost.swap_out_s(opt.nbytes) + cost.swap_in_s(opt.nbytes)
        ranked = np.flatnonzero(~np.isnan(first))
        ranked = ranked[np.lexsort((transfer_s[ranked], nbytes[ranked], first[ranked]))]
        need = int(state.use[k]) - target_at(target_nbytes, k)
        base_s = state.sim.extra_s
        best, best_key, tried = None, None, [0, 0]
        simulated = set()

        def weigh(o: int, d: Decision | None = None) -> None:
            nonlocal best, best_key
            if d is None:
                d = opt.swap(o // 2)[0] if o % 2 == 0 else state.recompute(gaps[o // 2])
            if d is None:
                return                          # its recipe's inputs are absent there
            useful = min(d.nbytes, need)
            extra_s = max(state.trial(d) - base_s, 0.0)
            key = (extra_s / useful, -useful)
            tied = best is not None and abs(key[0] - best_key[0]) <= 1e-15
            if best is None or (key[1] < best_key[1] if tied else key[0] < best_key[0]):
                best, best_key = d, key
            if o >= 0:
                simulated.add(o)
                tried[o % 2] += 1

        for o in ranked.tolist():
            if tried[o % 2] == SIMULATED_CANDIDATES:
                if min(tried) == SIMULATED_CANDIDATES:
                    break
                continue
            weigh(o)
        # at most tried[0] of the first few by slack were simulated, so these few suffice
        most_slack = np.lexsort((-opt.nbytes, -opt.slack_s))[:SIMULATED_CANDIDATES + SLACK_CANDIDATES]
        for i in most_slack.tolist():
            if tried[0] >= SIMULATED_CANDIDATES + SLACK_CANDIDATES:
                break
            if 2 * i not in simulated:
                weigh(2 * i)
        for d in state.widenings(k)[:SIMULATED_CANDIDATES] if widen else ():     # Note [Widened absences]
            weigh(-1, d)
        return best

    choose.widens = widen
    return choose


def plan_tensile(timeline: Timeline, cost: CostModel, target_nbytes: int,
                 max_seconds: float | None = MAX_PLAN_SECONDS, widen: bool = True) -> Plan:
    """TENSILE's planner over the combined timeline (see the module docstring). ``target_nbytes``
    is the combined peak to reach, bytes; ``max_seconds`` bounds the time spent choosing (None:
    only :data:`MAX_DECISIONS` does, so the plan does not depend on the machine's speed);
    ``widen``: whether a swap taken may be widened (Note [Widened absences]; not in TENSILE as
    published)."""
    return _greedy("tensile", timeline, cost, target_nbytes, tensile_choice(cost, target_nbytes, widen),
                   max_seconds)


def plan_swap_score(timeline: Timeline, cost: CostModel, target_nbytes: int,
                    max_seconds: float | None = MAX_PLAN_SECONDS) -> Plan:
    """The swap selection of arXiv 1903.06631 (see the module docstring); ``max_seconds`` as for
    :func:`plan_tensile`."""

    def choose(state: _State, gaps: list[_Gap], k: int) -> Decision | None:
        opt = state.options(gaps, k)                # every swap frees k
        duration_s = opt.back_s - state.sim.start_s[opt.a]
        votes = np.zeros(len(gaps))
        for score in (duration_s, duration_s * opt.nbytes, opt.nbytes):
            votes[np.argsort(-score, kind="stable")] += np.arange(len(gaps))     # rank, best first
        return opt.swap(int(np.argmin(votes)))[0]

    return _greedy("swap_score", timeline, cost, target_nbytes, choose, max_seconds)


def plan_vdnn(timeline: Timeline, cost: CostModel, target_nbytes: int | None = None) -> Plan:
    """vDNN_all on every job of the timeline, in each of its iterations of the period (see the
    module docstring); ignores the target."""
    decisions = []
    for job_id, trace in timeline.traces.items():
        prog = timeline.program(job_id)
        names = [op.name for op in prog.ops]
        first_backward = next(i for i, n in enumerate(names) if n.endswith("_backward"))
        # The layers: dense layers and convolutions, in forward order.
        layers = [i for i, n in enumerate(names) if n.startswith(("dense", "conv")) and not n.endswith("_backward")]
        for k, p in enumerate(layers):
            slot = prog.ops[p].reads[0]
            pos = prog.positions[slot]
            pa = max(q for q in pos if q < first_backward)
            pb = min(q for q in pos if q >= first_backward)
            free = next((q for q in layers if q > pa), first_backward - 1)
            above = f"{names[layers[k + 1]]}_backward" if k + 1 < len(layers) else None
            back = names.index(above) if above in names else first_backward
            if not pa < free < back <= pb:
                continue
            for i in range(trace.repeats):
                at = {q: timeline.index[(job_id, i * len(names) + q)] for q in (pa, pb, free, back)}
                decisions.append(Decision(job_id, slot, prog.slots[slot].arena_nbytes, "swap",
                                          at[pa], at[pb], at[free], at[back]))
    return Plan.build("vdnn", timeline, decisions, cost, target_nbytes)
