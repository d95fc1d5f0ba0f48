"""What the extension's SQL functions call. Each entry turns tensile_db errors into SQL errors
with a fitting SQLSTATE; PostgreSQL's own errors (unknown table, permission denied, cancel) pass
through unchanged."""

from __future__ import annotations

import datetime
import functools
import json

from ..errors import (CoordinatorUnavailable, DeviceOutOfMemory, InvalidArgument, JobCancelled, ModelNotFound,
                      ProtocolError, TensileError)
from . import batch as _batch
from . import predict as _predict
from . import session
from . import train as _train

SQLSTATE = {
    InvalidArgument: "22023",          # invalid_parameter_value
    ModelNotFound: "42704",            # undefined_object
    DeviceOutOfMemory: "53200",        # out_of_memory
    JobCancelled: "57014",             # query_canceled
    CoordinatorUnavailable: "08006",   # connection_failure
    ProtocolError: "08P01",            # protocol_violation
}


def _sql_errors(fn):
    @functools.wraps(fn)
    def wrapper(plpy, *args):
        try:
            return fn(plpy, *args)
        except TensileError as exc:
            plpy.error(str(exc), sqlstate=SQLSTATE.get(type(exc), "XX000"))
    return wrapper


train_model = _sql_errors(_train.train_model)
predict = _sql_errors(_predict.predict)
predict_proba = _sql_errors(_predict.predict_proba)
predict_batch = _sql_errors(_batch.predict_batch)
predict_into = _sql_errors(_batch.predict_into)


@_sql_errors
def drop_model(plpy, GD, name: str) -> bool:
    rows = plpy.execute(session.plan(plpy, GD, "DELETE FROM tensile.models WHERE name = $1 RETURNING id", ["text"]), [name])
    if not rows:
        raise ModelNotFound(f'model "{name}" does not exist (or is owned by another role)')
    return True


def _sql_row(row: dict) -> dict:
    """Rename ``*_nbytes`` keys to the SQL surface's ``*_bytes``; ``peak_nbytes`` of a job is
    ``peak_device_bytes``."""
    return {("peak_device_bytes" if k == "peak_nbytes" and "job_id" in row else k.replace("_nbytes", "_bytes")): v
            for k, v in row.items()}


def _timestamp(seconds):
    return None if seconds is None else datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat()


def _ask(plpy, GD, request: str) -> dict | None:
    """The coordinator's answer, or None if none is running (a status query never starts one)."""
    try:
        client, _ = session.connect(plpy, GD, start=False)
    except CoordinatorUnavailable:
        return None
    with client:
        return client.request({"type": request})[0]


@_sql_errors
def jobs(plpy, GD) -> list[dict]:
    reply = _ask(plpy, GD, "jobs")
    rows = reply["jobs"] if reply else []
    for r in rows:
        r["created_at"], r["started_at"] = _timestamp(r["created_at"]), _timestamp(r["started_at"])
    return [_sql_row(r) for r in rows]


@_sql_errors
def memory(plpy, GD) -> list[dict]:
    reply = _ask(plpy, GD, "memory")
    if reply is None:
        return []
    reply["per_job"] = json.dumps({job_id: _sql_row(c) for job_id, c in reply["per_job"].items()})
    reply["started_at"] = _timestamp(reply["started_at"])
    return [_sql_row(reply)]


@_sql_errors
def start_coordinator(plpy, GD) -> int:
    client, _ = session.connect(plpy, GD, start=True)
    with client:
        return client.request({"type": "ping"})[0]["pid"]


@_sql_errors
def stop_coordinator(plpy, GD) -> bool:
    return _ask(plpy, GD, "shutdown") is not None
