"""``tensile.predict`` / ``tensile.predict_proba`` / ``tensile.predict_label``: row-by-row
inference in the backend, on the CPU, with the deployed version of a model.

The model is cached for the session in GD, keyed by name (the ``MAX_CACHED_MODELS`` most recently
used), and checked on every call against the deployed version's ``id`` in ``tensile.models`` (one
indexed lookup through a prepared plan): every version has its own id, so a cached copy is never
used after another version was deployed. A model is loaded only within ``tensile.max_layers`` /
``tensile.max_parameters`` and with weights that match its architecture
(:func:`~tensile_db.runtime.weights.load_weights`).

A row comes as a jsonb object of column -> value (a table row arrives so, as ``to_jsonb(t)``,
from the SQL wrappers that take a ``record``): every column the model reads must be present,
null for a missing value, and the model's stored preprocessing (:mod:`tensile_db.runtime.preprocess`)
fills and encodes it exactly as training did. Or it comes as an array of numbers, for a model
without categorical columns: NaN and infinities are refused by name, a NULL unless the column is
imputed. A model whose architecture gives the rows' shape (``"input": {"shape": [C, H, W]}``)
takes an array of any dimensionality holding that many values, flattened in row-major order (an
image as ``real[]`` of 8x8 or 1x8x8 as well as 64 values in a row); a model without one takes a
one-dimensional array only.
"""

from __future__ import annotations

import collections
import json
import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from ..runtime import model as models
from ..runtime.checks import shown
from ..runtime.metrics import class_text
from ..runtime.preprocess import Categories, Preprocessor
from ..runtime.weights import load_weights
from . import registry, session

#: Models a session keeps loaded, least recently used dropped first (each up to tensile.max_parameters).
MAX_CACHED_MODELS = 8


@dataclass
class CachedModel:
    id: int
    spec: models.ModelSpec
    weights: dict
    classes: list[float] | None
    feature_names: list[str]
    pre: Preprocessor
    label_names: list[str] | None


def load(plpy, GD, name: str) -> CachedModel:
    """The deployed version of model ``name`` as the calling role sees it, cached for the
    session. Raises ModelNotFound, InvalidArgument (a model larger than the limits) or
    CorruptModel."""
    cache = GD.setdefault("tensile_models", collections.OrderedDict())
    rows = plpy.execute(session.plan(plpy, GD, """
        SELECT id FROM tensile.models WHERE name OPERATOR(pg_catalog.=) $1 AND deployed""",
                                     ["pg_catalog.text"]), [name])
    if not rows:
        cache.pop(name, None)
        raise registry.not_deployed(plpy, GD, name)
    cached = cache.get(name)
    if cached is None or cached.id != rows[0]["id"]:
        row = plpy.execute(session.plan(plpy, GD, """
            SELECT id, task, architecture::pg_catalog.text AS architecture, feature_names, label_classes, weights,
                   preprocess::pg_catalog.text AS preprocess, label_names
            FROM tensile.models WHERE id OPERATOR(pg_catalog.=) $1""", ["pg_catalog.int8"]), [rows[0]["id"]])[0]
        classes = list(row["label_classes"]) if row["label_classes"] else None
        pre = models.preprocessor_of_row(row["preprocess"], row["feature_names"], row["architecture"])
        spec = models.ModelSpec.of_row(row["architecture"], row["feature_names"],
                                      len(classes) if classes else 1, row["task"], pre.width)
        session.limits(plpy, GD, session.settings(plpy, GD)).check(spec, name)
        cached = CachedModel(row["id"], spec, load_weights(row["weights"], spec, name), classes,
                             list(row["feature_names"]), pre, list(row["label_names"]) if row["label_names"] else None)
        cache[name] = cached
        while len(cache) > MAX_CACHED_MODELS:
            cache.popitem(last=False)
    cache.move_to_end(name)
    return cached


def _expected(m: CachedModel) -> str:
    """What a model's features are, for messages: its columns, or its input shape and array column."""
    shape = m.spec.architecture.input_shape
    if len(m.feature_names) < m.spec.n_features and not m.pre.categorical:
        return f"{m.spec.n_features} values (input shape {list(shape)}, as in column {m.feature_names[0]})"
    return f"{len(m.feature_names)} features ({', '.join(m.feature_names)})"


def _position(m: CachedModel, i: int) -> str:
    """The feature at flat position ``i``: its column, or the 1-based position in the array column."""
    return m.feature_names[i] if len(m.feature_names) == m.spec.n_features else f"{m.feature_names[0]}[{i + 1}]"


def _flattened(values: list) -> list:
    """A PostgreSQL array as PL/Python passes it (nested lists, one level a dimension) in row-major order."""
    while values and isinstance(values[0], list):
        values = [v for inner in values for v in inner]
    return values


