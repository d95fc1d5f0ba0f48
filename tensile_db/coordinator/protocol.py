"""The coordinator wire protocol.

Transport: ``multiprocessing.connection`` over a Unix socket in a 0700 directory, using its
``send_bytes`` / ``recv_bytes`` (its ``send`` / ``recv`` would pickle; nothing here unpickles).
A message is one frame holding a UTF-8 JSON header, followed by one frame of raw bytes for each
array the header lists under ``"arrays"`` as ``{"name", "dtype", "shape"}``, or by one shared
memory file holding them all (Note [Shared arrays]). Only boolean, integer and floating dtypes are
accepted. A receiver may take a message's arrays one frame at a time (:func:`recv_stream`), so
that a large message (a model's weights) never sits whole in its memory. Errors travel as
``{"type": "error", "error": <class name>, "message": ...}`` and are raised again on the other
side as the same :mod:`tensile_db.errors` class.

Note [Shared arrays]
--------------------
Rationale: a training call's rows (68 MB for a million rows of 16 real columns and a label) went
through the socket in frames: copied into the kernel by the sender, out of it in chunks by the
receiver and once more into one ``bytes`` (0.08 s for 68 MB here), a wait before training starts.

Approach: where the arrays of a message (held in memory) come to :data:`SHARED_MIN_NBYTES` or
more, the connection is a Unix socket on Linux and the other end has said that it takes them
(:func:`accept_shared`), the sender writes them, each at an offset aligned to
:data:`SHARED_ALIGN` bytes, into an anonymous memory file (``memfd_create``), seals it against
writes, shrinking and growing (``F_ADD_SEALS``), sends the header with the offsets and the file's
bytes under ``"shared"``, and then the file's descriptor (``SCM_RIGHTS``). The receiver takes
exactly one descriptor, checks the seals and the size, maps the file read-only and views each
array in the mapping. A sealed file cannot change under the receiver's views nor shrink under them
(which would fault its process). A sender that cannot make the file (no memory for it) sends
frames. Which ends take shared arrays: a backend says so in every request
(``"accepts_shared": true``), and before its first large request asks the coordinator with a
``ping``, whose ``pong`` says so; so a coordinator or a backend of an earlier version, which
would wait for frames, only ever gets frames.

Arrays that already lie in a sealed memory file go as they are: the backend's scan writes a
table's rows into a memory file (:mod:`tensile_db.pg.scan`), seals it once the scan has ended and
maps it read-only through :func:`map_sealed`, which records the mapping. An array of a message
that lies wholly in such a mapping is sent as its offset in that file, which is passed besides the
message's own file of the other arrays: a message then has two files, and ``shared`` lists
``nbytes`` per file and, per array, the file it lies in (``files``). The receiver maps of each
file only the span its arrays cover. Only an end that has said it takes two files
(:func:`accept_shared`) gets them; to any other, those arrays are copied as the rest. A million
rows of 16 real columns then reach the coordinator with no copy at all (the scan's own pages).

Limitations: Linux only (elsewhere, frames); the sender holds its arrays and the file's copy of
them until it has sent the message (68 MB more for a million rows; the file's pages do not count
in the sender's ``VmHWM``); the receiver's mapping lives as long as any of its arrays; a scan
file passed whole lets the coordinator read every column of that scan, which it may anyway (it
runs as the server's user).
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import math
import mmap
import os
import socket
import stat
import weakref

import numpy as np

from ..errors import WIRE_ERRORS, DeviceOutOfMemory, ProtocolError, TensileError
from ..runtime.units import round_up

_ALLOWED_KINDS = "biuf"
#: A message's in-memory arrays of at least this many bytes together go in a shared memory file
#: (Note [Shared arrays]).
SHARED_MIN_NBYTES = 1 << 20
#: Byte alignment of each array in a shared memory file.
SHARED_ALIGN = 64
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE if hasattr(
    fcntl, "F_SEAL_WRITE") else 0
#: Shared memory files a message may have at most: its own and a sealed one its arrays lie in.
MAX_SHARED_FILES = 2
#: The connections whose other end takes shared arrays (Note [Shared arrays]).
_SHARING: weakref.WeakSet = weakref.WeakSet()
#: ... and of those, the ends that take a message's arrays in two files
_TWO_FILES: weakref.WeakSet = weakref.WeakSet()
#: The live mappings of sealed files (:func:`map_sealed`): key -> (the mapping, weakly; a
#: descriptor of the file; the mapping's address; its bytes).
_SEALED: dict[int, tuple[weakref.ref, int, int, int]] = {}
_sealed_keys = itertools.count()

log = logging.getLogger(__name__)


def accept_shared(conn, files: int = 1) -> None:
    """Record that the other end of ``conn`` takes shared arrays (Note [Shared arrays]), in up to
    ``files`` memory files a message."""
    _SHARING.add(conn)
    if files >= MAX_SHARED_FILES:
        _TWO_FILES.add(conn)


def map_sealed(fd: int) -> mmap.mmap:
    """Seal the memory file ``fd`` (made with ``MFD_ALLOW_SEALING``, not mapped writeable) against
    writes, shrinking and growing, and map it whole, read-only. Arrays that lie in the mapping go
    to an end that takes two files without a copy (Note [Shared arrays]); the mapping keeps a
    descriptor of the file for that, closed when the mapping goes. The caller still closes
    ``fd``. Raises OSError where the file cannot be sealed or mapped (empty, no sealing)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    nbytes = os.fstat(fd).st_size
    mapping = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    key = next(_sealed_keys)
    _SEALED[key] = (weakref.ref(mapping), os.dup(fd), np.frombuffer(mapping, np.uint8).ctypes.data, nbytes)
    weakref.finalize(mapping, _forget_sealed, key)
    return mapping


