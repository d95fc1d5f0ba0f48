"""The residency state machine: every way a registered tensor moves between host and arena.

The transitions of :class:`~tensile_db.memory.tensors.Residency`, each written once::

    HOST --start_load--> SWAPPING_IN --settle--> DEVICE          (a planned swap-in, a weight load)
    HOST / DROPPED --make_resident--> DEVICE                      (an op's access: passive, recompute)
    DEVICE --swap_out--> SWAPPING_OUT --release--> HOST           (a planned swap-out)
    SWAPPING_OUT --settle--> DEVICE                               (an access calls the swap-out off)
    DEVICE --evict--> HOST                                        (reactive; a free for read-only)
    DEVICE --drop, evict(drop=True)--> DROPPED;  any --free--> FREED

:class:`Residencies` is the base class of :class:`~tensile_db.memory.manager.MemoryManager` and
works on the manager's fields (the registry, the allocator, the planned pool, the swap engine),
every one guarded by the manager's lock. It holds the two chokepoints: every block is allocated
in :meth:`Residencies._place` and given back in :meth:`Residencies._free_block`, and every per-job
counter changes in :meth:`Residencies._account`. The planned pool's install and dissolve are the
manager's :class:`~tensile_db.memory.moves.RegionInstaller`'s. Which tensor to evict and when to compact are
the eviction policy's (:mod:`tensile_db.memory.eviction`); the methods under "the policies'
interface" are what the policies call, with the lock held.
"""

from __future__ import annotations

import logging

import numpy as np

from .eviction import Fragmented
from .moves import coalesced
from .tensors import Residency, Tensor

log = logging.getLogger(__name__)


#: Views of the arena :meth:`Residencies.array` keeps for reuse, by offset, shape and dtype: a
#: job's tensors take the same blocks every iteration under a plan, and making a view (a slice, a
#: view and a reshape on ``cpu``) took about 1.6 µs, four or so per op.
VIEWS_KEPT = 4096


