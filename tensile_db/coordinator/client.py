"""The client side of the coordinator protocol, used by backends, the CLI and the tests.

:func:`connect` reaches the coordinator of a socket directory and, given a :class:`StartSpec`,
starts one when none answers: a detached process in a new session (it outlives the backend that
started it) whose output goes to ``coordinator.log`` beside the socket. If two backends start one
at the same time, the lock in the socket directory lets one serve and the other exit; both
backends then connect to the winner.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Client

import numpy as np

from ..errors import CoordinatorUnavailable
from . import protocol
from .server import SOCKET_NAME, secure_dir

#: Longest Unix socket path the kernel accepts, bytes, less a margin.
MAX_SOCKET_PATH = 100


def socket_dir_for(data_dir: str) -> str:
    """The coordinator's directory for a cluster: ``<data_dir>/tensile_coordinator`` or, when that
    makes the socket path too long for ``AF_UNIX``, a per-cluster directory under the temp dir."""
    path = os.path.join(data_dir, "tensile_coordinator")
    if len(os.path.join(path, SOCKET_NAME)) <= MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(os.path.realpath(data_dir).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"tensile-{os.geteuid()}-{digest}")


@dataclass(frozen=True)
class StartSpec:
    """How to start a coordinator: interpreter, device, budget (bytes), admission limit, scheduler
    policy (one of ``tensile_db.scheduler.POLICIES``), pool (one of
    ``tensile_db.memory.manager.POOLS``), and the postmaster pid file whose disappearance stops it."""

    python: str = sys.executable
    device: str = "cpu"
    budget_nbytes: int = 1 << 30
    max_active_jobs: int = 8
    policy: str = "tensile"
    pool: str = "planned"
    postmaster_pid_file: str | None = None
    python_path: str | None = None      # prepended to PYTHONPATH, so the interpreter finds this package


def command(socket_dir: str, spec: StartSpec) -> list[str]:
    """The command line that runs a coordinator for ``socket_dir`` (see ``__main__.py``)."""
    argv = [spec.python, "-m", "tensile_db.coordinator", "--socket-dir", socket_dir, "--device", spec.device,
            "--budget", str(spec.budget_nbytes), "--max-active-jobs", str(spec.max_active_jobs),
            "--policy", spec.policy, "--pool", spec.pool]
    if spec.postmaster_pid_file:
        argv += ["--postmaster-pid-file", spec.postmaster_pid_file]
    return argv


def start(socket_dir: str, spec: StartSpec) -> subprocess.Popen:
    """Spawn a detached coordinator for ``socket_dir``."""
    secure_dir(socket_dir)
    argv = command(socket_dir, spec)
    env = dict(os.environ)
    if spec.python_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (spec.python_path, env.get("PYTHONPATH")) if p)
    with open(os.path.join(socket_dir, "coordinator.log"), "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True, cwd=socket_dir)


class CoordinatorClient:
    """One connection to the coordinator."""

    def __init__(self, conn):
        self.conn = conn

    def request(self, header: dict, arrays: dict[str, np.ndarray] | None = None) -> tuple[dict, dict]:
        """Send one request and return the reply; raises the error the coordinator sent."""
        protocol.send(self.conn, header, arrays)
        return self.receive()

    def receive(self) -> tuple[dict, dict]:
        header, arrays = protocol.recv(self.conn)
        return protocol.raise_if_error(header), arrays

    def send(self, header: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
        protocol.send(self.conn, header, arrays)

    def poll(self, timeout_s: float) -> bool:
        return self.conn.poll(timeout_s)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(socket_dir: str, start_spec: StartSpec | None = None, timeout_s: float = 30.0) -> CoordinatorClient:
    """Connect to the coordinator of ``socket_dir``, starting one with ``start_spec`` if none
    answers. Raises CoordinatorUnavailable after ``timeout_s`` seconds."""
    address = os.path.join(socket_dir, SOCKET_NAME)
    deadline = time.monotonic() + timeout_s
    proc = None
    while True:
        try:
            return CoordinatorClient(Client(address, family="AF_UNIX"))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if start_spec is None:
                raise CoordinatorUnavailable(f"no coordinator is running at {address}") from exc
            if proc is None:
                proc = start(socket_dir, start_spec)
            if time.monotonic() > deadline or (proc.poll() not in (None, 0)):
                raise CoordinatorUnavailable(
                    f"could not start the coordinator at {address} (exit status {proc.poll()}); "
                    f"see {os.path.join(socket_dir, 'coordinator.log')}") from exc
            time.sleep(0.05)
