"""The scan that reads training and prediction data (``tensile_db/pg/scan.py``) through the
extension's ``tensile._read_columns`` (``extension/reader.c``): it reads, value for value, what
the ``string_agg`` reader of a database whose tensile_db predates it reads — every type, NULLs
kept or refused, skipped rows, arrays of every shape — and refuses what it must: any file but
its scan file, several statements, more than its limit.
"""

from __future__ import annotations

import json
import re

import psycopg
import pytest

from sql_helpers import train

pytestmark = pytest.mark.db

#: Compares the two readers over one scan, inside the database: each read's counts, then each
#: decoded column bit for bit (a text column: its codes and values), and the kept mask. What they
#: agree on comes back as a NOTICE: the row counts, and the columns compared value by value (0
#: where the scan is refused before decoding, as the product refuses it).
COMPARE = """
import json
import numpy as np
from tensile_db.errors import InvalidArgument
from tensile_db.pg import data, scan
from tensile_db.runtime.preprocess import Categories

def same(a, b):
    if isinstance(a, Categories):
        return isinstance(b, Categories) and a.values == b.values and a.codes.tolist() == b.codes.tolist()
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()

def compared(reads, columns, skip_nulls, want_kept, width):
    fast, slow = reads
    if not skip_nulls and (fast.complete < fast.rows or any(fast.holes.values())):
        return 0                             # refused before decoding, naming the columns
    try:
        widths = {c: scan._array_width(fast, i, c, width, (width,)) for i, (c, t) in enumerate(columns)
                  if t == "real[]"}
    except InvalidArgument:                  # arrays of other sizes: refused before decoding
        return 0
    errors = []
    for read in reads:
        try:
            read.decode(widths)
        except InvalidArgument as e:         # arrays of different dimensions: refused alike
            errors.append(str(e))
    if errors:
        assert len(errors) == 2 and errors[0] == errors[1], errors
        return 0
    (decoded_fast, kept_fast), (decoded_slow, kept_slow) = fast.decode(widths), slow.decode(widths)
    for (c, t), a, b in zip(columns, decoded_fast, decoded_slow):
        assert same(a, b), (c, t, a, b)
    if want_kept and skip_nulls and fast.complete < fast.rows:
        assert kept_fast.tolist() == kept_slow.tolist()
    return len(columns)

def compare(source, columns, skip_nulls=False, want_kept=False, width=None, nullable=()):
    query, types = data._source(plpy, source)
    reads = [reader(plpy, query, types, columns, skip_nulls, want_kept, width, frozenset(nullable))
             for reader in (scan._read_columns, scan._aggregate)]
    for field in ("rows", "complete", "holes", "low", "high", "off"):
        values = [getattr(read, field) for read in reads]
        assert values[0] == values[1], (field, values)
    plpy.notice(json.dumps({"rows": reads[0].rows, "complete": reads[0].complete,
                            "compared": compared(reads, columns, skip_nulls, want_kept, width)}))
"""


def compare(conn, source, columns, **kwargs) -> dict:
    """What the two readers agree on (see COMPARE): rows, complete rows and columns compared."""
    conn.notices.clear()
    conn.execute(f"DO $$\n{COMPARE}\ncompare({source!r}, {columns!r}, **{kwargs!r})\n$$ LANGUAGE plpython3u")
    return json.loads(conn.notices[-1])


