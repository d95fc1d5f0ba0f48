"""The ``cuda`` device: CuPy arrays in one arena on the GPU, copy streams, page-locked host memory.

- The arena is one CuPy allocation made before :meth:`CudaDevice.route_allocations` routes CuPy's
  allocator into it: every allocation CuPy makes afterwards — kernel temporaries, reduction
  buffers, cuBLAS outputs not written with ``out=`` — is a workspace tensor in the memory
  manager's arena, so the budget counts them and eviction can make room for them. CuPy holds each
  block's address as a raw pointer, so the blocks are acquired ``fixed``: compaction and the
  planned pool never move them. A block returns to the arena when CuPy drops its last reference.
- The swap engine (:class:`CudaCopyEngine`) has a copy stream per direction (a GPU has a copy
  engine for each, so a swap-out and a swap-in run at once), from and to page-locked host
  buffers; a swap-out first waits (on its copy stream) for the work already queued on the compute
  stream, and a :class:`~.device.Transfer` completes when its event has. A disk thread does the
  spill files' I/O from and to a page-locked staging buffer that the copy streams fill and drain.
- Dropout draws come from a counter-based hash in one kernel (:data:`UNIFORM_KERNEL`).
- Several GPUs (``tensile.devices = 'cuda:0, cuda:1'``): each :class:`CudaDevice` has its GPU's
  index, and every thread that works on it does so inside :meth:`CudaDevice.using` (CuPy's
  current device is per thread). CuPy's allocator is one per process: with several devices routed
  it dispatches each allocation to the arena of the calling thread's current device.

Everything here needs a GPU and CuPy; ``TENSILE_TEST_DEVICE=cuda`` runs the runtime's tests on it.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import weakref

import numpy as np

from ..errors import InvalidArgument
from .device import CopyEngine, Device, Transfer
from .program import Kind, Slot

#: Job id under which the array library's temporaries are counted.
WORKSPACE_JOB = 0

#: GPU index -> the allocation function into that device's arena (:meth:`CudaDevice.route_allocations`).
_ROUTES: dict = {}
_ROUTES_LOCK = threading.Lock()

#: The body of the CuPy kernel of :meth:`CudaDevice.uniform`: SplitMix64's finaliser (Steele, Lea
#: and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014) of the seed's stream
#: at the element's index, its top 24 bits (float32) or 53 bits (float64) as a fraction, so that
#: no draw rounds up to 1.
UNIFORM_KERNEL = """
    unsigned long long z = seed * 0xD1B54A32D192ED03ull + (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    if (sizeof(T) == 4) out = (T)(z >> 40) * (T)(1.0 / 16777216.0);
    else out = (T)(z >> 11) * (T)(1.0 / 9007199254740992.0);
"""


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise InvalidArgument("tensile.device is 'cuda' but CuPy is not installed; install tensile_db[cuda] "
                              "or set tensile.device = 'cpu'") from exc
    return cupy


def pinned_empty(cupy, shape, dtype) -> np.ndarray:  # pragma: no cover - cuda only
    """A host array in page-locked memory (from CuPy's pinned memory pool)."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)                        # Python ints: no NumPy call per swap-out
    mem = cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return np.frombuffer(mem, dtype, count).reshape(shape)


def is_pinned(host: np.ndarray) -> bool:  # pragma: no cover - cuda only
    """Whether the host array ``host`` (or the array it is a view of) lies in page-locked memory
    from :func:`pinned_empty`."""
    cupy = _cupy()
    base = host
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):                # NumPy's frombuffer keeps a view of the buffer
        base = base.obj
    return isinstance(base, cupy.cuda.PinnedMemoryPointer)


class CudaDevice(Device):  # pragma: no cover - cuda only
    """``cuda``: GPU ``index`` (default 0) through CuPy (see the module docstring).

    Raises:
        InvalidArgument: CuPy is not installed, or no GPU has that index.
    """

    name = "cuda"

    def __init__(self, index: int = 0):
        self.xp = _cupy()
        count = self.xp.cuda.runtime.getDeviceCount()
        if not 0 <= index < count:
            raise InvalidArgument(f"device cuda:{index} does not exist: this machine has {count} GPUs "
                                  f"(cuda:0 to cuda:{count - 1}); fix tensile.devices")
        self.index = index
        self._gpu = self.xp.cuda.Device(index)
        self._uniform = None     # the kernel of uniform(), compiled at its first use

    def using(self):
        return self._gpu

    def copy_engine(self) -> "CudaCopyEngine":
        return CudaCopyEngine(self.xp)

    def route_allocations(self, manager) -> None:
        """Route CuPy's allocator into ``manager``'s arena (see the module docstring)."""
        cupy = self.xp
        manager.register_job(WORKSPACE_JOB)
        base = manager.buffer.data.ptr

        def malloc(nbytes: int) -> "cupy.cuda.MemoryPointer":
            (t,) = manager.acquire(WORKSPACE_JOB, [], [Slot("cupy_workspace", Kind.WORKSPACE, (max(nbytes, 1),), "uint8")],
                                   what=f"a CuPy temporary of {nbytes:,} bytes", fixed=True)
            owner = _Owner()
            mem = cupy.cuda.UnownedMemory(base + t.offset, nbytes, owner)
            weakref.finalize(owner, _release, manager, t)
            return cupy.cuda.MemoryPointer(mem, 0)

        with _ROUTES_LOCK:
            _ROUTES[self.index] = malloc
            cupy.cuda.set_allocator(malloc if len(_ROUTES) == 1 else _routed)

    def arena_buffer(self, nbytes: int):
        return self.xp.empty(nbytes, dtype=self.xp.uint8)

    def view(self, buffer, offset: int, shape: tuple[int, ...], dtype) -> object:
        """As :meth:`Device.view`, in one CuPy call: a slice, a view and a reshape of the arena
        took about 10 µs of the executor's thread per tensor, twice in a swap's cycle (Note
        [Issue cost] in :mod:`tensile_db.scheduler.cost`)."""
        return self.xp.ndarray(shape, dtype, buffer.data + offset)

    def host_empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        return pinned_empty(self.xp, shape, dtype)

    def to_host(self, array) -> np.ndarray:
        return self.xp.asnumpy(array)

    def to_device(self, host: np.ndarray, array) -> None:
        array.set(np.ascontiguousarray(host))

    def move_down(self, buffer, src: int, dst: int, nbytes: int) -> None:
        """Overlapping ranges go through the host when the shift is small, else in
        non-overlapping chunks of ``src - dst`` bytes."""
        assert dst < src
        if src - dst >= nbytes:
            buffer[dst:dst + nbytes] = buffer[src:src + nbytes]
        elif (src - dst) * 16 < nbytes:
            buffer[dst:dst + nbytes].set(self.xp.asnumpy(buffer[src:src + nbytes]))
        else:
            chunk = src - dst
            for i in range(0, nbytes, chunk):
                n = min(chunk, nbytes - i)
                buffer[dst + i:dst + i + n] = buffer[src + i:src + i + n]

    def uniform(self, seed: int, out) -> None:
        """A counter-based hash of (seed, element index) in one kernel (:data:`UNIFORM_KERNEL`):
        no generator state (CuPy's default generator would allocate and initialise about 12 MiB
        of cuRAND states at each call) and no temporaries."""
        if self._uniform is None:
            self._uniform = self.xp.ElementwiseKernel("uint64 seed", "T out", UNIFORM_KERNEL, "tensile_uniform")
        self._uniform(np.uint64(seed % (1 << 64)), out)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()


class CudaCopyEngine(CopyEngine):  # pragma: no cover - cuda only
    """Copy streams per direction and a disk thread (see the module docstring). A host array in
    page-locked memory (from :meth:`CudaDevice.host_empty` or a swap-out) is copied from directly;
    any other is staged first."""

    duplex = True

    def __init__(self, cupy):
        self._cupy = cupy
        self._streams = {"d2h": cupy.cuda.Stream(non_blocking=True), "h2d": cupy.cuda.Stream(non_blocking=True)}
        self._disk = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensile-disk")
        self._gpu = cupy.cuda.Device()     # the disk thread works on this one
        self._stage = None                 # the disk thread's staging buffer

    def to_host(self, array) -> Transfer:
        return self._copy(array, None)

    def to_device(self, host: np.ndarray, array) -> Transfer:
        return self._copy(array, host)

    def to_disk(self, array, file, offset: int) -> Transfer:
        queued = self._cupy.cuda.get_current_stream().record()
        future = self._disk.submit(self._to_disk, array, file, offset, queued)
        return Transfer(future.done, future.result)

    def from_disk(self, read, array) -> Transfer:
        future = self._disk.submit(self._from_disk, read, array)
        return Transfer(future.done, future.result)

    def close(self) -> None:
        self._disk.shutdown(wait=True)

    def _staging(self, nbytes: int):
        """The disk thread's page-locked buffer, grown to the largest tensor it has moved: the
        disk tier's pinned memory is one tensor's, whatever the number of copies queued."""
        if self._stage is None or self._stage.size < nbytes:
            self._stage = pinned_empty(self._cupy, (nbytes,), np.uint8)
        return self._stage[:nbytes]

    def _to_disk(self, array, file, offset: int, queued) -> None:
        with self._gpu:
            stream = self._streams["d2h"]
            stream.wait_event(queued)
            stage = self._staging(array.nbytes)
            array.get(stream=stream, out=stage)
            stream.synchronize()
            file.write_from(offset, stage)

    def _from_disk(self, read, array) -> None:
        with self._gpu:
            stage = self._staging(array.nbytes)
            read(stage)
            stream = self._streams["h2d"]
            array.set(stage, stream=stream)
            stream.synchronize()

    def _copy(self, array, host) -> Transfer:
        cupy = self._cupy
        stream = self._streams["d2h" if host is None else "h2d"]
        queued = cupy.cuda.get_current_stream().record()
        stream.wait_event(queued)
        if host is None:
            pinned = pinned_empty(cupy, array.shape, array.dtype)
            array.get(stream=stream, out=pinned)
        elif is_pinned(host):
            array.set(host, stream=stream)
        else:
            pinned = pinned_empty(cupy, host.shape, host.dtype)
            pinned[...] = host
            array.set(pinned, stream=stream)
        done = stream.record()

        def wait():
            done.synchronize()
            cupy.cuda.get_current_stream().wait_event(done)

        return Transfer(lambda: done.done, wait, pinned if host is None else None)


class _Owner:
    """Lives as long as CuPy holds the memory of a routed allocation."""


def _routed(nbytes: int):  # pragma: no cover - cuda only
    """CuPy's allocator with several devices routed: the arena of the current device's."""
    return _ROUTES[_cupy().cuda.runtime.getDevice()](nbytes)


def _release(manager, t) -> None:  # pragma: no cover - cuda only
    manager.unpin([t])
    manager.free(t)
