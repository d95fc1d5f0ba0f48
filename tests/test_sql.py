"""The SQL surface against a real cluster: training, prediction, the registry, the status views,
errors with their messages, concurrency under one budget, privileges, cancellation, the scheduler
policy setting, and the coordinator's lifecycle."""

from __future__ import annotations

import os
import shutil
import site
import tempfile
import threading
import time

import psycopg
import pytest

from conftest import TEST_BUDGET, wait_until
from sql_helpers import FEATURES, assert_nothing_left, error_of, running, train, train_in_background
from tensile_db.scheduler import POLICIES

pytestmark = pytest.mark.db

#: What tensile.jobs.schedule may say.
SCHEDULES = {"cold start", "planned", "reactive"}
#: The scheduler's counters of a job, in train_model's metrics.
SCHEDULER_COUNTERS = ("planned_swap_ins", "passive_swap_ins", "recomputes")


def assert_scheduler_metrics(metrics, policy):
    assert metrics["policy"] == policy
    for key in SCHEDULER_COUNTERS:
        assert isinstance(metrics[key], int) and metrics[key] >= 0, (key, metrics[key])


# --- training and prediction ------------------------------------------------------------------


def test_train_store_and_predict(conn, digits):
    task, metrics, _, _ = train(conn, "t_digits", architecture='{"layers": [{"dense": 128}, {"dense": 64, "activation": "tanh"}]}',
                          options='{"epochs": 15, "seed": 1}')
    assert task == "classification"
    assert metrics["epochs"] == 15 and metrics["samples"] + metrics["test_samples"] == 1347
    assert metrics["test_samples"] == 270 and metrics["accuracy"] > 0.9         # 20% held out by default
    assert metrics["peak_device_nbytes"] <= TEST_BUDGET
    epochs = [n for n in conn.notices if "epoch" in n]
    assert len(epochs) == 15 and "loss" in epochs[-1] and "device" in epochs[-1]

    row = conn.execute("SELECT owner, task, feature_names, label_name, label_classes, metrics, length(weights) "
                       "FROM tensile.models WHERE name = 't_digits'").fetchone()
    assert row[0] == "postgres" and row[1] == "classification"
    assert row[2] == [f"p{i}" for i in range(64)] and row[3] == "label"
    assert row[4] == [float(c) for c in range(10)]
    assert row[5]["train_accuracy"] > 0.95 and row[6] > 0

    accuracy = conn.execute(f"SELECT avg((tensile.predict('t_digits', {FEATURES}) = label)::int) FROM digits_test").fetchone()[0]
    assert accuracy >= 0.93
    proba = conn.execute(f"SELECT tensile.predict_proba('t_digits', {FEATURES}) FROM digits_test LIMIT 1").fetchone()[0]
    assert len(proba) == 10 and abs(sum(proba) - 1) < 1e-5
    assert_nothing_left(conn)


def test_regression_and_default_features(conn, digits):
    conn.execute("DROP TABLE IF EXISTS reg; CREATE TABLE reg AS "
                 "SELECT g::float8 / 100 AS a, (g % 7)::float8 AS b, (3 * g::float8 / 100 - (g % 7) + 5) AS target "
                 "FROM generate_series(1, 600) g")
    task, metrics, _, _ = train(conn, "t_reg", source="reg", label="target", options='{"epochs": 40, "lr": 0.01}')
    assert task == "regression" and metrics["train_rmse"] < 1.0
    feats = conn.execute("SELECT feature_names FROM tensile.models WHERE name = 't_reg'").fetchone()[0]
    assert feats == ["a", "b"]
    value = conn.execute("SELECT tensile.predict('t_reg', ARRAY[2.0, 3.0]::real[])").fetchone()[0]
    assert abs(value - (3 * 2.0 - 3 + 5)) < 1.5


