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
  sums per-job peaks), the bandwidth is measured, and the cheapest few candidates are compared by
  simulating them with the copy channel shared (the paper scores each swap alone).
- :func:`plan_swap_score`: the swap selection of Zhang, Yeung, Shu, He, Wang (arXiv 1903.06631,
  section IV): at the peak, rank the swappable tensors by duration of absence, by area of absence
  (bytes x duration) and by size, and swap the one with the best summed rank (a Borda majority
  vote of the three scores); swaps only, no recompute, each timed as above.
- :func:`plan_vdnn` (Rhu et al., vDNN, MICRO 2016, "vDNN_all"): every layer's (dense layer's or
  convolution's) input is swapped out
  after its last forward use, released when the next layer's forward starts, and prefetched when
  the backward pass of the layer above starts, whatever the budget.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .cost import CostModel
from .timeline import Decision, Simulation, TensorInfo, Timeline, simulate

#: candidates compared by a full simulation per step of :func:`plan_tensile`
SIMULATED_CANDIDATES = 4
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

    @property
    def predicted_extra_s(self) -> float | None:
        return self.simulation.extra_s if self.simulation else None


# --- absences -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Gap:
    tensor: TensorInfo
    a: int                 # event of the access before the absence
    b: int                 # event of the access after it
    pa: int                # the same as period positions of the job
    pb: int


class _State:
    """The planner's working state: decisions so far and accesses added by recomputes."""

    def __init__(self, timeline: Timeline, cost: CostModel):
        self.tl = timeline
        self.cost = cost
        self.decisions: list[Decision] = []
        self.taken: set[tuple[int, str, int]] = set()       # (job, slot, a) already decided
        self.extra: dict[tuple[int, str], set[int]] = {}    # positions read by planned recomputes
        self.sim = simulate(timeline, [], cost)
        # (job, slot) -> repeat -> gaps; a decision on a slot invalidates all its repeats
        self._gaps: dict[tuple[int, str], dict[int, list[_Gap]]] = {}

    def gaps(self, t: TensorInfo) -> list[_Gap]:
        """The absences of ``t`` not decided yet (cached until a decision touches ``t``)."""
        cached = self._gaps.setdefault((t.job_id, t.slot), {})
        if t.repeat not in cached:
            cached[t.repeat] = self._find_gaps(t)
        return cached[t.repeat]

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
                out.append(_Gap(t, a, b, pa, pb))
        return out

    def inside(self, gap: _Gap, k: int) -> bool:
        """Is event ``k`` strictly between the gap's accesses?"""
        span = self.tl.cyclic(gap.a, gap.b) or self.tl.n
        return 0 < self.tl.cyclic(gap.a, k) < span

    def time_at(self, k: int, after: int) -> float:
        """Start time of event ``k`` on the clock of event ``after`` (one period later if it wraps)."""
        s = self.sim.start_s
        return s[k] + (self.sim.period_s if k <= after else 0.0)

    def swap(self, gap: _Gap, k: int) -> tuple[Decision, float]:
        """The swap of ``gap`` that frees event ``k``, timed as early/late as the copies allow,
        with its predicted stall in seconds."""
        tl, a, b, nbytes = self.tl, gap.a, gap.b, gap.tensor.nbytes
        end_a = self.sim.start_s[a] + tl.durations_s[a]
        out_done = end_a + self.cost.swap_out_s(nbytes)
        need_by = self.time_at(b, a) - self.cost.swap_in_s(nbytes)
        free = (a + 1) % tl.n
        while free != k and self.time_at(free, a) < out_done:
            free = (free + 1) % tl.n
        back = b
        while (back - 1) % tl.n != k and self.time_at(back, a) > need_by:
            back = (back - 1) % tl.n
        stall = max(0.0, out_done - self.time_at(free, a)) + max(0.0, self.time_at(back, a) - need_by)
        return Decision(gap.tensor.job_id, gap.tensor.slot, nbytes, "swap", a, b, free, back), stall

    def recompute(self, gap: _Gap) -> Decision | None:
        """The recompute of ``gap``'s tensor at its next access, if the program allows it there
        and the recipe's inputs are held at that event under the decisions so far."""
        t = gap.tensor
        prog = self.tl.program(t.job_id)
        recipe = prog.recipe(t.slot)
        if recipe is None or gap.pa % len(prog.ops) < recipe[-1] or gap.pb <= gap.pa:
            return None
        inputs = prog.recipe_inputs_of(recipe, t.slot)
        for d in self.decisions:
            if d.job_id == t.job_id and (d.slot in inputs or d.slot == t.slot):
                start, length = d.window(self.tl.n)
                if self.tl.cyclic(start, gap.b) < length:
                    return None
        times = self.tl.traces[t.job_id].sequence.times_s
        return Decision(t.job_id, t.slot, t.nbytes, "recompute", gap.a, gap.b, (gap.a + 1) % self.tl.n,
                        gap.b, float(sum(times[p] for p in recipe)), tuple(sorted(inputs)))

    def add(self, d: Decision) -> None:
        self.decisions.append(d)
        self.taken.add((d.job_id, d.slot, d.a))
        self._gaps.pop((d.job_id, d.slot), None)
        if d.method == "recompute":
            pb = self.tl.events[d.b][1]
            for name in d.recipe_inputs:
                self.extra.setdefault((d.job_id, name), set()).add(pb)
                self._gaps.pop((d.job_id, name), None)
        self.sim = simulate(self.tl, self.decisions, self.cost)


