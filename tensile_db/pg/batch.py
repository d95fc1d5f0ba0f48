"""``tensile.predict_batch`` and ``CALL tensile.predict_into``: batch inference on the coordinator.

The backend side of the ``predict`` protocol (the coordinator side is :mod:`tensile_db.inference`):

1. Validate the options, then read the deployed version's row *without* its weights: id, a
   cluster-wide version name (database, owner, ``created_at``), task, architecture, feature
   names, classes, preprocessing. Row-level security applies, so a model the role cannot see is
   "not found".
2. Read the model's feature columns, in ``feature_names`` order, and the optional integer key
   column from the source, as the calling role, in one scan (:func:`.data.read_features`), and
   turn them into the network's inputs with the model's stored preprocessing (imputation,
   encoding). An empty source — or one whose every row was skipped — gives no rows and never
   contacts the coordinator.
3. Send a ``predict`` header naming the model by id and version, with the inputs ``x`` (N, F)
   float32 before scaling (the coordinator applies the stored ``x_mean`` / ``x_std``). The
   coordinator answers ``need_weights`` when it does not hold that version (open, or in its model
   file); only then are the weights read (``WHERE id = $1``) and sent as ``weights``. It then
   answers ``accepted`` and, once every batch has streamed through the layers, ``result`` with
   ``outputs`` (N, n_outputs) float32: class probabilities, or values in the label's units.
   It answers ``reload`` instead when a layer read from its copy of the model (a file on its
   disk) was corrupt: it has deleted that copy and returned nothing, so the backend repeats the
   call once, sending the weights again, with a WARNING.
4. Wait in slices so that a cancel reaches the backend (:func:`.session.await_result`); on any
   error the backend sends ``cancel`` and the coordinator stops the call between two layers and
   frees its device memory.

predict_batch is STABLE: every SPI query of one call sees the calling statement's snapshot, so
the model row, its weights and the source are read as of one moment, and a call that overlaps a
deployment predicts wholly with the old version or wholly with the new one. predict_into is a
procedure (it writes), so each of its queries sees a new snapshot: if the version was dropped
between reading its row and its weights, it raises ModelNotFound and asks to call again. It writes in chunks of ``INSERT_CHUNK_ROWS`` rows, as the calling role, in the
caller's transaction.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import numpy as np

from ..errors import CorruptModel, InvalidArgument, ModelNotFound, ProtocolError
from ..runtime import model as models
from ..runtime.checks import check_keys
from ..runtime.metrics import class_text
from ..runtime.preprocess import Preprocessor
from ..runtime.weights import load_weights
from ..settings import MAX_PREDICT_BATCH_ROWS
from . import registry, session
from .data import is_table_name, read_features
from .train import check_model_name

#: Rows per batch streamed through the layers, at most (the default is the coordinator's choice).
MAX_BATCH_SIZE = MAX_PREDICT_BATCH_ROWS
#: Rows per INSERT statement of predict_into.
INSERT_CHUNK_ROWS = 10_000
#: The columns predict_into writes, with their types as ``format_type`` spells them.
TARGET_COLUMNS = {"id": "bigint", "prediction": "double precision", "probabilities": "real[]"}


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Every option: what it must be (for the error message) and the test of a value.
_OPTIONS = {
    "window": ('an integer >= 1 (layers kept loaded ahead of the one computing) or "all"',
               lambda v: (isinstance(v, str) and v.lower() == "all") or (_is_integer(v) and v >= 1)),
    "batch_size": (f"an integer from 1 to {MAX_BATCH_SIZE}", lambda v: _is_integer(v) and 1 <= v <= MAX_BATCH_SIZE),
    "cache": ("true or false", lambda v: isinstance(v, bool)),
    "skip_nulls": ("true or false", lambda v: isinstance(v, bool)),
}


@dataclass(frozen=True)
class BatchOptions:
    """predict_batch's options; the field names are the JSON keys users write."""

    window: int | str | None = None         # layers loaded ahead, or "all"; None: tensile.prefetch_window
    batch_size: int | None = None           # rows per batch; None: the most up to 256 whose steps fit the budget
    cache: bool = True                      # keep the model's layers in the device weight cache after use
    skip_nulls: bool = False                # leave out rows with a NULL feature or key instead of failing


