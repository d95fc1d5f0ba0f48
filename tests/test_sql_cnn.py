"""Convolutional models from SQL against a real cluster: a small CNN trained on the digits as 1x8x8
images, read either as the 64 pixel columns or as one array column; the two give the same weights
and predictions; tensile.predict, predict_batch and predict_into agree row by row; the numeric
array types; and the errors of input shapes, arrays and layers, each before any job starts."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import psycopg
import pytest

from hostile_fixtures import fired
from sql_helpers import assert_nothing_left, error_of, train

pytestmark = pytest.mark.db

PIXELS = [f"p{i}" for i in range(64)]
#: A digit's pixels as one row of 64 values, and as an 8x8 and a 1x8x8 image.
FLAT = "ARRAY[" + ", ".join(PIXELS) + "]::real[]"
ROWS = ["ARRAY[" + ", ".join(PIXELS[8 * r: 8 * r + 8]) + "]" for r in range(8)]
IMAGE = "ARRAY[" + ", ".join(ROWS) + "]::real[]"
IMAGE_3D = "ARRAY[[" + ", ".join(ROWS) + "]]::real[]"
#: conv 16 -> batch norm, relu -> residual block -> max pool -> conv 32 -> global average pool -> dense 64.
CNN = {"input": {"shape": [1, 8, 8]}, "layers": [
    {"conv": 16, "kernel": 3, "padding": 1, "bias": False, "activation": "none"},
    {"batch_norm": {}, "activation": "relu"},
    {"residual": [{"conv": 16, "padding": 1}, {"conv": 16, "padding": 1, "activation": "none"}], "activation": "relu"},
    {"max_pool": 2}, {"conv": 32, "padding": 1}, {"global_avg_pool": {}}, {"dense": 64}]}
#: At batch 32 one training needs about 2.5 MB unscheduled, within the test cluster's budget.
OPTIONS = {"epochs": 20, "batch_size": 32, "lr": 0.002, "seed": 0, "test_size": 0}   # every training row: digits_test measures
#: Batch inference's options: at 256 rows a batch, a convolution's activations exceed the test budget.
BATCH = '{"batch_size": 32}'
#: The least test accuracy the CNN must reach on the held-out digits (chance: 0.1). One seed's
#: accuracy is a draw: over seeds 0 to 11 it ranged 0.956 to 0.982 with the convolutions lowered on
#: NumPy and 0.951 to 0.982 on oneDNN (means 0.973 and 0.968; the two agree to 1e-6 after an epoch,
#: then rounding sends each seed's training its own way), so the bar sits below that spread.
MIN_ACCURACY = 0.94
#: A small model with an input shape, for the cases that only need the data path.
VECTOR = {"input": {"shape": [64]}, "layers": [{"dense": 16}]}


@pytest.fixture(scope="module")
def images(dsn, digits):
    """digits_img_train (img real[] of 8x8, label) in digits_train's row order, and the test rows
    keyed by k: digits_keyed_test (k, p0..p63, label) and digits_img_test (k, img, label)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS digits_img_train, digits_keyed_test, digits_img_test")
        c.execute(f"CREATE TABLE digits_img_train AS SELECT {IMAGE} AS img, label FROM digits_train")
        c.execute("CREATE TABLE digits_keyed_test AS SELECT row_number() OVER () AS k, * FROM digits_test")
        c.execute(f"CREATE TABLE digits_img_test AS SELECT k, {IMAGE} AS img, label FROM digits_keyed_test")
        assert c.execute("SELECT count(*) FROM digits_img_train").fetchone()[0] == digits


@pytest.fixture(scope="module")
def cnn(dsn, images) -> dict[str, float]:
    """The CNN trained with one seed on the pixel columns (cnn_cols) and on the 8x8 real[] column
    (cnn_img); returns each training's seconds."""
    seconds = {}
    with psycopg.connect(dsn, autocommit=True) as c:
        for name, source in (("cnn_cols", "digits_train"), ("cnn_img", "digits_img_train")):
            c.execute("SELECT tensile.drop_model(name) FROM tensile.models WHERE name = %s", (name,))
            started = time.perf_counter()
            train(c, name, source=source, architecture=json.dumps(CNN), options=json.dumps(OPTIONS))
            seconds[name] = time.perf_counter() - started
    return seconds


@pytest.fixture(scope="module")
def vector_columns(dsn, digits) -> dict[str, np.ndarray]:
    """The weights of VECTOR trained for one epoch on the pixel columns."""
    with psycopg.connect(dsn, autocommit=True) as c:
        train(c, "t_vec_columns", source="digits_train", architecture=json.dumps(VECTOR),
              options='{"epochs": 1, "replace": true}')
        return weights_of(c, "t_vec_columns")


