"""Batch inference from SQL against a real cluster: tensile.predict_batch and tensile.predict_into.

Rows and ids, agreement with the row-by-row tensile.predict / predict_proba, identical outputs for
every prefetch window, the weight cache, the coordinator's model files (served after a restart,
read again from the registry when corrupt), the errors with their SQLSTATEs, NULL handling, writing
into a table, privileges, concurrent calls beside a training job under one budget, a model
replaced while it is used, and cancellation."""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import numpy as np
import psycopg
import pytest

from conftest import TEST_BUDGET, wait_until
from sql_helpers import FEATURES, running, train, train_in_background
from tensile_db.coordinator.address import socket_dir_for
from tensile_db.inference import files
from tensile_db.inference.files import file_name
from tensile_db.runtime import model as models
from tensile_db.runtime.weights import serialize_weights

pytestmark = pytest.mark.db

#: The classifier's hidden layers: four dense layers with the output layer.
DEEP = '{"layers": [{"dense": 64}, {"dense": 32, "activation": "tanh"}, {"dense": 32}]}'
LAYERS = 4
WINDOWS = (1, 2, 3, LAYERS, "all", 50)
BATCH_OPTIONS_KEYS = "window, batch_size, cache, skip_nulls"


def predict_batch(conn, model, source="b_src", key=None, options=None) -> list[tuple]:
    return conn.execute("SELECT id, prediction, probabilities FROM tensile.predict_batch("
                        "model_name => %s, source => %s, key => %s, options => %s)",
                        (model, source, key, json.dumps(options or {}))).fetchall()


def predict_into(conn, model, source, target, key=None, options=None) -> int:
    return conn.execute("CALL tensile.predict_into(model_name => %s, source => %s, target => %s, key => %s, "
                        "options => %s)", (model, source, target, key, json.dumps(options or {}))).fetchone()[0]


def sql_error(conn, fn, *args, **kwargs) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as info:
        fn(conn, *args, **kwargs)
    return info.value


def memory(conn, *columns) -> tuple:
    return conn.execute(f"SELECT {', '.join(columns)} FROM tensile.memory").fetchone()


def assert_no_call_left(conn):
    """No running predict call and no device bytes held but the weight cache's."""
    assert wait_until(lambda: memory(conn, "inference_calls", "in_use_bytes - weight_cache_bytes") == (0, 0))


def store_model(conn, name, architecture, features, classes, seed=0):
    """A classifier with random weights (no training), inserted as the current role."""
    spec = models.ModelSpec(models.parse_architecture(architecture), len(features), len(classes), "classification")
    conn.execute("DELETE FROM tensile.models WHERE name = %s", (name,))
    conn.execute("INSERT INTO tensile.models (name, version, deployed, task, architecture, options, feature_names, "
                 "label_name, label_classes, metrics, weights) "
                 "VALUES (%s, 1, true, 'classification', %s, '{}', %s, 'label', %s, '{}', %s)",
                 (name, architecture, features, classes, serialize_weights(models.init_weights(spec, seed))))