@dataclass(frozen=True)
class ModelRow:
    """A model's row without its weights. ``version`` names this row's contents in the whole
    cluster: the database's oid, the owner and ``created_at`` as ISO 8601 UTC text (``id`` alone
    repeats across databases, and a role could insert a row with a chosen id and created_at, but
    not with another role as owner)."""

    id: int
    database: int                           # oid of the database that holds the row
    version: str
    name: str
    spec: models.ModelSpec
    architecture: dict
    feature_names: list[str]
    classes: list[float] | None
    pre: Preprocessor                       # how the raw columns become the network's inputs
    label_names: list[str] | None = None    # a text label's class names, in label_classes order


def parse_options(value) -> BatchOptions:
    """Validate predict_batch's options (JSON text or dict). Raises InvalidArgument naming the key,
    the value and what it must be."""
    obj = models.load_json_object(value, "options")
    check_keys(obj, tuple(_OPTIONS), "options")
    for key, val in obj.items():
        what, ok = _OPTIONS[key]
        if not ok(val):
            raise InvalidArgument(f"options.{key} must be {what}, got {json.dumps(val)}")
    return BatchOptions(**obj)


def read_model(plpy, GD, name, limits: models.Limits) -> ModelRow:
    """The model's row, weights left out. Raises ModelNotFound when the role sees no such model,
    InvalidArgument when it is larger than ``limits``."""
    check_model_name(name)
    rows = plpy.execute(session.plan(plpy, GD, """
        SELECT id, d.oid AS database,
               pg_catalog.concat_ws('/', d.oid, owner, pg_catalog.to_char(created_at AT TIME ZONE 'UTC',
                                                                         'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')) AS version,
               task, architecture::pg_catalog.text AS architecture, feature_names, label_classes,
               preprocess::pg_catalog.text AS preprocess, label_names
        FROM tensile.models, (SELECT oid FROM pg_catalog.pg_database
                              WHERE datname OPERATOR(pg_catalog.=) pg_catalog.current_database()) d
        WHERE name OPERATOR(pg_catalog.=) $1 AND deployed""", ["pg_catalog.text"]), [name])
    if not rows:
        raise registry.not_deployed(plpy, GD, name)
    row = rows[0]
    architecture = json.loads(row["architecture"])
    classes = list(row["label_classes"]) if row["label_classes"] else None
    pre = models.preprocessor_of_row(row["preprocess"], row["feature_names"], architecture)
    spec = models.ModelSpec.of_row(architecture, row["feature_names"], len(classes) if classes else 1, row["task"],
                                   pre.width)
    limits.check(spec, name)
    return ModelRow(row["id"], row["database"], row["version"], name, spec, architecture, list(row["feature_names"]),
                    classes, pre, list(row["label_names"]) if row["label_names"] else None)


def _weights(plpy, GD, model: ModelRow) -> dict[str, np.ndarray]:
    """The model's weights, checked against its architecture. Raises ModelNotFound or CorruptModel."""
    rows = plpy.execute(session.plan(plpy, GD, "SELECT weights FROM tensile.models WHERE id OPERATOR(pg_catalog.=) $1",
                                     ["pg_catalog.int8"]), [model.id])
    if not rows:
        raise ModelNotFound(f'model "{model.name}" was replaced or dropped while this call read it; call again')
    return load_weights(rows[0]["weights"], model.spec, model.name)


class _Reload(Exception):
    """The coordinator found its copy of the model's weights corrupt and discarded it (message)."""


