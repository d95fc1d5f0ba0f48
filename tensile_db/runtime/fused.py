"""Fused elementwise kernels on the CPU: Adam and SGD with momentum, and the relu's backward, over
float32 NumPy arrays in one pass each, and copies split over the OpenMP team, by the package's
own compiled library (``_fused.c``, loaded by ``ctypes``).

:func:`adam`, :func:`sgd` and :func:`relu_backward` do the work of :func:`.kernels.adam_update`,
:func:`.kernels.sgd_update` and :func:`.kernels.relu_backward`, and :func:`copy` that of
``np.copyto`` (Note [Copies on the team]), and return True when they can; else False, and the
caller makes its NumPy passes as before (CuPy arrays, float64, arrays that are not C-contiguous,
aligned or writeable, arrays that overlap, a weight decay that rounds to 0 in float32, an
installation built without a C compiler, ``TENSILE_FUSED=0`` in the environment).

Note [Fused optimiser steps]
----------------------------
Rationale: NumPy's Adam makes 13 passes over each parameter (every ufunc reads and writes a
whole array; the 512x512 weights' four arrays, 4 MiB, do not stay in a core's 2 MiB of L2), and in
``bench/throughput.py``'s MLP (429,834 parameters) they took 0.95 ms of a 4.5 ms training
iteration. One pass that keeps each element in registers between the operations took 0.34 ms
for all eight parameters, against 0.89 ms by NumPy (medians of 7 x 50 steps, one thread).
Writing such a loop is the runtime's own business: no well-kept library has an optimiser step
for NumPy's arrays.

Approach: a C loop per optimiser that does, element by element, the float32 operations of the
NumPy kernel in the same order (compiled without contraction into fused multiply-adds and
without fast-math), so that its results equal the NumPy kernel's bit for bit, and a model trains
to the same weights either way; AVX-512 and AVX2 copies of each loop are chosen at load by the
CPU (GCC's ``target_clones``). The scalars (bias corrections, learning rate) are computed here
in Python's double precision and rounded to float32, as NumPy rounds a Python float it multiplies
a float32 array by. The library is compiled when the package is installed (a setuptools
extension marked optional: without a compiler the package installs, and these steps fall back).

A step of at least :data:`PARALLEL_MIN_NELEMS` elements splits its loop over the kernels'
workers as GNU OpenMP threads where the dense products run on oneDNN (the same OpenMP team: Note
[Dense products by oneDNN]); elsewhere, and in a child forked from this process, it runs on the
calling thread, since OpenMP threads beside OpenBLAS's busy ones cost more than they save. The
MLP's Adam took 0.30 to 0.39 ms an iteration so, against 0.43 ms on one thread.

Limitations: float32 NumPy arrays only; CuPy's steps stay elementwise kernels per operation.

Note [Fused relu backward]
--------------------------
Rationale: the relu's backward, ``dx = (1 - (y <= 0)) * dy``, took three NumPy passes (the mask
written into ``dx``, then two passes over it), seven array traversals where one loop needs three.
In the small CNN of ``bench/throughput.py`` its six ops took 4.9 ms of a 39 ms iteration, more
than any kernel but the convolutions; at its 64 x 16 x 32 x 32 activations (4 MiB) the arrays do
not stay in cache between the passes.

Approach: one loop of the same float32 operations in the same order (so a NaN or an infinite
``dy`` where ``y <= 0`` still gives NaN, and a negative one -0, as NumPy's passes do), split over
the OpenMP team as the optimiser steps are (:data:`PARALLEL_MIN_NELEMS`). Without the team
(oneDNN off), a backward of :data:`.workers.SPLIT_NELEMS` elements or more keeps its NumPy passes,
which split over the kernel workers.

Note [Copies on the team]
-------------------------
Rationale: where the kernels take every core, the CPU's copy engine copies between the arena and
host memory on the executor's thread (Note [Copies beside kernels on every core] in
:mod:`.device`), between ops, while the kernels' other threads wait. One thread's ``memcpy`` of
data not in cache ran at about 6.3 GB/s here: 650 us for 4 MiB, 160 us for 1 MiB (NumPy's
``copyto`` the same); the small CNN of ``bench/throughput.py`` at half its peak spent 4.5 ms of
a 43 ms iteration in such copies.

Approach: a copy of at least :data:`COPY_PARALLEL_MIN_NBYTES` splits over the OpenMP team where
the kernels run on it (as the large optimiser steps do), from the thread that runs them only
(Note [One OpenMP team] in :mod:`.workers`), in parts of whole cache lines: 4 MiB in
332 us, 1 MiB in 85, 256 KiB in 25 against 42, 128 KiB in 15 against 23 (medians, sources
rotated over 256 MiB so that none is in cache; two threads); in cache, 128 KiB took 5.1 against
4.5 us. The swaps themselves decide the threshold: under the executor, the MLP of
``bench/throughput.py`` at half its peak copied each 128 KiB tensor in 22 to 24 us on the team
and 11 to 12 us on one thread, each 512 KiB one in 34 us against 44, each 1 MiB one in 58 to 64
against 88 to 94 (mean per copy over 300 iterations, two runs each): the team gains somewhere
between 128 and 512 KiB (about 200 to 330 KiB, as these figures are read), so copies from
256 KiB split and smaller ones stay on one thread. No swap of that MLP or of the small CNN falls
between 128 KiB and 512 KiB, so the exact threshold was not measured.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading

import numpy as np

from . import onednn, workers

log = logging.getLogger(__name__)

#: The compiled library, as the package installs it (a setuptools extension; no Python API).
LIBRARY_MODULE = __package__ + "._fused"

#: Elements from which a step splits its loop over :func:`.workers.count` OpenMP threads (where
#: the dense products run on oneDNN's, the same team); below, one thread.
PARALLEL_MIN_NELEMS = 1 << 16
#: Bytes from which :func:`copy` splits a copy over them (Note [Copies on the team])
COPY_PARALLEL_MIN_NBYTES = 1 << 18

_lock = threading.Lock()
_state: dict = {"library": None, "tried": False, "forked": False, "functions": frozenset()}

_P, _F, _N, _I = ctypes.c_void_p, ctypes.c_float, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tensile_adam_f32": [_P, _P, _P, _P, _N, _F, _F, _F, _F, _F, _F, _I],
    "tensile_sgd_f32": [_P, _P, _P, _N, _F, _F, _F, _I],
    "tensile_relu_backward_f32": [_P, _P, _P, _N, _I],
    "tensile_copy": [_P, _P, _N, _I],
    "tensile_moments_f32": [_P, _N, _N, _P, _P, _P],
    "tensile_moments_rows_f32": [_P, _P, _N, _N, _P, _P, _P],
    "tensile_scale_rows_f32": [_P, _N, _N, _P, _P, _P],
}


def enabled(function: str | None = None) -> bool:
    """Whether optimiser steps may run fused: ``TENSILE_FUSED`` is not ``0`` and the library
    loads, with ``function`` among its functions where one is named (a library built from an
    earlier source lacks the later ones: those run as NumPy passes, the others still fused)."""
    return (os.environ.get("TENSILE_FUSED", "1") != "0" and _library() is not None
            and (function is None or function in _state["functions"]))


def _library():
    """The loaded library with its functions' signatures set, or None where the package was
    installed without it (tried once; after that, read without the lock: every step asks)."""
    if _state["tried"]:
        return _state["library"]
    with _lock:
        if not _state["tried"]:
            _state["library"] = _load()
            _state["tried"] = True
        return _state["library"]


def _load():
    spec = importlib.util.find_spec(LIBRARY_MODULE)
    if spec is None or not spec.origin:
        log.info("%s is not installed (the package was built without a C compiler); optimiser steps "
                 "run as NumPy passes", LIBRARY_MODULE)
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError:
        log.warning("%s does not load as the fused optimiser steps; they run as NumPy passes", spec.origin,
                    exc_info=True)
        return None
    found = set()
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, None
            found.add(name)
    if len(found) < len(_SIGNATURES):
        log.warning("%s lacks %s (built from an earlier source: reinstall the package); those run as NumPy passes",
                    spec.origin, ", ".join(sorted(set(_SIGNATURES) - found)))
    _state["functions"] = frozenset(found)
    return lib


def _forked() -> None:
    """In a child forked from this process: GNU OpenMP's threads did not come along (a parallel
    region would wait for them for ever), so this process's steps run on one thread."""
    global _lock
    _lock = threading.Lock()
    _state["forked"] = True


