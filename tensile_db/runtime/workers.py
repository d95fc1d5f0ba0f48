"""Kernel threads on the CPU: a kernel that lowers its batch in chunks runs the chunks on all the
cores the BLAS would use, each chunk's matrix products on a single BLAS thread.

Note [Chunk pipelines on the CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A lowered convolution on NumPy is a chain of copies (padding, im2col, transposes) and matrix
products. The BLAS runs a product on every core, but NumPy runs each copy on one thread, so on a
two-core machine the copies of a 16 -> 16 3x3 convolution (32x32, batch 64) took half its time
with the other core idle. Running whole chunks on separate threads instead (NumPy releases the
GIL in copies and products), each product on one BLAS thread, keeps every core busy through the
copies too, and two products of cache-sized chunks on one thread each take no longer than the
two on two threads (and wait at no barrier between the BLAS's threads on a machine shared with
other work): that convolution's forward pass went from about 7 ms to about 4.5 ms; with its input
gradient lowered as a convolution too (:mod:`.conv_kernels`), its backward pass went from about
22 ms to about 9.5 ms (one process, medians of 11 calls; ``bench/throughput.py`` profiles it under
the executor).

OpenBLAS's own threads spin up to 2^28 cycles after each product before they sleep (its default
``OPENBLAS_THREAD_TIMEOUT``), so a threaded product just before (even a 64x32 by 32x64 one) left a
core spinning through the chunks that followed: the same convolution took 4 ms more after one, and
under the executor, between other ops, the small CNN's convolutions ran 1.7 times as long as alone.
A kernel process therefore runs with :data:`BLAS_ENVIRONMENT` (:func:`with_blas_environment`): its
threads sleep after 2^22 cycles (1.6 ms at this machine's 2.6 GHz). Sleeping sooner cost the MLP,
whose products come every few tenths of a millisecond and then wake the threads each time. ``python
bench/throughput.py``, ours / PyTorch (median of 5 repeats), runs of the settings alternated: the
MLP at 0.85, 0.87, 0.87 with the default, 0.77, 0.80, 0.85 with 2^18, 0.81, 0.82, 0.84, 0.86, 0.84
with 2^22, 0.85, 0.83 with 2^24, 0.83, 0.86 with 2^26; the small CNN at 0.30, 0.41, 0.30 with the
default, 0.48, 0.46, 0.52 with 2^18, 0.49, 0.46, 0.46, 0.45, 0.45 with 2^22, 0.43, 0.46 with 2^24,
0.37, 0.36 with 2^26.

:func:`run` gives each worker its index, which names its share of the workspace; which chunks a
worker lowers is Note [Chunks to the first free worker].

Limitations: the BLAS reads its environment once, when loaded, so a process that needs
:data:`BLAS_ENVIRONMENT` starts again with it (the coordinator, the benchmarks); elsewhere (a
PostgreSQL backend's inference, the tests) the BLAS's threads may spin through the chunks as
before; and a chunk that starts within 1.6 ms of a threaded product still shares its core with
a spinning thread for that long. The BLAS's thread count is one
setting of the process: while any kernel runs its chunks, every matrix product of the process,
another thread's too, runs on one thread (a counter restores the setting when the last such
kernel ends). The OpenBLAS bundled with NumPy here (0.3.31) ignores a thread count set from any
other thread once the main thread has set one: a process whose main thread runs split kernels
before other threads do (the tests) has those threads' products share the cores instead (slower,
the same results); the coordinator runs kernels on its executors' and connections' threads only.
The threads run NumPy only, never the database's API, so a PostgreSQL backend may run these
kernels too.

Note [Chunks to the first free worker]
--------------------------------------
Rationale: a convolution once split its chunks among the workers by a fixed rule (worker ``k``
took chunks ``k``, ``k + n``, ...), so its weight gradient, a sum over chunks, came out the same
on every run. But an op then ends with its slowest worker: a core that another thread or process
takes for a while (a copy, a planner, a PostgreSQL backend beside the coordinator) holds the whole
op up while the other core idles. The small CNN's five convolutions alone (batch 64, two workers),
beside a process that computes on one core 2 ms of every 4, took 21.7 to 24.7 ms forward and 36.8
to 41.8 ms backward (median 22.5 and 40.4 ms), against 12.8 to 16.0 and 22.7 to 28.3 ms without it.

Approach: the chunks go, in order, to whichever worker asks first (a shared iterator, whose
``next`` the GIL makes atomic). A backward pass gives each chunk a buffer for its weight gradient
and adds the buffers in chunk order as they complete, whichever worker made them (the bits of
one worker taking the same chunks, whatever the timing; the chunks' size still follows the number
of workers, :func:`.conv_kernels.chunk_plan`); a chunk finished before an earlier one waits in
its buffer, and a worker takes a new chunk only once a buffer is free (``2n - 1`` of them beside
the sum, in the room the fixed rule took). Beside that process the five convolutions took 16.9 to
22.0 ms forward and 32.7 to 39.6 ms backward (median 18.4 and 36.3 ms); without it, no difference
decided (alternated runs of the two, six each; ``bench/throughput.py`` measures them in training).

Limitations: a worker whose chunk is slow still holds the op up by that one chunk; the weight
gradients are added on whichever thread completes the chunk that allows it, under a lock.

Note [One OpenMP team]
----------------------
Rationale: GNU OpenMP gives every thread that starts a parallel region a team of its own, and
where its teams' threads outnumber the cores it throttles the spinning of every team: the
threads sleep at once after a region and each region wakes them again. When the swap engine's
copies first split over the team (Note [Copies on the team] in :mod:`.fused`), the coordinator's
start-up probe of the copy bandwidth, on the thread that builds the scheduler, started a second
team beside the executor's: the MLP of ``bench/throughput.py`` with unlimited memory then took
5.13 ms an iteration against 3.55 ms, every kernel slower.

Approach: the thread that runs a region on the kernels' team says so (:func:`note_team`: a
oneDNN primitive, a fused step on several threads), and work that may join the team but has no
need to start one (a copy) splits over it only on that thread (:func:`on_team`); elsewhere it
runs on one thread. The cost model's start-up probe times its copies on a thread of its own that
runs as the team's meanwhile and then ends, taking its team with it
(:func:`~tensile_db.scheduler.cost.measure_bandwidth`).

Limitations: kernels themselves run wherever they are called (an inference on a connection's
thread starts a team of its own there, as before). A thread's identity is its ident, which a
thread started after another has ended may get again: it is then taken for the team's thread
until another runs a region (its copies then start a team of its own).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading

#: The BLAS settings a process that runs kernels starts with: OpenBLAS's idle threads sleep after
#: 2^22 cycles of spinning instead of 2^28 (Note [Chunk pipelines on the CPU]). A value the
#: environment already has is kept.
BLAS_ENVIRONMENT = {"OPENBLAS_THREAD_TIMEOUT": "22"}

_lock = threading.Lock()
_here = threading.local()          # .working: this thread runs a share of run()'s work now
_state: dict = {"pool": None, "size": 0, "count": None, "controller": None, "inside": 0, "limited": None,
                "team": None}


def note_team() -> None:
    """The calling thread runs a parallel region on the kernels' GNU OpenMP team now (a oneDNN
    primitive, a fused step): the team is its (Note [One OpenMP team])."""
    _state["team"] = threading.get_ident()


def on_team() -> bool:
    """Whether the calling thread is the one that last ran a region on the kernels' OpenMP team
    (:func:`note_team`): work that may join the team but must not start another (Note [One
    OpenMP team]) splits over it only then."""
    return _state["team"] == threading.get_ident()


def with_blas_environment() -> None:
    """Start this process again, by ``os.execve`` (the same pid) with the command line it was
    started with (``sys.orig_argv``: the interpreter's options, ``-m`` and the arguments) and
    :data:`BLAS_ENVIRONMENT` added to its environment, unless the environment already names each
    of its variables; call before anything else happens (the BLAS is loaded with NumPy, and reads
    the environment then)."""
    if all(name in os.environ for name in BLAS_ENVIRONMENT):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**BLAS_ENVIRONMENT, **os.environ})


#: Elements from which an elementwise kernel splits its work over the workers (:func:`split`):
#: below, handing the parts to the pool and back (about 80 µs here) costs more than the second
#: core saves. A relu of 65,536 float32 took 0.03 ms on one thread and 0.10 ms split in two; of
#: 1,048,576, 0.39 and 0.27 ms.
SPLIT_NELEMS = 1 << 19


def split(work, items: int, nelems: int, xp) -> None:
    """Call ``work(start, stop)`` over ``range(items)`` cut into one part per worker, at once
    (:func:`run`), where ``xp`` is NumPy and the work touches at least :data:`SPLIT_NELEMS`
    elements (``nelems``); else ``work(0, items)`` here. For kernels whose parts (rows of a batch,
    channels) are independent: elementwise results are those of one call, bit for bit; a
    reduction over a part may add in another order (equal to rounding), the same on every run
    with the same workers."""
    n = min(count(), items) if xp.__name__ == "numpy" and nelems >= SPLIT_NELEMS else 1
    step = -(-items // max(n, 1))
    n = -(-items // step) if items else 1
    run(lambda k: work(k * step, min(items, (k + 1) * step)), n)


def _controller():
    """The process's threadpoolctl controller (made once; it reads the loaded BLAS libraries)."""
    if _state["controller"] is None:
        from threadpoolctl import ThreadpoolController
        _state["controller"] = ThreadpoolController()
    return _state["controller"]


def count() -> int:
    """Workers a kernel may run its chunks on: the threads of NumPy's BLAS when first asked (so
    ``OPENBLAS_NUM_THREADS=1`` keeps kernels on one core too), at least 1 (read without the lock
    once known: every kernel asks)."""
    if _state["count"] is not None:
        return _state["count"]
    with _lock:
        if _state["count"] is None:
            threads = [c.num_threads for c in _controller().select(user_api="blas").lib_controllers]
            _state["count"] = max(1, min(threads, default=os.cpu_count() or 1))
        return _state["count"]


def every_core() -> bool:
    """Whether the kernels' workers (:func:`count`) take every core this process may run on: then
    whatever else the process runs beside a kernel takes a core from it (Note [Copies beside
    kernels on every core] in :mod:`.device`, Note [Plans beside kernels on every core] in
    :mod:`tensile_db.scheduler.engine`)."""
    return count() >= len(os.sched_getaffinity(0))


def _pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of at least ``n`` kernel threads (``count() - 1`` when first made; a
    larger one replaces it, the old one's threads ending when idle, the BLAS limit's count kept)."""
    with _lock:
        if _state["size"] < n:
            old, size = _state["pool"], max(n, (_state["count"] or 1) - 1)
            _state["pool"] = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="tensile-kernel")
            _state["size"] = size
            if old is not None:
                old.shutdown(wait=False)
        return _state["pool"]


def _forked() -> None:
    """In a child forked from this process: the parent's kernel threads and its lock's holder do
    not exist here, and a limit in force in a run of the parent is the child's to drop."""
    global _lock
    _lock = threading.Lock()
    if _state["limited"] is not None:
        _state["limited"].restore_original_limits()
    _state.update(pool=None, size=0, inside=0, limited=None)


os.register_at_fork(after_in_child=_forked)


@contextlib.contextmanager
def _single_threaded_blas():
    with _lock:
        if _state["inside"] == 0:
            _state["limited"] = _controller().limit(limits=1, user_api="blas")
        _state["inside"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["inside"] -= 1
            if _state["inside"] == 0:
                _state["limited"].restore_original_limits()
                _state["limited"] = None


def run(work, n: int) -> None:
    """Call ``work(k)`` for ``k`` in ``range(n)``, at once on ``n`` threads (this one included),
    the BLAS on one thread meanwhile (Note [Chunk pipelines on the CPU]); returns when all have
    returned, and then raises the exception of the lowest ``k`` that raised one (the others'
    are dropped). ``n`` 1 calls ``work(0)`` here, the BLAS
    unchanged; so does a call from inside a worker's share, for each ``k`` in order (a worker
    waiting on the pool that runs it would never return)."""
    if n <= 1 or getattr(_here, "working", False):     # inside a worker: its share, in order, here
        for k in range(n):
            work(k)
        return
    pool = _pool(n - 1)
    with _single_threaded_blas():
        others = [pool.submit(_share, work, k) for k in range(1, n)]
        try:
            _share(work, 0)
        finally:
            concurrent.futures.wait(others)
        for f in others:
            f.result()


def _share(work, k: int) -> None:
    _here.working = True
    try:
        work(k)
    finally:
        _here.working = False