class Residencies:
    """The transitions of the manager's tensors (see the module docstring); not used alone."""

    def array(self, t: Tensor, state: Residency = Residency.DEVICE):
        """The device array of a resident tensor (a view into the arena). Raises AssertionError
        if ``t`` is not resident."""
        # No lock: callers hold it, or pass a tensor they have pinned (an op between acquire and
        # unpin), whose residency and offset do not change until it is unpinned.
        assert t.residency in (state, Residency.SWAPPING_OUT), \
            f"tensor {t.slot} of job {t.job_id} is {t.residency.value}, not resident"
        key = (t.offset, t.shape, t.dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            view = self._views[key] = self.device.view(self.buffer, t.offset, t.shape, t.dtype)
        return view

    def to_host(self, t: Tensor) -> np.ndarray:
        """A host copy of the tensor's current values, wherever it lives (device, host tier,
        disk tier or a read-only tensor's source)."""
        with self._lock:
            self._settle(t)
            if t.residency is Residency.DEVICE:
                return self.device.to_host(self.array(t))
            if t.host is not None:
                return t.host.copy()
            out = np.empty(t.shape, t.dtype)
            self.host_tier.reader(t)(out.reshape(-1).view(np.uint8))
            return out

    # -- planned moves ------------------------------------------------------------------------

    def _host_copy(self, t: Tensor) -> np.ndarray:
        """A host copy of resident ``t``'s values made now, for the host tier: into a spare
        buffer where the arena is host memory (Note [Spare host buffers] in :mod:`.tiers`)."""
        if not self.device.arena_in_host_memory:
            return self.device.to_host(self.array(t))
        host = self.host_tier.host_buffer(t.shape, t.dtype)
        self.device.to_host_into(self.array(t), host)
        return host

    def swap_out(self, t: Tensor) -> None:
        """Start copying a resident, unpinned tensor to the host tier, or to the disk tier when
        the host tier has no room for it (:meth:`_host_room`); its block stays taken until
        :meth:`release`. A no-op for a tensor in any other state."""
        with self._lock:
            if t.residency is Residency.DEVICE and not t.pins:
                if self._host_room(t.nbytes):
                    self.host_tier.pending_nbytes += t.nbytes
                    self.host_tier.note_peak()
                    if self.device.arena_in_host_memory:       # Note [Spare host buffers] in .tiers
                        t.transfer = self.engine.to_host(self.array(t), self.host_tier.host_buffer(t.shape, t.dtype))
                    else:
                        t.transfer = self.engine.to_host(self.array(t))
                else:
                    file, offset = where = self.host_tier.slot(t)
                    t.transfer = self.engine.to_disk(self._block(t), file, offset)
                    t.transfer.spill = where
                t.residency = Residency.SWAPPING_OUT

    def release(self, t: Tensor) -> None:
        """Finish a swap-out started by :meth:`swap_out` (waiting for the copy if it is late)
        and free the tensor's arena block. A no-op unless the tensor is swapping out."""
        with self._lock:
            if t.residency is Residency.SWAPPING_OUT:
                self._out_done(t)

    def swap_in(self, t: Tensor) -> None:
        """Take an arena block for a tensor on the host and start copying it in (a planned
        swap-in); an op that accesses it waits for the copy. Makes room by eviction if the block
        does not fit. A no-op unless the tensor is on the host."""
        with self._lock:
            if self.start_load(t) and t.swapped_out:   # else the op that needs it swaps it in
                self._account(t, planned_swap_ins=1)

    def drop(self, t: Tensor) -> None:
        """Discard a resident, unpinned tensor's values and free its block; the owning job
        recomputes it before its next access. A no-op for a tensor in any other state, or one
        whose values are kept (:meth:`~tensile_db.memory.manager.MemoryManager.keep`)."""
        with self._lock:
            if t.residency is Residency.DEVICE and not t.pins and not t.keeps:
                self._free_block(t)
                t.residency = Residency.DROPPED
                self._account(t, drops=1)

    def evict(self, t: Tensor, drop: bool = False) -> None:
        """Evict a resident, unpinned tensor now: a synchronous copy to the host tier, or to the
        disk tier when the host tier has no room (the reactive path); for a read-only tensor,
        whose values are kept on the host or in its source, a free. With ``drop`` (the eviction
        policy's choice for a tensor its job can recompute) its values are discarded instead, as
        :meth:`drop` does, unless they are kept; then it is copied out all the same. A no-op for
        a tensor that is not resident or is pinned."""
        with self._lock:
            if t.residency is Residency.DEVICE and not t.pins:
                if t.readonly:
                    self._free_block(t)
                    t.residency = Residency.HOST
                    self._account(t, cache_evictions=1)
                    return
                self.pool.disturb(f"eviction of {t.slot} of job {t.job_id}")
                if drop and not t.keeps:
                    self.drop(t)
                elif self._host_room(t.nbytes):
                    self._left(t, host=self._host_copy(t))
                else:
                    self._left(t, spill=self.host_tier.spill_now(t, self._block(t)))

    def drop_device_copy(self, t: Tensor) -> None:
        """Free a read-only tensor's block once any load in flight has landed; its host copy
        stays, so nothing is copied. Raises AssertionError if ``t`` is not read-only."""
        with self._lock:
            assert t.readonly, f"{t.slot} of job {t.job_id} is not read-only"
            self._settle(t)
            self._free_block(t)
            t.residency = Residency.HOST
            self.pins.released.notify_all()

    # -- the policies' interface (the caller holds the lock) ----------------------------------

    def make_resident(self, t: Tensor) -> None:
        """Give ``t`` a block and its values now (waiting for a copy in flight); raises
        Fragmented if no block can be made room for."""
        self._settle(t)
        if t.residency is Residency.DEVICE:
            return
        t.offset = self._place(t)
        self._account(t, device=t.arena_nbytes)
        dropped = t.residency is Residency.DROPPED      # the job recomputes the values
        t.residency = Residency.DEVICE
        if not dropped and (t.host is not None or t.spill is not None or t.source is not None):
            if t.host is not None:                      # bring values back (swap-in or first load)
                self.device.to_device(t.host, self.array(t))
            else:                                       # from the disk tier or the source
                try:
                    self.host_tier.read_now(t, self._block(t))
                except BaseException:
                    self._free_block(t)
                    t.residency = Residency.HOST
                    raise
            if self._landed(t):
                self._account(t, passive_swap_ins=1)
                self.pool.disturb(f"passive swap-in of {t.slot} of job {t.job_id}")

    def start_load(self, t: Tensor, clean_only: bool = False) -> bool:
        """If ``t`` is on the host and a block can be placed for it (see
        :meth:`Eviction.make_room`), start copying it in on the swap engine; returns whether it did."""
        if t.residency is not Residency.HOST:
            return False
        try:
            t.offset = self._place(t, clean_only)
        except Fragmented:
            return False
        t.residency = Residency.SWAPPING_IN
        self._account(t, device=t.arena_nbytes)
        if t.host is not None:
            t.transfer = self.engine.to_device(t.host, self.array(t, Residency.SWAPPING_IN))
        else:                                           # from the disk tier or the source
            t.transfer = self.engine.from_disk(self.host_tier.reader(t), self._block(t))
        return True

    def land_copies(self, call_off: bool = False) -> bool:
        """The one place copies in flight are let land: a swap-in becomes resident; a swap-out
        completes and, with ``call_off``, is called off (the tensor stays resident), else stays
        swapping out until released as planned. Returns whether any copy was in flight.

        A copy that failed (a spill file's full disk, a model file's checksum) is not raised
        here, in whichever thread lets the copies land: a failed swap-out is called off (the
        device copy stays) and a failed swap-in leaves its tensor off the device, so the owner
        meets the error at its own next access, which reads again."""
        in_flight = [t for t in self._tensors.values() if t.transfer is not None]
        for t in in_flight:
            try:
                if call_off or t.residency is Residency.SWAPPING_IN:
                    self._settle(t)
                else:
                    self._wait_out(t)
            except Exception as exc:
                log.warning("a copy of %s of job %d failed and was called off: %s", t.slot, t.job_id, exc)
        return bool(in_flight)

    def compact(self, movable: list[Tensor], need_nbytes: int | None = None) -> bool:
        """Slide the blocks of ``movable`` toward offset 0 past every other block
        (:meth:`ArenaAllocator.compact`, device-to-device copies), so the free bytes coalesce;
        with ``need_nbytes``, only the cheapest run that opens a free block that large. Bytes in
        use do not change. Returns whether anything moved."""
        by_offset = {t.offset: t for t in movable}
        moves = self.allocator.compact(by_offset, need_nbytes)
        for old, new, size in coalesced(moves):
            self.device.move_down(self.buffer, old, new, size)
        for old, new, _ in moves:
            by_offset[old].offset = new
        self.compactions += bool(moves)
        self.compacted_nbytes += sum(size for _, _, size in moves)
        return bool(moves)

    # -- internals ----------------------------------------------------------------------------

    def _account(self, t: Tensor, device: int = 0, host: int = 0, disk: int = 0, **counts: int) -> None:
        """The one place per-job counters change: device, host and disk bytes held now (deltas,
        bytes; the host tier's ``nbytes`` and ``disk_nbytes`` totals with them) and the
        cumulative ``counts`` (deltas of :class:`JobMemory` fields)."""
        j = self.jobs[t.job_id]
        if device:
            j.device_nbytes += device
            if j.device_nbytes > j.peak_nbytes:
                j.peak_nbytes = j.device_nbytes
        if host or disk:
            j.host_nbytes += host
            j.disk_nbytes += disk
            self.host_tier.nbytes += host
            self.host_tier.disk_nbytes += disk
            if host > 0:
                self.host_tier.note_peak()
        assert j.device_nbytes >= 0 and j.host_nbytes >= 0 and j.disk_nbytes >= 0
        for name, delta in counts.items():
            setattr(j, name, getattr(j, name) + delta)

    def _settle(self, t: Tensor) -> None:
        """Complete a copy in flight: a swap-in becomes resident; a swap-out is called off (the
        device copy is still valid and is kept). A swap-in whose read failed (a model file's
        checksum) goes back to the host state, its block freed, and the error is raised."""
        if t.residency is Residency.SWAPPING_OUT:
            self._wait_out(t)
            self._call_off(t)
        elif t.residency is Residency.SWAPPING_IN:
            try:
                t.transfer.wait()
            except BaseException:
                t.transfer = None
                self._free_block(t)
                t.residency = Residency.HOST
                raise
            t.transfer, t.residency = None, Residency.DEVICE
            self._landed(t)

    def _wait_out(self, t: Tensor) -> None:
        """Wait for the swap-out in flight of ``t``; if it failed (a spill file's disk is full),
        call it off, so the device copy stays, and raise the error."""
        try:
            t.transfer.wait()
        except BaseException:
            self._call_off(t)
            raise

    def _call_off(self, t: Tensor) -> None:
        """A swap-out's copy is discarded: its host bytes or spill slot go back; ``t`` stays
        resident."""
        spill = t.transfer.spill
        if spill is not None:
            spill[0].release(spill[1], t.arena_nbytes)
        else:
            self.host_tier.pending_nbytes -= t.nbytes
        t.transfer, t.residency = None, Residency.DEVICE

    def _out_done(self, t: Tensor) -> None:
        """Finish the swap-out in flight of ``t`` (waiting for it): the copy is the host tier's
        or the disk tier's now."""
        self._wait_out(t)
        spill = t.transfer.spill
        if spill is not None:
            self._left(t, spill=spill)
        else:
            self.host_tier.pending_nbytes -= t.nbytes
            self._left(t, host=t.transfer.host)

    def _landed(self, t: Tensor) -> bool:
        """A copy host -> device has completed: drop the host copy and count a swap-in if the
        tensor had been swapped out (a first load of adopted values is not one); returns whether
        it was a swap-in. A read-only tensor keeps its host copy and counts a weight load."""
        if t.readonly:
            self._account(t, weight_loads=1, weight_loaded_nbytes=t.nbytes)
            if not self.host_tier.touch(t) and t.host is None and t.source is not None:
                self._cache_host_copy(t)
            return False
        if t.spill is not None:
            self._release_spill(t)
            self._account(t, disk_read_nbytes=t.nbytes)
        else:
            if self.device.arena_in_host_memory:
                self.host_tier.give_back(t.host)
            t.host = None
            self._account(t, host=-t.nbytes)
        if t.swapped_out:
            self._account(t, swapped_in_nbytes=t.nbytes, swap_ins=1)
        return t.swapped_out

    def _left(self, t: Tensor, host: np.ndarray | None = None, spill: tuple | None = None) -> None:
        """A copy device -> host tier has completed into ``host``, or device -> disk tier into
        the spill slot ``spill``: free the block, count a swap-out."""
        t.transfer, t.host, t.spill = None, host, spill
        self._free_block(t)
        if spill is None:
            self._account(t, host=t.nbytes, swapped_out_nbytes=t.nbytes, swap_outs=1)
        else:
            self._account(t, disk=t.nbytes, spilled_nbytes=t.nbytes, swapped_out_nbytes=t.nbytes, swap_outs=1)
        t.residency, t.swapped_out = Residency.HOST, True

    def _place(self, t: Tensor, clean_only: bool = False) -> int:
        """The one place a block is allocated: ``t``'s planned offset when the planned pool
        expects this allocation, else from the general pool (:meth:`Eviction.make_room`).
        Read-only tensors are a cache outside the jobs' timeline: the planned pool does not see
        them."""
        if t.readonly:
            return self.eviction.make_room(t.arena_nbytes, clean_only)
        position = self._position.get(t.job_id)
        t.key = None if position is None else (t.job_id, t.slot, position)
        offset = self.pool.lookup(t.key)
        if offset is not None:
            t.planned = True
            return offset
        offset = self.eviction.make_room(t.arena_nbytes)
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

    def _drop(self, t: Tensor) -> None:
        if t.transfer is not None:                  # never free a block a copy still uses
            try:
                t.transfer.wait()
            except BaseException:                   # a failed read or write: freed all the same
                pass
            spill = t.transfer.spill
            if spill is not None:                   # a swap-out to the disk tier in flight
                spill[0].release(spill[1], t.arena_nbytes)
            elif t.residency is Residency.SWAPPING_OUT:
                self.host_tier.pending_nbytes -= t.nbytes
        if t.residency in (Residency.DEVICE, Residency.SWAPPING_OUT, Residency.SWAPPING_IN):
            self._free_block(t)
        if t.residency in (Residency.HOST, Residency.SWAPPING_IN) and t.host is not None and not t.readonly:
            self._account(t, host=-t.nbytes)
        if t.spill is not None:
            self._release_spill(t)
        self.host_tier.forget(t)
        t.residency, t.offset, t.host, t.transfer = Residency.FREED, None, None, None
        self._tensors.pop(t.id, None)

    # -- the tiers under the device (the caller holds the lock) --------------------------------

    def _host_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit the host budget, giving up cached host copies of
        read-only tensors (least recently used first; their source keeps the values) to make
        room. Always true without a host budget."""
        tier = self.host_tier
        if tier.budget_nbytes is None:
            return True
        if not tier.fits(nbytes):
            for t in [t for t in self._tensors.values() if t.residency is Residency.SWAPPING_IN and not t.readonly
                      and t.host is not None and t.transfer.done()]:
                self._settle(t)             # swap-ins from the host tier that have landed give their room back
        for t in list(tier.cache.values()):
            if tier.fits(nbytes):
                break
            if t.transfer is None:                  # not being copied in from it now
                tier.forget(t)
        return tier.fits(nbytes)

    def _cache_host_copy(self, t: Tensor) -> None:
        """Keep a host copy of the read-only tensor ``t``, just loaded from its source, if the
        host tier has room: the next load of it reads no file."""
        if not self.host_tier.fits(t.nbytes):
            return
        t.host = self.device.host_empty(t.shape, t.dtype)     # page-locked on cuda: loads copy straight from it
        self.device.to_host_into(self.array(t), t.host)
        self.host_tier.keep(t)

    def _release_spill(self, t: Tensor) -> None:
        file, offset = t.spill
        file.release(offset, t.arena_nbytes)
        t.spill = None
        self._account(t, disk=-t.nbytes)

    def _block(self, t: Tensor):
        """The raw bytes of ``t``'s arena block (``arena_nbytes``, uint8): what the disk tier
        reads and writes, whole 512-byte units (Note [Spill I/O])."""
        return self.device.view(self.buffer, t.offset, (t.arena_nbytes,), np.uint8)