def _from_array(m: CachedModel, name: str, features: list) -> dict[str, np.ndarray]:
    """A row given as an array of numbers -> the model's raw columns (one row)."""
    if m.pre.categorical:
        categorical = [c.name for c in m.pre.columns if c.kind == "categorical"]
        raise InvalidArgument(f'model "{name}" has categorical feature columns ({", ".join(categorical)}); pass the '
                              f"row instead of an array: tensile.predict('{name}', t) FROM t, or a jsonb object of "
                              "column -> value")
    if any(isinstance(v, list) for v in features):
        if m.spec.architecture.input_shape is None:
            raise InvalidArgument(f"features must be a one-dimensional array of {m.spec.n_features} numbers, got a "
                                  f"multidimensional array; pass ARRAY[{', '.join(m.feature_names[:3])}, ...]")
        features = _flattened(features)
    if len(features) != m.spec.n_features:
        raise InvalidArgument(f'model "{name}" expects {_expected(m)}, got {len(features)}')
    x = np.asarray([np.nan if v is None else v for v in features], dtype=np.float32)
    imputed = np.array([m.pre.columns[0].kind != "array" and m.pre.nullable(m.feature_names[i])
                        for i in range(len(x))], dtype=bool)
    missing = [i for i, v in enumerate(features) if v is None and not imputed[i]]
    if missing:
        raise InvalidArgument(f"features[{missing[0] + 1}] ({_position(m, missing[0])}) is NULL; model \"{name}\" "
                              "needs a value for every feature it does not impute: filter such rows")
    bad = np.flatnonzero(np.isinf(x) | (np.isnan(x) & ~imputed))     # NaN in an imputed column: missing
    if len(bad):
        raise InvalidArgument(f"features[{bad[0] + 1}] ({_position(m, bad[0])}) is {x[bad[0]]}; "
                              f'model "{name}" needs finite numbers: filter or clip such rows')
    if m.pre.columns[0].kind == "array":
        return {m.feature_names[0]: x.reshape(1, -1)}
    return {c: x[i:i + 1] for i, c in enumerate(m.feature_names)}


def _from_row(m: CachedModel, name: str, row: dict) -> dict[str, np.ndarray]:
    """A row given by column name (a JSON object whose numbers are kept as their JSON text) ->
    the model's raw columns (one row). A category is the value's text as ``to_jsonb(value) #>>
    '{}'`` gives it, exactly as the training scan read it (``char(n)`` padding and a numeric's
    scale kept); a number's text, or "NaN" (a missing value), for a numeric column. Columns the
    model does not read are ignored; one it reads must be present (a JSON null is a NULL)."""
    absent = [c.name for c in m.pre.columns if c.name not in row]
    if absent:
        raise InvalidArgument(f'model "{name}" reads the columns {", ".join(m.feature_names)}; the row has no '
                              f'{", ".join(absent)} (give null for a missing value)')
    raw = {}
    for c in m.pre.columns:
        value = row[c.name]
        if c.kind == "categorical":
            text = None if value is None else ("true" if value is True else "false" if value is False else
                                               value if isinstance(value, str) else json.dumps(value))
            raw[c.name] = Categories.of([text])
            continue
        if c.kind == "array":
            if not isinstance(value, list):
                raise InvalidArgument(f'column "{c.name}" must be an array of {c.width} numbers, got {shown(value)}')
            raw[c.name] = np.asarray(_from_array(m, name, value)[c.name], np.float32)
            continue
        try:
            if isinstance(value, (bool, list, dict)):
                raise ValueError
            number = np.nan if value is None else float(value)      # JSON number text, or "NaN" (missing)
        except ValueError:
            raise InvalidArgument(f'column "{c.name}" is numeric in model "{name}"; got {shown(value)}: give a '
                                  "number, or null for a missing value") from None
        if not math.isnan(number) and not math.isfinite(number):
            raise InvalidArgument(f'column "{c.name}" is {number}; model "{name}" needs finite numbers')
        raw[c.name] = np.array([number], dtype=np.float32)
    return raw


def _outputs(plpy, GD, name: str, features) -> tuple[CachedModel, np.ndarray]:
    """The model's outputs for one row: ``features`` an array (PL/Python list) or a jsonb object
    (text; a table row arrives as ``to_jsonb(row)``)."""
    m = load(plpy, GD, name)
    if isinstance(features, str):
        try:        # numbers as their text: a category reads as the scan reads it, a number converts
            features = json.loads(features, parse_float=str, parse_int=str)
        except json.JSONDecodeError as exc:       # jsonb text is valid JSON; guard anyway
            raise InvalidArgument(f"features is not valid JSON: {exc}") from None
        if not isinstance(features, dict):
            raise InvalidArgument(f"a jsonb row must be an object of column -> value, got {shown(features)}")
        raw = _from_row(m, name, features)
    else:
        raw = _from_array(m, name, list(features))
    x = m.pre.transform(raw)
    return m, models.forward(m.spec, m.weights, x)[0]


def predict(plpy, GD, name: str, features) -> float:
    """The predicted class label (classification; for a text label, the class's index in
    ``label_names``) or value (regression) for one row."""
    m, out = _outputs(plpy, GD, name, features)
    return m.classes[int(out.argmax())] if m.classes else float(out[0])


def predict_label(plpy, GD, name: str, features) -> str:
    """The predicted class as text: its name for a text label, the number for a numeric one
    (exactly: ``1234567``; a boolean label is read as the numbers 0 and 1). Raises
    InvalidArgument for a regression model."""
    m, out = _outputs(plpy, GD, name, features)
    if not m.classes:
        raise InvalidArgument(f'model "{name}" is a regression model; predict_label needs a classifier')
    index = int(out.argmax())
    return m.label_names[index] if m.label_names else class_text(m.classes[index])


def predict_proba(plpy, GD, name: str, features) -> list[float]:
    """Class probabilities in the order of ``tensile.models.label_classes``."""
    m, out = _outputs(plpy, GD, name, features)
    if not m.classes:
        raise InvalidArgument(f'model "{name}" is a regression model; predict_proba needs a classifier')
    return [float(p) for p in out]
