"""Convolutions and dense products on the CPU by oneDNN (Intel's oneAPI Deep Neural Network
Library, the library PyTorch's CPU convolutions run on), through its C API by ``ctypes``: forward,
backward data and backward weights primitives of a float32 2-D convolution on the runtime's
channels-last images, every byte they touch in arrays the caller passes in; and float32 matrix
products with a bias row, for the dense layers.

:func:`forward` and :func:`backward` do a convolution of :mod:`.conv_kernels` when they can and
return True; else False, and the caller lowers it to matrix products as before (CuPy arrays,
float64, a platform without the library, a workspace too small, a process forked after loading
it, ``TENSILE_ONEDNN=0`` in the environment). :func:`matmul` does a product of
:func:`.kernels.dense_forward` or :func:`.kernels.dense_backward` the same way, else NumPy does.

Note [Convolutions by oneDNN]
-----------------------------
Rationale: lowered to im2col and OpenBLAS products on NumPy (:mod:`.conv_kernels`), the small
CNN of ``bench/throughput.py`` (batch 64, 3x32x32) spent 18 ms of each training iteration in its
five convolutions' forward passes and 31.5 ms in their backward passes, of about 69 ms, where
PyTorch trains the same network in about 25 ms an iteration: its CPU convolutions are oneDNN's,
direct convolutions by JIT-compiled AVX-512 kernels that need no lowering copy and keep the
products' operands in registers. The 16 -> 16 3x3 convolution at 32x32, batch 64, two threads,
medians of 30 calls: forward 5.2 ms lowered against 1.5 ms here, backward (data and weights) 10.1
ms against 2.4 to 2.7 ms. Writing such kernels is not this project's business; the well-kept
library that does it is.

Approach: a float32 convolution's geometry makes one :class:`_Primitives` (forward) or two
(backward data, backward weights), each built once per process for the OpenMP threads
:func:`.workers.count` allows (a primitive takes its threads when built) and kept (up to
:data:`PRIMITIVES_KEPT`): the images' memory descriptors are the channels-last arrays
as they are (dims N, C, H, W with the strides of (B, H, W, C)), the weights' the primitive's own
choice (``format_tag_any``), into which a reorder primitive copies ``w`` before each forward or
backward-data pass, and from which another copies the weight gradient into ``dw`` after a
backward-weights pass. The reordered weights and the primitives' scratchpads (user mode) are
slices of the convolution's workspace, an arena tensor: the library allocates nothing per call.
Each call makes the memory objects of its arrays and destroys them after, and runs on its
thread's own stream (primitives may run on several threads at once; a stream may not). The
arrays it writes must have the geometry's shapes and be writeable: the library writes through
their pointers unchecked.

Limitations: float32 only (oneDNN has no float64 convolution on the CPU); a workspace smaller
than the primitives need (tiny convolutions, whose lowering takes less than their scratchpads,
tens of kilobytes) is lowered; GNU OpenMP's idle threads spin a while after each primitive, as
its defaults have them (not tuned); the Python wheel
bundles oneDNN 3.2 built with GNU OpenMP, whose threads are not fork-safe: a process forked after
this module loaded the library lowers its convolutions instead. The bias gradient is the runtime's
own channel sum. The weights are reordered on every call, not once per optimiser step (a few
microseconds at these sizes). The workspace keeps the lowering's size, larger than the library
needs.

Note [Dense products by oneDNN]
-------------------------------
Rationale: NumPy's OpenBLAS took 0.72 ms for the four forward products of ``bench/throughput.py``'s
MLP (batch 128, 64-512-512-256-10) and 1.31 ms for their backward ones, where PyTorch's took 0.48
and 0.86 ms; oneDNN's matmul primitive takes 0.53 and 1.08 ms (medians of 7 x 200 calls, two
threads). Under the executor it gained nothing while other kernels still ran on OpenBLAS's
threads, and OpenMP threads beside OpenBLAS's cost more: the MLP's Adam split over OpenMP threads
(:mod:`.fused`) with the products on OpenBLAS took 8.6 ms an iteration, against 4.1 ms with Adam
on one thread. Each library's idle threads spin for a while after a call (OpenBLAS's about 1.6
ms, GNU OpenMP's longer), and two spinning pools on two cores take the cores from each other and
from the executor. With the products, the convolutions and the large optimiser steps all on GNU
OpenMP's one team, the MLP's iteration took 3.9 to 4.1 ms, against 4.2 to 4.6 ms before, and
about 3.7 ms once each thread kept a primitive's memory objects between calls (:class:`_Matmul`).

Approach: a product's operands' (dims, strides) make one matmul primitive, kept like the
convolutions' (:func:`_kept`): ``src`` and ``weights`` each C-contiguous or the transpose of a
C-contiguous array (a layer's ``x.T`` and ``w.T`` as they are, no copy), ``dst`` C-contiguous, the
bias a (1, N) row added by the primitive. A product of fewer than :data:`MATMUL_MIN_MACS`
multiply-adds stays NumPy's.

Limitations: the primitives' scratchpads are the library's own (its default mode, a buffer per
thread kept between calls, up to about 400 KB at these sizes), outside the arena: the dense op has
no workspace slot. Other strides are NumPy's (oneDNN's reference implementation, which they may
take, was a thousand times slower). Results differ from OpenBLAS's in rounding.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import threading
from collections import OrderedDict

import numpy as np

from . import workers

log = logging.getLogger(__name__)

#: Primitives a process keeps built, one per convolution (geometry, pass, bias, threads) and one
#: per dense product (operands' dims and strides, bias, threads); the least recently used beyond
#: are freed. ResNet-50's convolutions take 68 of them (23 geometries), DenseNet-121's 197; a
#: dense layer 3 per batch size.
PRIMITIVES_KEPT = 256
#: Multiply-adds from which a float32 matrix product runs on oneDNN (:func:`matmul`): below,
#: NumPy's is quicker than a oneDNN call through ``ctypes`` (about 20 µs): (128, 256) by (256, 10)
#: took 6 µs there and 26 µs here.
MATMUL_MIN_MACS = 1 << 20
#: Bytes every buffer in the workspace is aligned to (a cache line, oneDNN's expectation).
ALIGN_NBYTES = 64
#: The distribution that installs the library, and the library's file name.
DISTRIBUTION, LIBRARY = "onednn-cpu-gomp", "libdnnl.so.3"

# The C API's constants (oneapi/dnnl/dnnl_types.h, stable within oneDNN 3).
_F32, _FORMAT_ANY, _CPU, _STREAM_DEFAULT = 3, 1, 1, 1
_FORWARD_TRAINING, _CONVOLUTION_DIRECT, _SCRATCHPAD_USER = 64, 1, 1
_QUERY_WEIGHTS, _QUERY_DIFF_WEIGHTS, _QUERY_SCRATCHPAD = 131, 132, 136
_SRC, _DST, _WEIGHTS, _BIAS, _SCRATCHPAD = 1, 17, 33, 41, 80
_DIFF_SRC, _DIFF_DST, _DIFF_WEIGHTS = 129, 145, 161
_MAX_NDIMS = 12
_STATUS = {1: "out of memory", 2: "invalid arguments", 3: "unimplemented", 4: "last implementation reached",
           5: "runtime error", 6: "not required"}

_Dims = ctypes.c_int64 * _MAX_NDIMS
_handle = ctypes.c_void_p


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _handle)]


_SIGNATURES = {
    "dnnl_engine_create": [ctypes.POINTER(_handle), ctypes.c_int, ctypes.c_size_t],
    "dnnl_stream_create": [ctypes.POINTER(_handle), _handle, ctypes.c_uint],
    "dnnl_stream_wait": [_handle],
    "dnnl_stream_destroy": [_handle],
    "dnnl_primitive_attr_create": [ctypes.POINTER(_handle)],
    "dnnl_primitive_attr_set_scratchpad_mode": [_handle, ctypes.c_int],
    "dnnl_primitive_attr_destroy": [_handle],
    "dnnl_memory_desc_create_with_strides": [ctypes.POINTER(_handle), ctypes.c_int, _Dims, ctypes.c_int, _Dims],
    "dnnl_memory_desc_create_with_tag": [ctypes.POINTER(_handle), ctypes.c_int, _Dims, ctypes.c_int, ctypes.c_int],
    "dnnl_memory_desc_destroy": [_handle],
    "dnnl_convolution_forward_primitive_desc_create": [
        ctypes.POINTER(_handle), _handle, ctypes.c_int, ctypes.c_int, _handle, _handle, _handle, _handle,
        _Dims, _Dims, _Dims, _Dims, _handle],
    "dnnl_convolution_backward_data_primitive_desc_create": [
        ctypes.POINTER(_handle), _handle, ctypes.c_int, _handle, _handle, _handle, _Dims, _Dims, _Dims, _Dims,
        _handle, _handle],
    "dnnl_convolution_backward_weights_primitive_desc_create": [
        ctypes.POINTER(_handle), _handle, ctypes.c_int, _handle, _handle, _handle, _handle, _Dims, _Dims, _Dims,
        _Dims, _handle, _handle],
    "dnnl_reorder_primitive_desc_create": [ctypes.POINTER(_handle), _handle, _handle, _handle, _handle, _handle],
    "dnnl_matmul_primitive_desc_create": [ctypes.POINTER(_handle), _handle, _handle, _handle, _handle, _handle,
                                          _handle],
    "dnnl_primitive_desc_destroy": [_handle],
    "dnnl_primitive_create": [ctypes.POINTER(_handle), _handle],
    "dnnl_primitive_destroy": [_handle],
    "dnnl_primitive_execute": [_handle, _handle, ctypes.c_int, ctypes.POINTER(_Arg)],
    "dnnl_memory_create": [ctypes.POINTER(_handle), _handle, _handle, _handle],
    "dnnl_memory_set_data_handle": [_handle, _handle],
    "dnnl_memory_destroy": [_handle],
}
_RESTYPES = {"dnnl_primitive_desc_query_md": ([_handle, ctypes.c_int, ctypes.c_int], _handle),
             "dnnl_memory_desc_get_size": ([_handle], ctypes.c_size_t),
             "dnnl_memory_desc_equal": ([_handle, _handle], ctypes.c_int)}


class OneDNNError(RuntimeError):
    """A oneDNN call that failed where it may not (running a built primitive)."""


_lock = threading.Lock()
_state: dict = {"library": None, "tried": False, "engine": None, "forked": False,
                "primitives": OrderedDict()}
_threads = threading.local()                  # .stream: this thread's oneDNN stream


def enabled() -> bool:
    """Whether convolutions and dense products may run on oneDNN in this process:
    ``TENSILE_ONEDNN`` is not ``0``, the library loads, and the process was not forked from one
    that had loaded it."""
    return os.environ.get("TENSILE_ONEDNN", "1") != "0" and not _state["forked"] and _library() is not None


def _library():
    """The loaded library with its functions' signatures set, or None where it is not installed
    (tried once; after that, read without the lock: every convolution asks)."""
    if _state["tried"]:
        return _state["library"]
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            _state["library"] = _load()
        return _state["library"]


def _load():
    path = _installed_path()
    try:
        lib = ctypes.CDLL(path or LIBRARY)
        gomp = ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None
    try:
        return _bound(lib, gomp)
    except AttributeError:          # a library without a function of this API: not oneDNN 3
        log.warning("%s lacks a function of oneDNN 3's C API; convolutions and products run on NumPy instead",
                    path or LIBRARY)
        return None


def _bound(lib, gomp):
    """``lib`` with its functions' signatures set and the engine made; None if the engine fails."""
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    for name, (argtypes, restype) in _RESTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    gomp.omp_set_num_threads.argtypes, gomp.omp_set_num_threads.restype = [ctypes.c_int], None
    lib.omp_set_num_threads = gomp.omp_set_num_threads
    engine = _handle()
    if lib.dnnl_engine_create(ctypes.byref(engine), _CPU, 0):
        return None
    _state["engine"] = engine
    return lib