@pytest.fixture(scope="module")
def batch_models(dsn, digits):
    """Tables b_src (digits_test with an id 1..450), b_long (20 copies of it, key k 1..9000, the
    first copy's k its id) and b_reg_src; models b_clf (four dense layers), b_wide (a classifier)
    and b_reg (regression)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS b_src, b_long, b_reg_src")
        c.execute("CREATE TABLE b_src AS SELECT row_number() OVER ()::bigint AS id, * FROM digits_test")
        c.execute("CREATE TABLE b_long AS SELECT (g - 1) * 450 + s.id AS k, s.* "
                  "FROM b_src s CROSS JOIN generate_series(1, 20) g")
        c.execute("CREATE TABLE b_reg_src AS SELECT g AS id, g::float8 / 100 AS a, (g % 7)::float8 AS b, "
                  "(3 * g::float8 / 100 - (g % 7) + 5) AS target FROM generate_series(1, 600) g")
        train(c, "b_clf", architecture=DEEP, options='{"epochs": 3, "replace": true}')
        train(c, "b_wide", architecture='{"layers": [{"dense": 128}]}', options='{"epochs": 2, "replace": true}')
        train(c, "b_reg", source="SELECT a, b, target FROM b_reg_src", label="target",
              options='{"epochs": 20, "lr": 0.01, "replace": true}')
    return ("b_clf", "b_wide", "b_reg")


# --- rows, ids and agreement with the row-by-row functions ----------------------------------------


def test_one_row_per_source_row_agreeing_with_predict_and_predict_proba(conn, batch_models):
    rows = predict_batch(conn, "b_clf", key="id")
    assert sorted(r[0] for r in rows) == list(range(1, 451))
    by_id = {r[0]: r for r in rows}
    expected = conn.execute(f"SELECT id, tensile.predict('b_clf', {FEATURES}), tensile.predict_proba('b_clf', {FEATURES}) "
                            "FROM b_src ORDER BY id").fetchall()
    assert [by_id[i][1] for i, _, _ in expected] == [label for _, label, _ in expected]
    assert all(label in range(10) for _, label, _ in rows)
    batch_p = np.array([by_id[i][2] for i, _, _ in expected])
    assert batch_p.shape == (450, 10)
    assert np.allclose(batch_p, np.array([p for _, _, p in expected]), rtol=1e-5, atol=1e-6)
    assert np.allclose(batch_p.sum(axis=1), 1, atol=1e-5)


def assert_same_predictions(rows, expected):
    """Equal labels and ids; probabilities equal up to float32 rounding (rows batched
    differently may round differently)."""
    assert [r[:2] for r in rows] == [r[:2] for r in expected]
    assert np.allclose([r[2] for r in rows], [r[2] for r in expected], rtol=1e-5, atol=1e-6)


def test_ids_are_ordinals_in_the_source_order_without_a_key(conn, batch_models):
    keyed = {r[0]: r for r in predict_batch(conn, "b_clf", key="id")}
    rows = predict_batch(conn, "b_clf", source="SELECT * FROM b_src ORDER BY id DESC")
    assert [r[0] for r in rows] == list(range(1, 451))
    assert_same_predictions([(451 - i, *rest) for i, *rest in rows], [keyed[i] for i in range(450, 0, -1)])


@pytest.mark.parametrize("key_type", ["smallint", "integer", "bigint"])
def test_integer_key_columns(conn, batch_models, key_type):
    rows = predict_batch(conn, "b_clf", source=f"SELECT *, (id * 10)::{key_type} AS k FROM b_src", key="k")
    assert sorted(r[0] for r in rows) == [i * 10 for i in range(1, 451)]


def test_regression(conn, batch_models):
    rows = predict_batch(conn, "b_reg", source="b_reg_src", key="id")
    expected = conn.execute("SELECT id, tensile.predict('b_reg', ARRAY[a, b]::real[]) FROM b_reg_src ORDER BY id").fetchall()
    assert [r[0] for r in sorted(rows)] == [i for i, _ in expected]
    assert np.allclose([r[1] for r in sorted(rows)], [v for _, v in expected], rtol=1e-5, atol=1e-5)   # float32 sums in another order
    assert all(r[2] is None for r in rows)
    assert conn.execute("SELECT count(*) FROM tensile.predict_batch('b_reg', 'b_reg_src') WHERE class_name IS NOT NULL"
                        ).fetchone()[0] == 0


def test_the_class_name_column_names_the_class_as_predict_label_does(conn, batch_models):
    rows = conn.execute("SELECT b.class_name, tensile.predict_label('b_clf', s), b.prediction FROM b_src s "
                        "JOIN tensile.predict_batch('b_clf', 'b_src', key => 'id') b USING (id)").fetchall()
    assert rows and all(label == single == str(int(prediction)) for label, single, prediction in rows)


# --- the prefetch window ---------------------------------------------------------------------------


def test_every_window_gives_exactly_the_same_outputs(conn, batch_models):
    reference = predict_batch(conn, "b_clf", source="b_long", key="k", options={"window": 1, "batch_size": 100})
    assert len(reference) == 9000
    for window in WINDOWS[1:]:
        assert predict_batch(conn, "b_clf", source="b_long", key="k",
                             options={"window": window, "batch_size": 100}) == reference, window
    for cache in (False, True):
        assert predict_batch(conn, "b_clf", source="b_long", key="k",
                             options={"window": 2, "batch_size": 100, "cache": cache}) == reference, cache
    by_id = {r[0]: r for r in reference}
    for batch_size in (1, 65536):                             # other batches: equal up to float32 rounding
        rows = predict_batch(conn, "b_clf", source="b_src", key="id", options={"batch_size": batch_size})
        assert [r[1] for r in rows] == [by_id[r[0]][1] for r in rows]
        assert np.allclose([r[2] for r in rows], [by_id[r[0]][2] for r in rows], rtol=1e-5, atol=1e-6)


def test_the_cache_option_keeps_layers_resident_for_the_next_call(conn, batch_models):
    conn.execute("SELECT tensile.stop_coordinator()")
    predict_batch(conn, "b_clf", options={"cache": False})
    loads, cached, hits = memory(conn, "weight_loads", "weight_cache_bytes", "weight_cache_hits")
    assert loads >= LAYERS and cached == 0
    predict_batch(conn, "b_clf")
    assert memory(conn, "weight_cache_bytes")[0] > 0
    predict_batch(conn, "b_clf")
    assert memory(conn, "weight_cache_hits")[0] >= hits + LAYERS
    assert_no_call_left(conn)


def test_the_prefetch_window_setting_is_the_default(conn, batch_models):
    reference = predict_batch(conn, "b_clf", key="id", options={"window": 1})
    try:
        for setting in ("1", "3", "all", "ALL", "50"):
            conn.execute(f"SET tensile.prefetch_window = '{setting}'")
            assert predict_batch(conn, "b_clf", key="id") == reference, setting
        for bad in ("0", "two", "-1"):
            conn.execute(f"SET tensile.prefetch_window = '{bad}'")
            error = sql_error(conn, predict_batch, "b_clf")
            assert error.sqlstate == "22023"
            assert f"tensile.prefetch_window is '{bad}'; it must be an integer >= 1 or 'all'" in str(error)
            assert predict_batch(conn, "b_clf", key="id", options={"window": "all"}) == reference  # the option wins
    finally:
        conn.execute("RESET tensile.prefetch_window")
    assert predict_batch(conn, "b_clf", key="id") == reference      # unset (empty) again: the default


# --- errors --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def b_nulls(dsn, batch_models):
    """b_nulls: b_src with p3 NULL in every tenth row (45 rows)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS b_nulls; CREATE TABLE b_nulls AS SELECT * FROM b_src")
        c.execute("UPDATE b_nulls SET p3 = NULL WHERE id % 10 = 0")