os.register_at_fork(after_in_child=_forked)


def _team() -> int:
    """Threads of the kernels' OpenMP team: :func:`.workers.count` where the process's matrix
    products run on oneDNN (whose team a step then shares), else 1."""
    return 1 if _state["forked"] or not onednn.enabled() else workers.count()


def _threads(nelems: int) -> int:
    """OpenMP threads a step of ``nelems`` elements runs on (Note [Fused optimiser steps]): the
    kernels' team (:func:`_team`) where the step is large; else 1, the calling thread alone."""
    n = _team() if nelems >= PARALLEL_MIN_NELEMS else 1
    if n > 1:
        workers.note_team()                 # the caller runs a region on the team now
    return n


def _disjoint(pointers: list[int], nbytes: int) -> bool:
    """Whether no two of the blocks of ``nbytes`` bytes at ``pointers`` overlap."""
    ordered = sorted(pointers)
    return all(later - earlier >= nbytes for earlier, later in zip(ordered, ordered[1:]))


def _pointers(function: str, weight_decay: float, *arrays) -> list[int] | None:
    """The arrays' data pointers where the library may take them, else None: aligned,
    C-contiguous, writeable float32 NumPy arrays of one shape (the library writes through the
    pointers, unchecked), no two of them overlapping (its loops read each element once); and a
    weight decay that is 0 or, rounded to float32, not 0 (NumPy's passes divide by it)."""
    shape = arrays[0].shape
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype != np.float32 or a.shape != shape:
            return None
        flags = a.flags
        if not (flags.c_contiguous and flags.writeable and flags.aligned):
            return None
    if (weight_decay and np.float32(weight_decay) == 0) or not enabled(function):
        return None
    pointers = [a.ctypes.data for a in arrays]
    return pointers if _disjoint(pointers, arrays[0].nbytes) else None


