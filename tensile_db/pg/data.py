"""Reading rows through SPI, as the calling role: training data and the features to predict.

All columns are read in one scan of the source with the extension's C aggregates
(``extension/tensile_db.c``): ``tensile._pack_float4_columns(a::real, b::real, ...)`` for every
numeric feature at once (one call a row, each column's values big-endian one after another),
``_pack_float8`` for a numeric label and ``_pack_int8`` for an integer key (each non-NULL value
big-endian in one buffer: the bytes of ``string_agg(float8send(col), '')``, which a database
whose tensile_db predates them reads through instead, one aggregate a column), decoded with
``numpy.frombuffer``; a categorical column (text, varchar, char, enum, boolean and domains over
them: type categories S, E, B) by ``tensile._pack_text``, dictionary-encoded as it is read (its
distinct values' UTF-8 bytes, then a code a row, -1 for NULL; without the extension, each value's
UTF-8 bytes after its int4 length, -1 for NULL), decoded into
:class:`~tensile_db.runtime.preprocess.Categories`. Which columns are which is :func:`_kinds`;
any other type (json, geometry, dates, ...) is refused by name, never skipped
(:mod:`tensile_db.runtime.preprocess` turns the raw columns into the network's inputs). Every
aggregate of one Agg node sees the rows in the same order, so the columns stay aligned. The
numeric aggregates skip NULLs, so the scan counts the rows without a NULL where one is refused
(Note [One row test per row]); where some have one, it is either reported, naming each such
column and its count (a second scan, made only to count them), or — with ``skip_nulls`` — every
aggregate is filtered to the rows without any NULL (and, where rows are named by their ordinal,
one byte a row says which were kept). A column whose missing values the
model imputes keeps its NULLs instead: a numeric one reads them as NaN (``COALESCE(col::real,
'NaN')``, so a NaN stored in it is a missing value too), a categorical one as None. Parallel
aggregation is switched off for the scan so that no partial aggregates are combined.

A row's features may instead be one numeric array column (``real[]``, ``double precision[]``,
``smallint[]``, ``integer[]``, ``bigint[]``, ``numeric[]``) holding the row's values — an image
of the architecture's input shape ``[C, H, W]``, or a vector of shape ``[F]`` — in any
dimensionality, flattened in row-major order. The same scan then aggregates
``array_send(col::real[])`` (per array: ndim, a has-NULL flag and the element type, a size and
lower bound per dimension, then each element's length and value, all big-endian int4 / float4),
decoded with NumPy in one reshape. Every row must hold exactly the input shape's number of values
(``cardinality``; other rows are counted, never aggregated, so one huge array cannot make the scan
allocate) and no NULL element (``num_nulls(VARIADIC col)``: a NULL element is a NULL feature, so
``skip_nulls`` skips that row), and all rows must have the same number of dimensions. An array
column is the only feature: mixed with other feature columns it is refused, naming them. A model
trained on one stores that column's name once in ``feature_names``; its width comes from its
architecture's input shape (:meth:`~tensile_db.runtime.model.ModelSpec.of_row`).

The source is exactly one query (or a table name): one with several statements is refused by
name (``sqlparse`` splits it), and every statement built around it runs through a cursor, which
PostgreSQL opens only for a plan of exactly one query, so text after a ``;`` never runs even where
the split and the server's parser disagree. Every function, operator and type the scan adds is qualified
with ``pg_catalog``, so the caller's ``search_path`` resolves only the names in ``source``.

Limit: the scan's one result row holds every column read, and PostgreSQL refuses a row or a value
over 1 GB: the bytes of all the columns as read must stay under it together, 4 bytes a value of a
``real`` column (16 of them: about 16 million rows), 8 of a label or key, for an array column
about 8 a value (e.g. 2 million 8x8 images); beyond it the scan is refused with a message saying
so (SQLSTATE 22023). (64 real columns of 4,300,000 rows, 17 MB each, were refused so with an
aggregate a column too.)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from ..runtime.model import FLOAT32_MAX
from ..runtime.preprocess import MAX_CATEGORY_CHARS, Categories, check_configured

#: PostgreSQL's type OIDs of the types read here (``src/include/catalog/pg_type.dat``).
BOOL_OID, INT8_OID, INT2_OID, INT4_OID, FLOAT4_OID, FLOAT8_OID, NUMERIC_OID = 16, 20, 21, 23, 700, 701, 1700
TEXT_OID, VARCHAR_OID = 25, 1043
INT2_ARRAY_OID, INT4_ARRAY_OID, INT8_ARRAY_OID, FLOAT4_ARRAY_OID, FLOAT8_ARRAY_OID, NUMERIC_ARRAY_OID = (
    1005, 1007, 1016, 1021, 1022, 1231)
#: Type OIDs accepted as numeric input, with their SQL names.
NUMERIC_TYPES = {BOOL_OID: "boolean", INT8_OID: "bigint", INT2_OID: "smallint", INT4_OID: "integer",
                 FLOAT4_OID: "real", FLOAT8_OID: "double precision", NUMERIC_OID: "numeric"}
INTEGER_TYPES = {BOOL_OID, INT8_OID, INT2_OID, INT4_OID}
#: Type OIDs a key column may have: the integers, not boolean.
KEY_TYPES = {INT2_OID: "smallint", INT4_OID: "integer", INT8_OID: "bigint"}
#: Array type OIDs accepted as the one feature column that holds a row's values, with their SQL names.
ARRAY_TYPES = {INT2_ARRAY_OID: "smallint[]", INT4_ARRAY_OID: "integer[]", INT8_ARRAY_OID: "bigint[]",
               FLOAT4_ARRAY_OID: "real[]", FLOAT8_ARRAY_OID: "double precision[]", NUMERIC_ARRAY_OID: "numeric[]"}
#: More distinct labels than this is almost surely a regression target.
MAX_CLASSES = 10_000
_TABLE_NAME = re.compile(r'^("[^"]+"|[A-Za-z_][A-Za-z0-9_$]*)(\.("[^"]+"|[A-Za-z_][A-Za-z0-9_$]*))?$')
#: How one column is read: the SQL type it is cast to, its binary send function, its big-endian
#: dtype (an array's is decoded by :func:`_decode_arrays`).
_ENCODINGS = {"real": ("float4send", ">f4"), "double precision": ("float8send", ">f8"), "bigint": ("int8send", ">i8"),
              "real[]": ("array_send", None)}
#: The extension's aggregate that reads a column as each encoding but ``real`` (whose columns
#: ``tensile._pack_float4_columns`` reads together): the bytes of the send function's string_agg,
#: or a categorical column dictionary-encoded (extension/tensile_db.c; absent from a database
#: whose tensile_db predates them).
_PACKS = {"double precision": "_pack_float8", "bigint": "_pack_int8", "text": "_pack_text"}
#: Real columns one ``tensile._pack_float4_columns`` reads at most (a function takes 100 arguments).
PACKED_COLUMNS = 64
#: Bytes array_send writes per value (its length and the float4) and per array besides (ndim,
#: has-NULL flag, element type, and one dimension's size and lower bound).
_ARRAY_VALUE_NBYTES = 8
_ARRAY_HEADER_NBYTES = 20
#: PostgreSQL's largest value (and an aggregate's result), bytes: MaxAllocSize.
MAX_VALUE_NBYTES = (1 << 30) - 1


@dataclass
class TrainingData:
    """raw: each feature column's values as read (:meth:`~tensile_db.runtime.preprocess.Preprocessor.transform`
    takes them: numeric (N,) float32 with NaN for a NULL kept for imputation, categorical
    :class:`~tensile_db.runtime.preprocess.Categories`, array (N, width) float32); kinds: feature
    column -> kind, in order; y: the label, (N,) float64 (numeric) or Categories; row counts before and after
    dropping rows with NULLs; array_width: values per row of an array column (None: none)."""

    raw: dict[str, np.ndarray]
    kinds: dict[str, str]
    y: np.ndarray
    feature_names: list[str]
    label: str
    label_kind: str
    label_is_integer: bool
    rows: int
    skipped_rows: int
    array_width: int | None = None


@dataclass
class Features:
    """raw: the model's raw feature columns of the rows kept, in the source's order (as
    :class:`TrainingData`); ids: (N,) int64, the key column's values or the rows' 1-based
    ordinals in the source (skipped rows counted, so an ordinal always names the same source
    row); rows: rows in the source; skipped_rows: rows left out for a NULL."""

    raw: dict[str, np.ndarray]
    ids: np.ndarray
    rows: int
    skipped_rows: int


@dataclass
class _Scan:
    """One scan: the decoded columns, each (kept_rows,) of the rows kept, in the source's order
    (an array column (kept_rows, values per row) float32); the rows in the source; and ``kept``,
    (rows,) bool, which rows were kept — only when asked for and some were skipped, else None."""

    columns: list[np.ndarray]
    rows: int
    kept_rows: int
    kept: np.ndarray | None


def source_query(source: str | None) -> str:
    """The SQL of a source given as a query or a (schema-qualified) table name."""
    text = (source or "").strip().rstrip(";").strip()
    if not text:
        raise InvalidArgument("source is empty; pass a query such as 'SELECT * FROM my_table' or a table name")
    if ";" in text:
        import sqlparse  # only for sources that may hold several statements

        if len([s for s in sqlparse.split(text) if s.strip()]) > 1:
            raise _several_statements()
    return f"SELECT * FROM {text}" if is_table_name(text) else text


def _several_statements() -> InvalidArgument:
    return InvalidArgument("source must be exactly one query (or a table name); it holds several statements "
                           "separated by ';' — pass only the SELECT")


def _source(plpy, source: str | None) -> tuple[str, dict[str, int]]:
    """The source's query and its columns' type OIDs (see :func:`_column_types`)."""
    query = source_query(source)
    return query, _column_types(plpy, query)


def is_table_name(name: str | None) -> bool:
    """Whether ``name`` is a plain or schema-qualified table name (identifiers, quoted or not)."""
    return bool(name and _TABLE_NAME.match(name))


def _type_name(plpy, oid: int) -> str:
    known = NUMERIC_TYPES.get(oid) or ARRAY_TYPES.get(oid)
    return known or plpy.execute(f"SELECT pg_catalog.format_type({int(oid)}, NULL) AS t")[0]["t"]


def _run_one(plpy, sql: str):
    """Run one statement built around the user's source. Its plan is first opened as a cursor
    (and closed at once): PostgreSQL opens one only for a plan of exactly one query, before
    executing anything, so a source that smuggles in more statements (``x) s; DROP ...; SELECT
    (1``) runs none of them. Raises InvalidArgument for several statements; PostgreSQL's errors
    of the query itself pass through."""
    plan = plpy.prepare(sql)
    try:
        plpy.cursor(plan).close()
    except plpy.spiexceptions.InvalidCursorDefinition:       # SQLSTATE 34000: a plan of several queries
        raise _several_statements() from None
    return plpy.execute(plan)


def _column_types(plpy, query: str) -> dict[str, int]:
    """The source's columns and their type OIDs, from a plan that reads no row."""
    probe = _run_one(plpy, f"SELECT * FROM ({query}\n) AS tensile_source LIMIT 0")
    return dict(zip(probe.colnames(), probe.coltypes()))