@pytest.mark.parametrize("kwargs, sqlstate, message", [
    (dict(options={"windw": 2}), "22023", f"options: unknown key 'windw'; allowed keys: {BATCH_OPTIONS_KEYS}"),
    (dict(options={"window": 0}), "22023", 'options.window must be an integer >= 1 (layers kept loaded ahead of '
                                           'the one computing) or "all", got 0'),
    (dict(options={"window": "most"}), "22023", 'options.window must be an integer >= 1'),
    (dict(options={"window": True}), "22023", 'options.window must be an integer >= 1'),
    (dict(options={"batch_size": 0}), "22023", "options.batch_size must be an integer from 1 to 65536, got 0"),
    (dict(options={"batch_size": 65537}), "22023", "options.batch_size must be an integer from 1 to 65536, got 65537"),
    (dict(options={"cache": "yes"}), "22023", 'options.cache must be true or false, got "yes"'),
    (dict(model="nope"), "42704", 'model "nope" does not exist; SELECT name FROM tensile.models lists the models'),
    (dict(source="SELECT id, p0, p1 FROM b_src"), "22023",
     'feature column "p2" is not in the source; its columns are: id, p0, p1'),
    (dict(source=f"SELECT p0::text AS p0, {', '.join(f'p{i}' for i in range(1, 64))} FROM b_src"), "22023",
     'feature column "p0" has type text'),
    (dict(source="SELECT * FROM no_such_table"), "42P01", 'relation "no_such_table" does not exist'),
    (dict(source=" "), "22023", "source is empty"),
    (dict(key="nokey"), "22023", 'key column "nokey" is not in the source'),
    (dict(source="SELECT *, p0 AS k FROM b_src", key="k"), "22023",
     'key column "k" has type real; the key must be an integer column (smallint, integer, bigint), '
     'or pass key => NULL'),
    (dict(source="SELECT *, id::text AS k FROM b_src", key="k"), "22023", 'key column "k" has type text'),
    (dict(source="SELECT *, id > 3 AS k FROM b_src", key="k"), "22023", 'key column "k" has type boolean'),
    (dict(source="b_nulls"), "22023", 'column "p3" has 45 NULLs (of 450 rows); filter them in the source or '
                                      'pass options => \'{"skip_nulls": true}\''),
    (dict(source="SELECT *, CASE WHEN id > 5 THEN id END AS k FROM b_src", key="k"), "22023",
     'column "k" has 5 NULLs (of 450 rows)'),
])
def test_errors(conn, b_nulls, kwargs, sqlstate, message):
    args = dict(model="b_clf", source="b_src", key=None, options=None) | kwargs
    error = sql_error(conn, predict_batch, args.pop("model"), **args)
    assert error.sqlstate == sqlstate
    assert message in str(error)