@pytest.fixture
def edges(conn):
    """A table of every type the scan reads, with the values each must carry exactly (signed
    zeros, NaN, infinities, extremes, subnormals) and NULLs, enough rows to fill several of the
    reader's buffers."""
    conn.execute("SELECT tensile._bootstrap()")
    conn.execute("CREATE TYPE pg_temp.mood AS ENUM ('sad', 'ok', 'happy')")
    conn.execute("""CREATE TEMP TABLE edges AS
        SELECT g AS id,
               (ARRAY['0', '-0', 'NaN', 'Infinity', '-Infinity', '3.4028235e38', '-1.17549435e-38', '1e-45', '1.5',
                      NULL])[1 + g % 10]::real AS r,
               (ARRAY['0', '-0', 'NaN', 'Infinity', '-Infinity', '1.7976931348623157e308', '5e-324', '-2.5',
                      NULL])[1 + g % 9]::double precision AS d,
               (ARRAY['0', '-0', 'NaN', 'Infinity', '-1e30', '2.5', NULL])[1 + g % 7]::double precision AS dr,
               (ARRAY['0', '-1', '9223372036854775807', '-9223372036854775808', '16777217', NULL])[1 + g % 6]::bigint AS b,
               (ARRAY[0, -32768, 32767, NULL])[1 + g % 4]::smallint AS s,
               (ARRAY[0, 2147483647, -2147483648, 16777217, NULL])[1 + g % 5]::integer AS i,
               (ARRAY[true, false, NULL])[1 + g % 3] AS flag,
               (ARRAY['1.25', '-3.5e10', '1e-30', NULL])[1 + g % 4]::numeric AS n,
               (ARRAY['', 'a', 'Ünïcödé ✓', 'tab' || chr(9) || 'new' || chr(10) || 'line', NULL, repeat('x', 5000)])[1 + g % 6]
                   AS t,
               (ARRAY['v', 'vv', NULL])[1 + g % 3]::varchar(4) AS v,
               (ARRAY['sad', 'ok', 'happy', NULL])[1 + g % 4]::pg_temp.mood AS m,
               (g % 2)::integer AS label
        FROM generate_series(1, 40000) g""")


def test_every_type_reads_as_the_string_agg_reader_reads_it(conn, edges):
    # every column kept where NULL (imputed): no row is refused, each value is compared
    columns = [("r", "real"), ("dr", "real"), ("b", "real"), ("s", "real"), ("i", "real"), ("flag", "real"),
               ("n", "real"), ("d", "double precision"), ("i", "double precision"), ("t", "text"), ("v", "text"),
               ("m", "text"), ("flag", "text"), ("i", "text"), ("label", "double precision")]
    nullable = [c for c, _ in columns if c != "label"]
    assert compare(conn, "SELECT * FROM edges", columns, nullable=nullable) == {
        "rows": 40000, "complete": 40000, "compared": len(columns)}


@pytest.mark.parametrize("skip_nulls", [False, True])
def test_rows_with_a_refused_null_are_counted_and_skipped_alike(conn, edges, skip_nulls):
    columns = [("r", "real"), ("s", "real"), ("t", "text"), ("id", "bigint"), ("s", "bigint"), ("i", "bigint"),
               ("b", "bigint"), ("label", "double precision")]
    got = compare(conn, "SELECT id, r, s, i, b, t, label FROM edges", columns, skip_nulls=skip_nulls, want_kept=True,
                  nullable=["t"])
    # r, s, i and b are NULL in every 10th, 4th, 5th and 6th row: the rows with none of them
    complete = sum(all(g % k for k in (10, 4, 5, 6)) for g in range(1, 40001))
    assert got == {"rows": 40000, "complete": complete, "compared": len(columns) if skip_nulls else 0}


def test_arrays_read_alike_whatever_their_shape_and_holes(conn):
    conn.execute("SELECT tensile._bootstrap()")
    conn.execute("""CREATE TEMP TABLE images AS SELECT g AS id,
        CASE WHEN g % 97 = 0 THEN NULL
             WHEN g % 89 = 0 THEN ARRAY[[1, NULL], [3, 4]]::integer[]
             WHEN g % 83 = 0 THEN ARRAY[1, 2, 3]::integer[]
             WHEN g % 79 = 0 THEN ARRAY[1, 2, 3, 4]::integer[]
             ELSE ARRAY[[g, -g], [g * 2, 0]]::integer[] END AS a, (g % 3) AS label
        FROM generate_series(1, 5000) g""")
    sources = ["SELECT * FROM images",                                    # of other sizes, other dimensions
               "SELECT * FROM images WHERE cardinality(a) = 4 AND array_ndims(a) = 2",    # all read
               "SELECT * FROM images WHERE cardinality(a) = 4 AND array_ndims(a) = 2 AND id % 89 <> 0"]
    compared = {}
    for source in sources:
        for skip_nulls in (False, True):
            for width in (4, None):
                got = compare(conn, source, [("a", "real[]"), ("label", "double precision")], skip_nulls=skip_nulls,
                              want_kept=True, width=width)
                compared[sources.index(source), skip_nulls, width] = got["compared"]
    assert compared[2, False, 4] == compared[2, True, None] == 2       # every array read, value by value
    assert compared[0, False, 4] == 0                                   # NULLs and holes: refused