def _installed_path() -> str | None:
    """The library's file as :data:`DISTRIBUTION` installed it (under the environment's ``lib``,
    beside no other package), or None."""
    try:
        files = importlib.metadata.distribution(DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(f.locate()) for f in files if f.name == LIBRARY), None)


def _forked() -> None:
    """In a child forked from this process after it loaded the library: GNU OpenMP's threads did
    not come along (a parallel region would wait for them for ever), nor did a thread that held
    oneDNN's own locks (building a primitive), so this process lowers instead."""
    global _lock
    _lock = threading.Lock()
    _state["forked"] = _state["forked"] or _state["library"] is not None


os.register_at_fork(after_in_child=_forked)


def _check(status: int, what: str) -> None:
    if status:
        raise OneDNNError(f"oneDNN's {what} failed: {_STATUS.get(status, 'status ' + str(status))}")


class _Stream:
    """A thread's oneDNN stream, destroyed with the thread's local data when the thread ends."""

    def __init__(self):
        self._lib, self.handle = _state["library"], _handle()
        _check(self._lib.dnnl_stream_create(ctypes.byref(self.handle), _state["engine"], _STREAM_DEFAULT),
               "stream creation")

    def __del__(self):
        if self.handle:
            self._lib.dnnl_stream_destroy(self.handle)


