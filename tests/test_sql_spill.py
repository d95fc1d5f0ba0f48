"""The disk tier from SQL: tensile.host_budget and tensile.spill_dir reach the coordinator, a
training under a host budget of 0 spills and stores the same weights as one with room, the views
show the tiers, and a killed coordinator's spill files go when the next one starts."""

from __future__ import annotations

import os
import signal
import threading

import psycopg
import pytest

from conftest import TEST_BUDGET, wait_until
from tensile_db.coordinator.address import LOCK_NAME

pytestmark = pytest.mark.db

SOURCE = "SELECT * FROM digits_train"
ARCHITECTURE = '{"layers": [' + ", ".join(['{"dense": 256}'] * 8) + ']}'   # 5.7 MB of weights and Adam state
OPTIONS = '{"epochs": 2, "seed": 5, "optimizer": "adam", "test_size": 0, "replace": true}'


@pytest.fixture
def host_budget(cluster, conn):
    """``host_budget("'0'")`` writes tensile.host_budget and stops the coordinator, so the next
    call starts one with it; the default comes back afterwards."""
    def configure(value, spill_dir=None):
        conn.execute("SELECT tensile.stop_coordinator()")
        settings = {"tensile.host_budget": value}
        settings["tensile.spill_dir"] = f"'{spill_dir}'" if spill_dir else "''"
        cluster.configure(settings)
    yield configure
    configure("'1GB'")


def train(conn, name: str, options: str = OPTIONS) -> None:
    conn.execute("CALL tensile.train_model(model_name => %s, source => %s, label => 'label', "
                 "architecture => %s, options => %s)", (name, SOURCE, ARCHITECTURE, options))


def weights(conn, name: str) -> bytes:
    return conn.execute("SELECT weights FROM tensile.models WHERE name = %s", (name,)).fetchone()[0]


def coordinator_pid(cluster) -> int:
    with open(cluster.data_dir / "tensile_coordinator" / LOCK_NAME) as f:
        return int(f.readline())


def test_training_with_no_host_budget_spills_and_stores_the_same_weights(host_budget, conn, digits):
    host_budget("'1GB'")
    train(conn, "t_roomy")
    host_budget("'0'")
    train(conn, "t_spilled")
    assert weights(conn, "t_spilled") == weights(conn, "t_roomy")
    metrics = conn.execute("SELECT metrics FROM tensile.models WHERE name = 't_spilled'").fetchone()[0]
    assert metrics["spilled_nbytes"] > 0 and metrics["disk_read_nbytes"] > 0
    row = conn.execute("SELECT host_budget_bytes, host_peak_bytes, host_used_bytes, disk_bytes, "
                       "disk_read_bytes_per_s, disk_write_bytes_per_s, budget_bytes FROM tensile.memory").fetchone()
    assert row[:4] == (0, 0, 0, 0) and row[4] > 0 and row[5] > 0 and row[6] == TEST_BUDGET


def test_a_killed_coordinators_spill_files_are_removed_when_the_next_one_starts(host_budget, cluster, conn, dsn,
                                                                               digits):
    host_budget("'0'")
    outcome = {}

    def run():
        with psycopg.connect(dsn, autocommit=True) as c:
            try:
                train(c, "t_killed", '{"epochs": 5000, "test_size": 0}')
            except psycopg.Error as exc:
                outcome["error"] = str(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert wait_until(lambda: (conn.execute("SELECT coalesce(sum(disk_bytes), 0) FROM tensile.jobs "
                                                "WHERE model_name = 't_killed'").fetchone()[0] > 0), 60)
        assert conn.execute("SELECT spill_file_bytes > 0 AND host_used_bytes = 0 FROM tensile.memory").fetchone()[0]
        spill = cluster.data_dir / "tensile_coordinator" / "spill"
        (left,) = [d for d in spill.iterdir() if d.name.startswith("coordinator-")]
        assert any(f.name.endswith(".spill") for f in left.iterdir())
        os.kill(coordinator_pid(cluster), signal.SIGKILL)
    finally:
        t.join(30)
    assert "coordinator" in outcome["error"]
    assert left.exists()
    conn.execute("SELECT tensile.start_coordinator()")
    assert not left.exists()
    assert [d.name for d in spill.iterdir()] == [f"coordinator-{coordinator_pid(cluster)}-1"]


def test_spill_dir_and_host_budget_settings_are_checked(host_budget, conn, tmp_path):
    host_budget("'-1MB'")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="tensile.host_budget is '-1MB'; it must not be "
                                                                   "negative"):
        conn.execute("SELECT tensile.start_coordinator()")
    host_budget("'1MB'", spill_dir="relative/dir")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="tensile.spill_dir is 'relative/dir'; it must be "
                                                                   "an absolute directory"):
        conn.execute("SELECT tensile.start_coordinator()")
