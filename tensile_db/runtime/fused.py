"""Fused optimiser steps on the CPU: Adam and SGD with momentum over float32 NumPy arrays in one
pass each, by the package's own compiled library (``_fused.c``, loaded by ``ctypes``).

:func:`adam` and :func:`sgd` do the step of :func:`.kernels.adam_update` and
:func:`.kernels.sgd_update` and return True when they can; else False, and the caller makes its
NumPy passes as before (CuPy arrays, float64, arrays that are not C-contiguous or not writeable,
an installation built without a C compiler, ``TENSILE_FUSED=0`` in the environment).

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

Limitations: float32 NumPy arrays only; CuPy's steps stay elementwise kernels per operation. The
loop runs on the calling thread.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading

import numpy as np

log = logging.getLogger(__name__)

#: The compiled library, as the package installs it (a setuptools extension; no Python API).
LIBRARY_MODULE = __package__ + "._fused"

_lock = threading.Lock()
_state: dict = {"library": None, "tried": False}

_P, _F, _N, _I = ctypes.c_void_p, ctypes.c_float, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tensile_adam_f32": [_P, _P, _P, _P, _N, _F, _F, _F, _F, _F, _F, _I],
    "tensile_sgd_f32": [_P, _P, _P, _N, _F, _F, _F, _I],
}


def enabled() -> bool:
    """Whether optimiser steps may run fused: ``TENSILE_FUSED`` is not ``0`` and the library loads."""
    return os.environ.get("TENSILE_FUSED", "1") != "0" and _library() is not None


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
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
    except (OSError, AttributeError):
        log.warning("%s does not load as the fused optimiser steps; they run as NumPy passes", spec.origin,
                    exc_info=True)
        return None
    return lib


def _usable(*arrays) -> bool:
    """Whether the library may take these arrays: C-contiguous float32 NumPy arrays of one shape,
    every one writeable (the library writes through the pointers, unchecked)."""
    shape = arrays[0].shape
    return enabled() and all(type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous
                             and a.flags.writeable and a.shape == shape for a in arrays)


def adam(w, g, m, v, lr: float, beta1: float, beta2: float, eps: float, step: int, weight_decay: float) -> bool:
    """The step of :func:`.kernels.adam_update` (Kingma & Ba, arXiv 1412.6980, Algorithm 1, as
    ``torch.optim.Adam``), in one pass: w, m, v written, g only read. Arrays as :func:`_usable`
    takes them; returns whether it ran (False: nothing written)."""
    if not _usable(w, g, m, v):
        return False
    _state["library"].tensile_adam_f32(
        w.ctypes.data, g.ctypes.data, m.ctypes.data, v.ctypes.data, w.size, lr / (1.0 - beta1 ** step), beta1,
        beta2, 1.0 / (1.0 - beta2 ** step) ** 0.5, eps, weight_decay, 1)
    return True


def sgd(w, g, velocity, lr: float, momentum: float, weight_decay: float) -> bool:
    """The step of :func:`.kernels.sgd_update` (SGD with momentum, as ``torch.optim.SGD``), in one
    pass: w and velocity written, g only read. Arrays as :func:`_usable` takes them; returns
    whether it ran (False: nothing written)."""
    if not _usable(w, g, velocity):
        return False
    _state["library"].tensile_sgd_f32(w.ctypes.data, g.ctypes.data, velocity.ctypes.data, w.size, lr, momentum,
                                      weight_decay, 1)
    return True