def _set_threads(lib) -> None:
    """GNU OpenMP's threads for this thread's next parallel region: :func:`.workers.count` (set
    again only when it changed since this thread last set it)."""
    n = workers.count()
    if getattr(_threads, "omp", None) != n:
        lib.omp_set_num_threads(n)
        _threads.omp = n


def _stream():
    stream = getattr(_threads, "stream", None)
    if stream is None:
        stream = _threads.stream = _Stream()
    return stream.handle


def _image_dims(batch: int, channels: int, height: int, width: int):
    """(dims, strides) of a channels-last (B, H, W, C) array in oneDNN's axes (N, C, H, W)."""
    return (batch, channels, height, width), (height * width * channels, 1, width * channels, channels)


def _weight_dims(geometry):
    """(dims, strides) of the weights (O, C/g, KH, KW), C-contiguous; with groups, (g, O/g, C/g, KH, KW)."""
    o, cg, kh, kw = geometry.weight_shape
    if geometry.groups == 1:
        return (o, cg, kh, kw), (cg * kh * kw, kh * kw, kw, 1)
    og = o // geometry.groups
    return (geometry.groups, og, cg, kh, kw), (og * cg * kh * kw, cg * kh * kw, kh * kw, kw, 1)


class _Built:
    """Primitives built by a subclass's ``_build(lib, *args)``, with the memory descriptors and
    primitive descriptors they were made of, freed with this object. Raises
    :class:`_Unsupported` where oneDNN has no implementation of one."""

    def __init__(self, *args):
        lib = self._lib = _state["library"]
        self._owned_mds, self._pds, self._prims = [], [], []
        try:
            self._build(lib, *args)
        except BaseException:
            self.close()
            raise

    def _md(self, dims, strides=None, *, any_format=False):
        md = _handle()
        n = len(dims)
        if any_format:
            status = self._lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), n, _Dims(*dims), _F32, _FORMAT_ANY)
        else:
            status = self._lib.dnnl_memory_desc_create_with_strides(ctypes.byref(md), n, _Dims(*dims), _F32,
                                                                    _Dims(*strides))
        _check(status, "memory descriptor creation")
        self._owned_mds.append(md)
        return md

    def _pd(self, create, *args) -> _handle:
        pd = _handle()
        status = create(ctypes.byref(pd), *args)
        if status == 3:
            raise _Unsupported
        _check(status, "primitive descriptor creation")
        self._pds.append(pd)
        return pd

    def _primitive(self, pd) -> _handle:
        p = _handle()
        _check(self._lib.dnnl_primitive_create(ctypes.byref(p), pd), "primitive creation")
        self._prims.append(p)
        return p

    def nbytes(self, md) -> int:
        """Bytes of the memory descriptor ``md`` (0 for None, or a scratchpad not needed)."""
        return 0 if md is None else self._lib.dnnl_memory_desc_get_size(md)

    def close(self) -> None:
        lib = self._lib
        for p in self._prims:
            lib.dnnl_primitive_destroy(p)
        for pd in self._pds:
            lib.dnnl_primitive_desc_destroy(pd)
        for md in self._owned_mds:
            lib.dnnl_memory_desc_destroy(md)
        self._prims, self._pds, self._owned_mds = [], [], []

    def __del__(self):
        self.close()