def _forget_sealed(key: int) -> None:
    os.close(_SEALED.pop(key)[1])


def _in_sealed(a: np.ndarray) -> tuple[int, int, int] | None:
    """``(descriptor, offset, the file's bytes)`` of the sealed file whose mapping, open, holds
    all of ``a`` (C-contiguous, not empty), or None."""
    if not a.size or not a.flags.c_contiguous:
        return None
    start = a.ctypes.data
    for ref, fd, address, nbytes in list(_SEALED.values()):
        mapping = ref()
        if mapping is not None and not mapping.closed and address <= start and start + a.nbytes <= address + nbytes:
            return fd, start - address, nbytes
    return None


def large(arrays) -> bool:
    """Whether ``arrays`` (a dict of arrays held in memory) together are large enough to go in a
    shared memory file (:data:`SHARED_MIN_NBYTES`; Note [Shared arrays])."""
    return isinstance(arrays, dict) and sum(np.asarray(a).nbytes for a in arrays.values()) >= SHARED_MIN_NBYTES


def _unix_socket(conn) -> socket.socket:
    """A socket object on a duplicate of ``conn``'s descriptor, for its ancillary data (closing it
    leaves ``conn`` open)."""
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))


def send(conn, header: dict, arrays=None) -> None:
    """Send a header and named arrays (C-contiguous copies are made where needed). ``arrays``
    is a dict, or a mapping with ``meta(name) -> (dtype, shape)`` whose arrays are then read one
    at a time as they are sent (a job's weights in a spill file), so they are never all in
    memory at once. In-memory arrays of :data:`SHARED_MIN_NBYTES` or more go in a shared
    memory file where the other end takes them (Note [Shared arrays]), else in frames. Raises
    ProtocolError, before anything is written, for an array of an unsupported dtype; OSError
    when the connection fails."""
    arrays = arrays or {}
    lazy = hasattr(arrays, "meta")
    if not lazy:
        arrays = {k: np.asarray(v, order="C") for k, v in arrays.items()}  # keeps 0-d shapes
    metas = {k: arrays.meta(k) if lazy else (arrays[k].dtype, arrays[k].shape) for k in arrays}
    for name, (dtype, _) in metas.items():
        if np.dtype(dtype).kind not in _ALLOWED_KINDS:
            raise ProtocolError(f"array {name!r} has unsupported dtype {dtype}")
    header = dict(header, arrays=[{"name": k, "dtype": np.dtype(dtype).str, "shape": list(shape)}
                                  for k, (dtype, shape) in metas.items()])
    if not lazy and _can_share(conn):
        sealed, at = _lying_in_sealed(arrays) if conn in _TWO_FILES else (None, {})
        if (at or large(arrays)) and _send_shared(conn, header, arrays, sealed, at):
            return
    conn.send_bytes(json.dumps(header).encode())
    for k in metas:
        a = np.asarray(arrays[k], order="C")
        conn.send_bytes(a.reshape(-1).view(np.uint8) if a.size else b"")


