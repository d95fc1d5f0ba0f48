"""What the extension's SQL functions call. Each entry turns tensile_db errors into SQL errors
with a fitting SQLSTATE; PostgreSQL's own errors (unknown table, permission denied, cancel) pass
through unchanged.

The status functions behind ``tensile.jobs`` and ``tensile.memory`` show every job, but a role
sees the model name, loss and role of a job only when it is a member of the job's role;
superusers and members of ``pg_monitor`` see everything. The filter is applied here, so calling
the functions directly shows no more than the views."""

from __future__ import annotations

import datetime
import functools
import json
import time

from ..coordinator import address, reports
from ..errors import (
    ConnectionClosed,
    CoordinatorNotRunning,
    CoordinatorUnavailable,
    CorruptModel,
    DeviceOutOfMemory,
    DiskError,
    DiskFull,
    InvalidArgument,
    JobCancelled,
    ModelNotFound,
    ProtocolError,
    TensileError,
)
from . import batch as _batch
from . import predict as _predict
from . import registry, served, session
from . import train as _train

#: Job fields only members of the job's role (and superusers, pg_monitor) see.
PRIVATE_JOB_FIELDS = ("role", "model_name", "loss")

SQLSTATE = {
    InvalidArgument: "22023",          # invalid_parameter_value
    ModelNotFound: "42704",            # undefined_object
    CorruptModel: "XX001",             # data_corrupted
    DeviceOutOfMemory: "53200",        # out_of_memory
    JobCancelled: "57014",             # query_canceled
    CoordinatorUnavailable: "08006",   # connection_failure
    ProtocolError: "08P01",            # protocol_violation
    DiskFull: "53100",                 # disk_full
    DiskError: "58030",                # io_error
}


def _sql_errors(fn):
    """``fn`` with its errors as SQL errors: a TensileError with its class's SQLSTATE (XX000 for
    the root), PostgreSQL's own errors (``plpy.SPIError``: cancel, permission denied) as they are,
    and any other exception — a defect — as an internal error that names it and asks for a report
    rather than a raw Python traceback."""
    @functools.wraps(fn)
    def wrapper(plpy, *args):
        try:
            return fn(plpy, *args)
        except TensileError as exc:
            sqlstate = next((SQLSTATE[c] for c in type(exc).__mro__ if c in SQLSTATE), "XX000")
            detail = getattr(exc, "detail", None)
            plpy.error(str(exc), sqlstate=sqlstate, **({"detail": detail} if detail else {}))
        except (plpy.SPIError, plpy.Error):
            raise
        except Exception as exc:
            plpy.error(f"internal error in tensile_db: {type(exc).__name__}: {exc}; please report it with the call "
                       "that caused it", sqlstate="XX000")
    return wrapper


train_model = _sql_errors(_train.train_model)
predict = _sql_errors(_predict.predict)
predict_proba = _sql_errors(_predict.predict_proba)
predict_label = _sql_errors(_predict.predict_label)
predict_batch = _sql_errors(_batch.predict_batch)
predict_into = _sql_errors(_batch.predict_into)


write_model = _sql_errors(registry.write_model)
def _deploy(plpy, GD, name: str, version_or_strategy) -> int:
    version = registry.deploy(plpy, GD, name, version_or_strategy)
    served.retire_served(plpy, GD, name)
    return version


def _drop_model(plpy, GD, name: str) -> bool:
    registry.drop(plpy, GD, name)
    served.retire_served(plpy, GD, name)
    return True


deploy = _sql_errors(_deploy)
drop_model = _sql_errors(_drop_model)


def _timestamp(seconds):
    return None if seconds is None else datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat()


def _ask(plpy, GD, request: str) -> dict | None:
    """The coordinator's answer, or None if none is running (a status query never starts one)."""
    try:
        client, _ = session.connect(plpy, GD, start=False)
    except CoordinatorNotRunning:
        return None
    with client:
        return session.request(plpy, GD, client, {"type": request}, doing=f"a {request} request")[0]


def _hide_others(plpy, GD, rows: list[dict]) -> None:
    """Blank PRIVATE_JOB_FIELDS of every row whose ``role`` the calling role is not a member of,
    unless it is a superuser or a member of pg_monitor."""
    roles = sorted({r["role"] for r in rows})
    if not roles:
        return
    mine = plpy.execute(session.plan(plpy, GD, """
        SELECT pg_catalog.pg_has_role('pg_monitor', 'MEMBER') AS monitor,
               (SELECT pg_catalog.array_agg(rolname::pg_catalog.text) FROM pg_catalog.pg_roles
                WHERE rolname OPERATOR(pg_catalog.=) ANY ($1) AND pg_catalog.pg_has_role(oid, 'MEMBER')) AS roles""",
        ["pg_catalog.name[]"]), [roles])[0]
    if mine["monitor"]:
        return
    visible = set(mine["roles"] or ())
    for r in rows:
        if r["role"] not in visible:
            r.update(dict.fromkeys(PRIVATE_JOB_FIELDS))


@_sql_errors
def jobs(plpy, GD) -> list[dict]:
    reply = _ask(plpy, GD, "jobs")
    rows = reply["jobs"] if reply else []
    _hide_others(plpy, GD, rows)
    for r in rows:
        r["created_at"], r["started_at"] = _timestamp(r["created_at"]), _timestamp(r["started_at"])
    return [reports.sql_row(reports.JobRow, r) for r in rows]


@_sql_errors
def memory(plpy, GD) -> list[dict]:
    reply = _ask(plpy, GD, "memory")
    rows = reply["devices"] if reply else []
    for row in rows:
        _hide_others(plpy, GD, list(row["per_job"].values()))
        row["per_job"] = json.dumps({job_id: reports.sql_row(reports.MemoryRow, c)
                                     for job_id, c in row["per_job"].items()})
        row["started_at"] = _timestamp(row["started_at"])
    return [reports.sql_row(reports.MemoryRow, row) for row in rows]


@_sql_errors
def start_coordinator(plpy, GD) -> int:
    """The pid of the coordinator, started if none answers. A connection closed before the ping's
    answer (made to a coordinator that was exiting) is tried once more, starting a new one."""
    for attempt in range(2):
        client, _ = session.connect(plpy, GD, start=True)
        with client:
            try:
                return session.request(plpy, GD, client, {"type": "ping"}, doing="a ping")[0]["pid"]
            except ConnectionClosed:
                if attempt:
                    raise


@_sql_errors
def stop_coordinator(plpy, GD) -> bool:
    """Stop the coordinator and wait (in slices, up to tensile.coordinator_timeout) until its
    process has exited, so that a call right after starts a new one instead of reaching the old
    one's closing socket. False when none was running."""
    reply = _ask(plpy, GD, "shutdown")
    if reply is None:
        return False
    deadline = time.monotonic() + session.coordinator_timeout(plpy, GD)
    while reply.get("pid") and address.process_running(reply["pid"]) and time.monotonic() < deadline:
        session.pause(plpy, GD, 0.02)
    return True
