"""``CALL tensile.train_model(...)`` in the backend.

Validates the arguments (the model's size against ``tensile.max_layers`` /
``tensile.max_parameters`` too, and its layers against the architecture's input shape, before any
row is read), refuses a second training of a name that another session is training right now,
reads the rows as the calling role, holds out ``test_size`` of them and fits the preprocessing on
the rest (:mod:`.prepare`), ships them to the coordinator, waits in slices so that
``pg_cancel_backend``, ``statement_timeout`` and termination reach the backend
(:func:`.session.exchange`; the coordinator then cancels the job), relays progress as NOTICE
(with the held-out loss), and stores the model as a new version through :mod:`.registry` in the
caller's transaction, deployed by ``options.deploy``. With ``options.search`` the trials train at
once and each becomes a version (:mod:`.search`); the CALL reports the deployed one, else the
best. The stored metrics add the
data path's timings: ``read_s`` (the SPI scan), ``prepare_s`` (the split and the preprocessing) and ``transfer_s`` (until the coordinator has the
arrays and has accepted the job). A metric that is not a finite number (a regression whose error
overflows) is stored as null, with a WARNING naming it. A model trained on one array column
(:mod:`.data`) stores that column's name once in ``feature_names``; its input shape says how many
values a row holds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time

from ..errors import InvalidArgument
from ..runtime import model as models
from ..runtime import preprocess
from ..runtime.weights import check_weights, serialize_weights
from . import registry, served, session
from . import search as searching
from .data import read_training_data
from .prepare import prepare

MAX_NAME_LENGTH = 63
#: First key of the advisory locks that hold a model name while it trains ("tens").
NAME_LOCK_CLASS = 0x74656E73


def check_model_name(name) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"model_name must be a non-empty name of at most {MAX_NAME_LENGTH} characters, got {name!r}")
    return name


def _hold_name(plpy, GD, name: str) -> None:
    """Take a transaction-scoped advisory lock on the name, so that two sessions cannot train the
    same name at once (each would add a version, and the deploy decisions would race). Raises
    InvalidArgument when another session holds it. Locks are per database, as names are; two
    names whose hashes collide (about 1 in 4 billion) cannot train at the same moment either."""
    held = plpy.execute(session.plan(plpy, GD, f"""
        SELECT pg_catalog.pg_try_advisory_xact_lock({NAME_LOCK_CLASS}, pg_catalog.hashtext($1)) AS held""",
        ["pg_catalog.text"]), [name])[0]["held"]
    if not held:
        raise InvalidArgument(f'model "{name}" is being trained by another session, or was trained by one whose '
                              "transaction has not ended yet; wait until it ends (SELECT * FROM tensile.jobs shows "
                              "the training), then call again: the new training adds a version")


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
    registry.check_may_add(model_name, existing[0]["owner"] if existing else None, s["role"], any_owner, opts.replace)
    started = time.perf_counter()
    data = read_training_data(plpy, source, label, features, opts.skip_nulls, arch.input_shape,
                              imputed=lambda column: preprocess.imputes(opts, column),
                              configured=list(opts.preprocess or {}))
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    prepared = prepare(data, opts, functools.partial(_check_inputs, arch, limits, model_name))
    timings = {"read_s": read_s, "prepare_s": time.perf_counter() - started}
    task, classes = prepared.task, prepared.classes
    n_outputs = len(classes) if classes else 1
    spec = models.ModelSpec(arch, prepared.pre.width, n_outputs, task)   # an array column: one name, many values
    _notice_start(plpy, model_name, data, prepared, spec)
    header = {"model_name": model_name, "role": s["role"], "backend_pid": s["pid"], **prepared.header()}
    client, _ = session.connect(plpy, GD, s=s)
    with client:
        if opts.search is None:
            versions = [_train_one(plpy, GD, client, header, arch, opts, prepared, data, label, model_name, timings)]
        else:
            versions = _train_search(plpy, GD, client, header, arch, opts, limits, prepared, data, label, model_name,
                                     timings)
    added = registry.add_versions(plpy, GD, model_name, s["role"], any_owner, [v for v, _ in versions], opts.deploy,
                                  opts.replace)
    plpy.notice(f"tensile: {added.message}")
    if added.deployed is not None:
        served.retire_served(plpy, GD, model_name)
    best = added.versions.index(added.best)       # the deployed one when one is, as deployment ranks them
    return {"model_name": model_name, "task": task, "metrics": json.dumps(versions[best][1]),
            "version": added.best, "deployed": added.deployed == added.best}


def _train_one(plpy, GD, client, header, arch, opts, prepared, data, label, model_name, timings) -> tuple:
    """One model trained on the coordinator: its new version and its metrics."""
    started = time.perf_counter()
    reply, _ = session.request(plpy, GD, client, dict(header, type="train", architecture=arch.to_json(),
                                                      options=opts.to_json()),
                               prepared.arrays(session.takes_rows(plpy, GD, client)), doing="the start of training")
    transfer_s = time.perf_counter() - started
    plpy.notice(f"tensile: job {reply['job_id']} accepted on device {reply['device']}; unscheduled peak "
                f"{reply['vanilla_peak_nbytes']:,} bytes, device budget {reply['budget_nbytes']:,} bytes")
    result, weights = session.await_result(plpy, GD, client, "training", functools.partial(_relay_progress, plpy))
    return _version(plpy, arch, opts, prepared, data, label, model_name,
                    dict(result["metrics"], **timings, transfer_s=transfer_s), weights, None)


def _train_search(plpy, GD, client, header, arch, opts, limits, prepared, data, label, model_name, timings) -> list:
    """The trials of ``opts.search`` trained at once on the coordinator: each trained one's new
    version and metrics. Raises InvalidArgument when every trial failed."""
    n_outputs = len(prepared.classes) if prepared.classes else 1
    found, trials = searching.plan(arch, opts, limits, prepared.pre.width, n_outputs, prepared.task, model_name)
    search_id = searching.new_id()

    def keep(t: searching.Trial) -> None:         # serialized as it arrives: the arrays are dropped
        t.version = _version(plpy, models.parse_architecture(t.architecture), models.parse_options(t.options),
                             prepared, data, label, model_name, dict(t.metrics, **timings), t.weights,
                             t.record(search_id))
        t.weights = None

    wall_s = searching.run(plpy, GD, client, header, prepared.arrays(session.takes_rows(plpy, GD, client)), found,
                           trials, model_name, keep)
    done = [t.version for t in trials if t.version is not None]
    if not done:
        raise InvalidArgument(f"every trial of the search failed; the first: {trials[0].error}")
    return [(dataclasses.replace(v, metrics=registry.jsonb(dict(m, search_wall_s=wall_s))),
             dict(m, search_wall_s=wall_s)) for v, m in done]


def _check_inputs(arch, limits: models.Limits, name: str, task: str, n_outputs: int, pre, rows: int) -> None:
    """Before the network's inputs are built: the model against the limits (the input shape
    against the columns too), and the inputs' bytes against ``tensile.max_job_bytes``. Raises
    InvalidArgument naming the widest encoded columns."""
    limits.check(models.ModelSpec(arch, pre.width, n_outputs, task), name)
    nbytes = rows * pre.width * 4
    if nbytes > limits.max_job_nbytes:
        widest = sorted(pre.columns, key=lambda c: -c.width)[:3]
        listed = ", ".join(f'"{c.name}" ({c.width:,})' for c in widest)
        raise InvalidArgument(f"the encoded inputs of {rows:,} rows by {pre.width:,} inputs take {nbytes:,} bytes, more "
                              f"than tensile.max_job_bytes ({limits.max_job_nbytes:,}); the widest columns: {listed}: "
                              "lower options.max_categories, encode them ordinal, or read fewer rows")


def _version(plpy, arch, opts, prepared, data, label, model_name, metrics, weights, search) -> tuple:
    """One new version of the model, and its metrics as stored."""
    metrics = _finite_metrics(plpy, metrics)
    spec = models.ModelSpec(arch, prepared.pre.width, len(prepared.classes) if prepared.classes else 1, prepared.task)
    weights = check_weights(spec, weights, model_name)
    return registry.NewVersion(
        prepared.task, registry.jsonb(arch.to_json()), registry.jsonb(opts.to_json()), data.feature_names, label,
        prepared.classes, prepared.label_names, registry.jsonb(metrics), serialize_weights(weights),
        registry.jsonb(prepared.pre.to_json()), None if search is None else registry.jsonb(search)), metrics


def _notice_start(plpy, model_name: str, data, prepared, spec) -> None:
    skipped = f", {data.skipped_rows:,} rows with NULLs skipped" if data.skipped_rows else ""
    inputs = f" ({spec.n_features} inputs)" if spec.n_features != len(data.feature_names) else ""
    held = f", {len(prepared.y_test):,} held out" if len(prepared.y_test) else ""
    classes = f", {len(prepared.classes)} classes" if prepared.classes else ""
    plpy.notice(f"tensile: training {model_name!r} ({prepared.task}) on {len(prepared.y):,} rows{held}, "
                f"{len(data.feature_names)} feature columns{inputs}{classes}{skipped}")


def _relay_progress(plpy, header: dict, arrays: dict) -> None:
    if header["type"] == "progress":
        held = f", held-out loss {header['val_loss']:.4f}" if "val_loss" in header else ""
        plpy.notice(f"tensile: epoch {header['epoch']}/{header['epochs']}: loss {header['loss']:.4f}{held}, "
                    f"device {header['device_nbytes']:,} bytes (peak {header['peak_nbytes']:,}), "
                    f"swapped out {header['swapped_out_nbytes']:,} bytes")
