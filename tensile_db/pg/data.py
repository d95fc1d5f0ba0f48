"""Reading rows through SPI, as the calling role: training data and the features to predict.

This module decides what is read: which columns are features and of which kind (:func:`_kinds`:
numeric, categorical — text, varchar, char, enum, boolean and domains over them: type categories
S, E, B — or one numeric array column), the label and the key, and the checks of what was read
(types, NULLs, finite values, classes). Any other type (json, geometry, dates, ...) is refused by
name, never skipped. :mod:`.scan` reads every column in one scan of the source;
:mod:`tensile_db.runtime.preprocess` turns the raw columns into the network's inputs. A column
whose missing values the model imputes keeps its NULLs (a numeric one as NaN, a categorical one
as code -1); in any other column a NULL is refused, naming each such column and its count, or,
with ``skip_nulls``, its row is left out (where rows are named by their ordinal, the ordinals
count the rows left out).

A row's features may instead be one numeric array column (``real[]``, ``double precision[]``,
``smallint[]``, ``integer[]``, ``bigint[]``, ``numeric[]``) holding the row's values — an image
of the architecture's input shape ``[C, H, W]``, or a vector of shape ``[F]`` — in any
dimensionality, flattened in row-major order. Every row must hold exactly the input shape's number
of values (other rows are counted, never read, so one huge array cannot make the scan allocate)
and no NULL element (a NULL element is a NULL feature, so ``skip_nulls`` skips that row), and all
rows must have the same number of dimensions. An array column is the only feature: mixed with
other feature columns it is refused, naming them. A model trained on one stores that column's
name once in ``feature_names``; its width comes from its architecture's input shape
(:meth:`~tensile_db.runtime.model.ModelSpec.of_row`).

The source is exactly one query (or a table name): one with several statements is refused by
name (``sqlparse`` splits it), and every statement built around it runs only as one query
(:func:`.scan.run_one`), so text after a ``;`` never runs even where the split and the server's
parser disagree. Every function, operator and type the statements add is qualified with
``pg_catalog``, so the caller's ``search_path`` resolves only the names in ``source``. The
columns read take at most 1 GB together (:data:`.scan.MAX_VALUE_NBYTES`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from ..runtime import side_by_side
from ..runtime.model import FLOAT32_MAX
from ..runtime.preprocess import MAX_CATEGORY_CHARS, check_configured
from . import oids
from .scan import run_one, several_statements
from .scan import scan as read_columns

#: Type OIDs accepted as numeric input, with their SQL names.
NUMERIC_TYPES = {oids.BOOL_OID: "boolean", oids.INT8_OID: "bigint", oids.INT2_OID: "smallint", oids.INT4_OID: "integer",
                 oids.FLOAT4_OID: "real", oids.FLOAT8_OID: "double precision", oids.NUMERIC_OID: "numeric"}
INTEGER_TYPES = {oids.BOOL_OID, oids.INT8_OID, oids.INT2_OID, oids.INT4_OID}
#: Type OIDs a key column may have: the integers, not boolean.
KEY_TYPES = {oids.INT2_OID: "smallint", oids.INT4_OID: "integer", oids.INT8_OID: "bigint"}
#: Array type OIDs accepted as the one feature column that holds a row's values, with their SQL names.
ARRAY_TYPES = {oids.INT2_ARRAY_OID: "smallint[]", oids.INT4_ARRAY_OID: "integer[]", oids.INT8_ARRAY_OID: "bigint[]",
               oids.FLOAT4_ARRAY_OID: "real[]", oids.FLOAT8_ARRAY_OID: "double precision[]",
               oids.NUMERIC_ARRAY_OID: "numeric[]"}
#: More distinct labels than this is almost surely a regression target.
MAX_CLASSES = 10_000
_TABLE_NAME = re.compile(r'^("[^"]+"|[A-Za-z_][A-Za-z0-9_$]*)(\.("[^"]+"|[A-Za-z_][A-Za-z0-9_$]*))?$')


@dataclass
class TrainingData:
    """raw: each feature column's values as read (:meth:`~tensile_db.runtime.preprocess.Preprocessor.transform`
    takes them: numeric (N,) float32 with NaN for a NULL kept for imputation, categorical
    :class:`~tensile_db.runtime.preprocess.Categories`, array (N, width) float32); kinds: feature
    column -> kind, in order; y: the label, (N,) float64 (numeric) or Categories; row counts before and after
    dropping rows with NULLs; array_width: values per row of an array column (None: none); finite:
    the numeric feature columns checked to hold only finite values (those that refuse NULLs)."""

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
    finite: frozenset[str] = frozenset()


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


def source_query(source: str | None) -> str:
    """The SQL of a source given as a query or a (schema-qualified) table name."""
    text = (source or "").strip().rstrip(";").strip()
    if not text:
        raise InvalidArgument("source is empty; pass a query such as 'SELECT * FROM my_table' or a table name")
    if ";" in text:
        import sqlparse  # only for sources that may hold several statements

        if len([s for s in sqlparse.split(text) if s.strip()]) > 1:
            raise several_statements()
    return f"SELECT * FROM {text}" if is_table_name(text) else text


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


def _column_types(plpy, query: str) -> dict[str, int]:
    """The source's columns and their type OIDs, from a plan that reads no row."""
    probe = run_one(plpy, f"SELECT * FROM ({query}\n) AS tensile_source LIMIT 0")
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