def _infer(plpy, GD, s: dict, model: ModelRow, x: np.ndarray, window: int, opts: BatchOptions) -> np.ndarray:
    """Run x (N, F) float32 through the model on the coordinator: outputs (N, n_outputs) float32.
    When the coordinator answers ``reload`` (a layer of its model file was corrupt; it returned
    nothing), the call is repeated once, the weights read again from the registry; a second
    ``reload`` raises CorruptModel."""
    try:
        return _infer_once(plpy, GD, s, model, x, window, opts)
    except _Reload as exc:
        plpy.warning(f"tensile: the coordinator's copy of model {model.name!r} was corrupt ({exc}); its weights "
                     "were read again from tensile.models")
    try:
        return _infer_once(plpy, GD, s, model, x, window, opts)
    except _Reload as exc:
        raise CorruptModel(f"model {model.name!r}: the coordinator's copy of its weights was corrupt twice in a "
                           f"row ({exc}); check the disk of the coordinator's models directory") from None


def _infer_once(plpy, GD, s: dict, model: ModelRow, x: np.ndarray, window: int, opts: BatchOptions) -> np.ndarray:
    """One exchange of :func:`_infer`. Raises _Reload when the coordinator asks for one."""
    client, _ = session.connect(plpy, GD, s=s)
    timeout_s = session.coordinator_timeout(plpy, GD)
    header = {"type": "predict", "model_name": model.name, "model_id": model.id, "model_version": model.version,
              "database": model.database,
              "task": model.spec.task, "architecture": model.architecture, "n_outputs": model.spec.n_outputs,
              "window": window, "batch_size": opts.batch_size, "cache": opts.cache, "role": s["role"],
              "backend_pid": s["pid"]}

    def until_accepted(reply: dict) -> None:
        """Answer the coordinator until it accepts the call (within the timeout at each step)."""
        if reply["type"] == "need_weights":
            weights = _weights(plpy, GD, model)
            reply, _ = session.request(plpy, GD, client, {"type": "weights"}, weights,
                                       doing="the start of a prediction", timeout_s=timeout_s)
        if reply["type"] != "accepted":
            raise ProtocolError(f"unexpected {reply['type']!r} message from the coordinator during prediction")

    def on_message(reply: dict, arrays: dict) -> None:
        if reply["type"] == "reload":
            raise _Reload(reply.get("message", ""))
        raise ProtocolError(f"unexpected {reply['type']!r} message from the coordinator during prediction")

    with client:
        reply, _ = session.request(plpy, GD, client, header, {"x": x}, doing="the start of a prediction",
                                   timeout_s=timeout_s)
        until_accepted(reply)
        result, arrays = session.await_result(plpy, GD, client, "prediction", on_message)
    outputs = arrays.get("outputs")
    expected = (x.shape[0], model.spec.n_outputs)
    if outputs is None or outputs.shape != expected:
        raise ProtocolError(f"the coordinator's outputs have shape {None if outputs is None else outputs.shape}, "
                            f"expected {expected}")
    plpy.debug(f"tensile: predicted {x.shape[0]:,} rows with {model.name!r}: {json.dumps(result.get('stats'))}")
    return outputs


def _predict(plpy, GD, model_name, source, key, options) -> tuple[ModelRow, np.ndarray, np.ndarray]:
    """The model, the ids (N,) int64 and the outputs (N, n_outputs) float32 of the source's rows."""
    opts = parse_options(options)
    s = session.settings(plpy, GD)
    model = read_model(plpy, GD, model_name, session.limits(plpy, GD, s))
    window = opts.window if opts.window is not None else session.prefetch_window(plpy, GD)
    layers = len(model.spec.network.layered)
    window = layers if isinstance(window, str) else min(window, layers)
    data = read_features(plpy, source, model.pre, key, opts.skip_nulls, model.spec.architecture.input_shape)
    if len(data.ids) == 0:
        return model, data.ids, np.empty((0, model.spec.n_outputs), dtype=np.float32)
    return model, data.ids, _infer(plpy, GD, s, model, model.pre.transform(data.raw), window, opts)


def _predictions(model: ModelRow, outputs: np.ndarray) -> np.ndarray:
    """(N,) float64: the class label of the most probable class, or the regression value."""
    if model.classes:
        return np.asarray(model.classes, dtype=np.float64)[outputs.argmax(axis=1)]
    return outputs[:, 0].astype(np.float64)


