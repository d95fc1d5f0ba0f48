"""The combined timeline of all running jobs, the executor's pace, and the simulator that predicts
a plan's memory and time.

Note [Fair sharing]
-------------------
The executor interleaves jobs in rounds. A period is ``R`` rounds; in one period a job of ``L``
ops runs ``k`` whole iterations (its *iterations per period*), that is ``n = k * L`` ops, and the
op at *period position* ``q = i * L + p`` (op ``p`` of the period's iteration ``i``) runs in round
``phase + q * R // n`` (:func:`round_of`, the one place this formula lives; ``phase`` is the round
its period starts in). The sequence of ops in one period, the *combined timeline*, repeats as long
as the same jobs run at the same pace, so a plan made for one period applies to every period.

Rationale: with one iteration of every job per period (``k = 1``), every job ran at the pace of the
longest program: a small model beside a 400-layer one ran about 65 times slower than alone. Here
each job gets about the same device time per period instead: :func:`iterations_per_period` gives a
job ``k = floor(T_max / T)`` iterations per period, where ``T`` is its iteration time and
``T_max`` the longest such time, so no job gets more device time per period than the slowest
job's one iteration. ``T`` is the sum of the job's least measured op times once they have settled
(:mod:`~tensile_db.scheduler.trace`), and before that its op count times the settled jobs' mean op
time. The period is then the most ops any job runs in one (:func:`period_of`), so no job runs
more than one op per round. This is weighted round robin with quanta fixed per schedule (compare
deficit round robin, Shreedhar and Varghese, SIGCOMM 1995): the ``k`` of every job change only
when a job arrives or leaves and when a job's op times settle, which keeps the timeline periodic,
as the plans need; each such change is a schedule change (a re-plan).

Limitations: ``k`` is capped so that a job's ops per period stay within :data:`MAX_STRETCH` times
the longest program (a job whose ops are far cheaper than the longest job's gets less than an
equal share, rather than a period of unbounded length); the iterations per period do not follow
op times that drift later; ``floor`` leaves a job whose iteration is up to twice as fast as the
slowest one at one iteration per period (measured times on a shared machine vary that much).

Memory on the timeline is counted the way the memory manager counts it: a non-persistent tensor
holds its arena bytes from the op that first writes it to the end of its last access in the same
iteration (so a job of ``k`` iterations per period has ``k`` such lifetimes of it); a persistent
one always; a planned absence (a :class:`Decision`) removes a cyclic window of events. Because a
swap-out's bytes are freed at a fixed event (the executor waits there if the copy is late) and a
swap-in's are taken at a fixed event, memory over the timeline depends only on the plan, not on
timing; only the predicted time does, which :func:`simulate` computes with one FIFO copy channel,
or one per direction where the cost model says the copies are duplex (a GPU's copy engines). With a
host budget, a swap-out goes to the host tier or to the disk tier by how many swapped-out bytes the
host holds when it is issued (Note [Tiers] in :mod:`~tensile_db.scheduler.cost`), which also
depends on timing; so the simulation decides each swap's tier as it replays the period.
TENSILE plans each job against the sum of the per-job peaks; planning against the combined
timeline sees that the jobs' peaks fall at different times.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .cost import CostModel
from .trace import AccessSequence
from .work import PlanWork

#: most ops of one job in a period, as a multiple of the longest program (Note [Fair sharing])
MAX_STRETCH = 4


def round_of(q: int, n_ops: int, period: int) -> int:
    """Round, counted from the start of the job's period, in which a job that runs ``n_ops`` ops
    per period of ``period`` rounds runs the op at period position ``q`` (0 <= q < n_ops)."""
    return q * period // n_ops


def iterations_per_period(iteration_s: dict[int, float], n_ops: dict[int, int]) -> dict[int, int]:
    """Iterations per period of each job (job id -> k >= 1) so that every job gets about the same
    device time per period (Note [Fair sharing]). ``iteration_s``: job id -> its iteration time,
    seconds (or any unit common to all jobs); ``n_ops``: job id -> ops in its program."""
    longest_s = max(iteration_s.values())
    cap_ops = MAX_STRETCH * max(n_ops.values())
    repeats = {}
    for job_id, seconds in iteration_s.items():
        cap = max(1, cap_ops // n_ops[job_id])
        repeats[job_id] = max(1, int(min(cap, longest_s / seconds))) if seconds > 0 else cap
    return repeats


def period_of(repeats: dict[int, int], n_ops: dict[int, int]) -> int:
    """Rounds per period: the most ops any job runs in one (job id -> iterations per period, job
    id -> ops in its program); 1 without jobs."""
    return max((k * n_ops[j] for j, k in repeats.items()), default=1)


@dataclass(frozen=True)
class JobTrace:
    """A job on the timeline: its access sequence (with op times), the round its period starts in
    (mod the period), its place in each round (admission order), and its iterations per period."""

    job_id: int
    sequence: AccessSequence
    phase: int = 0
    order: int = 0
    repeats: int = 1

    @property
    def n_ops(self) -> int:
        """Ops of the job in one period."""
        return self.repeats * len(self.sequence.program.ops)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a job as the planner sees it: arena bytes, persistence, and the period positions
    that access it. A persistent tensor is one over the whole period; a non-persistent one is one
    per iteration of its job in the period (``repeat``: which)."""

    job_id: int
    slot: str
    nbytes: int
    persistent: bool
    positions: tuple[int, ...]
    repeat: int = 0


