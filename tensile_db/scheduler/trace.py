"""Access sequences: the accesses of one training iteration of a job, with measured op times.

TENSILE (Zhang et al., arXiv 2105.13336, section 3.1) records each job's tensor access sequence
in a cold-start iteration. Here the order of accesses, the tensors each op reads and writes and
their sizes come from the job's :class:`~tensile_db.runtime.program.Program`, which is exact from
the first iteration; what the cold-start iteration records is the time of every op, measured
around the op's arithmetic (without waits for transfers). Later iterations keep the times current
with an exponential moving average, which the planners use.

The executor's fair sharing (Note [Fair sharing] in :mod:`tensile_db.scheduler.timeline`) needs
how much device time a job's iteration takes relative to the others', not where its times are
heading. For that the sequence also keeps each op's least time over the iterations after the cold
start: a wall-clock op time on a shared machine only gains from contention (another thread
holding the GIL, the copy thread, other processes; a job measured in its cold start while a plan
was being made read ten times its later time), and the cold start adds first-touch costs. The
estimate is *settled* after :data:`SETTLE_ITERATIONS` iterations.

Note [Warm-up iteration]
------------------------
Rationale: on a real device the cold-start iteration pays one-time costs: the first touch of the
arena's pages, the BLAS's threads starting, on a GPU the kernels' loading and compilation. The
MLP of ``bench/throughput.py`` measured 6.6 ms of op time in its cold start and 3.3 ms an
iteration afterwards. A plan made on the cold start's times places its swaps against twice the
compute there is to hide them behind, and stays in force until the moving average has drifted
past the scheduler's ``drift`` (a relative change of 0.5 here, which the average of a halved time
only just reaches): then, at least ``drift_every`` iterations later, a re-plan and a new offset
plan of the planned pool follow, on the CPU the jobs run on.

Approach: a sequence made with ``warm_up`` (the scheduler's, on every device but the simulated
one, whose cold start costs what its other iterations cost) treats the cold start's times as
provisional: the first warm iteration's times replace them instead of entering the moving
average, and the sequence is :attr:`~AccessSequence.measured` (plannable, and the reason for the
re-plan that follows a cold start) only after that iteration. Limitations: the job runs one
more iteration under the arrangement of its cold start (the reactive fallback, or a plan on
estimated times); a job of one iteration is never planned; a first warm iteration slowed by
something else (a plan of another job being made) is planned on as it was, until it drifts.

Note [Drift of a median]
------------------------
Rationale: the drift that asks for a re-plan was read off the moving average of the op times,
which one slow iteration moves far: an op measured while a planning thread holds the GIL reads
up to ten times its time, and the planned pool's offset search stalled iterations of that MLP
at 50 to 120 ms each (against 5 ms). In one run here the average then drifted past the
threshold twice, each re-plan dissolved the pool, and each new offset plan stalled the job again.

Approach: :meth:`AccessSequence.drift` compares the median of the latest :data:`DRIFT_WINDOW`
iterations' measured seconds (the sum of their op times) with the same median in the snapshot a
plan was made from. Nine iterations: more than twice the boundaries a planned pool's plan may
take on its thread (:data:`~tensile_db.memory.planned.PLAN_WAIT_PERIODS`), so the stalls of one
plan do not move it, while a change of the job's own times moves it within five iterations. The
planners still read the moving average.
"""

from __future__ import annotations

import collections
import math
import statistics

import numpy as np
import scipy.optimize

from ..runtime.program import Program

#: iterations (the cold start included) after which :attr:`AccessSequence.best_iteration_s` is used
SETTLE_ITERATIONS = 4
#: the latest iterations whose median :meth:`AccessSequence.drift` reads (Note [Drift of a median])
DRIFT_WINDOW = 9


