"""Per-backend plumbing: settings, the coordinator connection, waiting for its reply, and
prepared plans.

Settings, read from the configuration files only (``postgresql.conf`` and the files it
includes; PostgreSQL 15's ``ALTER SYSTEM`` refuses parameters that no loaded module defines)
through ``tensile._server_setting``: they pick the program the server spawns as its OS user and
the budget every job shares, so no session may change them with ``SET``, ``ALTER ROLE`` /
``ALTER DATABASE ... SET`` or connection options.

- ``tensile.device``: ``cpu`` (default) or ``cuda``.
- ``tensile.devices``: several devices of one kind for one coordinator, comma-separated
  (``cpu:0, cpu:1``; :func:`tensile_db.settings.parse_devices`), each with its own budget, arena,
  memory manager, executor and plans; training jobs and search trials are placed among them
  (Note [Placement] in :mod:`tensile_db.coordinator.placement`). Empty (default): the one
  ``tensile.device``.
- ``tensile.device_budget``: each device's arena, with units as ``pg_size_bytes`` reads them
  (default ``1GB``): one size for every device, or one per device of ``tensile.devices``,
  comma-separated.
- ``tensile.host_budget``: host memory for the copies of swapped-out tensors, and for cached
  copies of served models' layers, with units as ``pg_size_bytes`` reads them (default ``1GB``);
  beyond it swapped-out tensors go to spill files (the disk tier).
- ``tensile.spill_dir``: an absolute directory for the spill files, which the server's OS user can
  write (default: ``tensile_coordinator/spill`` in the data directory). Files of a job are removed
  when it ends, and those of a coordinator that died when the next one starts.
- ``tensile.max_active_jobs``: jobs trained at once per device; more wait queued (default 8).
- ``tensile.max_pressure``: beyond its budget, a device admits a queued job only while the
  unscheduled peaks of its running jobs and that one stay within this many times the budget, and
  when the device's jobs are predicted to end sooner, summed, so than with it waiting (default 2;
  ``none``: every job admitted at once; Note [Admission by memory pressure] in
  :mod:`tensile_db.coordinator.executor`).
- ``tensile.policy``: the scheduler policy, one of :data:`tensile_db.settings.POLICIES`
  (default ``tensile``).
- ``tensile.pool``: ``planned`` (default: recurring allocations at lifetime-planned offsets once
  a period has been recorded) or ``general`` (the best-fit pool only), one of
  :data:`tensile_db.settings.POOLS`.
- ``tensile.max_layers`` / ``tensile.max_parameters`` / ``tensile.max_job_bytes``: the largest
  model trained or served (default 1000 layers, 100,000,000 parameters) and the most device
  and host bytes one training job may need (its unscheduled peak; default 4GB); larger ones are
  refused at once (see :class:`tensile_db.runtime.model.Limits`).
- ``tensile.python``: interpreter for the coordinator (default: the virtual environment that holds
  this package, else ``python3`` on the postmaster's PATH).
- ``tensile.python_path``: extra ``site`` directories for PL/Python (read by ``tensile._bootstrap``).

All but the last two take effect when the coordinator starts; ``tensile.stop_coordinator()`` lets the
next call start one with new values.

Two settings are the session's own, read with ``current_setting`` (so ``postgresql.conf``, ``ALTER
ROLE / DATABASE ... SET`` or a session's ``SET`` all reach them): they only shape how this
session's calls use the shared device and how long they wait.

- ``tensile.prefetch_window``: how many layers ``tensile.predict_batch`` keeps loaded on the
  device ahead of the layer it computes, an integer >= 1 or ``all`` (default 2); the call's
  ``window`` option overrides it.
- ``tensile.coordinator_timeout``: seconds to wait for the coordinator to accept a connection or
  answer a request (default 30); a training or a prediction, once accepted, waits as long as it runs.

Waiting: every exchange with the coordinator — connecting, sending the rows, each reply — runs in
:func:`exchange`: the socket I/O on a helper thread while this thread waits in ``WAIT_SLICE_S``
slices, calling into SPI between them so that ``pg_cancel_backend``, ``statement_timeout`` and
``pg_terminate_backend`` reach the backend within a slice, and failing at the deadline with the
coordinator's process state. On any error the connection is shut down, which the coordinator
takes as a cancel: it stops the job or call and frees its device memory.

Every statement here is immune to the caller's ``search_path``: functions, operators and types
are schema-qualified (``pg_catalog.``, ``tensile.``); only the user's ``source`` is resolved with
the caller's path.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

from .. import settings as server_settings
from ..coordinator import address
from ..coordinator import client as coordinator_client
from ..errors import ConnectionClosed, CoordinatorUnavailable, InvalidArgument
from ..runtime.model import Limits

#: The tensile.* settings of the configuration files, by name, with their defaults.
SERVER_SETTINGS = {"device": server_settings.DEFAULT_DEVICE, "devices": "",
                   "max_pressure": str(server_settings.DEFAULT_MAX_PRESSURE),
                   "device_budget": str(server_settings.DEFAULT_BUDGET_NBYTES),
                   "host_budget": str(server_settings.DEFAULT_HOST_BUDGET_NBYTES), "spill_dir": "",
                   "max_active_jobs": str(server_settings.DEFAULT_MAX_ACTIVE_JOBS),
                   "policy": server_settings.DEFAULT_POLICY, "pool": server_settings.DEFAULT_POOL,
                   "max_layers": str(Limits.max_layers),
                   "max_parameters": str(Limits.max_parameters), "max_job_bytes": str(Limits.max_job_nbytes),
                   "python": ""}
_SETTINGS_SQL = ("SELECT current_user AS role, pg_catalog.pg_backend_pid() AS pid, "
                 + ", ".join(f"tensile._server_setting('tensile.{k}') AS {k}" for k in SERVER_SETTINGS))

#: How long one wait for the coordinator lasts before the backend checks for a cancel, seconds.
WAIT_SLICE_S = 0.1
#: tensile.prefetch_window when it is not set: layers loaded ahead of the one computing.
DEFAULT_PREFETCH_WINDOW = 2
#: tensile.coordinator_timeout when it is not set, seconds.
DEFAULT_COORDINATOR_TIMEOUT_S = 30.0


def plan(plpy, GD, sql: str, types: list[str] | None = None):
    """A prepared plan, cached for the session in GD."""
    key = ("tensile_plan", sql)
    if key not in GD:
        GD[key] = plpy.prepare(sql, types or [])
    return GD[key]


def settings(plpy, GD) -> dict:
    """The role, the backend's pid and the tensile.* server settings (defaults filled in)."""
    row = plpy.execute(plan(plpy, GD, _SETTINGS_SQL))[0]
    return dict(row, **{k: row[k] or default for k, default in SERVER_SETTINGS.items()})


