"""The reactive policy: farthest next use across all jobs (Belady's rule).

Each running job registers its program (its access sequence) and reports the op it has just run.
The distance to a tensor's next use is the number of the owning job's ops until the slot is next
accessed, wrapping into the next iteration for weights and optimizer state, times the rounds one
op of that job takes: the executor runs ``k * L`` ops of a job of ``L`` ops per period of ``R``
rounds (Note [Fair sharing] in :mod:`tensile_db.scheduler.timeline`), so one op is ``R / (k * L)``
rounds, and distances of different jobs are measured in the same unit, rounds of the device.
"""

from __future__ import annotations

import math
import threading

from ..runtime.program import Program


class FarthestNextUse:
    """``policy(tensor) -> float``: rounds until the tensor's next access; ``inf`` if unknown.

    ``_jobs`` (job id -> (program, position of the op just run, rounds per op)) is replaced whole
    per job, never mutated in place; ``_lock`` guards adding and removing jobs.
    """

    def __init__(self):
        # Entries added and removed under _lock; an entry is replaced whole (see advance) without it.
        self._jobs: dict[int, tuple[Program, int, float]] = {}
        self._lock = threading.Lock()

    def track(self, job_id: int, program: Program) -> None:
        """Start following a job, before its first op (one round per op until :meth:`pace`)."""
        with self._lock:
            self._jobs[job_id] = (program, -1, 1.0)

    def pace(self, job_id: int, rounds_per_op: float) -> None:
        """One op of the job now takes ``rounds_per_op`` rounds of the executor."""
        # No lock, as in advance.
        program, position, _ = self._jobs[job_id]
        self._jobs[job_id] = (program, position, rounds_per_op)

    def advance(self, job_id: int, position: int) -> None:
        """The job has just run op ``position`` of its program."""
        # No lock: only the executor thread writes a job's entry after track (here and in pace),
        # and it stores a new tuple whole, one atomic dict store in CPython; a reader on another
        # thread (the manager's eviction, under the manager's lock) sees the old tuple or the new
        # one, each a valid distance. Taking _lock here would not order it against those reads.
        program, _, rounds_per_op = self._jobs[job_id]
        self._jobs[job_id] = (program, position, rounds_per_op)

    def forget(self, job_id: int) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def position(self, job_id: int) -> int | None:
        """The op of the job's iteration it has just run (-1 before its first); None for a job
        not followed. Read without the lock, as :meth:`__call__` reads."""
        entry = self._jobs.get(job_id)
        return None if entry is None else entry[1]

    def __call__(self, tensor) -> float:
        entry = self._jobs.get(tensor.job_id)
        if entry is None or tensor.slot not in entry[0].slots:
            return math.inf
        program, position, rounds_per_op = entry
        return program.next_use(tensor.slot, position) * rounds_per_op