def test_predict_sees_a_replaced_model(conn, digits):
    train(conn, "t_cache")
    first = conn.execute(f"SELECT tensile.predict('t_cache', {FEATURES}) FROM digits_test LIMIT 1").fetchone()[0]
    assert 0 <= first <= 9
    old_id = conn.execute("SELECT id FROM tensile.models WHERE name = 't_cache'").fetchone()[0]
    train(conn, "t_cache", source="SELECT p0, p1, label + 100 AS label FROM digits_train",
          options='{"epochs": 2, "replace": true}')
    new_id = conn.execute("SELECT id FROM tensile.models WHERE name = 't_cache'").fetchone()[0]
    assert new_id != old_id
    second = conn.execute("SELECT tensile.predict('t_cache', ARRAY[p0, p1]) FROM digits_test LIMIT 1").fetchone()[0]
    assert 100 <= second <= 109


def test_predict_under_settings_that_force_parallel_plans(conn, digits):
    train(conn, "t_parallel", options='{"epochs": 1}')
    for setting in ("max_parallel_workers_per_gather = 2", "parallel_setup_cost = 0", "parallel_tuple_cost = 0",
                    "min_parallel_table_scan_size = 0"):
        conn.execute(f"SET {setting}")
    try:
        n = conn.execute(f"SELECT count(tensile.predict('t_parallel', {FEATURES})) FROM digits_test").fetchone()[0]
        assert n == 450
    finally:
        conn.execute("RESET ALL")


def test_python_client(cluster, digits):
    from tensile_db.client import TensileClient

    client = TensileClient(cluster.url("tensile_test"))
    notices = []
    result = client.train("t_client", "SELECT * FROM digits_train", "label", architecture={"layers": [{"dense": 32}]},
                          options={"epochs": 2}, on_notice=notices.append)
    assert result["task"] == "classification" and any("epoch 2/2" in n for n in notices)
    assert "t_client" in [m["name"] for m in client.models()]
    assert client.predict("t_client", [0.0] * 64) in [float(c) for c in range(10)]
    client.drop("t_client")
    assert "t_client" not in [m["name"] for m in client.models()]
    client.engine.dispose()


# --- errors: clear messages, nothing left behind ----------------------------------------------


@pytest.fixture(scope="module")
def messy(dsn):
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS messy; CREATE TABLE messy (a real, b real, name text, label integer)")
        c.execute("INSERT INTO messy SELECT g, g * 2, 'x' || g, g % 2 FROM generate_series(1, 200) g")
        c.execute("UPDATE messy SET a = NULL WHERE label = 1 AND b < 40")
        c.execute("DROP TABLE IF EXISTS empty_t; CREATE TABLE empty_t (a real, label integer)")


@pytest.mark.parametrize("kwargs, message", [
    (dict(source="SELECT * FROM no_such_table"), 'relation "no_such_table" does not exist'),
    (dict(source="messy", label="nope"), 'label column "nope" is not in the source; its columns are: a, b, name, label'),
    (dict(source="messy", features=["a", "zz"]), 'feature column "zz" is not in the source'),
    (dict(source="SELECT a, b, '{}'::json AS doc, label FROM messy"),
     'feature column "doc" has type json, which cannot be a feature: features are numeric'),
    (dict(source="SELECT a, b, '{}'::json AS doc FROM messy", label="doc", features=["b"]),
     'label column "doc" has type json; the label must be numeric or categorical'),
    (dict(source="messy", features=["a", "b"]), 'column "a" has 10 NULLs (of 200 rows)'),
    (dict(source="empty_t"), "the source returned no rows"),
    (dict(source="  "), "source is empty"),
    (dict(architecture='{"layers": [{"dens": 10}]}'), 'architecture.layers[0] must have one of the keys activation, avg_pool, batch_norm, concat, conv, dense, dropout, flatten'),
    (dict(architecture='{"layers": [{"dense": 0}]}'), 'architecture.layers[0]."dense" must be an integer from 1 to 65536, got 0'),
    (dict(architecture='{"layers": [{"dense": 8, "activation": "mish"}]}'), '"activation" must be one of relu, tanh, sigmoid'),
    (dict(options='{"epoch": 3}'), "options: unknown key 'epoch'"),
    (dict(options='{"epochs": "3"}'), 'options.epochs has the wrong type: got "3"'),
    (dict(options='{"optimizer": "lbfgs"}'), "options.optimizer must be one of adam, sgd, got 'lbfgs'"),
    (dict(options='{"task": "regression", "epochs": 1}', label="label", source="SELECT a, b, name FROM messy"),
     'label column "label" is not in the source'),
])
def test_training_errors(conn, messy, kwargs, message):
    name = "t_bad"
    assert message in error_of(conn, train, name, **kwargs)
    assert conn.execute("SELECT count(*) FROM tensile.models WHERE name = %s", (name,)).fetchone()[0] == 0
    assert_nothing_left(conn)


