"""The client side of the coordinator protocol, used by backends, the CLI and the tests.

:func:`connect` reaches the coordinator of a socket directory and, given a :class:`StartSpec`,
starts one when none answers: a detached process in a new session (it outlives the backend that
started it) whose output goes to ``coordinator.log`` beside the socket. If two backends start one
at the same time, the lock in the socket directory lets one serve and the other exit; both
backends then connect to the winner.

Nothing here waits without a bound: a connection attempt that finds the listen queue full (a busy
or stopped coordinator) is retried after ``pause(seconds)``, which a backend uses to let
PostgreSQL deliver a cancel, and gives up at a deadline; :meth:`CoordinatorClient.abort` wakes a
thread blocked in a send or receive on the connection.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from .. import settings
from ..dirs import secure_dir
from ..errors import CoordinatorNotRunning, CoordinatorUnavailable
from ..runtime.model import Limits
from . import protocol
from .address import LOG_NAME, SOCKET_NAME, START_FAILED, coordinator_state, socket_address


@dataclass(frozen=True)
class StartSpec:
    """How to start a coordinator: interpreter, device (or ``devices``, several of one kind, from
    :func:`tensile_db.settings.parse_devices`), budget (bytes: one for every device, or a tuple of
    one per device), host budget (bytes) and
    the spill directory of the disk tier under it, admission limit, scheduler
    policy (one of ``tensile_db.settings.POLICIES``), pool (one of
    ``tensile_db.settings.POOLS``), the postmaster pid file whose disappearance stops it, and
    the largest model it builds (layers, parameters)."""

    python: str = sys.executable
    device: str = settings.DEFAULT_DEVICE
    budget_nbytes: int | tuple[int, ...] = settings.DEFAULT_BUDGET_NBYTES
    host_budget_nbytes: int = settings.DEFAULT_HOST_BUDGET_NBYTES
    spill_dir: str | None = None        # None: <socket_dir>/spill
    max_active_jobs: int = settings.DEFAULT_MAX_ACTIVE_JOBS
    policy: str = settings.DEFAULT_POLICY
    pool: str = settings.DEFAULT_POOL
    postmaster_pid_file: str | None = None
    python_path: str | None = None      # prepended to PYTHONPATH, so the interpreter finds this package
    limits: Limits = Limits()
    devices: tuple[str, ...] = ()
    max_pressure: float | None = settings.DEFAULT_MAX_PRESSURE


def command(socket_dir: str, spec: StartSpec) -> list[str]:
    """The command line that runs a coordinator for ``socket_dir`` (see ``__main__.py``)."""
    argv = [spec.python, "-m", "tensile_db.coordinator", "--socket-dir", socket_dir, "--device", spec.device,
            "--budget", ",".join(map(str, (spec.budget_nbytes,) if isinstance(spec.budget_nbytes, int)
                                     else spec.budget_nbytes)), "--host-budget", str(spec.host_budget_nbytes),
            "--max-active-jobs", str(spec.max_active_jobs),
            "--max-pressure", "none" if spec.max_pressure is None else repr(spec.max_pressure),
            "--policy", spec.policy, "--pool", spec.pool, "--max-layers", str(spec.limits.max_layers),
            "--max-parameters", str(spec.limits.max_parameters),
            "--max-job-bytes", str(spec.limits.max_job_nbytes)]
    if spec.postmaster_pid_file:
        argv += ["--postmaster-pid-file", spec.postmaster_pid_file]
    if spec.spill_dir:
        argv += ["--spill-dir", spec.spill_dir]
    if spec.devices:
        argv += ["--devices", ",".join(spec.devices)]
    return argv


def start(socket_dir: str, spec: StartSpec) -> subprocess.Popen:
    """Spawn a detached coordinator for ``socket_dir``."""
    secure_dir(socket_dir, "socket directory")
    argv = command(socket_dir, spec)
    env = dict(os.environ)
    if spec.python_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (spec.python_path, env.get("PYTHONPATH")) if p)
    with open(os.path.join(socket_dir, LOG_NAME), "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True, cwd=socket_dir)


class CoordinatorClient:
    """One connection to the coordinator of ``socket_dir``."""

    def __init__(self, conn: Connection, socket_dir: str):
        self.conn = conn
        self.socket_dir = socket_dir
        self._leave_open = False
        self._pong: dict | None = None   # the coordinator's answer to a ping: what it takes (asked once)

    def state(self) -> str:
        """The coordinator's process state in words (see :func:`.address.coordinator_state`)."""
        return coordinator_state(self.socket_dir)

    def abort(self) -> None:
        """Shut the connection down in both directions: a send or receive blocked on it in another
        thread fails at once, and the coordinator sees the connection close (which cancels a job
        or call). Call :meth:`close` afterwards."""
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def request(self, header: dict, arrays: dict[str, np.ndarray] | None = None) -> tuple[dict, dict]:
        """Send one request and return the reply; raises the error the coordinator sent. Before
        the connection's first request with arrays of :data:`.protocol.SHARED_MIN_NBYTES` or
        more, a ``ping`` asks whether the coordinator takes them in a shared memory file (Note
        [Shared arrays]); every request says that this end takes them."""
        if self._pong is None and protocol.large(arrays):
            self._ask()
        protocol.send(self.conn, dict(header, accepts_shared=True), arrays)
        return self.receive()

    def takes_rows(self) -> bool:
        """Whether the coordinator takes a training request's rows by index (``rows`` and
        ``test_rows`` into ``x``, :mod:`.training`): asked with a ``ping`` once a connection, as
        whether it takes shared arrays and in how many files (Note [Shared arrays])."""
        return self._ask().get("rows") is True

    def _ask(self) -> dict:
        if self._pong is None:
            protocol.send(self.conn, {"type": "ping", "accepts_shared": True})
            self._pong = self.receive()[0]
            if self._pong.get("accepts_shared") is True:
                protocol.accept_shared(self.conn, files=2 if self._pong.get("shared_files") == 2 else 1)
        return self._pong

    def receive(self) -> tuple[dict, dict]:
        header, arrays = protocol.recv(self.conn)
        return protocol.raise_if_error(header), arrays

    def send(self, header: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
        protocol.send(self.conn, header, arrays)

    def poll(self, timeout_s: float) -> bool:
        return self.conn.poll(timeout_s)

    def leave_open(self) -> None:
        """Make :meth:`close` a no-op: another thread is still in a system call on the socket
        (after :meth:`abort`), and closing its fd could hand the number to another file while it
        runs. The connection closes when the last reference to it goes."""
        self._leave_open = True

    def close(self) -> None:
        if not self._leave_open:
            self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _attempt(socket_dir: str) -> Connection | None:
    """One connection attempt that never blocks: the connection, or None when the coordinator's
    listen queue is full. Raises FileNotFoundError or ConnectionRefusedError when none listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        with socket_address(socket_dir) as address:
            sock.connect(address)
    except BlockingIOError:
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    sock.setblocking(True)
    return Connection(sock.detach())


def connect(socket_dir: str, start_spec: StartSpec | None = None, timeout_s: float = 30.0,
            pause=time.sleep) -> CoordinatorClient:
    """Connect to the coordinator of ``socket_dir``, starting one with ``start_spec`` if none
    answers; between attempts calls ``pause(0.05)``.

    Raises CoordinatorUnavailable when none runs and ``start_spec`` is None, when a started one
    exits, or after ``timeout_s`` seconds (naming the coordinator's process state).
    """
    address = os.path.join(socket_dir, SOCKET_NAME)
    deadline = time.monotonic() + timeout_s
    proc = None
    while True:
        try:
            conn = _attempt(socket_dir)
            if conn is not None:
                return CoordinatorClient(conn, socket_dir)
            if time.monotonic() > deadline:
                raise CoordinatorUnavailable(
                    f"the coordinator at {address} ({coordinator_state(socket_dir)}) accepted no connection within "
                    f"{timeout_s:g} s; see {os.path.join(socket_dir, LOG_NAME)}, or stop it "
                    "(SELECT tensile.stop_coordinator()) and call again")
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if start_spec is None:
                raise CoordinatorNotRunning(f"no coordinator is running at {address}") from exc
            if proc is None:
                log_offset = _size(os.path.join(socket_dir, LOG_NAME))
                proc = start(socket_dir, start_spec)
            if time.monotonic() > deadline or (proc.poll() not in (None, 0)):
                log_path = os.path.join(socket_dir, LOG_NAME)
                cause = start_failure(log_path, log_offset) if proc.poll() not in (None, 0) else None
                raise CoordinatorUnavailable(
                    f"could not start the coordinator at {address}: {cause or 'it did not listen in time'}",
                    detail=f"exit status {proc.poll()}; the coordinator's log is {log_path}") from exc
        pause(0.05)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


#: The most of a failed start's log output read for its cause, bytes, and the longest cause given.
START_LOG_NBYTES = 64 << 10
START_CAUSE_CHARS = 500


def start_failure(log_path: str, offset: int) -> str | None:
    """Why a coordinator that wrote its log from ``offset`` on failed to start: the cause it wrote
    after :data:`~.address.START_FAILED`, else its output's last line (an argument error), at most
    :data:`START_CAUSE_CHARS` characters; None when it wrote nothing."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(offset, _size(log_path) - START_LOG_NBYTES))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return None
    causes = [line.split(START_FAILED, 1)[1] for line in lines if START_FAILED in line]
    cause = causes[-1] if causes else (lines[-1] if lines else None)
    return cause[:START_CAUSE_CHARS] if cause else None
