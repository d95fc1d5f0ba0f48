"""The one scan of a source that reads its columns, as the calling role, in the backend.

:func:`scan` reads ``columns`` — ``(name, SQL type)`` pairs: ``real`` (a numeric feature),
``double precision`` (a numeric label), ``bigint`` (a key), ``text`` (a categorical column) or
``real[]`` (an array column) — of every row of one query, in one pass over its rows, and decodes
them with NumPy: numeric columns as float32 / float64 / int64 arrays, a categorical one as
:class:`~tensile_db.runtime.preprocess.Categories`, an array column as (rows, width) float32.

Two readers, the same rows and the same errors:

- ``tensile._read_columns`` (extension 0.7.0; ``extension/reader.c``): the statement around the
  source projects the columns whose type the C function converts itself bare, in the source's
  order, and casts any other to its SQL type (:func:`_reading_statement`); the C function runs it
  and writes every value, in native byte order, from the executor's tuple slot into a memory file
  this module makes (``os.memfd_create``), then seals against writes and maps
  (:func:`~tensile_db.coordinator.protocol.map_sealed`): each column is an array viewed in place
  in the mapping, read-only, with no copy of it in the backend's memory (Note [A sparse scan
  file] in reader.c), and the rows go on to the coordinator as they lie there (Note [Rows sent
  as the scan wrote them] in :mod:`.prepare`). The real columns that refuse NULLs lie side by side in one row-major block
  (their arrays strided views of it, :mod:`tensile_db.runtime.side_by_side`). The function tests
  each row for refused NULLs and counts what the checks below need.
- ``string_agg`` of each value's binary send function (``float4send``, ...), big-endian, a
  categorical value as its UTF-8 length and bytes: the reader of a database whose tensile_db
  predates the C function, one aggregate a column (Note [One row test per row]).

A row is complete when no column read holds a NULL, except the ``nullable`` ones, which keep
theirs for imputation (a numeric one as NaN, so a NaN stored in it is a missing value too; a
categorical one as code -1). Only complete rows are decoded. Where
some rows are not complete, the scan is refused naming each column with NULLs and their count (a
second scan, made only to count them) — or, with ``skip_nulls``, those rows are left out (and,
with ``want_kept``, one byte a row says which were kept). An array column's arrays must each hold
the input shape's number of values (other complete rows are counted, never decoded) and no NULL
element (an array with one is a NULL feature: refused, or skipped with ``skip_nulls``), and all
have the same number of dimensions.

Limit: the columns as read take at most :data:`MAX_VALUE_NBYTES` (1 GB) together: 4 bytes a value
of a ``real`` column (16 of them: about 16 million rows), 8 of a label or key, 4 a value of an
array (with ``string_agg``, about 8); beyond it the scan is refused with a message saying so
(SQLSTATE 22023), before the backend holds more.

Every function, operator and type a statement here adds is qualified with ``pg_catalog`` (or
``tensile``), so the caller's ``search_path`` resolves only the names in ``source``; every
statement built around the source is exactly one query (:func:`run_one`, and the C function's own
test), so text after a ``;`` never runs.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import sys
from dataclasses import dataclass

import numpy as np

from ..coordinator import protocol
from ..errors import InvalidArgument
from ..runtime.preprocess import Categories
from . import oids

#: The name of the memory file ``tensile._read_columns`` writes into; it refuses any other.
SCAN_FILE_NAME = "tensile_db-scan"
#: How one column is read through ``string_agg``: its binary send function and its big-endian
#: dtype (an array's is decoded by :func:`_decode_arrays`).
_SENDS = {"real": ("float4send", ">f4"), "double precision": ("float8send", ">f8"), "bigint": ("int8send", ">i8"),
          "real[]": ("array_send", None)}
#: What ``tensile._read_columns`` writes for each type (its kind letter; reader.c), and the native
#: dtype it writes it in (a ``text`` column: its codes); the types of source column it converts
#: itself (a statement casts any other).
_KINDS = {"real": "f", "double precision": "d", "bigint": "i", "text": "t", "real[]": "a"}
_NATIVE = {"real": np.float32, "double precision": np.float64, "bigint": np.int64, "text": np.int32,
           "real[]": np.float32}
_INTEGERS = {oids.INT2_OID, oids.INT4_OID, oids.INT8_OID}
_BARE = {"real": {oids.FLOAT4_OID, oids.BOOL_OID, *_INTEGERS},
         "double precision": {oids.FLOAT8_OID, oids.FLOAT4_OID, oids.BOOL_OID, *_INTEGERS}, "bigint": _INTEGERS,
         "text": {oids.TEXT_OID, oids.VARCHAR_OID}, "real[]": {oids.FLOAT4_ARRAY_OID}}
#: Bytes array_send writes per value (its length and the float4) and per array besides (ndim,
#: has-NULL flag, element type, and one dimension's size and lower bound).
_ARRAY_VALUE_NBYTES = 8
_ARRAY_HEADER_NBYTES = 20
#: The most bytes the columns of one scan take as read: PostgreSQL's largest value (MaxAllocSize),
#: the C reader's limit (reader.c's MAX_SCAN_NBYTES) and, with string_agg, its one result row's.
MAX_VALUE_NBYTES = (1 << 30) - 1


@dataclass
class Scan:
    """One scan: the decoded columns, each (kept_rows,) of the rows kept, in the source's order
    (an array column (kept_rows, values per row) float32); the rows in the source; and ``kept``,
    (rows,) bool, which rows were kept — only when asked for and some were skipped, else None."""

    columns: list
    rows: int
    kept_rows: int
    kept: np.ndarray | None


@dataclass
class _Read:
    """What a reader found before decoding: the row counts; per array column (by position in
    the columns read) its arrays with NULL elements, least and most values of a complete row's
    array (None without one) and complete rows whose array is not of the input shape's size; and
    ``decode(widths)``, which gives the decoded columns and the kept mask (None if not asked for),
    each array column read as ``widths[name]`` values a row."""

    rows: int
    complete: int
    holes: dict[int, int]
    low: dict[int, int | None]
    high: dict[int, int | None]
    off: dict[int, int]
    decode: object


def several_statements() -> InvalidArgument:
    return InvalidArgument("source must be exactly one query (or a table name); it holds several statements "
                           "separated by ';' — pass only the SELECT")


def run_one(plpy, sql: str):
    """Run one statement built around the user's source. Its plan is first opened as a cursor
    (and closed at once): PostgreSQL opens one only for a plan of exactly one query, before
    executing anything, so a source that smuggles in more statements (``x) s; DROP ...; SELECT
    (1``) runs none of them. Raises InvalidArgument for several statements; PostgreSQL's errors
    of the query itself pass through."""
    plan = plpy.prepare(sql)
    try:
        plpy.cursor(plan).close()
    except plpy.spiexceptions.InvalidCursorDefinition:       # SQLSTATE 34000: a plan of several queries
        raise several_statements() from None
    return plpy.execute(plan)


def scan(plpy, query: str, types: dict[str, int], columns: list[tuple[str, str]], skip_nulls: bool,
         want_kept: bool = False, input_shape: tuple[int, ...] | None = None,
         nullable: frozenset[str] = frozenset()) -> Scan:
    """Read ``columns`` — ``(name, SQL type)`` pairs, the type one of ``real``, ``double
    precision``, ``bigint``, ``text``, ``real[]`` — of every row of ``query`` (whose columns have
    the type OIDs ``types``) in one scan. Raises InvalidArgument naming each column with NULLs (or
    arrays with NULL elements) and their count unless ``skip_nulls``; the columns in ``nullable``
    keep their NULLs instead (a ``real`` one as NaN, a ``text`` one as code -1), for imputation.
    ``want_kept`` asks for the mask of kept rows when rows are skipped. A ``real[]`` column's
    arrays must each hold ``prod(input_shape)`` values (None: as many as each other), else
    InvalidArgument names the rows that differ; arrays of different numbers of dimensions are
    InvalidArgument too, and so are columns beyond :data:`MAX_VALUE_NBYTES` together."""
    width = math.prod(input_shape) if input_shape else None
    reader = plpy.execute("SELECT pg_catalog.to_regprocedure('tensile._read_columns(pg_catalog.text, "
                          "pg_catalog.int4[], pg_catalog.text, pg_catalog.bool[], pg_catalog.int4, pg_catalog.bool, "
                          "pg_catalog.bool, pg_catalog.int4, pg_catalog.int8)') IS NOT NULL AS has")[0]["has"]
    try:
        read = (_read_columns if reader else _aggregate)(plpy, query, types, columns, skip_nulls, want_kept, width,
                                                           nullable)
    except plpy.spiexceptions.ProgramLimitExceeded:     # SQLSTATE 54000: the columns beyond 1 GB
        raise _too_large(columns, width) from None
    arrays = [(i, c) for i, (c, t) in enumerate(columns) if t == "real[]"]
    nulls = {}
    if read.complete < read.rows and not skip_nulls:
        names = list(dict.fromkeys(c for c, _ in columns))
        nulls = _null_counts(plpy, query, names, nullable)
        if not nulls:                   # a source whose rows changed between the scans
            raise InvalidArgument(f"{read.rows - read.complete:,} of {read.rows:,} rows have NULLs in the columns "
                                  f"read (the source gave other rows when counted again); filter them in the source "
                                  f"or pass options => '{{\"skip_nulls\": true}}' to skip such rows")
    holes = {c: read.holes[i] for i, c in arrays if read.holes[i]}
    if (nulls or holes) and not skip_nulls:
        listed = ", ".join([f'column "{c}" has {k:,} NULL{"s" if k > 1 else ""}' for c, k in nulls.items()]
                           + [f'column "{c}" has {k:,} array{"s" if k > 1 else ""} with NULL elements'
                              for c, k in holes.items()])
        raise InvalidArgument(f"{listed} (of {read.rows:,} rows); filter them in the source or pass "
                              f"options => '{{\"skip_nulls\": true}}' to skip such rows")
    widths = {c: _array_width(read, i, c, width, input_shape) for i, c in arrays}
    decoded, kept = read.decode(widths)
    return Scan(decoded, read.rows, read.complete, kept if kept is not None and read.complete < read.rows else None)


def _too_large(columns: list[tuple[str, str]], width: int | None) -> InvalidArgument:
    """The error of a scan whose columns outgrew :data:`MAX_VALUE_NBYTES`."""
    arrays = [c for c, t in columns if t == "real[]"]
    per_row = ""
    if arrays and width:
        row_nbytes = _ARRAY_HEADER_NBYTES + _ARRAY_VALUE_NBYTES * width
        per_row = (f'; the array column "{arrays[0]}" takes about {row_nbytes:,} bytes a row as read, so at most '
                   f"about {MAX_VALUE_NBYTES // row_nbytes:,} rows fit")
    return InvalidArgument(f"the source's rows hold more than the 1 GB that one scan may read (every column read, "
                           f"together){per_row}; read fewer rows or columns at once (a WHERE clause or LIMIT in "
                           f"the source)")


def _array_width(read: _Read, i: int, column: str, width: int | None, input_shape) -> int:
    """The values per row of the array column ``column`` (the ``i``-th read): ``width`` (the
    input shape's) if given, else the one width all its arrays share. Raises InvalidArgument
    naming the rows that differ."""
    low, high, off = read.low[i], read.high[i], read.off[i]
    if off:
        raise InvalidArgument(f'feature column "{column}" has {off:,} rows (of {read.rows:,}) whose arrays do not '
                              f"hold {width:,} values, as architecture.input.shape {list(input_shape)} asks (they "
                              f"hold {low:,} to {high:,}); fix or filter those rows in the source, or give the "
                              f"input shape of the rows")
    if width is None and read.complete and (low != high or high == 0):
        raise InvalidArgument(f'feature column "{column}" holds arrays of {low:,} to {high:,} values; every row must '
                              "hold the same number of values, at least one; fix or filter the others in the "
                              "source")
    return width if width is not None else (high or 0)


def _mixed_dimensions(column: str, ndim: int) -> InvalidArgument:
    return InvalidArgument(f'feature column "{column}" holds arrays of different numbers of dimensions (the first '
                           f"row's has {ndim}); give every row the same shape, or flatten the arrays in the source: "
                           f"ARRAY(SELECT unnest({column}))")


def _null_counts(plpy, query: str, names: list[str], nullable: frozenset[str]) -> dict[str, int]:
    """Column -> its NULLs, of the columns of ``names`` that must have none but do: a second scan,
    made only to say which columns :func:`scan` found rows with NULLs in."""
    refused = [c for c in names if c not in nullable]
    counts = ", ".join(f"pg_catalog.count(*) - pg_catalog.count({plpy.quote_ident(c)}) AS z{i}"
                       for i, c in enumerate(refused))
    row = run_one(plpy, f"SELECT {counts} FROM ({query}\n) AS tensile_source")[0]
    return {c: row[f"z{i}"] for i, c in enumerate(refused) if row[f"z{i}"]}


def _value(plpy, types: dict[str, int], column: str, sql_type: str, nullable: frozenset[str], alias=None) -> str:
    """The SQL of one column's value as read: cast to ``sql_type`` (a boolean through integer;
    NULL as NaN in a ``nullable`` numeric column), a categorical one as text (text and varchar
    as they are, any other type as the text its jsonb carries, as predict reads a row)."""
    name = alias or plpy.quote_ident(column)
    if sql_type == "text":
        if types[column] in (oids.TEXT_OID, oids.VARCHAR_OID):
            return f"{name}::pg_catalog.text"
        return f"(pg_catalog.to_jsonb({name}) OPERATOR(pg_catalog.#>>) '{{}}'::pg_catalog.text[])"
    cast = f"{name}::int::{sql_type}" if types[column] == oids.BOOL_OID else f"{name}::{sql_type}"
    return f"COALESCE({cast}, 'NaN'::{sql_type})" if column in nullable else cast


# -- tensile._read_columns ---------------------------------------------------------------------


def _read_columns(plpy, query: str, types: dict[str, int], columns: list[tuple[str, str]], skip_nulls: bool,
                  want_kept: bool, width: int | None, nullable: frozenset[str]) -> _Read:
    """Read through the extension's ``tensile._read_columns`` into a memory file, mapped here
    read-only once the scan has ended: every column a view of the mapping."""
    statement, at = _reading_statement(plpy, query, types, columns)
    required = [c not in nullable for c, _ in columns]
    fd = os.memfd_create(SCAN_FILE_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        layout = json.loads(plpy.execute(plpy.prepare(
            "SELECT tensile._read_columns($1, $2, $3, $4, $5, $6, $7, $8, $9) AS layout",
            ["pg_catalog.text", "pg_catalog.int4[]", "pg_catalog.text", "pg_catalog.bool[]", "pg_catalog.int4",
             "pg_catalog.bool", "pg_catalog.bool", "pg_catalog.int4", "pg_catalog.int8"]),
            [statement, at, "".join(_KINDS[t] for _, t in columns), required, width,
             skip_nulls, want_kept, fd, MAX_VALUE_NBYTES])[0]["layout"])
        try:              # sealed, its rows go to the coordinator as they lie (Note [Shared arrays])
            mapping = protocol.map_sealed(fd)
        except OSError:
            mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    regions = layout["regions"]
    arrays = {int(i): a for i, a in layout["arrays"].items()}
    complete = layout["complete"]

    def region(k: int, dtype, count: int | None = None) -> np.ndarray:
        offset, nbytes = regions[k]
        return np.frombuffer(mapping, dtype, count=nbytes // np.dtype(dtype).itemsize if count is None else count,
                             offset=offset)

    def decode(widths: dict[str, int]):
        dictionaries = _dictionaries(region(len(columns) + 1, np.uint8))
        # the real columns that refuse NULLs lie side by side in one row-major matrix; one that
        # keeps them (NaN) has a region of its own, where the imputation's column passes read it
        in_matrix = [t == "real" and required for (_, t), required in zip(columns, required)]
        matrix = region(len(columns) + 2, np.float32, complete * sum(in_matrix)).reshape(complete, sum(in_matrix))
        decoded = []
        for i, (c, t) in enumerate(columns):
            if in_matrix[i]:
                decoded.append(matrix[:, sum(in_matrix[:i])])
            elif t == "real[]":
                if arrays[i]["mixed_ndim"]:
                    raise _mixed_dimensions(c, arrays[i]["ndim"])
                decoded.append(region(i, np.float32, complete * widths[c]).reshape(complete, widths[c]))
            elif t == "text":
                decoded.append(Categories(region(i, np.int32), next(dictionaries)))
            else:
                decoded.append(region(i, _NATIVE[t]))
        return decoded, region(len(columns), np.bool_) if want_kept else None

    return _Read(layout["rows"], complete, {i: a["holes"] for i, a in arrays.items()},
                 {i: a["lo"] for i, a in arrays.items()}, {i: a["hi"] for i, a in arrays.items()},
                 {i: a["off"] for i, a in arrays.items()}, decode)


def _reading_statement(plpy, query: str, types: dict[str, int], columns: list[tuple[str, str]]) -> tuple[str, list]:
    """The statement ``tensile._read_columns`` runs around ``query``, and the 1-based statement
    column each of ``columns`` reads. A column whose type the C function converts itself
    (:data:`_BARE`) is projected bare, in the source's order, so that a source whose every column
    is read is scanned without a projection (Note [A sparse scan file] in reader.c); any other is
    cast to its type in the statement (a categorical one to text, as :func:`_value` gives it)."""
    bare = {c for c, t in columns if types[c] in _BARE[t]}
    projected = [plpy.quote_ident(c) for c in types if c in bare]
    position = {c: k + 1 for k, c in enumerate(c for c in types if c in bare)}
    at = []
    for c, t in columns:
        if types[c] in _BARE[t]:
            at.append(position[c])
        else:
            projected.append(_value(plpy, types, c, t, frozenset()))
            at.append(len(projected))
    return f"SELECT {', '.join(projected)} FROM ({query}\n) AS tensile_source", at


def _dictionaries(data: np.ndarray):
    """Each text column's distinct values, in turn, from the dictionary region: per column the
    number of values (int32), then each one's UTF-8 length (int32) and bytes, in native byte order."""
    view, pos = memoryview(data), 0
    while pos < len(view):
        distinct, pos, values = int.from_bytes(view[pos:pos + 4], sys.byteorder), pos + 4, []
        for _ in range(distinct):
            length = int.from_bytes(view[pos:pos + 4], sys.byteorder)
            values.append(str(view[pos + 4:pos + 4 + length], "utf-8"))
            pos += 4 + length
        yield tuple(values)


