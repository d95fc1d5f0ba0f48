"""Devices: where tensors live and how bytes move between the arena and host memory.

A :class:`Device` hides the array module (NumPy for ``cpu``, CuPy for ``cuda``). Every device
tensor is a view into one arena buffer the device allocates once; host copies are always NumPy
arrays. On ``cuda`` the CuPy allocator is routed into the arena by the memory manager, so library
temporaries count against the budget too.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import time

import numpy as np

from ..errors import InvalidArgument


class Device:
    """One compute device. ``name`` is ``"cpu"`` or ``"cuda"``; ``xp`` its array module. The
    simulated device ``sim`` is :class:`~.simulated.SimDevice` (:func:`make_device`)."""

    #: True for a device whose tensors hold no values and whose time is virtual
    #: (:mod:`.simulated`): callers skip work whose only purpose is values, and plan synchronously.
    simulated = False
    _uniform = None     # the CuPy kernel of uniform(), compiled at its first use

    def __init__(self, name: str):
        if name == "cpu":
            self.xp = np
        elif name == "cuda":
            try:
                import cupy
            except ImportError as exc:  # pragma: no cover - depends on the machine
                raise InvalidArgument(
                    "tensile.device is 'cuda' but CuPy is not installed; install tensile_db[cuda] "
                    "or set tensile.device = 'cpu'") from exc
            self.xp = cupy
        else:
            raise InvalidArgument(f"unknown device {name!r}; use 'cpu', 'cuda' or 'sim'")
        self.name = name
        self._compute = threading.Lock() if name == "cpu" else None

    def describe(self) -> str:
        """The device in words, as benchmark output names it."""
        return self.name

    def now(self) -> float:
        """The device's clock, seconds (wall clock here; virtual on ``sim``)."""
        return time.perf_counter()

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

    def host_copy(self, host: np.ndarray) -> np.ndarray:
        """A C-contiguous host copy of ``host``, owned by the caller."""
        return np.array(host, order="C", copy=True)

    def computing(self):
        """A context manager around one op's arithmetic. On ``cpu`` it lets one thread compute at
        a time: BLAS already spreads one matrix product over every core, and several threads'
        products at once oversubscribe them (8 concurrent calls took twice as long as the same
        calls one after another). On ``cuda`` the device queues kernels itself: a no-op."""
        return self._compute if self._compute is not None else contextlib.nullcontext()

    def arena_buffer(self, nbytes: int):
        """One contiguous uint8 buffer of ``nbytes`` bytes on the device. On ``cpu`` it is
        page-aligned anonymous memory (pages are committed as they are first touched), so every
        512-byte arena block can be read from and written to a spill file with ``O_DIRECT``
        (Note [Spill I/O] in :mod:`tensile_db.memory.spill`)."""
        if self.xp is np:
            return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)[:nbytes]
        return self.xp.empty(nbytes, dtype=self.xp.uint8)  # pragma: no cover - cuda only

    def view(self, buffer, offset: int, shape: tuple[int, ...], dtype) -> object:
        """An array of ``shape`` and ``dtype`` over ``buffer[offset:]``; no copy."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return buffer[offset:offset + nbytes].view(dtype).reshape(shape)

    def host_empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised host (NumPy) array, page-locked on ``cuda`` so that copies to the
        device can run asynchronously straight from it."""
        if self.xp is np:
            return np.empty(shape, dtype)
        return pinned_empty(self.xp, shape, dtype)  # pragma: no cover - cuda only

    def to_host(self, array) -> np.ndarray:
        """A new host (NumPy) copy of a device array."""
        if self.xp is np:
            return array.copy()
        return self.xp.asnumpy(array)  # pragma: no cover - cuda only

    def to_device(self, host: np.ndarray, array) -> None:
        """Copy ``host`` into the device array ``array`` (same shape and dtype)."""
        if self.xp is np:
            np.copyto(array, host)
        else:  # pragma: no cover - cuda only
            array.set(np.ascontiguousarray(host))

    def move_down(self, buffer, src: int, dst: int, nbytes: int) -> None:
        """Copy ``buffer[src:src + nbytes]`` to ``buffer[dst:dst + nbytes]`` with ``dst < src``.
        NumPy copies overlapping slices correctly; on ``cuda`` overlapping ranges go through the
        host when the shift is small, else in non-overlapping chunks of ``src - dst`` bytes."""
        assert dst < src
        if self.xp is np or src - dst >= nbytes:
            buffer[dst:dst + nbytes] = buffer[src:src + nbytes]
        elif (src - dst) * 16 < nbytes:  # pragma: no cover - cuda only
            buffer[dst:dst + nbytes].set(self.xp.asnumpy(buffer[src:src + nbytes]))
        else:  # pragma: no cover - cuda only
            chunk = src - dst
            for i in range(0, nbytes, chunk):
                n = min(chunk, nbytes - i)
                buffer[dst + i:dst + i + n] = buffer[src + i:src + i + n]

    def copy_within(self, buffer, src: int, dst: int, nbytes: int) -> None:
        """Copy ``buffer[src:src + nbytes]`` to ``buffer[dst:dst + nbytes]``; the ranges must not
        overlap."""
        assert src + nbytes <= dst or dst + nbytes <= src
        buffer[dst:dst + nbytes] = buffer[src:src + nbytes]

    def uniform(self, seed: int, out) -> None:
        """Fill ``out`` (float32 or float64) with uniform draws in [0, 1) from a stream fixed by
        ``seed``, so that a recomputed dropout mask equals the first one. On ``cpu``, NumPy's
        Philox; on ``cuda``, a counter-based hash of (seed, element index) in one kernel
        (:data:`UNIFORM_KERNEL`): no generator state (CuPy's default generator would allocate
        and initialise about 12 MiB of cuRAND states at each call) and no temporaries."""
        if self.xp is np:
            np.random.Generator(np.random.Philox(seed)).random(out=out, dtype=out.dtype)
        else:  # pragma: no cover - cuda only
            if self._uniform is None:
                self._uniform = self.xp.ElementwiseKernel("uint64 seed", "T out", UNIFORM_KERNEL, "tensile_uniform")
            self._uniform(np.uint64(seed % (1 << 64)), out)

    def synchronize(self) -> None:
        """Wait for the work queued on the compute stream (a no-op on ``cpu``); copies on the swap
        engine's stream go on."""
        if self.xp is not np:  # pragma: no cover - cuda only
            self.xp.cuda.get_current_stream().synchronize()


