"""The simulated device ``sim``: the project's own executor, memory manager, pools, swap engine
and planners, run on a GPU that exists only as a virtual clock.

A GPU is lent to this project's machines only now and then, and on ``cpu`` "device" and "host"
are the same RAM, copies compete with the arithmetic for the same cores, and short runs are
dominated by noise. ``sim`` measures what the scheduler does at GPU scale, deterministically:

- Tensors have shapes, dtypes and arena offsets but no values (:class:`SimArray`): the arena is
  offsets and bytes only, so four ResNet-50 jobs at batch 16 take no gigabytes of RAM. Everything
  above the arithmetic — the registry, the allocators, the planned pool, eviction, swap-out,
  swap-in, recompute, every policy — runs its real code.
- An op takes the roofline time of its class of kernel on a named GPU profile
  (:mod:`.gpus`)::

      seconds = max(flops / (peak FLOP/s x efficiency of the class),
                    bytes / (memory bandwidth x BANDWIDTH_EFFICIENCY)) + LAUNCH_S

  with the FLOPs and bytes the program builder gives each op from its shapes
  (:class:`~.program.Op`); loading the batch is a host -> device copy on the compute stream.
- Copies run on one copy engine per direction (FIFO, like CUDA's copy engines), each taking
  ``COPY_LATENCY_S + bytes / (PCIe bandwidth x PCIE_EFFICIENCY)``, overlapping compute. While a
  copy and a kernel run at once each progresses ``1 + CONTENTION`` times slower (both use the
  memory controllers); the clock integrates this exactly (:class:`VirtualClock`).
- A synchronous copy (the reactive eviction, a passive swap-in) stalls the compute stream until it
  completes on its engine; an asynchronous one (a planned swap) stalls only the op that waits for
  it (:meth:`Transfer.wait`).
- Each op's time is multiplied by seeded log-normal jitter (``jitter``, the standard deviation of
  its logarithm), and an op's first run by ``1 + first_run_error``: what the planner measures in a
  job's cold-start iteration is then not what later iterations take, so it is never an oracle and
  passive swap-ins can happen as on a real device.

Same profile, seed and inputs, same result: the clock is pure arithmetic, and the executor plans
synchronously on this device (:attr:`~.device.Device.virtual_time`) so that no thread's timing matters.
Every figure it produces is simulated and must be labelled "simulated, <profile>".
"""

from __future__ import annotations

import collections
import math

import numpy as np

from . import gpus
from .device import CopyEngine, Device, Transfer