def weights_of(conn, name) -> dict[str, np.ndarray]:
    data = conn.execute("SELECT weights FROM tensile.models WHERE name = %s", (name,)).fetchone()[0]
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {k: archive[k] for k in archive.files}


def timings(seconds: float, metrics: dict) -> str:
    return (f"CALL {seconds:.1f} s: read {metrics['read_s']:.3f} s, on the coordinator "
            f"{metrics['train_time_s']:.1f} s, swapped out {metrics['swapped_out_nbytes']:,} bytes")


def predictions(conn, sql) -> np.ndarray:
    return np.array([r[0] for r in conn.execute(sql).fetchall()], dtype=np.float64)


# --- training and prediction ------------------------------------------------------------------


def test_a_cnn_on_the_pixel_columns_as_1x8x8_images(conn, cnn):
    accuracy = conn.execute(f"SELECT avg((tensile.predict('cnn_cols', {FLAT}) = label)::int) "
                            "FROM digits_test").fetchone()[0]
    names, architecture, metrics = conn.execute(
        "SELECT feature_names, architecture, metrics FROM tensile.models WHERE name = 'cnn_cols'").fetchone()
    print(f"cnn_cols: test accuracy {float(accuracy):.4f}; {timings(cnn['cnn_cols'], metrics)}")
    assert float(accuracy) >= MIN_ACCURACY
    assert names == PIXELS and architecture["input"] == {"shape": [1, 8, 8]}
    assert_nothing_left(conn)


def test_an_array_column_trains_the_same_model_as_the_pixel_columns(conn, cnn):
    """The same values in the same row order: the same weights, bit for bit, and the same
    predictions from the image as real[] of any dimensionality."""
    names, metrics = conn.execute("SELECT feature_names, metrics FROM tensile.models WHERE name = 'cnn_img'").fetchone()
    print(f"cnn_img: {timings(cnn['cnn_img'], metrics)}")
    assert names == ["img"]
    cols, img = weights_of(conn, "cnn_cols"), weights_of(conn, "cnn_img")
    assert cols.keys() == img.keys()
    for k in cols:
        assert np.array_equal(cols[k], img[k]), k
    expected = predictions(conn, f"SELECT tensile.predict('cnn_cols', {FLAT}) FROM digits_keyed_test ORDER BY k")
    for argument, source in (("img", "digits_img_test"), (FLAT, "digits_keyed_test"), (IMAGE_3D, "digits_keyed_test")):
        got = predictions(conn, f"SELECT tensile.predict('cnn_img', {argument}) FROM {source} ORDER BY k")
        np.testing.assert_array_equal(got, expected)
    proba_cols = conn.execute(f"SELECT tensile.predict_proba('cnn_cols', {IMAGE_3D}) FROM digits_keyed_test "
                              "ORDER BY k").fetchall()
    proba_img = conn.execute("SELECT tensile.predict_proba('cnn_img', img) FROM digits_img_test ORDER BY k").fetchall()
    np.testing.assert_array_equal(np.array(proba_cols), np.array(proba_img))


@pytest.mark.parametrize("model, source", [("cnn_cols", "digits_keyed_test"), ("cnn_img", "digits_img_test")])
def test_predict_batch_and_predict_into_agree_with_predict(conn, cnn, model, source):
    argument = "img" if model == "cnn_img" else FLAT
    one = conn.execute(f"SELECT k, tensile.predict('{model}', {argument}), "
                       f"tensile.predict_proba('{model}', {argument}) FROM {source} ORDER BY k").fetchall()
    batch = conn.execute("SELECT id, prediction, probabilities FROM tensile.predict_batch(%s, %s, key => 'k', "
                         "options => %s) ORDER BY id", (model, source, BATCH)).fetchall()
    conn.execute("DROP TABLE IF EXISTS cnn_into")
    conn.execute("CALL tensile.predict_into(%s, %s, 'cnn_into', key => 'k', options => %s)", (model, source, BATCH))
    into = conn.execute("SELECT id, prediction, probabilities FROM cnn_into ORDER BY id").fetchall()
    for rows in (batch, into):
        assert [r[0] for r in rows] == [r[0] for r in one]
        assert [r[1] for r in rows] == [r[1] for r in one]
        np.testing.assert_allclose(np.array([r[2] for r in rows]), np.array([r[2] for r in one]), atol=1e-5)
    assert_nothing_left(conn)


@pytest.mark.parametrize("array", [f"{FLAT}::{t}" for t in ("double precision[]", "integer[]", "smallint[]",
                                                               "bigint[]", "numeric[]")] + [FLAT, IMAGE, IMAGE_3D])
