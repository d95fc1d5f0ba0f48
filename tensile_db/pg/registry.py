"""Writes to the model registry, ``tensile.models``.

Ordinary roles may only read the table (and row-level security shows them their own models and
their roles' models); they have no INSERT, UPDATE or DELETE, so no row is ever written that the
extension did not check. The extension's functions run as the calling role, so they write
through one SECURITY DEFINER function, ``tensile._write_model()``, with its ``search_path``
pinned. That function takes no arguments a caller could forge: the invoking code stages the
write (a :class:`Write`, built from values it validated, with ``owner`` the calling role) in the
session's PL/Python dictionary ``GD``, which only PL/Python code of this session can reach, and
the definer applies exactly that write and removes it. A role that calls ``tensile._write_model()``
itself finds nothing staged and gets an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InvalidArgument, ModelNotFound
from . import session

_STAGED = "tensile_staged_write"

_DELETE = """
    DELETE FROM tensile.models
    WHERE name OPERATOR(pg_catalog.=) $1 AND (owner OPERATOR(pg_catalog.=) $2 OR $3) RETURNING id"""
_INSERT = """
    INSERT INTO tensile.models (name, owner, task, architecture, options, feature_names, label_name, label_classes,
                                metrics, weights)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) RETURNING id"""
_INSERT_TYPES = ["pg_catalog.text", "pg_catalog.name", "pg_catalog.text", "pg_catalog.jsonb", "pg_catalog.jsonb",
                 "pg_catalog.text[]", "pg_catalog.text", "pg_catalog.float8[]", "pg_catalog.jsonb", "pg_catalog.bytea"]


@dataclass(frozen=True)
class Write:
    """One change of the registry: delete the model ``name`` (a drop, or the old version of a
    replaced model) when ``delete``, then insert ``row`` (the columns after ``name`` and
    ``owner``, in ``_INSERT``'s order) when given. ``owner`` is the calling role; ``any_owner``
    lets a superuser (or a role that bypasses row-level security) delete another role's model."""

    name: str
    owner: str
    any_owner: bool = False
    delete: bool = False
    row: tuple | None = None


def apply(plpy, GD, write: Write) -> int | None:
    """Stage ``write`` and apply it through ``tensile._write_model()``; returns the inserted
    row's id, or for a drop the deleted row's id, or None when nothing matched."""
    GD[_STAGED] = write
    try:
        return plpy.execute(session.plan(plpy, GD, "SELECT tensile._write_model() AS id"))[0]["id"]
    finally:
        GD.pop(_STAGED, None)


def write_model(plpy, GD) -> int | None:
    """The body of ``tensile._write_model()`` (SECURITY DEFINER): apply the staged write.
    Raises InvalidArgument when nothing is staged."""
    write = GD.pop(_STAGED, None)
    if not isinstance(write, Write):
        raise InvalidArgument("tensile._write_model() applies only what the extension's own functions prepare; "
                              "use tensile.train_model or tensile.drop_model")
    deleted = None
    if write.delete:
        rows = plpy.execute(session.plan(plpy, GD, _DELETE, ["pg_catalog.text", "pg_catalog.name", "pg_catalog.bool"]),
                            [write.name, write.owner, write.any_owner])
        deleted = rows[0]["id"] if rows else None
    if write.row is None:
        return deleted
    return plpy.execute(session.plan(plpy, GD, _INSERT, _INSERT_TYPES), [write.name, write.owner, *write.row])[0]["id"]


def may_replace_any(plpy, GD) -> bool:
    """Whether the calling role may replace or drop other roles' models (superuser or BYPASSRLS)."""
    return plpy.execute(session.plan(plpy, GD, """
        SELECT rolsuper OR rolbypassrls AS any FROM pg_catalog.pg_roles
        WHERE rolname OPERATOR(pg_catalog.=) current_user"""))[0]["any"]


def drop(plpy, GD, name: str) -> bool:
    """Delete the model ``name`` if the calling role owns it (any model for a superuser). Raises
    ModelNotFound otherwise."""
    role = plpy.execute(session.plan(plpy, GD, "SELECT current_user AS r"))[0]["r"]
    if apply(plpy, GD, Write(name, role, may_replace_any(plpy, GD), delete=True)) is None:
        raise ModelNotFound(f'model "{name}" does not exist (or is owned by another role)')
    return True


def jsonb(value) -> str:
    """``value`` as JSON text for a jsonb column; NaN and infinities are not JSON, so they raise."""
    return json.dumps(value, allow_nan=False)
