"""The memory manager: every device tensor of every job, where it lives, and the budget.

The manager owns one arena of ``budget`` bytes on the device (:class:`ArenaAllocator` over one
device buffer) and registers every tensor the runtime creates: owning job, slot, kind, shape,
dtype, bytes, and its residency — on the device at an arena offset, or on the host as a NumPy
copy. Operators get their tensors through :meth:`MemoryManager.acquire`, which makes them resident
and pins them for the duration of the op.

A plan (:mod:`tensile_db.scheduler`) moves tensors ahead of time through the asynchronous
operations :meth:`MemoryManager.swap_out`, :meth:`~MemoryManager.release`,
:meth:`~MemoryManager.swap_in` and :meth:`~MemoryManager.drop`; the copies run on the swap engine
(:mod:`tensile_db.memory.transfer`) while ops compute. A swapped-out tensor keeps its arena block
until it is released, so the bytes in use follow the plan exactly.

Correctness never depends on a plan. When an allocation does not fit, the manager swaps out the
unpinned resident tensor whose next use is farthest away, across all jobs (Belady's rule over
the jobs' access sequences, supplied by the scheduler as ``next_use``), until the block fits; a
tensor that is on the host when an op needs it is swapped back in at once (a *passive* swap-in:
a miss of the plan). A dropped tensor is given a block without values and its job recomputes it.
If the free space is too fragmented for the op's working set even then, everything is swapped out
and the working set is placed from offset 0, largest first. An op whose working set exceeds the
budget raises :class:`DeviceOutOfMemory`.

Blocks come from two allocators sharing the arena: the general pool (best fit, the
arena's :class:`ArenaAllocator`) and, once a period of the combined timeline has been recorded,
the planned region, where each recurring allocation has a lifetime-planned offset and costs a
lookup (:mod:`tensile_db.memory.planned`, Note [Planned pool]). Every allocation goes through
:meth:`MemoryManager._place` and every free through :meth:`MemoryManager._free_block`.

*Read-only* tensors (:meth:`MemoryManager.adopt` with ``readonly=True``: the layers of a served
model, :mod:`tensile_db.inference`) keep their host copy for good, so the device copy is a cache:
loading one keeps the host copy, and evicting one frees its block without a copy. Eviction gives
them up first, least recently used first, and those no running call is about to use before those
one is (Note [Eviction order]).

Several threads may run ops at once (the executor and the inference calls); the manager's lock
serialises every change. An op's :meth:`~MemoryManager.acquire` with ``wait=True`` that finds the
free space held by tensors another thread's op has pinned waits for those pins to go, instead of
failing, and while it waits it *drains*: other threads' new waiting acquires hold back, so the
pins in the way cannot keep coming back. Only callers that hold no pins and are inside no other
manager operation may wait (an op's own acquire, not a library temporary allocated during an
op), so pins always go and no two threads wait for each other.

Device and host byte counters change only in :meth:`MemoryManager._account`.

Note [Eviction order]
---------------------
Rank, highest evicted first: (1) read-only tensors no call holds in its prefetch window, least
recently used first: a free, and a later load if they are used again; (2) read-only tensors in
some call's window: a free and a certain reload, cheaper than any copy out; most recently used
first, since a call streams its layers in order and the one it used last is the one it needs
last; (3) the other tensors, farthest next use first (Belady's rule across jobs), larger first
among equals: a copy out and a copy back. So a training job that needs memory takes the device
weight cache first. A prefetch evicts only (1): it never pushes out a layer a window holds.
"""

from __future__ import annotations

import enum
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import DeviceOutOfMemory, InvalidArgument
from ..runtime.program import Kind, Slot
from ..settings import POOLS
from .arena import ArenaAllocator, round_up
from .planned import PlannedPool, State
from .transfer import Transfer, TransferEngine


class Residency(str, enum.Enum):
    DEVICE = "device"
    SWAPPING_OUT = "swapping out"    # being copied to the host; still holds its arena block
    HOST = "host"
    SWAPPING_IN = "swapping in"      # holds its block; the copy from the host is in flight
    DROPPED = "dropped"              # values discarded; recomputed from its producer when needed
    FREED = "freed"


