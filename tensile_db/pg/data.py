"""Reading rows through SPI, as the calling role: training data and the features to predict.

All columns are read in one scan of the source with one aggregate per column:
``string_agg(float4send(col::real), '')`` for features, ``float8send`` for a label and
``int8send`` for an integer key, decoded with ``numpy.frombuffer``. Every aggregate of one Agg
node sees the rows in the same order, so the columns stay aligned; ``string_agg`` skips NULLs, so
NULLs are counted first (``count(col)`` against ``count(*)`` in the same scan) and either
reported, naming the column and the count, or — with ``skip_nulls`` — every aggregate is filtered
to the rows without any NULL (and, where rows are named by their ordinal, one byte a row says
which were kept). Parallel aggregation is switched off for the scan so that no partial aggregates
are combined.

The source is exactly one query (or a table name): one with several statements is refused by
name (``sqlparse`` splits it), and every statement built around it runs through a cursor, which
PostgreSQL opens only for a plan of exactly one query, so text after a ``;`` never runs even where
the split and the server's parser disagree. Every function, operator and type the scan adds is qualified
with ``pg_catalog``, so the caller's ``search_path`` resolves only the names in ``source``.

Limit: one column's bytes must stay under PostgreSQL's 1 GB value limit, about 268 million rows
(134 million with an integer key).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from ..runtime.model import FLOAT32_MAX

#: PostgreSQL type OIDs accepted as numeric input, with their SQL names.
NUMERIC_TYPES = {16: "boolean", 20: "bigint", 21: "smallint", 23: "integer", 700: "real",
                 701: "double precision", 1700: "numeric"}
INTEGER_TYPES = {16, 20, 21, 23}
#: Type OIDs a key column may have: the integers, not boolean.
KEY_TYPES = {21: "smallint", 23: "integer", 20: "bigint"}
#: More distinct labels than this is almost surely a regression target.
MAX_CLASSES = 10_000
_TABLE_NAME = re.compile(r'^("[^"]+"|[A-Za-z_][A-Za-z0-9_$]*)(\.("[^"]+"|[A-Za-z_][A-Za-z0-9_$]*))?$')
#: How one column is read: the SQL type it is cast to, its binary send function, its big-endian dtype.
_ENCODINGS = {"real": ("float4send", ">f4"), "double precision": ("float8send", ">f8"), "bigint": ("int8send", ">i8")}


@dataclass
class TrainingData:
    """x: (N, F) float32 features; y: (N,) float64 label values; row counts before and after
    dropping rows with NULLs."""

    x: np.ndarray
    y: np.ndarray
    feature_names: list[str]
    label: str
    label_is_integer: bool
    rows: int
    skipped_rows: int


@dataclass
class Features:
    """x: (N, F) float32 raw features of the rows kept, in the source's order; ids: (N,) int64,
    the key column's values or the rows' 1-based ordinals in the source (skipped rows counted, so
    an ordinal always names the same source row); rows: rows in the source; skipped_rows: rows
    left out for a NULL."""

    x: np.ndarray
    ids: np.ndarray
    rows: int
    skipped_rows: int


@dataclass
class _Scan:
    """One scan: the decoded columns, each (kept_rows,) of the rows kept, in the source's order;
    the rows in the source; and ``kept``, (rows,) bool, which rows were kept — only when asked for
    and some were skipped, else None."""

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
        import sqlparse      # only for sources that may hold several statements

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
    return NUMERIC_TYPES.get(oid) or plpy.execute(f"SELECT pg_catalog.format_type({int(oid)}, NULL) AS t")[0]["t"]


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


def _check_numeric(plpy, types: dict[str, int], columns: list[str], role: str) -> None:
    for c in columns:
        if types[c] not in NUMERIC_TYPES:
            raise InvalidArgument(f'{role} column "{c}" has type {_type_name(plpy, types[c])}; '
                                  f'{role}s must be numeric ({", ".join(NUMERIC_TYPES.values())})')


def _scan(plpy, query: str, types: dict[str, int], columns: list[tuple[str, str]], skip_nulls: bool,
          want_kept: bool = False) -> _Scan:
    """Read ``columns`` — ``(name, SQL type)`` pairs, the type a key of ``_ENCODINGS`` — of every
    row of ``query`` in one scan. Raises InvalidArgument naming each column with NULLs and their
    count unless ``skip_nulls``. ``want_kept`` asks for the mask of kept rows when rows are
    skipped."""
    def ident(c):
        return plpy.quote_ident(c)

    def value(c, sql_type):
        return f"{ident(c)}::int::{sql_type}" if types[c] == 16 else f"{ident(c)}::{sql_type}"

    names = list(dict.fromkeys(c for c, _ in columns))
    complete = " AND ".join(f"{ident(c)} IS NOT NULL" for c in names)
    aggregates = [f"pg_catalog.count({ident(c)}) AS nn{i}" for i, c in enumerate(names)]
    aggregates += [f"pg_catalog.string_agg(pg_catalog.{_ENCODINGS[t][0]}({value(c, t)}), ''::pg_catalog.bytea) "
                   f"FILTER (WHERE {complete}) AS c{i}" for i, (c, t) in enumerate(columns)]
    if want_kept and skip_nulls:
        aggregates.append(f"pg_catalog.string_agg(pg_catalog.boolsend({complete}), ''::pg_catalog.bytea) AS kept")
    parallel = plpy.execute("SELECT pg_catalog.current_setting('max_parallel_workers_per_gather') AS old, "
                            "pg_catalog.set_config('max_parallel_workers_per_gather', '0', true)")[0]["old"]
    scan = (f"SELECT pg_catalog.count(*) AS n, pg_catalog.count(*) FILTER (WHERE {complete}) AS complete, "
            f"{', '.join(aggregates)} FROM ({query}\n) AS tensile_source")
    row = _run_one(plpy, scan)[0]
    plpy.execute("SELECT pg_catalog.set_config('max_parallel_workers_per_gather', "
                 f"{plpy.quote_literal(parallel)}, true)")
    n = row["n"]
    nulls = {c: n - row[f"nn{i}"] for i, c in enumerate(names) if row[f"nn{i}"] < n}
    if nulls and not skip_nulls:
        listed = ", ".join(f'column "{c}" has {k:,} NULL{"s" if k > 1 else ""}' for c, k in nulls.items())
        raise InvalidArgument(f"{listed} (of {n:,} rows); filter them in the source or pass "
                              f"options => '{{\"skip_nulls\": true}}' to skip such rows")
    decoded = [np.frombuffer(row[f"c{i}"] or b"", dtype=_ENCODINGS[t][1]) for i, (_, t) in enumerate(columns)]
    kept = np.frombuffer(row["kept"], dtype=np.bool_) if row.get("kept") and nulls else None
    return _Scan(decoded, n, row["complete"], kept)


def _check_finite(x: np.ndarray, features: list[str]) -> None:
    for name, bad in ((c, ~np.isfinite(x[:, i])) for i, c in enumerate(features)):
        if bad.any():
            raise InvalidArgument(f'feature column "{name}" has {int(bad.sum()):,} NaN or infinite values '
                                  f'(after conversion to real); filter or clip them in the source')


def read_training_data(plpy, source: str, label: str, features: list[str] | None,
                       skip_nulls: bool) -> TrainingData:
    """Read features and label from ``source`` with the caller's privileges.

    ``features`` None means every numeric column but the label. Raises InvalidArgument for a
    missing or non-numeric column, NULLs (unless ``skip_nulls``), no rows, or non-finite values;
    errors of the query itself (unknown table, permission denied) come from PostgreSQL.
    """
    query, types = _source(plpy, source)
    if not label:
        raise InvalidArgument("label is empty; name the column to predict")
    _check_present(types, [label], "label")
    if features is None:
        features = [c for c, t in types.items() if c != label and t in NUMERIC_TYPES]
        if not features:
            raise InvalidArgument(f"the source has no numeric column besides the label \"{label}\"; "
                                  f"its columns are: {', '.join(types)}")
    else:
        if not features:
            raise InvalidArgument("features is an empty array; pass NULL to use every numeric column but the label")
        _check_present(types, features, "feature")
        if label in features:
            raise InvalidArgument(f'column "{label}" is both the label and a feature')
        if len(set(features)) != len(features):
            raise InvalidArgument(f"features name a column twice: {features}")
    _check_numeric(plpy, types, features, "feature")
    _check_numeric(plpy, types, [label], "label")
    scan = _scan(plpy, query, types, [(c, "real") for c in features] + [(label, "double precision")], skip_nulls)
    if scan.rows == 0:
        raise InvalidArgument("the source returned no rows; check its query or WHERE clause")
    if scan.kept_rows == 0:
        raise InvalidArgument(f"all {scan.rows:,} rows of the source have a NULL in a feature or the label")
    x = np.stack(scan.columns[:-1], axis=1).astype(np.float32)
    y = scan.columns[-1].astype(np.float64)
    _check_finite(x, features)
    if not np.isfinite(y).all():
        raise InvalidArgument(f'label column "{label}" has NaN or infinite values; filter them in the source')
    return TrainingData(x, y, list(features), label, types[label] in INTEGER_TYPES, scan.rows,
                        scan.rows - scan.kept_rows)


def read_features(plpy, source: str, features: list[str], key: str | None, skip_nulls: bool) -> Features:
    """Read a model's ``features`` (in order) and the optional integer ``key`` column from
    ``source`` with the caller's privileges.

    An empty source gives zero rows, not an error. Raises InvalidArgument for a missing or
    non-numeric feature column, a missing key column or one that is not smallint / integer /
    bigint, NULLs (unless ``skip_nulls``: those rows are left out) or non-finite features; errors
    of the query itself (unknown table, permission denied) come from PostgreSQL.
    """
    query, types = _source(plpy, source)
    _check_present(types, features, "feature")
    _check_numeric(plpy, types, features, "feature")
    columns = [(c, "real") for c in features]
    if key is not None:
        _check_present(types, [key], "key")
        if types[key] not in KEY_TYPES:
            raise InvalidArgument(f'key column "{key}" has type {_type_name(plpy, types[key])}; the key must be an '
                                  f'integer column ({", ".join(KEY_TYPES.values())}), or pass key => NULL to '
                                  f"number the rows 1, 2, ...")
        columns.append((key, "bigint"))
    scan = _scan(plpy, query, types, columns, skip_nulls, want_kept=key is None)
    x = np.stack(scan.columns[:len(features)], axis=1).astype(np.float32)
    if key is not None:
        ids = scan.columns[-1].astype(np.int64)
    elif scan.kept is not None:
        ids = np.flatnonzero(scan.kept).astype(np.int64) + 1
    else:
        ids = np.arange(1, scan.kept_rows + 1, dtype=np.int64)
    _check_finite(x, features)
    return Features(x, ids, scan.rows, scan.rows - scan.kept_rows)


def encode_labels(data: TrainingData, task: str) -> tuple[np.ndarray, list[float] | None]:
    """Targets for the coordinator: class indices (N,) int32 and the class values in index order
    for classification; (N, 1) float32 and None for regression."""
    if task == "regression":
        beyond = int((np.abs(data.y) > FLOAT32_MAX).sum())
        if beyond:
            raise InvalidArgument(f'label column "{data.label}" has {beyond:,} values beyond the range of real '
                                  f"(float32, about 3.4e38), where the device computes; scale the label in the source")
        return data.y.astype(np.float32).reshape(-1, 1), None
    classes, index = np.unique(data.y, return_inverse=True)
    if not np.all(classes == np.round(classes)):
        raise InvalidArgument(f'label column "{data.label}" has non-integer values; classification needs '
                              f'integer class labels, or use options => \'{{"task": "regression"}}\'')
    if len(classes) < 2:
        raise InvalidArgument(f'label column "{data.label}" has a single class ({classes[0]:g}); '
                              f"classification needs at least two")
    if len(classes) > MAX_CLASSES:
        raise InvalidArgument(f'label column "{data.label}" has {len(classes):,} distinct values, more than '
                              f'{MAX_CLASSES:,} classes; use options => \'{{"task": "regression"}}\'')
    return index.astype(np.int32), [float(c) for c in classes]