def adam(w, g, m, v, lr: float, beta1: float, beta2: float, eps: float, step: int, weight_decay: float) -> bool:
    """The step of :func:`.kernels.adam_update` (Kingma & Ba, arXiv 1412.6980, Algorithm 1, as
    ``torch.optim.Adam``), in one pass: w, m, v written, g only read. Arrays as :func:`_pointers`
    takes them; returns whether it ran (False: nothing written)."""
    pointers = _pointers("tensile_adam_f32", weight_decay, w, g, m, v)
    if pointers is None:
        return False
    _state["library"].tensile_adam_f32(
        *pointers, w.size, lr / (1.0 - beta1 ** step), beta1,
        beta2, 1.0 / (1.0 - beta2 ** step) ** 0.5, eps, weight_decay, _threads(w.size))
    return True


def sgd(w, g, velocity, lr: float, momentum: float, weight_decay: float) -> bool:
    """The step of :func:`.kernels.sgd_update` (SGD with momentum, as ``torch.optim.SGD``), in one
    pass: w and velocity written, g only read. Arrays as :func:`_pointers` takes them; returns
    whether it ran (False: nothing written)."""
    pointers = _pointers("tensile_sgd_f32", weight_decay, w, g, velocity)
    if pointers is None:
        return False
    _state["library"].tensile_sgd_f32(*pointers, w.size, lr, momentum, weight_decay, _threads(w.size))
    return True


def relu_backward(y, dy, dx) -> bool:
    """The relu's backward of :func:`.kernels.relu_backward` in one pass (Note [Fused relu
    backward]): ``dx`` written from the forward output ``y`` and ``dy``, arrays as :func:`_pointers`
    takes them; returns whether it ran (False: nothing written)."""
    pointers = _pointers("tensile_relu_backward_f32", 0.0, y, dy, dx)
    if pointers is None:
        return False
    threads = _threads(y.size)
    if threads == 1 and y.size >= workers.SPLIT_NELEMS and workers.count() > 1:
        return False                    # no team (oneDNN off): the NumPy passes split over the workers
    _state["library"].tensile_relu_backward_f32(*pointers, y.size, threads)
    return True


