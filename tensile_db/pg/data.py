"""Reading training data through SPI, as the calling role.

All columns are read in one scan of the source with one aggregate per column:
``string_agg(float4send(col::real), '')`` for features and ``float8send`` for the label, decoded
with ``numpy.frombuffer``. Every aggregate of one Agg node sees the rows in the same order, so the
columns stay aligned; ``string_agg`` skips NULLs, so NULLs are counted first (``count(col)``
against ``count(*)`` in the same scan) and either reported, naming the column and the count, or
— with ``skip_nulls`` — every aggregate is filtered to the rows without any NULL. Parallel
aggregation is switched off for the transaction so that no partial aggregates are combined.

Limit: one column's bytes must stay under PostgreSQL's 1 GB value limit, about 268 million rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument

#: PostgreSQL type OIDs accepted as numeric input, with their SQL names.
NUMERIC_TYPES = {16: "boolean", 20: "bigint", 21: "smallint", 23: "integer", 700: "real",
                 701: "double precision", 1700: "numeric"}
INTEGER_TYPES = {16, 20, 21, 23}
#: More distinct labels than this is almost surely a regression target.
MAX_CLASSES = 10_000
_TABLE_NAME = re.compile(r'^("[^"]+"|[A-Za-z_][A-Za-z0-9_$]*)(\.("[^"]+"|[A-Za-z_][A-Za-z0-9_$]*))?$')


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


def source_query(source: str | None) -> str:
    """The SQL of a source given as a query or a (schema-qualified) table name."""
    text = (source or "").strip().rstrip(";").strip()
    if not text:
        raise InvalidArgument("source is empty; pass a query such as 'SELECT * FROM my_table' or a table name")
    return f"SELECT * FROM {text}" if _TABLE_NAME.match(text) else text


def _type_name(plpy, oid: int) -> str:
    return NUMERIC_TYPES.get(oid) or plpy.execute(f"SELECT format_type({int(oid)}, NULL) AS t")[0]["t"]


def read_training_data(plpy, source: str, label: str, features: list[str] | None,
                       skip_nulls: bool) -> TrainingData:
    """Read features and label from ``source`` with the caller's privileges.

    ``features`` None means every numeric column but the label. Raises InvalidArgument for a
    missing or non-numeric column, NULLs (unless ``skip_nulls``), no rows, or non-finite values;
    errors of the query itself (unknown table, permission denied) come from PostgreSQL.
    """
    query = source_query(source)
    probe = plpy.execute(f"SELECT * FROM ({query}\n) AS tensile_source LIMIT 0")
    types = dict(zip(probe.colnames(), probe.coltypes()))
    if not label:
        raise InvalidArgument("label is empty; name the column to predict")
    if label not in types:
        raise InvalidArgument(f'label column "{label}" is not in the source; its columns are: {", ".join(types)}')
    if features is None:
        features = [c for c, t in types.items() if c != label and t in NUMERIC_TYPES]
        if not features:
            raise InvalidArgument(f"the source has no numeric column besides the label \"{label}\"; "
                                  f"its columns are: {', '.join(types)}")
    else:
        if not features:
            raise InvalidArgument("features is an empty array; pass NULL to use every numeric column but the label")
        for c in features:
            if c is None or c not in types:
                raise InvalidArgument(f'feature column "{c}" is not in the source; its columns are: {", ".join(types)}')
            if c == label:
                raise InvalidArgument(f'column "{c}" is both the label and a feature')
        if len(set(features)) != len(features):
            raise InvalidArgument(f"features name a column twice: {features}")
    for c in features + [label]:
        if types[c] not in NUMERIC_TYPES:
            role = "label" if c == label else "feature"
            raise InvalidArgument(f'{role} column "{c}" has type {_type_name(plpy, types[c])}; '
                                  f'{role}s must be numeric ({", ".join(NUMERIC_TYPES.values())})')

    def ident(c):
        return plpy.quote_ident(c)

    def value(c, sql_type):
        return f"{ident(c)}::int::{sql_type}" if types[c] == 16 else f"{ident(c)}::{sql_type}"

    columns = features + [label]
    complete = " AND ".join(f"{ident(c)} IS NOT NULL" for c in columns)
    aggregates = [f"count({ident(c)}) AS nn{i}" for i, c in enumerate(columns)]
    aggregates += [f"string_agg(float4send({value(c, 'real')}), '') FILTER (WHERE {complete}) AS c{i}"
                   for i, c in enumerate(features)]
    aggregates.append(f"string_agg(float8send({value(label, 'double precision')}), '') FILTER (WHERE {complete}) AS label")
    plpy.execute("SELECT set_config('max_parallel_workers_per_gather', '0', true)")
    row = plpy.execute(f"SELECT count(*) AS n, count(*) FILTER (WHERE {complete}) AS complete, "
                       f"{', '.join(aggregates)} FROM ({query}\n) AS tensile_source")[0]
    n = row["n"]
    if n == 0:
        raise InvalidArgument("the source returned no rows; check its query or WHERE clause")
    nulls = {c: n - row[f"nn{i}"] for i, c in enumerate(columns) if row[f"nn{i}"] < n}
    if nulls and not skip_nulls:
        listed = ", ".join(f'column "{c}" has {k:,} NULL{"s" if k > 1 else ""}' for c, k in nulls.items())
        raise InvalidArgument(f"{listed} (of {n:,} rows); filter them in the source or pass "
                              f"options => '{{\"skip_nulls\": true}}' to skip such rows")
    if row["complete"] == 0:
        raise InvalidArgument(f"all {n:,} rows of the source have a NULL in a feature or the label")
    x = np.stack([np.frombuffer(row[f"c{i}"], dtype=">f4") for i in range(len(features))], axis=1).astype(np.float32)
    y = np.frombuffer(row["label"], dtype=">f8").astype(np.float64)
    for name, bad in ((c, ~np.isfinite(x[:, i])) for i, c in enumerate(features)):
        if bad.any():
            raise InvalidArgument(f'feature column "{name}" has {int(bad.sum()):,} NaN or infinite values '
                                  f'(after conversion to real); filter or clip them in the source')
    if not np.isfinite(y).all():
        raise InvalidArgument(f'label column "{label}" has NaN or infinite values; filter them in the source')
    return TrainingData(x, y, list(features), label, types[label] in INTEGER_TYPES, n, n - row["complete"])


def encode_labels(data: TrainingData, task: str) -> tuple[np.ndarray, list[float] | None]:
    """Targets for the coordinator: class indices (N,) int32 and the class values in index order
    for classification; (N, 1) float32 and None for regression."""
    if task == "regression":
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