#: The body of the CuPy kernel of :meth:`Device.uniform` on ``cuda``: SplitMix64's finaliser
#: (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014) of the
#: seed's stream at the element's index, its top 24 bits (float32) or 53 bits (float64) as a
#: fraction, so that no draw rounds up to 1.
UNIFORM_KERNEL = """
    unsigned long long z = seed * 0xD1B54A32D192ED03ull + (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    if (sizeof(T) == 4) out = (T)(z >> 40) * (T)(1.0 / 16777216.0);
    else out = (T)(z >> 11) * (T)(1.0 / 9007199254740992.0);
"""


def pinned_empty(cupy, shape, dtype) -> np.ndarray:  # pragma: no cover - cuda only
    """A host array in page-locked memory (from CuPy's pinned memory pool)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    mem = cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return np.frombuffer(mem, dtype, count).reshape(shape)


def is_pinned(host: np.ndarray) -> bool:  # pragma: no cover - cuda only
    """Whether the host array ``host`` (or the array it is a view of) lies in page-locked memory
    from :func:`pinned_empty`."""
    import cupy

    base = host
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):                # NumPy's frombuffer keeps a view of the buffer
        base = base.obj
    return isinstance(base, cupy.cuda.PinnedMemoryPointer)


def make_device(name: str, **sim_options) -> Device:
    """The device named ``name``: ``cpu``, ``cuda``, or ``sim`` (:class:`~.simulated.SimDevice`,
    whose keyword arguments ``sim_options`` are: profile, seed, jitter, first_run_error,
    contention). Raises InvalidArgument for an unknown name or a simulator option elsewhere."""
    if name == "sim":
        from .simulated import SimDevice
        return SimDevice(**sim_options)
    if sim_options:
        raise InvalidArgument(f"options {sorted(sim_options)} apply to the 'sim' device only, not {name!r}")
    return Device(name)
