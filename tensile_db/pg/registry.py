"""Writes to the model registry: ``tensile.models`` (one row per version of a name) and
``tensile.deployments`` (which version of a name was deployed when, and how).

Ordinary roles may only read the tables (and row-level security shows them their own models and
their roles' models); they have no INSERT, UPDATE or DELETE, so no row is ever written that the
extension did not check. The extension's functions run as the calling role, so they write
through one SECURITY DEFINER function, ``tensile._write_model()``, with its ``search_path``
pinned. That function takes no arguments a caller could forge: the invoking code stages the
write (an :class:`_AddVersions`, :class:`_Deploy` or :class:`_Drop`, built from values it
validated, with ``role`` the calling role) in the session's PL/Python dictionary ``GD``, which
only PL/Python code of this session can reach, and the definer applies exactly that write,
removes it and leaves its outcome in ``GD`` for the caller. A role that calls
``tensile._write_model()`` itself finds nothing staged and gets an error.

Versions and deployment. Every version of a name has one owner; only the owner (or a superuser,
or a role that bypasses row-level security) adds, deploys or drops versions. A name has at most
one deployed version, the one predictions use. Versions are ranked by ``metrics->'score'``
(higher is better; a version without a score ranks below any with one; on a tie the higher
version wins). Training deploys by ``options.deploy``: ``always``, ``never``, or ``auto``: when no
version is deployed, or when the new version's score is at least the deployed one's
(:func:`tensile_db.runtime.metrics.better_or_equal`). Each deployment is a row of ``tensile.deployments``; a rollback
deploys the version of the latest deployment whose version is not the deployed one.

Each write holds a transaction-scoped advisory lock on the name (``REGISTRY_LOCK_CLASS``) while it
reads and changes the name's versions, so two deployments of one name cannot interleave.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InvalidArgument, ModelNotFound, TensileError
from ..runtime.metrics import better_or_equal
from ..runtime.model import DEPLOY_MODES
from . import session

_STAGED = "tensile_staged_write"
_OUTCOME = "tensile_write_outcome"
#: First key of the advisory locks that serialize registry writes of one name ("tenr").
REGISTRY_LOCK_CLASS = 0x74656E72
#: What ``tensile.deploy(name, strategy)`` accepts.
STRATEGIES = ("best_score", "most_recent", "rollback")

_LOCK = f"SELECT pg_catalog.pg_advisory_xact_lock({REGISTRY_LOCK_CLASS}, pg_catalog.hashtext($1))"
_VERSIONS = """
    SELECT id, version, owner, deployed, metrics OPERATOR(pg_catalog.->>) 'score' AS score,
           metrics OPERATOR(pg_catalog.->>) 'score_name' AS score_name
    FROM tensile.models WHERE name OPERATOR(pg_catalog.=) $1 ORDER BY version"""
_DELETE = """
    DELETE FROM tensile.models
    WHERE name OPERATOR(pg_catalog.=) $1 AND (owner OPERATOR(pg_catalog.=) $2 OR $3) RETURNING id"""
_INSERT = """
    INSERT INTO tensile.models (name, owner, version, task, architecture, options, feature_names, label_name,
                                label_classes, label_names, metrics, weights, preprocess, search)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) RETURNING id"""
_INSERT_TYPES = ["pg_catalog.text", "pg_catalog.name", "pg_catalog.int4", "pg_catalog.text", "pg_catalog.jsonb",
                 "pg_catalog.jsonb", "pg_catalog.text[]", "pg_catalog.text", "pg_catalog.float8[]", "pg_catalog.text[]",
                 "pg_catalog.jsonb", "pg_catalog.bytea", "pg_catalog.jsonb", "pg_catalog.jsonb"]
_UNDEPLOY = """
    UPDATE tensile.models SET deployed = false
    WHERE name OPERATOR(pg_catalog.=) $1 AND deployed AND id OPERATOR(pg_catalog.<>) $2"""
_DEPLOY = "UPDATE tensile.models SET deployed = true WHERE id OPERATOR(pg_catalog.=) $1 AND NOT deployed"
_RECORD = """
    INSERT INTO tensile.deployments (name, owner, model_id, version, strategy) VALUES ($1, $2, $3, $4, $5)"""
_LAST_OTHER_DEPLOYMENT = """
    SELECT m.version FROM tensile.deployments d JOIN tensile.models m ON m.id OPERATOR(pg_catalog.=) d.model_id
    WHERE d.name OPERATOR(pg_catalog.=) $1 AND NOT m.deployed ORDER BY d.id DESC LIMIT 1"""
_MAY_SEE = """
    SELECT pg_catalog.pg_has_role($1, r.oid, 'MEMBER') AS sees FROM pg_catalog.pg_roles r
    WHERE r.rolname OPERATOR(pg_catalog.=) $2"""


@dataclass(frozen=True)
class NewVersion:
    """The columns of one new version of a model (its name, owner and number come from
    :func:`add_versions`). JSON columns are JSON text; ``metrics`` carries ``score`` (higher is
    better) and ``score_name`` when the training measured one."""

    task: str
    architecture: str                          # jsonb text
    options: str                               # jsonb text
    feature_names: list[str]
    label_name: str
    label_classes: list[float] | None          # classification: the class of each output
    label_names: list[str] | None              # a text or enum label's class names, in label_classes order
    metrics: str                               # jsonb text
    weights: bytes                             # .npz of float32 arrays
    preprocess: str | None = None              # jsonb text; None: every feature numeric
    search: str | None = None                  # jsonb text {"search", "trial", "params"}; None: not a trial

    def row(self) -> list:
        """The values after name, owner and version, in ``_INSERT``'s order."""
        return [self.task, self.architecture, self.options, self.feature_names, self.label_name, self.label_classes,
                self.label_names, self.metrics, self.weights, self.preprocess, self.search]