def _lying_in_sealed(arrays: dict[str, np.ndarray]) -> tuple[tuple[int, int] | None, dict[str, int]]:
    """The sealed file (its descriptor and bytes) the first of ``arrays`` that lies in one lies
    in, and the offset there of each of them that lies in that same file (Note [Shared
    arrays])."""
    sealed, at = None, {}
    for name, a in arrays.items():
        where = _in_sealed(a)
        if where is not None and (sealed is None or where[0] == sealed[0]):
            sealed, at[name] = (where[0], where[2]), where[1]
    return sealed, at


def _send_shared(conn, header: dict, arrays: dict[str, np.ndarray], sealed: tuple[int, int] | None,
                 at: dict[str, int]) -> bool:
    """Send ``header`` and ``arrays`` in shared memory files (Note [Shared arrays]): those named
    in ``at`` by their offset in the ``sealed`` file, the others written into a file of the
    message's own. Returns False, having sent nothing, where that file cannot be made."""
    rest = [a for name, a in arrays.items() if name not in at]
    own = _shared_file(rest) if rest or not at else (None, 0, [])
    if own is None:
        return False
    fd, nbytes, offsets = own
    if at:                                   # the sealed file last, after the message's own if any
        files = ([fd] if fd is not None else []) + [sealed[0]]
        rest_offsets = iter(offsets)
        description = {"nbytes": ([nbytes] if fd is not None else []) + [sealed[1]],
                       "offsets": [at[name] if name in at else next(rest_offsets) for name in arrays],
                       "files": [len(files) - 1 if name in at else 0 for name in arrays]}
    else:
        files, description = [fd], {"nbytes": nbytes, "offsets": offsets}
    try:
        conn.send_bytes(json.dumps(dict(header, shared=description)).encode())
        with _unix_socket(conn) as sock:
            socket.send_fds(sock, [b"F"], files)
    finally:
        if fd is not None:
            os.close(fd)
    return True


def _can_share(conn) -> bool:
    """Whether arrays may go to the other end of ``conn`` in a shared memory file."""
    try:
        return (bool(_SEALS) and hasattr(os, "memfd_create") and conn in _SHARING
                and stat.S_ISSOCK(os.fstat(conn.fileno()).st_mode))
    except (AttributeError, OSError, ValueError):
        return False


