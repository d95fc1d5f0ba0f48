"""Shared set-up of the tests that call the extension from SQL: a training of the digits data,
the error a call raises, the check that nothing is left behind, and a long training on its own
connection."""

from __future__ import annotations

import threading

import psycopg
import pytest

from conftest import wait_until

#: The digits' 64 pixel columns as one array feature.
FEATURES = "ARRAY[" + ", ".join(f"p{i}" for i in range(64)) + "]"
#: A small MLP's architecture.
SMALL = '{"layers": [{"dense": 64}]}'


def train(conn, name, source="SELECT * FROM digits_train", label="label", architecture=SMALL,
          options='{"epochs": 3}', features=None):
    return conn.execute(
        "CALL tensile.train_model(model_name => %s, source => %s, label => %s, features => %s, "
        "architecture => %s, options => %s)", (name, source, label, features, architecture, options)).fetchone()


def error_of(conn, fn, *args, **kwargs) -> str:
    with pytest.raises(psycopg.Error) as info:
        fn(conn, *args, **kwargs)
    return str(info.value)


def assert_nothing_left(conn):
    """No live job and no device bytes held once a call has ended, but for model layers kept in
    the weight cache."""
    assert wait_until(lambda: conn.execute("SELECT count(*) FROM tensile.jobs").fetchone()[0] == 0)
    mem = conn.execute("SELECT in_use_bytes - weight_cache_bytes, peak_bytes, budget_bytes FROM tensile.memory").fetchone()
    if mem is not None:
        assert mem[0] == 0 and mem[1] <= mem[2]


def train_in_background(dsn: str, name: str) -> tuple[threading.Thread, dict]:
    """Start a long training of ``name`` on its own connection; the dict gets the backend's
    ``pid`` and, when the call fails, its ``error``."""
    outcome = {}

    def run():
        with psycopg.connect(dsn, autocommit=True) as c:
            outcome["pid"] = c.info.backend_pid
            try:
                train(c, name, options='{"epochs": 5000}')
            except psycopg.Error as exc:
                outcome["error"] = str(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, outcome


def running(conn, name: str) -> bool:
    return conn.execute("SELECT count(*) FROM tensile.jobs WHERE model_name = %s AND state = 'running'",
                        (name,)).fetchone()[0] == 1
