"""The contract of ``tensile.jobs`` and ``tensile.memory`` at its two boundaries: what a running
coordinator sends is exactly the fields of :mod:`tensile_db.coordinator.reports`' records, and
the SQL functions' columns are exactly those fields, in order, named by ``sql_name``. Before the
records, figures computed by a producer (compactions, served models) were dropped silently on
the way to SQL."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from conftest import wait_until
from tensile_db.coordinator import client as coordinator_client
from tensile_db.coordinator.address import SOCKET_NAME
from tensile_db.coordinator.reports import JobRow, MemoryRow, sql_columns

FIELDS = {record: [f.name for f in dataclasses.fields(record)] for record in (JobRow, MemoryRow)}


@pytest.fixture
def coordinator(tmp_path):
    """A coordinator process of its own (no PostgreSQL); its socket directory."""
    socket_dir = str(tmp_path / "coordinator")
    spec = coordinator_client.StartSpec(budget_nbytes=4 << 20,
                                        python_path=os.path.dirname(os.path.dirname(coordinator_client.__file__)))
    proc = coordinator_client.start(socket_dir, spec)
    try:
        assert wait_until(lambda: os.path.exists(os.path.join(socket_dir, SOCKET_NAME)))
        yield socket_dir
    finally:
        with coordinator_client.connect(socket_dir) as c:
            c.request({"type": "shutdown"})
        proc.wait(10)


def test_a_running_coordinator_sends_exactly_the_records_fields(coordinator):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 8)).astype(np.float32), rng.integers(0, 2, 256).astype(np.int32)
    with coordinator_client.connect(coordinator) as trainer, coordinator_client.connect(coordinator) as status:
        accepted, _ = trainer.request({"type": "train", "model_name": "m", "role": "r", "backend_pid": 1,
                                       "architecture": {"layers": [{"dense": 16}]}, "options": {"epochs": 10_000},
                                       "task": "classification", "n_outputs": 2}, {"x": x, "y": y})
        assert accepted["type"] == "accepted"
        assert wait_until(lambda: status.request({"type": "jobs"})[0]["jobs"][0]["state"] == "running")
        jobs = status.request({"type": "jobs"})[0]["jobs"]
        (memory,) = status.request({"type": "memory"})[0]["devices"]
    assert list(jobs[0]) == FIELDS[JobRow]
    assert list(memory) == FIELDS[MemoryRow]
    assert memory["running_jobs"] == 1 and list(memory["per_job"]) == [str(jobs[0]["job_id"])]


def _out_columns(conn, function: str) -> list[str]:
    return conn.execute("""
        SELECT array_agg(name ORDER BY n) FROM pg_proc p,
               unnest(p.proargnames, p.proargmodes) WITH ORDINALITY AS a(name, mode, n)
        WHERE p.oid = %s::regprocedure AND mode = 'o'""", (function,)).fetchone()[0]


@pytest.mark.db
@pytest.mark.parametrize("record, function, view", [(JobRow, "tensile.job_status()", "tensile.jobs"),
                                                    (MemoryRow, "tensile.memory_status()", "tensile.memory")])
def test_the_sql_columns_are_the_records_fields_in_order(conn, record, function, view):
    assert _out_columns(conn, function) == sql_columns(record)
    cursor = conn.execute(f"SELECT * FROM {view} LIMIT 0")
    assert [d.name for d in cursor.description] == sql_columns(record)


@pytest.mark.db
def test_the_memory_view_shows_the_figures_that_were_dropped(conn):
    conn.execute("SELECT tensile.start_coordinator()")
    row = conn.execute("SELECT compactions, compacted_bytes, served_models, served_host_bytes, device, started_at "
                       "FROM tensile.memory").fetchone()
    assert all(isinstance(v, int) and v >= 0 for v in row[:4]) and row[4] == "cpu" and row[5] is not None


def test_the_resident_set_is_read_from_proc():
    import numpy as np_

    from tensile_db.coordinator.address import resident_set

    rss, peak = resident_set()
    block = np_.ones(64 << 20, dtype=np_.uint8)              # 64 MiB touched: the resident set grows
    grown, peak_after = resident_set()
    assert 0 < rss <= peak and grown >= rss + (48 << 20) and peak_after >= grown
    del block
    assert resident_set("no-such-process") == (0, 0)


@pytest.mark.db
def test_the_memory_view_shows_the_coordinators_resident_set(conn):
    conn.execute("SELECT tensile.start_coordinator()")
    rss, peak, pid = conn.execute("SELECT rss_bytes, peak_rss_bytes, tensile.start_coordinator() FROM tensile.memory"
                                  ).fetchone()
    with open(f"/proc/{pid}/status") as f:
        vm_hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    assert 10 << 20 < rss <= peak <= vm_hwm                  # a Python process with NumPy: tens of MB