def moments(x, shift: np.ndarray, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Per column of ``x`` (N, F) float32 (of ``x[rows]``, row after row in the order of
    ``rows``, (M,) indices into x, where given), the sums of ``x - shift`` and of its squares,
    (F,) float64 each, in one pass on the calling thread (the same sums on every run, and with
    ``rows`` the same as on a gathered copy), or None where the library may not take ``x`` (not an
    aligned C-contiguous float32 NumPy array) or is not there; ``shift`` (F,) float64. Raises
    ValueError for a shift of another shape or a row outside x."""
    if type(x) is not np.ndarray or x.dtype != np.float32 or x.ndim != 2 \
            or not enabled("tensile_moments_f32" if rows is None else "tensile_moments_rows_f32") \
            or not (x.flags.c_contiguous and x.flags.aligned):
        return None
    shift = np.ascontiguousarray(shift, np.float64)
    if shift.shape != (x.shape[1],):
        raise ValueError(f"a shift of shape {shift.shape} for {x.shape[1]} columns")
    s1, s2 = np.zeros(x.shape[1]), np.zeros(x.shape[1])
    library = _state["library"]
    if rows is None:
        library.tensile_moments_f32(x.ctypes.data, x.shape[0], x.shape[1], shift.ctypes.data, s1.ctypes.data,
                                    s2.ctypes.data)
        return s1, s2
    rows = np.ascontiguousarray(rows, np.int64)       # the library reads every index as given: check them
    if rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= len(x))):
        raise ValueError(f"rows of shape {rows.shape} are not indices of x's {len(x)} rows")
    library.tensile_moments_rows_f32(x.ctypes.data, rows.ctypes.data, len(rows), x.shape[1], shift.ctypes.data,
                                     s1.ctypes.data, s2.ctypes.data)
    return s1, s2


def scale_rows(x, center, spread, out) -> bool:
    """``out = (x - center) / spread`` in float32, one pass on the calling thread, the same bits
    as NumPy's subtraction and division; x and out (N, F), center and spread (F,), all float32
    NumPy arrays, aligned and C-contiguous (out may be x). Returns whether it scaled (False:
    nothing written: another dtype, shape or layout, or no library)."""
    arrays = (x, center, spread, out)
    if any(type(a) is not np.ndarray or a.dtype != np.float32 or not (a.flags.c_contiguous and a.flags.aligned)
           for a in arrays) or x.ndim != 2 or out.shape != x.shape or center.shape != (x.shape[1],) \
            or spread.shape != center.shape or not out.flags.writeable or not enabled("tensile_scale_rows_f32"):
        return False
    if out.ctypes.data != x.ctypes.data and not _disjoint([out.ctypes.data, x.ctypes.data], x.nbytes):
        return False                                     # in place only exactly: a shifted overlap is not
    _state["library"].tensile_scale_rows_f32(x.ctypes.data, x.shape[0], x.shape[1], center.ctypes.data,
                                             spread.ctypes.data, out.ctypes.data)
    return True


def copy(dst, src) -> bool:
    """``dst[...] = src`` over the OpenMP team (Note [Copies on the team]) where it is there and
    the copy has at least :data:`COPY_PARALLEL_MIN_NBYTES` bytes: NumPy arrays of one shape and
    dtype (not of objects), C-contiguous, ``dst`` writeable, not overlapping; returns whether it
    copied (False: nothing written)."""
    if (type(dst) is not np.ndarray or type(src) is not np.ndarray or dst.nbytes < COPY_PARALLEL_MIN_NBYTES
            or dst.dtype != src.dtype or dst.dtype.hasobject or dst.shape != src.shape):
        return False
    if not workers.on_team():              # never a team of this thread's own (Note [One OpenMP team])
        return False
    threads = _team()
    if threads <= 1 or not enabled("tensile_copy") or not (dst.flags.c_contiguous and src.flags.c_contiguous
                                              and dst.flags.writeable):
        return False
    pointers = [dst.ctypes.data, src.ctypes.data]
    if not _disjoint(pointers, dst.nbytes):
        return False
    _state["library"].tensile_copy(*pointers, dst.nbytes, threads)
    return True
