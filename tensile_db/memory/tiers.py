"""The tiers under the device: host memory, bounded by the host budget, and the jobs' spill files.

"On the host" means off the device with the values kept, in one of two tiers: the host tier
(host memory, at most ``tensile.host_budget`` bytes in all) or the disk tier (the job's spill file
in ``tensile.spill_dir``, :mod:`.spill`). The memory manager decides which tier a swap-out goes
to and moves the bytes (:mod:`.residency`); :class:`HostTier` keeps the tiers' accounts and
their files.
"""

from __future__ import annotations

import collections
import math
import weakref

import numpy as np

from ..runtime.checks import require
from .spill import SpillDir, SpillFile
from .tensors import JobMemory, Residency, Tensor

#: Bytes of freed swap-out buffers the host tier keeps at most for later swap-outs of their size
#: (Note [Spare host buffers]).
SPARE_NBYTES_MAX = 64 << 20


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
      recently used first), and :attr:`files`, each job's spill file (job id -> file);
    - the synchronous disk I/O of the reactive path (:meth:`spill_now`, :meth:`read_now`,
      :meth:`write_new`), through the manager's copy ``engine``;
    - the spare host buffers (:meth:`host_buffer`, :meth:`give_back`), ``spare_nbytes`` in all.

    Note [Spare host buffers]
    ~~~~~~~~~~~~~~~~~~~~~~~~~
    Rationale: the coordinator fixes glibc's mmap threshold at 1 MiB (``fix_mmap_threshold``),
    so a swap-out's host copy of 1 MiB or more was a fresh mapping, zeroed and faulted in page
    by page, and unmapped again when its swap-in landed. ``bench/throughput.py`` with the
    threshold fixed as the coordinator fixes it: the MLP at half its peak (4.5 MiB out and in an
    iteration) 1.81 and 1.89x its unlimited time per iteration, the CNN (16.7 MiB) 1.57 and
    1.51x, against 1.41 and 1.49x, 1.37 and 1.40x with glibc's default threshold.

    Approach: a swap-out to host memory on a device whose arena is host memory, and the reactive
    path's eviction there (a fresh 1 MiB copy took 355 us against 68 us into a reused buffer,
    medians of 200), takes its copy's buffer from :meth:`host_buffer`: a spare of the same size,
    kept when an earlier swap-in of a copy this tier made landed (:meth:`give_back`), else a new
    one. The spares are bytes the process holds: they are kept only within
    :data:`SPARE_NBYTES_MAX` and, with the bytes in use, within the host budget, and dropped as
    the bytes in use grow into it (:meth:`note_peak`).

    Limitations: only a buffer of the very size is reused; ``cuda`` swaps to its own page-locked
    copies as before.

    Every field is guarded by the memory manager's lock: the manager reads and changes them, and
    calls every method, with it held.
    """

    def __init__(self, budget_nbytes: int | None, spill: SpillDir | None, engine):
        self.budget_nbytes = budget_nbytes
        self.spill = spill
        self.engine = engine
        self.nbytes = 0
        self.pending_nbytes = 0
        self.cache_nbytes = 0
        self.copies_nbytes = 0
        self.peak_nbytes = 0
        self.disk_nbytes = 0
        self.cache: collections.OrderedDict[int, Tensor] = collections.OrderedDict()
        self.files: dict[int, SpillFile] = {}
        self.spares: dict[int, list[np.ndarray]] = {}      # nbytes -> flat uint8 buffers, spare
        self.spare_nbytes = 0
        self._made: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # id -> buffer made here

    def used_nbytes(self) -> int:
        """The bytes the host tier holds now: swapped-out copies, copies in flight, cached
        read-only copies and the jobs' copies of their weights."""
        return self.nbytes + self.pending_nbytes + self.cache_nbytes + self.copies_nbytes

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit within the host budget now."""
        return self.budget_nbytes is None or self.used_nbytes() + nbytes <= self.budget_nbytes

    def note_peak(self) -> None:
        """Raise ``peak_nbytes`` to the bytes held now: called wherever they grow (a copy in
        flight, a swapped-out copy, a cached copy, a job's copy of its weights); drops spare
        buffers that no longer fit beside them within the host budget."""
        used = self.used_nbytes()
        self.peak_nbytes = max(self.peak_nbytes, used)
        while self.spare_nbytes and self.budget_nbytes is not None and used + self.spare_nbytes > self.budget_nbytes:
            nbytes = max(self.spares)
            self._take_spare(nbytes)

    def host_buffer(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised host array of ``shape`` and ``dtype`` for a swap-out's or an eviction's
        copy: a spare of its size if one is kept, else new (Note [Spare host buffers])."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        flat = self._take_spare(nbytes) if self.spares.get(nbytes) else None
        if flat is None:
            flat = np.empty(nbytes, np.uint8)
            self._made[id(flat)] = flat
        return flat.view(dtype).reshape(shape)

    def give_back(self, host: np.ndarray) -> None:
        """Keep ``host``, a swap-out's copy whose swap-in has landed, as a spare if this tier made
        its buffer and it fits within :data:`SPARE_NBYTES_MAX` and the host budget; else let it go."""
        flat = host.base
        if flat is None or self._made.get(id(flat)) is not flat or flat.nbytes != host.nbytes:
            return
        nbytes = flat.nbytes
        room = SPARE_NBYTES_MAX if self.budget_nbytes is None else \
            min(SPARE_NBYTES_MAX, self.budget_nbytes - self.used_nbytes())
        if self.spare_nbytes + nbytes <= room:
            self.spares.setdefault(nbytes, []).append(flat)
            self.spare_nbytes += nbytes

    def _take_spare(self, nbytes: int) -> np.ndarray:
        spares = self.spares[nbytes]
        flat = spares.pop()
        if not spares:
            del self.spares[nbytes]
        self.spare_nbytes -= nbytes
        return flat

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

    def write_new(self, t: Tensor, host) -> tuple[SpillFile, int]:
        """Write ``host`` (``t``'s values, just adopted) to a new slot of its job's spill file and
        return the slot; on a failure (the disk is full) the slot goes back and the error is raised."""
        file, offset = where = self.slot(t)
        try:
            file.write_from(offset, host)
        except BaseException:
            file.release(offset, t.arena_nbytes)
            raise
        return where

    def spill_now(self, t: Tensor, block) -> tuple[SpillFile, int]:
        """Write ``block`` (``t``'s arena block, uint8) to a new slot of its job's spill file now
        (the reactive path) and return the slot; on a failure the slot goes back and the error is
        raised."""
        file, offset = where = self.slot(t)
        try:
            self.engine.write_now(block, file, offset)
        except BaseException:
            file.release(offset, t.arena_nbytes)
            raise
        return where

    def reader(self, t: Tensor):
        """``read(out)``: fills a uint8 array of at least ``t.nbytes`` with ``t``'s values from its
        spill slot or its source."""
        if t.spill is not None:
            file, offset = t.spill
            return lambda out: file.read_into(offset, out, t.nbytes)
        return lambda out: t.source.read_into(out[:t.nbytes])

    def read_now(self, t: Tensor, block) -> None:
        """Fill ``block`` (``t``'s arena block) from its spill slot or its source now (a passive load)."""
        self.engine.read_now(self.reader(t), block)

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
        self.spares.clear()
        self.spare_nbytes = 0

    def describe(self) -> dict:
        """The tiers' figures for :meth:`tensile_db.memory.manager.MemoryManager.snapshot`, bytes."""
        return {"host_nbytes": self.nbytes, "host_budget_nbytes": self.budget_nbytes,
                "host_used_nbytes": self.used_nbytes(), "host_peak_nbytes": self.peak_nbytes,
                "host_cache_nbytes": self.cache_nbytes, "disk_nbytes": self.disk_nbytes,
                "spill_file_nbytes": sum(f.end_nbytes for f in self.files.values()),
                "disk_free_nbytes": self.spill.free_nbytes() if self.spill is not None else None}

    def check(self, tensors: list[Tensor], jobs: dict[int, JobMemory]) -> None:
        """Raise AssertionError (also under ``python -O``) unless the accounts are what the
        manager's ``tensors`` and ``jobs`` hold: the cached bytes, the jobs' host and disk totals,
        the swap-outs to the host in flight, each spill file's slots; and the host tier is within
        its budget."""
        cached = sum(t.nbytes for t in self.cache.values())
        require(cached == self.cache_nbytes, f"{self.cache_nbytes:,} cached host bytes counted, {cached:,} held")
        host, disk = sum(j.host_nbytes for j in jobs.values()), sum(j.disk_nbytes for j in jobs.values())
        require((self.nbytes, self.disk_nbytes) == (host, disk),
                f"the totals of {self.nbytes:,} host and {self.disk_nbytes:,} disk bytes are not the jobs' "
                f"{host:,} and {disk:,}")
        out = [t for t in tensors if t.residency is Residency.SWAPPING_OUT]
        pending = sum(t.nbytes for t in out if t.transfer.spill is None)
        require(pending == self.pending_nbytes,
                f"{self.pending_nbytes:,} bytes of swap-outs to the host counted in flight, {pending:,} are")
        for job_id, file in self.files.items():
            slots = [t for t in tensors if t.job_id == job_id and t.spill is not None] + \
                    [t for t in out if t.job_id == job_id and t.transfer.spill is not None]
            held = sum(file.slot_nbytes(t.arena_nbytes) for t in slots)
            require(held == file.in_use_nbytes,
                    f"job {job_id}'s spill file has {file.in_use_nbytes:,} bytes of slots handed out; its tensors "
                    f"hold {held:,}")
        if self.budget_nbytes is not None:
            require(self.fits(0), f"the host tier holds {self.used_nbytes():,} bytes, over its budget of "
                                  f"{self.budget_nbytes:,}")