def test_skip_nulls_option(conn, messy):
    train(conn, "t_nulls", source="messy", features=["a", "b"], options='{"epochs": 1, "skip_nulls": true}')
    assert any("10 rows with NULLs skipped" in n for n in conn.notices)
    kept = conn.execute("SELECT (metrics->>'samples')::int + (metrics->>'test_samples')::int FROM tensile.models "
                        "WHERE name = 't_nulls'").fetchone()[0]
    assert kept == 190


def test_existing_model_name(conn, digits):
    train(conn, "t_exists", options='{"epochs": 1}')
    assert train(conn, "t_exists", options='{"epochs": 1}')[2:] == (2, True)       # a second version


def test_invalid_json_is_rejected_by_postgres(conn):
    assert "invalid input syntax for type json" in error_of(conn, train, "t_json", architecture="{layers:")


def test_predict_errors(conn, digits):
    train(conn, "t_pred", options='{"epochs": 1}')
    assert 'model "nope" does not exist' in error_of(conn, lambda c: c.execute("SELECT tensile.predict('nope', ARRAY[1]::real[])"))
    message = error_of(conn, lambda c: c.execute("SELECT tensile.predict('t_pred', ARRAY[1, 2, 3]::real[])"))
    assert 'model "t_pred" expects 64 features (p0, p1' in message and "got 3" in message
    message = error_of(conn, lambda c: c.execute(
        "SELECT tensile.predict('t_pred', array_fill(NULL::real, ARRAY[64]))"))
    assert "features[1] (p0) is NULL" in message
    assert conn.execute("SELECT tensile.predict('t_pred', NULL::real[])").fetchone()[0] is None   # STRICT


def test_working_set_larger_than_budget(conn, digits):
    big = '{"layers": [{"dense": 8192}]}'
    with pytest.raises(psycopg.errors.OutOfMemory) as info:      # SQLSTATE 53200
        train(conn, "t_huge", architecture=big, options='{"epochs": 1}')
    message = str(info.value)
    assert "device out of memory" in message and f"budget {TEST_BUDGET:,} bytes" in message
    assert_nothing_left(conn)


# --- the status views --------------------------------------------------------------------------


def columns(conn, view):
    return conn.execute("SELECT column_name, data_type FROM information_schema.columns "
                        "WHERE table_schema = 'tensile' AND table_name = %s ORDER BY ordinal_position",
                        (view,)).fetchall()


def test_jobs_view_has_the_disk_bytes_and_the_scheduler_columns_after_host_bytes(conn):
    names = [c for c, _ in columns(conn, "jobs")]
    at = names.index("host_bytes")
    assert columns(conn, "jobs")[at + 1:at + 7] == [
        ("disk_bytes", "bigint"), ("policy", "text"), ("schedule", "text"), ("planned_swap_ins", "bigint"), ("passive_swap_ins", "bigint"),
        ("recomputes", "bigint")]


def test_memory_view_has_the_scheduler_columns(conn):
    types = dict(columns(conn, "memory"))
    assert {k: types.get(k) for k in ("policy", "h2d_bytes_per_s", "d2h_bytes_per_s", "plans_made",
                                      "predicted_peak_bytes", "predicted_extra_s")} == {
        "policy": "text", "h2d_bytes_per_s": "double precision", "d2h_bytes_per_s": "double precision",
        "plans_made": "integer", "predicted_peak_bytes": "bigint", "predicted_extra_s": "double precision"}


