"""The coordinator's served versions of a model, told when the registry changes which one is
deployed: after ``tensile.drop_model``, ``tensile.deploy`` and a training that deploys a new
version, the others leave the coordinator's device weight cache at once instead of holding
budget every job shares until room is needed."""

from __future__ import annotations

from ..errors import CoordinatorNotRunning, CoordinatorUnavailable
from . import session


def retire_served(plpy, GD, name: str) -> None:
    """Tell a running coordinator that only the deployed version of model ``name`` (none after a
    drop) is served from now on (:meth:`~tensile_db.inference.store.ModelStore.retire`): the other
    versions' layers leave its device weight cache at once. Nothing when no coordinator runs. A
    coordinator that does not answer gets a WARNING, not an error: the drop or deployment stands,
    and the cache gives those layers up first when it needs room. Sent before the transaction
    commits: after a rollback the next call reads the version's weights again."""
    row = plpy.execute(session.plan(plpy, GD, """
        SELECT d.oid AS database,
               (SELECT id FROM tensile.models WHERE name OPERATOR(pg_catalog.=) $1 AND deployed) AS keep
        FROM pg_catalog.pg_database d WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()""",
        ["pg_catalog.text"]), [name])[0]
    try:
        client, _ = session.connect(plpy, GD, start=False)
    except CoordinatorNotRunning:
        return
    except CoordinatorUnavailable as exc:
        plpy.warning(f"tensile: the coordinator's cache may keep the layers of model {name!r} for now: {exc}")
        return
    with client:
        try:
            session.request(plpy, GD, client, {"type": "retire", "database": row["database"], "name": name,
                                               "keep": row["keep"]}, doing="retiring a model's served versions")
        except CoordinatorUnavailable as exc:
            plpy.warning(f"tensile: the coordinator's cache may keep the layers of model {name!r} for now: {exc}")
