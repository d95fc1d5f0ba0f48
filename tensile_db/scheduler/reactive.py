"""The reactive policy: farthest next use across all jobs (Belady's rule).

Each running job registers its program (its access sequence) and reports the op it has just run.
The distance to a tensor's next use is the number of the owning job's ops until the slot is next
accessed, wrapping into the next iteration for weights and optimizer state. The executor steps
every running job one op at a time in round robin, so one op of any job is one round of the whole
device and distances of different jobs are measured in the same unit.
"""

from __future__ import annotations

import math
import threading

from ..runtime.program import Program


class FarthestNextUse:
    """``policy(tensor) -> float``: ops until the tensor's next access; ``inf`` if unknown."""

    def __init__(self):
        self._jobs: dict[int, tuple[Program, int]] = {}
        self._lock = threading.Lock()

    def track(self, job_id: int, program: Program) -> None:
        """Start following a job, before its first op."""
        with self._lock:
            self._jobs[job_id] = (program, -1)

    def advance(self, job_id: int, position: int) -> None:
        """The job has just run op ``position`` of its program."""
        program, _ = self._jobs[job_id]
        self._jobs[job_id] = (program, position)

    def forget(self, job_id: int) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def __call__(self, tensor) -> float:
        entry = self._jobs.get(tensor.job_id)
        if entry is None or tensor.slot not in entry[0].slots:
            return math.inf
        program, position = entry
        return float(program.next_use(tensor.slot, position))