def _check_present(types: dict[str, int], columns: list[str], role: str) -> None:
    for c in columns:
        if c is None or c not in types:
            raise InvalidArgument(f'{role} column "{c}" is not in the source; its columns are: {", ".join(types)}')


def _check_numeric(plpy, types: dict[str, int], columns: list[str], role: str, arrays: bool = False) -> None:
    """Raise InvalidArgument for the first of ``columns`` that is not numeric (with ``arrays``,
    nor a numeric array), naming its type and the types allowed."""
    for c in columns:
        if types[c] not in NUMERIC_TYPES and not (arrays and types[c] in ARRAY_TYPES):
            also = f", or one numeric array column ({', '.join(ARRAY_TYPES.values())})" if arrays else ""
            raise InvalidArgument(f'{role} column "{c}" has type {_type_name(plpy, types[c])}; '
                                  f'{role}s must be numeric ({", ".join(NUMERIC_TYPES.values())}){also}')


def _array_column(types: dict[str, int], features: list[str], hint: str = "") -> str | None:
    """The array column among ``features``, or None when there is none. Raises InvalidArgument
    when an array column comes with other feature columns: it holds all of a row's values.
    ``hint`` ends the message, ``{array}`` in it naming the array column."""
    arrays = [c for c in features if types[c] in ARRAY_TYPES]
    if not arrays:
        return None
    array = arrays[0]
    if len(features) > 1:
        others = [c for c in features if c != array]
        listed = ", ".join(f'"{c}"' for c in others[:5]) + (f" and {len(others) - 5:,} more" if len(others) > 5 else "")
        raise InvalidArgument(f'the feature columns mix the array column "{array}" ({ARRAY_TYPES[types[array]]}) '
                              f"with {listed}; an array column holds all of a row's values, so it must be the only "
                              f"feature{hint.format(array=array)}")
    return array


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
        raise InvalidArgument(f'feature column "{column}" holds arrays of different numbers of dimensions (the first '
                              f"row's has {ndim}); give every row the same shape, or flatten the arrays in the source: "
                              f"ARRAY(SELECT unnest({column}))")
    words = words.reshape(rows, stride)
    if words[:, 1].any() or (words[:, 2] != FLOAT4_OID).any() or (words[:, header::2] != 4).any():
        raise RuntimeError(f'array_send of column "{column}" wrote a NULL element or a type other than real')
    return np.frombuffer(data, dtype=">f4").reshape(rows, stride)[:, header + 1::2].astype(np.float32)


