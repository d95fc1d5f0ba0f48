"""Several devices from SQL: ``tensile.devices`` and a budget per device reach the coordinator,
``tensile.memory`` has a row per device, concurrent trainings land on both devices (the NOTICE
and ``tensile.jobs`` name each one's), each device's peak stays within its budget, a cancel frees
the right device's memory, a device whose budget cannot hold a job is never chosen for it, and a
predict call goes where its model's layers are (else to the less busy device), each device keeping
its own model files."""

from __future__ import annotations

import threading

import psycopg
import pytest

from conftest import TEST_BUDGET, wait_until
from tensile_db.inference.files import file_name

pytestmark = pytest.mark.db

SOURCE = "SELECT * FROM digits_train"
ARCHITECTURE = '{"layers": [{"dense": 256}, {"dense": 256}]}'


@pytest.fixture
def devices(cluster, conn):
    """``devices("'cpu:0, cpu:1'", "'3MB'")`` writes tensile.devices and tensile.device_budget and
    stops the coordinator, so that the next call starts one with them; one device comes back
    afterwards."""
    def configure(devices: str, budget: str) -> None:
        conn.execute("SELECT tensile.stop_coordinator()")
        cluster.configure({"tensile.devices": devices, "tensile.device_budget": budget})
    yield configure
    configure("''", f"'{TEST_BUDGET}'")


def _train_in_background(dsn: str, name: str, epochs: int, outcome: dict) -> threading.Thread:
    def run():
        with psycopg.connect(dsn, autocommit=True) as c:
            c.add_notice_handler(lambda d: outcome.setdefault(name, []).append(d.message_primary))
            outcome[f"{name} pid"] = c.info.backend_pid
            try:
                c.execute("CALL tensile.train_model(model_name => %s, source => %s, label => 'label', "
                          "architecture => %s, options => %s)",
                          (name, SOURCE, ARCHITECTURE, f'{{"epochs": {epochs}, "test_size": 0, "replace": true}}'))
            except psycopg.Error as exc:
                outcome[f"{name} error"] = exc
    t = threading.Thread(target=run)
    t.start()
    return t


def _devices_of(conn, names) -> dict:
    return dict(conn.execute("SELECT model_name, device FROM tensile.jobs WHERE model_name = ANY(%s) "
                             "AND state = 'running'", (list(names),)).fetchall())


