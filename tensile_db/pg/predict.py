"""``tensile.predict`` / ``tensile.predict_proba``: row-by-row inference in the backend, on the CPU.

The model is cached for the session in GD, keyed by name, and checked on every call against the
row's ``id`` in ``tensile.models`` (one indexed lookup through a prepared plan): replacing a model
gives it a new id, so a cached copy is never used after the model changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument, ModelNotFound
from ..runtime import model as models
from . import session


@dataclass
class CachedModel:
    id: int
    spec: models.ModelSpec
    weights: dict
    classes: list[float] | None
    feature_names: list[str]


def load(plpy, GD, name: str) -> CachedModel:
    cache = GD.setdefault("tensile_models", {})
    rows = plpy.execute(session.plan(plpy, GD, "SELECT id FROM tensile.models WHERE name = $1", ["text"]), [name])
    if not rows:
        cache.pop(name, None)
        raise ModelNotFound(f'model "{name}" does not exist; SELECT name FROM tensile.models lists the models')
    cached = cache.get(name)
    if cached is None or cached.id != rows[0]["id"]:
        row = plpy.execute(session.plan(plpy, GD, """
            SELECT id, task, architecture::text AS architecture, feature_names, label_classes, weights
            FROM tensile.models WHERE name = $1""", ["text"]), [name])[0]
        classes = list(row["label_classes"]) if row["label_classes"] else None
        spec = models.ModelSpec(models.parse_architecture(json.loads(row["architecture"])), len(row["feature_names"]),
                                len(classes) if classes else 1, row["task"])
        cached = CachedModel(row["id"], spec, models.deserialize_weights(row["weights"]), classes,
                             list(row["feature_names"]))
        cache[name] = cached
    return cached


def _outputs(plpy, GD, name: str, features) -> tuple[CachedModel, np.ndarray]:
    m = load(plpy, GD, name)
    if len(features) != m.spec.n_features:
        raise InvalidArgument(f'model "{name}" expects {m.spec.n_features} features ({", ".join(m.feature_names)}), '
                              f"got {len(features)}")
    if any(v is None for v in features):
        raise InvalidArgument(f"features[{[v is None for v in features].index(True) + 1}] is NULL; "
                              f'model "{name}" needs a value for every feature')
    return m, models.forward(m.spec, m.weights, np.asarray(features, dtype=np.float32).reshape(1, -1))[0]


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