def test_a_batch_larger_than_the_budget_is_refused(conn, batch_models):
    error = sql_error(conn, predict_batch, "b_wide", source="b_long", options={"batch_size": 65536})
    assert error.sqlstate == "53200"
    assert "device out of memory" in str(error) and f"budget {TEST_BUDGET:,} bytes" in str(error)
    assert_no_call_left(conn)


def test_skip_nulls_leaves_those_rows_out_and_ordinals_name_source_rows(conn, b_nulls):
    keyed = {r[0]: r for r in predict_batch(conn, "b_clf", key="id")}
    kept = [i for i in range(1, 451) if i % 10]
    rows = predict_batch(conn, "b_clf", source="SELECT * FROM b_nulls ORDER BY id", options={"skip_nulls": True})
    assert [r[0] for r in rows] == kept                     # ordinals count the skipped rows too
    assert_same_predictions(rows, [keyed[i] for i in kept])
    rows = predict_batch(conn, "b_clf", source="b_nulls", key="id", options={"skip_nulls": True})
    assert sorted(r[0] for r in rows) == kept
    rows = predict_batch(conn, "b_clf", source="SELECT *, CASE WHEN id > 5 THEN id END AS k FROM b_src", key="k",
                         options={"skip_nulls": True})
    assert sorted(r[0] for r in rows) == list(range(6, 451))


def test_an_empty_source_gives_no_rows_without_the_coordinator(conn, b_nulls):
    conn.execute("SELECT tensile.stop_coordinator()")
    assert predict_batch(conn, "b_clf", source="SELECT * FROM b_src WHERE false") == []
    assert predict_batch(conn, "b_clf", source="SELECT * FROM b_nulls WHERE p3 IS NULL",
                         options={"skip_nulls": True}) == []
    assert conn.execute("SELECT count(*) FROM tensile.memory").fetchone()[0] == 0      # none was started


# --- predict_into --------------------------------------------------------------------------------