# -- string_agg, where the extension predates tensile._read_columns -----------------------------


def _aggregate(plpy, query: str, types: dict[str, int], columns: list[tuple[str, str]], skip_nulls: bool,
               want_kept: bool, width: int | None, nullable: frozenset[str]) -> _Read:
    """Read through one statement of ``string_agg`` aggregates (:func:`_aggregate_query`), with
    parallel aggregation off so that no partial aggregates are combined out of order."""
    parallel = plpy.execute("SELECT pg_catalog.current_setting('max_parallel_workers_per_gather') AS old, "
                            "pg_catalog.set_config('max_parallel_workers_per_gather', '0', true)")[0]["old"]
    row = run_one(plpy, _aggregate_query(plpy, query, types, columns, skip_nulls, want_kept, width, nullable))[0]
    plpy.execute("SELECT pg_catalog.set_config('max_parallel_workers_per_gather', "
                 f"{plpy.quote_literal(parallel)}, true)")
    arrays = [i for i, (_, t) in enumerate(columns) if t == "real[]"]
    complete = row["complete"]

    def decode(widths: dict[str, int]):
        decoded = [_decode_arrays(row[f"c{i}"] or b"", complete, widths[c], c) if t == "real[]"
                   else _decode_texts(row[f"c{i}"] or b"", complete) if t == "text"
                   else _native(row[f"c{i}"] or b"", _SENDS[t][1]) for i, (c, t) in enumerate(columns)]
        return decoded, np.frombuffer(row["kept"], dtype=np.bool_) if row.get("kept") else None

    return _Read(row["n"], complete, {i: row[f"holes{i}"] for i in arrays}, {i: row[f"lo{i}"] for i in arrays},
                 {i: row[f"hi{i}"] for i in arrays}, {i: row.get(f"off{i}") or 0 for i in arrays}, decode)