@dataclass
class Decision:
    """One planned absence of a tensor between two of its accesses (events ``a`` and ``b``).

    ``method`` is ``"swap"``: swapped out after event ``a``, its bytes freed before event ``free``
    and taken again before event ``back`` when the swap-in is issued (absent over
    ``[free, back)``); or ``"recompute"``: dropped after ``a`` and recomputed at ``b`` by the ops
    ``recipe`` (absent over ``[a + 1, b)``), whose replays take ``workspace_nbytes`` more arena
    bytes during event ``b`` (a convolution's im2col matrix). Event indices are cyclic over the
    period.
    """

    job_id: int
    slot: str
    nbytes: int
    method: str
    a: int
    b: int
    free: int
    back: int
    recipe_s: float = 0.0
    recipe_inputs: tuple[str, ...] = ()
    workspace_nbytes: int = 0

    def window(self, n: int) -> tuple[int, int]:
        """(first absent event, number of absent events)."""
        return self.free, (self.back - self.free) % n


class Timeline:
    """The ops of one period of the combined timeline, in execution order (Note [Fair sharing]).
    ``period`` is the executor's rounds per period (which may come from a job not on this
    timeline); by default the most ops any job here runs in one period.

    Attributes:
        period: rounds per period.
        events: (job_id, q) per event, in order, ``q`` the op's period position (op ``q % L`` of
            the job's program of ``L`` ops, in its iteration ``q // L`` of the period); ``n`` of them.
        index: (job_id, q) -> event index.
        durations_s: (n,) float64 seconds, each op's measured time.
        tensors: every tensor of every job, as :class:`TensorInfo`.
        work: the planning work done on this timeline so far, its own construction included
            (:class:`~.work.PlanWork`; the simulator and the planners add theirs).

    Raises:
        ValueError: no traces, or a period shorter than some job's ops per period.
    """

    def __init__(self, traces: list[JobTrace], period: int | None = None):
        if not traces:
            raise ValueError("a timeline needs at least one job")
        self.traces = {t.job_id: t for t in traces}
        most = max(t.n_ops for t in traces)
        if period is not None and period < most:
            raise ValueError(f"period {period} is shorter than the most ops of a job in one ({most})")
        self.period = period or most
        keyed = []
        for t in traces:
            for q in range(t.n_ops):
                keyed.append(((t.phase + round_of(q, t.n_ops, self.period)) % self.period, t.order, q, t.job_id))
        keyed.sort()
        self.events = [(job, q) for _, _, q, job in keyed]
        self.n = len(self.events)
        self.index = {e: k for k, e in enumerate(self.events)}
        self.durations_s = np.array([self.traces[j].sequence.times_s[q % self.n_program_ops(j)]
                                     for j, q in self.events])
        self.tensors: list[TensorInfo] = []
        for t in traces:
            prog, n_prog = t.sequence.program, len(t.sequence.program.ops)
            for name, slot in prog.slots.items():
                pos = prog.positions[name]
                if slot.kind.persistent:
                    self.tensors.append(TensorInfo(t.job_id, name, slot.arena_nbytes, True,
                                                   tuple(i * n_prog + p for i in range(t.repeats) for p in pos)))
                    continue
                for i in range(t.repeats):
                    self.tensors.append(TensorInfo(t.job_id, name, slot.arena_nbytes, False,
                                                   tuple(i * n_prog + p for p in pos), i))
        self.work = PlanWork(items=self.n + len(self.tensors))

    def program(self, job_id: int):
        return self.traces[job_id].sequence.program

    def n_program_ops(self, job_id: int) -> int:
        """Ops in the job's program (one iteration); its period positions are taken mod this."""
        return len(self.traces[job_id].sequence.program.ops)

    def cyclic(self, start: int, end: int) -> int:
        """Events from ``start`` forward to ``end`` (0 when equal)."""
        return (end - start) % self.n

    def lifetime(self, t: TensorInfo) -> tuple[int, int]:
        """(first event, number of events) the tensor holds memory without any plan."""
        if t.persistent:
            return 0, self.n
        first = self.index[(t.job_id, t.positions[0])]
        last = self.index[(t.job_id, t.positions[-1])]
        return first, self.cyclic(first, last) + 1

    def add_window(self, use: np.ndarray, start: int, length: int, nbytes: int) -> None:
        """Add ``nbytes`` to ``use`` ((n,) int64, bytes per event) over ``length`` events from
        event ``start``, wrapping around the period; in place."""
        end = start + length
        use[start:min(end, self.n)] += nbytes
        if end > self.n:
            use[:end - self.n] += nbytes

    @functools.cached_property
    def _vanilla_usage(self) -> np.ndarray:
        """(n,) int64: arena bytes held during each event without a plan (read-only)."""
        use = np.zeros(self.n, dtype=np.int64)
        for t in self.tensors:
            self.add_window(use, *self.lifetime(t), t.nbytes)
        self.work.items += len(self.tensors)
        use.flags.writeable = False
        return use

    def usage(self, decisions: list[Decision]) -> np.ndarray:
        """(n,) int64: arena bytes held during each event under ``decisions`` (a new array)."""
        use = self._vanilla_usage.copy()
        for d in decisions:
            self.add_decision(use, d)
        self.work.events += self.n
        return use

    def add_decision(self, use: np.ndarray, d: Decision) -> None:
        """Apply ``d`` to ``use`` ((n,) bytes per event), in place: its absence, and the
        workspaces of a recompute's replays during the event that needs the tensor (an upper
        bound there: the replays free their workspaces before that event's op allocates its
        outputs)."""
        self.add_window(use, *d.window(self.n), -d.nbytes)
        use[d.b] += d.workspace_nbytes

    def vanilla_peak_nbytes(self) -> int:
        """The combined peak with no plan: the most arena bytes any event holds."""
        return int(self._vanilla_usage.max())

    @functools.cached_property
    def floor_nbytes(self) -> np.ndarray:
        """(n,) int64: the arena bytes each event's op needs resident at once, its working set
        (:meth:`~tensile_db.runtime.program.Program.working_set_nbytes`): no plan holds the event
        below it (read-only)."""
        floors = np.array([self.program(j).working_set_nbytes(q % self.n_program_ops(j)) for j, q in self.events],
                          dtype=np.int64)
        self.work.items += self.n
        floors.flags.writeable = False
        return floors

    def targets(self, target_nbytes: int) -> np.ndarray:
        """(n,) int64: ``target_nbytes`` at every event, raised to the event's floor
        (:attr:`floor_nbytes`): the per-event targets of a plan whose target lies under the
        floor (Note [Targets under the floor] in :mod:`~tensile_db.scheduler.engine`)."""
        return np.maximum(self.floor_nbytes, target_nbytes)


