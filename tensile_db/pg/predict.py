"""``tensile.predict`` / ``tensile.predict_proba``: row-by-row inference in the backend, on the CPU.

The model is cached for the session in GD, keyed by name (the ``MAX_CACHED_MODELS`` most recently
used), and checked on every call against the row's ``id`` in ``tensile.models`` (one indexed
lookup through a prepared plan): replacing a model gives it a new id, so a cached copy is never
used after the model changed. A model is loaded only
within ``tensile.max_layers`` / ``tensile.max_parameters`` and with weights that match its
architecture (:func:`~tensile_db.runtime.weights.load_weights`). A row's features must be an
array of finite numbers: NaN and infinities are refused by name. A model whose architecture gives
the rows' shape (``"input": {"shape": [C, H, W]}``) takes an array of any dimensionality holding
that many values, flattened in row-major order (an image as ``real[]`` of 8x8 or 1x8x8 as well as
64 values in a row); a model without one takes a one-dimensional array only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument, ModelNotFound
from ..runtime import model as models
from ..runtime.weights import load_weights
from . import session

#: Models a session keeps loaded, least recently used dropped first (each up to tensile.max_parameters).
MAX_CACHED_MODELS = 8


@dataclass
class CachedModel:
    id: int
    spec: models.ModelSpec
    weights: dict
    classes: list[float] | None
    feature_names: list[str]


def load(plpy, GD, name: str) -> CachedModel:
    """The model ``name`` as the calling role sees it, cached for the session. Raises
    ModelNotFound, InvalidArgument (a model larger than the limits) or CorruptModel."""
    cache = GD.setdefault("tensile_models", collections.OrderedDict())
    rows = plpy.execute(session.plan(plpy, GD, "SELECT id FROM tensile.models WHERE name OPERATOR(pg_catalog.=) $1",
                                     ["pg_catalog.text"]), [name])
    if not rows:
        cache.pop(name, None)
        raise ModelNotFound(f'model "{name}" does not exist; SELECT name FROM tensile.models lists the models')
    cached = cache.get(name)
    if cached is None or cached.id != rows[0]["id"]:
        row = plpy.execute(session.plan(plpy, GD, """
            SELECT id, task, architecture::pg_catalog.text AS architecture, feature_names, label_classes, weights
            FROM tensile.models WHERE id OPERATOR(pg_catalog.=) $1""", ["pg_catalog.int8"]), [rows[0]["id"]])[0]
        classes = list(row["label_classes"]) if row["label_classes"] else None
        spec = models.ModelSpec.of_row(row["architecture"], row["feature_names"],
                                      len(classes) if classes else 1, row["task"])
        session.limits(plpy, GD, session.settings(plpy, GD)).check(spec, name)
        cached = CachedModel(row["id"], spec, load_weights(row["weights"], spec, name), classes,
                             list(row["feature_names"]))
        cache[name] = cached
        while len(cache) > MAX_CACHED_MODELS:
            cache.popitem(last=False)
    cache.move_to_end(name)
    return cached


def _expected(m: CachedModel) -> str:
    """What a model's features are, for messages: its columns, or its input shape and array column."""
    shape = m.spec.architecture.input_shape
    if len(m.feature_names) < m.spec.n_features:
        return f"{m.spec.n_features} values (input shape {list(shape)}, as in column {m.feature_names[0]})"
    return f"{m.spec.n_features} features ({', '.join(m.feature_names)})"


def _position(m: CachedModel, i: int) -> str:
    """The feature at flat position ``i``: its column, or the 1-based position in the array column."""
    return m.feature_names[i] if len(m.feature_names) == m.spec.n_features else f"{m.feature_names[0]}[{i + 1}]"


def _flattened(values: list) -> list:
    """A PostgreSQL array as PL/Python passes it (nested lists, one level a dimension) in row-major order."""
    while values and isinstance(values[0], list):
        values = [v for inner in values for v in inner]
    return values


def _outputs(plpy, GD, name: str, features) -> tuple[CachedModel, np.ndarray]:
    m = load(plpy, GD, name)
    if any(isinstance(v, list) for v in features):
        if m.spec.architecture.input_shape is None:
            raise InvalidArgument(f"features must be a one-dimensional array of {m.spec.n_features} numbers, got a "
                                  f"multidimensional array; pass ARRAY[{', '.join(m.feature_names[:3])}, ...]")
        features = _flattened(features)
    if len(features) != m.spec.n_features:
        raise InvalidArgument(f'model "{name}" expects {_expected(m)}, got {len(features)}')
    if any(v is None for v in features):
        raise InvalidArgument(f"features[{[v is None for v in features].index(True) + 1}] is NULL; "
                              f'model "{name}" needs a value for every feature')
    x = np.asarray(features, dtype=np.float32).reshape(1, -1)
    bad = np.flatnonzero(~np.isfinite(x[0]))
    if len(bad):
        raise InvalidArgument(f"features[{bad[0] + 1}] ({_position(m, bad[0])}) is {x[0, bad[0]]}; "
                              f'model "{name}" needs finite numbers: filter or clip such rows')
    return m, models.forward(m.spec, m.weights, x)[0]


def predict(plpy, GD, name: str, features) -> float:
    """The predicted class label (classification) or value (regression) for one row."""
    m, out = _outputs(plpy, GD, name, features)
    return m.classes[int(out.argmax())] if m.classes else float(out[0])


def predict_proba(plpy, GD, name: str, features) -> list[float]:
    """Class probabilities in the order of ``tensile.models.label_classes``."""
    m, out = _outputs(plpy, GD, name, features)
    if not m.classes:
        raise InvalidArgument(f'model "{name}" is a regression model; predict_proba needs a classifier')
    return [float(p) for p in out]