@dataclass(eq=False)
class Tensor:
    """A registered tensor. ``nbytes`` is its size in bytes; ``arena_nbytes`` rounded to the unit."""

    id: int
    job_id: int
    slot: str
    kind: Kind
    shape: tuple[int, ...]
    dtype: np.dtype
    residency: Residency = Residency.HOST
    offset: int | None = None            # arena offset, bytes, while on the device
    host: np.ndarray | None = None       # host copy while on the host
    pins: int = 0                        # ops currently using it; pinned tensors are never evicted
    swapped_out: bool = False            # has been swapped out at least once (a later load is a swap-in)
    transfer: Transfer | None = None     # the copy in flight while swapping out or in
    key: tuple | None = None             # (job, slot, op position) its block was allocated under
    planned: bool = False                # its block is in the planned region
    readonly: bool = False               # host copy kept for good; evicting it is a free, loading it a cache fill
    pin_owners: list = field(default_factory=list)   # thread ident of each pin
    wanted: int = 0                      # read-only: prefetch windows of running calls that hold it
    last_used: int = 0                   # tick of its last acquire (least recently used goes first)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def arena_nbytes(self) -> int:
        return round_up(self.nbytes)


@dataclass
class JobMemory:
    """Per-job counters. Bytes throughout; ``*_nbytes`` totals are cumulative."""

    device_nbytes: int = 0          # arena bytes held now
    peak_nbytes: int = 0            # high-water mark of device_nbytes
    host_nbytes: int = 0            # bytes swapped out and held on the host now
    swapped_out_nbytes: int = 0     # bytes copied device -> host by eviction, cumulative
    swapped_in_nbytes: int = 0      # bytes copied host -> device for evicted tensors, cumulative
    swap_outs: int = 0
    swap_ins: int = 0               # planned + passive
    planned_swap_ins: int = 0       # issued ahead of the access by a plan
    passive_swap_ins: int = 0       # made when an op needed the tensor: misses of the plan
    recomputes: int = 0             # dropped tensors recomputed
    weight_loads: int = 0           # read-only tensors copied host -> device
    weight_loaded_nbytes: int = 0   # their bytes, cumulative
    cache_evictions: int = 0        # read-only tensors given up for room (a free, no copy)


NextUse = Callable[[Tensor], float]

#: How long an acquire waits for other threads' ops to release the blocks it needs, seconds,
#: before it raises DeviceOutOfMemory.
PIN_WAIT_S = 60.0