def predict_batch(plpy, GD, model_name, source, key, options):
    """Rows ``(id, prediction, probabilities, class_name)`` for every row of ``source`` that is kept:
    for a classifier the class label (a text label's index), the class probabilities in
    ``label_classes`` order and the class by its name (as ``predict_label`` gives it); for a
    regression model the value, NULL and NULL."""
    model, ids, outputs = _predict(plpy, GD, model_name, source, key, options)
    if not model.classes:
        none = itertools.repeat(None)
        return zip(ids.tolist(), _predictions(model, outputs).tolist(), none, none)
    names = model.label_names or [class_text(c) for c in model.classes]
    labels = (names[i] for i in outputs.argmax(axis=1).tolist())
    return zip(ids.tolist(), _predictions(model, outputs).tolist(), (row.tolist() for row in outputs), labels)


def _target(plpy, GD, target) -> str:
    """``target`` checked as a table name; the table is created if it does not exist. Raises
    InvalidArgument for a name that is not a table name or a table without TARGET_COLUMNS."""
    name = (target or "").strip()
    if not is_table_name(name):
        raise InvalidArgument(f"target must be a table name, optionally schema-qualified, got {target!r}")
    oid = plpy.execute(session.plan(plpy, GD, "SELECT pg_catalog.to_regclass($1)::pg_catalog.oid AS oid",
                                    ["pg_catalog.text"]), [name])[0]["oid"]
    if oid is None:
        plpy.execute(f"CREATE TABLE {name} ({', '.join(f'{c} {t}' for c, t in TARGET_COLUMNS.items())})")
        return name
    columns = plpy.execute(session.plan(plpy, GD, """
        SELECT attname::pg_catalog.text AS name, pg_catalog.format_type(atttypid, atttypmod) AS type
        FROM pg_catalog.pg_attribute
        WHERE attrelid OPERATOR(pg_catalog.=) $1 AND attnum OPERATOR(pg_catalog.>) 0 AND NOT attisdropped""",
        ["pg_catalog.oid"]), [oid])
    have = {r["name"]: r["type"] for r in columns}
    problems = [f"column {c} {t} is missing" if c not in have else f"column {c} is {have[c]}, not {t}"
                for c, t in TARGET_COLUMNS.items() if have.get(c) != t]
    if problems:
        raise InvalidArgument(f"target {name} does not fit the rows predict_into writes: {'; '.join(problems)}; "
                              "alter it, or name a table that does not exist yet and predict_into creates it")
    return name


def predict_into(plpy, GD, model_name, source, target, key, options) -> dict:
    """Write predict_batch's rows into ``target`` (created when it does not exist, else appended
    to); the procedure's INOUT ``rows``: how many were written."""
    table = _target(plpy, GD, target)
    model, ids, outputs = _predict(plpy, GD, model_name, source, key, options)
    # Row k's probabilities are $3[(k - 1) * $4 + 1 : k * $4], with pg_catalog's operators.
    first = "(k OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog.*) $4 OPERATOR(pg_catalog.+) 1"
    last = "k OPERATOR(pg_catalog.*) $4"
    insert = plpy.prepare(f"""
        INSERT INTO {table} (id, prediction, probabilities)
        SELECT $1[k], $2[k], CASE WHEN $4 OPERATOR(pg_catalog.>) 0 THEN $3[{first} : {last}] END
        FROM pg_catalog.generate_subscripts($1, 1) AS k""", ["bigint[]", "double precision[]", "real[]", "integer"])
    predictions = _predictions(model, outputs)
    width = outputs.shape[1] if model.classes else 0
    for start in range(0, len(ids), INSERT_CHUNK_ROWS):
        chunk = slice(start, start + INSERT_CHUNK_ROWS)
        probabilities = outputs[chunk].reshape(-1).tolist() if width else []
        plpy.execute(insert, [ids[chunk].tolist(), predictions[chunk].tolist(), probabilities, width])
    return {"rows": len(ids)}