def _decode_texts(data: bytes, rows: int) -> Categories:
    """``rows`` values as the scan's ``text`` aggregate wrote them — each a big-endian int4 UTF-8
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


def _decode_categories(data: bytes, rows: int) -> Categories:
    """``rows`` values as ``tensile._pack_text`` wrote them — the number of distinct values, each
    one's UTF-8 length and bytes, then one code a row (-1 for NULL), all integers big-endian int4 —
    -> :class:`~tensile_db.runtime.preprocess.Categories`: a string made per distinct value, the
    codes read by NumPy."""
    if not data:
        return Categories(np.full(rows, -1, dtype=np.int32), ())
    view = memoryview(data)
    distinct, pos, values = int.from_bytes(view[:4], "big"), 4, []
    for _ in range(distinct):
        length = int.from_bytes(view[pos:pos + 4], "big")
        values.append(str(view[pos + 4:pos + 4 + length], "utf-8"))
        pos += 4 + length
    if len(data) - pos != 4 * rows:
        raise RuntimeError(f"the categorical aggregate wrote {len(data) - pos:,} bytes of codes for {rows:,} rows")
    return Categories(np.frombuffer(data, dtype=">i4", offset=pos).astype(np.int32), tuple(values))


def _too_large(columns: list[tuple[str, str]], width: int | None) -> InvalidArgument:
    """The error of a scan whose columns outgrew PostgreSQL's largest value or row."""
    arrays = [c for c, t in columns if t == "real[]"]
    per_row = ""
    if arrays and width:
        row_nbytes = _ARRAY_HEADER_NBYTES + _ARRAY_VALUE_NBYTES * width
        per_row = (f'; the array column "{arrays[0]}" takes about {row_nbytes:,} bytes a row as read, so at most '
                   f"about {MAX_VALUE_NBYTES // row_nbytes:,} rows fit")
    return InvalidArgument(f"the source's rows hold more than PostgreSQL's 1 GB limit of one row of values as read "
                           f"(every column read, together){per_row}; read fewer rows or columns at once (a WHERE "
                           f"clause or LIMIT in the source)")