class MemoryManager:
    """Owns the arena on ``device`` and every tensor in it.

    Args:
        device: a :class:`tensile_db.runtime.device.Device`.
        budget_nbytes: arena size, bytes (rounded down to the arena unit).
        next_use: distance to a tensor's next access (any unit common to all jobs); larger is
            evicted first. Unknown tensors should return ``math.inf``.
        pool: ``"planned"`` (recurring allocations from a lifetime-planned region once one
            period has been recorded; the default) or ``"general"`` (the best-fit pool only).

    ``limit_nbytes`` (default: the budget) is where eviction starts: a scheduler that keeps
    headroom for fragmentation lowers it. An op whose working set needs more still gets up to the
    budget once nothing is left to evict.

    Thread safety: every method takes the manager's lock; ops of several threads (the executor,
    the inference calls) may run at once, each on the tensors it has pinned.
    """

    def __init__(self, device, budget_nbytes: int, next_use: NextUse | None = None, pool: str = "planned"):
        if pool not in POOLS:
            raise InvalidArgument(f"unknown pool {pool!r}; use one of {', '.join(POOLS)}")
        self.device = device
        self.allocator = ArenaAllocator(budget_nbytes)
        self.budget_nbytes = self.allocator.capacity_nbytes
        self.limit_nbytes = self.budget_nbytes      # bytes in use kept below this while evicting helps
        self.buffer = device.arena_buffer(self.budget_nbytes)
        self.engine = TransferEngine(device)
        self.compactions = 0           # times the arena was defragmented
        self.compacted_nbytes = 0      # bytes moved by defragmenting, cumulative
        self.next_use: NextUse = next_use or (lambda t: math.inf)
        self.jobs: dict[int, JobMemory] = {}
        self._tensors: dict[int, Tensor] = {}
        self._ids = itertools.count(1)
        self._acquiring: set[int] = set()
        self._lock = threading.RLock()      # CuPy temporaries re-enter on cuda
        self._unpinned = threading.Condition(self._lock)   # notified when pins or blocks go
        self._drainer: int | None = None    # thread whose acquire waits for other threads' pins to go
        self._ticks = itertools.count(1)
        self._position: dict[int, int] = {}   # job id -> position of the op it is running
        self.pool = PlannedPool(self._install_region, self._dissolve_region, enabled=pool == "planned")

    # -- registration -------------------------------------------------------------------------

    def register_job(self, job_id: int) -> None:
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
            return self.jobs.pop(job_id, JobMemory())

    def close(self) -> None:
        """Stop the swap engine's and the planned pool's threads."""
        self.engine.close()
        self.pool.close()

    def at(self, job_id: int, position: int) -> None:
        """The job is about to run op ``position``: blocks allocated until the next call are
        keyed by it."""
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

    def adopt(self, job_id: int, slot: str, kind: Kind, host: np.ndarray, readonly: bool = False) -> Tensor:
        """Register a tensor whose values start on the host (initial weights, optimizer state);
        it is copied into the arena on first use. A ``readonly`` tensor keeps ``host`` itself
        (no copy; it must not change while registered, and on ``cuda`` should be pinned) and its
        device copy is a cache: see the module docstring. Host bytes of read-only tensors belong
        to their owner and are not counted as swapped."""
        with self._lock:
            t = self._new(job_id, slot, kind, host.shape, host.dtype)
            t.readonly = readonly
            if readonly:
                t.host = host
            else:
                t.host = np.array(host, order="C", copy=True)
                self._account(t, host=t.nbytes)
            return t

    # -- the op protocol ----------------------------------------------------------------------

    def acquire(self, job_id: int, tensors: list[Tensor], new: list[Slot], what: str = "",
                wait: bool = False) -> list[Tensor]:
        """Make ``tensors`` resident, allocate a tensor for each slot in ``new``, and pin all of
        them until :meth:`unpin`. Returns the new tensors in order. With ``wait``, blocks that
        other threads' ops pin are waited for (see the module docstring); the caller must hold
        no pins and be in no other manager operation.

        Raises:
            DeviceOutOfMemory: the working set exceeds the budget, or does not fit beside what is
                pinned (with ``wait``: after :data:`PIN_WAIT_S` seconds of waiting).
        """
        with self._lock:
            need = sum(t.arena_nbytes for t in tensors) + sum(s.arena_nbytes for s in new)
            if need > self.budget_nbytes:
                raise DeviceOutOfMemory(need, self.allocator.in_use_nbytes, self.budget_nbytes, what)
            created = [self._new(job_id, s.name, s.kind, s.shape, s.dtype) for s in new]
            working = tensors + created
            try:
                self._make_working_set_resident(working, need, what, wait)
            except BaseException:
                for t in created:
                    self._drop(t)
                raise
            me, tick = threading.get_ident(), next(self._ticks)
            for t in working:
                t.pins += 1
                t.pin_owners.append(me)
                t.last_used = tick
            return created

    def _make_working_set_resident(self, working: list[Tensor], need: int, what: str, wait: bool) -> None:
        """Place every tensor of ``working`` (pins not yet taken). With ``wait``, while other
        threads' ops pin the blocks that stand in the way, drain and wait for them (up to
        :data:`PIN_WAIT_S`); else pack the working set at once (:meth:`_pack`)."""
        me = threading.get_ident()
        deadline = time.monotonic() + PIN_WAIT_S
        try:
            while True:
                while wait and self._drainer not in (None, me):     # another thread is draining
                    self._wait_for_pins(deadline, need, what)
                self._acquiring = {t.id for t in working}      # not evicted, but may be moved
                try:
                    for t in working:
                        self._make_resident(t)
                    return
                except _Fragmented:
                    if not (wait and self._pinned_elsewhere()):
                        self._pack(working, what)
                        return
                finally:
                    self._acquiring = set()
                self._drainer = me
                self._wait_for_pins(deadline, need, what)
        finally:
            if self._drainer == me:
                self._drainer = None
                self._unpinned.notify_all()

    def _wait_for_pins(self, deadline: float, need: int, what: str) -> None:
        if time.monotonic() > deadline:
            raise DeviceOutOfMemory(need, self.allocator.in_use_nbytes, self.budget_nbytes,
                                    f"{what}, after waiting {PIN_WAIT_S:.0f} s for other ops' blocks")
        self._unpinned.wait(0.05)

    def _pinned_elsewhere(self) -> bool:
        """Whether an op of another thread holds pins now."""
        me = threading.get_ident()
        return any(owner != me for t in self._tensors.values() if t.pins for owner in t.pin_owners)

    def unpin(self, tensors: list[Tensor]) -> None:
        """Unpin tensors pinned by :meth:`acquire`."""
        with self._lock:
            me = threading.get_ident()
            for t in tensors:
                assert t.pins > 0, f"unpin of unpinned tensor {t.slot}"
                t.pins -= 1
                t.pin_owners.remove(me if me in t.pin_owners else t.pin_owners[0])
            self._unpinned.notify_all()

    # -- planned moves ------------------------------------------------------------------------

    def swap_out(self, t: Tensor) -> None:
        """Start copying a resident, unpinned tensor to the host; its block stays taken until
        :meth:`release`. A no-op for a tensor in any other state."""
        with self._lock:
            if t.residency is Residency.DEVICE and not t.pins:
                t.transfer = self.engine.to_host(self.array(t))
                t.residency = Residency.SWAPPING_OUT

    def release(self, t: Tensor) -> None:
        """Finish a swap-out started by :meth:`swap_out` (waiting for the copy if it is late)
        and free the tensor's arena block. A no-op unless the tensor is swapping out."""
        with self._lock:
            if t.residency is Residency.SWAPPING_OUT:
                self._finish_swap_out(t)

    def swap_in(self, t: Tensor) -> None:
        """Take an arena block for a tensor on the host and start copying it in (a planned
        swap-in); an op that accesses it waits for the copy. Makes room by eviction if the block
        does not fit. A no-op unless the tensor is on the host."""
        with self._lock:
            if self._start_load(t) and t.swapped_out:   # else the op that needs it swaps it in
                self.jobs[t.job_id].planned_swap_ins += 1

    def _start_load(self, t: Tensor, clean_only: bool = False) -> bool:
        """If ``t`` is on the host and a block can be placed for it (see :meth:`_make_room`),
        start copying it in on the swap engine; returns whether it did."""
        if t.residency is not Residency.HOST:
            return False
        try:
            t.offset = self._place(t, clean_only)
        except _Fragmented:
            return False
        t.residency = Residency.SWAPPING_IN
        self._account(t, device=t.arena_nbytes)
        t.transfer = self.engine.to_device(t.host, self.array(t, Residency.SWAPPING_IN), pinned=t.readonly)
        return True

    def prefetch(self, t: Tensor) -> bool:
        """Hold the read-only tensor ``t`` in a call's prefetch window and start loading it if it
        is not on the device (on the swap engine: the copy thread on ``cpu``, the copy stream on
        ``cuda``). Room is made by evicting only read-only tensors; if that is not enough the
        load is left to the acquire that needs it. Returns whether a load was started. Undo with
        :meth:`unwant`."""
        with self._lock:
            assert t.readonly, f"prefetch of {t.slot}, which is not read-only"
            t.wanted += 1
            return self._start_load(t, clean_only=True)

    def unwant(self, t: Tensor, keep: bool = True) -> None:
        """A call's prefetch window has let go of the read-only tensor ``t``. With ``keep`` its
        device copy stays as cache (evicted first when room is needed); without, it is freed
        unless another call holds it."""
        with self._lock:
            assert t.wanted > 0, f"unwant of {t.slot}, which no window holds"
            t.wanted -= 1
            if not keep and not t.wanted and not t.pins and t.offset is not None:
                self._settle(t)
                self._drop_device_copy(t)
                self._unpinned.notify_all()

    def drop(self, t: Tensor) -> None:
        """Discard a resident, unpinned tensor's values and free its block; the owning job
        recomputes it before its next access. A no-op for a tensor in any other state."""
        with self._lock:
            if t.residency is Residency.DEVICE and not t.pins:
                self._free_block(t)
                t.residency = Residency.DROPPED

    def note_recompute(self, t: Tensor) -> None:
        with self._lock:
            self.jobs[t.job_id].recomputes += 1

    def array(self, t: Tensor, state: Residency = Residency.DEVICE):
        """The device array of a resident tensor (a view into the arena)."""
        assert t.residency in (state, Residency.SWAPPING_OUT), \
            f"tensor {t.slot} of job {t.job_id} is {t.residency.value}, not resident"
        return self.device.view(self.buffer, t.offset, t.shape, t.dtype)

    def free(self, t: Tensor) -> None:
        """Forget a tensor: its arena block or host copy is released."""
        with self._lock:
            self._drop(t)
            self._unpinned.notify_all()

    def to_host(self, t: Tensor) -> np.ndarray:
        """A host copy of the tensor's current values, wherever it lives."""
        with self._lock:
            self._settle(t)
            if t.residency is Residency.DEVICE:
                return self.device.to_host(self.array(t))
            return t.host.copy()

    # -- statistics ---------------------------------------------------------------------------

    @property
    def in_use_nbytes(self) -> int:
        return self.allocator.in_use_nbytes

    @property
    def peak_nbytes(self) -> int:
        """The arena's high-water mark, bytes; never above ``budget_nbytes``."""
        return self.allocator.peak_nbytes

    def cache_nbytes(self) -> int:
        """Arena bytes of the weight cache: read-only tensors with a block (resident or still
        loading) that no op pins and no prefetch window holds, bytes."""
        with self._lock:
            return sum(t.arena_nbytes for t in self._tensors.values()
                       if t.readonly and t.offset is not None and not t.pins and not t.wanted)

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
                "host_nbytes": sum(j.host_nbytes for j in self.jobs.values()),
                **self.pool.describe(),
                "jobs": {job_id: dict(vars(j), **self.pool.job_figures(job_id)) for job_id, j in self.jobs.items()},
            }

    # -- internals ----------------------------------------------------------------------------

    def _new(self, job_id: int, slot: str, kind: Kind, shape, dtype) -> Tensor:
        t = Tensor(next(self._ids), job_id, slot, kind, tuple(shape), np.dtype(dtype))
        self._tensors[t.id] = t
        return t

    def _account(self, t: Tensor, device: int = 0, host: int = 0) -> None:
        """The one place device and host byte counters change."""
        j = self.jobs[t.job_id]
        j.device_nbytes += device
        j.host_nbytes += host
        assert j.device_nbytes >= 0 and j.host_nbytes >= 0
        j.peak_nbytes = max(j.peak_nbytes, j.device_nbytes)

    def _settle(self, t: Tensor) -> None:
        """Complete a copy in flight: a swap-in becomes resident; a swap-out is called off (the
        device copy is still valid and is kept)."""
        if t.residency is Residency.SWAPPING_IN:
            t.transfer.wait()
            t.transfer, t.residency = None, Residency.DEVICE
            self._landed(t)
        elif t.residency is Residency.SWAPPING_OUT:
            t.transfer.wait()
            t.transfer, t.residency = None, Residency.DEVICE

    def _landed(self, t: Tensor) -> bool:
        """A copy host -> device has completed: drop the host copy and count a swap-in if the
        tensor had been swapped out (a first load of adopted values is not one). A read-only
        tensor keeps its host copy and counts a weight load."""
        if t.readonly:
            j = self.jobs[t.job_id]
            j.weight_loads += 1
            j.weight_loaded_nbytes += t.nbytes
            return False
        self._account(t, host=-t.nbytes)
        t.host = None
        if t.swapped_out:
            j = self.jobs[t.job_id]
            j.swapped_in_nbytes += t.nbytes
            j.swap_ins += 1
        return t.swapped_out

    def _left(self, t: Tensor, host: np.ndarray) -> None:
        """A copy device -> host has completed into ``host``: free the block, count a swap-out."""
        t.host = host
        self._free_block(t)
        self._account(t, host=t.nbytes)
        t.residency, t.swapped_out = Residency.HOST, True
        j = self.jobs[t.job_id]
        j.swapped_out_nbytes += t.nbytes
        j.swap_outs += 1

    def _finish_swap_out(self, t: Tensor) -> None:
        host = t.transfer.wait().host
        t.transfer = None
        self._left(t, host)

    def _make_resident(self, t: Tensor) -> None:
        self._settle(t)
        if t.residency is Residency.DEVICE:
            return
        t.offset = self._place(t)
        self._account(t, device=t.arena_nbytes)
        dropped = t.residency is Residency.DROPPED      # the job recomputes the values
        t.residency = Residency.DEVICE
        if not dropped and t.host is not None:          # bring values back (swap-in or first load)
            self.device.to_device(t.host, self.array(t))
            if self._landed(t):
                self.jobs[t.job_id].passive_swap_ins += 1
                self.pool.disturb(f"passive swap-in of {t.slot} of job {t.job_id}")

    def _place(self, t: Tensor, clean_only: bool = False) -> int:
        """An arena offset for ``t``'s block: its planned offset when the planned pool expects
        this allocation, else from the general pool (:meth:`_make_room`). Read-only tensors are
        a cache outside the jobs' timeline: the planned pool does not see them."""
        if t.readonly:
            return self._make_room(t.arena_nbytes, clean_only)
        position = self._position.get(t.job_id)
        t.key = None if position is None else (t.job_id, t.slot, position)
        offset = self.pool.lookup(t.key)
        if offset is not None:
            t.planned = True
            return offset
        offset = self._make_room(t.arena_nbytes)
        self.pool.allocated(t.key, t.arena_nbytes)
        return offset

    def _free_block(self, t: Tensor) -> None:
        """The one place a tensor's block is given back: to the planned region (which stays
        reserved) or to the general pool."""
        if not t.planned:
            self.allocator.free(t.offset)
        self._account(t, device=-t.arena_nbytes)
        t.offset, t.planned = None, False
        if not t.readonly:
            self.pool.freed(t.key, t.arena_nbytes)

    def _make_room(self, nbytes: int, clean_only: bool = False) -> int:
        """An arena offset for ``nbytes``, keeping the bytes in use within ``limit_nbytes`` while
        anything can be evicted (and within the budget always). When no free block fits: if the
        free bytes suffice, compact the arena (after letting the copies in flight land, so that
        their blocks can move too); else complete the swap-outs in flight ahead of their planned
        release; else evict (Note [Eviction order]). With ``clean_only`` only read-only
        tensors that no prefetch window holds are evicted and nothing waits for a copy; raises
        _Fragmented if that is not enough."""
        size = round_up(nbytes)
        if self.allocator.in_use_nbytes + size <= self.limit_nbytes:    # the common case
            offset = self.allocator.allocate(size)
            if offset is not None:
                return offset
        if clean_only or self.pool.state is State.SERVING:
            # the region was admitted against the budget, not the limit; the cache gives way first
            ceiling = self.limit_nbytes if clean_only else self.budget_nbytes
            offset = self._allocate_evicting_clean(size, ceiling, unwanted_only=clean_only)
            if offset is not None:
                return offset
            if clean_only:
                raise _Fragmented
            self.pool.disturb(f"a general-pool block of {size:,} bytes did not fit beside the planned region")
        while True:
            victims = [t for t in self._tensors.values()
                       if t.residency is Residency.DEVICE and not t.pins and t.id not in self._acquiring]
            leaving = [t for t in self._tensors.values()
                       if t.residency is Residency.SWAPPING_OUT and t.id not in self._acquiring]
            within = self.allocator.in_use_nbytes + size <= self.limit_nbytes or not (victims or leaving)
            if within:
                offset = self.allocator.allocate(size)
                if offset is not None:
                    return offset
                if self.allocator.free_nbytes >= size:
                    if self._compact():         # around the blocks copies still use
                        continue
                    in_flight = [t for t in self._tensors.values() if t.transfer is not None]
                    if in_flight:               # let them land so that their blocks can move too
                        for t in in_flight:
                            if t.residency is Residency.SWAPPING_IN:
                                self._settle(t)
                            else:
                                t.transfer.wait()   # copied out; released as planned
                        if self._compact():
                            continue
            if leaving:
                self.pool.disturb("swap-outs finished ahead of their planned release")
                for t in leaving:
                    self._finish_swap_out(t)
                continue
            if not victims:
                raise _Fragmented
            self._swap_out(max(victims, key=self._eviction_rank))

    def _eviction_rank(self, t: Tensor) -> tuple:
        """Higher is evicted first (Note [Eviction order])."""
        if t.readonly:
            return (1, t.last_used, 0) if t.wanted else (2, -t.last_used, 0)
        return (0, self.next_use(t), t.arena_nbytes)

    def _allocate_evicting_clean(self, size: int, ceiling: int, unwanted_only: bool = False) -> int | None:
        """A block of ``size`` bytes with the bytes in use within ``ceiling``, evicting read-only
        tensors (Note [Eviction order]; with ``unwanted_only``, only those no window holds) while
        that is not yet possible; None if they run out."""
        while True:
            if self.allocator.in_use_nbytes + size <= ceiling:
                offset = self.allocator.allocate(size)
                if offset is not None:
                    return offset
            clean = [t for t in self._tensors.values() if t.readonly and t.residency is Residency.DEVICE
                     and not t.pins and t.id not in self._acquiring and not (unwanted_only and t.wanted)]
            if not clean:
                return None
            self._swap_out(max(clean, key=self._eviction_rank))

    def _compact(self) -> bool:
        """Defragment: slide resident tensors that no op is using and no copy is reading toward
        the start of the arena (device-to-device copies), so the free bytes coalesce. Bytes in use
        do not change. Returns whether anything moved."""
        movable = {t.offset: t for t in self._tensors.values()
                   if t.offset is not None and not t.pins and not t.planned and t.job_id != 0
                   and (t.transfer is None or t.transfer.done())}
        moves = self.allocator.compact(movable)
        for old, new, size in moves:
            self.device.move_down(self.buffer, old, new, size)
            movable[old].offset = new
        self.compactions += bool(moves)
        self.compacted_nbytes += sum(size for _, _, size in moves)
        return bool(moves)

    def _install_region(self, plan, live_keys: set, reserve_nbytes: int) -> int | None:
        """Reserve ``plan.arena_nbytes`` at the lowest offset clear of pinned blocks as the
        planned region and move every live block whose key is in ``live_keys`` to its planned
        offset, the other unpinned blocks out of the way, keeping ``reserve_nbytes`` for unkeyed
        blocks within the budget (not ``limit_nbytes``: that headroom is for the general pool's
        fragmentation, and the region's packing is exact). Returns the region's offset, or None
        (nothing changed) if it does not fit. Called at a period boundary; copies in flight are
        waited for first.

        The bytes move through host memory (each moving block is copied out, then all are copied
        in), which is simple whatever the overlaps; it happens once per installed plan."""
        for t in [t for t in self._tensors.values() if t.transfer is not None]:
            if t.residency is Residency.SWAPPING_IN:
                self._settle(t)
            else:
                t.transfer.wait()               # still swapping out: released as planned
        live = [t for t in self._tensors.values() if t.offset is not None]
        pinned = {t.offset: t.arena_nbytes for t in live if t.pins}
        if any(t.pins and t.key in live_keys for t in live):
            return None
        base, cursor = None, 0
        for offset, size in sorted(pinned.items()) + [(self.budget_nbytes, 0)]:
            if offset - cursor >= plan.arena_nbytes:
                base = cursor
                break
            cursor = max(cursor, offset + size)
        if base is None:
            return None
        layout = ArenaAllocator(self.budget_nbytes)
        layout.relayout({**pinned, base: plan.arena_nbytes})
        target = {t: base + plan.offsets[t.key] for t in live if t.key in live_keys}
        evicted = []                            # cached read-only blocks that no longer fit
        for t in sorted((t for t in live if not t.pins and t not in target),
                        key=lambda t: (t.readonly, -t.arena_nbytes)):
            offset = layout.allocate(t.arena_nbytes)
            if offset is None and not t.readonly:
                return None
            if offset is None:
                evicted.append(t)
            else:
                target[t] = offset
        if layout.in_use_nbytes + reserve_nbytes > self.budget_nbytes:   # the region's packing is exact:
            return None                                                  # no headroom for it
        for t in evicted:
            self._swap_out(t)
        moving = [(t, new) for t, new in target.items() if new != t.offset]
        staged = [self.device.to_host(self.device.view(self.buffer, t.offset, (t.nbytes,), np.uint8))
                  for t, _ in moving]
        for (t, new), host in zip(moving, staged):
            self.device.to_device(host, self.device.view(self.buffer, new, (t.nbytes,), np.uint8))
            t.offset = new
        for t in target:
            t.planned = t.key in live_keys
        self.allocator.relayout(dict(layout.blocks()))
        return base

    def _dissolve_region(self) -> None:
        """Turn the planned region back into general-pool blocks: each live planned block stays
        where it is as an ordinary block; the rest of the region becomes free."""
        used = {t.offset: t.arena_nbytes for t in self._tensors.values() if t.offset is not None}
        for t in self._tensors.values():
            t.planned = False
        self.allocator.relayout(used)

    def _swap_out(self, t: Tensor) -> None:
        """Evict now: a synchronous copy to the host (the reactive path); for a read-only tensor,
        whose host copy is kept, a free."""
        if t.readonly:
            self._drop_device_copy(t)
            self.jobs[t.job_id].cache_evictions += 1
            return
        self.pool.disturb(f"eviction of {t.slot} of job {t.job_id}")
        self._left(t, self.device.to_host(self.array(t)))

    def _drop_device_copy(self, t: Tensor) -> None:
        """Free a resident read-only tensor's block; its host copy stays, so nothing is copied."""
        self._free_block(t)
        t.residency = Residency.HOST

    def _pack(self, working_set: list[Tensor], what: str) -> None:
        """Last resort when nothing is left to evict: swap out every other unpinned tensor, then
        place the working set largest first (compacting the arena as needed)."""
        for t in list(self._tensors.values()):
            self._settle(t)
        for t in [t for t in self._tensors.values() if t.residency is Residency.DEVICE and not t.pins]:
            if t.id not in self._acquiring:
                self._swap_out(t)
        try:
            for t in sorted(working_set, key=lambda t: -t.arena_nbytes):
                self._make_resident(t)
        except _Fragmented:
            need = sum(t.arena_nbytes for t in working_set)
            raise DeviceOutOfMemory(need, self.allocator.in_use_nbytes, self.budget_nbytes, what) from None

    def _drop(self, t: Tensor) -> None:
        if t.transfer is not None:                  # never free a block a copy still uses
            t.transfer.wait()
        if t.residency in (Residency.DEVICE, Residency.SWAPPING_OUT, Residency.SWAPPING_IN):
            self._free_block(t)
        if t.residency in (Residency.HOST, Residency.SWAPPING_IN) and t.host is not None and not t.readonly:
            self._account(t, host=-t.nbytes)
        t.residency, t.offset, t.host, t.transfer = Residency.FREED, None, None, None
        self._tensors.pop(t.id, None)


class _Fragmented(Exception):
    """No free block fits and nothing unpinned is left to evict."""