class _Primitives(_Built):
    """One built convolution primitive and the reorder of its weights, for ``(geometry, kind,
    bias)``; ``kind``: ``forward``, ``data`` (backward data) or ``weights`` (backward weights)."""

    def _build(self, lib, geometry, kind: str, bias: bool) -> None:
        attr = _handle()
        _check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attribute creation")
        try:
            _check(lib.dnnl_primitive_attr_set_scratchpad_mode(attr, _SCRATCHPAD_USER), "scratchpad mode")
            self._build_with(lib, geometry, kind, bias, attr)
        finally:
            lib.dnnl_primitive_attr_destroy(attr)

    def _build_with(self, lib, geometry, kind: str, bias: bool, attr) -> None:
        src = self._md(*_image_dims(geometry.batch, geometry.channels, geometry.height, geometry.width))
        dst = self._md(*_image_dims(geometry.batch, geometry.out_channels, geometry.out_height, geometry.out_width))
        wdims, wstrides = _weight_dims(geometry)
        plain, chosen = self._md(wdims, wstrides), self._md(wdims, any_format=True)
        shape = (geometry.height, geometry.width)
        pad_r = [(o - 1) * s + (k - 1) * d + 1 - size - p for o, s, k, d, size, p in zip(
            (geometry.out_height, geometry.out_width), geometry.stride, geometry.kernel, geometry.dilation,
            shape, geometry.padding)]
        geo = (_Dims(*geometry.stride), _Dims(*(d - 1 for d in geometry.dilation)), _Dims(*geometry.padding),
               _Dims(*pad_r))
        bias_md = self._md((geometry.out_channels,), (1,)) if bias and kind == "forward" else None
        hint = self._pd(lib.dnnl_convolution_forward_primitive_desc_create, _state["engine"], _FORWARD_TRAINING,
                        _CONVOLUTION_DIRECT, src, chosen, bias_md, dst, *geo, attr)
        if kind == "forward":
            pd = hint
        elif kind == "data":
            pd = self._pd(lib.dnnl_convolution_backward_data_primitive_desc_create, _state["engine"],
                          _CONVOLUTION_DIRECT, src, chosen, dst, *geo, hint, attr)
        else:
            pd = self._pd(lib.dnnl_convolution_backward_weights_primitive_desc_create, _state["engine"],
                          _CONVOLUTION_DIRECT, src, chosen, None, dst, *geo, hint, attr)
        self.conv = self._primitive(pd)
        self.src, self.dst, self.bias, self.plain = src, dst, bias_md, plain
        self.weights = lib.dnnl_primitive_desc_query_md(pd, _QUERY_DIFF_WEIGHTS if kind == "weights"
                                                        else _QUERY_WEIGHTS, 0)
        self.weights_nbytes = lib.dnnl_memory_desc_get_size(self.weights)
        self.scratch = lib.dnnl_primitive_desc_query_md(pd, _QUERY_SCRATCHPAD, 0)
        self.reorder = self.reorder_scratch = None
        if not lib.dnnl_memory_desc_equal(plain, self.weights):
            source, target = (self.weights, plain) if kind == "weights" else (plain, self.weights)
            rpd = self._pd(lib.dnnl_reorder_primitive_desc_create, source, _state["engine"], target,
                           _state["engine"], attr)
            self.reorder = self._primitive(rpd)
            self.reorder_scratch = lib.dnnl_primitive_desc_query_md(rpd, _QUERY_SCRATCHPAD, 0)

    @property
    def workspace_nbytes(self) -> int:
        """Bytes of workspace a call takes: the weights in the primitive's layout (where they
        need a reorder) and the scratchpads of the convolution and the reorder, each aligned to
        :data:`ALIGN_NBYTES`."""
        weights = self.weights_nbytes if self.reorder is not None else 0
        return sum(_aligned(n) for n in (weights, self.nbytes(self.scratch), self.nbytes(self.reorder_scratch)))