def test_every_numeric_array_type_and_shape_gives_the_values_of_the_columns(conn, vector_columns, array):
    """The pixels are whole numbers, so every numeric array type holds the same values; a 1-D,
    8x8 or 1x8x8 array is read flattened in row-major order, as the columns come."""
    train(conn, "t_vec_array", source=f"SELECT {array} AS v, label FROM digits_train", architecture=json.dumps(VECTOR),
          options='{"epochs": 1, "replace": true}')
    got, expected = weights_of(conn, "t_vec_array"), vector_columns
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in expected)


def test_skip_nulls_skips_arrays_with_null_elements(conn, digits):
    source = (f"SELECT CASE WHEN label = 3 THEN {FLAT.replace('p0,', 'NULL,')} ELSE {FLAT} END AS v, label "
              "FROM digits_train")
    threes = conn.execute("SELECT count(*) FROM digits_train WHERE label = 3").fetchone()[0]
    train(conn, "t_vec_holes", source=source, architecture=json.dumps(VECTOR),
          options='{"epochs": 1, "skip_nulls": true, "replace": true}')
    assert any(f"{threes:,} rows with NULLs skipped" in n for n in conn.notices)
    assert conn.execute("SELECT label_classes FROM tensile.models WHERE name = 't_vec_holes'").fetchone()[0] == \
        [c for c in range(10) if c != 3]


# --- errors -------------------------------------------------------------------------------------


def _arch(**changes) -> str:
    return json.dumps({**CNN, **changes})


@pytest.mark.parametrize("kwargs, message", [
    (dict(architecture=_arch(input={"shape": [1, 8, 7]})),
     r"architecture.input.shape \[1, 8, 7\] holds 56 values per row, but the data has 64 feature columns"),
    (dict(source="SELECT CASE WHEN label = 3 THEN img[1:7] ELSE img END AS img, label FROM digits_img_train"),
     r'feature column "img" has {threes} rows \(of {rows}\) whose arrays do not hold 64 values, as '
     r"architecture.input.shape \[1, 8, 8\] asks \(they hold 56 to 64\)"),
    (dict(source=f"SELECT CASE WHEN label = 3 THEN {FLAT.replace('p5,', 'NULL,')} ELSE {FLAT} END AS img, label "
                 "FROM digits_train"),
     r'column "img" has {threes} arrays with NULL elements \(of {rows} rows\); filter them in the source or pass '
     r"options => '\{{\"skip_nulls\": true\}}'"),
    (dict(source="SELECT CASE WHEN label = 3 THEN ARRAY(SELECT unnest(img)) ELSE img END AS img, label "
                 "FROM digits_img_train"),
     r'feature column "img" holds arrays of different numbers of dimensions'),
    (dict(source="SELECT img, 1::real AS extra, label FROM digits_img_train"),
     r'the feature columns mix the array column "img" \(real\[\]\) with "extra"; an array column holds all of a '
     r"row's values, so it must be the only feature; pass features => ARRAY\['img'\] to train on it alone"),
    (dict(source="digits_img_train", architecture='{"layers": [{"dense": 16}]}'),
     r'feature column "img" is an array \(real\[\]\); give the shape of the values it holds in the architecture'),
    (dict(source="SELECT img::text[] AS img, label FROM digits_img_train", features=["img"]),
     r'feature column "img" has type text\[\], which cannot be a feature'),
    (dict(architecture=_arch(layers=[{"conv": 8}, {"conv": 8, "kernel": 0}])),
     r'architecture.layers\[1\]."kernel" must be an integer from 1 to 64'),
    (dict(architecture=_arch(layers=[{"conv": 8}, {"max_pool": 2}, {"conv": 8, "kernel": 5}])),
     r"architecture.layers\[2\]: a \[5, 5\] window .* does not fit its input of 3x3"),
])
def test_shape_array_and_layer_errors_come_before_any_job(conn, images, kwargs, message):
    rows, threes = conn.execute("SELECT count(*), count(*) FILTER (WHERE label = 3) FROM digits_train").fetchone()
    kwargs = {"source": "digits_train", "architecture": json.dumps(CNN), "options": '{"epochs": 1}', **kwargs}
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message.format(rows=f"{rows:,}", threes=threes)):
        train(conn, "t_cnn_bad", **kwargs)
    assert not any("accepted" in n for n in conn.notices)
    assert conn.execute("SELECT count(*) FROM tensile.models WHERE name = 't_cnn_bad'").fetchone()[0] == 0
    assert_nothing_left(conn)


