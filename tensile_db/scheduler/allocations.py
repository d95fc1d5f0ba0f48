"""The recurring allocations of one job's iteration under a swap schedule, for the lifetime planner.

:func:`allocations_of` derives the trace that :mod:`tensile_db.memory.lifetimes` places offline
from a program and a plan's decisions: on the events of one iteration (op positions), a
swapped-out tensor is a new allocation after each swap-in, a recomputed one after each
recompute. It lives with the scheduler because it reads the scheduler's timeline and decisions;
the memory layer below takes only the resulting :class:`~tensile_db.memory.lifetimes.Allocation`
list. Used by the pool benchmark (``bench/pool.py``) and its tests.
"""

from __future__ import annotations

import numpy as np

from ..memory.lifetimes import Allocation
from ..runtime.units import round_up
from .timeline import JobTrace, Timeline
from .trace import AccessSequence


def allocations_of(program, decisions=()) -> list[Allocation]:
    """The recurring allocations of one iteration of ``program`` on its own (events = op
    positions), under ``decisions`` (a single-job plan's :class:`Decision` list, made on a
    timeline of this program alone). Persistent tensors without absences are one allocation over
    the whole iteration. Each allocation is keyed ``(slot, k)``, k counting its runs of
    residency, and sized in arena bytes."""
    tl = Timeline([JobTrace(0, AccessSequence(program))])
    n = tl.n
    absent: dict[str, list[tuple[int, int]]] = {}
    for d in decisions:
        absent.setdefault(d.slot, []).append(d.window(n))
    allocs = []
    for t in tl.tensors:
        start, length = tl.lifetime(t)
        held = np.zeros(n, dtype=bool)
        held[[(start + i) % n for i in range(length)]] = True
        for s, ln in absent.get(t.slot, ()):
            held[[(s + i) % n for i in range(ln)]] = False
        for k, segments in enumerate(_runs(held)):
            allocs.append(Allocation((t.slot, k), round_up(t.nbytes), segments))
    return allocs


def _runs(held: np.ndarray) -> list[tuple[tuple[int, int], ...]]:
    """Maximal cyclic runs of True in ``held``, each as linear segments (a run that wraps the end
    of the iteration is two segments)."""
    n = len(held)
    if held.all():
        return [((0, n - 1),)]
    first_false = int(np.argmin(held))
    runs: list[list[int]] = []
    current: list[int] = []
    for i in range(1, n + 1):                       # one lap, starting just after a False
        k = (first_false + i) % n
        if held[k]:
            current.append(k)
        elif current:
            runs.append(current)
            current = []
    out = []
    for run in runs:
        split = next((j for j in range(1, len(run)) if run[j] != run[j - 1] + 1), len(run))
        parts = [run[:split], run[split:]] if split < len(run) else [run]
        out.append(tuple(sorted((p[0], p[-1]) for p in parts)))
    return out
