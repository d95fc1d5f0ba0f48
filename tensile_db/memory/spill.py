"""The disk tier: spill files under the host tier, and their cleanup.

With a host budget (``tensile.host_budget``), a swapped-out tensor that does not fit the host
tier goes to its job's *spill file* (:class:`SpillFile`), and comes back from it on its swap-in
(:mod:`tensile_db.memory.residency` decides the tier, :mod:`tensile_db.memory.tiers` keeps the
files and the accounts, and the device's swap engine, :meth:`~tensile_db.runtime.device.Device.copy_engine`,
runs the I/O on its threads). A spill file is a heap of 4096-byte-aligned slots: a slot
freed by a swap-in is reused by the next tensor of the same size (the same tensors leave and
come back every iteration), so a job's file grows to its largest spilled set, not beyond.

Note [Spill I/O]: every read and write is one ``os.preadv`` / ``os.pwritev`` of the whole
tensor at an explicit offset (no shared file position, so the copy threads need no lock), with
``O_DIRECT`` where the file system accepts it: the page cache is bypassed, so a spilled byte is
on disk and nowhere in RAM (a buffered write would leave it in the page cache, which the kernel
counts against the machine, not this process, and a benchmark would measure RAM). On ``cpu`` the
source or destination is the arena block itself: arena blocks start at 512-byte multiples of a
page-aligned buffer and span whole 512-byte units, which is what ``O_DIRECT`` asks, so no bounce
copy is made. A buffer that is not aligned (a host array) goes through a reusable page-aligned
bounce buffer of :data:`BOUNCE_NBYTES`. Where ``O_DIRECT`` is refused (tmpfs: ``EINVAL``), the
file is opened buffered. Measured on this project's machine (ext4 on a virtual disk, 64 MiB in
1 MiB requests): about 1.6 GB/s each way with ``O_DIRECT``.

Cleanup: each coordinator spills under its own directory ``coordinator-<pid>`` of the spill root,
holding an exclusive ``flock`` on its ``lock`` file for its whole life. A job's file is removed
when the job's memory is released (:meth:`SpillFile.close`); at start, :class:`SpillDir` removes
every other coordinator directory whose lock it can take, which are those of coordinators that
died (a crash, ``kill -9``) without removing their own; the kernel drops a dead process's locks,
so a reused pid cannot keep a stale directory alive.
"""

from __future__ import annotations

import collections.abc
import errno
import fcntl
import itertools
import logging
import math
import mmap
import os
import shutil
import tempfile
import threading
import time

import numpy as np

from ..dirs import secure_dir
from ..errors import DiskError, DiskFull, TensileError
from ..runtime.units import round_up

log = logging.getLogger(__name__)