def _shared_file(arrays: list[np.ndarray]) -> tuple[int, int, list[int]] | None:
    """A sealed memory file holding ``arrays`` (Note [Shared arrays]): its descriptor (the
    caller closes it), its bytes and each array's offset; None, with nothing left open, when it
    cannot be made (the caller sends frames)."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end = round_up(end + a.nbytes, SHARED_ALIGN)
    try:
        fd = os.memfd_create("tensile-arrays", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        log.warning("arrays go in frames: no shared memory file (%s)", exc)
        return None
    try:
        os.ftruncate(fd, end)
        for a, offset in zip(arrays, offsets):
            data = memoryview(a.reshape(-1).view(np.uint8))
            while len(data):
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError as exc:
        os.close(fd)
        log.warning("arrays go in frames: the shared memory file of %d bytes failed (%s)", end, exc)
        return None
    return fd, end, offsets


def recv(conn) -> tuple[dict, dict[str, np.ndarray]]:
    """Receive one message: ``(header, arrays)``. Raises ProtocolError on a malformed message
    and EOFError when the peer has closed."""
    header, stream = recv_stream(conn)
    with stream:                # a malformed array still leaves the connection at the next message
        return header, dict(stream)


def recv_stream(conn) -> tuple[dict, ArrayStream]:
    """Receive one message's header, and its arrays as an :class:`ArrayStream` that receives
    them one frame at a time (or views them in the message's shared memory file, Note [Shared
    arrays]): the caller must consume it, or leave its ``with`` block (which receives and drops
    what is left), before the next message. Raises ProtocolError on a malformed header, array
    description or shared file, and EOFError when the peer has closed."""
    try:
        header = json.loads(conn.recv_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed message header: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("message header must be a JSON object with a string 'type'")
    shared = header.pop("shared", None)
    fds = [] if shared is None else _receive_fds(conn)       # first: the connection stays in step
    try:
        declared = _declared(header)
        views = None if shared is None else _map_shared(fds, shared, declared)
    finally:
        for fd in fds:
            os.close(fd)
    return header, ArrayStream(conn, declared, views)


def _declared(header: dict) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The arrays a header lists, as ``(name, dtype, shape)``; raises ProtocolError for a
    malformed or refused description."""
    declared = []
    for meta in header.pop("arrays", []):
        try:
            name, dtype, shape = str(meta["name"]), np.dtype(meta["dtype"]), tuple(int(d) for d in meta["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed array description {meta!r}: {exc}") from None
        if dtype.kind not in _ALLOWED_KINDS or any(d < 0 for d in shape):
            raise ProtocolError(f"array {name!r} has unsupported dtype {dtype} or shape {shape}")
        declared.append((name, dtype, shape))
    return declared


def _receive_fds(conn) -> list[int]:
    """The descriptors that follow on ``conn`` (Note [Shared arrays]): one or two. Raises
    ProtocolError, having closed them, when there are none or more (EOFError when the peer has
    closed)."""
    with _unix_socket(conn) as sock:
        message, fds, _, _ = socket.recv_fds(sock, 1, MAX_SHARED_FILES + 2, socket.MSG_CMSG_CLOEXEC)
    if not message and not fds:
        raise EOFError
    if message != b"F" or not 1 <= len(fds) <= MAX_SHARED_FILES:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"a shared arrays' message came with {len(fds)} descriptors, not one or two")
    return fds