class _Matmul(_Built):
    """One built matmul primitive: ``dst (M, N) = src (M, K) @ weights (K, N)`` plus a bias row
    (1, N) if ``bias``, for the operands' (dims, strides) in elements; dst C-contiguous. Its
    scratchpad is the library's own (the default mode), not the caller's. Each thread that runs
    it keeps its memory objects and argument list, pointed at the arrays of each call, so that a
    call makes and destroys none (a product of the MLP took about 25 µs of ``ctypes`` calls so)."""

    def _build(self, lib, src, weights, bias: bool) -> None:
        (m, _), (_, n) = src[0], weights[0]
        self.src, self.weights = self._md(*src), self._md(*weights)
        self.dst = self._md((m, n), (n, 1))
        self.bias = self._md((1, n), (n, 1)) if bias else None
        pd = self._pd(lib.dnnl_matmul_primitive_desc_create, _state["engine"], self.src, self.weights, self.bias,
                      self.dst, None)
        self.matmul = self._primitive(pd)
        self._threads = threading.local()

    def run(self, pointers: list[int]) -> None:
        """``out = a @ b (+ bias)`` on this thread's stream: ``pointers`` the data of a, b, out and
        (with a bias) bias, arrays as :func:`matmul` takes them."""
        bound = getattr(self._threads, "bound", None)
        if bound is None:
            bound = self._threads.bound = self._bind()
        lib = self._lib
        for memory, pointer in zip(bound.memories, pointers):
            _check(lib.dnnl_memory_set_data_handle(memory, pointer), "memory handle")
        _set_threads(lib)
        stream = _stream()
        workers.note_team()
        _check(lib.dnnl_primitive_execute(self.matmul, stream, len(bound.args), bound.args), "primitive execution")
        _check(lib.dnnl_stream_wait(stream), "stream wait")

    def _bind(self) -> _Bound:
        """This thread's memory objects of src, weights, dst and bias, and the execution's arguments."""
        named = [(_SRC, self.src), (_WEIGHTS, self.weights), (_DST, self.dst)]
        if self.bias is not None:
            named.append((_BIAS, self.bias))
        bound = _Bound(self._lib)
        for _, md in named:
            memory = _handle()
            _check(self._lib.dnnl_memory_create(ctypes.byref(memory), md, _state["engine"], None), "memory creation")
            bound.memories.append(memory)
        bound.args = (_Arg * len(named))(*(_Arg(arg, m) for (arg, _), m in zip(named, bound.memories)))
        return bound