def _aggregate_query(plpy, query: str, types: dict[str, int], columns: list[tuple[str, str]], skip_nulls: bool,
                     want_kept: bool, width: int | None, nullable: frozenset[str]) -> str:
    """The one statement of :func:`_aggregate` around the user's ``query``: the row counts (all,
    and those without a refused NULL), each array column's holes and widths, each column's values
    encoded into one ``bytea`` by ``string_agg`` of its send function, and the kept-rows mask if
    asked.

    Note [One row test per row]: the source's rows pass through a subquery that projects the
    columns read (as ``v0``, ``v1``, ...) and whether the row is complete (``k``: no NULL where one
    is refused); ``OFFSET 0`` keeps PostgreSQL from pulling it up into the aggregates, which would
    evaluate the test again in each aggregate's FILTER (on 1,000,000 rows of 16 columns, about
    1.5 s of a 2.5 s read)."""
    names = list(dict.fromkeys(c for c, _ in columns))
    alias = {c: f"v{j}" for j, c in enumerate(names)}
    ident = plpy.quote_ident

    def aggregate(c, sql_type):
        value = _value(plpy, types, c, sql_type, nullable, alias[c])
        if sql_type == "text":       # each value's UTF-8 length (-1: NULL) and bytes
            utf8 = f"pg_catalog.convert_to({value}, 'UTF8')"
            encoded = (f"CASE WHEN {alias[c]} IS NULL THEN pg_catalog.int4send(-1) ELSE "
                       f"pg_catalog.int4send(pg_catalog.octet_length({utf8})) OPERATOR(pg_catalog.||) {utf8} END")
        else:
            encoded = f"pg_catalog.{_SENDS[sql_type][0]}({value})"
        return f"pg_catalog.string_agg({encoded}, ''::pg_catalog.bytea)"

    def cardinality(c):
        return f"pg_catalog.cardinality({alias[c]})"

    arrays = [(i, c) for i, (c, t) in enumerate(columns) if t == "real[]"]
    complete = " AND ".join([f"{ident(c)} IS NOT NULL" for c in names if c not in nullable]
                            + [f"pg_catalog.num_nulls(VARIADIC {ident(c)}) OPERATOR(pg_catalog.=) 0"
                               for _, c in arrays if skip_nulls]) or "true"
    aggregates = []
    for i, c in arrays:
        aggregates += [f"pg_catalog.count(*) FILTER (WHERE pg_catalog.num_nulls(VARIADIC {alias[c]}) "
                       f"OPERATOR(pg_catalog.>) 0) AS holes{i}",
                       f"pg_catalog.min({cardinality(c)}) FILTER (WHERE k) AS lo{i}",
                       f"pg_catalog.max({cardinality(c)}) FILTER (WHERE k) AS hi{i}"]
        if width is not None:
            aggregates.append(f"pg_catalog.count(*) FILTER (WHERE k AND {cardinality(c)} "
                              f"OPERATOR(pg_catalog.<>) {int(width)}) AS off{i}")

    def read_when(c, t):   # the rows a column's aggregate reads: an array of another width never is
        sized = t == "real[]" and width is not None
        return f"k AND {cardinality(c)} OPERATOR(pg_catalog.=) {int(width)}" if sized else "k"

    aggregates += [f"{aggregate(c, t)} FILTER (WHERE {read_when(c, t)}) AS c{i}" for i, (c, t) in enumerate(columns)]
    if want_kept and skip_nulls:
        aggregates.append("pg_catalog.string_agg(pg_catalog.boolsend(k), ''::pg_catalog.bytea) AS kept")
    projected = ", ".join([f"{ident(c)} AS {alias[c]}" for c in names] + [f"({complete}) AS k"])
    return (f"SELECT pg_catalog.count(*) AS n, pg_catalog.count(*) FILTER (WHERE k) AS complete, "
            f"{', '.join(aggregates)} FROM (SELECT {projected} FROM ({query}\n) AS tensile_source OFFSET 0) "
            f"AS tensile_rows")