def _map_shared(fds: list[int], shared, declared: list) -> list[np.ndarray]:
    """The arrays ``declared`` in the shared memory files ``fds`` (Note [Shared arrays]), as
    read-only views of a mapping of each file's span that they cover. Raises ProtocolError for a
    description that is malformed or names other files than came, a file that is not a sealed
    memory file of the bytes declared, or an array outside its file."""
    try:
        single = not isinstance(shared["nbytes"], list)
        nbytes = [int(shared["nbytes"])] if single else [int(n) for n in shared["nbytes"]]
        offsets = [int(o) for o in shared["offsets"]]
        files = [0] * len(offsets) if single else [int(f) for f in shared["files"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed shared arrays {shared!r}: {exc}") from None
    if len(nbytes) != len(fds) or len(offsets) != len(declared) or len(files) != len(declared) \
            or any(not 0 <= f < len(fds) for f in files):
        raise ProtocolError(f"{len(offsets)} offsets in {len(nbytes)} files for {len(declared)} shared arrays "
                            f"that came in {len(fds)} files")
    for fd, size in zip(fds, nbytes):
        try:
            sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS == _SEALS and os.fstat(fd).st_size == size
        except OSError:                                  # not a memory file
            sealed = False
        if not sealed:
            raise ProtocolError(f"the shared arrays' file is not a sealed memory file of {size} bytes")
    extents = [(math.prod(shape) * dtype.itemsize, offset) for (_, dtype, shape), offset in zip(declared, offsets)]
    for (name, _, _), (size, offset), f in zip(declared, extents, files):
        if not 0 <= offset <= offset + size <= nbytes[f]:
            raise ProtocolError(f"array {name!r} lies outside the shared arrays' {nbytes[f]} bytes")
    spans = {}                    # file -> (first byte mapped, the mapping): the span its arrays cover
    for f, fd in enumerate(fds):
        mine = [(size, offset) for (size, offset), g in zip(extents, files) if g == f]
        first = min(offset for _, offset in mine) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY \
            if mine else 0
        end = max((offset + size for size, offset in mine), default=0)
        try:
            spans[f] = (first, mmap.mmap(fd, end - first, prot=mmap.PROT_READ, offset=first) if end > first else b"")
        except OSError as exc:                           # no room for the span: the stream is still in step
            raise ProtocolError(f"the shared arrays' {end - first} bytes do not map: {exc}") from None
    return [np.frombuffer(spans[f][1], dtype=dtype, count=size // dtype.itemsize, offset=offset - spans[f][0])
            .reshape(shape) for (_, dtype, shape), (size, offset), f in zip(declared, extents, files)]


class ArrayStream:
    """The arrays of a message, received one frame at a time as ``(name, array)`` pairs in the
    order the header lists them (iterate once); ``declared`` is that list as ``(name, dtype,
    shape)``, known before any array arrives. Only the array being received is held here, so the
    largest array bounds the memory a message takes (arrays in a shared memory file, ``shared``:
    views of its one mapping, held by the sender's file already). Each array's byte count is
    checked against its description (ProtocolError). Leaving a ``with`` block receives and drops
    the arrays not yet received, so the connection stays in step whatever the consumer did."""

    def __init__(self, conn, declared: list[tuple[str, np.dtype, tuple[int, ...]]], shared: list | None = None):
        self.conn = conn
        self.declared = declared
        self._received = 0               # arrays taken off the connection
        self._shared = shared            # the arrays' views of a shared memory file, if they came so

    def __iter__(self):
        if self._shared is not None:
            for (name, _, _), view in zip(self.declared, self._shared):
                self._received += 1
                yield name, view
            self._shared = None
            return
        while self._received < len(self.declared):
            name, dtype, shape = self.declared[self._received]
            data = self.conn.recv_bytes()
            self._received += 1
            if len(data) != math.prod(shape) * dtype.itemsize:
                raise ProtocolError(f"array {name!r}: {len(data)} bytes do not match shape {shape} {dtype}")
            yield name, np.frombuffer(data, dtype=dtype).reshape(shape)
            del data

    def drain(self) -> None:
        """Receive and drop the arrays not yet received."""
        if self._shared is not None:
            self._shared, self._received = None, len(self.declared)
        while self._received < len(self.declared):
            self.conn.recv_bytes()
            self._received += 1

    def __enter__(self) -> ArrayStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or not issubclass(exc_type, (EOFError, OSError)):
            self.drain()


def send_error(conn, exc: BaseException) -> None:
    """Send ``exc`` as an error message (its class name if it is a wire error, else TensileError).
    An out-of-memory error carries its byte counts as ``fields``."""
    name = type(exc).__name__ if type(exc).__name__ in WIRE_ERRORS else "TensileError"
    message = str(exc) if isinstance(exc, TensileError) else f"internal error in the coordinator: {exc!r}"
    header = {"type": "error", "error": name, "message": message}
    if isinstance(exc, DeviceOutOfMemory):
        header["fields"] = [exc.requested_nbytes, exc.in_use_nbytes, exc.budget_nbytes, exc.what]
    send(conn, header)


def raise_if_error(header: dict) -> dict:
    """Raise the error a header carries, or return the header."""
    if header.get("type") == "error":
        cls = WIRE_ERRORS.get(header.get("error"), TensileError)
        if cls is DeviceOutOfMemory and header.get("fields"):
            raise DeviceOutOfMemory(*header["fields"])
        raise (cls if cls is not DeviceOutOfMemory else TensileError)(header.get("message", "unknown error"))
    return header