def test_memory_view_has_the_pool_columns(conn):
    types = dict(columns(conn, "memory"))
    pool_columns = {"pool": "text", "planned_region_bytes": "bigint", "pool_plans_installed": "integer",
                    "planned_allocations": "bigint", "pool_mismatches": "bigint", "planned_arena_bytes": "bigint",
                    "max_live_bytes": "bigint", "general_pool_bytes": "bigint"}
    assert {k: types.get(k) for k in pool_columns} == pool_columns


def test_status_functions_stay_volatile_and_parallel_unsafe(conn):
    rows = conn.execute("SELECT proname, provolatile, proparallel FROM pg_proc "
                        "WHERE pronamespace = 'tensile'::regnamespace AND proname IN ('job_status', 'memory_status') "
                        "ORDER BY proname").fetchall()
    assert rows == [("job_status", "v", "u"), ("memory_status", "v", "u")]


# --- concurrency under one budget --------------------------------------------------------------


def test_three_concurrent_trainings_share_the_budget(dsn, conn, digits):
    architectures = {
        "c_wide": '{"layers": [{"dense": 512, "dropout": 0.1}, {"dense": 256}]}',
        "c_deep": '{"layers": [{"dense": 256}, {"dense": 256}, {"dense": 128}]}',
        "c_tanh": '{"layers": [{"dense": 384, "activation": "tanh"}]}',
    }
    conn.execute("SELECT tensile.stop_coordinator()")        # a fresh high-water mark
    results, errors = {}, []
    seen_running = set()

    def run(name, arch):
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                results[name] = train(c, name, architecture=arch, options='{"epochs": 6, "replace": true}')[:2]
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=item) for item in architectures.items()]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for job in conn.execute("SELECT model_name, state, role, backend_pid, policy, schedule "
                                "FROM tensile.jobs").fetchall():
            assert job[2] == "postgres" and job[3] > 0
            if job[1] == "running":
                seen_running.add(job[0])
                assert job[4] == "tensile" and job[5] in SCHEDULES      # the default policy
        time.sleep(0.05)
    assert not errors, errors
    assert len(seen_running) >= 2            # they really ran at the same time
    for _, metrics in results.values():
        assert_scheduler_metrics(metrics, "tensile")
        assert metrics["planned_swap_ins"] + metrics["passive_swap_ins"] == metrics["swap_ins"]
    assert sum(m["planned_swap_ins"] for _, m in results.values()) > 0       # the plan moved tensors ahead
    policy, h2d, d2h, plans = conn.execute("SELECT policy, h2d_bytes_per_s, d2h_bytes_per_s, plans_made "
                                           "FROM tensile.memory").fetchone()
    assert policy == "tensile" and h2d > 0 and d2h > 0 and plans >= 1
    vanilla = sum(m["vanilla_peak_nbytes"] for _, m in results.values())
    assert vanilla > TEST_BUDGET             # the budget is below the sum of unscheduled peaks
    budget, peak = conn.execute("SELECT budget_bytes, peak_bytes FROM tensile.memory").fetchone()
    assert peak <= budget <= TEST_BUDGET
    assert sum(m["swapped_out_nbytes"] for _, m in results.values()) > 0
    stored = conn.execute("SELECT name FROM tensile.models WHERE name LIKE 'c\\_%' ORDER BY name").fetchall()
    assert [r[0] for r in stored] == sorted(architectures)
    assert_nothing_left(conn)


# --- privileges ----------------------------------------------------------------------------------