@dataclass(frozen=True)
class Added:
    """What :func:`add_versions` did: the new version numbers, the best of them by the ranking
    of deployment (:func:`_rank`), the version it deployed (None: it deployed none of them) and
    one sentence that says so, naming the versions and their scores."""

    versions: list[int]
    best: int
    deployed: int | None
    message: str


# --- ranking -----------------------------------------------------------------------------------------


def _rank(score: float | None, version: int) -> tuple:
    """Sort key, best last: a score beats no score, a higher score a lower one, then the higher version."""
    return (score is not None, score if score is not None else 0.0, version)


def _score(text: str | None) -> float | None:
    """``metrics->>'score'`` as a number, or None when there is none."""
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def _with_score(version: int, score: float | None, score_name: str | None = None) -> str:
    """'version 3 (f1_macro 0.91)', 'version 3 (0.91)' without a name, 'version 3' without a score."""
    if score is None:
        return f"version {version}"
    return f"version {version} ({score_name + ' ' if score_name else ''}{score:.4g})"


# --- staging -----------------------------------------------------------------------------------------


def _apply(plpy, GD, write):
    """Stage ``write`` and apply it through ``tensile._write_model()``; returns its outcome, or
    raises the error that refused it."""
    GD[_STAGED] = write
    GD.pop(_OUTCOME, None)
    try:
        plpy.execute(session.plan(plpy, GD, "SELECT tensile._write_model() AS n"))
        outcome = GD.pop(_OUTCOME)
    finally:
        GD.pop(_STAGED, None)
    if isinstance(outcome, TensileError):
        raise outcome
    return outcome


def write_model(plpy, GD) -> int:
    """The body of ``tensile._write_model()`` (SECURITY DEFINER): apply the staged write, leave
    its outcome in GD and return the number of versions it added, deployed or deleted. A write
    refused with a TensileError writes nothing (it runs in a subtransaction) and leaves that error
    as its outcome, for the caller to raise as its own. Raises InvalidArgument when nothing is
    staged."""
    write = GD.pop(_STAGED, None)
    if not isinstance(write, (_AddVersions, _Deploy, _Drop)):
        raise InvalidArgument("tensile._write_model() applies only what the extension's own functions prepare; "
                              "use tensile.train_model, tensile.deploy or tensile.drop_model")
    plpy.execute(session.plan(plpy, GD, _LOCK, ["pg_catalog.text"]), [write.name])
    try:
        with plpy.subtransaction():
            outcome, count = write.run(plpy, GD)
    except TensileError as exc:
        outcome, count = exc, 0
    GD[_OUTCOME] = outcome
    return count