def _scan(plpy, query: str, types: dict[str, int], columns: list[tuple[str, str]], skip_nulls: bool,
          want_kept: bool = False, input_shape: tuple[int, ...] | None = None,
          nullable: frozenset[str] = frozenset()) -> _Scan:
    """Read ``columns`` — ``(name, SQL type)`` pairs, the type a key of ``_ENCODINGS`` — of every
    row of ``query`` in one scan. Raises InvalidArgument naming each column with NULLs (or arrays
    with NULL elements) and their count unless ``skip_nulls``; the columns in ``nullable`` keep
    their NULLs instead (a ``real`` one as NaN, a ``text`` one as None), for imputation. ``want_kept``
    asks for the mask of kept rows when rows are skipped. A ``real[]`` column's arrays must each hold
    ``prod(input_shape)`` values (None: as many as each other), else InvalidArgument names the
    rows that differ. A column beyond PostgreSQL's largest value (SQLSTATE 54000 from its aggregate)
    is InvalidArgument too."""
    width = math.prod(input_shape) if input_shape else None
    arrays = [(i, c) for i, (c, t) in enumerate(columns) if t == "real[]"]
    names = list(dict.fromkeys(c for c, _ in columns))
    packs = plpy.execute("SELECT pg_catalog.to_regprocedure('tensile._pack_float4(real)') "
                         "IS NOT NULL AS packs")[0]["packs"]
    together = _read_together(columns, packs)
    parallel = plpy.execute("SELECT pg_catalog.current_setting('max_parallel_workers_per_gather') AS old, "
                            "pg_catalog.set_config('max_parallel_workers_per_gather', '0', true)")[0]["old"]
    scan = _scan_query(plpy, query, types, columns, skip_nulls, want_kept, width, nullable, packs, together)
    try:
        row = _run_one(plpy, scan)[0]
    except plpy.spiexceptions.ProgramLimitExceeded:     # SQLSTATE 54000: a value or the row beyond 1 GB
        raise _too_large(columns, width) from None
    plpy.execute("SELECT pg_catalog.set_config('max_parallel_workers_per_gather', "
                 f"{plpy.quote_literal(parallel)}, true)")
    n = row["n"]
    nulls = {}
    if row["complete"] < n and not skip_nulls:
        nulls = _null_counts(plpy, query, names, nullable)
        if not nulls:                   # a source whose rows changed between the scans
            raise InvalidArgument(f"{n - row['complete']:,} of {n:,} rows have NULLs in the columns read (the source "
                                  f"gave other rows when counted again); filter them in the source or pass "
                                  f"options => '{{\"skip_nulls\": true}}' to skip such rows")
    holes = {c: row[f"holes{i}"] for i, c in arrays if row[f"holes{i}"]}
    if (nulls or holes) and not skip_nulls:
        listed = ", ".join([f'column "{c}" has {k:,} NULL{"s" if k > 1 else ""}' for c, k in nulls.items()]
                           + [f'column "{c}" has {k:,} array{"s" if k > 1 else ""} with NULL elements'
                              for c, k in holes.items()])
        raise InvalidArgument(f"{listed} (of {n:,} rows); filter them in the source or pass "
                              f"options => '{{\"skip_nulls\": true}}' to skip such rows")
    widths = {c: _array_width(row, i, c, width, input_shape) for i, c in arrays}
    reals = {}                      # column position -> its values, from the packs of several columns
    for g, group in enumerate(together):
        values = _native(row[f"reals{g}"] or b"", ">f4").reshape(len(group), row["complete"])
        reals.update(zip(group, values))
    decoded = [reals[i] if i in reals
               else _decode_arrays(row[f"c{i}"] or b"", row["complete"], widths[c], c) if t == "real[]"
               else (_decode_categories if packs else _decode_texts)(row[f"c{i}"] or b"", row["complete"]) if t == "text"
               else _native(row[f"c{i}"] or b"", _ENCODINGS[t][1]) for i, (c, t) in enumerate(columns)]
    kept_mask = np.frombuffer(row["kept"], dtype=np.bool_) if row.get("kept") and row["complete"] < n else None
    return _Scan(decoded, n, row["complete"], kept_mask)