def _decode_arrays(data: bytes, rows: int, width: int, column: str) -> np.ndarray:
    """``rows`` arrays of ``width`` values each and no NULL element, as ``string_agg(array_send(
    col::real[]), '')`` wrote them one after another -> (rows, width) float32, each array
    flattened in row-major order. array_send writes big-endian int4 words: ndim, a has-NULL flag,
    the element type, a size and lower bound per dimension, then per value its length (4) and
    the float4 itself; so arrays of one ndim are rows of one length, read in one reshape. Raises
    InvalidArgument when the arrays differ in their number of dimensions."""
    if rows == 0:
        return np.empty((0, width), dtype=np.float32)
    ndim = int.from_bytes(data[:4], "big")
    header = 3 + 2 * ndim                         # int4 words before the first value's length
    stride = header + 2 * width                   # int4 words per array
    words = np.frombuffer(data, dtype=">i4")
    if len(words) != rows * stride or (words.reshape(rows, stride)[:, 0] != ndim).any():
        raise _mixed_dimensions(column, ndim)
    words = words.reshape(rows, stride)
    if words[:, 1].any() or (words[:, 2] != oids.FLOAT4_OID).any() or (words[:, header::2] != 4).any():
        raise RuntimeError(f'array_send of column "{column}" wrote a NULL element or a type other than real')
    return np.frombuffer(data, dtype=">f4").reshape(rows, stride)[:, header + 1::2].astype(np.float32)