def test_concurrent_trainings_land_on_both_devices_and_a_cancel_frees_its_own(devices, conn, dsn, digits):
    devices("'cpu:0, cpu:1'", f"'{TEST_BUDGET}, {TEST_BUDGET // 2}'")
    conn.execute("SELECT tensile.start_coordinator()")
    assert conn.execute("SELECT device, budget_bytes FROM tensile.memory ORDER BY device").fetchall() == [
        ("cpu:0", TEST_BUDGET), ("cpu:1", TEST_BUDGET // 2)]
    outcome, names = {}, ("d_first", "d_second")
    threads = [_train_in_background(dsn, name, 5000, outcome) for name in names]
    try:
        assert wait_until(lambda: len(_devices_of(conn, names)) == 2, 60)
        placed = _devices_of(conn, names)
        assert sorted(placed.values()) == ["cpu:0", "cpu:1"]
        for name in names:
            assert any(f"accepted on device {placed[name]};" in n for n in outcome[name])
        on_1 = next(name for name in names if placed[name] == "cpu:1")
        conn.execute("SELECT pg_cancel_backend(%s)", (outcome[f"{on_1} pid"],))
        assert wait_until(lambda: conn.execute(
            "SELECT in_use_bytes = 0 AND running_jobs = 0 FROM tensile.memory WHERE device = 'cpu:1'").fetchone()[0])
        assert conn.execute("SELECT running_jobs, in_use_bytes > 0 FROM tensile.memory WHERE device = 'cpu:0'"
                            ).fetchone() == (1, True)
        rows = conn.execute("SELECT device, peak_bytes, budget_bytes FROM tensile.memory").fetchall()
        assert len(rows) == 2 and all(0 < peak <= budget for _, peak, budget in rows)
    finally:
        for name in names:
            if f"{name} pid" in outcome:
                conn.execute("SELECT pg_cancel_backend(%s)", (outcome[f"{name} pid"],))
        for t in threads:
            t.join(60)
    assert isinstance(outcome[f"{on_1} error"], psycopg.errors.QueryCanceled)


def test_a_device_whose_budget_cannot_hold_the_job_is_never_chosen(devices, conn, dsn, digits):
    devices("'cpu:0, cpu:1'", f"'{TEST_BUDGET}, 64kB'")
    outcome, names = {}, ("d_roomy_a", "d_roomy_b")
    threads = [_train_in_background(dsn, name, 3, outcome) for name in names]
    for t in threads:
        t.join(120)
    assert not any(k.endswith("error") for k in outcome), outcome
    for name in names:
        assert any("accepted on device cpu:0;" in n for n in outcome[name])
        metrics = conn.execute("SELECT metrics FROM tensile.models WHERE name = %s", (name,)).fetchone()[0]
        assert metrics["device"] == "cpu:0" and metrics["budget_nbytes"] == TEST_BUDGET
        assert metrics["peak_device_nbytes"] <= TEST_BUDGET
    assert conn.execute("SELECT peak_bytes FROM tensile.memory WHERE device = 'cpu:1'").fetchone()[0] == 0


@pytest.mark.parametrize("setting, budget, message", [
    ("'gpu:0, gpu:1'", f"'{TEST_BUDGET}'", "tensile.devices entry 'gpu:0' is not a device"),
    ("'cpu:0, cpu:1'", "'3MB, 3MB, 3MB'", "tensile.device_budget is '3MB, 3MB, 3MB': 3 budgets for 2 devices"),
    ("'cpu:0, cuda:0'", f"'{TEST_BUDGET}'", "mixes device kinds")])
def test_device_settings_are_checked(devices, conn, setting, budget, message):
    devices(setting, budget)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
        conn.execute("SELECT tensile.start_coordinator()")


def test_predict_calls_go_where_the_models_layers_are(devices, cluster, conn, dsn, digits):
    devices("'cpu:0, cpu:1'", f"'{TEST_BUDGET}'")
    conn.execute("CALL tensile.train_model(model_name => 'd_served', source => %s, label => 'label', "
                 "architecture => %s, options => %s)",
                 (SOURCE, ARCHITECTURE, '{"epochs": 1, "test_size": 0, "replace": true}'))
    model_id, version = conn.execute(
        "SELECT id, concat_ws('/', d.oid, owner, to_char(created_at AT TIME ZONE 'UTC', "
        "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')) FROM tensile.models, "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) d WHERE name = 'd_served'").fetchone()
    models = cluster.data_dir / "tensile_coordinator" / "models"
    directory = {"cpu:0": models, "cpu:1": models / "cpu-1"}

    def figures() -> dict:
        return {d: (loads, hits) for d, loads, hits in conn.execute(
            "SELECT device, weight_loads, weight_cache_hits FROM tensile.memory").fetchall()}

    query = "SELECT count(*) FROM tensile.predict_batch('d_served', 'SELECT * FROM digits_test')"
    outcome = {}
    thread = _train_in_background(dsn, "d_busy", 5000, outcome)     # one device trains: the call goes to the other
    try:
        assert wait_until(lambda: len(_devices_of(conn, ["d_busy"])) == 1, 60)
        busy = _devices_of(conn, ["d_busy"])["d_busy"]
        assert conn.execute(query).fetchone()[0] > 0
    finally:
        conn.execute("SELECT pg_cancel_backend(%s)", (outcome["d_busy pid"],))
        thread.join(60)
    first = figures()
    (served,) = [d for d, (loads, _) in first.items() if loads > 0]
    assert served != busy and (directory[served] / file_name(model_id, version)).exists()
    assert not (directory[busy] / file_name(model_id, version)).exists()
    assert conn.execute(query).fetchone()[0] > 0                  # both idle: where its layers are
    second = figures()
    assert second[served][1] > first[served][1] and second[busy] == first[busy] == (0, 0)
    conn.execute("SELECT tensile.stop_coordinator()")
    cluster.configure({"tensile.devices": "''"})
    conn.execute("SELECT tensile.start_coordinator()")             # one device: the other's files go
    assert not (models / "cpu-1").exists()
    cluster.configure({"tensile.devices": "'cpu:0, cpu:1'"})
