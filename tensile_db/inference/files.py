"""Model files: one file per served model version, from which its layers are read on demand.

A served model's weights live on disk, not in host memory (Demand Layering's setting, Ji et al.,
arXiv 2210.04024: a fast SSD feeds the device layer by layer). The first call on a version sends
its weights from the registry once; :meth:`ModelFiles.write` writes them to the models directory
as they arrive, array by array, and later calls — and a restarted coordinator — read the file.

Layout (little-endian)::

    [0, 24)            magic b"TNSLMODL", format version (u32), body bytes (u32), body crc32 (u32),
                       reserved (u32)
    [24, 24 + body)    the body: UTF-8 JSON {"model_id", "version", "layer_count", "layers":
                       [[offset, nbytes, crc32], ...], "scaling": {"offset", "nbytes", "crc32",
                       "arrays": [[name, shape], ...]}}, crc32 as 8 hex digits
    then per layer     its arrays (``Node.weights`` order) packed as float32, the region starting
                       at a multiple of :data:`ALIGN_NBYTES` (what ``O_DIRECT`` asks of offsets)
    then scaling       ``x_mean`` / ``x_std`` / ``y_mean`` / ``y_std`` as present, packed float32

The packing of a layer is :class:`~tensile_db.inference.store.ServedModel`'s (its ``split``), so a
region is read as it is into the layer's arena block. Every region carries a CRC-32 of its bytes,
verified on every read (:meth:`ModelFile.read_into`); a mismatch raises CorruptModel naming the
model, version, layer and file, marks the file corrupt and deletes it, and the store then forgets
the model so that the backend sends the weights again (:mod:`tensile_db.inference.service`).

Writing is atomic: a temporary file in the same directory (``.tmp-*``), each array written at its
place as it arrives and checked (:func:`~tensile_db.runtime.weights.check_declared` on what the
message declares, before any byte is written; :func:`~tensile_db.runtime.weights.check_array` on
each array), the header last, ``fsync``, then :meth:`ModelFiles.commit` renames it to its name and
``fsync`` s the directory. An error removes the temporary file; a crash leaves one that the next
:class:`ModelFiles` removes. A file's name is a hash of the model's id and version, never user
text; the header repeats both and a file whose header does not match what it is opened for is
refused.

Note [Layer I/O]: a layer is read with ``os.preadv`` at its region's offset, from a file opened
with ``O_DIRECT`` (buffered where the file system refuses it: tmpfs answers ``EINVAL``), straight
into the caller's buffer (the arena block on ``cpu``) when that is aligned to what the disk
accepts (512 or 4096 bytes, probed when the file is opened by
:func:`~tensile_db.memory.spill.direct_alignment`, the rule spill files follow too), the
unaligned tail (or a whole unaligned buffer, in pieces of at most :data:`BOUNCE_NBYTES`) through
a page-aligned bounce buffer mapped for that read only; then ``zlib.crc32`` over the buffer. A
file whose direct reads are refused after all is read buffered from then on. Chosen by ``python bench/layer_io.py --repeats 5`` (as root, so the
page cache is dropped for the cold runs; 20 layers of 32 MiB read in order, each verified, 5
interleaved runs, medians [min, max], ext4 on this project's virtual disk, 2 cores)::

    page cache  method    checksum   GB/s   range           ms / layer
    cold        buffered  crc32      0.52   [0.44, 1.66]    64.8
    cold        direct    crc32      0.94   [0.77, 1.06]    35.5
    cold        mmap      crc32      0.03   [0.03, 0.03]    997
    cold        direct    blake2b    0.50   [0.49, 0.59]    67.6
    cold        direct    none       1.21   [1.14, 1.34]    27.7
    warm        buffered  crc32      4.34   [3.33, 4.60]     7.7
    warm        direct    crc32      1.00   [0.86, 1.11]    33.5
    warm        mmap      crc32      3.03   [2.93, 3.08]    11.1

    checksum alone in memory: crc32 5.8 GB/s, blake2b 1.0 GB/s

With the model on disk (cold), direct reads are the fastest and by far the steadiest (a second
run of 7 repeats: direct 0.79 [0.67, 0.85] GB/s, buffered 0.83 [0.39, 1.67]); ``mmap`` faults
page by page and is thirty times slower. Buffered and ``mmap`` win only when the page cache
already holds the model, i.e. when the kernel keeps the whole model in RAM, which is the memory
this design exists not to use (and which no budget of ours counts). CRC-32 is six times faster
than BLAKE2b and detects every burst of up to 32 bits and random damage with probability
1 - 2**-32: enough to detect corruption (the files are in a 0700 directory; this is not a defence
against an attacker who can write them).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import struct
import tempfile
import threading
import weakref
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import CorruptModel, TensileError
from ..memory.spill import ALIGN_NBYTES, direct_alignment  # regions start at ALIGN_NBYTES
from ..runtime import model as models
from ..runtime.units import round_up
from ..runtime.weights import check_array, check_declared, weight_shapes

log = logging.getLogger(__name__)

MAGIC = b"TNSLMODL"
FORMAT_VERSION = 1
#: Most bytes of the page-aligned bounce buffer a read of an unaligned buffer maps, bytes.
BOUNCE_NBYTES = 8 << 20
#: Longest header body accepted when a file is opened, bytes.
MAX_BODY_NBYTES = 16 << 20
SUFFIX = ".model"
TEMP_PREFIX = ".tmp-"
#: The fixed start of a model file: magic, format version, body bytes, body crc32, reserved.
PREFIX = struct.Struct("<8sIIII")       # magic, format version, body bytes, body crc32, reserved
_SCALING = ("x_mean", "x_std", "y_mean", "y_std")


def file_name(model_id: int, version: str) -> str:
    """The file name of a model version: a SHA-256 of its id and version (no user text)."""
    return hashlib.sha256(f"{int(model_id)}\n{version}".encode()).hexdigest() + SUFFIX


@dataclass(frozen=True)
class Region:
    """A stretch of a model file: where it starts and its bytes, and the CRC-32 of those bytes."""

    offset: int                 # bytes, a multiple of ALIGN_NBYTES
    nbytes: int
    crc32: int = 0


class Layout:
    """Where every array of a model goes in its file: ``places[name] = (region, byte offset in
    it)``, region ``L`` being the scaling region; ``regions[i]`` (offset, bytes) of layer ``i``
    and, last, of the scaling; ``header_nbytes`` the header's room."""

    def __init__(self, spec: models.ModelSpec, model_id: int, version: str, scaling: list[tuple[str, tuple]]):
        nodes = spec.network.layered
        self.places: dict[str, tuple[int, int]] = {}
        sizes = []
        for i, node in enumerate(nodes):
            at = 0
            for key, shape in node.weights.items():
                self.places[key] = (i, at)
                at += math.prod(shape) * 4
            sizes.append(at)
        at = 0
        for key, shape in scaling:
            self.places[key] = (len(nodes), at)
            at += math.prod(shape) * 4
        sizes.append(at)
        self.model_id, self.version, self.scaling = int(model_id), version, scaling
        self.header_nbytes = ALIGN_NBYTES
        while True:                 # the body names the offsets, which follow the header: settle both
            self.regions = []
            offset = self.header_nbytes
            for nbytes in sizes:
                self.regions.append(Region(offset, nbytes))
                offset += round_up(max(nbytes, 1), ALIGN_NBYTES)
            self.end_nbytes = offset
            need = round_up(PREFIX.size + len(self.body()), ALIGN_NBYTES)
            if need <= self.header_nbytes:
                return
            self.header_nbytes = need

    def body(self, crcs: list[int] | None = None) -> bytes:
        """The header's JSON body with the regions' checksums ``crcs`` (placeholders without)."""
        crcs = crcs or [0] * len(self.regions)
        rows = [[r.offset, r.nbytes, f"{c:08x}"] for r, c in zip(self.regions, crcs)]
        return json.dumps({"model_id": self.model_id, "version": self.version, "layer_count": len(rows) - 1,
                           "layers": rows[:-1],
                           "scaling": {"offset": rows[-1][0], "nbytes": rows[-1][1], "crc32": rows[-1][2],
                                       "arrays": [[k, list(s)] for k, s in self.scaling]}},
                          separators=(",", ":")).encode()

    def header(self, crcs: list[int]) -> bytes:
        body = self.body(crcs)
        return PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body), 0) + body


