"""The demo run against a server named by a connection string (``tensile-db demo --dsn``), the form
the compose file's demo service runs: in a cluster of its own, whose device budget is below the sum
of the demo's models' unscheduled peaks (so that they must share it), in a database whose
tensile_db is older than the package (as a volume made by an earlier image has it).
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import tempfile

import psycopg
import pytest

import tensile_db
from tensile_db import demo
from tensile_db.cluster import EmbeddedCluster

DATABASE = "analytics"


@pytest.fixture(scope="module")
def server():
    """A running cluster with the budget the embedded demo sets, and DATABASE holding tensile_db 0.3.0."""
    budget, _ = demo.shared_budget(1347)
    base = tempfile.mkdtemp(prefix="tensile-demo-")
    cluster = EmbeddedCluster(base, python_paths=[site.getsitepackages()[0]],
                              settings={"tensile.device_budget": f"'{budget}'"})
    cluster.start()
    try:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        with psycopg.connect(cluster.conninfo(DATABASE), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION tensile_db VERSION '0.3.0' CASCADE")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.db
def test_the_demo_runs_in_a_servers_database_and_brings_its_extension_up_to_date(server):
    result = subprocess.run([sys.executable, "-m", "tensile_db.cli", "demo", "--dsn", server.conninfo(DATABASE)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert f"tensile_db {tensile_db.__version__} in database {DATABASE}" in out
    assert "FAILED" not in out
    assert "ok     the budget is below the sum of unscheduled peaks" in out
    assert "ok     the combined peak stayed within the budget" in out
    with psycopg.connect(server.conninfo(DATABASE)) as conn:
        assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'tensile_db'"
                            ).fetchone()[0] == tensile_db.__version__
        names = [r[0] for r in conn.execute("SELECT name FROM tensile.models WHERE deployed ORDER BY name")]
        assert names == sorted([*demo.MODELS, "penguins"])
        # the stored models are served from SQL after the demo's connections are gone
        right, rows = conn.execute("SELECT count(*) FILTER (WHERE tensile.predict_label('digits_cnn', t)::int = "
                                   "t.label), count(*) FROM digits_test t").fetchone()
        assert rows == 450 and right >= 0.9 * rows


def test_demo_takes_either_an_embedded_cluster_or_a_server_not_both(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tensile_db.cli", "demo", "--home", str(tmp_path),
                             "--dsn", "dbname=x"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "not allowed with argument" in result.stderr