def test_a_statement_of_the_source_order_reads_every_column_bare(conn, edges):
    """A source whose every column is read is projected bare, in its order, so that PostgreSQL
    hands the scan's tuples over as they are; a column of another type is cast after them."""
    conn.execute("""DO $$
from tensile_db.pg import data, scan
query, types = data._source(plpy, 'SELECT r, s, i, label FROM edges')
statement, at = scan._reading_statement(plpy, query, types, [("label", "double precision"), ("r", "real"),
                                                             ("s", "real"), ("i", "real")])
assert statement.startswith('SELECT r, s, i, label FROM (') and at == [4, 1, 2, 3], (statement, at)
statement, at = scan._reading_statement(plpy, query, types, [("r", "text"), ("r", "real")])
assert statement.startswith('SELECT r, (pg_catalog.to_jsonb(r)') and at == [2, 1], (statement, at)
$$ LANGUAGE plpython3u""")


@pytest.mark.parametrize("fd, message", [
    ("0", "file descriptor 0 is not a scan file"),
    ("-1", "file descriptor -1 is not a scan file"),
    ("1000000", "file descriptor 1000000 is not a scan file"),
])
def test_the_reader_writes_into_its_scan_file_only(conn, fd, message):
    with pytest.raises(psycopg.Error, match=re.escape(message)):
        conn.execute(f"SELECT tensile._read_columns('SELECT 1::real', ARRAY[1], 'f', ARRAY[true], NULL, false, "
                     f"false, {fd}, 1000)")


def test_the_reader_refuses_a_relation_file_of_the_backend(conn, edges):
    """The backend holds its relations' files open: none is a scan file, whatever its number."""
    conn.execute("SELECT count(*) FROM edges")
    conn.execute("""DO $$
import os
def target(f):
    try:
        return os.readlink(f'/proc/self/fd/{f}')
    except FileNotFoundError:                # the directory listing's own
        return ''
files = [f for f in map(int, os.listdir('/proc/self/fd')) if target(f).startswith('/') and '/base/' in target(f)]
assert files
for f in files:
    try:
        plpy.execute(f"SELECT tensile._read_columns('SELECT 1::real', ARRAY[1], 'f', ARRAY[true], NULL, false, false, "
                     f"{f}, 1000)")
    except plpy.SPIError as e:
        assert "is not a scan file" in str(e), str(e)
    else:
        raise AssertionError(f"wrote into {target(f)}")
$$ LANGUAGE plpython3u""")


SCAN_FILE = "import os; fd = os.memfd_create('tensile_db-scan')"


@pytest.mark.parametrize("call, message", [
    ("'SELECT 1::real; SELECT 2::real', ARRAY[1], 'f', ARRAY[true]", "reads exactly one query"),
    ("'SELECT 1::real', ARRAY[1, 2], 'f', ARRAY[true]", "one entry per output column"),
    ("'SELECT 1::real', ARRAY[1], 'x', ARRAY[true]", "kind 'x' of output column 1 is none of f, d, i, t, a"),
    ("'SELECT 1::real', ARRAY[2], 'f', ARRAY[true]", "output column 1 reads statement column 2 of 1"),
    ("'SELECT now()', ARRAY[1], 'f', ARRAY[true]", "cannot read a column of type 1184 as kind 'f'"),
    ("'SELECT 1::real', NULL, 'f', ARRAY[true]", "argument 2 is NULL"),
])
def test_the_reader_refuses_what_it_cannot_read(conn, call, message):
    conn.execute("SELECT tensile._bootstrap()")
    with pytest.raises(psycopg.Error, match=re.escape(message)):
        conn.execute(f"""DO $$
{SCAN_FILE}
plpy.execute(f"SELECT tensile._read_columns({call}, NULL, false, false, {{fd}}, 1000)")
$$ LANGUAGE plpython3u""")


