"""The cost model: how long a swap takes, measured on this machine when the coordinator starts.

TENSILE hard-codes a host/device bandwidth (12 MB/ms); here both directions are measured through
the same transfer engine that performs the swaps (a copy thread on ``cpu``, the copy stream with
pinned host buffers on ``cuda``). The cost of recomputing a tensor is the measured time of the
ops that produce it (:mod:`tensile_db.scheduler.trace`).

Note [Tiers]
------------
TENSILE's cost model has two tiers: a swapped-out tensor waits in host memory, and a swap costs a
host <-> device copy. This one has three, device, host and disk, as the memory manager has: with
a host budget (:attr:`CostModel.host_budget_nbytes`), a swap-out goes to the host tier if the
bytes of swapped-out tensors held in host memory now plus its own fit the host budget, else to
the disk tier (written to the spill file, :mod:`tensile_db.memory.spill`). Its swap-in reads it
from where it went, and its host bytes are freed when its swap-in completes. Which tier a swap
gets depends on when the other swaps are issued and complete, so the simulator decides it while
it replays a plan (:class:`~tensile_db.scheduler.timeline.Simulator`); the cost model only says
what a copy from or to either tier costs (:meth:`CostModel.swap_out_s`, :meth:`CostModel.swap_in_s`).
Without a host budget the host tier is unbounded: two tiers, as in TENSILE.

Note [Contention]
-----------------
Rationale: a copy between host and device and a kernel that run at once share the device's
memory (its controllers and L2 on a GPU; the memory bus of a CPU), so each goes slower than it
would alone: every swap costs compute time even when its copy is hidden. The simulated device
charges it (:class:`~tensile_db.runtime.simulated.VirtualClock`: both at ``1 / (1 + c)`` while
the other runs, ``c`` = 0.05); a planner or a bound that leaves it out promises plans faster than
they run. On the simulated H100 (no jitter, no first-run error), one ResNet-50 at 70% of its
peak ran at +0.047 of extra time where its plan predicted +0.036; priced, the plan predicts
+0.044 and runs at +0.049.

Approach: :attr:`CostModel.contention` is ``c``, measured at start-up like the bandwidths
(:func:`measure_bandwidth`: device-to-device copies on the compute stream, looped for at least
0.2 ms, alone and beside a swap-out, the median of interleaved pairs; on an NVIDIA H200 four
start-ups measured 0.022 to 0.067 with the coordinator's 16 MiB probe). A copy of ``S``
uncontended seconds that runs wholly beside kernels takes ``S (1 + c)``, during which the kernels
do ``S`` seconds of work instead of ``S (1 + c)``: the compute stream falls ``c S`` behind. The
planners' simulation prices each copy at ``S (1 + c)`` and adds ``c`` times the busier copy
engine's uncontended seconds to the period (:class:`~tensile_db.scheduler.timeline.Simulator`).
The lower bound counts ``c / (1 + c)`` of them, what every plan loses at least (Note
[Relaxation] in :mod:`~tensile_db.scheduler.bound`).

Limitations: first order. The simulation adds the loss at the end of the period, not where the
copies run, and assumes every copy runs beside a kernel (a copy during a stall runs at full
speed); two engines busy at once lose once, so the busier one's seconds are counted. The measure
is of one machine at one moment, like the bandwidths: on a loaded ``cpu`` another program's work
can read as contention, hence the cap (:data:`MAX_CONTENTION`).

Note [Issue cost]
-----------------
Rationale: the executor carries out a plan's swaps on its own thread, between ops: a swap-out's
issue, the release of its block, the swap-in's issue and the acquire that makes it resident again
are the memory manager's bookkeeping and the copy's launch, and each op waits for the ones before
it (an op is timed to its end on every device, so no kernel runs meanwhile). A cost model of
copies alone priced a swap whose copies hide behind the kernels at nothing: at the largest working
set of ``bench/throughput.py``'s MLP (``cpu``), the plan swapped 29 tensors an iteration, 16 of
them biases and their Adam moments of 512 to 2,048 bytes, and each iteration ran 2 to 3 ms over
its 3.3 to 5 ms of ops. One swap cycle of a 512-byte tensor (out, release, in, acquire) took 15
to 20 µs of the thread on this project's 2-core machine, 127 to 169 µs on an NVIDIA H200 with
CuPy (three runs of 180 cycles, 512 bytes to 1 MiB; 104 to 110 µs once a tensor's view of the
arena took one CuPy call instead of three); a kernel and its synchronisation there took 18 µs.

Approach: :attr:`CostModel.issue_s` is half the median cycle, measured at start-up through a
memory manager of the probe's own (:func:`measure_issue`), less the copies, which the simulation
prices apart: a copy on a copy engine is waited for outside the timing, and one the executor's
thread makes itself (``cpu``) is taken off at the measured latency. The planners' simulation adds
it to the compute stream at each swap-out and each swap-in it issues. On ``cpu`` a copy of at most
:attr:`~tensile_db.runtime.device.CopyEngine.inline_nbytes` runs on the executor's thread
(:class:`~tensile_db.runtime.device.CpuCopyEngine`): :attr:`CostModel.inline_nbytes`, whose
copies the simulation puts on the compute stream too, done when issued, and not on a copy
channel (so without contention). The probe measures 6.8 µs per action on this project's
machine (about 2 µs of it the inline copy), 34 to 35 µs on the H200. The planner then weighs a small swap by what it costs the
executor: at 70% of the MLP's peak its plan took 8 swaps, none under 10,240 bytes, instead of 11
(three of 1,024 and 2,048 bytes).

Limitations: the simulated device charges no issue cost (its clock advances only with kernels
and copies), so it measures none and its plans are priced as before: its swaps are cheaper than
the real coordinator's. The cost is taken as one figure per action, whatever the tensor's size
(on the H200, a swap-out of 16 MiB took longer to issue: pinned host memory for it), and the
probe runs with its few objects in the caches: between a job's ops a swap costs the thread more
(the 29 swaps above, about 70 µs each against the probe's 15 a cycle). Where the plan must take
every byte at a peak (a budget at the largest working set), there is no choice to weigh, and the
cost is only predicted.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..errors import DiskError, DiskFull, InvalidArgument
from ..memory.manager import MemoryManager
from ..memory.spill import ALIGN_NBYTES
from ..runtime import workers
from ..runtime.device import Transfer
from ..runtime.program import Kind, Slot

log = logging.getLogger(__name__)

#: Bytes a start's measurement of the disk tier reads and writes, at most; less where less is free.
DISK_PROBE_NBYTES = 32 << 20
#: The least bytes worth measuring the disk tier with (below it, the default is taken).
MIN_DISK_PROBE_NBYTES = 1 << 20
#: The disk tier's read and write bandwidth, bytes per second, taken when it cannot be measured (too
#: little free space, or an error): a SATA SSD's order of magnitude; the plans price disk swaps
#: with it until the coordinator starts again with room to measure.
DEFAULT_DISK_BYTES_PER_S = 200e6
#: The most contention a start's measurement reports (Note [Contention]): beyond it, what slowed
#: the kernel was the machine's other work, not the copy.
MAX_CONTENTION = 0.2
#: The least seconds of the kernels a contention measurement times at once, and the most copies
#: in its loop (Note [Contention])
CONTENTION_KERNEL_S = 200e-6
MAX_CONTENTION_LOOPS = 256
#: The bytes of the issue cost's probe tensor (float32), and the swap cycles it times (Note
#: [Issue cost]): a small copy, so that the cycle is the bookkeeping
ISSUE_PROBE_NBYTES = 512
ISSUE_CYCLES = 64


@dataclass(frozen=True)
class CostModel:
    """Bandwidths in bytes per second, and a fixed latency per transfer in seconds. ``duplex``:
    swap-outs and swap-ins run on separate copy engines and overlap each other (a GPU's copy
    engines, the simulated device's); else they share one channel (``cpu``'s copy thread).

    ``contention``: how much slower a kernel runs while a copy is in flight, and a copy while a
    kernel runs, as a fraction (0.05: 5% slower; Note [Contention]).

    ``issue_s``: seconds of the executor's thread, and so of the compute stream, per swap-out and
    per swap-in it carries out; ``inline_nbytes``: copies to and from the host tier of at most
    this many bytes run on that thread, done when issued (Note [Issue cost]).

    ``host_budget_nbytes``: bytes of swapped-out tensors the host tier holds at most, None for
    no limit (Note [Tiers]); with one, ``disk_read_bytes_per_s`` and ``disk_write_bytes_per_s``
    (the spill file's, :func:`measure_disk`) price the swaps that go to the disk tier.

    Raises:
        InvalidArgument: a negative contention, issue cost or inline size, a negative host
            budget, or a host budget without both disk bandwidths (positive).
    """

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    latency_s: float = 0.0
    duplex: bool = False
    host_budget_nbytes: int | None = None
    disk_read_bytes_per_s: float | None = None
    disk_write_bytes_per_s: float | None = None
    contention: float = 0.0
    issue_s: float = 0.0
    inline_nbytes: int = 0

    def __post_init__(self):
        if not self.contention >= 0:
            raise InvalidArgument(f"contention {self.contention!r} is not a fraction >= 0; give how much slower a "
                                  f"kernel runs while a copy is in flight (0.05: 5%), or 0")
        if not self.issue_s >= 0 or self.inline_nbytes < 0:
            raise InvalidArgument(f"issue_s {self.issue_s!r} and inline_nbytes {self.inline_nbytes!r} must be >= 0 "
                                  f"(the executor's seconds per swap, the largest copy it makes itself)")
        if self.host_budget_nbytes is None:
            return
        if self.host_budget_nbytes < 0:
            raise InvalidArgument(f"host budget {self.host_budget_nbytes:,} bytes is negative; use 0 or more, "
                                  f"or None for an unbounded host tier")
        for name in ("disk_read_bytes_per_s", "disk_write_bytes_per_s"):
            value = getattr(self, name)
            if value is None or not value > 0:
                raise InvalidArgument(f"a host budget of {self.host_budget_nbytes:,} bytes needs the disk tier's "
                                      f"{name}, got {value!r}; measure it with measure_disk")

    @property
    def kernel_loss(self) -> float:
        """Compute seconds the kernels lose per second a copy is in flight beside them, ``c / (1 +
        c)`` (Note [Contention]): the one rule the planners' simulation and the lower bound share."""
        return self.contention / (1.0 + self.contention)

    def inline(self, nbytes):
        """Whether a swap of ``nbytes`` to or from the host tier makes its copies on the compute
        stream, done when issued (Note [Issue cost]); ``nbytes`` may be an array. The planners'
        simulation and the lower bound share the rule."""
        return (0 < self.inline_nbytes) & (nbytes <= self.inline_nbytes)

    def inline_swap_s(self, nbytes):
        """Seconds a swap of ``nbytes`` whose copies are made on the compute stream (:meth:`inline`)
        costs it: its swap-out's and swap-in's issue and both copies (Note [Issue cost]);
        ``nbytes`` may be an array."""
        return 2 * self.issue_s + self.swap_in_s(nbytes) + self.swap_out_s(nbytes)

    def disk_read_s(self, nbytes: int) -> float:
        """Seconds to read ``nbytes`` from the spill file."""
        return self.latency_s + nbytes / self.disk_read_bytes_per_s

    def disk_write_s(self, nbytes: int) -> float:
        """Seconds to write ``nbytes`` to the spill file."""
        return self.latency_s + nbytes / self.disk_write_bytes_per_s

    def swap_in_s(self, nbytes: int, disk: bool = False) -> float:
        """Seconds to swap ``nbytes`` in: copy them host -> device, or, from the disk tier
        (``disk``), read them from the spill file (Note [Tiers]). ``nbytes`` may be an array."""
        if not disk:
            return self.latency_s + nbytes / self.h2d_bytes_per_s
        if self.duplex:     # the device's memory is not host memory: read into host, then copy
            return self.disk_read_s(nbytes) + self.swap_in_s(nbytes)
        return self.disk_read_s(nbytes)      # cpu: the read goes straight into the arena

    def swap_out_s(self, nbytes: int, disk: bool = False) -> float:
        """Seconds to swap ``nbytes`` out: copy them device -> host, or, to the disk tier
        (``disk``), write them to the spill file (Note [Tiers]). ``nbytes`` may be an array."""
        if not disk:
            return self.latency_s + nbytes / self.d2h_bytes_per_s
        # A separate device's memory (duplex copy engines: cuda, sim) is copied to host memory and
        # then written, one after the other on the swap engine's thread: the sum of the two. On
        # cpu the arena is host memory and the write goes straight from it.
        if self.duplex:
            return self.swap_out_s(nbytes) + self.disk_write_s(nbytes)
        return self.disk_write_s(nbytes)


def measure_bandwidth(device, engine, nbytes: int = 16 << 20, repeats: int = 3) -> CostModel:
    """Measure host<->device bandwidth through ``engine`` (:func:`_measure_bandwidth`). Where the
    arena is host memory (``cpu``) the executor's thread, which runs the kernels' OpenMP team,
    splits its copies over that team (Note [Copies on the team] in
    :mod:`tensile_db.runtime.fused`): the copies are timed on a thread of their own that runs as
    the team's meanwhile and then ends, taking the team it started with it (Note [One OpenMP
    team] in :mod:`tensile_db.runtime.workers`). Timed on the caller's thread, which runs no
    team, they were one thread's: about 6.3 GB/s here against 12.5 on the team, and the plans
    priced every copy at twice its time."""
    if not device.arena_in_host_memory:
        return _measure_bandwidth(device, engine, nbytes, repeats)

    def on_the_team() -> CostModel:
        workers.note_team()
        return _measure_bandwidth(device, engine, nbytes, repeats)

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensile-probe") as probe:
        return probe.submit(on_the_team).result()       # its thread ends with the pool


def _measure_bandwidth(device, engine, nbytes: int, repeats: int) -> CostModel:
    """Measure host<->device bandwidth through ``engine`` (a
    :meth:`~tensile_db.runtime.device.Device.copy_engine`): the best of ``repeats`` copies of
    ``nbytes`` bytes each way, and the latency (best of a 512-byte copy each way); the bandwidth
    is the slope between the two sizes, or ``nbytes`` over the large copy's time when noise makes
    the slope meaningless; the contention of a copy and a kernel at once (Note
    [Contention]); the executor's seconds per swap action on ``device`` and the engine's largest
    copy on the caller's thread (Note [Issue cost]). Returns a :class:`CostModel` with an
    unbounded host tier.

    Where the arena is host memory (``cpu``), a swap-out copies into a spare buffer of the host
    tier once the buffers' sizes recur (Note [Spare host buffers] in
    :mod:`tensile_db.memory.tiers`): pages already faulted in. So the swap-outs here copy into
    such a buffer, not into a new one: with the coordinator's mmap threshold each new 16 MiB
    buffer was a fresh mapping faulted in page by page, and five start-ups here measured 0.44 to
    2.9 GB/s device to host against 5.7 to 8.5 GB/s host to device.
    """
    host = device.host_empty((nbytes,), np.uint8)
    host[...] = 1
    dev = device.arena_buffer(nbytes)
    spare = None
    if device.arena_in_host_memory:
        spare = device.host_empty((nbytes,), np.uint8)
        spare[...] = 0

    def to_host(array):
        return engine.to_host(array) if spare is None else engine.to_host(array, spare[:array.nbytes])

    def best(copy) -> float:
        times = []
        for _ in range(repeats):
            start = device.now()
            copy().wait()
            times.append(device.now() - start)
        return min(times)

    h2d = best(lambda: engine.to_device(host, dev))
    d2h = best(lambda: to_host(dev))
    small_host, small_dev = host[:512], dev[:512]
    latency = min(best(lambda: engine.to_device(small_host, small_dev)), best(lambda: to_host(small_dev)))
    def bandwidth(seconds: float) -> float:
        if seconds > 2 * latency:
            return (nbytes - 512) / (seconds - latency)
        return nbytes / seconds

    return CostModel(h2d_bytes_per_s=bandwidth(h2d), d2h_bytes_per_s=bandwidth(d2h), latency_s=latency,
                     duplex=engine.duplex, contention=_contention(device, engine, dev, repeats, to_host),
                     issue_s=_issue_less_copies(measure_issue(device), latency, engine),
                     inline_nbytes=engine.inline_nbytes)


def _issue_less_copies(issue_s: float, latency_s: float, engine) -> float:
    """The probe's seconds per action without its copy where the caller's thread made the copy
    (an engine whose :attr:`~tensile_db.runtime.device.CopyEngine.inline_nbytes` holds the probe's
    tensor: ``cpu``): the simulation prices that copy apart, at ``latency_s`` and up (Note [Issue
    cost])."""
    if ISSUE_PROBE_NBYTES <= engine.inline_nbytes:
        return max(issue_s - latency_s, 0.0)
    return issue_s


def measure_issue(device, cycles: int = ISSUE_CYCLES) -> float:
    """Note [Issue cost]: seconds of the calling thread per swap action, half the median over
    ``cycles`` of one swap cycle (swap-out, release, swap-in, acquire) of a tensor of
    :data:`ISSUE_PROBE_NBYTES` bytes (float32), through a memory manager of its own on
    ``device`` (closed before it returns), each copy on a copy engine waited for outside the
    timing (one the caller's thread makes, on ``cpu``, is inside it). 0 on a device whose clock is
    virtual (``sim``: its clock charges no bookkeeping)."""
    if device.virtual_time:
        return 0.0
    probe = MemoryManager(device, 1 << 20, pool="general")
    try:
        probe.register_job(1)
        (t,) = probe.acquire(1, [], [Slot("issue_probe", Kind.ACTIVATION, (ISSUE_PROBE_NBYTES // 4,))])
        probe.unpin([t])
        cycle_s = []
        for _ in range(cycles):
            start = device.now()
            probe.swap_out(t)
            out_s = device.now() - start
            t.transfer.wait()
            start = device.now()
            probe.release(t)
            probe.swap_in(t)
            in_s = device.now() - start
            t.transfer.wait()
            start = device.now()
            probe.acquire(1, [t], [])
            probe.unpin([t])
            cycle_s.append(out_s + in_s + device.now() - start)
        return float(np.median(cycle_s)) / 2
    finally:
        probe.close()


def _contention(device, engine, dev, repeats: int, to_host) -> float:
    """Note [Contention]: how much slower device-to-device copies of an eighth of ``dev``'s bytes
    (kernels on the compute stream, run in a loop at least :data:`CONTENTION_KERNEL_S` long, so
    that launches and the clock's resolution do not decide) run while a swap-out of all of
    ``dev`` (``to_host(dev)``, as :func:`measure_bandwidth` makes it; where the engine would make
    it on the caller's thread, done before the kernels start, a thread's copy of it) is in
    flight than alone:
    the median over ``2 * repeats`` pairs, each timed alone then beside one, of the ratio less 1
    (interleaved, so that the machine's other work falls on both alike); 0 where noise makes it
    look faster, at most :data:`MAX_CONTENTION`. A loop that outlasts the swap-out runs partly
    alone, so the figure can only come out low."""
    size = dev.nbytes // 8
    scratch = device.arena_buffer(2 * size)

    inline = dev.nbytes <= engine.inline_nbytes
    landing = device.host_empty(dev.shape, dev.dtype) if inline else None

    def beside_copy() -> Transfer:
        if not inline:
            return to_host(dev)
        # an engine that would make this copy on the caller's thread (``cpu`` where the kernels
        # take every core): a thread copies beside the kernels instead, as a copy thread does
        # (the disk tier's), for those copies the cost model prices with contention
        thread = threading.Thread(target=np.copyto, args=(landing, dev), name="tensile-probe-copy")
        thread.start()
        return Transfer(lambda: not thread.is_alive(), thread.join)

    def kernel_s(beside: bool, loops: int) -> float:
        copy = beside_copy() if beside else None
        start = device.now()
        for _ in range(loops):
            device.copy_within(scratch, 0, size, size)
        device.synchronize()
        seconds = device.now() - start
        if copy is not None:
            copy.wait()
        return seconds

    loops = 1
    while kernel_s(False, loops) < CONTENTION_KERNEL_S and loops < MAX_CONTENTION_LOOPS:
        loops *= 2
    ratios = []
    for _ in range(2 * repeats):
        alone = kernel_s(False, loops)
        ratios.append(kernel_s(True, loops) / alone - 1.0 if alone > 0 else 0.0)
    return min(max(float(np.median(ratios)), 0.0), MAX_CONTENTION)


def measure_disk(spill_file, nbytes: int = 32 << 20, repeats: int = 3) -> tuple[float, float]:
    """Measure the disk tier: (read, write) bandwidth of ``spill_file`` in bytes per second, each
    ``nbytes`` over the best of ``repeats`` blocking transfers of ``nbytes`` bytes, wall-clock.

    ``spill_file`` is a :class:`~tensile_db.memory.spill.SpillFile` (the same I/O the spill tier
    does: ``reserve``, ``write_from``, ``read_into``, ``release``); the bytes reserved are
    released again, and the file stays open (its owner closes it). The buffer is page-aligned, as
    O_DIRECT asks. The per-transfer latency is the cost model's ``latency_s``, not measured here.
    """
    raw = np.empty(nbytes + ALIGN_NBYTES, np.uint8)
    skip = -raw.ctypes.data % ALIGN_NBYTES
    buffer = raw[skip:skip + nbytes]
    buffer[...] = 1
    offset = spill_file.reserve(nbytes)
    try:
        def best(io) -> float:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                io(offset, buffer)
                times.append(time.perf_counter() - start)
            return max(min(times), 1e-9)          # a clock that did not tick: 1 ns, not 0

        write_s = best(spill_file.write_from)
        read_s = best(spill_file.read_into)
    finally:
        spill_file.release(offset, nbytes)
    return nbytes / read_s, nbytes / write_s


def measure_disk_tier(spill) -> tuple[float, float]:
    """The disk tier's (read, write) bandwidth, bytes per second, measured by :func:`measure_disk`
    on a scratch file of ``spill`` (a :class:`~tensile_db.memory.spill.SpillDir`) with at most
    half its free bytes (:data:`DISK_PROBE_NBYTES` at most), so that a small or full disk tier
    never stops the coordinator's start. Takes :data:`DEFAULT_DISK_BYTES_PER_S` both ways when
    less than :data:`MIN_DISK_PROBE_NBYTES` would fit or the measurement fails, and logs which."""
    free = spill.free_nbytes()
    nbytes = min(DISK_PROBE_NBYTES, free // 2 // ALIGN_NBYTES * ALIGN_NBYTES)
    reason = f"{free:,} bytes free, too few to measure with {MIN_DISK_PROBE_NBYTES:,}"
    if nbytes >= MIN_DISK_PROBE_NBYTES:
        try:
            scratch = spill.open_scratch()
            try:
                read, write = measure_disk(scratch, nbytes)
            finally:
                scratch.close()
            log.info("disk tier %s: %s bytes free; measured with %s bytes: read %.3g, write %.3g bytes/s", spill.root,
                     f"{free:,}", f"{nbytes:,}", read, write)
            return read, write
        except (DiskFull, DiskError) as exc:
            reason = str(exc)
    log.warning("disk tier %s: not measured (%s); taking %.3g bytes/s for reads and writes", spill.root, reason,
                DEFAULT_DISK_BYTES_PER_S)
    return DEFAULT_DISK_BYTES_PER_S, DEFAULT_DISK_BYTES_PER_S
