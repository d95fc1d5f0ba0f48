"""The extension's C aggregates that read training data (``extension/tensile_db.c``):
``tensile._pack_float4``, ``_pack_float8`` and ``_pack_int8`` give, byte for byte, what
``string_agg(float4send(x), '')`` (``float8send``, ``int8send``) gives over the same rows — NULLs
skipped, NULL over none — and ``_pack_text`` a categorical column dictionary-encoded as the
``string_agg`` reader decodes it;
the training scan reads through them, or through ``string_agg`` in a database whose tensile_db
predates them.
"""

from __future__ import annotations

import re

import numpy as np
import psycopg
import pytest

from sql_helpers import train
from tensile_db.pg import data

pytestmark = pytest.mark.db

#: values each type must carry exactly: signed zeros, NaN, infinities, the extremes, subnormals
EDGES = {
    "real": ["0", "-0", "NaN", "Infinity", "-Infinity", "3.4028235e38", "-1.17549435e-38", "1e-45", "1.5", None],
    "double precision": ["0", "-0", "NaN", "Infinity", "-Infinity", "1.7976931348623157e308", "5e-324",
                         "-2.5", None],
    "bigint": ["0", "-1", "9223372036854775807", "-9223372036854775808", "42", None],
}
SENDS = {"real": ("_pack_float4", "float4send"), "double precision": ("_pack_float8", "float8send"),
         "bigint": ("_pack_int8", "int8send")}


