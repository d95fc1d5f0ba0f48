"""The memory manager's records: a registered tensor, its residency, and a job's counters.

A :class:`Tensor` is created and changed only by its :class:`~tensile_db.memory.manager.MemoryManager`
(and the policies the manager calls, under its lock); everyone else reads it. Its fields after
``dtype`` change as the tensor moves, and every one of them is guarded by the owning manager's
lock: read them under that lock, or on a tensor the reader has pinned (a pinned tensor's
residency and offset do not change until it is unpinned).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

from ..runtime.device import Transfer
from ..runtime.program import Kind
from ..runtime.units import round_up


class Residency(str, enum.Enum):
    DEVICE = "device"
    SWAPPING_OUT = "swapping out"    # being copied to the host; still holds its arena block
    HOST = "host"                    # off the device, values kept: on the host tier, in the disk tier or a source
    SWAPPING_IN = "swapping in"      # holds its block; the copy from the host is in flight
    DROPPED = "dropped"              # values discarded; recomputed from its producer when needed
    FREED = "freed"


@dataclass(eq=False, slots=True)
class Tensor:
    """A registered tensor. ``nbytes`` is its size in bytes; ``arena_nbytes`` rounded to the unit.

    Every field after ``dtype`` is guarded by the owning manager's lock (see the module docstring).
    """

    id: int
    job_id: int
    slot: str
    kind: Kind
    shape: tuple[int, ...]
    dtype: np.dtype
    residency: Residency = Residency.HOST
    offset: int | None = None            # arena offset, bytes, while it holds a block
    host: np.ndarray | None = None       # host copy while on the host tier (a read-only tensor's: a cache if it has a source)
    spill: tuple | None = None           # (SpillFile, offset) while its values are in the disk tier
    source: object | None = None         # read-only: where its values are read from (read_into), when not on the host
    pins: int = 0                        # ops currently using it; pinned tensors are never evicted or moved
    swapped_out: bool = False            # has been swapped out at least once (a later load is a swap-in)
    transfer: Transfer | None = None     # the copy in flight while swapping out or in
    key: tuple | None = None             # (job, slot, op position) its block was allocated under
    planned: bool = False                # its block is in the planned region
    readonly: bool = False               # host copy kept for good; evicting it is a free, loading it a cache fill
    fixed: bool = False                  # its address is held as a raw pointer (a CuPy workspace block): never moved
    pin_owners: list = field(default_factory=list)   # thread ident of each pin
    wanted: int = 0                      # read-only: prefetch windows of running calls that hold it (the weight cache's)
    last_used: int = 0                   # tick of its last acquire (least recently used goes first)
    accessed_s: float = 0.0              # device time (Device.now(), seconds) of its registration or last acquire
    keeps: int = 0                       # holds on its values (MemoryManager.keep): while positive, never dropped

    nbytes: int = field(init=False)        # from shape and dtype, which never change
    arena_nbytes: int = field(init=False)  # nbytes rounded up to the arena unit

    def __post_init__(self):
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self.arena_nbytes = round_up(self.nbytes)


@dataclass
class JobMemory:
    """Per-job counters, changed only through ``MemoryManager._account`` under the manager's lock.
    Bytes throughout; ``*_nbytes`` totals are cumulative."""

    device_nbytes: int = 0          # arena bytes held now
    peak_nbytes: int = 0            # high-water mark of device_nbytes
    host_nbytes: int = 0            # bytes swapped out and held on the host now
    disk_nbytes: int = 0            # bytes swapped out and held in the disk tier (its spill file) now
    spilled_nbytes: int = 0         # bytes written to the disk tier, cumulative
    disk_read_nbytes: int = 0       # bytes read back from the disk tier, cumulative
    swapped_out_nbytes: int = 0     # bytes copied device -> host by eviction, cumulative
    swapped_in_nbytes: int = 0      # bytes copied host -> device for evicted tensors, cumulative
    swap_outs: int = 0
    swap_ins: int = 0               # planned + passive
    planned_swap_ins: int = 0       # issued ahead of the access by a plan
    passive_swap_ins: int = 0       # made when an op needed the tensor: misses of the plan
    drops: int = 0                  # tensors dropped (values discarded, recomputed at their next access)
    recomputes: int = 0             # dropped tensors recomputed
    weight_loads: int = 0           # read-only tensors copied host -> device
    weight_loaded_nbytes: int = 0   # their bytes, cumulative
    cache_evictions: int = 0        # read-only tensors given up for room (a free, no copy)