def may_replace_any(plpy, GD) -> bool:
    """Whether the calling role may replace, deploy or drop other roles' models (superuser or BYPASSRLS)."""
    return plpy.execute(session.plan(plpy, GD, """
        SELECT rolsuper OR rolbypassrls AS any FROM pg_catalog.pg_roles
        WHERE rolname OPERATOR(pg_catalog.=) current_user"""))[0]["any"]


def _role(plpy, GD) -> str:
    return plpy.execute(session.plan(plpy, GD, "SELECT current_user AS r"))[0]["r"]


def _versions(plpy, GD, name: str) -> list[dict]:
    """Every version of ``name`` (the definer sees them all), by version, with its score as a number."""
    rows = plpy.execute(session.plan(plpy, GD, _VERSIONS, ["pg_catalog.text"]), [name])
    return [dict(r, score=_score(r["score"])) for r in rows]


def _set_deployed(plpy, GD, name: str, owner: str, row: dict, strategy: str) -> None:
    """Make ``row`` the deployed version of ``name`` and record the deployment."""
    plpy.execute(session.plan(plpy, GD, _UNDEPLOY, ["pg_catalog.text", "pg_catalog.int8"]), [name, row["id"]])
    plpy.execute(session.plan(plpy, GD, _DEPLOY, ["pg_catalog.int8"]), [row["id"]])
    plpy.execute(session.plan(plpy, GD, _RECORD, ["pg_catalog.text", "pg_catalog.name", "pg_catalog.int8",
                                                  "pg_catalog.int4", "pg_catalog.text"]),
                 [name, owner, row["id"], row["version"], strategy])


def check_may_add(name: str, owner: str | None, role: str, any_owner: bool, replace: bool) -> None:
    """Whether ``role`` may store a new version of ``name``, whose versions ``owner`` owns (None:
    none exist): its owner may; another role only replaces every version, and only when
    ``any_owner`` (superuser or BYPASSRLS). Raises InvalidArgument."""
    if owner is None or owner == role:
        return
    if replace and not any_owner:
        raise InvalidArgument(f'model "{name}" is owned by role {owner}; only its owner can replace it — '
                              "choose another model_name")
    if not replace:
        also = ", or replace every version of it with options => '{\"replace\": true}'" if any_owner else ""
        raise InvalidArgument(f'model "{name}" is owned by role {owner}; only its owner can train new versions '
                              f"of it — choose another model_name{also}")


# --- adding versions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _AddVersions:
    name: str
    role: str                                  # the calling role, the new versions' owner
    any_owner: bool                            # superuser or BYPASSRLS: may replace another role's versions
    versions: tuple[NewVersion, ...]
    deploy: str                                # one of DEPLOY_MODES
    replace: bool                              # delete every earlier version first

    def run(self, plpy, GD) -> tuple[Added, int]:
        existing = _versions(plpy, GD, self.name)
        check_may_add(self.name, existing[0]["owner"] if existing else None, self.role, self.any_owner, self.replace)
        if self.replace and existing:
            plpy.execute(session.plan(plpy, GD, _DELETE, ["pg_catalog.text", "pg_catalog.name", "pg_catalog.bool"]),
                         [self.name, self.role, self.any_owner])
            existing = []
        first = max((r["version"] for r in existing), default=0) + 1
        for number, v in enumerate(self.versions, first):
            plpy.execute(session.plan(plpy, GD, _INSERT, _INSERT_TYPES), [self.name, self.role, number, *v.row()])
        new = [r for r in _versions(plpy, GD, self.name) if r["version"] >= first]
        candidate = max(new, key=lambda r: _rank(r["score"], r["version"]))
        current = next((r for r in existing if r["deployed"]), None)
        deploy = self.deploy == "always" or (self.deploy == "auto" and (
            current is None or better_or_equal(candidate["score"], current["score"])))
        if deploy:
            _set_deployed(plpy, GD, self.name, self.role, candidate, "train")
        message = _added_message(self.name, new, candidate, current, deploy, self.deploy)
        return Added([r["version"] for r in new], candidate["version"], candidate["version"] if deploy else None,
                     message), len(new)


