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
"""

from __future__ import annotations

import numpy as np
import scipy.optimize

from ..runtime.program import Program

#: iterations (the cold start included) after which :attr:`AccessSequence.best_iteration_s` is used
SETTLE_ITERATIONS = 4


class AccessSequence:
    """One job's access sequence and its op times.

    Attributes:
        program: the job's program (op order, reads, writes, slot sizes).
        times_s: (ops,) float64, smoothed op times in seconds; NaN until first measured.
        best_s: (ops,) float64, each op's least time in seconds after the cold start; NaN before.
        iterations: complete iterations recorded.
    """

    def __init__(self, program: Program, smoothing: float = 0.2):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.program = program
        self.smoothing = smoothing
        self.times_s = np.full(len(program.ops), np.nan)
        self.best_s = np.full(len(program.ops), np.nan)
        self.iterations = 0

    def snapshot(self) -> "AccessSequence":
        """A copy whose times no longer change (the program is shared)."""
        copy = AccessSequence(self.program, self.smoothing)
        copy.times_s, copy.best_s, copy.iterations = self.times_s.copy(), self.best_s.copy(), self.iterations
        return copy

    def record(self, position: int, seconds: float) -> None:
        """Fold one measured time of op ``position`` (seconds) into the moving average."""
        old = self.times_s[position]
        self.times_s[position] = seconds if np.isnan(old) else old + self.smoothing * (seconds - old)
        if self.iterations > 0:
            self.best_s[position] = np.fmin(self.best_s[position], seconds)

    def end_iteration(self) -> None:
        self.iterations += 1

    @property
    def measured(self) -> bool:
        """True once every op has a measured time (after the cold-start iteration)."""
        return self.iterations > 0 and not np.isnan(self.times_s).any()

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

    def drift(self, reference_s: np.ndarray) -> float:
        """Relative change of the iteration time since ``reference_s`` (the times a plan used)."""
        ref = float(np.sum(reference_s))
        return abs(self.iteration_s - ref) / ref if ref > 0 else 0.0


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
