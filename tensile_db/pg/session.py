"""Per-backend plumbing: settings, the coordinator connection, waiting for its reply, and
prepared plans.

Settings, read from the configuration files only (``postgresql.conf`` and the files it
includes; PostgreSQL 15's ``ALTER SYSTEM`` refuses parameters that no loaded module defines)
through ``tensile._server_setting``: they pick the program the server spawns as its OS user and
the budget every job shares, so no session may change them with ``SET``, ``ALTER ROLE`` /
``ALTER DATABASE ... SET`` or connection options.

- ``tensile.device``: ``cpu`` (default) or ``cuda``.
- ``tensile.device_budget``: the device arena, with units as ``pg_size_bytes`` reads them
  (default ``1GB``).
- ``tensile.max_active_jobs``: jobs trained at once; more wait queued (default 8).
- ``tensile.policy``: the scheduler policy, one of :data:`tensile_db.scheduler.POLICIES`
  (default ``tensile``).
- ``tensile.pool``: ``planned`` (default: recurring allocations at lifetime-planned offsets once
  a period has been recorded) or ``general`` (the best-fit pool only), one of
  :data:`tensile_db.memory.manager.POOLS`.
- ``tensile.python``: interpreter for the coordinator (default: the virtual environment that holds
  this package, else ``python3`` on the postmaster's PATH).
- ``tensile.python_path``: extra ``site`` directories for PL/Python (read by ``tensile._bootstrap``).

The first five take effect when the coordinator starts; ``tensile.stop_coordinator()`` lets the
next call start one with new values.

One setting is the session's own, read with ``current_setting`` (so ``postgresql.conf``, ``ALTER
ROLE / DATABASE ... SET`` or a session's ``SET`` all reach it): it only shapes how this session's
calls use the shared device, which stays within the budget whatever it says.

- ``tensile.prefetch_window``: how many layers ``tensile.predict_batch`` keeps loaded on the
  device ahead of the layer it computes, an integer >= 1 or ``all`` (default 2); the call's
  ``window`` option overrides it.

Waiting: :func:`await_result` waits for the coordinator's final reply in ``WAIT_SLICE_S`` slices,
calling into SPI between slices so that ``pg_cancel_backend`` and ``statement_timeout`` reach the
backend, which then sends ``{"type": "cancel"}`` before re-raising.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..coordinator import client as coordinator_client
from ..errors import CoordinatorUnavailable, InvalidArgument
from ..memory.manager import POOLS
from ..scheduler import POLICIES

_SETTINGS_SQL = """
SELECT current_user::text AS role, pg_backend_pid() AS pid,
       coalesce(nullif(tensile._server_setting('tensile.device'), ''), 'cpu') AS device,
       pg_size_bytes(coalesce(nullif(tensile._server_setting('tensile.device_budget'), ''), '1GB')) AS budget,
       coalesce(nullif(tensile._server_setting('tensile.max_active_jobs'), ''), '8')::int AS max_active_jobs,
       coalesce(nullif(tensile._server_setting('tensile.policy'), ''), 'tensile') AS policy,
       coalesce(nullif(tensile._server_setting('tensile.pool'), ''), 'planned') AS pool,
       nullif(tensile._server_setting('tensile.python'), '') AS python
"""

#: How long one wait for the coordinator lasts before the backend checks for a cancel, seconds.
WAIT_SLICE_S = 0.1
#: tensile.prefetch_window when it is not set: layers loaded ahead of the one computing.
DEFAULT_PREFETCH_WINDOW = 2


def plan(plpy, GD, sql: str, types: list[str] | None = None):
    """A prepared plan, cached for the session in GD."""
    key = ("tensile_plan", sql)
    if key not in GD:
        GD[key] = plpy.prepare(sql, types or [])
    return GD[key]


def settings(plpy, GD) -> dict:
    return plpy.execute(plan(plpy, GD, _SETTINGS_SQL))[0]


def socket_dir() -> str:
    # A backend's working directory is the cluster's data directory.
    return coordinator_client.socket_dir_for(os.getcwd())


def _default_python() -> str:
    package = Path(__file__).resolve().parent.parent
    for parent in package.parents:
        if (parent / "pyvenv.cfg").exists():
            return str(parent / "bin" / "python")
    return shutil.which("python3") or "python3"


def connect(plpy, GD, start: bool = True):
    """A client connected to this cluster's coordinator, started on demand if ``start``.

    Raises InvalidArgument, when ``start``, for a ``tensile.policy`` not in POLICIES or a
    ``tensile.pool`` not in POOLS, and CoordinatorUnavailable when no coordinator answers.
    """
    s = settings(plpy, GD)
    if start and s["policy"] not in POLICIES:
        raise InvalidArgument(f"tensile.policy is {s['policy']!r}; it must be one of {', '.join(POLICIES)}: "
                              "set it in the server's configuration files and reload them (SELECT pg_reload_conf())")
    if start and s["pool"] not in POOLS:
        raise InvalidArgument(f"tensile.pool is {s['pool']!r}; it must be one of {', '.join(POOLS)}: "
                              "set it in the server's configuration files and reload them (SELECT pg_reload_conf())")
    spec = coordinator_client.StartSpec(
        python=s["python"] or _default_python(), device=s["device"], budget_nbytes=int(s["budget"]),
        max_active_jobs=int(s["max_active_jobs"]), policy=s["policy"], pool=s["pool"],
        postmaster_pid_file=os.path.join(os.getcwd(), "postmaster.pid"),
        python_path=str(Path(__file__).resolve().parent.parent.parent))
    return coordinator_client.connect(socket_dir(), spec if start else None), s


def prefetch_window(plpy, GD) -> int | str:
    """The session's ``tensile.prefetch_window``: an integer >= 1 or ``"all"`` (default
    ``DEFAULT_PREFETCH_WINDOW`` when unset or empty). Raises InvalidArgument naming any other value."""
    value = plpy.execute(plan(plpy, GD, "SELECT current_setting('tensile.prefetch_window', true) AS w"))[0]["w"]
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
    """Wait for the coordinator's ``result`` message and return it as ``(header, arrays)``.

    Waits in ``WAIT_SLICE_S`` slices, calling into SPI between them so that PostgreSQL can
    deliver a cancel or ``statement_timeout``; hands every other message to
    ``on_message(header, arrays)``. On any error (a cancel, an error the coordinator sent, one
    raised by ``on_message``) sends ``{"type": "cancel"}`` and re-raises. Raises
    CoordinatorUnavailable, naming ``doing`` ("training"), when the coordinator closes the
    connection.
    """
    check = plan(plpy, GD, "SELECT 1")
    try:
        while True:
            if not client.poll(WAIT_SLICE_S):
                plpy.execute(check)          # lets PostgreSQL deliver a cancel or statement_timeout
                continue
            try:
                header, arrays = client.receive()
            except (EOFError, OSError) as exc:
                raise CoordinatorUnavailable(
                    f"the coordinator closed the connection during {doing} ({exc!r}); see "
                    f"{socket_dir()}/coordinator.log, then call again") from None
            if header["type"] == "result":
                return header, arrays
            on_message(header, arrays)
    except BaseException:
        try:
            client.send({"type": "cancel"})
        except OSError:
            pass
        raise
