"""``CALL tensile.train_model(...)`` in the backend.

Validates the arguments, reads the rows as the calling role, ships them to the coordinator, waits
in 0.1 s slices — calling into SPI between slices so that ``pg_cancel_backend`` and
``statement_timeout`` reach the backend, which then cancels the job in the coordinator before
re-raising — relays progress as NOTICE, and stores the model in the caller's transaction. The
stored metrics add the data path's timings: ``read_s`` (the SPI scan) and ``transfer_s`` (until the
coordinator has the arrays and has accepted the job).
"""

from __future__ import annotations

import functools
import json
import time

from ..errors import InvalidArgument
from ..runtime import model as models
from . import session
from .data import encode_labels, read_training_data

MAX_NAME_LENGTH = 63


def check_model_name(name) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"model_name must be a non-empty name of at most {MAX_NAME_LENGTH} characters, got {name!r}")
    return name


def train_model(plpy, GD, model_name, source, label, features, architecture, options) -> dict:
    check_model_name(model_name)
    arch = models.parse_architecture(architecture)
    opts = models.parse_options(options)
    existing = plpy.execute(session.plan(plpy, GD, """
        SELECT owner, owner = current_user OR (SELECT rolsuper OR rolbypassrls FROM pg_roles WHERE rolname = current_user)
               AS may_replace
        FROM tensile._model_owner($1) AS owner WHERE owner IS NOT NULL""", ["text"]), [model_name])
    if existing and opts.replace and not existing[0]["may_replace"]:
        raise InvalidArgument(f'model "{model_name}" is owned by role {existing[0]["owner"]}; only its owner can '
                              f"replace it — choose another model_name")
    if existing and not opts.replace:
        raise InvalidArgument(
            f'model "{model_name}" already exists (owner {existing[0]["owner"]}); pass options => '
            f"'{{\"replace\": true}}' to replace it, or drop it with tensile.drop_model('{model_name}')")
    started = time.perf_counter()
    data = read_training_data(plpy, source, label, features, opts.skip_nulls)
    read_s = time.perf_counter() - started
    task = opts.task or ("classification" if data.label_is_integer else "regression")
    y, classes = encode_labels(data, task)
    n_outputs = len(classes) if classes else 1
    skipped = f", {data.skipped_rows:,} rows with NULLs skipped" if data.skipped_rows else ""
    plpy.notice(f"tensile: training {model_name!r} ({task}) on {len(y):,} rows, {len(data.feature_names)} features"
                f"{', ' + str(n_outputs) + ' classes' if classes else ''}{skipped}")
    client, s = session.connect(plpy, GD)
    header = {"type": "train", "model_name": model_name, "role": s["role"], "backend_pid": s["pid"],
              "architecture": arch.to_json(), "options": opts.to_json(), "task": task, "n_outputs": n_outputs}
    with client:
        started = time.perf_counter()
        reply, _ = client.request(header, {"x": data.x, "y": y})
        transfer_s = time.perf_counter() - started
        plpy.notice(f"tensile: job {reply['job_id']} accepted; unscheduled peak {reply['vanilla_peak_nbytes']:,} bytes, "
                    f"device budget {reply['budget_nbytes']:,} bytes")
        result, weights = session.await_result(plpy, GD, client, "training", functools.partial(_relay_progress, plpy))
    metrics = dict(result["metrics"], read_s=read_s, transfer_s=transfer_s)
    if opts.replace:
        plpy.execute(session.plan(plpy, GD, "DELETE FROM tensile.models WHERE name = $1", ["text"]), [model_name])
    plpy.execute(session.plan(plpy, GD, """
        INSERT INTO tensile.models (name, task, architecture, options, feature_names, label_name, label_classes,
                                    metrics, weights)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)""",
        ["text", "text", "jsonb", "jsonb", "text[]", "text", "float8[]", "jsonb", "bytea"]),
        [model_name, task, json.dumps(arch.to_json()), json.dumps(opts.to_json()), data.feature_names, label,
         classes, json.dumps(metrics), models.serialize_weights(weights)])
    return {"model_name": model_name, "task": task, "metrics": json.dumps(metrics)}


def _relay_progress(plpy, header: dict, arrays: dict) -> None:
    if header["type"] == "progress":
        plpy.notice(f"tensile: epoch {header['epoch']}/{header['epochs']}: loss {header['loss']:.4f}, "
                    f"device {header['device_nbytes']:,} bytes (peak {header['peak_nbytes']:,}), "
                    f"swapped out {header['swapped_out_nbytes']:,} bytes")