def _decode_texts(data: bytes, rows: int) -> Categories:
    """``rows`` values as the ``text`` aggregate wrote them — each a big-endian int4 UTF-8
    length (-1 for NULL) and the bytes — -> :class:`~tensile_db.runtime.preprocess.Categories`:
    one dictionary lookup a row on the value's bytes, a string made only for each distinct value."""
    codes = np.empty(rows, dtype=np.int32)
    lookup: dict[bytes, int] = {}
    view, pos = memoryview(data), 0
    for i in range(rows):
        length = int.from_bytes(view[pos:pos + 4], "big", signed=True)
        pos += 4
        if length < 0:
            codes[i] = -1
            continue
        key = bytes(view[pos:pos + length])
        codes[i] = lookup.setdefault(key, len(lookup))
        pos += length
    if pos != len(data):
        raise RuntimeError(f"the text aggregate wrote {len(data):,} bytes for {rows:,} values, {pos:,} read")
    return Categories(codes, tuple(str(k, "utf-8") for k in lookup))


def _native(data: bytes, big_endian: str) -> np.ndarray:
    """Big-endian values of dtype ``big_endian`` (``">f4"``, ...) as a native-order array: one
    byte swap here, not one in every later operation on the column."""
    dtype = np.dtype(big_endian)
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="))