def _read_together(columns: list[tuple[str, str]], packs: bool) -> list[list[int]]:
    """The positions in ``columns`` of the ``real`` ones, where the extension has
    ``tensile._pack_float4_columns``, in groups that one of it reads each: at most
    :data:`PACKED_COLUMNS`, as a function takes at most 100 arguments."""
    reals = [i for i, (_, t) in enumerate(columns) if t == "real"] if packs else []
    return [reals[i:i + PACKED_COLUMNS] for i in range(0, len(reals), PACKED_COLUMNS)]


def _native(data: bytes, big_endian: str) -> np.ndarray:
    """Big-endian values of dtype ``big_endian`` (``">f4"``, ...) as a native-order array: one
    byte swap here, not one in every later operation on the column."""
    dtype = np.dtype(big_endian)
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="))


def _null_counts(plpy, query: str, names: list[str], nullable: frozenset[str]) -> dict[str, int]:
    """Column -> its NULLs, of the columns of ``names`` that must have none but do: a second scan,
    made only to say which columns :func:`_scan` found rows with NULLs in."""
    refused = [c for c in names if c not in nullable]
    counts = ", ".join(f"pg_catalog.count(*) - pg_catalog.count({plpy.quote_ident(c)}) AS z{i}"
                       for i, c in enumerate(refused))
    row = _run_one(plpy, f"SELECT {counts} FROM ({query}\n) AS tensile_source")[0]
    return {c: row[f"z{i}"] for i, c in enumerate(refused) if row[f"z{i}"]}


def _scan_query(plpy, query: str, types: dict[str, int], columns: list[tuple[str, str]], skip_nulls: bool,
                want_kept: bool, width: int | None, nullable: frozenset[str], packs: bool,
                together: list[list[int]]) -> str:
    """The one statement of :func:`_scan` around the user's ``query``: the row counts (all, and
    those without a refused NULL), each array column's holes and widths, each column's values
    encoded into one ``bytea`` aggregate, and the kept-rows mask if asked. ``packs``: the extension's
    C aggregates (:data:`_PACKS`) read the columns, else
    ``string_agg`` of each value's send function (the same bytes); ``together``: groups of the
    positions of the ``real`` columns that one ``tensile._pack_float4_columns`` reads at once.

    Note [One row test per row]: the source's rows pass through a subquery that projects the
    columns read (as ``v0``, ``v1``, ...) and whether the row is complete (``k``: no NULL where one
    is refused); ``OFFSET 0`` keeps PostgreSQL from pulling it up into the aggregates, which would
    evaluate the test again in each aggregate's FILTER (on 1,000,000 rows of 16 columns, about
    1.5 s of a 2.5 s read)."""
    names = list(dict.fromkeys(c for c, _ in columns))
    alias = {c: f"v{j}" for j, c in enumerate(names)}

    def text(c):             # the text a row's jsonb carries to predict: text and varchar as they are
        if packs and types[c] in (TEXT_OID, VARCHAR_OID):
            return f"{alias[c]}::pg_catalog.text"
        return f"(pg_catalog.to_jsonb({alias[c]}) OPERATOR(pg_catalog.#>>) '{{}}'::pg_catalog.text[])"

    def value(c, sql_type):
        if sql_type == "text" and packs:
            return text(c)
        if sql_type == "text":       # each value's UTF-8 length (-1: NULL) and bytes
            utf8 = f"pg_catalog.convert_to({text(c)}, 'UTF8')"
            return (f"CASE WHEN {alias[c]} IS NULL THEN pg_catalog.int4send(-1) ELSE "
                    f"pg_catalog.int4send(pg_catalog.octet_length({utf8})) OPERATOR(pg_catalog.||) {utf8} END")
        cast = f"{alias[c]}::int::{sql_type}" if types[c] == BOOL_OID else f"{alias[c]}::{sql_type}"
        return f"COALESCE({cast}, 'NaN'::{sql_type})" if c in nullable else cast

    def aggregate(c, sql_type):
        if packs and sql_type in _PACKS:
            return f"tensile.{_PACKS[sql_type]}({value(c, sql_type)})"
        encoded = value(c, sql_type) if sql_type == "text" else \
            f"pg_catalog.{_ENCODINGS[sql_type][0]}({value(c, sql_type)})"
        return f"pg_catalog.string_agg({encoded}, ''::pg_catalog.bytea)"

    def cardinality(c):
        return f"pg_catalog.cardinality({alias[c]})"

    arrays = [(i, c) for i, (c, t) in enumerate(columns) if t == "real[]"]
    ident = plpy.quote_ident
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

    for g, group in enumerate(together):        # real columns: an aggregate a group, one call a row
        values = ", ".join(value(columns[i][0], "real") for i in group)
        aggregates.append(f"tensile._pack_float4_columns({values}) FILTER (WHERE k) AS reals{g}")
    packed = {i for group in together for i in group}
    aggregates += [f"{aggregate(c, t)} FILTER (WHERE {read_when(c, t)}) AS c{i}" for i, (c, t) in enumerate(columns)
                   if i not in packed]
    if want_kept and skip_nulls:
        aggregates.append("pg_catalog.string_agg(pg_catalog.boolsend(k), ''::pg_catalog.bytea) AS kept")
    projected = ", ".join([f"{ident(c)} AS {alias[c]}" for c in names] + [f"({complete}) AS k"])
    return (f"SELECT pg_catalog.count(*) AS n, pg_catalog.count(*) FILTER (WHERE k) AS complete, "
            f"{', '.join(aggregates)} FROM (SELECT {projected} FROM ({query}\n) AS tensile_source OFFSET 0) "
            f"AS tensile_rows")