def test_predict_into_creates_appends_and_counts(conn, batch_models):
    conn.execute("DROP TABLE IF EXISTS b_out, b_reg_out, b_bad")
    assert predict_into(conn, "b_clf", "b_src", "b_out", key="id") == 450
    assert conn.execute("SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'b_out' "
                        "ORDER BY ordinal_position").fetchall() == [
        ("id", "bigint"), ("prediction", "double precision"), ("probabilities", "ARRAY")]
    written = conn.execute("SELECT id, prediction, probabilities FROM b_out ORDER BY id").fetchall()
    assert written == sorted(predict_batch(conn, "b_clf", key="id"))
    assert predict_into(conn, "b_clf", "SELECT * FROM b_src WHERE id <= 10", "public.b_out") == 10
    assert conn.execute("SELECT count(*), count(DISTINCT id) FROM b_out").fetchone() == (460, 450)

    assert predict_into(conn, "b_reg", "b_reg_src", "b_reg_out", key="id") == 600
    assert conn.execute("SELECT count(*) FROM b_reg_out WHERE probabilities IS NULL").fetchone()[0] == 600
    assert predict_into(conn, "b_clf", "SELECT * FROM b_src WHERE false", "b_reg_out") == 0

    conn.execute("CREATE TABLE b_bad (id integer, prediction double precision, note text)")
    error = sql_error(conn, predict_into, "b_clf", "b_src", "b_bad")
    assert error.sqlstate == "22023"
    assert ("target b_bad does not fit the rows predict_into writes: column id is integer, not bigint; "
            "column probabilities real[] is missing") in str(error)
    error = sql_error(conn, predict_into, "b_clf", "b_src", "b_out; DROP TABLE b_src")
    assert error.sqlstate == "22023" and "target must be a table name" in str(error)


def test_predict_into_writes_in_the_callers_transaction(conn, batch_models):
    conn.execute("DROP TABLE IF EXISTS b_rolled_back")
    with conn.transaction():
        assert predict_into(conn, "b_clf", "b_src", "b_rolled_back") == 450
        raise psycopg.Rollback()
    assert conn.execute("SELECT to_regclass('b_rolled_back')").fetchone()[0] is None


# --- privileges ----------------------------------------------------------------------------------


def test_roles_predict_only_what_they_may_select_with_models_they_may_see(conn, dsn, batch_models):
    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'b_reader'").fetchone():
        conn.execute("DROP OWNED BY b_reader; DROP ROLE b_reader")
    conn.execute("CREATE ROLE b_reader LOGIN")
    conn.execute("DELETE FROM tensile.models WHERE name = 'b_readers'")
    conn.execute("INSERT INTO tensile.models (name, owner, version, deployed, task, architecture, options, "
                 "feature_names, label_name, label_classes, metrics, weights) SELECT 'b_readers', 'b_reader', 1, true, "
                 "task, architecture, options, feature_names, label_name, label_classes, metrics, weights "
                 "FROM tensile.models WHERE name = 'b_clf' AND deployed")
    with psycopg.connect(dsn.replace("user=postgres", "user=b_reader"), autocommit=True) as r:
        error = sql_error(r, predict_batch, "b_readers")
        assert error.sqlstate == "42501" and "permission denied for table b_src" in str(error)
        conn.execute("GRANT SELECT ON b_src TO b_reader")
        error = sql_error(r, predict_batch, "b_clf")             # another role's model
        assert error.sqlstate == "42704" and 'model "b_clf" does not exist' in str(error)
        assert sorted(predict_batch(r, "b_readers", key="id")) == sorted(predict_batch(conn, "b_clf", key="id"))
    conn.execute("DELETE FROM tensile.models WHERE name = 'b_readers'")


# --- the coordinator's model files ---------------------------------------------------------------


def model_file(conn, cluster, name) -> str:
    """The path of the coordinator's file of the deployed version of ``name``."""
    model_id, version = conn.execute(
        "SELECT id, concat_ws('/', d.oid, owner, to_char(created_at AT TIME ZONE 'UTC', "
        "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')) FROM tensile.models, "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) d WHERE name = %s AND deployed",
        (name,)).fetchone()
    return os.path.join(socket_dir_for(str(cluster.data_dir)), "models", file_name(model_id, version))


