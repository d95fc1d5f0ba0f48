"""``CALL tensile.train_model(...)`` in the backend.

Validates the arguments (the model's size against ``tensile.max_layers`` /
``tensile.max_parameters`` too, and its layers against the architecture's input shape, before any
row is read), refuses a second training of a name that another session is training right now,
reads the rows as the calling role, ships them to the coordinator, waits in slices so that
``pg_cancel_backend``, ``statement_timeout`` and termination reach the backend
(:func:`.session.exchange`; the coordinator then cancels the job), relays progress as NOTICE, and
stores the model through :mod:`.registry` in the caller's transaction. The stored metrics add the
data path's timings: ``read_s`` (the SPI scan) and ``transfer_s`` (until the coordinator has the
arrays and has accepted the job). A metric that is not a finite number (a regression whose error
overflows) is stored as null, with a WARNING naming it. A model trained on one array column
(:mod:`.data`) stores that column's name once in ``feature_names``; its input shape says how many
values a row holds.
"""

from __future__ import annotations

import functools
import json
import math
import time

from ..errors import InvalidArgument
from ..runtime import model as models
from ..runtime.weights import check_weights, serialize_weights
from . import registry, session
from .data import encode_labels, read_training_data

MAX_NAME_LENGTH = 63
#: First key of the advisory locks that hold a model name while it trains ("tens").
NAME_LOCK_CLASS = 0x74656E73


def check_model_name(name) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"model_name must be a non-empty name of at most {MAX_NAME_LENGTH} characters, got {name!r}")
    return name


def _hold_name(plpy, GD, name: str) -> None:
    """Take a transaction-scoped advisory lock on the name, so that two sessions cannot train the
    same name at once (the second would train in full, then fail to store). Raises
    InvalidArgument when another session holds it. Locks are per database, as names are; two
    names whose hashes collide (about 1 in 4 billion) cannot train at the same moment either."""
    held = plpy.execute(session.plan(plpy, GD, f"""
        SELECT pg_catalog.pg_try_advisory_xact_lock({NAME_LOCK_CLASS}, pg_catalog.hashtext($1)) AS held""",
        ["pg_catalog.text"]), [name])[0]["held"]
    if not held:
        raise InvalidArgument(f'model "{name}" is being trained by another session, or was trained by one whose '
                              "transaction has not ended yet; wait until it ends (SELECT * FROM tensile.jobs shows "
                              "the training), then call again, with options => '{\"replace\": true}' to replace it")


def _finite_metrics(plpy, metrics: dict) -> dict:
    """``metrics`` with every non-finite number replaced by None, and a WARNING naming them."""
    bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        plpy.warning(f"tensile: metrics {', '.join(bad)} are not finite numbers and are stored as null; "
                     "the label's values may be too large: scale the label in the source")
    return {k: None if k in bad else v for k, v in metrics.items()}


def train_model(plpy, GD, model_name, source, label, features, architecture, options) -> dict:
    check_model_name(model_name)
    arch = models.parse_architecture(architecture)
    opts = models.parse_options(options)
    s = session.settings(plpy, GD)
    limits = session.limits(plpy, GD, s)
    # Before reading any row: the layers against the limits and the input shape (without an input
    # shape, one value per row until the rows say how many there are).
    limits.check(models.ModelSpec(arch, arch.n_features or 1, 1, "regression"), model_name)
    _hold_name(plpy, GD, model_name)
    existing = plpy.execute(session.plan(plpy, GD, """
        SELECT owner, owner OPERATOR(pg_catalog.=) current_user AS own
        FROM tensile._model_owner($1) AS owner WHERE owner IS NOT NULL""", ["pg_catalog.text"]), [model_name])
    any_owner = registry.may_replace_any(plpy, GD)
    if existing and opts.replace and not (existing[0]["own"] or any_owner):
        raise InvalidArgument(f'model "{model_name}" is owned by role {existing[0]["owner"]}; only its owner can '
                              f"replace it — choose another model_name")
    if existing and not opts.replace:
        raise InvalidArgument(
            f'model "{model_name}" already exists (owner {existing[0]["owner"]}); pass options => '
            f"'{{\"replace\": true}}' to replace it, or drop it with tensile.drop_model('{model_name}')")
    started = time.perf_counter()
    data = read_training_data(plpy, source, label, features, opts.skip_nulls, arch.input_shape)
    read_s = time.perf_counter() - started
    task = opts.task or ("classification" if data.label_is_integer else "regression")
    y, classes = encode_labels(data, task)
    n_outputs = len(classes) if classes else 1
    spec = models.ModelSpec(arch, data.x.shape[1], n_outputs, task)   # an array column: one name, many values
    limits.check(spec, model_name)             # and the input shape against the columns, before any job
    skipped = f", {data.skipped_rows:,} rows with NULLs skipped" if data.skipped_rows else ""
    array = f" of array column {data.feature_names[0]!r}" if len(data.feature_names) < spec.n_features else ""
    plpy.notice(f"tensile: training {model_name!r} ({task}) on {len(y):,} rows, {spec.n_features} features{array}"
                f"{', ' + str(n_outputs) + ' classes' if classes else ''}{skipped}")
    client, _ = session.connect(plpy, GD, s=s)
    header = {"type": "train", "model_name": model_name, "role": s["role"], "backend_pid": s["pid"],
              "architecture": arch.to_json(), "options": opts.to_json(), "task": task, "n_outputs": n_outputs}
    with client:
        started = time.perf_counter()
        reply, _ = session.request(plpy, GD, client, header, {"x": data.x, "y": y}, doing="the start of training")
        transfer_s = time.perf_counter() - started
        plpy.notice(f"tensile: job {reply['job_id']} accepted; unscheduled peak {reply['vanilla_peak_nbytes']:,} bytes, "
                    f"device budget {reply['budget_nbytes']:,} bytes")
        result, weights = session.await_result(plpy, GD, client, "training", functools.partial(_relay_progress, plpy))
    metrics = _finite_metrics(plpy, dict(result["metrics"], read_s=read_s, transfer_s=transfer_s))
    weights = check_weights(spec, weights, model_name)
    row = (task, registry.jsonb(arch.to_json()), registry.jsonb(opts.to_json()), data.feature_names, label, classes,
           registry.jsonb(metrics), serialize_weights(weights))
    registry.apply(plpy, GD, registry.Write(model_name, s["role"], any_owner, delete=opts.replace, row=row))
    return {"model_name": model_name, "task": task, "metrics": json.dumps(metrics)}


def _relay_progress(plpy, header: dict, arrays: dict) -> None:
    if header["type"] == "progress":
        plpy.notice(f"tensile: epoch {header['epoch']}/{header['epochs']}: loss {header['loss']:.4f}, "
                    f"device {header['device_nbytes']:,} bytes (peak {header['peak_nbytes']:,}), "
                    f"swapped out {header['swapped_out_nbytes']:,} bytes")