def test_roles_train_only_on_what_they_may_select(conn, dsn, digits):
    conn.execute("DROP TABLE IF EXISTS secret; CREATE TABLE secret AS SELECT * FROM digits_train")
    for role in ("analyst", "other"):
        conn.execute(f"DROP OWNED BY {role}" if conn.execute(
            "SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() else "SELECT 1")
        conn.execute(f"DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN")
    conn.execute("GRANT SELECT ON digits_train TO analyst")
    analyst_dsn = dsn.replace("user=postgres", "user=analyst")
    with psycopg.connect(analyst_dsn, autocommit=True) as a:
        assert "permission denied for table secret" in error_of(a, train, "t_secret", source="secret")
        train(a, "t_analyst", options='{"epochs": 1}')
    assert conn.execute("SELECT owner FROM tensile.models WHERE name = 't_analyst'").fetchone()[0] == "analyst"
    assert conn.execute("SELECT count(*) FROM tensile.models WHERE name = 't_secret'").fetchone()[0] == 0
    other_dsn = dsn.replace("user=postgres", "user=other")
    with psycopg.connect(other_dsn, autocommit=True) as o:
        # Models reveal facts about their data: another role neither sees nor uses them ...
        assert o.execute("SELECT count(*) FROM tensile.models WHERE name = 't_analyst'").fetchone()[0] == 0
        assert 'model "t_analyst" does not exist' in error_of(
            o, lambda c: c.execute("SELECT tensile.predict('t_analyst', array_fill(0::real, ARRAY[64]))"))
        assert "does not exist (or is owned by another role)" in error_of(
            o, lambda c: c.execute("SELECT tensile.drop_model('t_analyst')"))
        assert "permission denied for function stop_coordinator" in error_of(
            o, lambda c: c.execute("SELECT tensile.stop_coordinator()"))
    conn.execute("GRANT SELECT ON digits_train TO other")
    with psycopg.connect(other_dsn, autocommit=True) as o:
        message = error_of(o, train, "t_analyst", options='{"epochs": 1}')
        assert 'model "t_analyst" is owned by role analyst; only its owner can train new versions of it' in message
    conn.execute("GRANT analyst TO other")            # ... until the owner shares its role
    with psycopg.connect(other_dsn, autocommit=True) as o:
        assert o.execute("SELECT tensile.predict('t_analyst', array_fill(0::real, ARRAY[64]))").fetchone()[0] in range(10)
        message = error_of(o, train, "t_analyst", options='{"epochs": 1, "replace": true}')
        assert 'model "t_analyst" is owned by role analyst; only its owner can replace it' in message
        assert not any("epoch" in n for n in getattr(o, "notices", []))


def test_sessions_cannot_change_server_settings(conn, dsn, digits):
    """tensile.* settings pick the program spawned as the server's OS user and the shared budget:
    a session's SET must not reach them."""
    conn.execute("SELECT tensile.stop_coordinator()")
    conn.execute("DROP ROLE IF EXISTS mallory; CREATE ROLE mallory LOGIN")
    conn.execute("GRANT SELECT ON digits_train TO mallory")
    marker = tempfile.mktemp(prefix="tensile-evil-")
    script = tempfile.mktemp(prefix="tensile-evil-", suffix=".sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ntouch {marker}\n")
    os.chmod(script, 0o755)
    try:
        with psycopg.connect(dsn.replace("user=postgres", "user=mallory"), autocommit=True) as m:
            m.execute(f"SET tensile.python = '{script}'")
            m.execute("SET tensile.max_active_jobs = '0'")
            m.execute("SET tensile.device_budget = '1kB'")
            m.execute("SET tensile.python_path = '/tmp'")
            m.execute("SET tensile.policy = 'belady'")
            assert m.execute("SELECT tensile.start_coordinator()").fetchone()[0] > 0
            train(m, "t_mallory", options='{"epochs": 1}')        # would be refused or stuck with those values
        assert not os.path.exists(marker)
        assert conn.execute("SELECT budget_bytes, policy FROM tensile.memory").fetchone() == (TEST_BUDGET, "tensile")
    finally:
        os.unlink(script)
        conn.execute("DELETE FROM tensile.models WHERE name = 't_mallory'")


def test_source_query_with_a_trailing_comment(conn, digits):
    train(conn, "t_comment", source="SELECT * FROM digits_train -- every row", options='{"epochs": 1}')
    assert conn.execute("SELECT count(*) FROM tensile.models WHERE name = 't_comment'").fetchone()[0] == 1


# --- cancellation ----------------------------------------------------------------------------------


def test_statement_timeout_cancels_the_job(conn, digits):
    conn.execute("SET statement_timeout = '1500ms'")
    message = error_of(conn, train, "t_timeout", architecture='{"layers": [{"dense": 256}]}', options='{"epochs": 5000}')
    conn.execute("RESET statement_timeout")
    assert "canceling statement due to statement timeout" in message
    assert conn.execute("SELECT count(*) FROM tensile.models WHERE name = 't_timeout'").fetchone()[0] == 0
    assert_nothing_left(conn)


def test_pg_cancel_backend_cancels_the_job(conn, dsn, digits):
    t, outcome = train_in_background(dsn, "t_cancel")
    assert wait_until(lambda: running(conn, "t_cancel"))
    conn.execute("SELECT pg_cancel_backend(%s)", (outcome["pid"],))
    t.join(10)
    assert not t.is_alive()
    assert "canceling statement due to user request" in outcome["error"]
    assert_nothing_left(conn)


# --- the scheduler policy, from the configuration file ---------------------------------------------


@pytest.fixture
def configure_policy(cluster, conn):
    """``configure_policy("'vdnn'")`` writes tensile.policy into tensile.conf and stops the
    coordinator so that the next call starts one with it; the default comes back afterwards."""
    def configure(value):
        conn.execute("SELECT tensile.stop_coordinator()")
        cluster.configure({"tensile.policy": value})
    yield configure
    configure("'tensile'")


def test_configured_policy_reaches_a_fresh_coordinator(configure_policy, conn, dsn, digits):
    policy = "vdnn"
    configure_policy(f"'{policy}'")
    t, outcome = train_in_background(dsn, "t_policy_running")
    try:
        assert wait_until(lambda: running(conn, "t_policy_running"))
        job = conn.execute("SELECT policy, schedule, planned_swap_ins, passive_swap_ins, recomputes FROM tensile.jobs "
                           "WHERE model_name = 't_policy_running'").fetchone()
        assert job[0] == policy and job[1] in SCHEDULES and all(n >= 0 for n in job[2:])
        assert conn.execute("SELECT policy FROM tensile.memory").fetchone()[0] == policy
    finally:
        if "pid" in outcome:
            conn.execute("SELECT pg_cancel_backend(%s)", (outcome["pid"],))
        t.join(10)
    assert "canceling statement due to user request" in outcome["error"]
    _, metrics, _, _ = train(conn, "t_policy", options='{"epochs": 1, "replace": true}')
    assert_scheduler_metrics(metrics, policy)
    stored = conn.execute("SELECT metrics FROM tensile.models WHERE name = 't_policy'").fetchone()[0]
    assert stored["policy"] == policy
    assert_nothing_left(conn)


def test_a_running_job_is_served_from_the_planned_pool_and_tensile_memory_shows_it(conn, dsn, digits):
    t, outcome = train_in_background(dsn, "t_pool")
    try:
        assert wait_until(lambda: running(conn, "t_pool"))
        rows = []       # one reading of the view while serving (a drift re-plan may dissolve the region any time)
        assert wait_until(lambda: rows.append(conn.execute(
            "SELECT pool, planned_region_bytes, pool_plans_installed, planned_allocations, planned_arena_bytes, "
            "max_live_bytes, general_pool_bytes, budget_bytes, per_job FROM tensile.memory").fetchone())
            or rows[-1][0] == "serving", 60)
        _, region, installed, lookups, planned, bound, general, budget, per_job = rows[-1]
        assert installed >= 1 and lookups >= 0 and region == planned
        assert 0 < bound <= planned <= budget and general >= bound
        (job,) = per_job.values()
        assert job["model_name"] == "t_pool" and job["max_live_bytes"] <= job["planned_arena_bytes"]
        assert job["general_pool_bytes"] >= job["max_live_bytes"]
        assert wait_until(lambda: conn.execute("SELECT planned_allocations FROM tensile.memory").fetchone()[0] > lookups)
    finally:
        if "pid" in outcome:
            conn.execute("SELECT pg_cancel_backend(%s)", (outcome["pid"],))
        t.join(10)
    assert "canceling statement due to user request" in outcome["error"]
    assert_nothing_left(conn)


@pytest.fixture
def configure_pool(cluster, conn):
    def configure(value):
        conn.execute("SELECT tensile.stop_coordinator()")
        cluster.configure({"tensile.pool": value})
    yield configure
    configure("'planned'")


def test_configured_general_pool_and_an_unknown_pool(configure_pool, conn, digits):
    configure_pool("'general'")
    _, metrics, _, _ = train(conn, "t_general_pool", options='{"epochs": 2, "replace": true}')
    assert metrics["epochs"] == 2
    assert conn.execute("SELECT pool, pool_plans_installed FROM tensile.memory").fetchone() == ("general only", 0)
    configure_pool("'buddy'")
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:      # SQLSTATE 22023
        conn.execute("SELECT tensile.start_coordinator()")
    assert "tensile.pool is 'buddy'; it must be one of planned, general" in str(info.value)


def test_unknown_policy_in_the_configuration_is_refused(configure_policy, conn):
    configure_policy("'belady'")
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:      # SQLSTATE 22023
        conn.execute("SELECT tensile.start_coordinator()")
    assert f"tensile.policy is 'belady'; it must be one of {', '.join(POLICIES)}" in str(info.value)
    assert conn.execute("SELECT count(*) FROM tensile.memory").fetchone()[0] == 0   # none was started


# --- the coordinator's lifecycle -------------------------------------------------------------------


def test_racing_starts_share_one_coordinator(conn, dsn):
    conn.execute("SELECT tensile.stop_coordinator()")
    pids = []

    def start():
        with psycopg.connect(dsn, autocommit=True) as c:
            pids.append(c.execute("SELECT tensile.start_coordinator()").fetchone()[0])

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(pids) == 4 and len(set(pids)) == 1


def test_coordinator_exits_with_the_postmaster():
    from tensile_db.cluster import EmbeddedCluster

    base = tempfile.mkdtemp(prefix="tensile-life-")
    c = EmbeddedCluster(base, python_paths=[site.getsitepackages()[0]])
    try:
        c.start()
        c.create_database("life")
        with psycopg.connect(c.conninfo("life"), autocommit=True) as conn:
            pid = conn.execute("SELECT tensile.start_coordinator()").fetchone()[0]
            socket_dir = conn.execute("SELECT current_setting('data_directory')").fetchone()[0]
        os.kill(pid, 0)                              # it runs
        c.stop()

        def gone():
            try:
                os.kill(pid, 0)
                return False
            except ProcessLookupError:
                return True
        assert wait_until(gone, 10)
        assert not os.path.exists(os.path.join(socket_dir, "tensile_coordinator", "coordinator.sock"))
    finally:
        c.destroy()
        shutil.rmtree(base, ignore_errors=True)


def test_rows_of_a_megabyte_or_more_travel_in_shared_memory_files(conn):
    # 20,000 rows x 16 real columns (1.3 MB) to the coordinator, for training and again for
    # predict_batch: each message large enough for Note [Shared arrays]
    conn.execute("CREATE TABLE t_large AS SELECT " + ", ".join(f"(random() * 10)::real AS f{i}" for i in range(16))
                 + ", ((g * 7919) % 3) AS label, g AS id FROM generate_series(1, 20000) g")
    features = ", ".join(f"f{i}" for i in range(16))
    _, metrics, _, _ = train(conn, "t_large", source=f"SELECT {features}, label FROM t_large",
                             architecture='{"layers": [{"dense": 16}]}', options='{"epochs": 1, "batch_size": 2000}')
    assert metrics["samples"] + metrics["test_samples"] == 20000
    counts = conn.execute("SELECT count(*), count(DISTINCT id) FROM tensile.predict_batch(model_name => 't_large', "
                          "source => %s, key => 'id')", (f"SELECT id, {features} FROM t_large",)).fetchone()
    assert counts == (20000, 20000)
    conn.execute("SELECT tensile.drop_model('t_large')")
    conn.execute("DROP TABLE t_large")
    assert_nothing_left(conn)