def _greedy(policy: str, timeline: Timeline, cost: CostModel, target_nbytes: int, choose,
            max_seconds: float | None) -> Plan:
    state = _State(timeline, cost)
    deadline = time.monotonic() + (math.inf if max_seconds is None else max_seconds)
    while len(state.decisions) < MAX_DECISIONS and time.monotonic() < deadline:
        use = timeline.usage(state.decisions)
        k = int(np.argmax(use))
        if use[k] <= target_nbytes:
            break
        candidates = [g for t in timeline.tensors for g in state.gaps(t) if state.inside(g, k)]
        decision = choose(state, candidates, k) if candidates else None
        if decision is None:
            break                               # the target is out of reach; reactive covers the rest
        state.add(decision)
    return Plan.build(policy, timeline, state.decisions, cost, target_nbytes)


def plan_tensile(timeline: Timeline, cost: CostModel, target_nbytes: int,
                 max_seconds: float | None = MAX_PLAN_SECONDS) -> Plan:
    """TENSILE's planner over the combined timeline (see the module docstring). ``target_nbytes``
    is the combined peak to reach, bytes; ``max_seconds`` bounds the time spent choosing (None:
    only :data:`MAX_DECISIONS` does, so the plan does not depend on the machine's speed)."""

    def choose(state: _State, gaps: list[_Gap], k: int) -> Decision | None:
        options = []
        for g in gaps:
            d, stall = state.swap(g, k)
            if d.window(timeline.n)[1] > 0:
                transfer = cost.swap_out_s(d.nbytes) + cost.swap_in_s(d.nbytes)
                options.append((stall, -d.nbytes, transfer, d))
            r = state.recompute(g)
            if r is not None:
                options.append((r.recipe_s, -r.nbytes, 0.0, r))
        if not options:
            return None
        options.sort(key=lambda o: o[:3])
        best, best_extra = None, None
        for *_, d in options[:SIMULATED_CANDIDATES]:
            extra = simulate(timeline, state.decisions + [d], cost).extra_s
            if best is None or extra < best_extra - 1e-12:
                best, best_extra = d, extra
        return best

    return _greedy("tensile", timeline, cost, target_nbytes, choose, max_seconds)


def plan_swap_score(timeline: Timeline, cost: CostModel, target_nbytes: int,
                    max_seconds: float | None = MAX_PLAN_SECONDS) -> Plan:
    """The swap selection of arXiv 1903.06631 (see the module docstring); ``max_seconds`` as for
    :func:`plan_tensile`."""

    def choose(state: _State, gaps: list[_Gap], k: int) -> Decision | None:
        scored = []
        for g in gaps:
            d, _ = state.swap(g, k)
            if d.window(timeline.n)[1] == 0:
                continue
            duration = state.time_at(g.b, g.a) - state.sim.start_s[g.a]
            scored.append((duration, duration * d.nbytes, d.nbytes, d))
        if not scored:
            return None
        votes = np.zeros(len(scored))
        for score in range(3):
            order = sorted(range(len(scored)), key=lambda i: -scored[i][score])
            for rank, i in enumerate(order):
                votes[i] += rank
        return scored[int(np.argmin(votes))][3]

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