class AccessSequence:
    """One job's access sequence and its op times.

    Attributes:
        program: the job's program (op order, reads, writes, slot sizes).
        times_s: (ops,) float64, smoothed op times in seconds; NaN until first measured.
        best_s: (ops,) float64, each op's least time in seconds after the cold start; NaN before.
        iterations: complete iterations recorded.
        warm_up: whether the cold start's times are provisional (Note [Warm-up iteration]).
        recent_s: the measured seconds (sums of op times) of the latest :data:`DRIFT_WINDOW`
            iterations after the cold start, oldest first.
    """

    def __init__(self, program: Program, smoothing: float = 0.2, warm_up: bool = False):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.program = program
        self.smoothing = smoothing
        self.warm_up = warm_up
        self.times_s = np.full(len(program.ops), np.nan)
        self.best_s = np.full(len(program.ops), np.nan)
        self.iterations = 0
        self.recent_s: collections.deque = collections.deque(maxlen=DRIFT_WINDOW)
        self._this_s = 0.0                                  # the iteration's measured seconds so far

    def snapshot(self) -> "AccessSequence":
        """A copy whose times no longer change (the program is shared)."""
        copy = AccessSequence(self.program, self.smoothing, self.warm_up)
        copy.times_s, copy.best_s, copy.iterations = self.times_s.copy(), self.best_s.copy(), self.iterations
        copy.recent_s.extend(self.recent_s)
        return copy

    def record(self, position: int, seconds: float) -> None:
        """Fold one measured time of op ``position`` (seconds) into the moving average; in the
        first iteration after a provisional cold start (:attr:`warm_up`), the time replaces the
        cold start's."""
        old = float(self.times_s[position])           # Python floats: this runs after every op
        first = math.isnan(old) or (self.warm_up and self.iterations == 1)
        self.times_s[position] = seconds if first else old + self.smoothing * (seconds - old)
        if self.iterations > 0:
            best = float(self.best_s[position])
            if math.isnan(best) or seconds < best:      # as np.fmin: a NaN is not a least time
                self.best_s[position] = seconds
        self._this_s += seconds

    def end_iteration(self) -> None:
        if self.iterations > 0:                             # after the cold start, as best_s
            self.recent_s.append(self._this_s)
        self._this_s = 0.0
        self.iterations += 1

    @property
    def measured_iterations(self) -> int:
        """Iterations after which the op times stand for the job's: the cold start, and with
        :attr:`warm_up` the first warm iteration too."""
        return 2 if self.warm_up else 1

    @property
    def measured(self) -> bool:
        """True once every op has a measured time that stands for the job's (after
        :attr:`measured_iterations` iterations)."""
        return self.iterations >= self.measured_iterations and not np.isnan(self.times_s).any()

    @property
    def settled(self) -> bool:
        """True once :attr:`best_iteration_s` is an estimate to share the device by."""
        return self.iterations >= SETTLE_ITERATIONS and not np.isnan(self.best_s).any()

    @property
    def iteration_s(self) -> float:
        """Seconds of one iteration, from the smoothed op times."""
        return float(np.nansum(self.times_s))

    @property
    def best_iteration_s(self) -> float:
        """Seconds of one iteration, from each op's least time after the cold start."""
        return float(np.nansum(self.best_s))

    @property
    def typical_iteration_s(self) -> float:
        """Seconds of one iteration as :meth:`drift` reads them: the median of the measured
        seconds of the latest :data:`DRIFT_WINDOW` iterations after the cold start (before
        any, :attr:`iteration_s`)."""
        return statistics.median(self.recent_s) if self.recent_s else self.iteration_s

    def drift(self, reference: "AccessSequence") -> float:
        """Relative change of the typical iteration time (:attr:`typical_iteration_s`) since
        ``reference``, the snapshot a plan was made from (Note [Drift of a median])."""
        ref = reference.typical_iteration_s
        return abs(self.typical_iteration_s - ref) / ref if ref > 0 else 0.0


def estimated(program: Program, measured: list[AccessSequence]) -> AccessSequence | None:
    """An access sequence of ``program`` whose op times are predicted from the measured ops of
    other jobs (``measured``, each with every op timed), for a job still in its cold start; None
    when no op is measured. Its :attr:`~AccessSequence.iterations` is 0: it is not measured.

    A measured job of the same ops (the same model) lends its times. Otherwise the model is a
    roofline fitted by least squares on relative error: an op's seconds as
    ``a * flops + b * nbytes + c`` (``a, b, c >= 0``, :func:`scipy.optimize.nnls`), then scaled per
    op unit (convolution, matmul, ...) by the median of measured over fitted seconds of that
    unit's measured ops, where there are any. Source: an op's time on an accelerator is about
    the larger of its compute and its memory traffic (Williams et al., "Roofline", CACM 2009);
    the sum is that bound's linear relaxation, and the per-unit factor absorbs how far each kind
    of kernel is from it."""
    out = AccessSequence(program)
    same = next((seq for seq in measured if seq.program.ops == program.ops), None)
    if same is not None:                 # another job of the same model: its times
        out.times_s, out.best_s = same.times_s.copy(), same.times_s.copy()
        return out
    rows = [(op.flops, op.nbytes, op.unit, t) for seq in measured for op, t in zip(seq.program.ops, seq.times_s)
            if np.isfinite(t) and t > 0]
    if not rows:
        return None
    flops, nbytes, units, seconds = (np.array(c) for c in zip(*rows))
    features = np.column_stack([flops, nbytes, np.ones(len(rows))]).astype(np.float64)
    coef, _ = scipy.optimize.nnls(features / seconds[:, None], np.ones(len(rows)))
    fitted = features @ coef
    scale = {u: float(np.median(seconds[units == u] / fitted[units == u])) for u in set(units.tolist())
             if (fitted[units == u] > 0).all()}
    mine = np.array([[op.flops, op.nbytes, 1.0] for op in program.ops], dtype=np.float64) @ coef
    out.times_s = mine * np.array([scale.get(op.unit, 1.0) for op in program.ops])
    out.best_s = out.times_s.copy()
    return out