def _replacing(current: dict | None) -> str:
    """', replacing version 2 (0.89)' after 'is deployed' (nothing when no version was deployed)."""
    if current is None:
        return ""
    old = "no score" if current["score"] is None else f"{current['score']:.4g}"
    return f", replacing version {current['version']} ({old})"


def _added_message(name: str, new: list[dict], candidate: dict, current: dict | None, deployed: bool,
                   mode: str) -> str:
    """One sentence on what training stored and deployed, naming versions and scores."""
    score_name = candidate["score_name"] or (current or {}).get("score_name")
    version, score = candidate["version"], candidate["score"]

    def subject(with_score: bool) -> str:
        this = _with_score(version, score if with_score else None, score_name)
        if len(new) > 1:
            this = f"versions {new[0]['version']} to {new[-1]['version']} are stored; the best, {this},"
        return f'model "{name}": {this}'

    if deployed:
        return f"{subject(True)} is deployed{_replacing(current)}"
    how = f"SELECT tensile.deploy('{name}', {version}) deploys it"
    if mode == "never":
        stays = f"version {current['version']} stays deployed" if current else "no version is deployed"
        return f"{subject(True)} is not deployed (deploy: never); {stays}; {how}"
    if score is None:
        return (f"{subject(False)} is not deployed: it has no score, and "
                f"{_with_score(current['version'], current['score'], current['score_name'])} is deployed; {how}")
    return (f"{subject(False)} is not deployed: its {score_name or 'score'} {score:.4g} is below "
            f"version {current['version']}'s {current['score']:.4g}; {how}")


def add_versions(plpy, GD, name: str, owner: str, any_owner: bool, versions: list[NewVersion], deploy: str,
                 replace: bool) -> Added:
    """Store ``versions`` as the next versions of ``name`` (after the highest one; with
    ``replace``, every earlier version and its deployments are deleted first), owned by
    ``owner`` (the calling role), and deploy the best of them by ``deploy`` (one of
    DEPLOY_MODES). ``any_owner``: the caller is a superuser or bypasses row-level security
    (:func:`may_replace_any`). Raises InvalidArgument when another role owns the name (see
    :func:`check_may_add`) or ``deploy`` is not a mode."""
    if deploy not in DEPLOY_MODES:
        raise InvalidArgument(f"options.deploy must be one of {', '.join(DEPLOY_MODES)}, got {deploy!r}")
    if not versions:
        raise InvalidArgument(f'no version of model "{name}" to store')
    return _apply(plpy, GD, _AddVersions(name, owner, any_owner, tuple(versions), deploy, replace))


# --- deploying ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Deploy:
    name: str
    role: str                                  # the calling role
    any_owner: bool
    target: int | str                          # a version number or one of STRATEGIES

    def run(self, plpy, GD) -> tuple[int, int]:
        existing = _versions(plpy, GD, self.name)
        _check_may_deploy(plpy, GD, self.name, existing, self.role, self.any_owner)
        current = next((r for r in existing if r["deployed"]), None)
        if isinstance(self.target, int):
            row = next((r for r in existing if r["version"] == self.target), None)
            if row is None:
                raise ModelNotFound(f'model "{self.name}" has no version {self.target}; its versions are '
                                    f"{', '.join(str(r['version']) for r in existing)}")
            strategy = "version"
        elif self.target == "best_score":
            row, strategy = max(existing, key=lambda r: _rank(r["score"], r["version"])), self.target
        elif self.target == "most_recent":
            row, strategy = existing[-1], self.target
        else:
            previous = plpy.execute(session.plan(plpy, GD, _LAST_OTHER_DEPLOYMENT, ["pg_catalog.text"]), [self.name])
            if not previous:
                raise InvalidArgument(f'model "{self.name}" has no earlier deployment to roll back to; deploy a version '
                                      f"by its number: SELECT tensile.deploy('{self.name}', {existing[-1]['version']})")
            row = next(r for r in existing if r["version"] == previous[0]["version"])
            strategy = self.target
        _set_deployed(plpy, GD, self.name, existing[0]["owner"], row, strategy)
        if current is not None and current["version"] == row["version"]:
            plpy.notice(f'tensile: model "{self.name}": version {row["version"]} stays deployed')
        else:
            plpy.notice(f'tensile: model "{self.name}": {_with_score(row["version"], row["score"], row["score_name"])} '
                        f"is deployed{_replacing(current)}")
        return row["version"], 1