@dataclass
class Simulation:
    """Predicted timing of one period (the second of two simulated, so transfers issued late in a
    period and completed in the next are counted). Seconds throughout."""

    start_s: np.ndarray                 # (n,) when each op starts, from the period's start
    period_s: float
    compute_s: float                    # sum of the ops' measured times
    stall_s: float = 0.0                # waiting for transfers
    recompute_s: float = 0.0
    transfer_nbytes: int = 0            # bytes copied per period, both directions
    channel_busy_s: float = 0.0
    disk_nbytes: int = 0                # bytes swapped out to the disk tier per period (each read back once)

    @property
    def extra_s(self) -> float:
        return self.period_s - self.compute_s


def simulate(timeline: Timeline, decisions: list[Decision], cost: CostModel) -> Simulation:
    """Predict the timing of ``decisions`` on ``timeline``: ops run back to back on the compute
    stream; swaps run one at a time on the copy channel in issue order (swap-outs and swap-ins on
    separate channels when ``cost.duplex``), each to and from the tier the host budget gives it
    (Note [Tiers] in :mod:`~tensile_db.scheduler.cost`); the op that next accesses
    a swapped tensor waits for its swap-in, a release waits for its swap-out, and a recompute adds
    the producing ops' measured times before the op that needs the tensor; copies and kernels
    slow each other by ``cost.contention`` (Note [Contention] in :mod:`~.cost`: the copies priced
    that much slower, and the busier copy channel's loss added to each period) (:class:`Simulator`)."""
    return Simulator(timeline, cost, decisions).simulate()