def test_a_restarted_coordinator_serves_from_the_model_file_and_reads_a_corrupt_one_again(conn, cluster,
                                                                                           batch_models):
    expected = predict_batch(conn, "b_clf", key="id")
    path = model_file(conn, cluster, "b_clf")
    written = os.stat(path)
    assert stat.S_IMODE(written.st_mode) == 0o600 and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    on_disk = sum(os.path.getsize(os.path.join(os.path.dirname(path), n)) for n in os.listdir(os.path.dirname(path)))
    assert memory(conn, "served_models")[0] >= 1 and memory(conn, "served_file_bytes")[0] == on_disk

    conn.execute("SELECT tensile.stop_coordinator()")
    assert predict_batch(conn, "b_clf", key="id") == expected
    served = os.stat(path)                        # the new coordinator read the file: no weights were sent
    assert (served.st_ino, served.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)

    conn.execute("SELECT tensile.stop_coordinator()")        # nothing cached: the next call reads the file
    with open(path, "rb") as f:
        original = f.read()
    _, _, body_nbytes, _, _ = files.PREFIX.unpack(original[:files.PREFIX.size])
    first_layer = json.loads(original[files.PREFIX.size:files.PREFIX.size + body_nbytes])["layers"][0][0]
    with open(path, "r+b") as f:                  # a float's exponent in the first layer
        f.seek(first_layer + 3)
        f.write(bytes([original[first_layer + 3] ^ 0x40]))
    conn.notices.clear()
    assert predict_batch(conn, "b_clf", key="id") == expected
    assert any("copy of model 'b_clf' was corrupt" in n and "layer 0" in n for n in conn.notices), conn.notices
    with open(path, "rb") as f:
        assert f.read() == original               # rewritten from the registry's weights
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(files.TEMP_PREFIX)]
    assert_no_call_left(conn)


# --- tensile.memory -------------------------------------------------------------------------------


def test_memory_view_has_the_inference_columns_after_the_pool_columns(conn):
    names = conn.execute("SELECT column_name, data_type FROM information_schema.columns "
                         "WHERE table_schema = 'tensile' AND table_name = 'memory' ORDER BY ordinal_position").fetchall()
    at = [n for n, _ in names].index("general_pool_bytes")
    assert names[at + 1:at + 7] == [
        ("inference_calls", "integer"), ("inference_bytes", "bigint"), ("weight_cache_bytes", "bigint"),
        ("weight_loads", "bigint"), ("weight_cache_hits", "bigint"), ("weight_cache_evictions", "bigint")]


def test_batch_functions_declare_volatility_strictness_and_parallel_safety(conn):
    row = conn.execute("SELECT provolatile, proisstrict, proparallel FROM pg_proc "
                       "WHERE oid = 'tensile.predict_batch'::regproc").fetchone()
    assert row == ("s", False, "u")
    assert conn.execute("SELECT prokind FROM pg_proc WHERE oid = 'tensile.predict_into'::regproc").fetchone()[0] == "p"
    for name in ("predict_batch", "predict_into"):
        assert conn.execute(f"SELECT obj_description('tensile.{name}'::regproc, 'pg_proc')").fetchone()[0]


# --- concurrency, replacement, cancellation ------------------------------------------------------