def _array_width(row: dict, i: int, column: str, width: int | None, input_shape) -> int:
    """The values per row of the array column ``column`` (the ``i``-th read) in the scan's
    ``row``: ``width`` (the input shape's) if given, else the one width all its arrays share.
    Raises InvalidArgument naming the rows that differ."""
    low, high, off, n = row[f"lo{i}"], row[f"hi{i}"], row.get(f"off{i}"), row["n"]
    if off:
        raise InvalidArgument(f'feature column "{column}" has {off:,} rows (of {n:,}) whose arrays do not hold '
                              f"{width:,} values, as architecture.input.shape {list(input_shape)} asks (they hold "
                              f"{low:,} to {high:,}); fix or filter those rows in the source, or give the "
                              f"input shape of the rows")
    if width is None and row["complete"] and (low != high or high == 0):
        raise InvalidArgument(f'feature column "{column}" holds arrays of {low:,} to {high:,} values; every row must '
                              "hold the same number of values, at least one; fix or filter the others in the "
                              "source")
    return width if width is not None else (high or 0)


def _kinds(plpy, types: dict[str, int]) -> dict[str, str | None]:
    """Each column's kind as a feature: ``numeric``, ``categorical`` (text, varchar, char, enum,
    boolean and domains over them: the catalog's type categories S, E and B), ``array`` (a
    numeric array), or None (a type that cannot be used)."""
    kinds = {c: "numeric" if t in NUMERIC_TYPES and t != BOOL_OID else "array" if t in ARRAY_TYPES else None
             for c, t in types.items()}
    others = sorted({t for c, t in types.items() if kinds[c] is None})
    if others:
        rows = plpy.execute(plpy.prepare("""
            SELECT oid::pg_catalog.int8 AS oid FROM pg_catalog.pg_type
            WHERE oid OPERATOR(pg_catalog.=) ANY ($1) AND typcategory OPERATOR(pg_catalog.=) ANY ('{S,E,B}')""",
            ["pg_catalog.oid[]"]), [others])
        categorical = {r["oid"] for r in rows}
        kinds.update((c, "categorical") for c, t in types.items() if t in categorical)
    return kinds


def _refuse_unusable(plpy, types: dict[str, int], kinds: dict, columns: list[str], chosen: bool) -> None:
    """Raise InvalidArgument naming the first of ``columns`` whose type cannot be a feature;
    ``chosen``: the caller named the features (else they were every column but the label)."""
    for c in columns:
        if kinds[c] is None:
            how = ("" if chosen else f"; pass features => ARRAY[...] naming the columns to use, without \"{c}\"")
            raise InvalidArgument(f'feature column "{c}" has type {_type_name(plpy, types[c])}, which cannot be a '
                                  f"feature: features are numeric ({', '.join(NUMERIC_TYPES.values())}), "
                                  f"categorical (text, varchar, char, enum, boolean) or one numeric array column "
                                  f"(an image){how}; or convert it in the source (e.g. extract(epoch FROM ts))")


def _read_as(kind: str) -> str:
    """The scan's encoding of a feature column of ``kind``."""
    return {"numeric": "real", "categorical": "text", "array": "real[]"}[kind]


def _check_finite(raw: dict[str, np.ndarray], kinds: dict[str, str], nullable: frozenset[str]) -> None:
    """Raise InvalidArgument naming the first numeric or array column with NaN or infinite
    values (in a ``nullable`` column NaN is a missing value: only infinities count)."""
    for name, kind in kinds.items():
        if kind == "categorical":
            continue
        values = raw[name]
        bad = int(np.isinf(values).sum() if name in nullable else (~np.isfinite(values)).sum())
        if bad:
            raise InvalidArgument(f'feature column "{name}" has {bad:,} NaN or infinite values '
                                  f"(after conversion to real); filter or clip them in the source")