def _check_may_deploy(plpy, GD, name: str, existing: list[dict], role: str, any_owner: bool) -> None:
    """Raise ModelNotFound when ``role`` does not see ``name``, InvalidArgument when it sees but
    does not own it (and is neither superuser nor BYPASSRLS)."""
    owner = existing[0]["owner"] if existing else None
    if owner is not None and (owner == role or any_owner):
        return
    if owner is not None and plpy.execute(session.plan(plpy, GD, _MAY_SEE, ["pg_catalog.name", "pg_catalog.name"]),
                                          [role, owner])[0]["sees"]:
        raise InvalidArgument(f'model "{name}" is owned by role {owner}; only its owner can deploy its versions')
    raise ModelNotFound(f'model "{name}" does not exist (or is owned by another role); SELECT name, version FROM '
                        "tensile.models lists the models you may see")


def deploy(plpy, GD, name: str, version_or_strategy: int | str) -> int:
    """Deploy a version of ``name``: a version number, or the one a strategy picks: ``best_score``
    (ranked as in training's ``deploy: auto``), ``most_recent`` (the highest version) or
    ``rollback`` (the version of the latest deployment whose version is not the deployed one).
    Records a ``tensile.deployments`` row (strategy ``version`` for a number) and returns the
    version now deployed. Only the owner (or a superuser, or a BYPASSRLS role) deploys. Raises
    InvalidArgument (an unknown strategy, not the owner, nothing to roll back to) or
    ModelNotFound (no such model, or no such version)."""
    target = version_or_strategy
    if isinstance(target, str) and target not in STRATEGIES:
        raise InvalidArgument(f'strategy "{target}" is not one of {", ".join(STRATEGIES)}; deploy model "{name}" '
                              f"by one of them or by a version number: SELECT tensile.deploy('{name}', 1)")
    return _apply(plpy, GD, _Deploy(name, _role(plpy, GD), may_replace_any(plpy, GD), target))


def not_deployed(plpy, GD, name: str) -> ModelNotFound:
    """The error for a prediction of ``name`` that found no deployed version the calling role
    sees: the model does not exist for it, or none of its versions is deployed."""
    rows = plpy.execute(session.plan(plpy, GD, """
        SELECT pg_catalog.array_agg(version ORDER BY version) AS versions FROM tensile.models
        WHERE name OPERATOR(pg_catalog.=) $1""", ["pg_catalog.text"]), [name])
    versions = rows[0]["versions"] if rows else None
    if not versions:
        return ModelNotFound(f'model "{name}" does not exist; SELECT name FROM tensile.models lists the models')
    return ModelNotFound(f'model "{name}" has no deployed version (its versions are '
                         f"{', '.join(map(str, versions))}); deploy one: SELECT tensile.deploy('{name}', "
                         f"{versions[-1]}), or SELECT tensile.deploy('{name}', 'best_score')")


# --- dropping ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Drop:
    name: str
    role: str
    any_owner: bool

    def run(self, plpy, GD) -> tuple[int, int]:
        rows = plpy.execute(session.plan(plpy, GD, _DELETE, ["pg_catalog.text", "pg_catalog.name", "pg_catalog.bool"]),
                            [self.name, self.role, self.any_owner])
        return len(rows), len(rows)


def drop(plpy, GD, name: str) -> bool:
    """Delete every version of the model ``name`` and its deployments, if the calling role owns
    it (any model for a superuser). Raises ModelNotFound otherwise."""
    if not _apply(plpy, GD, _Drop(name, _role(plpy, GD), may_replace_any(plpy, GD))):
        raise ModelNotFound(f'model "{name}" does not exist (or is owned by another role)')
    return True


def jsonb(value) -> str:
    """``value`` as JSON text for a jsonb column; NaN and infinities are not JSON, so they raise."""
    return json.dumps(value, allow_nan=False)