def _positive_int(s: dict, key: str) -> int:
    text = s[key].strip()
    if not re.fullmatch(r"[0-9]{1,18}", text) or int(text) < 1:
        raise InvalidArgument(f"tensile.{key} is {s[key]!r}; it must be a positive integer: set it in the "
                              "server's configuration files and reload them (SELECT pg_reload_conf())")
    return int(text)


def size_bytes(plpy, GD, s: dict, key: str) -> int:
    """The setting ``tensile.<key>`` of ``s`` in bytes, with units as ``pg_size_bytes`` reads them."""
    return _pg_size_bytes(plpy, GD, s[key])


def _pg_size_bytes(plpy, GD, text: str) -> int:
    """``text`` in bytes, with units as ``pg_size_bytes`` reads them."""
    return int(plpy.execute(plan(plpy, GD, "SELECT pg_catalog.pg_size_bytes($1) AS b", ["pg_catalog.text"]),
                            [text])[0]["b"])


def limits(plpy, GD, s: dict) -> Limits:
    """The largest model the settings ``s`` allow. Raises InvalidArgument for a malformed value."""
    return Limits(_positive_int(s, "max_layers"), _positive_int(s, "max_parameters"),
                  size_bytes(plpy, GD, s, "max_job_bytes"))


def socket_dir() -> str:
    # A backend's working directory is the cluster's data directory.
    return address.socket_dir_for(os.getcwd())


def _default_python() -> str:
    package = Path(__file__).resolve().parent.parent
    for parent in package.parents:
        if (parent / "pyvenv.cfg").exists():
            return str(parent / "bin" / "python")
    return shutil.which("python3") or "python3"


