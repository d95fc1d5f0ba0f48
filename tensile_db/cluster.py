"""An embedded PostgreSQL cluster for the demo and the tests.

:class:`EmbeddedCluster` runs the machine's PostgreSQL server binaries (``pg_config --bindir``)
on a data directory of its own: ``initdb`` with trust authentication for local connections, a Unix
socket in the cluster's directory and no TCP listener, PL/Python's search path set through the
postmaster's ``PYTHONPATH``, and the extension's settings in ``postgresql.conf``. PostgreSQL
refuses to run as root, so when the caller is root every server command runs as the ``postgres``
OS user (``runuser``), which then owns the cluster directory; that user must be able to read the
virtual environment named in ``python_paths``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import TensileError

#: The OS user that runs the server when the caller is root.
SERVER_USER = "postgres"
#: Longest Unix socket path we use, bytes (the kernel's limit is 107).
MAX_SOCKET_PATH = 100


def pg_bindir() -> Path:
    """The server binaries' directory, from ``pg_config``."""
    out = subprocess.run(["pg_config", "--bindir"], check=True, capture_output=True, text=True).stdout.strip()
    return Path(out)


class EmbeddedCluster:
    """A PostgreSQL cluster in ``base_dir`` (``pgdata/``, ``run/`` for the socket, ``postgres.log``).

    Args:
        base_dir: directory of the cluster; created if missing.
        python_paths: directories PL/Python must import from (the site-packages holding tensile_db).
        settings: extra ``postgresql.conf`` lines, e.g. ``{"tensile.device_budget": "'8MB'"}``.
        port: names the socket file; no TCP port is opened.
    """

    def __init__(self, base_dir: str | Path, python_paths: list[str] | None = None,
                 settings: dict[str, str] | None = None, port: int = 5432):
        self.base_dir = Path(base_dir).resolve()
        self.data_dir = self.base_dir / "pgdata"
        self.socket_dir = self.base_dir / "run"
        if len(str(self.socket_dir / f".s.PGSQL.{port}")) > MAX_SOCKET_PATH:   # AF_UNIX path limit
            digest = hashlib.sha256(str(self.base_dir).encode()).hexdigest()[:12]
            self.socket_dir = Path(tempfile.gettempdir()) / f"tensile-pg-{digest}"
        self.log_file = self.base_dir / "postgres.log"
        self.python_paths = list(python_paths or [])
        self.settings = dict(settings or {})
        self.port = port
        self.bindir = pg_bindir()
        self.as_root = os.geteuid() == 0

    # -- commands -----------------------------------------------------------------------------

    def _run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        cmd = [str(a) for a in argv]
        if env:
            cmd = ["env", *(f"{k}={v}" for k, v in env.items()), *cmd]
        if self.as_root:
            cmd = ["runuser", "-u", SERVER_USER, "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/")
        if check and proc.returncode:
            raise TensileError(f"{' '.join(map(str, argv[:2]))} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    @property
    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def init(self) -> None:
        """``initdb`` the data directory (skipped if it exists) and write the settings."""
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(mode=0o700, exist_ok=True)
        if self.as_root:
            user = pwd.getpwnam(SERVER_USER)
            for p in (self.base_dir, self.socket_dir):
                os.chown(p, user.pw_uid, user.pw_gid)
        if self.initialized:
            return
        self._run(self.bindir / "initdb", "-D", self.data_dir, "-U", "postgres", "--auth=trust",
                  "--encoding=UTF8", "--locale=C.UTF-8")
        lines = ["", "# tensile_db embedded cluster", "listen_addresses = ''",
                 f"unix_socket_directories = '{self.socket_dir}'", f"port = {self.port}"]
        with open(self.data_dir / "postgresql.conf", "a") as f:
            f.write("\n".join(lines) + "\n")
        self._write_settings()

    #: File in the data directory holding the extension's settings (``tensile.*``); PostgreSQL 15's
    #: ALTER SYSTEM refuses parameters no loaded module defines, so they live in a config file.
    SETTINGS_FILE = "tensile.conf"

    def configure(self, settings: dict[str, str]) -> None:
        """Merge ``settings`` (values as written in postgresql.conf, e.g. ``"'8MB'"``) into the
        cluster's settings file and reload the server's configuration."""
        self.settings.update(settings)
        self._write_settings()
        if self.running:
            self._run(self.bindir / "pg_ctl", "-D", self.data_dir, "reload")

    def _write_settings(self) -> None:
        include = f"include_if_exists = '{self.SETTINGS_FILE}'"
        conf = self.data_dir / "postgresql.conf"
        if include not in conf.read_text():
            with open(conf, "a") as f:
                f.write(include + "\n")
        path = self.data_dir / self.SETTINGS_FILE
        path.write_text("".join(f"{k} = {v}\n" for k, v in self.settings.items()))
        if self.as_root:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(path, user.pw_uid, user.pw_gid)

    def start(self) -> None:
        """Start the server (``pg_ctl -w``) if it is not running."""
        if not self.initialized:
            self.init()
        if self.running:
            return
        env = {"PYTHONPATH": os.pathsep.join(self.python_paths)} if self.python_paths else None
        self._run(self.bindir / "pg_ctl", "-D", self.data_dir, "-l", self.log_file, "-w", "-t", "60", "start", env=env)

    def stop(self) -> None:
        """Stop the server (fast shutdown: running queries are cancelled)."""
        if self.running:
            self._run(self.bindir / "pg_ctl", "-D", self.data_dir, "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self.initialized and self._run(self.bindir / "pg_ctl", "-D", self.data_dir, "status", check=False).returncode == 0

    # -- connecting ---------------------------------------------------------------------------

    def conninfo(self, dbname: str = "postgres", user: str = "postgres") -> str:
        """A libpq connection string over the cluster's Unix socket."""
        return f"host={self.socket_dir} port={self.port} dbname={dbname} user={user}"

    def url(self, dbname: str = "postgres", user: str = "postgres") -> str:
        """A SQLAlchemy URL (psycopg driver) over the cluster's Unix socket."""
        return f"postgresql+psycopg://{user}@/{dbname}?host={self.socket_dir}&port={self.port}"

    def create_database(self, dbname: str, fresh: bool = False) -> None:
        """Create ``dbname`` (if missing; dropped first if ``fresh``) with the extension installed."""
        import psycopg

        with psycopg.connect(self.conninfo(), autocommit=True) as conn:
            if fresh:
                conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone():
                conn.execute(f'CREATE DATABASE "{dbname}"')
        with psycopg.connect(self.conninfo(dbname), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS tensile_db CASCADE")


@contextlib.contextmanager
def scratch_cluster(database: str, python_paths: list[str] | None = None):
    """A cluster in a new temporary directory with ``database`` created (the extension in it), for
    a benchmark; stopped and removed on leaving, after printing the coordinator log's last lines
    to stderr when leaving on an error (the directory, and the log with it, goes)."""
    import site

    base = tempfile.mkdtemp(prefix="tensile-bench-")
    cluster = EmbeddedCluster(base, python_paths=python_paths or [site.getsitepackages()[0]])
    try:
        cluster.start()
        cluster.create_database(database)
        yield cluster
    except BaseException:
        log = cluster.data_dir / "tensile_coordinator" / "coordinator.log"
        if log.exists():
            print(f"last lines of {log}:\n" + "".join(log.read_text().splitlines(True)[-20:]), file=sys.stderr)
        raise
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
