"""The memory manager's core: every device tensor of every job, where it lives, and the budget.

The manager owns one arena of ``budget`` bytes on the device (:class:`ArenaAllocator` over one
device buffer) and registers every tensor the runtime creates
(:class:`~tensile_db.memory.tensors.Tensor`): owning job, slot, kind, shape, dtype, bytes, and
its residency — on the device at an arena offset, or on the host as a NumPy copy. Operators get
their tensors through :meth:`MemoryManager.acquire`, which makes them resident and pins them for
the duration of the op; a plan (:mod:`tensile_db.scheduler`) moves them ahead of time through
:meth:`~MemoryManager.swap_out`, :meth:`~MemoryManager.release`, :meth:`~MemoryManager.swap_in` and
:meth:`~MemoryManager.drop`, copies that run on the swap engine while ops compute. Every
transition is in :mod:`tensile_db.memory.residency`, the manager's base class.

This is the mechanism; the rules are policies it calls, each through a narrow interface (the
methods under "the policies' interface", called with the lock held): which tensor leaves and when
to compact (:mod:`tensile_db.memory.eviction`, Note [Eviction order]), the planned region's
recording, layout and moves (:mod:`tensile_db.memory.planned`; the manager performs the moves),
and the rules of the device weight cache (:mod:`tensile_db.memory.cache`). :meth:`MemoryManager.check`
verifies the invariants.

Several threads may run ops at once (the executor and the inference calls); the manager's lock
serialises every change, and an acquire may wait for other threads' pins (:mod:`.pins`).
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import Callable

import numpy as np

from ..errors import DeviceOutOfMemory, InvalidArgument
from ..runtime.checks import require
from ..runtime.program import Kind, Slot
from ..settings import DEFAULT_POOL, POOLS
from .arena import ArenaAllocator
from .cache import WeightCache
from .eviction import Eviction, Fragmented
from .moves import RegionInstaller
from .pins import Pins
from .planned import PlannedPool
from .residency import Residencies
from .spill import SpillDir
from .tensors import JobMemory, Residency, Tensor
from .tiers import HostTier

__all__ = ["JobMemory", "MemoryManager", "NextUse", "Residency", "Tensor"]

NextUse = Callable[[Tensor], float]


class MemoryManager(Residencies):
    """Owns the arena on ``device`` and every tensor in it.

    Args:
        device: a :class:`tensile_db.runtime.device.Device`.
        budget_nbytes: arena size, bytes (rounded down to the arena unit).
        next_use: the eviction score of a tensor that is not read-only: larger is evicted first
            (the scheduler's distance to its next access, in any unit common to all jobs, or
            under ``dtr`` minus its h). Unknown tensors should return ``math.inf``.
        pool: ``"planned"`` (recurring allocations from a lifetime-planned region once one
            period has been recorded; the default) or ``"general"`` (the best-fit pool only).

    Raises:
        InvalidArgument: an unknown ``pool``.

    ``droppable(t)`` (default: never; the scheduler's under ``dtr``) says whether an eviction
    drops ``t`` (its job recomputes it) rather than copying it out.

    ``limit_nbytes`` (default: the budget) is where eviction starts: a scheduler that keeps
    headroom for fragmentation lowers it. An op whose working set needs more still gets up to the
    budget once nothing is left to evict.

    Thread safety: every public method takes the manager's lock, except :meth:`at` and
    :meth:`~Residencies.array`, which say why they need not; ops of several threads may run at
    once, each on the tensors it has pinned.
    """

    def __init__(self, device, budget_nbytes: int, next_use: NextUse | None = None, pool: str = DEFAULT_POOL,
                 host_budget_nbytes: int | None = None, spill: SpillDir | None = None):
        if pool not in POOLS:
            raise InvalidArgument(f"unknown pool {pool!r}; use one of {', '.join(POOLS)}")
        if host_budget_nbytes is not None and (host_budget_nbytes < 0 or spill is None or not device.holds_values):
            raise InvalidArgument(f"a host budget of {host_budget_nbytes} bytes needs a spill directory and a device "
                                  "with values (cpu or cuda), and must not be negative")
        self.device = device
        self.engine = device.copy_engine()
        self.host_tier = HostTier(host_budget_nbytes, spill, self.engine)    # guarded by _lock
        self.allocator = ArenaAllocator(budget_nbytes)       # guarded by _lock
        self.budget_nbytes = self.allocator.capacity_nbytes  # constant
        self.limit_nbytes = self.budget_nbytes   # set by the scheduler (before the first op, and with each plan); read under _lock
        self.buffer = device.arena_buffer(self.budget_nbytes)   # constant
        self._views: dict = {}         # (offset, shape, dtype) -> a view of the buffer (Residencies.array)
        self.compactions = 0           # times the arena was defragmented; guarded by _lock
        self.compacted_nbytes = 0      # bytes moved by defragmenting, cumulative; guarded by _lock
        self.next_use: NextUse = next_use or (lambda t: math.inf)   # set by the scheduler before the first op
        self.droppable: Callable[[Tensor], bool] = lambda t: False   # likewise; read under _lock
        self.jobs: dict[int, JobMemory] = {}     # guarded by _lock, and so is every JobMemory in it
        self._tensors: dict[int, Tensor] = {}    # id -> tensor; guarded by _lock
        self._ids = itertools.count(1)           # guarded by _lock
        self._ticks = itertools.count(1)         # guarded by _lock
        self._acquiring: set[int] = set()        # ids of the working set being placed; guarded by _lock
        self._position: dict[int, int] = {}      # job id -> position of the op it runs; see at()
        self._lock = threading.RLock()           # CuPy temporaries re-enter on cuda
        self.pins = Pins(self._lock)             # guarded by _lock
        # guarded by _lock
        self.installer = RegionInstaller(self)
        self.pool = PlannedPool(self.installer.install, self.installer.dissolve, enabled=pool == "planned",
                                synchronous=device.virtual_time, where=self._live_offsets,
                                room=lambda: self.budget_nbytes)
        self.eviction = Eviction(self)
        self.cache = WeightCache(self)

    # -- registration -------------------------------------------------------------------------

    def register_job(self, job_id: int) -> None:
        """Start counting for ``job_id`` (a no-op if it is registered)."""
        with self._lock:
            if job_id not in self.jobs:
                self.jobs[job_id] = JobMemory()
                self.pool.invalidate(f"job {job_id} arrived")

    def release_job(self, job_id: int) -> JobMemory:
        """Free every tensor of the job (device and host) and forget it; returns its counters."""
        with self._lock:
            self.pool.invalidate(f"job {job_id} left")
            for t in [t for t in self._tensors.values() if t.job_id == job_id]:
                self._drop(t)
            self._position.pop(job_id, None)
            self.host_tier.close_job(job_id)
            return self.jobs.pop(job_id, JobMemory())

    def close(self) -> None:
        """Stop the swap engine's and the planned pool's threads and remove the spill files."""
        self.engine.close()
        self.pool.close()
        with self._lock:
            self.host_tier.close()

    def at(self, job_id: int, position: int) -> None:
        """The job is about to run op ``position``: blocks allocated until the next call are
        keyed by it."""
        # No lock: a job's entry is written only by the thread that runs the job's ops (here and
        # in release_job), and read (in _place) only for that job's allocations, which the same
        # thread makes; storing one dict item is atomic in CPython.
        self._position[job_id] = position

    def schedule_changed(self, reason: str) -> None:
        """The scheduler installed a new plan: the recorded lifetimes no longer hold."""
        with self._lock:
            self.pool.invalidate(reason)

    def period_boundary(self) -> None:
        """The executor is between two periods of the combined timeline (no op running): the
        planned pool records, installs or checks its plan here."""
        with self._lock:
            self.pool.boundary(self._live_blocks)

    def _live_blocks(self) -> tuple[dict, int]:
        """(key -> bytes of every keyed block in the arena, bytes of the unkeyed ones)."""
        blocks = [t for t in self._tensors.values() if t.offset is not None and not t.readonly]
        return ({t.key: t.arena_nbytes for t in blocks if t.key is not None},
                sum(t.arena_nbytes for t in blocks if t.key is None))

    def _live_offsets(self) -> dict:
        """Key -> arena offset of every keyed block in the arena (Note [Blocks kept in place] in
        :mod:`~tensile_db.memory.planned`); called under the lock, at a period boundary."""
        return {t.key: t.offset for t in self._tensors.values()
                if t.offset is not None and not t.readonly and t.key is not None}

    def adopt(self, job_id: int, slot: str, kind: Kind, host: np.ndarray, readonly: bool = False) -> Tensor:
        """Register a tensor whose values start on the host (initial weights, optimizer state);
        it is copied into the arena on first use. A ``readonly`` tensor keeps ``host`` itself
        (no copy; it must not change while registered, and on ``cuda`` should be pinned) and its
        device copy is a cache (:mod:`tensile_db.memory.cache`). Host bytes of read-only tensors
        belong to their owner and are not counted as swapped. A tensor that is not read-only goes
        to the host tier, or to the disk tier when the host budget has no room for it."""
        with self._lock:
            t = self._new(job_id, slot, kind, host.shape, host.dtype)
            t.readonly = readonly
            if readonly:
                t.host = host
            elif self._host_room(t.nbytes):
                t.host = self.device.host_copy(host)
                self._account(t, host=t.nbytes)
            else:
                try:
                    t.spill = self.host_tier.write_new(t, host)
                except BaseException:       # the disk is full: nothing of it stays
                    self._tensors.pop(t.id)
                    raise
                self._account(t, disk=t.nbytes, spilled_nbytes=t.nbytes)
            return t

    def adopt_source(self, job_id: int, slot: str, kind: Kind, shape: tuple[int, ...], dtype, source) -> Tensor:
        """Register a read-only tensor of ``shape`` and ``dtype`` whose values live in ``source``
        (an object with ``nbytes`` and ``read_into(out)``, ``out`` a C-contiguous uint8 array
        of ``nbytes`` bytes: a layer of a model file), not in host memory. A load reads it
        (on the swap engine for a prefetch); a read's error (a checksum) reaches whoever waits
        for the load. Its host copy, kept while the host budget has room, is a cache given up
        first when a job's swap-out needs host room. Raises AssertionError when ``source.nbytes``
        differs from the tensor's bytes."""
        with self._lock:
            t = self._new(job_id, slot, kind, shape, dtype)
            assert source.nbytes == t.nbytes, f"{slot}: a source of {source.nbytes} bytes for {t.nbytes}"
            t.readonly, t.source = True, source
            return t

    # -- the op protocol ----------------------------------------------------------------------

    def acquire(self, job_id: int, tensors: list[Tensor], new: list[Slot], what: str = "",
                wait: bool = False, fixed: bool = False) -> list[Tensor]:
        """Make ``tensors`` resident, allocate a tensor for each slot in ``new``, and pin all of
        them until :meth:`unpin`. Returns the new tensors in order. With ``wait``, blocks that
        other threads' ops pin are waited for (see the module docstring); the caller must hold
        no pins and be in no other manager operation. With ``fixed``, the new tensors' addresses
        are handed out as raw pointers: their blocks are never moved.

        Raises:
            DeviceOutOfMemory: the working set exceeds the budget, or does not fit beside what is
                pinned (with ``wait``: after :data:`~.pins.PIN_WAIT_S` seconds of waiting).
        """
        with self._lock:
            need = sum(t.arena_nbytes for t in tensors) + sum(s.arena_nbytes for s in new)
            if need > self.budget_nbytes:
                raise DeviceOutOfMemory(need, self.allocator.in_use_nbytes, self.budget_nbytes, what)
            created = [self._new(job_id, s.name, s.kind, s.shape, s.dtype, fixed) for s in new]
            working = tensors + created
            try:
                self._make_working_set_resident(working, need, what, wait)
            except BaseException:
                for t in created:
                    self._drop(t)
                raise
            self.pins.pin(working)
            tick, now = next(self._ticks), self.device.now()
            for t in working:
                t.last_used, t.accessed_s = tick, now
            return created

    def _make_working_set_resident(self, working: list[Tensor], need: int, what: str, wait: bool) -> None:
        """Place every tensor of ``working`` (pins not yet taken). With ``wait``, while other
        threads' ops pin the blocks that stand in the way, drain and wait for them (up to
        :data:`~.pins.PIN_WAIT_S`); else pack the working set at once (:meth:`Eviction.pack`)."""
        deadline = None                                         # when a wait starts
        try:
            while True:
                while wait and self.pins.others_drain():
                    deadline = deadline or self.pins.deadline()
                    self.pins.wait(deadline, need, self.allocator.in_use_nbytes, self.budget_nbytes, what)
                self._acquiring = {t.id for t in working}      # not evicted, but may be moved
                try:
                    for t in working:
                        if t.residency is not Residency.DEVICE:   # (make_resident's no-op, without the call)
                            self.make_resident(t)
                    return
                except Fragmented:
                    if not (wait and self.pins.held_elsewhere(self._tensors.values())):
                        self.eviction.pack(working, what)
                        return
                finally:
                    self._acquiring = set()
                self.pins.drain()
                deadline = deadline or self.pins.deadline()
                self.pins.wait(deadline, need, self.allocator.in_use_nbytes, self.budget_nbytes, what)
        finally:
            self.pins.stop_draining()

    def unpin(self, tensors: list[Tensor]) -> None:
        """Unpin tensors pinned by :meth:`acquire`. Raises AssertionError for an unpinned one."""
        with self._lock:
            self.pins.unpin(tensors)

    def keep(self, tensors: list[Tensor]) -> None:
        """Hold on to the values of ``tensors`` until :meth:`let_go`: an eviction may copy them
        out but never drops them. A job keeps an op's inputs from its check for dropped ones to
        its acquire, so that recomputing one input (or another thread's eviction) cannot drop
        another, nor a tensor between the ops of its own recompute; a tensor found not dropped
        once kept stays so."""
        with self._lock:
            for t in tensors:
                t.keeps += 1

    def let_go(self, tensors: list[Tensor]) -> None:
        """End a :meth:`keep`. Raises AssertionError for a tensor not kept."""
        with self._lock:
            for t in tensors:
                assert t.keeps > 0, f"let_go of {t.slot} of job {t.job_id}, which is not kept"
                t.keeps -= 1

    def free(self, t: Tensor) -> None:
        """Forget a tensor: its arena block or host copy is released."""
        with self._lock:
            self._drop(t)
            self.pins.released.notify_all()

    def take_host(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` of the host tier for copies held outside the registry (a job's
        weights, for its result or a held-out loss; a region install's staged blocks), giving up
        cached read-only copies for room;
        returns False, reserving nothing, when the host budget has no room (the caller uses the
        disk tier). Give back with :meth:`give_host`."""
        with self._lock:
            if not self._host_room(nbytes):
                return False
            self.host_tier.copies_nbytes += nbytes
            self.host_tier.note_peak()
            return True

    def give_host(self, nbytes: int) -> None:
        """Give back host bytes :meth:`take_host` reserved."""
        with self._lock:
            self.host_tier.copies_nbytes -= nbytes
            assert self.host_tier.copies_nbytes >= 0

    def note_recompute(self, t: Tensor) -> None:
        """The owning job recomputed the dropped tensor ``t``."""
        with self._lock:
            self._account(t, recomputes=1)

    # -- statistics and invariants ------------------------------------------------------------

    @property
    def in_use_nbytes(self) -> int:
        """Arena bytes allocated now (the planned region counts whole), bytes."""
        return self.allocator.in_use_nbytes

    @property
    def peak_nbytes(self) -> int:
        """The arena's high-water mark, bytes; never above ``budget_nbytes``."""
        return self.allocator.peak_nbytes

    def cache_nbytes(self) -> int:
        """Arena bytes of the weight cache, bytes (:meth:`WeightCache.nbytes`)."""
        return self.cache.nbytes()

    def tensors(self, job_id: int | None = None) -> list[Tensor]:
        """The registered tensors (of ``job_id`` only, if given), in registration order."""
        with self._lock:
            return [t for t in self._tensors.values() if job_id is None or t.job_id == job_id]

    def blocks(self) -> list[tuple[int, int, Tensor]]:
        """Every tensor's arena block as ``(offset, arena bytes, tensor)``, sorted by offset."""
        with self._lock:
            return sorted(((t.offset, t.arena_nbytes, t) for t in self._tensors.values() if t.offset is not None),
                          key=lambda b: b[0])

    def check(self) -> None:
        """Raise AssertionError (also under ``python -O``) unless: no two blocks share a byte;
        every block lies inside the arena, a planned one inside the planned region and any other
        one is the allocator's block of its size; the allocator's bytes in use are the blocks'
        (the planned region counting whole); every job's device and host bytes are its tensors';
        every pinned tensor is resident."""
        with self._lock:
            region = (self.pool.base, self.pool.base + self.pool.region_nbytes)
            self.allocator.check_blocks([(offset, size, t.planned, f"{t.slot} of job {t.job_id}")
                                         for offset, size, t in self.blocks()], region)
            for job_id, j in self.jobs.items():
                mine = [t for t in self._tensors.values() if t.job_id == job_id]
                device = sum(t.arena_nbytes for t in mine if t.offset is not None)
                host = sum(t.nbytes for t in mine if t.host is not None and not t.readonly)
                disk = sum(t.nbytes for t in mine if t.spill is not None)
                require((j.device_nbytes, j.host_nbytes, j.disk_nbytes) == (device, host, disk),
                        f"job {job_id} counts {j.device_nbytes:,} device, {j.host_nbytes:,} host and "
                        f"{j.disk_nbytes:,} disk bytes; its tensors hold {device:,}, {host:,} and {disk:,}")
            self.host_tier.check(list(self._tensors.values()), self.jobs)
            for t in self._tensors.values():
                require(not t.pins or t.residency is Residency.DEVICE,
                        f"{t.slot} of job {t.job_id} is pinned but {t.residency.value}")

    def snapshot(self) -> dict:
        """Device-wide and per-job counters, bytes."""
        with self._lock:
            a = self.allocator
            return {
                "device": self.device.name,
                "budget_nbytes": self.budget_nbytes,
                "in_use_nbytes": a.in_use_nbytes,
                "peak_nbytes": a.peak_nbytes,
                "free_blocks": a.free_blocks,
                "largest_free_nbytes": a.largest_free_nbytes,
                "fragmentation": round(a.fragmentation, 4),
                "compactions": self.compactions,
                "compacted_nbytes": self.compacted_nbytes,
                **self.host_tier.describe(),
                **self.pool.describe(),
                "jobs": {job_id: dict(vars(j), **self.pool.job_figures(job_id)) for job_id, j in self.jobs.items()},
            }

    # -- the policies' interface (the caller holds the lock) ----------------------------------

    def held(self, t: Tensor) -> bool:
        """Whether ``t`` is pinned or in the working set an acquire is placing: never evicted."""
        return bool(t.pins) or t.id in self._acquiring

    # -- internals ----------------------------------------------------------------------------

    def _new(self, job_id: int, slot: str, kind: Kind, shape, dtype, fixed: bool = False) -> Tensor:
        t = Tensor(next(self._ids), job_id, slot, kind, tuple(shape), np.dtype(dtype), fixed=fixed,
                   accessed_s=self.device.now())
        self._tensors[t.id] = t
        return t

