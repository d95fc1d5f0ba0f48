"""The combined timeline of all running jobs, and the simulator that predicts a plan's memory and time.

The executor interleaves jobs in rounds: with ``R`` the longest program (in ops) among the running
jobs, every job runs one iteration per ``R`` rounds, op ``p`` of a job of ``L`` ops in round
``phase + p * R // L`` of the period (``phase`` is the round its iteration starts in). One period
of ``R`` rounds is therefore one iteration of every job, and the sequence of ops in it, the
*combined timeline*, repeats as long as the same jobs run. TENSILE plans each job against the sum
of the per-job peaks; planning against the combined timeline sees that the jobs' peaks fall at
different times.

Memory on the timeline is counted the way the memory manager counts it: a non-persistent tensor
holds its arena bytes from the op that first writes it to the end of its last access; a persistent
one always; a planned absence (a :class:`Decision`) removes a cyclic window of events. Because a
swap-out's bytes are freed at a fixed event (the executor waits there if the copy is late) and a
swap-in's are taken at a fixed event, memory over the timeline depends only on the plan, not on
timing; only the predicted time does, which :func:`simulate` computes with one FIFO copy channel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import CostModel
from .trace import AccessSequence


@dataclass(frozen=True)
class JobTrace:
    """A job on the timeline: its access sequence (with op times), the round its iteration starts
    in (mod the period), and its place in each round (admission order)."""

    job_id: int
    sequence: AccessSequence
    phase: int = 0
    order: int = 0


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a job as the planner sees it: arena bytes, persistence, accessing positions."""

    job_id: int
    slot: str
    nbytes: int
    persistent: bool
    positions: tuple[int, ...]


@dataclass
class Decision:
    """One planned absence of a tensor between two of its accesses (events ``a`` and ``b``).

    ``method`` is ``"swap"``: swapped out after event ``a``, its bytes freed before event ``free``
    and taken again before event ``back`` when the swap-in is issued (absent over
    ``[free, back)``); or ``"recompute"``: dropped after ``a`` and recomputed at ``b`` by the ops
    ``recipe`` (absent over ``[a + 1, b)``). Event indices are cyclic over the period.
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

    def window(self, n: int) -> tuple[int, int]:
        """(first absent event, number of absent events)."""
        return self.free, (self.back - self.free) % n


class Timeline:
    """The ops of one period of the combined timeline, in execution order. ``period`` is the
    executor's rounds per iteration (its longest running program, which may be a job not on this
    timeline); by default the longest program here.

    Attributes:
        period: rounds per period.
        events: (job_id, position) per event, in order; ``n`` of them.
        index: (job_id, position) -> event index.
        durations_s: (n,) float64 seconds, each op's measured time.
        tensors: every tensor of every job, as :class:`TensorInfo`.
    """

    def __init__(self, traces: list[JobTrace], period: int | None = None):
        if not traces:
            raise ValueError("a timeline needs at least one job")
        self.traces = {t.job_id: t for t in traces}
        longest = max(len(t.sequence.program.ops) for t in traces)
        if period is not None and period < longest:
            raise ValueError(f"period {period} is shorter than the longest program ({longest} ops)")
        self.period = period or longest
        keyed = []
        for t in traces:
            n_ops = len(t.sequence.program.ops)
            for p in range(n_ops):
                keyed.append(((t.phase + p * self.period // n_ops) % self.period, t.order, p, t.job_id))
        keyed.sort()
        self.events = [(job, p) for _, _, p, job in keyed]
        self.n = len(self.events)
        self.index = {e: k for k, e in enumerate(self.events)}
        self.durations_s = np.array([self.traces[j].sequence.times_s[p] for j, p in self.events])
        self.tensors: list[TensorInfo] = []
        for t in traces:
            prog = t.sequence.program
            for name, slot in prog.slots.items():
                self.tensors.append(TensorInfo(t.job_id, name, slot.arena_nbytes, slot.kind.persistent,
                                               tuple(prog.positions[name])))

    def program(self, job_id: int):
        return self.traces[job_id].sequence.program

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

    def usage(self, decisions: list[Decision]) -> np.ndarray:
        """(n,) int64: arena bytes held during each event under ``decisions``."""
        diff = np.zeros(self.n + 1, dtype=np.int64)

        def add(start, length, nbytes):
            if length <= 0:
                return
            end = start + length
            diff[start] += nbytes
            if end <= self.n:
                diff[end] -= nbytes
            else:
                diff[self.n] -= nbytes
                diff[0] += nbytes
                diff[end - self.n] -= nbytes

        for t in self.tensors:
            add(*self.lifetime(t), t.nbytes)
        for d in decisions:
            start, length = d.window(self.n)
            add(start, length, -d.nbytes)
        return np.cumsum(diff[:-1])

    def vanilla_peak_nbytes(self) -> int:
        """The combined peak with no plan: the most arena bytes any event holds."""
        return int(self.usage([]).max())


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

    @property
    def extra_s(self) -> float:
        return self.period_s - self.compute_s


def simulate(timeline: Timeline, decisions: list[Decision], cost: CostModel) -> Simulation:
    """Predict the timing of ``decisions`` on ``timeline``: ops run back to back on the compute
    stream; swaps run one at a time on the copy channel in issue order; the op that next accesses
    a swapped tensor waits for its swap-in, a release waits for its swap-out, and a recompute adds
    the producing ops' measured times before the op that needs the tensor."""
    n = timeline.n
    release: dict[int, list] = {}
    swap_in: dict[int, list] = {}
    swap_out: dict[int, list] = {}
    wait_in: dict[int, list] = {}
    recompute_s = np.zeros(n)
    for i, d in enumerate(decisions):
        if d.method == "swap":
            swap_out.setdefault(d.a, []).append((i, cost.swap_out_s(d.nbytes)))
            release.setdefault(d.free, []).append(i)
            swap_in.setdefault(d.back, []).append((i, cost.swap_in_s(d.nbytes)))
            wait_in.setdefault(d.b, []).append(i)
        else:
            recompute_s[d.b] += d.recipe_s
    durations = timeline.durations_s.tolist()
    recompute_list = recompute_s.tolist()
    out_end = [0.0] * len(decisions)
    in_end = [0.0] * len(decisions)
    start = [0.0] * n
    t = channel = stall = busy = period_start = 0.0
    for rep in range(2):
        if rep == 1:
            period_start, stall, busy = t, 0.0, 0.0
        for k in range(n):
            for i in release.get(k, ()):
                if out_end[i] > t:
                    stall += out_end[i] - t
                    t = out_end[i]
            for i, seconds in swap_in.get(k, ()):
                channel = max(channel, t) + seconds
                busy += seconds
                in_end[i] = channel
            for i in wait_in.get(k, ()):
                if in_end[i] > t:
                    stall += in_end[i] - t
                    t = in_end[i]
            t += recompute_list[k]
            start[k] = t - period_start
            t += durations[k]
            for i, seconds in swap_out.get(k, ()):
                channel = max(channel, t) + seconds
                busy += seconds
                out_end[i] = channel
    nbytes = sum(2 * d.nbytes for d in decisions if d.method == "swap")
    return Simulation(np.array(start), t - period_start, float(timeline.durations_s.sum()), stall,
                      float(recompute_s.sum()), nbytes, busy)