def test_a_scan_beyond_its_limit_stops_before_writing_past_it(conn, edges):
    """Capped below the columns' bytes, the scan stops with SQLSTATE 54000, which the product
    reports naming the limit; at the cap, it reads."""
    nbytes = 40000 * (4 + 8)
    conn.execute(f"""DO $$
{SCAN_FILE}
for cap, fits in (({nbytes} - 1, False), ({nbytes}, True)):
    try:
        plpy.execute(f"SELECT tensile._read_columns('SELECT id::real, id::double precision FROM edges', ARRAY[1, 2], "
                     f"'fd', ARRAY[true, true], NULL, false, false, {{fd}}, {{cap}})")
    except plpy.spiexceptions.ProgramLimitExceeded as e:
        assert not fits and f"more than {{cap}} bytes" in str(e), (cap, str(e))
    else:
        assert fits, cap
from tensile_db.pg import scan
scan.MAX_VALUE_NBYTES = 1000
try:
    scan.scan(plpy, 'SELECT id::real AS a, label FROM edges', {{'a': 700, 'label': 23}},
              [('a', 'real'), ('label', 'double precision')], False)
except Exception as e:
    assert "more than the 1 GB that one scan may read" in str(e), str(e)
else:
    raise AssertionError("read past the limit")
finally:
    scan.MAX_VALUE_NBYTES = (1 << 30) - 1
$$ LANGUAGE plpython3u""")


def test_a_database_whose_tensile_db_predates_the_reader_reads_through_string_agg(cluster, conn):
    conn.execute("DROP DATABASE IF EXISTS tensile_before_reader")
    conn.execute("CREATE DATABASE tensile_before_reader")
    try:
        with psycopg.connect(cluster.conninfo("tensile_before_reader"), autocommit=True) as old:
            old.execute("CREATE EXTENSION tensile_db VERSION '0.6.0' CASCADE")
            assert old.execute("SELECT pg_catalog.to_regproc('tensile._read_columns')").fetchone() == (None,)
            old.execute("CREATE TABLE points AS SELECT i::real AS a, (i % 7)::real AS b, (i % 2) AS label "
                        "FROM generate_series(1, 200) i")
            old.execute("INSERT INTO points VALUES (NULL, 1, 0)")
            with pytest.raises(psycopg.Error, match=r'column "a" has 1 NULL \(of 201 rows\)'):
                train(old, "before_reader", source="SELECT * FROM points")
            metrics = train(old, "before_reader", source="SELECT * FROM points WHERE a IS NOT NULL")[1]
            assert metrics["samples"] + metrics["test_samples"] == 200
            old.execute("ALTER EXTENSION tensile_db UPDATE")        # drops the aggregates, adds the reader
            assert old.execute("SELECT pg_catalog.to_regproc('tensile._pack_float4') IS NULL, "
                               "pg_catalog.to_regproc('tensile._read_columns') IS NOT NULL").fetchone() == (True, True)
            metrics = train(old, "after_reader", source="SELECT * FROM points WHERE a IS NOT NULL")[1]
            assert metrics["samples"] + metrics["test_samples"] == 200
    finally:
        conn.execute("DROP DATABASE tensile_before_reader WITH (FORCE)")