def _start_spec(plpy, GD, s: dict) -> coordinator_client.StartSpec:
    """How to start a coordinator with the settings ``s``. Raises InvalidArgument for a value
    not allowed."""
    for key, allowed in (("policy", server_settings.POLICIES), ("pool", server_settings.POOLS),
                         ("device", server_settings.DEVICES)):
        if s[key] not in allowed:
            raise InvalidArgument(f"tensile.{key} is {s[key]!r}; it must be one of {', '.join(allowed)}: set it in "
                                  "the server's configuration files and reload them (SELECT pg_reload_conf())")
    if size_bytes(plpy, GD, s, "host_budget") < 0:
        raise InvalidArgument(f"tensile.host_budget is {s['host_budget']!r}; it must not be negative: set it in the "
                              "server's configuration files and reload them (SELECT pg_reload_conf())")
    devices = tuple(server_settings.parse_devices(s["devices"]))
    budgets = tuple(_pg_size_bytes(plpy, GD, b) for b in s["device_budget"].split(","))
    if len(budgets) not in (1, len(devices) or 1):
        raise InvalidArgument(f"tensile.device_budget is {s['device_budget']!r}: {len(budgets)} budgets for "
                              f"{len(devices) or 1} devices; give one for every device or one per device of "
                              "tensile.devices, and reload the configuration (SELECT pg_reload_conf())")
    return coordinator_client.StartSpec(
        python=s["python"] or _default_python(), device=s["device"], devices=devices,
        max_pressure=server_settings.parse_max_pressure(s["max_pressure"]),
        budget_nbytes=budgets[0] if len(budgets) == 1 else budgets,
        host_budget_nbytes=size_bytes(plpy, GD, s, "host_budget"), spill_dir=_spill_dir(s),
        max_active_jobs=_positive_int(s, "max_active_jobs"), policy=s["policy"], pool=s["pool"],
        postmaster_pid_file=os.path.join(os.getcwd(), "postmaster.pid"),
        python_path=str(Path(__file__).resolve().parent.parent.parent), limits=limits(plpy, GD, s))


def _spill_dir(s: dict) -> str | None:
    """``tensile.spill_dir`` of the settings ``s``, or None when it is not set. Raises
    InvalidArgument for a relative path."""
    text = s["spill_dir"].strip()
    if text and not os.path.isabs(text):
        raise InvalidArgument(f"tensile.spill_dir is {s['spill_dir']!r}; it must be an absolute directory the server's "
                              "OS user can write: set it in the server's configuration files and reload them "
                              "(SELECT pg_reload_conf())")
    return text or None


def connect(plpy, GD, start: bool = True, s: dict | None = None):
    """``(client, settings)``: a client connected to this cluster's coordinator, started on
    demand if ``start`` with the settings ``s`` (read when None). Waits in slices (see
    :func:`pause`) up to ``tensile.coordinator_timeout``.

    Raises InvalidArgument, when ``start``, for a tensile.* setting not allowed, and
    CoordinatorUnavailable when no coordinator answers in time.
    """
    s = s or settings(plpy, GD)
    spec = _start_spec(plpy, GD, s) if start else None
    client = coordinator_client.connect(socket_dir(), spec, timeout_s=coordinator_timeout(plpy, GD),
                                        pause=lambda seconds: pause(plpy, GD, seconds))
    return client, s


def pause(plpy, GD, seconds: float) -> None:
    """Sleep ``seconds``, then call into SPI so that PostgreSQL can deliver a cancel,
    ``statement_timeout`` or termination (raised here as a Python exception)."""
    time.sleep(seconds)
    plpy.execute(plan(plpy, GD, "SELECT 1"))


def session_setting(plpy, GD, name: str) -> str | None:
    """A setting of this session (``SET``, ``ALTER ROLE / DATABASE ... SET`` or the configuration
    files reach it), or None when it was never set."""
    return plpy.execute(plan(plpy, GD, "SELECT pg_catalog.current_setting($1, true) AS v", ["pg_catalog.text"]),
                        [name])[0]["v"]


def coordinator_timeout(plpy, GD) -> float:
    """The session's ``tensile.coordinator_timeout``, seconds (default
    ``DEFAULT_COORDINATOR_TIMEOUT_S``). Raises InvalidArgument naming a value that is not a
    positive number."""
    value = session_setting(plpy, GD, "tensile.coordinator_timeout")
    text = (value or "").strip()
    if not text:
        return DEFAULT_COORDINATOR_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e9:
        raise InvalidArgument(f"tensile.coordinator_timeout is {value!r}; it must be a positive number of seconds "
                              "(SET tensile.coordinator_timeout = 30)")
    return seconds