@pytest.mark.parametrize("features, message", [
    ("(img)[1:7]", r'model "cnn_img" expects 64 values \(input shape \[1, 8, 8\], as in column img\), got 56'),
    ("array_fill(0::real, ARRAY[65])", r"expects 64 values .*, got 65"),
    (f"{FLAT.replace('p4,', '''real 'NaN',''')}", r"features\[5\] \(img\[5\]\) is nan"),
    (f"{FLAT.replace('p4,', 'NULL,')}", r"features\[5\] \(img\[5\]\) is NULL"),
])
def test_predict_errors_of_a_cnn(conn, cnn, features, message):
    source = "digits_img_test" if features.startswith("(img)") else "digits_keyed_test"
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
        conn.execute(f"SELECT tensile.predict('cnn_img', {features}) FROM {source} LIMIT 1")


def test_predict_batch_refuses_a_scalar_column_where_the_model_reads_an_array(conn, cnn):
    message = error_of(conn, lambda c: c.execute(
        "SELECT * FROM tensile.predict_batch('cnn_img', 'SELECT p0 AS img FROM digits_test')"))
    assert ("the model takes 64 values per row, as architecture.input.shape [1, 8, 8] says, from the array column "
            "\"img\", but the source's \"img\" has type real; give the source that column as an array of 64 "
            "numbers") in message


# --- search_path --------------------------------------------------------------------------------

#: Functions, aggregates and operators the array path's SQL uses, planted for real[] / integer
#: arguments (an exact type match wins over pg_catalog's polymorphic ones) by mallory.
ARRAY_TROJANS = r"""
SET ROLE mallory;
CREATE FUNCTION evil.array_send(real[]) RETURNS bytea LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('array_send'); RETURN pg_catalog.array_send($1); END $$;
CREATE FUNCTION evil.cardinality(real[]) RETURNS integer LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('cardinality'); RETURN pg_catalog.cardinality($1); END $$;
CREATE FUNCTION evil.num_nulls(VARIADIC real[]) RETURNS integer LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('num_nulls'); RETURN pg_catalog.num_nulls(VARIADIC $1); END $$;
CREATE FUNCTION evil.int4_min(integer, integer) RETURNS integer LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('min(integer)'); RETURN pg_catalog.int4smaller($1, $2); END $$;
CREATE AGGREGATE evil.min(integer) (SFUNC = evil.int4_min, STYPE = integer);
CREATE FUNCTION evil.int4_eq(integer, integer) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('integer = integer'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR evil.= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = evil.int4_eq);
CREATE FUNCTION evil.int4_ne(integer, integer) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN PERFORM evil.fire('integer <> integer'); RETURN $1 OPERATOR(pg_catalog.<>) $2; END $$;
CREATE OPERATOR evil.<> (LEFTARG = integer, RIGHTARG = integer, FUNCTION = evil.int4_ne);
RESET ROLE;
"""


def test_array_trojans_on_a_superusers_search_path_never_run(conn, images, trojans):
    """The array path's SQL (array_send, cardinality, num_nulls, min / max, = and <> on integers)
    must not run objects another role planted on a superuser's search_path."""
    conn.execute(ARRAY_TROJANS)
    conn.execute("SET search_path = evil, pg_catalog, public")
    conn.execute("SELECT array_send(img), num_nulls(VARIADIC img) FROM digits_img_train LIMIT 1")
    conn.execute("SELECT min(cardinality(img)), count(*) FILTER (WHERE cardinality(img) = 64 AND "
                 "cardinality(img) <> 63) FROM digits_img_train")
    assert set(fired(conn)) >= {"array_send", "cardinality", "num_nulls", "min(integer)", "integer = integer",
                                "integer <> integer"}
    conn.execute("TRUNCATE evil.fired")
    architecture = json.dumps({**VECTOR, "input": {"shape": [1, 8, 8]}})
    train(conn, "t_trojan_img", source="digits_img_train", architecture=architecture, options='{"epochs": 1}')
    train(conn, "t_trojan_img", source="digits_img_train", architecture=architecture,
          options='{"epochs": 1, "skip_nulls": true, "replace": true}')
    conn.execute("SELECT tensile.predict('t_trojan_img', img) FROM digits_img_test LIMIT 3")
    assert fired(conn) == []
    conn.execute("SELECT * FROM tensile.predict_batch('t_trojan_img', 'digits_img_test', key => 'k')")
    conn.execute("SELECT * FROM tensile.predict_batch('t_trojan_img', 'digits_img_test', "
                 "options => '{\"skip_nulls\": true}')")
    conn.execute("SELECT tensile.drop_model('t_trojan_img')")
    assert fired(conn) == []