#: The errors of a full disk tier: no space left, or a quota reached.
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_nbytes(path: str) -> int:
    """Bytes free to the server's OS user on the file system of ``path`` (0 when it cannot be
    read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def disk_error(exc: OSError, what: str, root: str) -> TensileError:
    """The error of the disk tier for ``exc``, raised doing ``what`` (naming the file) in the spill
    directory ``root``: DiskFull (SQLSTATE 53100) naming the directory, its free bytes and the
    settings to change, when the file system is full; DiskError (58030) otherwise."""
    if exc.errno in FULL_ERRNOS:
        return DiskFull(f"the disk tier is full: {what} failed ({exc.strerror}); tensile.spill_dir {root} has "
                        f"{free_nbytes(root):,} bytes free: free space there, set tensile.spill_dir to a larger file "
                        "system, or raise tensile.host_budget so that less goes to disk")
    return DiskError(f"the disk tier failed: {what} ({exc.strerror}); check the disk under tensile.spill_dir {root}")


#: Alignment of every slot in a spill file and of direct I/O buffers, bytes.
ALIGN_NBYTES = 4096
#: ``O_DIRECT``'s requirement on buffer addresses and lengths on the file systems we meet, bytes.
DIRECT_NBYTES = 512
#: Size of the page-aligned bounce buffer for unaligned transfers, bytes; one per thread that
#: makes such a transfer (the executor's, the copy thread, a connection's), so it is kept small.
BOUNCE_NBYTES = 1 << 20


_instances = itertools.count(1)     # spill directories made by this process (tests make several)
#: Prefix of a coordinator's directory before it is locked and named, and how long such a
#: directory is left alone before it is taken for one whose coordinator died starting, seconds.
STARTING = ".starting-"
STARTING_S = 600


def direct_alignment(fd: int, write: bool) -> int:
    """The least alignment (512 or 4096 bytes) that direct I/O on ``fd`` (opened with
    ``O_DIRECT``) accepts for buffer addresses, lengths and offsets, or 0 when it refuses both:
    a disk of 4096-byte sectors refuses 512. Probed at offset 0 with a write of zeros
    (``write``, a new file) or a read. Raises OSError for an error other than ``EINVAL``.
    The one owner of this rule: spill files and model files both ask it."""
    with mmap.mmap(-1, ALIGN_NBYTES) as buffer:
        view = memoryview(buffer)
        try:
            for align in (DIRECT_NBYTES, ALIGN_NBYTES):
                try:
                    if write:
                        os.pwrite(fd, view[:align], 0)
                    else:
                        os.preadv(fd, [view[:align]], 0)
                    return align
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
            return 0
        finally:
            view.release()


class SpillFile:
    """One file of 4096-byte-aligned slots (see the module docstring). Thread-safe: slots are
    handed out under a lock, and I/O uses explicit offsets.

    Raises DiskFull or DiskError (from the constructor) when the file cannot be created, naming
    it; ``root`` is the spill directory errors name (default: the file's directory).
    """

    def __init__(self, path: str, root: str | None = None):
        self.path = path
        self.root = root or os.path.dirname(path)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self.direct, self.align_nbytes = False, 1    # direct I/O, and the alignment it needs, bytes
        try:
            self._fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise disk_error(exc, f"creating spill file {path}", self.root) from None
            self._fd = os.open(path, flags, 0o600)        # a file system without direct I/O (tmpfs)
        if self.direct:
            try:
                self.align_nbytes = direct_alignment(self._fd, write=True)
            except OSError as exc:
                os.close(self._fd)
                os.unlink(path)
                raise disk_error(exc, f"writing spill file {path}", self.root) from None
            if not self.align_nbytes:                     # direct I/O opened but refused: buffered
                os.close(self._fd)
                self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                self.direct, self.align_nbytes = False, 1
        self._lock = threading.Lock()
        self._free: dict[int, list[int]] = {}     # slot bytes -> free offsets; guarded by _lock
        self.end_nbytes = 0                       # the file's extent, bytes; guarded by _lock
        self.in_use_nbytes = 0                    # bytes of slots handed out; guarded by _lock
        self._bounce = threading.local()

    @staticmethod
    def slot_nbytes(nbytes: int) -> int:
        """Bytes of the slot that :meth:`reserve` hands out for ``nbytes``."""
        return round_up(nbytes, ALIGN_NBYTES)

    def reserve(self, nbytes: int) -> int:
        """A free slot of at least ``nbytes`` bytes: its file offset, bytes."""
        size = self.slot_nbytes(nbytes)
        with self._lock:
            free = self._free.get(size)
            offset = free.pop() if free else self.end_nbytes
            if offset == self.end_nbytes:
                self.end_nbytes += size
            self.in_use_nbytes += size
            return offset

    def release(self, offset: int, nbytes: int) -> None:
        """Give back the slot at ``offset`` that :meth:`reserve` returned for ``nbytes``."""
        size = self.slot_nbytes(nbytes)
        with self._lock:
            self._free.setdefault(size, []).append(offset)
            self.in_use_nbytes -= size

    def write_from(self, offset: int, array) -> None:
        """Write the bytes of the C-contiguous array ``array`` at ``offset`` (blocking)."""
        view = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        if self._aligned(view):
            self._all(os.pwritev, view, offset)
            return
        bounce = self._bounce_buffer()
        for start in range(0, len(view), BOUNCE_NBYTES):
            part = view[start:start + BOUNCE_NBYTES]
            length = round_up(len(part), self.align_nbytes)
            bounce[:len(part)] = part
            self._all(os.pwritev, bounce[:length], offset + start)

    def read_into(self, offset: int, array, need_nbytes: int | None = None) -> None:
        """Fill the C-contiguous array ``array`` with the bytes at ``offset`` (blocking); with
        ``need_nbytes``, only that many must be in the file (the rest of ``array`` is padding
        that may lie past its end). Raises DiskError if the file is shorter than that."""
        view = memoryview(array.reshape(-1).view(np.uint8))
        if self._aligned(view):
            self._all(os.preadv, view, offset, need=need_nbytes)
            return
        bounce = self._bounce_buffer()
        need_nbytes = len(view) if need_nbytes is None else need_nbytes
        for start in range(0, len(view), BOUNCE_NBYTES):
            n = min(BOUNCE_NBYTES, len(view) - start)
            length = round_up(n, self.align_nbytes)
            self._all(os.preadv, bounce[:length], offset + start, need=max(0, min(n, need_nbytes - start)))
            view[start:start + n] = bounce[:n]

    def close(self) -> None:
        """Close and remove the file (idempotent)."""
        with self._lock:
            if self._fd < 0:
                return
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _aligned(self, view: memoryview) -> bool:
        if not self.direct:
            return True
        address = np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0
        return address % self.align_nbytes == 0 and len(view) % self.align_nbytes == 0

    def _bounce_buffer(self) -> memoryview:
        buf = getattr(self._bounce, "buffer", None)
        if buf is None:                      # one per copy thread, page-aligned (mmap)
            buf = self._bounce.buffer = memoryview(mmap.mmap(-1, BOUNCE_NBYTES))
        return buf

    def _all(self, call, view: memoryview, offset: int, need: int | None = None) -> None:
        """Run ``os.preadv`` / ``os.pwritev`` until ``need`` (default: all) bytes are done."""
        need = len(view) if need is None else need
        done = 0
        while done < need:
            try:
                n = call(self._fd, [view[done:]], offset + done)
            except OSError as exc:
                doing = "reading" if call is os.preadv else "writing"
                raise disk_error(exc, f"{doing} {len(view):,} bytes at {offset:,} of spill file {self.path}",
                                 self.root) from None
            if n <= 0:
                raise DiskError(f"spill file {self.path}: {'read' if call is os.preadv else 'write'} of "
                                f"{len(view):,} bytes at {offset:,} stopped after {done:,}")
            done += n
            if done < need and done % self.align_nbytes:
                raise DiskError(f"spill file {self.path}: a direct transfer stopped mid-sector")


class SpillDir:
    """This coordinator's spill directory under ``root`` (created 0700), and the cleanup of
    dead coordinators' directories (see the module docstring). ``removed_nbytes`` /
    ``removed_files`` say what the start removed.

    Raises DiskFull or DiskError (from the constructor) naming ``root`` when it cannot be used.
    """

    def __init__(self, root: str):
        self.root = root
        try:
            secure_dir(root, "spill directory", "fix it or set tensile.spill_dir to another")
            self.removed_files, self.removed_nbytes = self._remove_dead()
            # Made under a temporary name and locked before it gets its name, so a coordinator
            # directory another one sees is always locked while its owner lives.
            starting = tempfile.mkdtemp(prefix=STARTING, dir=root)
            self._lock_fd = os.open(os.path.join(starting, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.directory = os.path.join(root, f"coordinator-{os.getpid()}-{next(_instances)}")
            os.rename(starting, self.directory)
        except OSError as exc:
            if exc.errno in FULL_ERRNOS:
                raise disk_error(exc, f"creating this coordinator's directory in {root}", root) from None
            raise DiskError(f"cannot use spill directory {root}: {exc}; set tensile.spill_dir to a directory "
                            "the server's OS user can write") from None
        self._names = itertools.count(1)

    def open(self, name: str) -> SpillFile:
        """A new spill file ``<name>.spill`` (``name``: a job id or similar, never user text)."""
        return SpillFile(os.path.join(self.directory, f"{name}.spill"), self.root)

    def free_nbytes(self) -> int:
        """Bytes free on the spill directory's file system (:func:`free_nbytes`)."""
        return free_nbytes(self.root)

    def open_scratch(self) -> SpillFile:
        """A new spill file for a measurement; :meth:`SpillFile.close` removes it."""
        return self.open(f"scratch-{next(self._names)}")

    def close(self) -> None:
        """Remove this coordinator's directory and everything in it (idempotent)."""
        if self._lock_fd < 0:
            return
        shutil.rmtree(self.directory, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = -1

    def _remove_dead(self) -> tuple[int, int]:
        files = nbytes = 0
        for entry in os.scandir(self.root):
            if not entry.is_dir(follow_symlinks=False):
                continue
            if entry.name.startswith(STARTING):     # one dying between mkdtemp and rename; left a while
                if time.time() - entry.stat(follow_symlinks=False).st_mtime < STARTING_S:
                    continue
            elif not entry.name.startswith("coordinator-"):
                continue
            try:
                fd = os.open(os.path.join(entry.path, "lock"), os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = None                       # never locked, so never a live coordinator's
            except OSError:
                continue                        # not ours to judge (another OS user's)
            try:
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue                        # a live coordinator's
            finally:
                if fd is not None:
                    os.close(fd)
            for f in os.scandir(entry.path):
                if f.name.endswith(".spill"):
                    files += 1
                    nbytes += f.stat(follow_symlinks=False).st_size
            shutil.rmtree(entry.path, ignore_errors=True)
        if files:
            log.info("removed %d spill files (%d bytes) left by coordinators that died", files, nbytes)
        return files, nbytes


class SpilledArrays(collections.abc.Mapping):
    """Named arrays kept in a spill file, read back one at a time: a training job's weights
    when they do not fit the host budget (its result, its best epoch's weights, the weights its
    held-out loss is computed with). ``arrays[name]`` reads a new array each time; the file is
    removed by :meth:`close`. Holds no array in memory.

    Raises DiskFull or DiskError (from :meth:`put` and reads) when the spill file's I/O fails.
    """

    def __init__(self, file: SpillFile):
        self.file = file
        self._where: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}   # name -> (offset, dtype, shape)

    def put(self, name: str, array: np.ndarray) -> None:
        """Write ``array`` under ``name`` (replacing an earlier one of the name)."""
        array = np.ascontiguousarray(array)
        if name in self._where:
            offset, dtype, shape = self._where.pop(name)
            self.file.release(offset, math.prod(shape) * dtype.itemsize)
        offset = self.file.reserve(array.nbytes)
        self.file.write_from(offset, array)
        self._where[name] = (offset, array.dtype, array.shape)

    def meta(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape of ``name``'s array, without reading it."""
        _, dtype, shape = self._where[name]
        return dtype, shape

    @property
    def nbytes(self) -> int:
        """Bytes of every array, bytes."""
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self._where.values())

    def __getitem__(self, name: str) -> np.ndarray:
        offset, dtype, shape = self._where[name]
        out = np.empty(shape, dtype)
        self.file.read_into(offset, out.reshape(-1).view(np.uint8))
        return out

    def __contains__(self, name) -> bool:          # without reading the array
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        """Remove the file (idempotent)."""
        self.file.close()