def _thread(target) -> threading.Thread:
    """A started daemon thread that PostgreSQL's signals never interrupt: it inherits a mask
    blocking every signal, so cancels and timeouts reach the backend's own thread."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        thread = threading.Thread(target=target, name="tensile-io", daemon=True)
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return thread


#: When this backend last let PostgreSQL deliver a cancel (time.monotonic()).
_checked = {"at": 0.0}


def _check_interrupts(plpy, check) -> None:
    """Call into SPI (``check``: a prepared ``SELECT 1``), which lets PostgreSQL deliver a cancel or
    a ``statement_timeout`` as an exception."""
    plpy.execute(check)
    _checked["at"] = time.monotonic()


def exchange(plpy, GD, client, io, doing: str, timeout_s: float | None):
    """Run ``io()`` — a send and/or receive on ``client`` — on a helper thread and return what
    it returns, waiting in ``WAIT_SLICE_S`` slices with a call into SPI between them, and with one
    more before it returns where none came in the last slice: a search's progress messages,
    arriving faster than a slice, once kept every wait shorter than one, and a cancel unseen for
    20 s.

    ``timeout_s`` None waits as long as the coordinator works (a training); else raises
    CoordinatorUnavailable after that many seconds, naming ``doing`` and the coordinator's
    process state. A closed connection raises ConnectionClosed, a CoordinatorUnavailable; errors
    the coordinator sent are raised as they are. On any exception (a cancel included) the
    connection is shut down first, so the helper thread ends and the coordinator cancels the work.
    """
    done = threading.Event()
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = io()
        except BaseException as exc:        # handed to the waiting thread
            outcome["error"] = exc
        finally:
            done.set()

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    check = plan(plpy, GD, "SELECT 1")
    thread = _thread(run)
    try:
        while not done.wait(WAIT_SLICE_S):
            _check_interrupts(plpy, check)
            if deadline is not None and time.monotonic() > deadline:
                raise CoordinatorUnavailable(
                    f"the coordinator ({client.state()}) did not answer within {timeout_s:g} s during {doing}; "
                    f"see {socket_dir()}/{address.LOG_NAME}, or stop it (SELECT tensile.stop_coordinator()) "
                    "and call again (tensile.coordinator_timeout sets the wait)")
        if time.monotonic() - _checked["at"] > WAIT_SLICE_S:    # exchanges that end at once, one after another
            _check_interrupts(plpy, check)
        error = outcome.get("error")
        if isinstance(error, (EOFError, OSError)):
            raise ConnectionClosed(
                f"the coordinator closed the connection during {doing} ({error!r}); see "
                f"{socket_dir()}/{address.LOG_NAME}, then call again") from None
        if error is not None:
            raise error
        return outcome["value"]
    except BaseException:
        client.abort()
        thread.join(1.0)
        if thread.is_alive():       # still inside a system call on the socket: its fd must stay its own
            client.leave_open()
        raise


def request(plpy, GD, client, header: dict, arrays: dict | None = None, doing: str = "a request",
            timeout_s: float | None = None):
    """Send one request and return the reply ``(header, arrays)``, within ``timeout_s`` seconds
    (default: ``tensile.coordinator_timeout``; see :func:`exchange`)."""
    timeout_s = coordinator_timeout(plpy, GD) if timeout_s is None else timeout_s
    return exchange(plpy, GD, client, lambda: client.request(header, arrays), doing, timeout_s)


def takes_rows(plpy, GD, client) -> bool:
    """Whether the coordinator takes a training request's rows by index
    (:meth:`~tensile_db.coordinator.client.CoordinatorClient.takes_rows`), asked as a request is
    (:func:`exchange`, within ``tensile.coordinator_timeout``)."""
    return exchange(plpy, GD, client, client.takes_rows, "the question of what it takes",
                    coordinator_timeout(plpy, GD))


def prefetch_window(plpy, GD) -> int | str:
    """The session's ``tensile.prefetch_window``: an integer >= 1 or ``"all"`` (default
    ``DEFAULT_PREFETCH_WINDOW`` when unset or empty). Raises InvalidArgument naming any other value."""
    value = session_setting(plpy, GD, "tensile.prefetch_window")
    text = (value or "").strip().lower()
    if not text:
        return DEFAULT_PREFETCH_WINDOW
    if text == "all":
        return "all"
    if re.fullmatch(r"[0-9]+", text) and int(text) >= 1:
        return int(text)
    raise InvalidArgument(f"tensile.prefetch_window is {value!r}; it must be an integer >= 1 or 'all' "
                          "(SET tensile.prefetch_window = 2, or fix it where it is configured)")


def await_result(plpy, GD, client, doing: str, on_message) -> tuple[dict, dict]:
    """Wait for the coordinator's ``result`` message and return it as ``(header, arrays)``;
    hands every other message to ``on_message(header, arrays)``. Each wait is an
    :func:`exchange` without a deadline, so cancel and ``statement_timeout`` reach the backend;
    on any error (a cancel, an error the coordinator sent, one raised by ``on_message``) the
    connection is shut down, which cancels the work, and the error re-raised."""
    try:
        while True:
            header, arrays = exchange(plpy, GD, client, client.receive, doing, None)
            if header["type"] == "result":
                return header, arrays
            on_message(header, arrays)
    except BaseException:
        client.abort()
        raise