class SimArray:
    """A tensor with a shape and a dtype but no values (host or device). Reading an element gives
    0.0, so a loss read from it is finite; a slice of the first axis, views, reshapes and copies
    are free."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def copy(self) -> "SimArray":
        return SimArray(self.shape, self.dtype)

    def reshape(self, *shape) -> "SimArray":
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(self.size // known if d == -1 else d for d in shape)
        return SimArray(shape, self.dtype)

    def view(self, dtype) -> "SimArray":
        dtype = np.dtype(dtype)
        return SimArray((self.nbytes // dtype.itemsize,), dtype)

    def __getitem__(self, index):
        if isinstance(index, slice):          # a range of the first axis
            return SimArray((len(range(*index.indices(self.shape[0]))), *self.shape[1:]), self.dtype)
        return 0.0

    def __setitem__(self, index, value) -> None:
        pass

    def __repr__(self) -> str:
        return f"SimArray({self.shape}, {self.dtype})"


class Copy:
    """One copy on a copy engine: ``work_s`` seconds of transfer left (uncontended), and the
    virtual time it completed at (None while in flight)."""

    __slots__ = ("work_s", "done_s")

    def __init__(self, work_s: float):
        self.work_s, self.done_s = work_s, None

    @property
    def done(self) -> bool:
        return self.done_s is not None


class VirtualClock:
    """The device's time: one compute stream and two copy engines (``h2d``, ``d2h``), FIFO each.

    ``now_s`` is the compute stream's time, seconds. Time advances only through :meth:`compute`
    (a kernel of given uncontended seconds), :meth:`wait` (the compute stream idles until a copy
    completes: a stall) and :meth:`idle_until`. Between events, the compute stream progresses at
    rate ``1 / (1 + contention)`` while a copy is in flight, and each copy engine's head copy at the
    same reduced rate while a kernel runs; rates are piecewise constant, so the integration is
    exact (event by event).

    Counters, seconds: ``busy_s`` (compute stream running a kernel), ``stall_s`` (waiting for a
    copy), ``idle_s`` (nothing to do); ``copied_nbytes`` per direction, bytes.
    """

    def __init__(self, contention: float = gpus.CONTENTION):
        self.contention = contention
        self.now_s = 0.0
        self.busy_s = self.stall_s = self.idle_s = 0.0
        self.engines: dict[str, collections.deque[Copy]] = {"h2d": collections.deque(), "d2h": collections.deque()}
        self.copied_nbytes = {"h2d": 0, "d2h": 0}

    def copy(self, direction: str, nbytes: int, seconds: float) -> Copy:
        """Queue a copy of ``nbytes`` taking ``seconds`` uncontended on the ``direction`` engine."""
        c = Copy(seconds)
        self.engines[direction].append(c)
        self.copied_nbytes[direction] += nbytes
        return c

    def compute(self, seconds: float) -> float:
        """Run a kernel of ``seconds`` uncontended; returns the seconds it took (contention in)."""
        start = self.now_s
        self._advance(compute_s=seconds)
        self.busy_s += self.now_s - start
        return self.now_s - start

    def wait(self, copy: Copy) -> None:
        """The compute stream waits until ``copy`` has completed."""
        start = self.now_s
        self._advance(copy=copy)
        self.stall_s += self.now_s - start

    def idle_until(self, t_s: float) -> None:
        """Nothing runs on the compute stream until ``t_s`` (copies go on)."""
        start = self.now_s
        self._advance(until_s=t_s)
        self.idle_s += self.now_s - start

    def in_flight(self) -> bool:
        return any(self.engines.values())

    def _advance(self, compute_s: float = 0.0, copy: Copy | None = None, until_s: float | None = None) -> None:
        slow = 1.0 + self.contention
        while compute_s > 0.0 or (copy is not None and not copy.done) or (until_s is not None and self.now_s < until_s):
            heads = [q[0] for q in self.engines.values() if q]
            compute_rate = 1.0 / slow if heads else 1.0
            copy_rate = 1.0 / slow if compute_s > 0.0 else 1.0
            compute_step = compute_s / compute_rate if compute_s > 0.0 else math.inf
            idle_step = until_s - self.now_s if until_s is not None and compute_s <= 0.0 else math.inf
            copy_steps = [h.work_s / copy_rate for h in heads]
            dt = min([compute_step, idle_step, *copy_steps])
            if dt == math.inf:
                raise AssertionError("waiting for a copy that is not queued on any engine")
            self.now_s += dt
            if compute_s > 0.0:
                compute_s = 0.0 if dt == compute_step else compute_s - dt * compute_rate
            for head, step in zip(heads, copy_steps):
                head.work_s = 0.0 if dt == step else head.work_s - dt * copy_rate
            for q in self.engines.values():
                while q and q[0].work_s <= 0.0:
                    q.popleft().done_s = self.now_s


class SimDevice(Device):
    """The ``sim`` device on GPU ``profile`` (a :mod:`.gpus` name or :class:`~.gpus.GpuProfile`).

    Args:
        profile: the GPU whose figures the roofline uses.
        seed: seeds the jitter.
        jitter: standard deviation of the logarithm of each op's time factor (0: none).
        first_run_error: relative error of an op's first run (a job's cold-start iteration)
            against its later runs; -0.1 makes the cold start measure 10% fast.
        contention: slowdown of a kernel and a copy running at once (:class:`VirtualClock`).

    Raises InvalidArgument for an unknown profile.
    """

    name = "sim"
    holds_values = False
    virtual_time = True

    def __init__(self, profile: str | gpus.GpuProfile = "h100", seed: int = 0, jitter: float = 0.03,
                 first_run_error: float = 0.0, contention: float = gpus.CONTENTION):
        self.profile = gpus.profile(profile) if isinstance(profile, str) else profile
        self.seed, self.jitter, self.first_run_error = seed, jitter, first_run_error
        self.clock = VirtualClock(contention)
        self.xp = None
        self._rng = np.random.default_rng(seed)
        self._seen: set[int] = set()          # ids of ops run before (kept alive by _ops)
        self._ops: list = []

    def describe(self) -> str:
        return f"simulated, {self.profile.description}"

    # -- time --------------------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock.now_s

    def idle_until(self, t_s: float) -> None:
        self.clock.idle_until(t_s)

    def op_seconds(self, op) -> float:
        """The roofline time of ``op`` (a :class:`~.program.Op`) on the profile, seconds, before
        jitter."""
        p = self.profile
        if op.unit == "load":
            return gpus.COPY_LATENCY_S + op.nbytes / p.copy_bytes_per_s
        compute = op.flops / (p.peak_flops_per_s(op.unit) * gpus.FLOP_EFFICIENCY[op.unit])
        memory = op.nbytes / (p.memory_bytes_per_s * gpus.BANDWIDTH_EFFICIENCY)
        return max(compute, memory) + gpus.LAUNCH_S

    def execute(self, op, arrays: dict, ctx) -> None:
        seconds = self.op_seconds(op)
        if id(op) not in self._seen:
            self._seen.add(id(op))
            self._ops.append(op)
            seconds *= 1.0 + self.first_run_error
        if self.jitter:
            seconds *= math.exp(self.jitter * float(self._rng.standard_normal()))
        self.clock.compute(seconds)

    def copy_seconds(self, nbytes: int) -> float:
        """Uncontended seconds of one host <-> device copy of ``nbytes``."""
        return gpus.COPY_LATENCY_S + nbytes / self.profile.copy_bytes_per_s

    def start_copy(self, direction: str, nbytes: int) -> Copy:
        """Queue an asynchronous copy (``"h2d"`` or ``"d2h"``) on its engine."""
        return self.clock.copy(direction, nbytes, self.copy_seconds(nbytes))

    # -- the Device interface: no values, only time -------------------------------------------------

    def copy_engine(self) -> "SimCopyEngine":
        return SimCopyEngine(self)

    def arena_buffer(self, nbytes: int) -> SimArray:
        return SimArray((nbytes,), np.uint8)

    def view(self, buffer, offset: int, shape, dtype) -> SimArray:
        return SimArray(shape, dtype)

    def host_empty(self, shape, dtype) -> SimArray:
        return SimArray(shape, dtype)

    def host_copy(self, host) -> SimArray:
        return SimArray(host.shape, host.dtype)

    def to_host(self, array) -> SimArray:
        self.clock.wait(self.start_copy("d2h", array.nbytes))
        return SimArray(array.shape, array.dtype)

    def to_device(self, host, array) -> None:
        self.clock.wait(self.start_copy("h2d", array.nbytes))

    def move_down(self, buffer, src: int, dst: int, nbytes: int) -> None:
        """A device-to-device copy: reads and writes ``nbytes``."""
        self.clock.compute(2 * nbytes / (self.profile.memory_bytes_per_s * gpus.BANDWIDTH_EFFICIENCY) + gpus.LAUNCH_S)

    copy_within = move_down

    def uniform(self, seed: int, out) -> None:
        pass

    def synchronize(self) -> None:
        pass


class SimCopyEngine(CopyEngine):
    """The swap engine of ``sim``: a copy is queued on the simulated device's copy engine of its
    direction and completes on its virtual clock. The device holds no values, so it has no disk
    tier (the memory manager refuses a host budget on it)."""

    duplex = True

    def __init__(self, device: SimDevice):
        self._device = device

    def to_host(self, array) -> Transfer:
        return self._copy("d2h", array, self._device.host_empty(array.shape, array.dtype))

    def to_device(self, host, array) -> Transfer:
        return self._copy("h2d", array)

    def _copy(self, direction: str, array, host=None) -> Transfer:
        copy, clock = self._device.start_copy(direction, array.nbytes), self._device.clock
        return Transfer(lambda: copy.done, lambda: clock.wait(copy), host)