def _kinds(plpy, types: dict[str, int]) -> dict[str, str | None]:
    """Each column's kind as a feature: ``numeric``, ``categorical`` (text, varchar, char, enum,
    boolean and domains over them: the catalog's type categories S, E and B), ``array`` (a
    numeric array), or None (a type that cannot be used)."""
    kinds = {c: "numeric" if t in NUMERIC_TYPES and t != oids.BOOL_OID else "array" if t in ARRAY_TYPES else None
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
    values (in a ``nullable`` column NaN is a missing value: only infinities count). The
    columns are tested together first (:func:`~tensile_db.runtime.side_by_side.finite`); only where
    that finds a non-finite value are they counted one by one."""
    names = [name for name, kind in kinds.items() if kind != "categorical"]
    arrays = [raw[n] if raw[n].ndim == 1 else raw[n].reshape(-1) for n in names]
    for name, values, ok in zip(names, arrays, side_by_side.finite(arrays)):
        bad = 0 if ok else int(np.isinf(values).sum() if name in nullable else (~np.isfinite(values)).sum())
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
    label_kind = ("numeric" if types[label] in NUMERIC_TYPES else "categorical" if kinds[label] == "categorical"
                  else None)
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
    scan = read_columns(plpy, query, types, columns, skip_nulls, input_shape=input_shape, nullable=nullable)
    if scan.rows == 0:
        raise InvalidArgument("the source returned no rows; check its query or WHERE clause")
    if scan.kept_rows == 0:
        raise InvalidArgument(f"all {scan.rows:,} rows of the source have a NULL in a feature or the label")
    raw = dict(zip(features, scan.columns[:-1]))
    y = scan.columns[-1]
    feature_kinds = {c: kinds[c] for c in features}
    _check_finite(raw, feature_kinds, nullable)
    if label_kind == "numeric":
        y = np.asarray(y, dtype=np.float64)
        if not np.isfinite(y).all():
            raise InvalidArgument(f'label column "{label}" has NaN or infinite values; filter them in the source')
    return TrainingData(raw, feature_kinds, y, list(features), label, label_kind,
                        types[label] in INTEGER_TYPES, scan.rows, scan.rows - scan.kept_rows,
                        math.prod(input_shape) if array is not None else None,
                        frozenset(c for c, k in feature_kinds.items() if k == "numeric" and c not in nullable))


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
    scan = read_columns(plpy, query, types, columns, skip_nulls, want_kept=key is None, input_shape=input_shape,
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
