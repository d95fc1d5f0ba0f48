"""The tiers under the device: host memory, bounded by the host budget, and the jobs' spill files.

"On the host" means off the device with the values kept, in one of two tiers: the host tier
(host memory, at most ``tensile.host_budget`` bytes in all) or the disk tier (the job's spill file
in ``tensile.spill_dir``, :mod:`.spill`). The memory manager decides which tier a swap-out goes
to and moves the bytes (:mod:`.residency`); :class:`HostTier` keeps the tiers' accounts and
their files.
"""

from __future__ import annotations

import collections

from .spill import SpillDir, SpillFile
from .tensors import Tensor


class HostTier:
    """The accounts and files of the tiers under one memory manager's device.

    It owns:

    - ``budget_nbytes`` (the host budget; None: unbounded) and ``spill`` (the spill directory;
      None: no disk tier), both constant;
    - the bytes the host tier holds, by what holds them: ``nbytes`` (the jobs' swapped-out
      copies), ``pending_nbytes`` (swap-outs to the host in flight), ``cache_nbytes`` (cached
      copies of read-only tensors, :attr:`cache`), ``copies_nbytes`` (the jobs' copies of their
      weights, and a region install's staged blocks), with ``peak_nbytes``, the high-water mark of
      their sum (:meth:`used_nbytes`);
    - ``disk_nbytes``, the jobs' bytes in the disk tier;
    - :attr:`cache`, the read-only tensors whose host copy is kept (tensor id -> tensor, least
      recently used first), and :attr:`files`, each job's spill file (job id -> file).

    Every field is guarded by the memory manager's lock: the manager reads and changes them, and
    calls every method, with it held.
    """

    def __init__(self, budget_nbytes: int | None, spill: SpillDir | None):
        self.budget_nbytes = budget_nbytes
        self.spill = spill
        self.nbytes = 0
        self.pending_nbytes = 0
        self.cache_nbytes = 0
        self.copies_nbytes = 0
        self.peak_nbytes = 0
        self.disk_nbytes = 0
        self.cache: collections.OrderedDict[int, Tensor] = collections.OrderedDict()
        self.files: dict[int, SpillFile] = {}

    def used_nbytes(self) -> int:
        """The bytes the host tier holds now: swapped-out copies, copies in flight, cached
        read-only copies and the jobs' copies of their weights."""
        return self.nbytes + self.pending_nbytes + self.cache_nbytes + self.copies_nbytes

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit within the host budget now."""
        return self.budget_nbytes is None or self.used_nbytes() + nbytes <= self.budget_nbytes

    def note_peak(self) -> None:
        self.peak_nbytes = max(self.peak_nbytes, self.used_nbytes())

    def keep(self, t: Tensor) -> None:
        """Count ``t``'s host copy (``t.host``, just made) as cached."""
        self.cache[t.id] = t
        self.cache_nbytes += t.nbytes
        self.note_peak()

    def touch(self, t: Tensor) -> bool:
        """Mark ``t``'s cached host copy as just used; whether it is cached."""
        if t.id not in self.cache:
            return False
        self.cache.move_to_end(t.id)             # least recently used goes first
        return True

    def forget(self, t: Tensor) -> None:
        """Give up ``t``'s cached host copy, if it has one."""
        if self.cache.pop(t.id, None) is not None:
            t.host = None
            self.cache_nbytes -= t.nbytes

    def slot(self, t: Tensor) -> tuple[SpillFile, int]:
        """A slot of ``t``'s job's spill file for ``t``: (file, offset)."""
        file = self.files.get(t.job_id)
        if file is None:
            file = self.files[t.job_id] = self.spill.open(f"job-{t.job_id}")
        return file, file.reserve(t.arena_nbytes)

    def close_job(self, job_id: int) -> None:
        """Remove the job's spill file, if it has one."""
        file = self.files.pop(job_id, None)
        if file is not None:
            file.close()

    def close(self) -> None:
        """Remove every job's spill file."""
        for file in self.files.values():
            file.close()
        self.files.clear()