def test_the_scan_names_each_column_with_nulls_and_reads_the_same_rows_as_before(conn):
    conn.execute("CREATE TEMP TABLE gaps AS SELECT i::real AS a, (i % 5)::double precision AS b, i::bigint AS c, "
                 "(i % 3) AS label FROM generate_series(1, 300) i")
    conn.execute("UPDATE gaps SET a = NULL WHERE label = 0 AND c < 40")
    conn.execute("UPDATE gaps SET b = NULL WHERE c IN (100, 101)")
    with pytest.raises(psycopg.Error, match=r'column "a" has 13 NULLs, column "b" has 2 NULLs \(of 300 rows\)'):
        train(conn, "gaps_model", source="SELECT * FROM gaps")
    _, metrics, _, _ = train(conn, "gaps_model", source="SELECT * FROM gaps", options='{"epochs": 2, "skip_nulls": true}')
    assert metrics["samples"] + metrics["test_samples"] == 300 - 13 - 2


def test_many_real_columns_are_read_side_by_side_each_where_it_belongs(conn):
    """150 real columns (more than a function takes arguments) in one row-major block, each column
    its own values, in the order read."""
    columns = ", ".join(["g::real AS f0"] + [f"(g * 1000 + {j})::real AS f{j}" for j in range(1, 150)])
    conn.execute(f"CREATE TEMP TABLE wide AS SELECT {columns}, (g % 2) AS label FROM generate_series(1, 3000) g")
    conn.execute("SELECT tensile._bootstrap()")
    conn.execute("""DO $$
from tensile_db.pg import data
d = data.read_training_data(plpy, 'wide', 'label', None, False)
assert list(d.raw) == [f"f{j}" for j in range(150)] and sorted(d.raw["f0"].tolist()) == list(range(1, 3001)), "f0"
for j in range(1, 150):
    assert (d.raw[f"f{j}"] == d.raw["f0"] * 1000 + j).all(), f"f{j}"
$$ LANGUAGE plpython3u""")


def test_a_dictionary_of_many_long_values_reads_as_the_string_agg_reader_reads_it(conn):
    """100,000 distinct values of 32 to 96 bytes: the dictionary's buffer grows far past its first
    allocation, and must live until the scan has written it out."""
    conn.execute("SELECT tensile._bootstrap()")
    conn.execute("CREATE TEMP TABLE words AS SELECT g AS id, repeat(md5(g::text), 1 + g % 3) AS w, (g % 2) AS label "
                 "FROM generate_series(1, 100000) g")
    assert compare(conn, "SELECT * FROM words", [("w", "text"), ("label", "double precision")]) == {
        "rows": 100000, "complete": 100000, "compared": 2}


def test_the_reader_reads_at_most_a_querys_columns(conn):
    conn.execute("SELECT tensile._bootstrap()")
    with pytest.raises(psycopg.Error, match="reads at most 1664 output columns, not 20000"):
        conn.execute(f"""DO $$
{SCAN_FILE}
plpy.execute(f"SELECT tensile._read_columns('SELECT 1::real', pg_catalog.array_fill(1, ARRAY[20000]), "
             f"repeat('f', 20000), pg_catalog.array_fill(true, ARRAY[20000]), NULL, false, false, {{fd}}, 1000)")
$$ LANGUAGE plpython3u""")


def test_a_scan_inside_the_statement_of_another_is_refused(conn):
    """A source that calls the reader itself (to write into the outer scan's file) is refused, and
    the session scans again afterwards."""
    conn.execute("SELECT tensile._bootstrap()")
    inner = ("SELECT pg_catalog.length(tensile._read_columns(''SELECT 1::real'', ARRAY[1], ''f'', ARRAY[true], NULL, "
             "false, false, 3, 10))::real")
    with pytest.raises(psycopg.Error, match="cannot run inside the statement of another scan"):
        conn.execute(f"""DO $$
{SCAN_FILE}
plpy.execute(f"SELECT tensile._read_columns('{inner}', ARRAY[1], 'f', ARRAY[true], NULL, false, false, {{fd}}, 1000)")
$$ LANGUAGE plpython3u""")
    conn.execute(f"""DO $$
{SCAN_FILE}
plpy.execute(f"SELECT tensile._read_columns('SELECT 1::real', ARRAY[1], 'f', ARRAY[true], NULL, false, false, {{fd}}, 1000)")
$$ LANGUAGE plpython3u""")