def read_training_data(plpy, source: str, label: str, features: list[str] | None, skip_nulls: bool,
                       input_shape: tuple[int, ...] | None = None, imputed=lambda column: False,
                       configured=()) -> TrainingData:
    """Read the raw feature columns and the label from ``source`` with the caller's privileges.

    ``features`` None means every column but the label; each must be numeric, categorical or
    one numeric array column (:func:`_kinds`), else InvalidArgument names it. An array column is
    read as the row's values, flattened; it must be the only feature and hold
    ``prod(input_shape)`` values in every row (``input_shape``: the architecture's, required for
    an array column). ``imputed(column)`` says whether a NULL in a column is kept for imputation
    rather than refused; ``configured`` names the columns the options configure, each of which
    must be a feature. The label is numeric, or categorical (then class names). Raises
    InvalidArgument for a missing or unusable column, an array column with others or without an
    input shape, arrays of another size or with NULL elements, NULLs (unless ``skip_nulls``;
    a NULL label always), no rows, or non-finite values; errors of the query itself (unknown
    table, permission denied) come from PostgreSQL.
    """
    query, types = _source(plpy, source)
    if not label:
        raise InvalidArgument("label is empty; name the column to predict")
    _check_present(types, [label], "label")
    kinds = _kinds(plpy, types)
    chosen = features is not None
    if features is None:
        features = [c for c in types if c != label]
        if not features:
            raise InvalidArgument(f'the source has no column besides the label "{label}"; its columns are: '
                                  f"{', '.join(types)}")
    else:
        if not features:
            raise InvalidArgument("features is an empty array; pass NULL to use every column but the label")
        _check_present(types, features, "feature")
        if label in features:
            raise InvalidArgument(f'column "{label}" is both the label and a feature')
        if len(set(features)) != len(features):
            raise InvalidArgument(f"features name a column twice: {features}")
    _refuse_unusable(plpy, types, kinds, features, chosen)
    check_configured(configured, features)      # before the scan: a misspelt column is named first
    label_kind = "numeric" if types[label] in NUMERIC_TYPES else "categorical" if kinds[label] == "categorical" else None
    if label_kind is None:
        raise InvalidArgument(f'label column "{label}" has type {_type_name(plpy, types[label])}; the label must be '
                              f"numeric or categorical (text, varchar, enum)")
    array = _array_column(types, features, "; pass features => ARRAY['{array}'] to train on it alone")
    if array is not None and input_shape is None:
        raise InvalidArgument(f'feature column "{array}" is an array ({ARRAY_TYPES[types[array]]}); give the shape of '
                              'the values it holds in the architecture: "input": {"shape": [C, H, W]} for images, '
                              'or {"shape": [F]} for vectors of F values')
    nullable = frozenset(c for c in features if kinds[c] != "array" and imputed(c))
    columns = [(c, _read_as(kinds[c])) for c in features]
    columns.append((label, "double precision" if label_kind == "numeric" else "text"))
    scan = _scan(plpy, query, types, columns, skip_nulls, input_shape=input_shape, nullable=nullable)
    if scan.rows == 0:
        raise InvalidArgument("the source returned no rows; check its query or WHERE clause")
    if scan.kept_rows == 0:
        raise InvalidArgument(f"all {scan.rows:,} rows of the source have a NULL in a feature or the label")
    raw = dict(zip(features, scan.columns[:-1]))
    y = scan.columns[-1]
    feature_kinds = {c: kinds[c] for c in features}
    _check_finite(raw, feature_kinds, nullable)
    if label_kind == "numeric":
        y = y.astype(np.float64)
        if not np.isfinite(y).all():
            raise InvalidArgument(f'label column "{label}" has NaN or infinite values; filter them in the source')
    return TrainingData(raw, feature_kinds, y, list(features), label, label_kind,
                        types[label] in INTEGER_TYPES, scan.rows, scan.rows - scan.kept_rows,
                        math.prod(input_shape) if array is not None else None)


def read_features(plpy, source: str, pre, key: str | None, skip_nulls: bool,
                  input_shape: tuple[int, ...] | None = None) -> Features:
    """Read a model's raw feature columns (``pre``: its
    :class:`~tensile_db.runtime.preprocess.Preprocessor`, which names them, their kinds and which
    keep NULLs for imputation) and the optional integer ``key`` column from ``source`` with the
    caller's privileges. ``input_shape`` is the model's (None: it has none); a model whose one
    feature is an array column reads each row's array flattened, of ``prod(input_shape)`` values
    (without an input shape: as many as every row holds).

    An empty source gives zero rows, not an error. Raises InvalidArgument for a missing column,
    a numeric or array column of another type, an array column among others or of other sizes, a
    scalar column where the model reads an array, a missing key column or one that is not smallint
    / integer / bigint, NULLs or NULL elements the model does not impute (unless ``skip_nulls``:
    those rows are left out) or non-finite features; errors of the query itself (unknown table,
    permission denied) come from PostgreSQL.
    """
    query, types = _source(plpy, source)
    features = pre.names
    _check_present(types, features, "feature")
    source_kinds = _kinds(plpy, types)
    for c, kind in pre.kinds.items():
        if kind == "categorical" and source_kinds[c] in ("numeric", "categorical"):
            continue                     # any scalar reads as text: a code stored as a number is a category too
        if kind == "numeric" and types[c] not in NUMERIC_TYPES:
            raise InvalidArgument(f'feature column "{c}" has type {_type_name(plpy, types[c])}; the model reads it as '
                                  f"a number ({', '.join(NUMERIC_TYPES.values())}): cast it in the source")
        if kind == "categorical":
            raise InvalidArgument(f'feature column "{c}" has type {_type_name(plpy, types[c])}; the model reads it as '
                                  "a category (text, varchar, enum, boolean): cast it in the source")
    _check_numeric(plpy, types, [c for c, k in pre.kinds.items() if k != "categorical"], "feature", arrays=True)
    array = _array_column(types, [c for c, k in pre.kinds.items() if k != "categorical"])
    width = math.prod(input_shape) if input_shape else len(features)
    if array is None and len(features) == 1 and width > 1:       # the model was trained on an array column
        raise InvalidArgument(f"the model takes {width:,} values per row, as architecture.input.shape "
                              f'{list(input_shape)} says, from the array column "{features[0]}", but the source\'s '
                              f'"{features[0]}" has type {_type_name(plpy, types[features[0]])}; give the source that '
                              f"column as an array of {width:,} numbers")
    nullable = frozenset(c for c in features if pre.kinds[c] != "array" and pre.nullable(c))
    columns = [(c, "real[]" if c == array else _read_as(pre.kinds[c])) for c in features]
    if key is not None:
        _check_present(types, [key], "key")
        if types[key] not in KEY_TYPES:
            raise InvalidArgument(f'key column "{key}" has type {_type_name(plpy, types[key])}; the key must be an '
                                  f'integer column ({", ".join(KEY_TYPES.values())}), or pass key => NULL to '
                                  f"number the rows 1, 2, ...")
        columns.append((key, "bigint"))
    scan = _scan(plpy, query, types, columns, skip_nulls, want_kept=key is None, input_shape=input_shape,
                 nullable=nullable)
    raw = dict(zip(features, scan.columns[:len(features)]))
    if key is not None:
        ids = scan.columns[-1].astype(np.int64)
    elif scan.kept is not None:
        ids = np.flatnonzero(scan.kept).astype(np.int64) + 1
    else:
        ids = np.arange(1, scan.kept_rows + 1, dtype=np.int64)
    _check_finite(raw, pre.kinds, nullable)
    return Features(raw, ids, scan.rows, scan.rows - scan.kept_rows)