def run_in_threads(dsn, calls) -> tuple[list, list]:
    """Run ``fn(conn)`` of each of ``calls`` on its own connection, at once; their results in order
    and the errors raised."""
    results, errors = [None] * len(calls), []

    def run(i, fn):
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                results[i] = fn(c)
        except Exception as exc:  # reported by the caller's assertion
            errors.append(exc)

    threads = [threading.Thread(target=run, args=item) for item in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, errors


def test_concurrent_calls_beside_a_training_job_give_their_sequential_results(conn, dsn, batch_models):
    sources = {"b_clf": ("b_long", "k"), "b_wide": ("b_long", "k"), "b_reg": ("b_reg_src", "id")}
    sequential = {m: predict_batch(conn, m, source=s, key=k) for m, (s, k) in sources.items()}
    conn.execute("SELECT tensile.stop_coordinator()")         # a fresh high-water mark
    t, outcome = train_in_background(dsn, "b_training")
    try:
        assert wait_until(lambda: running(conn, "b_training"), 30)
        calls = [(m, lambda c, m=m, s=s, k=k: predict_batch(c, m, source=s, key=k))
                 for m, (s, k) in sources.items() for _ in range(2)]
        results, errors = run_in_threads(dsn, [fn for _, fn in calls])
        assert not errors, errors
        assert running(conn, "b_training")                    # the job ran all along
    finally:
        if "pid" in outcome:
            conn.execute("SELECT pg_cancel_backend(%s)", (outcome["pid"],))
        t.join(10)
    for (model, _), rows in zip(calls, results):
        assert rows == sequential[model], model
    # The arena is the budget, so no figure here can exceed it; that no two live tensors share a
    # byte under this load is checked op by op in test_inference.py.
    assert wait_until(lambda: conn.execute("SELECT count(*) FROM tensile.jobs").fetchone()[0] == 0)
    assert_no_call_left(conn)


def test_a_model_replaced_during_calls_predicts_wholly_old_or_wholly_new(conn, dsn, batch_models):
    train(conn, "b_swap", options='{"epochs": 1, "seed": 1, "replace": true}')
    old = predict_batch(conn, "b_swap", source="b_long", key="k")
    done = threading.Event()
    outputs, errors = [], []

    def keep_predicting():
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                while not done.is_set():
                    started = time.monotonic()
                    rows = predict_batch(c, "b_swap", source="b_long", key="k")
                    outputs.append((started, time.monotonic(), rows))
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=keep_predicting) for _ in range(3)]
    for t in threads:
        t.start()
    assert wait_until(lambda: len(outputs) >= 1, 60)
    train(conn, "b_swap", options='{"epochs": 1, "seed": 2, "replace": true}')
    replaced = time.monotonic()                               # the replacement has committed
    new = predict_batch(conn, "b_swap", source="b_long", key="k")
    seen = len(outputs)
    assert wait_until(lambda: len(outputs) >= seen + len(threads), 60)
    done.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert old != new
    assert all(rows == old or rows == new for _, _, rows in outputs)
    assert any(rows == old for _, _, rows in outputs) and any(rows == new for _, _, rows in outputs)
    assert any(start < replaced < end for start, end, _ in outputs)        # calls overlapped the replacement


def test_pg_cancel_backend_stops_a_long_call_and_frees_its_memory(conn, dsn, batch_models):
    features = [f"p{i}" for i in range(8)]
    store_model(conn, "b_slow", '{"layers": [{"dense": 384}, {"dense": 384}, {"dense": 384}]}', features,
                [float(c) for c in range(10)])
    outcome = {}

    def run():
        with psycopg.connect(dsn, autocommit=True) as c:
            outcome["pid"] = c.info.backend_pid
            try:
                predict_batch(c, "b_slow", source="SELECT b.* FROM b_src b CROSS JOIN generate_series(1, 1000)")
            except psycopg.Error as exc:
                outcome["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    try:
        assert wait_until(lambda: (memory(conn, "inference_calls") or (0,))[0] > 0, 60)
    finally:
        assert wait_until(lambda: "pid" in outcome)
        conn.execute("SELECT pg_cancel_backend(%s)", (outcome["pid"],))
        t.join(60)
    assert not t.is_alive()
    assert outcome["error"].sqlstate == "57014"
    assert "canceling statement due to user request" in str(outcome["error"])
    assert_no_call_left(conn)
    conn.execute("DELETE FROM tensile.models WHERE name = 'b_slow'")