class _Bound:
    """One thread's memory objects of a :class:`_Matmul` (no buffer of their own: each call points
    them at its arrays) and its argument list, destroyed with the thread's local data when the
    thread ends or with the primitive (a memory object does not need its primitive)."""

    def __init__(self, lib):
        self._lib, self.memories, self.args = lib, [], None

    def __del__(self):
        for memory in self.memories:
            self._lib.dnnl_memory_destroy(memory)


class _Unsupported(Exception):
    """oneDNN has no implementation of a primitive asked for."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_NBYTES) * ALIGN_NBYTES


def _primitives(geometry, kind: str, bias: bool) -> _Primitives | None:
    """The kept primitives of ``geometry``'s ``kind`` pass (built now if not yet), or None where
    oneDNN has none."""
    return _kept(_Primitives, geometry, kind, bias)


def _kept(kind: type, *args) -> _Built | None:
    """The kept ``kind(*args)`` for this process's threads (built now if not yet), or None where
    oneDNN has no implementation of it or fails to build one (the caller's NumPy kernel runs)."""
    threads = workers.count()
    key = (kind, *args, threads)
    cache = _state["primitives"]
    with _lock:
        found = cache.get(key, False)
        if found is not False:
            cache.move_to_end(key)
            return found
    _set_threads(_state["library"])                     # a primitive takes its threads when built
    try:
        built = kind(*args)
    except _Unsupported:
        built = None
    except OneDNNError:             # a library that fails to build one: the NumPy kernel runs it, as before
        log.exception("oneDNN could not build the primitives %s%s; the NumPy kernel runs instead", kind.__name__, args)
        built = None
    with _lock:
        cache[key] = built
        while len(cache) > PRIMITIVES_KEPT:
            cache.popitem(last=False)
    return built


def _usable(shaped, written, geometry) -> bool:
    """Whether oneDNN may take these arrays: ``shaped`` pairs of (array, the shape it must have),
    every one a C-contiguous float32 NumPy array, those in ``written`` writeable too (the library
    writes through the pointer, unchecked)."""
    return (geometry.batch > 0 and enabled()
            and all(type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous and a.shape == shape
                    for a, shape in shaped)
            and all(a.flags.writeable for a in written))


class _Workspace:
    """Aligned byte slices handed out from the start of a float32 workspace ``flat``."""

    def __init__(self, flat):
        self._base, self._end = flat.ctypes.data, flat.ctypes.data + flat.nbytes
        self._at = _aligned(self._base)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more bytes (the sum of aligned sizes) fit after what is taken."""
        return self._at + nbytes <= self._end

    def take(self, nbytes: int) -> int:
        at, self._at = self._at, _aligned(self._at + nbytes)
        return at


class _Call:
    """The memory objects of one run of primitives, destroyed at its end."""

    def __init__(self):
        self._lib, self._made = _state["library"], []

    def memory(self, md, address: int) -> _handle:
        m = _handle()
        _check(self._lib.dnnl_memory_create(ctypes.byref(m), md, _state["engine"], _handle(address)),
               "memory creation")
        self._made.append(m)
        return m

    def run(self, primitive, **args) -> None:
        pairs = [(_ARG_IDS[name], m) for name, m in args.items() if m is not None]
        array = (_Arg * len(pairs))(*(_Arg(a, m) for a, m in pairs))
        workers.note_team()
        _check(self._lib.dnnl_primitive_execute(primitive, _stream(), len(pairs), array), "primitive execution")

    def __enter__(self):
        _set_threads(self._lib)
        return self

    def __exit__(self, *exc):
        try:
            status = self._lib.dnnl_stream_wait(_stream())
            if exc[0] is None:                       # an error of the run is the one to raise
                _check(status, "stream wait")
        finally:
            for m in self._made:
                self._lib.dnnl_memory_destroy(m)


_ARG_IDS = {"src": _SRC, "dst": _DST, "weights": _WEIGHTS, "bias": _BIAS, "scratchpad": _SCRATCHPAD,
            "diff_src": _DIFF_SRC, "diff_dst": _DIFF_DST, "diff_weights": _DIFF_WEIGHTS}


def _scratchpad(call: _Call, prims: _Primitives, space: _Workspace, md):
    """The memory object of the scratchpad ``md`` of ``prims`` in ``space``, or None where it has no bytes."""
    nbytes = prims.nbytes(md)
    return call.memory(md, space.take(nbytes)) if nbytes else None


def forward(x, w, b, out, geometry, flat) -> bool:
    """``out = conv2d(x, w) + b`` by oneDNN, if it can (see the module): x (B, H, W, C), w (O,
    C/g, KH, KW), b (O,) or None, out (B, OH, OW, O), C-contiguous float32 NumPy arrays; ``flat``
    the float32 workspace of :attr:`.conv_kernels.ConvGeometry.forward_workspace_nelems`
    elements. Returns whether it did (False: nothing written)."""
    shaped = [(x, geometry.in_shape), (w, geometry.weight_shape), (out, geometry.out_shape), (flat, flat.shape)]
    if not _usable(shaped + ([] if b is None else [(b, (geometry.out_channels,))]), [out, flat], geometry):
        return False
    prims = _primitives(geometry, "forward", b is not None)
    space = _Workspace(flat)
    if prims is None or not space.fits(prims.workspace_nbytes):
        return False
    with _Call() as call:
        weights = _weights_in(call, prims, w, space)
        scratch = _scratchpad(call, prims, space, prims.scratch)
        call.run(prims.conv, src=call.memory(prims.src, x.ctypes.data), weights=weights,
                 bias=None if b is None else call.memory(prims.bias, b.ctypes.data),
                 dst=call.memory(prims.dst, out.ctypes.data), scratchpad=scratch)
    return True


def _weights_in(call: _Call, prims: _Primitives, w, space: _Workspace):
    """The memory object of ``w`` in ``prims``' layout: reordered into ``space`` where needed."""
    plain = call.memory(prims.plain, w.ctypes.data)
    if prims.reorder is None:
        return plain
    blocked = call.memory(prims.weights, space.take(prims.weights_nbytes))
    scratch = _scratchpad(call, prims, space, prims.reorder_scratch)
    call.run(prims.reorder, src=plain, dst=blocked, scratchpad=scratch)
    return blocked


def backward(x, w, dy, dx, dw, geometry, flat) -> bool:
    """Gradients of :func:`forward` by oneDNN, if it can: dw (O, C/g, KH, KW) and, unless None,
    dx (B, H, W, C), from x and dy (B, OH, OW, O), C-contiguous float32 NumPy arrays; ``flat``
    the float32 workspace of :attr:`.conv_kernels.ConvGeometry.backward_workspace_nelems`
    elements. The bias gradient is the caller's. Returns whether it did (False: nothing
    written)."""
    shaped = [(x, geometry.in_shape), (w, geometry.weight_shape), (dy, geometry.out_shape),
              (dw, geometry.weight_shape), (flat, flat.shape)] + ([] if dx is None else [(dx, geometry.in_shape)])
    if not _usable(shaped, [dw, flat] + ([] if dx is None else [dx]), geometry):
        return False
    wprims = _primitives(geometry, "weights", False)
    dprims = None if dx is None else _primitives(geometry, "data", False)
    if wprims is None or (dx is not None and dprims is None):
        return False
    need = wprims.workspace_nbytes + (0 if dprims is None else dprims.workspace_nbytes)
    space = _Workspace(flat)
    if not space.fits(need):
        return False
    with _Call() as call:
        if dprims is not None:
            weights = _weights_in(call, dprims, w, space)
            call.run(dprims.conv, diff_dst=call.memory(dprims.dst, dy.ctypes.data), weights=weights,
                     diff_src=call.memory(dprims.src, dx.ctypes.data),
                     scratchpad=_scratchpad(call, dprims, space, dprims.scratch))
        plain = call.memory(wprims.plain, dw.ctypes.data)
        grad = plain if wprims.reorder is None else call.memory(wprims.weights, space.take(wprims.weights_nbytes))
        call.run(wprims.conv, src=call.memory(wprims.src, x.ctypes.data),
                 diff_dst=call.memory(wprims.dst, dy.ctypes.data), diff_weights=grad,
                 scratchpad=_scratchpad(call, wprims, space, wprims.scratch))
        if wprims.reorder is not None:
            call.run(wprims.reorder, src=grad, dst=plain,
                     scratchpad=_scratchpad(call, wprims, space, wprims.reorder_scratch))
    return True


def _operand(a) -> tuple | None:
    """(dims, strides in elements) of a 2-D float32 NumPy array that is C-contiguous or the
    transpose of a C-contiguous one, else None (other strides may take oneDNN's reference
    implementation, a thousand times slower)."""
    if type(a) is not np.ndarray or a.dtype != np.float32 or a.ndim != 2 or not a.flags.aligned:
        return None
    rows, cols = a.shape
    if a.flags.c_contiguous:
        return (rows, cols), (cols, 1)
    if a.flags.f_contiguous:
        return (rows, cols), (1, rows)
    return None


def matmul(a, b, out, bias=None) -> bool:
    """``out = a @ b``, plus ``bias`` on every row unless None, by oneDNN's matmul primitive if it
    can (Note [Dense products by oneDNN]): a (M, K) and b (K, N), each C-contiguous or the
    transpose of a C-contiguous array; out (M, N) C-contiguous and writeable, not overlapping a
    or b (an overlap is left to NumPy); bias (N,) C-contiguous; all aligned float32 NumPy arrays,
    with M x K x N at least
    :data:`MATMUL_MIN_MACS`. Returns whether it did (False: nothing written)."""
    src, weights = _operand(a), _operand(b)
    if src is None or weights is None or not _is_output(out) or not enabled():
        return False
    (m, k), (k2, n) = a.shape, b.shape
    if k2 != k or out.shape != (m, n) or m * k * n < MATMUL_MIN_MACS:
        return False
    if bias is not None and (type(bias) is not np.ndarray or bias.dtype != np.float32 or bias.shape != (n,)
                             or not bias.flags.c_contiguous or not bias.flags.aligned):
        return False
    pointers = [x.ctypes.data for x in (a, b, out)]
    if any(p < pointers[2] + out.nbytes and pointers[2] < p + x.nbytes for p, x in zip(pointers, (a, b))):
        return False            # out overlaps an operand: NumPy's matmul copies it first; the primitive would not
    prims = _kept(_Matmul, src, weights, bias is not None)
    if prims is None:
        return False
    prims.run(pointers + ([] if bias is None else [bias.ctypes.data]))
    return True


def _is_output(out) -> bool:
    return (type(out) is np.ndarray and out.dtype == np.float32 and out.ndim == 2 and out.flags.c_contiguous
            and out.flags.writeable and out.flags.aligned)