class Simulator:
    """Decisions by the events their actions happen at, and the simulation of their timing
    (:func:`simulate`). A planner that tries one more decision at a time keeps one, adds each
    decision it takes (:meth:`add`), and simulates the candidates with ``also``.

    At an event, in this order: the releases wait for their swap-outs, the swap-ins are issued,
    the op waits for the swap-ins it needs, the recomputes run, the op runs, the swap-outs are
    issued; each in the order of the decisions. Issuing a swap-out or a swap-in costs the compute
    stream ``cost.issue_s``, and a copy to or from the host tier of at most ``cost.inline_nbytes``
    runs on the compute stream, done when issued, not on a copy channel (Note [Issue cost] in
    :mod:`~tensile_db.scheduler.cost`). Only the events with such actions are visited one by one;
    between them the clock adds the ops' times in order (the same sums, to the last bit, as
    visiting every event). :meth:`extra_s`, a candidate's trial, needs no op's start time: it
    moves the clock between two such events by a difference of prefix sums of the ops' times, so a
    trial costs the events with actions only, not every event of two periods (the same seconds but
    for rounding, about 1e-16 of a period).

    Tiers (Note [Tiers] in :mod:`~tensile_db.scheduler.cost`), with ``cost.host_budget_nbytes``
    set: at each swap-out, in the order they are issued on the clock, the bytes the host tier
    holds are those of the swaps sent there whose swap-ins have not completed by then; the
    swap-out goes to the host tier if they and its own bytes fit the host budget, else to the
    disk tier, and its swap-in costs the copy from that tier. A disk copy runs on the same copy
    channel as a host one (the swap engine's threads do both). The swaps whose absence wraps
    around the end of the period are out when a simulation starts: they get their tiers by the
    same rule, in the order of their swap-outs, before the first period. Without a host budget
    every swap goes to the host tier, as in TENSILE.

    Note [Inline plans add up]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~
    Rationale: where every copy is made on the compute stream (``cpu`` with the kernels on every
    core: Note [Copies beside kernels on every core] in :mod:`tensile_db.runtime.device`) nothing
    waits for a copy channel: a swap-in lands when issued, before the op that waits for it, a
    swap-out before its release, and no copy slows a kernel. A period then lasts the ops' times
    plus each decision's own seconds, wherever its actions lie: a swap's two issues and two copies,
    a recompute's recipe. Yet every trial replayed two periods of events, and the trials were 41%
    of the global planner's time on the small CNN of ``bench/throughput.py`` at half its peak: its
    plan (65 decisions) took 40 ms on this project's 2-core machine, the MLP's (28) 18 ms, on the
    CPU the jobs need (Note [Plans beside kernels on every core] in
    :mod:`tensile_db.scheduler.engine`).

    Approach: where the cost model makes copies on the compute stream (``inline_nbytes``), while
    every decision added costs the compute stream alone and there is one tier (no host budget),
    the simulator keeps their seconds summed, and :meth:`extra_s` answers a trial of such a
    candidate with that sum and the candidate's own seconds (a re-timed swap: the sum) without a
    replay. The first decision that takes a copy channel sends every trial back to the replay,
    and so does a host budget; :meth:`simulate` always replays. The same plans came out, decision
    for decision, on the two workloads at 50% and 70% of their peaks, in 23 and 9.5 ms.

    Limitations: the sum and the replay's clock add the same seconds in different orders, so
    they may differ in the last bits (a tie between two candidates may break the other way). A
    device that makes no copy on the compute stream (``cuda``, the simulated one, whose modelled
    planning time counts the steps) always replays, even for a plan of recomputes alone.
    """

    def __init__(self, timeline: Timeline, cost: CostModel, decisions: Sequence[Decision] = ()):
        self.timeline = timeline
        self.cost = cost
        self.decisions: list[Decision] = []
        # (event, releases, swap-ins, waits for a swap-in, swap-outs) for every event with an
        # action, by event: decision indices, and for the two that issue a copy (decision index,
        # the copy's seconds from or to the host tier, and from or to the disk tier, its bytes,
        # whether a copy from or to the host tier runs on the compute stream: Note [Issue cost])
        # (None for none). The lists are never changed in place, so a copy of the list may be
        # changed apart.
        self._steps: list[tuple] = []
        # (a, decision index, bytes) of the swaps whose swap-in comes before their swap-out in a
        # period, by event ``a`` (of the swap-out) and index: out when a simulation starts
        self._wrapping: list[tuple[int, int, int]] = []
        self._recomputes: dict[int, float] = {}           # event -> seconds of recomputes before its op
        self._transfer_nbytes = 0
        # Note [Inline plans add up]: whether every decision so far costs the compute stream alone,
        # and their seconds summed
        self._additive = cost.host_budget_nbytes is None and cost.inline_nbytes > 0
        self._added_s = 0.0
        self._durations = timeline.durations_s.tolist()
        self._prefix_s = [0.0, *itertools.accumulate(self._durations)]   # the ops' seconds before each event
        self._compute_s = float(timeline.durations_s.sum())
        # of the last simulation, the seconds each decision's actions waited in its second period:
        # key i for the release of decision i (waiting for its swap-out), ~i for the access that
        # waited for its swap-in (Note [Re-timed swaps] in :mod:`~.planners`)
        self.waited_s: dict[int, float] = {}
        for d in decisions:
            self.add(d)

    def _merge(self, steps: list[tuple], d: Decision, i: int) -> None:
        """Put the actions of ``d``, the ``i``-th decision, into ``steps``, in place."""
        if d.method == "swap":
            cost, nbytes = self.cost, d.nbytes
            slow = 1.0 + cost.contention                  # beside the kernels (Note [Contention])
            inline = bool(cost.inline(nbytes))                # on the compute stream
            in_s, out_s = cost.swap_in_s(nbytes), cost.swap_out_s(nbytes)
            if not inline:
                in_s, out_s = in_s * slow, out_s * slow
            if cost.host_budget_nbytes is None:           # one tier: the disk's seconds are never read
                disk_in_s, disk_out_s = in_s, out_s
            else:
                disk_in_s, disk_out_s = cost.swap_in_s(nbytes, disk=True) * slow, cost.swap_out_s(nbytes, disk=True) * slow
            actions = [(d.free, 0, i), (d.back, 1, (i, in_s, disk_in_s, nbytes, inline)), (d.b, 2, i),
                       (d.a, 3, (i, out_s, disk_out_s, nbytes, inline))]
        else:
            actions = [(d.b, None, None)]                 # visited for its recompute
        for k, which, entry in actions:
            at = bisect.bisect_left(steps, k, key=operator.itemgetter(0))
            if at == len(steps) or steps[at][0] != k:
                steps.insert(at, (k, None, None, None, None))
            if which is not None:
                step = list(steps[at])
                step[1 + which] = (step[1 + which] or []) + [entry]
                steps[at] = tuple(step)

    @staticmethod
    def _wraps(d: Decision) -> bool:
        """Whether ``d`` is a swap whose swap-in is issued before its swap-out in a period (at
        one event, swap-ins come first)."""
        return d.method == "swap" and d.back <= d.a

    def _inline_s(self, d: Decision) -> float | None:
        """The seconds ``d`` adds to a period where it costs the compute stream alone: a
        recompute's recipe, or a swap whose copies are made on the compute stream (its two issues
        and two copies); None for a swap whose copies take a copy channel (Note [Inline plans
        add up])."""
        if d.method != "swap":
            return d.recipe_s
        if not self.cost.inline(d.nbytes):
            return None
        return self.cost.inline_swap_s(d.nbytes)

    def add(self, d: Decision) -> None:
        """Append ``d`` to the decisions."""
        if self._additive:
            added = self._inline_s(d)
            self._additive = added is not None
            self._added_s += added or 0.0
        if self._wraps(d):
            bisect.insort(self._wrapping, (d.a, len(self.decisions), d.nbytes))
        self._merge(self._steps, d, len(self.decisions))
        self.decisions.append(d)
        if d.method == "swap":
            self._transfer_nbytes += 2 * d.nbytes
        else:
            self._recomputes[d.b] = self._recomputes.get(d.b, 0.0) + d.recipe_s

    def retime(self, i: int, d: Decision) -> None:
        """Replace the ``i``-th decision, a swap, by ``d``, the same swap at other events (its
        release or swap-in moved: Note [Widened absences] in :mod:`~.planners`)."""
        self._steps, self._wrapping = self._without(self._steps, self._wrapping, i)
        if self._wraps(d):
            bisect.insort(self._wrapping, (d.a, i, d.nbytes))
        self._merge(self._steps, d, i)
        self.decisions[i] = d

    @staticmethod
    def _without(steps: list, wrapping: list, i: int) -> tuple[list, list]:
        """``steps`` and ``wrapping`` less the actions of swap ``i`` (new lists)."""
        def drop(entries):
            if entries is None:
                return None
            return [e for e in entries if (e[0] if isinstance(e, tuple) else e) != i]
        return ([(k, *map(drop, lists)) for k, *lists in steps],
                [w for w in wrapping if w[1] != i])

    def _with(self, also: Decision | None, instead: int | None = None
              ) -> tuple[list, dict[int, float], list[tuple[int, int, int]]]:
        """The steps, recomputes and wrapping swaps of the decisions and ``also`` (not added);
        with ``instead``, ``also`` is a swap that stands in for that decision (a re-timing of it)."""
        steps, recomputes, wrapping = self._steps, self._recomputes, self._wrapping
        if also is not None:
            if instead is None:
                steps, at = steps.copy(), len(self.decisions)
            else:
                (steps, wrapping), at = self._without(steps, wrapping, instead), instead
            self._merge(steps, also, at)
            if also.method != "swap":
                recomputes = {**recomputes, also.b: recomputes.get(also.b, 0.0) + also.recipe_s}
            elif self._wraps(also):
                wrapping = sorted([*wrapping, (also.a, at, also.nbytes)])
        return steps, recomputes, wrapping

    def simulate(self, also: Decision | None = None) -> Simulation:
        """Predict the timing of the decisions, and of ``also`` after them if given (not added)."""
        steps, recomputes, wrapping = self._with(also)
        nbytes = self._transfer_nbytes + (2 * also.nbytes if also is not None and also.method == "swap" else 0)
        start_s, period_s, stall_s, busy_s, disk_nbytes = self._replay(steps, recomputes, wrapping,
                                                                       len(self.decisions) + 1)
        return Simulation(start_s, period_s, self._compute_s, stall_s, sum(recomputes.values()), nbytes, busy_s,
                          disk_nbytes)

    def extra_s(self, also: Decision | None = None, instead: int | None = None) -> float:
        """The extra seconds per period (:attr:`Simulation.extra_s`) of the decisions and of
        ``also`` after them if given (not added; with ``instead``, in place of that decision, as
        :meth:`retime` would put it), without the ops' start times: what a planner weighs a
        candidate by, at the cost of the events with actions only. Leaves :attr:`waited_s` as
        the last :meth:`simulate` made it."""
        if self._additive:                          # Note [Inline plans add up]
            added = 0.0 if also is None or instead is not None else self._inline_s(also)
            if added is not None:
                self.timeline.work.steps += 1
                return self._added_s + added
        _, period_s, _, _, _ = self._replay(*self._with(also, instead), len(self.decisions) + 1, timed=False)
        return period_s - self._compute_s

    def _replay(self, steps: list, recomputes: dict[int, float], wrapping: list[tuple[int, int, int]],  # noqa: C901
                transfers: int, timed: bool = True) -> tuple[np.ndarray | None, float, float, float, int]:
        # (one function, over the complexity limit: the planners' innermost loop, where a call
        # per step would cost more than the step)
        """Two periods of ``steps``; (the second's start times, its length, stall and copy
        channel's busy time, seconds; bytes it swaps out to the disk tier). Not ``timed``: no
        start times (None) and no :attr:`waited_s`, the clock moved between steps by prefix sums."""
        durations, prefix = self._durations, self._prefix_s
        if timed:
            self.timeline.work.events += 2 * len(durations)
        self.timeline.work.steps += 2 * len(steps)
        out_end = [0.0] * transfers
        in_end = [0.0] * transfers
        starts: list[float] = []            # the second period's op start times, on one clock
        t = period_start = stall = 0.0
        free = [0.0, 0.0]                   # when each copy channel is next free: swap-ins', swap-outs'
        out = 1 if self.cost.duplex else 0  # one channel for both directions unless duplex
        # the compute stream's loss per second of the busier channel (Note [Contention] in
        # :mod:`~tensile_db.scheduler.cost`: c S of copies priced at S (1 + c))
        loss = self.cost.kernel_loss
        issue = self.cost.issue_s           # the executor's seconds per swap action, on the compute stream
        # Tiers: only with a host budget; without one every swap is a host tier's, as before.
        budget = self.cost.host_budget_nbytes
        tiered = budget is not None
        on_disk = [False] * transfers       # each swap's tier, from its last swap-out
        held = 0                            # bytes of swapped-out tensors in the host tier now
        # (seconds, bytes) the host tier frees when a swap-in from it completes, in order of time
        # (the swap-ins' channel is FIFO); frees[:freed] have happened
        frees: list[tuple[float, int]] = []
        freed = 0
        spilled = 0                         # bytes swapped out to the disk tier in this period
        for _, i, nbytes in wrapping if tiered else ():
            on_disk[i] = held + nbytes > budget
            if not on_disk[i]:
                held += nbytes
        waited: dict[int, float] = {}      # the second period's waits (:attr:`waited_s`)
        for rep in range(2):
            # busy: each copy channel's seconds in this period
            period_start, stall, busy, done, spilled = t, 0.0, [0.0, 0.0], 0, 0
            for k, releases, swap_ins, waits, swap_outs in steps:
                if not timed:               # the ops before this event, summed
                    t += prefix[k] - prefix[done]
                elif rep:                   # the ops before this event, each at the clock's time
                    starts.extend(itertools.accumulate(durations[done:k], initial=t))
                    t = starts.pop()
                elif k > done:
                    t = functools.reduce(operator.add, durations[done:k], t)
                if releases:
                    for i in releases:
                        if out_end[i] > t:
                            stall += out_end[i] - t
                            if rep:
                                waited[i] = waited.get(i, 0.0) + out_end[i] - t
                            t = out_end[i]
                if swap_ins:
                    for i, seconds, disk_s, nbytes, inline in swap_ins:
                        t += issue
                        if on_disk[i]:
                            seconds = disk_s
                        elif inline:        # copied on the compute stream, done when issued
                            t += seconds
                            in_end[i] = t
                            if tiered:
                                bisect.insort(frees, (t, nbytes), lo=freed)
                            continue
                        free[0] = (free[0] if free[0] > t else t) + seconds
                        busy[0] += seconds
                        in_end[i] = free[0]
                        if tiered and not on_disk[i]:
                            frees.append((free[0], nbytes))
                if waits:
                    for i in waits:
                        if in_end[i] > t:
                            stall += in_end[i] - t
                            if rep:
                                waited[~i] = waited.get(~i, 0.0) + in_end[i] - t
                            t = in_end[i]
                t += recomputes.get(k, 0.0)
                if rep and timed:
                    starts.append(t)
                t += durations[k]
                if swap_outs:
                    for i, seconds, disk_s, nbytes, inline in swap_outs:
                        t += issue
                        if tiered:
                            while freed < len(frees) and frees[freed][0] <= t:
                                held -= frees[freed][1]
                                freed += 1
                            on_disk[i] = held + nbytes > budget
                            if on_disk[i]:
                                seconds = disk_s
                                spilled += nbytes
                            else:
                                held += nbytes
                        if inline and not on_disk[i]:
                            t += seconds
                            out_end[i] = t
                            continue
                        free[out] = (free[out] if free[out] > t else t) + seconds
                        busy[out] += seconds
                        out_end[i] = free[out]
                done = k + 1
            if not timed:
                t += prefix[-1] - prefix[done]
            elif rep:
                starts.extend(itertools.accumulate(durations[done:], initial=t))
                t = starts.pop()
            else:
                t = functools.reduce(operator.add, durations[done:], t)
            t += loss * max(busy)           # the kernels slowed by the copies beside them
        if not timed:
            return None, t - period_start, stall, sum(busy), spilled
        self.waited_s = waited
        return np.array(starts) - period_start, t - period_start, stall, sum(busy), spilled
