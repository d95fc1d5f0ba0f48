"""Devices: where tensors live, how bytes move between the arena, host memory and spill files,
and how time is told.

A device is one class behind one interface (:class:`Device`): the arena buffer and the array
views into it, synchronous copies between the arena and host memory, the swap engine's
asynchronous copies (:class:`CopyEngine`, made by :meth:`Device.copy_engine`), the compute lock,
and the clock. Every device tensor is a view into the one arena buffer; host copies are NumPy
arrays. The devices are :class:`CpuDevice` (``cpu``: NumPy, the arena is host memory),
:class:`~.cuda.CudaDevice` (``cuda``: CuPy, copy streams, page-locked host memory) and
:class:`~.simulated.SimDevice` (``sim``: shapes without values on a virtual clock);
:func:`~.devices.make_device` finds one by name. Callers ask a device what it can do
(:attr:`Device.holds_values`, :attr:`Device.virtual_time`, :attr:`Device.arena_in_host_memory`),
never which one it is.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import mmap
import sys
import threading
import time

import numpy as np

from ..errors import InvalidArgument
from . import fused, workers


class Transfer:
    """A copy in flight. ``host`` is the destination host array of a device -> host copy;
    ``spill`` the destination slot of a device -> disk copy."""

    def __init__(self, done, wait, host: np.ndarray | None = None):
        self._done, self._wait, self.host = done, wait, host
        self.spill: tuple | None = None     # (SpillFile, offset) of a swap-out to the disk tier

    def done(self) -> bool:
        return self._done()

    def wait(self) -> "Transfer":
        """Block until the copy has completed; returns self."""
        self._wait()
        return self


class CopyEngine:
    """The swap engine of a device: copies between its arena, host memory and spill files, off
    the compute path (on ``cpu``, a small one on the caller's thread: :class:`CpuCopyEngine`).
    Copies in one direction are issued in order and run one at a time (on ``cpu``, a small one
    done at once may end before a larger one issued earlier, and its error is raised at once);
    :attr:`duplex` says whether the two directions overlap (a copy engine for each) or share one
    channel, which is how the scheduler's cost model sees the channels
    (:mod:`tensile_db.scheduler.timeline`)."""

    duplex = False
    #: The largest copy to or from host memory done on the caller's thread, done when the call
    #: returns, bytes (0: none; the cost model puts such copies on the compute stream).
    inline_nbytes = 0

    def to_host(self, array) -> Transfer:
        """Start copying the device array ``array`` into a new host array (``Transfer.host``)."""
        raise NotImplementedError

    def to_device(self, host: np.ndarray, array) -> Transfer:
        """Start copying ``host`` into the device array ``array`` (same shape and dtype); ``host``
        must not change until the copy completes."""
        raise NotImplementedError

    def to_disk(self, array, file, offset: int) -> Transfer:
        """Start writing the device array ``array`` (uint8, 1-D) to the spill file ``file`` (a
        :class:`~tensile_db.memory.spill.SpillFile`) at ``offset``."""
        raise NotImplementedError

    def from_disk(self, read, array) -> Transfer:
        """Start filling the device array ``array`` (uint8, 1-D) by ``read(out)``, which fills a
        host uint8 array of the same length (a spill file's or a model file's read); the transfer
        is done only once the block holds the values (it must not move before)."""
        raise NotImplementedError

    def write_now(self, array, file, offset: int) -> None:
        """:meth:`to_disk`, waited for (the reactive path)."""
        self.to_disk(array, file, offset).wait()

    def read_now(self, read, array) -> None:
        """:meth:`from_disk`, waited for (a passive load)."""
        self.from_disk(read, array).wait()

    def close(self) -> None:
        """Finish the copies in flight and stop the engine's threads."""


class CpuCopyEngine(CopyEngine):
    """``cpu``: one copy thread does the copies, the disk tier's reads and writes included (NumPy
    releases the GIL while copying, so they overlap the executor's arithmetic on another core);
    the two directions share it. A copy between the arena and host memory of at most
    :attr:`inline_nbytes` runs on the caller's thread instead, done when it returns (Note [Copies
    beside kernels on every core]). A spill write reads the arena block itself, a spill read fills
    it (Note [Spill I/O] in :mod:`tensile_db.memory.spill`); the synchronous ones
    (:meth:`write_now`, :meth:`read_now`) run on the caller's thread.

    Args:
        inline_nbytes: the largest copy done on the caller's thread, bytes; None:
            :func:`cpu_inline_nbytes`.

    Note [Copies beside kernels on every core]
    ------------------------------------------
    Rationale: a copy thread overlaps the arithmetic only where a core is free for it. Where the
    kernels' workers take every core (:func:`.workers.count`, the BLAS's threads, against the
    cores this process may run on), it shares one with a kernel's thread, and an OpenMP region
    waits for its slowest thread: the kernels slow down by more than the copy takes, and the
    copy, slowed too, lands after the op that waits for it. The small CNN of
    ``bench/throughput.py`` at half its peak (about 21 MiB swapped each way an iteration, most of
    it 4 MiB activations) on this project's 2-core machine, copies above 1 MiB on the thread
    against every copy on the executor's: 44.8, 44.2, 46.2 against 42.6, 42.5, 44.3 ms an
    iteration over the run (three alternated runs of five repeats), 40.7, 40.7, 41.1 against
    38.4, 39.1, 41.3 once the planned pool served; over 60 iterations, 40.2 to 41.0 against 38.0
    to 40.1 (six runs).

    Approach: where the kernels take every core, every copy between the arena and host memory is
    made on the caller's thread; the cost model then puts every copy on the compute stream (Note
    [Issue cost] in :mod:`tensile_db.scheduler.cost`), so the plans price them as they run.
    Elsewhere a copy of at most :data:`SPARE_CORE_INLINE_NBYTES` is. The disk tier's reads and
    writes stay on the thread (they wait for the disk, not for a core).

    Limitations: measured where the kernels take every core; the threshold where a core is free
    comes from a machine without one (below), and a copy thread that shares the cores with
    another process's work is not seen.
    """

    #: The largest copy done on the caller's thread where a core is free for the copy thread:
    #: handing a copy to the copy thread and waiting for it took about 30 µs more than the copy
    #: itself here (59 against 29 µs at 1 MiB, 46 against 17 µs at 256 KiB; 139 against 102 µs at
    #: 4 MiB). ``bench/throughput.py --quick --repeats 3``, the MLP at half its peak (28 swap-ins
    #: and 28 swap-outs of at most 1 MiB an iteration), runs alternated: 1.39x and 1.22x its
    #: unlimited time per iteration with these copies here, 2.06x and 1.83x with all on the
    #: thread; again: 1.46x and 1.36x at 1 MiB, 1.54x and 1.37x at 256 KiB, 1.43x and 1.30x with
    #: every copy here (not decided between these three).
    SPARE_CORE_INLINE_NBYTES = 1 << 20

    def __init__(self, inline_nbytes: int | None = None):
        self.inline_nbytes = cpu_inline_nbytes() if inline_nbytes is None else inline_nbytes
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensile-copy")

    def _run(self, fn, *args, host=None) -> Transfer:
        future = self._pool.submit(fn, *args)
        return Transfer(future.done, future.result, host)

    def _copy(self, dst, src, host=None) -> Transfer:
        if src.nbytes > self.inline_nbytes:
            return self._run(np.copyto, dst, src, host=host)
        copy_here(dst, src)
        return Transfer(lambda: True, lambda: None, host)

    def to_host(self, array, host: np.ndarray | None = None) -> Transfer:
        """As the engine's, into ``host`` (same shape and dtype) when given, else a new array."""
        if host is None:
            host = np.empty(array.shape, array.dtype)
        return self._copy(host, array, host=host)

    def to_device(self, host: np.ndarray, array) -> Transfer:
        return self._copy(array, host)

    def to_disk(self, array, file, offset: int) -> Transfer:
        return self._run(file.write_from, offset, array)

    def from_disk(self, read, array) -> Transfer:
        return self._run(read, array)

    def write_now(self, array, file, offset: int) -> None:
        file.write_from(offset, array)          # the arena is host memory: straight from the block, here

    def read_now(self, read, array) -> None:
        read(array)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def copy_here(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` on the calling thread, split over the kernels' OpenMP team where it may
    be (:func:`.fused.copy`, Note [Copies on the team]), else by NumPy."""
    if not fused.copy(dst, src):
        np.copyto(dst, src)


def cpu_inline_nbytes() -> int:
    """The largest copy a :class:`CpuCopyEngine` makes on the caller's thread (Note [Copies beside
    kernels on every core]), bytes: every one (:data:`sys.maxsize`) where the kernels' workers
    take every core this process may run on, else
    :data:`CpuCopyEngine.SPARE_CORE_INLINE_NBYTES`."""
    if workers.every_core():
        return sys.maxsize
    return CpuCopyEngine.SPARE_CORE_INLINE_NBYTES


#: The roofline of :meth:`Device.op_seconds` where a device has no model of its own: FLOP/s and
#: bytes/s of about one server CPU socket. Only ratios between jobs' estimates matter.
NOMINAL_FLOPS_PER_S = 1e11
NOMINAL_BYTES_PER_S = 2e10


class Device:
    """One compute device (the interface; see the module docstring). ``name`` is its name in
    ``tensile.device``; ``xp`` its array module (None on ``sim``)."""

    name: str = ""
    xp = None
    #: Whether its tensors hold values: False on ``sim``, whose tensors are shapes only, so
    #: callers skip work whose only purpose is values (initial weights, validation, the tiers).
    holds_values = True
    #: Whether its clock is virtual (``sim``): no thread's timing may matter, so the executor
    #: plans synchronously, deterministically, and idles the clock forward to an arrival.
    virtual_time = False
    #: Whether the arena is host memory (``cpu``): a move staged through host memory costs what a
    #: direct one does, and the bandwidth probe's buffers need no room in the arena.
    arena_in_host_memory = False

    @property
    def kernels_on_every_core(self) -> bool:
        """Whether its kernels run on every core this process may use (``cpu`` where the kernels'
        workers take them all, :func:`.workers.every_core`): then no other work of the process's
        runs beside a kernel without taking a core from it."""
        return False

    def describe(self) -> str:
        """The device in words, as benchmark output names it."""
        return self.name

    def now(self) -> float:
        """The device's clock, seconds (wall clock; virtual on ``sim``)."""
        return time.perf_counter()

    def idle_until(self, t_s: float) -> None:
        """Move a virtual clock (:attr:`virtual_time`) forward to ``t_s`` with nothing running."""
        raise NotImplementedError(f"the {self.name} device's clock is the wall clock")

    def op_seconds(self, op) -> float:
        """An estimate of the seconds of ``op`` (a :class:`~.program.Op`) before it has run: a
        roofline of its FLOPs and bytes at :data:`NOMINAL_FLOPS_PER_S` and
        :data:`NOMINAL_BYTES_PER_S`. It weighs one job's work against another's on devices of one
        kind (Note [Placement] in :mod:`tensile_db.coordinator.placement`); it is not a measure.
        The simulated device answers with its profile's roofline."""
        return max(op.flops / NOMINAL_FLOPS_PER_S, op.nbytes / NOMINAL_BYTES_PER_S)

    def execute(self, op, arrays: dict, ctx) -> None:
        """Run ``op`` (a :class:`~.program.Op`) on ``arrays`` (slot -> device array) and wait for
        it to complete, so that :meth:`now` around this call times the op.

        Raises:
            InvalidArgument: ``op`` has no kernel (an op of a program's skeleton).
        """
        if op.run is None:
            raise InvalidArgument(f"op {op.name!r} has no kernel: it is an op of a program's skeleton, which "
                                  f"plans but does not run; run the program the skeleton was made from")
        op.run(arrays, ctx)
        self.synchronize()

    def copy_engine(self) -> CopyEngine:
        """A new swap engine for this device (its owner closes it)."""
        raise NotImplementedError

    def route_allocations(self, manager) -> None:
        """Make the array library's own allocations (kernel temporaries) blocks of ``manager``'s
        arena, so that the budget counts them; a no-op where the library allocates on the host."""

    def host_copy(self, host: np.ndarray) -> np.ndarray:
        """A C-contiguous host copy of ``host``, owned by the caller."""
        return np.array(host, order="C", copy=True)

    def computing(self):
        """A context manager around one op's arithmetic (see :class:`CpuDevice`); a no-op where
        the device queues kernels itself."""
        return contextlib.nullcontext()

    def using(self):
        """A context manager that makes this device the calling thread's current one, for every
        thread that allocates on it or runs its ops (the executor's, a predict call's, the one
        that builds its manager); a no-op where the device is not one of several of a library's
        (:class:`~.cuda.CudaDevice` with an index)."""
        return contextlib.nullcontext()

    def arena_buffer(self, nbytes: int):
        """One contiguous uint8 buffer of ``nbytes`` bytes on the device."""
        raise NotImplementedError

    def view(self, buffer, offset: int, shape: tuple[int, ...], dtype) -> object:
        """An array of ``shape`` and ``dtype`` over ``buffer[offset:]``; no copy."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize      # Python ints: exact, and no NumPy call per op
        return buffer[offset:offset + nbytes].view(dtype).reshape(shape)

    def host_empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised host (NumPy) array from which copies to the device can run
        asynchronously (page-locked on ``cuda``)."""
        return np.empty(shape, dtype)

    def to_host(self, array) -> np.ndarray:
        """A new host (NumPy) copy of a device array."""
        raise NotImplementedError

    def to_host_into(self, array, out: np.ndarray) -> None:
        """Copy the device array ``array`` into the host array ``out`` (same shape and dtype)."""
        out[...] = self.to_host(array)

    def to_device(self, host: np.ndarray, array) -> None:
        """Copy ``host`` into the device array ``array`` (same shape and dtype)."""
        raise NotImplementedError

    def move_down(self, buffer, src: int, dst: int, nbytes: int) -> None:
        """Copy ``buffer[src:src + nbytes]`` to ``buffer[dst:dst + nbytes]`` with ``dst < src``
        (the ranges may overlap)."""
        raise NotImplementedError

    def copy_within(self, buffer, src: int, dst: int, nbytes: int) -> None:
        """Copy ``buffer[src:src + nbytes]`` to ``buffer[dst:dst + nbytes]``; the ranges must not
        overlap."""
        assert src + nbytes <= dst or dst + nbytes <= src
        buffer[dst:dst + nbytes] = buffer[src:src + nbytes]

    def uniform(self, seed: int, out) -> None:
        """Fill ``out`` (float32 or float64) with uniform draws in [0, 1) from a stream fixed by
        ``seed``, so that a recomputed dropout mask equals the first one."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for the work queued on the compute stream; copies on the swap engine go on."""


class CpuDevice(Device):
    """``cpu``: NumPy arrays in host memory; the arena is page-aligned anonymous memory."""

    name = "cpu"
    xp = np
    arena_in_host_memory = True

    def __init__(self):
        self._compute = threading.Lock()

    @property
    def kernels_on_every_core(self) -> bool:
        return workers.every_core()

    def copy_engine(self) -> CopyEngine:
        return CpuCopyEngine()

    def computing(self):
        """Lets one thread compute at a time: BLAS already spreads one matrix product over every
        core, and several threads' products at once oversubscribe them (8 concurrent calls took
        twice as long as the same calls one after another)."""
        return self._compute

    def arena_buffer(self, nbytes: int):
        """Page-aligned anonymous memory (pages are committed as they are first touched), so every
        512-byte arena block can be read from and written to a spill file with ``O_DIRECT``
        (Note [Spill I/O] in :mod:`tensile_db.memory.spill`)."""
        return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)[:nbytes]

    def to_host(self, array) -> np.ndarray:
        out = np.empty(array.shape, array.dtype)
        self.to_host_into(array, out)
        return out

    def to_host_into(self, array, out: np.ndarray) -> None:
        copy_here(out, array)

    def to_device(self, host: np.ndarray, array) -> None:
        copy_here(array, host)

    def move_down(self, buffer, src: int, dst: int, nbytes: int) -> None:
        """NumPy copies overlapping slices correctly."""
        assert dst < src
        buffer[dst:dst + nbytes] = buffer[src:src + nbytes]

    def uniform(self, seed: int, out) -> None:
        """NumPy's Philox, keyed by ``seed``."""
        np.random.Generator(np.random.Philox(seed)).random(out=out, dtype=out.dtype)