@pytest.mark.parametrize("sql_type", list(EDGES))
def test_a_pack_gives_the_bytes_of_string_agg_of_the_send_function(conn, sql_type):
    pack, send = SENDS[sql_type]
    rows = [(v,) for v in EDGES[sql_type]] * 300          # past the buffer's first growths
    conn.execute(f"CREATE TEMP TABLE edges (x {sql_type})")
    with conn.cursor() as cur, cur.copy("COPY edges FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)
    packed, aggregated, grouped = conn.execute(
        f"SELECT tensile.{pack}(x), pg_catalog.string_agg(pg_catalog.{send}(x), ''::bytea), "
        f"(SELECT pg_catalog.array_agg(p ORDER BY g) FROM (SELECT g, tensile.{pack}(x) AS p "
        f" FROM (SELECT x, row_number() OVER () % 3 AS g FROM edges) t GROUP BY g) s) FROM edges").fetchone()
    assert packed == aggregated
    assert len(packed) == (4 if sql_type == "real" else 8) * sum(v is not None for v, in rows)
    assert all(g is not None for g in grouped)
    dtype = {"real": ">f4", "double precision": ">f8", "bigint": ">i8"}[sql_type]
    values = np.frombuffer(packed, dtype=dtype)[:len(EDGES[sql_type]) - 1]
    expected = np.array([float(v) if sql_type != "bigint" else int(v) for v in EDGES[sql_type][:-1]], dtype=dtype)
    assert values.tobytes() == expected.tobytes()         # -0 stays -0, NaN stays NaN


@pytest.mark.parametrize("pack", ["_pack_float4", "_pack_float8", "_pack_int8", "_pack_text"])
def test_a_pack_over_no_values_is_null(conn, pack):
    # a text NULL is a row: no distinct value, one code -1
    null_result = None if pack != "_pack_text" else b"\x00\x00\x00\x00\xff\xff\xff\xff"
    assert conn.execute(f"SELECT tensile.{pack}(NULL), tensile.{pack}('1') FILTER (WHERE false)").fetchone() == \
        (null_result, None)


def test_a_columns_pack_gives_each_columns_pack_one_after_another(conn):
    conn.execute("CREATE TEMP TABLE three AS SELECT (i * 0.5)::real AS a, (-i)::real AS b, "
                 "(CASE WHEN i % 7 = 0 THEN 'NaN' WHEN i % 11 = 0 THEN '-0' ELSE (i / 3.0)::text END)::real AS c "
                 "FROM generate_series(1, 5000) i")
    together, apart = conn.execute("SELECT tensile._pack_float4_columns(a, b, c), tensile._pack_float4(a) "
                                   "|| tensile._pack_float4(b) || tensile._pack_float4(c) FROM three").fetchone()
    assert together == apart and len(together) == 3 * 4 * 5000
    assert conn.execute("SELECT tensile._pack_float4_columns(a) FILTER (WHERE false) FROM three").fetchone() == (None,)


@pytest.mark.parametrize("call, message", [
    ("tensile._pack_float4_columns(1::real, NULL::real)", "got a NULL in argument 2"),
    ("tensile._pack_float4_columns(1::real, 2::double precision)", "reads real columns only (argument 2)"),
])
def test_a_columns_pack_refuses_a_null_and_a_column_of_another_type(conn, call, message):
    with pytest.raises(psycopg.Error, match=re.escape(message)):
        conn.execute(f"SELECT {call}")


def test_a_text_pack_dictionary_encodes_what_the_string_agg_reader_decodes(conn):
    values = ["", "a", "Ünïcödé ✓", "x" * 5000, None, "tab\tnew\nline", "'quoted'", "a"] * 200
    conn.execute("CREATE TEMP TABLE words (w text)")
    with conn.cursor() as cur, cur.copy("COPY words FROM STDIN") as copy:
        for v in values:
            copy.write_row((v,))
    packed, aggregated = conn.execute(
        "SELECT tensile._pack_text(w), pg_catalog.string_agg(CASE WHEN w IS NULL THEN pg_catalog.int4send(-1) "
        "ELSE pg_catalog.int4send(pg_catalog.octet_length(pg_catalog.convert_to(w, 'UTF8'))) "
        "OPERATOR(pg_catalog.||) pg_catalog.convert_to(w, 'UTF8') END, ''::bytea) FROM words").fetchone()
    fast, slow = data._decode_categories(packed, len(values)), data._decode_texts(aggregated, len(values))
    assert fast.values == slow.values and fast.codes.tolist() == slow.codes.tolist()
    in_scan_order = [w for w, in conn.execute("SELECT w FROM words")]      # not COPY's: a long value moves
    assert sorted(in_scan_order, key=str) == sorted(values, key=str)
    assert [None if c < 0 else fast.values[c] for c in fast.codes] == in_scan_order
    assert list(fast.values) == list(dict.fromkeys(v for v in in_scan_order if v is not None))


def test_a_pack_as_a_running_window_aggregate_gives_each_prefix(conn):
    """Its final function runs once per row over one growing state: each result is its own value."""
    rows = conn.execute("SELECT tensile._pack_float4(i::real) OVER w, "
                        "pg_catalog.string_agg(pg_catalog.float4send(i::real), ''::bytea) OVER w "
                        "FROM generate_series(1, 700) i WINDOW w AS (ORDER BY i)").fetchall()
    assert len(rows) == 700 and all(packed == aggregated for packed, aggregated in rows)


def test_a_database_whose_tensile_db_predates_the_packs_reads_through_string_agg(cluster, conn):
    conn.execute("DROP DATABASE IF EXISTS tensile_before_packs")
    conn.execute("CREATE DATABASE tensile_before_packs")
    try:
        with psycopg.connect(cluster.conninfo("tensile_before_packs"), autocommit=True) as old:
            old.execute("CREATE EXTENSION tensile_db VERSION '0.4.0' CASCADE")
            assert old.execute("SELECT pg_catalog.to_regprocedure('tensile._pack_float4(real)')").fetchone() == (None,)
            old.execute("CREATE TABLE points AS SELECT i::real AS a, (i % 7)::real AS b, (i % 2) AS label "
                        "FROM generate_series(1, 200) i")
            old.execute("INSERT INTO points VALUES (NULL, 1, 0)")
            with pytest.raises(psycopg.Error, match=r'column "a" has 1 NULL \(of 201 rows\)'):
                train(old, "before_packs", source="SELECT * FROM points")
            metrics = train(old, "before_packs", source="SELECT * FROM points WHERE a IS NOT NULL")[1]
            assert metrics["samples"] + metrics["test_samples"] == 200
    finally:
        conn.execute("DROP DATABASE tensile_before_packs WITH (FORCE)")


def test_the_scan_names_each_column_with_nulls_and_reads_the_same_rows_as_before(conn):
    conn.execute("CREATE TEMP TABLE gaps AS SELECT i::real AS a, (i % 5)::double precision AS b, i::bigint AS c, "
                 "(i % 3) AS label FROM generate_series(1, 300) i")
    conn.execute("UPDATE gaps SET a = NULL WHERE label = 0 AND c < 40")
    conn.execute("UPDATE gaps SET b = NULL WHERE c IN (100, 101)")
    with pytest.raises(psycopg.Error, match=r'column "a" has 13 NULLs, column "b" has 2 NULLs \(of 300 rows\)'):
        train(conn, "gaps_model", source="SELECT * FROM gaps")
    _, metrics, _, _ = train(conn, "gaps_model", source="SELECT * FROM gaps", options='{"epochs": 2, "skip_nulls": true}')
    assert metrics["samples"] + metrics["test_samples"] == 300 - 13 - 2


def test_more_real_columns_than_a_function_takes_are_read_by_several_packs(conn):
    """A function takes at most 100 arguments: 150 real columns are read by three packs (64, 64
    and 22 columns), each column's values where they belong."""
    columns = ", ".join(["g::real AS f0"] + [f"(g * 1000 + {j})::real AS f{j}" for j in range(1, 150)])
    conn.execute(f"CREATE TEMP TABLE wide AS SELECT {columns}, (g % 2) AS label FROM generate_series(1, 300) g")
    conn.execute("SELECT tensile._bootstrap()")
    conn.execute("""DO $$
from tensile_db.pg import data
d = data.read_training_data(plpy, 'wide', 'label', None, False)
assert len(d.raw) == 150 and sorted(d.raw["f0"].tolist()) == list(range(1, 301)), "f0"
for j in range(1, 150):
    assert (d.raw[f"f{j}"] == d.raw["f0"] * 1000 + j).all(), f"f{j}"
$$ LANGUAGE plpython3u""")
    assert data._read_together([(f"f{j}", "real") for j in range(150)], True) == [
        list(range(64)), list(range(64, 128)), list(range(128, 150))]