_bounce_lock = threading.Lock()
_bounce_nbytes = 0                   # bytes of the bounce buffers of reads in progress; guarded by _bounce_lock


@contextlib.contextmanager
def _bounce_buffer(nbytes: int):
    """A page-aligned buffer of at least ``nbytes`` (at most :data:`BOUNCE_NBYTES`) for one read."""
    global _bounce_nbytes
    size = round_up(min(max(nbytes, 1), BOUNCE_NBYTES), ALIGN_NBYTES)
    with _bounce_lock:
        _bounce_nbytes += size
    try:
        yield memoryview(mmap.mmap(-1, size))      # unmapped when the last view of it goes
    finally:
        with _bounce_lock:
            _bounce_nbytes -= size


def bounce_nbytes() -> int:
    """Host bytes of the bounce buffers of the reads in progress, bytes."""
    with _bounce_lock:
        return _bounce_nbytes


class ModelFile:
    """An open, verified model file (see the module docstring). ``layers[i]``: layer ``i``'s
    region; ``scaling``: the model's ``x_mean`` / ``x_std`` (F,) and, for regression, ``y_mean``
    / ``y_std`` (1,) float32; ``nbytes``: the file's size in bytes. Reads are thread-safe
    (explicit offsets, no shared file position). ``corrupt`` is set once a read found a bad
    checksum (it is never cleared: the file is deleted)."""

    def __init__(self, files: ModelFiles, path: str, fd: int, direct: bool, name: str, version: str,
                 layers: list[Region], scaling: dict[str, np.ndarray]):
        self.files, self.path, self.name, self.version = files, path, name, version
        self.layers, self.scaling = layers, scaling
        self.direct, self.align_nbytes = direct, 1     # direct reads, and the alignment they need, bytes
        if direct:
            self.align_nbytes = direct_alignment(fd, write=False)
            if not self.align_nbytes:               # direct reads refused whatever the alignment
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct, self.align_nbytes = False, 1
        st = os.fstat(fd)
        self.nbytes, self.identity = st.st_size, (st.st_dev, st.st_ino)
        self.corrupt = False
        self._fd = fd                      # closed by close() only, once no read can run

    def source(self, i: int) -> LayerSource:
        """Layer ``i`` as a source of values for :meth:`MemoryManager.adopt_source`."""
        return LayerSource(self, i)

    def read_into(self, i: int, out: np.ndarray) -> None:
        """Fill ``out`` (C-contiguous 1-D uint8 of ``layers[i].nbytes`` bytes) with layer ``i``
        and verify its checksum. Raises CorruptModel (naming the model, version, layer and file)
        on a checksum mismatch, a short file or an I/O error; the file is then deleted."""
        region = self.layers[i]
        assert out.dtype == np.uint8 and out.ndim == 1 and out.nbytes == region.nbytes and out.flags.c_contiguous
        view = memoryview(out)
        try:
            self._read(view, region.offset)
        except OSError as exc:
            raise self._corrupt(i, f"it cannot be read ({exc.strerror or exc})") from None
        crc = zlib.crc32(view)
        if crc != region.crc32:
            raise self._corrupt(i, f"its checksum is {crc:08x}, the header says {region.crc32:08x}")

    def close(self) -> None:
        """Close the file (it stays on disk)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _read(self, view: memoryview, offset: int) -> None:
        """Read ``len(view)`` bytes at ``offset`` into ``view`` (Note [Layer I/O])."""
        n = len(view)
        if not self.direct:
            self._all(view, offset, n)
            return
        try:
            self._read_direct(view, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # Refused at the probed alignment after all: read this file buffered.
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            log.info("%s: O_DIRECT refused a %d-byte-aligned read; reading it buffered", self.path, self.align_nbytes)
            self._all(view, offset, n)

    def _read_direct(self, view: memoryview, offset: int) -> None:
        n = len(view)
        address = np.frombuffer(view, np.uint8).ctypes.data if n else 0
        align = self.align_nbytes
        start = n - n % align if address % align == 0 else 0
        self._all(view[:start], offset, start)
        if start == n:
            return
        with _bounce_buffer(n - start) as bounce:     # the tail, or everything when unaligned
            while start < n:
                part = min(len(bounce), n - start)
                self._all(bounce[:round_up(part, align)], offset + start, part)
                view[start:start + part] = bounce[:part]
                start += part

    def _all(self, view: memoryview, offset: int, need: int) -> None:
        done = 0
        while done < need:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"the file ends {offset + done:,} bytes in, {need - done:,} bytes short")
            done += got

    def _corrupt(self, i: int, why: str) -> CorruptModel:
        self.corrupt = True
        self.files.remove(self)
        log.warning("model %r version %s: layer %d of %s is corrupt (%s); deleted", self.name, self.version, i,
                    self.path, why)
        return CorruptModel(f"model {self.name!r} (version {self.version}): layer {i} in its file {self.path} is "
                            f"corrupt: {why}; the file was deleted and the weights are read again from "
                            "tensile.models")


class LayerSource:
    """One layer of a :class:`ModelFile`, as :meth:`MemoryManager.adopt_source` takes it."""

    def __init__(self, file: ModelFile, i: int):
        self.file, self.i = file, i
        self.nbytes = file.layers[i].nbytes

    def read_into(self, out: np.ndarray) -> None:
        """See :meth:`ModelFile.read_into`."""
        self.file.read_into(self.i, out)


@dataclass
class Pending:
    """A model file written and synced under a temporary name, not yet committed."""

    path: str
    model_id: int
    version: str
    name: str


class ModelFiles:
    """The models directory: one file per model version (see the module docstring). One
    ``ModelFiles`` per directory at a time (the coordinator's lock sees to it): it removes the
    temporary files a crash left when it starts. ``directory`` None: a private temporary
    directory, removed with this object. Thread-safe."""

    def __init__(self, directory: str | None = None):
        if directory is None:
            directory = tempfile.mkdtemp(prefix="tensile-models-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, directory, True)
        self.directory = directory
        self._lock = threading.Lock()      # serialises renames and removals, so a removal never takes a newer file
        for entry in os.scandir(directory):
            if entry.name.startswith(TEMP_PREFIX) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                log.info("removed %s, a model file a crash left half-written", entry.path)

    def path(self, model_id: int, version: str) -> str:
        return os.path.join(self.directory, file_name(model_id, version))

    def listing(self) -> list[tuple[str, int]]:
        """(path, bytes) of every model file in the directory, least recently modified first."""
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith(TEMP_PREFIX):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, entry.path, st.st_size))
        return [(path, nbytes) for _, path, nbytes in sorted(found)]

    def write(self, model_id: int, version: str, name: str, spec: models.ModelSpec, weights) -> Pending:
        """Write a model's weights to a temporary file, array by array as ``weights`` yields them,
        and sync it; :meth:`commit` gives it its name. ``weights``: a mapping of name -> array,
        or an object with ``declared`` ((name, dtype, shape) of every array, before any is read)
        that yields ``(name, array)`` pairs (:class:`tensile_db.coordinator.protocol.ArrayStream`).
        At most one array is held at a time (as float32, if it came in another float dtype).

        Raises CorruptModel, before anything is written, for an array that is missing, extra,
        repeated, misshapen or not of a float dtype, and for one with NaN or infinite values as
        it arrives; the temporary file is removed on every error."""
        if isinstance(weights, Mapping):
            declared = [(k, np.asarray(a).dtype, np.shape(a)) for k, a in weights.items()]
            arrays: Iterable = weights.items()
        else:
            declared, arrays = list(weights.declared), weights
        shapes = check_declared(spec, declared, name)
        layout = Layout(spec, model_id, version, [(k, shapes[k]) for k in _SCALING if k in shapes])
        fd, path = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=SUFFIX, dir=self.directory)
        try:
            crcs: list[int | None] = [0] * len(layout.regions)
            filled = [0] * len(layout.regions)        # bytes written in order from each region's start
            written = [0] * len(layout.regions)       # bytes written into each region
            for key, a in arrays:
                if key not in layout.places:
                    raise CorruptModel(f"model {name!r}: weight {key!r} arrived, which its weights did not declare")
                a = np.ascontiguousarray(check_array(key, a, name))
                region, at = layout.places[key]
                data = memoryview(a.reshape(-1).view(np.uint8))
                _pwrite_all(fd, data, layout.regions[region].offset + at)
                written[region] += len(data)
                if crcs[region] is not None and at == filled[region]:
                    crcs[region] = zlib.crc32(data, crcs[region])
                    filled[region] += len(data)
                else:                                  # out of order: checksummed from the file below
                    crcs[region] = None
                del a, data
            for r, region in enumerate(layout.regions):
                if written[r] != region.nbytes:           # a stream that ended early
                    raise CorruptModel(f"model {name!r}: {written[r]:,} of the {region.nbytes:,} bytes of "
                                       f"{'its scaling' if r == len(layout.regions) - 1 else f'layer {r}'} arrived")
                if crcs[r] is None:
                    crcs[r] = _file_crc(fd, region)
            _pwrite_all(fd, memoryview(layout.header(crcs)), 0)
            os.ftruncate(fd, layout.end_nbytes)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)     # on disk now: no need to keep it in RAM too
        except BaseException as exc:
            os.close(fd)
            os.unlink(path)
            if isinstance(exc, OSError):        # a full disk: said, not taken for a closed connection
                raise TensileError(f"cannot write model file {path}: {exc.strerror or exc}; free space in "
                                   f"{self.directory} or remove old model files there") from None
            raise
        os.close(fd)
        return Pending(path, int(model_id), version, name)

    def commit(self, pending: Pending, spec: models.ModelSpec) -> ModelFile:
        """Give a written file its name (replacing any file of that name), sync the directory and
        open the file. Raises TensileError if it cannot be read back."""
        final = self.path(pending.model_id, pending.version)
        with self._lock:
            try:
                os.rename(pending.path, final)
                _fsync_dir(self.directory)
            except OSError as exc:
                raise TensileError(f"cannot store model file {final}: {exc.strerror or exc}") from None
        file = self.open(pending.model_id, pending.version, pending.name, spec)
        if file is None:
            raise TensileError(f"model file {final} was written but could not be read back; see the coordinator's log")
        return file

    def discard(self, pending: Pending) -> None:
        """Remove a written file that is not to be committed."""
        os.unlink(pending.path)

    def open(self, model_id: int, version: str, name: str, spec: models.ModelSpec) -> ModelFile | None:
        """The model's file, opened and its header checked against ``spec``; None when there is
        none. A file whose header is damaged or does not match is deleted (logged), and None."""
        path = self.path(model_id, version)
        try:
            fd, direct = _open_direct(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TensileError(f"cannot open model file {path}: {exc.strerror or exc}") from None
        try:
            layers, scaling = _read_header(fd, path, int(model_id), version, spec)
            return ModelFile(self, path, fd, direct, name, version, layers, scaling)
        except CorruptModel as exc:
            os.close(fd)
            log.warning("%s; deleted", exc)
            self.remove_path(path)
            return None
        except BaseException:
            os.close(fd)
            raise

    def remove(self, file: ModelFile) -> None:
        """Delete ``file`` from the directory, unless its name now holds a newer file."""
        self.remove_path(file.path, file.identity)

    def remove_path(self, path: str, identity: tuple[int, int] | None = None) -> None:
        """Delete the model file ``path`` (only if it is the file ``identity``, (device, inode),
        when given); a missing file is no error."""
        with self._lock:
            try:
                st = os.stat(path)
                if identity is None or (st.st_dev, st.st_ino) == identity:
                    os.unlink(path)
            except FileNotFoundError:
                pass


def _open_direct(path: str) -> tuple[int, bool]:
    """``(fd, direct)``: ``path`` opened read-only with ``O_DIRECT`` where the file system takes it."""
    flags = os.O_RDONLY | os.O_CLOEXEC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags), False


def _pread_exact(fd: int, offset: int, nbytes: int) -> bytes:
    """``nbytes`` at ``offset``, read through a page-aligned buffer (``fd`` may be ``O_DIRECT``).
    Raises EOFError when the file ends before."""
    start = offset - offset % ALIGN_NBYTES
    need = offset + nbytes - start
    with mmap.mmap(-1, round_up(max(need, 1), ALIGN_NBYTES)) as buf:
        view, done = memoryview(buf), 0
        while done < need:
            got = os.preadv(fd, [view[done:]], start + done)
            if got <= 0:
                view.release()
                raise EOFError
            done += got
        out = bytes(view[offset - start:need])
        view.release()
    return out


def _read_header(fd: int, path: str, model_id: int, version: str, spec: models.ModelSpec):
    """The layers' regions and the scaling arrays of the file ``fd``, checked against the model
    it is opened for. Raises CorruptModel saying what does not match."""
    def bad(what: str) -> CorruptModel:
        return CorruptModel(f"model file {path} is not usable: {what}")

    size = os.fstat(fd).st_size
    body_nbytes, body = _header_body(fd, size, bad)
    try:
        head = json.loads(body)
        layers = [Region(int(o), int(n), int(c, 16)) for o, n, c in head["layers"]]
        s = head["scaling"]
        scaling_region = Region(int(s["offset"]), int(s["nbytes"]), int(s["crc32"], 16))
        scaling_shapes = [(str(k), tuple(int(d) for d in shape)) for k, shape in s["arrays"]]
        layer_count, got_id, got_version = int(head["layer_count"]), int(head["model_id"]), str(head["version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise bad(f"its header cannot be read ({exc!r})") from None
    if (got_id, got_version) != (model_id, version):
        raise bad(f"it holds model {got_id} version {got_version!r}, not {model_id} version {version!r}")
    nodes = spec.network.layered
    if layer_count != len(layers) or len(layers) != len(nodes):
        raise bad(f"it holds {len(layers)} layers, the architecture has {len(nodes)}")
    for i, (region, node) in enumerate(zip(layers, nodes)):
        expected = sum(math.prod(shape) for shape in node.weights.values()) * 4
        if region.nbytes != expected:
            raise bad(f"layer {i} holds {region.nbytes:,} bytes, the architecture says {expected:,}")
    end = PREFIX.size + body_nbytes
    for region in [*layers, scaling_region]:
        if region.offset % ALIGN_NBYTES or region.offset < end or region.offset + region.nbytes > size:
            raise bad(f"a region at {region.offset:,} of {region.nbytes:,} bytes lies outside its place")
        end = region.offset + region.nbytes
    return layers, _read_scaling(fd, scaling_region, scaling_shapes, spec, bad)


def _header_body(fd: int, size: int, bad) -> tuple[int, bytes]:
    """(bytes, contents) of the header's JSON body of the file ``fd`` of ``size`` bytes, its
    magic, format and checksum checked; ``bad(what)`` makes the error raised."""
    try:
        magic, fmt, body_nbytes, body_crc, _ = PREFIX.unpack(_pread_exact(fd, 0, PREFIX.size))
        if magic != MAGIC or fmt != FORMAT_VERSION:
            raise bad(f"magic {magic!r}, format {fmt} (expected {MAGIC!r}, {FORMAT_VERSION})")
        if body_nbytes > min(MAX_BODY_NBYTES, size):
            raise bad(f"its header claims {body_nbytes:,} bytes")
        body = _pread_exact(fd, PREFIX.size, body_nbytes)
    except EOFError:
        raise bad(f"it ends after {size:,} bytes") from None
    if zlib.crc32(body) != body_crc:
        raise bad("its header's checksum does not match")
    return body_nbytes, body


def _read_scaling(fd: int, region: Region, shapes: list, spec: models.ModelSpec, bad) -> dict[str, np.ndarray]:
    """The scaling arrays (float32, of ``shapes``) in ``region`` of the file ``fd``, checked
    against ``spec`` and the region's checksum; ``bad(what)`` makes the error raised."""
    expected = {k: v for k, v in weight_shapes(spec, [k for k, _ in shapes]).items() if k in _SCALING}
    if dict(shapes) != expected or region.nbytes != sum(math.prod(shape) * 4 for _, shape in shapes):
        raise bad(f"its scaling arrays {shapes} do not fit the model")
    try:
        data = _pread_exact(fd, region.offset, region.nbytes)
    except EOFError:
        raise bad("its scaling region is cut short") from None
    if zlib.crc32(data) != region.crc32:
        raise bad("its scaling region's checksum does not match")
    scaling, at = {}, 0
    for key, shape in shapes:
        numel = math.prod(shape)
        scaling[key] = np.frombuffer(data, np.float32, numel, at).reshape(shape).copy()
        at += numel * 4
    return scaling


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _file_crc(fd: int, region: Region, chunk_nbytes: int = 8 << 20) -> int:
    """CRC-32 of ``region`` read back from the (buffered) file ``fd``."""
    crc = 0
    for start in range(0, region.nbytes, chunk_nbytes):
        n = min(chunk_nbytes, region.nbytes - start)
        data = os.pread(fd, n, region.offset + start)
        if len(data) != n:
            raise TensileError(f"a model file being written ended early at {region.offset + start:,}")
        crc = zlib.crc32(data, crc)
    return crc


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