def encode_labels(data: TrainingData, task: str) -> tuple[np.ndarray, list[float] | None, list[str] | None]:
    """Targets for the coordinator: for classification, class indices (N,) int32, the class
    values in index order (for a categorical label 0..C-1) and the class names of a categorical
    label (sorted; None for a numeric one); for regression (N, 1) float32, None, None."""
    if data.label_kind == "categorical":
        if task == "regression":
            raise InvalidArgument(f'label column "{data.label}" holds text; regression needs a numeric label: use '
                                  f'classification, or convert the label in the source')
        labels = data.y                               # Categories: the label is never NULL here
        longest = max(map(len, labels.values), default=0)
        if longest > MAX_CATEGORY_CHARS:
            raise InvalidArgument(f'label column "{data.label}" holds a value of {longest:,} characters; a class name '
                                  f"may have at most {MAX_CATEGORY_CHARS:,}: is it the column you meant to predict?")
        order = sorted(range(len(labels.values)), key=labels.values.__getitem__)
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        names, index = [labels.values[i] for i in order], rank[labels.codes]
        _check_classes(data.label, len(names), names[0] if len(names) else None)
        return index.astype(np.int32), [float(i) for i in range(len(names))], [str(n) for n in names]
    if task == "regression":
        beyond = int((np.abs(data.y) > FLOAT32_MAX).sum())
        if beyond:
            raise InvalidArgument(f'label column "{data.label}" has {beyond:,} values beyond the range of real '
                                  f"(float32, about 3.4e38), where the device computes; scale the label in the source")
        return data.y.astype(np.float32).reshape(-1, 1), None, None
    classes, index = _integer_classes(data.y) or np.unique(data.y, return_inverse=True)
    if not np.all(classes == np.round(classes)):
        raise InvalidArgument(f'label column "{data.label}" has non-integer values; classification needs '
                              f'integer class labels, or use options => \'{{"task": "regression"}}\'')
    _check_classes(data.label, len(classes), f"{classes[0]:g}")
    return index.astype(np.int32), [float(c) for c in classes], None


def _integer_classes(y: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """What ``np.unique(y, return_inverse=True)`` gives (the classes ascending, float64; each
    row's index into them) for labels that are integers within :data:`MAX_CLASSES` of each
    other, by counting instead of sorting (a million labels: about 0.08 s sorted); None for any
    other labels, which go to np.unique."""
    if not len(y):
        return None
    low, high = float(y.min()), float(y.max())
    if not (-2.0 ** 53 < low <= high < 2.0 ** 53) or high - low > MAX_CLASSES or low != math.floor(low):
        return None                                     # beyond float64's exact integers, NaN, or not an integer
    codes = np.subtract(y, low, dtype=np.float64).astype(np.intp)
    if not np.array_equal(codes + low, y):              # every label an integer (a difference may round to one)
        return None
    present = np.bincount(codes) > 0
    return np.flatnonzero(present) + low, (np.cumsum(present) - 1)[codes]


def _check_classes(label: str, count: int, first) -> None:
    if count < 2:
        raise InvalidArgument(f'label column "{label}" has a single class ({first}); classification needs at least two')
    if count > MAX_CLASSES:
        raise InvalidArgument(f'label column "{label}" has {count:,} distinct values, more than '
                              f'{MAX_CLASSES:,} classes; use options => \'{{"task": "regression"}}\'')
