"""Where a cluster's coordinator listens, and how a caller reads its state. A leaf module: the
backends import it without the server.

The socket directory is ``<data_dir>/tensile_coordinator``, mode 0700, owned by the server's OS
user, inside the data directory (itself 0700): no other OS user can create it first, enter it or
connect. A Unix socket path longer than the kernel's limit (108 bytes) is reached through
``/proc/self/fd/<fd of the directory>/coordinator.sock``, so the location never moves to a shared
place such as ``/tmp``, however long the data directory's path.

The coordinator writes its pid into ``coordinator.lock`` once it holds the lock, so a caller that
waits too long for an answer can say what the coordinator is doing (running, stopped, gone).
"""

from __future__ import annotations

import contextlib
import os

SOCKET_NAME = "coordinator.sock"
LOCK_NAME = "coordinator.lock"
LOG_NAME = "coordinator.log"
#: What a coordinator that fails before it listens writes to its log before the cause, on one line.
START_FAILED = "could not start: "
#: Longest Unix socket path used as it is, bytes (the kernel's limit is 107 plus the NUL).
MAX_SOCKET_PATH = 100
#: What ``/proc/<pid>/stat`` state letters mean, for error messages.
_PROCESS_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP)",
                   "t": "stopped by a debugger", "Z": "a zombie", "X": "dead", "I": "idle"}


def socket_dir_for(data_dir: str) -> str:
    """The coordinator's directory for the cluster whose data directory is ``data_dir``."""
    return os.path.join(data_dir, "tensile_coordinator")


@contextlib.contextmanager
def socket_address(socket_dir: str):
    """The address to bind or connect for ``socket_dir``'s socket: its path, or when that is too
    long for ``AF_UNIX``, the same file through ``/proc/self/fd``, valid inside the ``with``."""
    path = os.path.join(socket_dir, SOCKET_NAME)
    if len(path.encode()) <= MAX_SOCKET_PATH:
        yield path
        return
    fd = os.open(socket_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{SOCKET_NAME}"
    finally:
        os.close(fd)


def coordinator_state(socket_dir: str) -> str:
    """What the coordinator of ``socket_dir`` is doing, in words, for an error message:
    ``"pid 1234, stopped (SIGSTOP)"``, ``"pid 1234, not running"``, or ``"no pid recorded"``."""
    try:
        with open(os.path.join(socket_dir, LOCK_NAME)) as f:
            pid = int(f.readline())
    except (OSError, ValueError):
        return "no pid recorded"
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return f"pid {pid}, not running"
    return f"pid {pid}, {_PROCESS_STATES.get(letter, 'state ' + letter)}"


def resident_set(pid: int | str = "self") -> tuple[int, int]:
    """``(rss, peak)``: the resident set of process ``pid`` and its high-water mark, bytes
    (``VmRSS`` and ``VmHWM`` of ``/proc/<pid>/status``; 0 where the kernel does not say). On a CPU
    host this is the memory the device budget does not bound: host copies, the jobs' rows, the
    served models, the Python heap."""
    values = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in values:
                    values[key] = int(rest.split()[0]) * 1024          # kB
    except (OSError, ValueError, IndexError):
        pass
    return values["VmRSS"], values["VmHWM"]


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, exited but not yet reaped by
    its parent, has)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, ValueError):
        return False
    return letter not in ("Z", "X")
