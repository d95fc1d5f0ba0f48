"""Fixtures: a real PostgreSQL cluster for the database tests, started once per session.

The cluster is initdb'ed into a fresh temporary directory, with PL/Python, the extension installed
from the checkout (``make -C extension install``, run by ``make test``) and PL/Python importing
this virtual environment's site-packages. The device budget is small (``TEST_BUDGET``) so that
training under it must swap. Tests marked ``db`` are skipped when no PostgreSQL server binaries
are installed.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import tempfile
import time

import psycopg
import pytest

#: Fixture modules beside this one.
pytest_plugins = ["hostile_fixtures"]

#: The device the runtime tests that run jobs on an executor run on: ``cpu`` unless the
#: environment's TENSILE_TEST_DEVICE names another (``cuda`` on a machine with a GPU and CuPy).
TEST_DEVICE = os.environ.get("TENSILE_TEST_DEVICE", "cpu")

#: Device budget of the test cluster's coordinator, bytes.
TEST_BUDGET = 3 * 1024 * 1024


def wait_until(predicate, timeout_s=10.0) -> bool:
    """Poll ``predicate`` every 0.05 s until it is true (True) or ``timeout_s`` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def wait_done(job, what: str, timeout_s: float = 120.0) -> None:
    """Read the events of the in-process ``job`` until its last, and assert that it finished;
    ``what`` names the job in the failure."""
    while (event := job.events.get(timeout=timeout_s))[0] == "progress":
        pass
    assert event[0] == "done", f"{what}: {event[1]!r}"


def _have_postgres() -> bool:
    try:
        from tensile_db.cluster import pg_bindir

        return (pg_bindir() / "initdb").exists()
    except (OSError, subprocess.CalledProcessError):
        return False


@pytest.fixture(scope="session")
def cluster():
    if not _have_postgres():
        pytest.skip("PostgreSQL server binaries are not installed")
    from tensile_db.cluster import EmbeddedCluster

    base = tempfile.mkdtemp(prefix="tensile-test-")
    c = EmbeddedCluster(base, python_paths=[site.getsitepackages()[0]],
                        settings={"tensile.device_budget": f"'{TEST_BUDGET}'", "tensile.max_active_jobs": "4"})
    c.start()
    c.create_database("tensile_test")
    yield c
    c.stop()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def dsn(cluster) -> str:
    return cluster.conninfo("tensile_test")


@pytest.fixture
def conn(dsn):
    """An autocommit superuser connection; NOTICEs are collected in ``conn.notices``."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.notices = []
        c.add_notice_handler(lambda d: c.notices.append(d.message_primary))
        yield c


@pytest.fixture(scope="session")
def digits(cluster) -> int:
    """Tables digits_train / digits_test (64 real features p0..p63, integer label), loaded the
    way the demo loads them; returns the number of training rows."""
    from sqlalchemy import create_engine

    from tensile_db.demo import load_digits_tables

    engine = create_engine(cluster.url("tensile_test"))
    try:
        return load_digits_tables(engine)
    finally:
        engine.dispose()
