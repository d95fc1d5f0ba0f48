"""Model versions and their deployment against a real cluster: training a name again adds a
version, predictions use the deployed version, tensile.deploy by number and by strategy
(best_score, most_recent, rollback), options.deploy (auto, always, never), who sees, trains and
deploys which versions, dropping, replacing, the Python client, and the upgrade from 0.2.0."""

from __future__ import annotations

import json

import psycopg
import pytest

import tensile_db
from hostile_fixtures import CATALOG, fired, fresh_role
from sql_helpers import FEATURES, error_of, train
from tensile_db.runtime import model as models
from tensile_db.runtime.weights import serialize_weights

pytestmark = pytest.mark.db

TINY = '{"layers": [{"dense": 8}]}'
PIXELS = ", ".join(f"p{i}" for i in range(64))
#: digits_train with every label shifted by 100: a version trained on it predicts 100..109.
SHIFTED = f"SELECT {PIXELS}, label + 100 AS label FROM digits_train"
ZEROS = "array_fill(0::real, ARRAY[64])"


def fit(conn, name, source="digits_train", deploy=None, replace=False, epochs=1) -> tuple[int, bool]:
    """Train a tiny version of ``name``; returns (version, deployed)."""
    options = {"epochs": epochs, **({"deploy": deploy} if deploy else {}), **({"replace": True} if replace else {})}
    _, _, version, deployed = train(conn, name, source=source, architecture=TINY,
                                    options=json.dumps(options))
    return version, deployed


def versions(conn, name) -> list[tuple[int, bool]]:
    return conn.execute("SELECT version, deployed FROM tensile.models WHERE name = %s ORDER BY version",
                        (name,)).fetchall()


def deployments(conn, name) -> list[tuple[int, str]]:
    return conn.execute("SELECT version, strategy FROM tensile.deployments WHERE name = %s ORDER BY id",
                        (name,)).fetchall()


def deploy(conn, name, target) -> int:
    return conn.execute("SELECT tensile.deploy(%s, %s)", (name, target)).fetchone()[0]


def predicted(conn, name) -> float:
    return conn.execute(f"SELECT tensile.predict(%s, {FEATURES}) FROM digits_test LIMIT 1", (name,)).fetchone()[0]


def batch_predicted(conn, name) -> float:
    return conn.execute("SELECT prediction FROM tensile.predict_batch(%s, 'digits_test') ORDER BY id LIMIT 1",
                        (name,)).fetchone()[0]


def set_score(conn, name, version, score) -> None:
    """Give a version a score as a superuser (the registry's roles cannot write it)."""
    conn.execute("UPDATE tensile.models SET metrics = metrics || jsonb_build_object('score', %s::float8, "
                 "'score_name', coalesce(metrics->>'score_name', 'f1_macro')) WHERE name = %s AND version = %s",
                 (score, name, version))


def sql_error(conn, sql, *params) -> tuple[str, str]:
    """The SQLSTATE and the message of the error ``sql`` raises (the extension's errors reach SQL
    as PL/Python's ``plpy.Error: message``)."""
    with pytest.raises(psycopg.Error) as info:
        conn.execute(sql, params or None)
    return info.value.sqlstate, info.value.diag.message_primary.removeprefix("plpy.Error: ")


def notice(conn, start: str) -> str:
    """The last NOTICE that starts with ``start``."""
    return [n for n in conn.notices if n.startswith(start)][-1]


# --- training adds versions ------------------------------------------------------------------------


def test_training_a_name_again_adds_a_version(conn, digits):
    assert fit(conn, "v_two") == (1, True)
    assert notice(conn, 'tensile: model "v_two"').startswith('tensile: model "v_two": version 1')
    assert fit(conn, "v_two", deploy="always") == (2, True)
    assert versions(conn, "v_two") == [(1, False), (2, True)]
    assert deployments(conn, "v_two") == [(1, "train"), (2, "train")]
    message = notice(conn, 'tensile: model "v_two"')
    assert message.startswith('tensile: model "v_two": version 2') and ", replacing version 1 (" in message
    owners = conn.execute("SELECT DISTINCT owner FROM tensile.models WHERE name = 'v_two'").fetchall()
    assert owners == [("postgres",)]


def test_replace_deletes_every_earlier_version_and_its_deployments(conn, digits):
    fit(conn, "v_replace")
    fit(conn, "v_replace", deploy="always")
    assert fit(conn, "v_replace", replace=True) == (1, True)
    assert versions(conn, "v_replace") == [(1, True)]
    assert deployments(conn, "v_replace") == [(1, "train")]


# --- deploying a version, and what predictions use --------------------------------------------------


@pytest.fixture(scope="module")
def switch(dsn, digits):
    """v_switch: version 1 predicts 0..9, version 2 (deployed) 100..109."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT tensile.drop_model(name) FROM (SELECT DISTINCT name FROM tensile.models "
                  "WHERE name = 'v_switch') n")
        fit(c, "v_switch")
        fit(c, "v_switch", source=SHIFTED, deploy="always")


def test_deploying_a_version_switches_predictions(conn, switch):
    assert deploy(conn, "v_switch", 2) == 2
    assert 100 <= predicted(conn, "v_switch") <= 109 and 100 <= batch_predicted(conn, "v_switch") <= 109
    ids = dict(conn.execute("SELECT version, id FROM tensile.models WHERE name = 'v_switch'").fetchall())
    assert deploy(conn, "v_switch", 1) == 1                     # the same session: its cached model is stale
    assert 0 <= predicted(conn, "v_switch") <= 9 and 0 <= batch_predicted(conn, "v_switch") <= 9
    assert conn.execute("SELECT id FROM tensile.models WHERE name = 'v_switch' AND deployed").fetchone()[0] == ids[1]
    message = notice(conn, 'tensile: model "v_switch"')
    assert message.startswith('tensile: model "v_switch": version 1') and " is deployed, replacing version 2 (" in message
    assert deploy(conn, "v_switch", 1) == 1
    assert notice(conn, 'tensile: model "v_switch"') == 'tensile: model "v_switch": version 1 stays deployed'
    assert deployments(conn, "v_switch")[-3:] == [(2, "version"), (1, "version"), (1, "version")]


def test_most_recent_deploys_the_highest_version(conn, switch):
    assert conn.execute("SELECT tensile.deploy('v_switch', 1)").fetchone()[0] == 1          # no casts needed
    assert conn.execute("SELECT tensile.deploy('v_switch', 'most_recent')").fetchone()[0] == 2
    assert versions(conn, "v_switch") == [(1, False), (2, True)]
    assert deployments(conn, "v_switch")[-1] == (2, "most_recent")


def test_best_score_ranks_by_score_then_version(conn, switch):
    for scores, best in (((0.9, 0.5), 1), ((0.7, 0.7), 2), ((0.1, None), 1), ((None, None), 2)):
        for version, score in enumerate(scores, 1):
            set_score(conn, "v_switch", version, score)
        assert deploy(conn, "v_switch", "best_score") == best, scores
        assert conn.execute("SELECT version FROM tensile.models WHERE name = 'v_switch' AND deployed").fetchone()[0] \
            == best
    assert deployments(conn, "v_switch")[-1] == (2, "best_score")


def test_rollback_goes_back_to_the_previous_deployment(conn, digits):
    fit(conn, "v_roll")
    fit(conn, "v_roll", deploy="always")
    assert deploy(conn, "v_roll", "rollback") == 1
    assert versions(conn, "v_roll") == [(1, True), (2, False)]
    assert deploy(conn, "v_roll", "rollback") == 2                  # and back again
    assert deployments(conn, "v_roll") == [(1, "train"), (2, "train"), (1, "rollback"), (2, "rollback")]
    fit(conn, "v_once")
    assert sql_error(conn, "SELECT tensile.deploy('v_once', 'rollback')") == (
        "22023", 'model "v_once" has no earlier deployment to roll back to; deploy a version by its number: '
                 "SELECT tensile.deploy('v_once', 1)")


def test_deploy_never_stores_a_version_that_predictions_do_not_use(conn, digits):
    assert fit(conn, "v_never", deploy="never") == (1, False)
    assert notice(conn, 'tensile: model "v_never"').endswith(
        " is not deployed (deploy: never); no version is deployed; SELECT tensile.deploy('v_never', 1) deploys it")
    expected = ('model "v_never" has no deployed version (its versions are 1); deploy one: '
                "SELECT tensile.deploy('v_never', 1), or SELECT tensile.deploy('v_never', 'best_score')")
    for sql in (f"SELECT tensile.predict('v_never', {FEATURES}) FROM digits_test LIMIT 1",
                "SELECT * FROM tensile.predict_batch('v_never', 'digits_test')"):
        assert sql_error(conn, sql) == ("42704", expected)
    assert fit(conn, "v_never", deploy="never") == (2, False)
    assert deployments(conn, "v_never") == []
    assert deploy(conn, "v_never", 1) == 1
    assert 0 <= predicted(conn, "v_never") <= 9
    assert fit(conn, "v_never", deploy="never") == (3, False)
    assert notice(conn, 'tensile: model "v_never"').endswith(
        "; version 1 stays deployed; SELECT tensile.deploy('v_never', 3) deploys it")


def test_auto_keeps_a_deployed_version_that_scores_higher(conn, digits):
    """Whatever the new version scores (an F1 is at most 1, or it has none), 2.0 is higher."""
    fit(conn, "v_keep")
    set_score(conn, "v_keep", 1, 2.0)
    assert fit(conn, "v_keep") == (2, False)
    assert versions(conn, "v_keep") == [(1, True), (2, False)]
    message = notice(conn, 'tensile: model "v_keep"')
    score = conn.execute("SELECT metrics->>'score', metrics->>'score_name' FROM tensile.models "
                         "WHERE name = 'v_keep' AND version = 2").fetchone()
    why = (f"its {score[1]} {float(score[0]):.4g} is below version 1's 2" if score[0] is not None
           else "it has no score, and version 1 (f1_macro 2) is deployed")
    assert message == f"tensile: model \"v_keep\": version 2 is not deployed: {why}; " \
                      "SELECT tensile.deploy('v_keep', 2) deploys it"


@pytest.fixture
def scored(conn, digits):
    """A trained model whose metrics carry the held-out score."""
    fit(conn, "v_scored")
    assert conn.execute("SELECT metrics ? 'score' FROM tensile.models WHERE name = 'v_scored'").fetchone()[0]


def test_auto_deploys_a_better_or_equal_version_and_keeps_a_worse_one(conn, scored):
    fit(conn, "v_auto")
    set_score(conn, "v_auto", 1, 0.0)                   # every F1 is at least 0
    assert fit(conn, "v_auto") == (2, True)
    score, name = conn.execute("SELECT (metrics->>'score')::float8, metrics->>'score_name' FROM tensile.models "
                               "WHERE name = 'v_auto' AND version = 2").fetchone()
    assert notice(conn, 'tensile: model "v_auto"') == \
        f'tensile: model "v_auto": version 2 ({name} {score:.4g}) is deployed, replacing version 1 (0)'
    set_score(conn, "v_auto", 2, 1.5)                   # and none is above 1
    assert fit(conn, "v_auto") == (3, False)
    new = conn.execute("SELECT (metrics->>'score')::float8 FROM tensile.models WHERE name = 'v_auto' AND version = 3"
                       ).fetchone()[0]
    assert notice(conn, 'tensile: model "v_auto"') == \
        (f"tensile: model \"v_auto\": version 3 is not deployed: its {name} {new:.4g} is below version 2's 1.5; "
         "SELECT tensile.deploy('v_auto', 3) deploys it")
    assert versions(conn, "v_auto") == [(1, False), (2, True), (3, False)]


def test_versions_and_deployments_never_run_objects_on_the_callers_search_path(conn, digits, trojans):
    conn.execute("SET search_path = evil, pg_catalog, public")
    fit(conn, "v_trojan", deploy="never")
    assert sql_error(conn, "SELECT tensile.predict('v_trojan', array_fill(0::real, ARRAY[64]))")[0] == "42704"
    assert sql_error(conn, "SELECT * FROM tensile.predict_batch('v_trojan', 'digits_test')")[0] == "42704"
    fit(conn, "v_trojan")
    fit(conn, "v_trojan", deploy="always")
    for target in (1, "best_score", "most_recent", "rollback"):
        deploy(conn, "v_trojan", target)
    assert sql_error(conn, "SELECT tensile.deploy('v_trojan', 9)")[0] == "42704"
    conn.execute("SELECT tensile.predict('v_trojan', array_fill(0::real, ARRAY[64]))")
    fit(conn, "v_trojan", replace=True)
    conn.execute("SELECT tensile.drop_model('v_trojan')")
    assert fired(conn) == []


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sql, sqlstate, message", [
    ("SELECT tensile.deploy('v_switch', 'newest')", "22023",
     'strategy "newest" is not one of best_score, most_recent, rollback; deploy model "v_switch" by one of them '
     "or by a version number: SELECT tensile.deploy('v_switch', 1)"),
    ("SELECT tensile.deploy('v_switch', 7)", "42704", 'model "v_switch" has no version 7; its versions are 1, 2'),
    ("SELECT tensile.deploy('v_switch', 0)", "42704", 'model "v_switch" has no version 0; its versions are 1, 2'),
    ("SELECT tensile.deploy('v_nope', 'rollback')", "42704",
     'model "v_nope" does not exist (or is owned by another role); SELECT name, version FROM tensile.models lists '
     "the models you may see"),
    ("SELECT tensile.deploy('v_nope', 1)", "42704",
     'model "v_nope" does not exist (or is owned by another role); SELECT name, version FROM tensile.models lists '
     "the models you may see"),
    ("SELECT tensile._write_model()", "22023",
     "tensile._write_model() applies only what the extension's own functions prepare; use tensile.train_model, "
     "tensile.deploy or tensile.drop_model"),
])
def test_deploy_errors(conn, switch, sql, sqlstate, message):
    assert sql_error(conn, sql) == (sqlstate, message)


def test_deploy_and_the_row_predictions_are_declared_like_every_function(conn):
    rows = conn.execute("SELECT p.oid::regprocedure::text, p.provolatile, p.proisstrict, p.proparallel, "
                        "obj_description(p.oid, 'pg_proc') IS NOT NULL FROM pg_proc p "
                        "WHERE p.pronamespace = 'tensile'::regnamespace "
                        "AND p.proname IN ('deploy', 'predict', 'predict_proba', 'predict_label') ORDER BY 1").fetchall()
    assert rows == [("tensile.deploy(text,integer)", "v", True, "u", True),
                    ("tensile.deploy(text,text)", "v", True, "u", True),
                    ("tensile.predict(text,jsonb)", "s", True, "u", True),
                    ("tensile.predict(text,real[])", "s", True, "u", True),
                    ("tensile.predict(text,record)", "s", True, "u", True),
                    ("tensile.predict_label(text,jsonb)", "s", True, "u", True),
                    ("tensile.predict_label(text,real[])", "s", True, "u", True),
                    ("tensile.predict_label(text,record)", "s", True, "u", True),
                    ("tensile.predict_proba(text,jsonb)", "s", True, "u", True),
                    ("tensile.predict_proba(text,real[])", "s", True, "u", True),
                    ("tensile.predict_proba(text,record)", "s", True, "u", True)]


# --- who sees, trains and deploys which versions ----------------------------------------------------


def as_role(dsn, role) -> psycopg.Connection:
    c = psycopg.connect(dsn.replace("user=postgres", f"user={role}"), autocommit=True)
    c.notices = []
    c.add_notice_handler(lambda d: c.notices.append(d.message_primary))
    return c


def test_versions_are_private_to_the_owner_and_its_role_members(conn, dsn, digits):
    conn.execute("SELECT tensile.drop_model(name) FROM (SELECT DISTINCT name FROM tensile.models "
                 "WHERE name = 'v_private') n")
    fresh_role(conn, "v_owner", "GRANT SELECT ON digits_train TO v_owner")
    fresh_role(conn, "v_other", "GRANT SELECT ON digits_train TO v_other")
    fresh_role(conn, "v_member", "GRANT v_owner TO v_member")
    with as_role(dsn, "v_owner") as o:
        fit(o, "v_private")
        assert fit(o, "v_private", deploy="always") == (2, True)
        assert deploy(o, "v_private", 1) == 1
    with as_role(dsn, "v_other") as x:
        assert x.execute("SELECT count(*) FROM tensile.models WHERE name = 'v_private'").fetchone()[0] == 0
        assert x.execute("SELECT count(*) FROM tensile.deployments WHERE name = 'v_private'").fetchone()[0] == 0
        assert sql_error(x, "SELECT tensile.deploy('v_private', 2)") == (
            "42704", 'model "v_private" does not exist (or is owned by another role); SELECT name, version FROM '
                     "tensile.models lists the models you may see")
        assert sql_error(x, f"SELECT tensile.predict('v_private', {ZEROS})") == (
            "42704", 'model "v_private" does not exist; SELECT name FROM tensile.models lists the models')
        message = error_of(x, train, "v_private", architecture=TINY, options='{"epochs": 1}')
        assert 'model "v_private" is owned by role v_owner; only its owner can train new versions of it — choose ' \
               "another model_name" in message
        assert not any("epoch" in n for n in x.notices)
    with as_role(dsn, "v_member") as m:
        assert versions(m, "v_private") == [(1, True), (2, False)]
        assert deployments(m, "v_private") == [(1, "train"), (2, "train"), (1, "version")]
        assert 0 <= m.execute(f"SELECT tensile.predict('v_private', {ZEROS})").fetchone()[0] <= 9
        assert sql_error(m, "SELECT tensile.deploy('v_private', 2)") == (
            "22023", 'model "v_private" is owned by role v_owner; only its owner can deploy its versions')
    assert deploy(conn, "v_private", 2) == 2                       # a superuser may
    assert conn.execute("SELECT owner, strategy FROM tensile.deployments WHERE name = 'v_private' ORDER BY id DESC "
                        "LIMIT 1").fetchone() == ("v_owner", "version")
    message = error_of(conn, train, "v_private", architecture=TINY, options='{"epochs": 1}')
    assert 'model "v_private" is owned by role v_owner; only its owner can train new versions of it — choose ' \
           "another model_name, or replace every version of it with options => '{\"replace\": true}'" in message


def test_drop_removes_every_version_and_deployment(conn, digits):
    fit(conn, "v_drop")
    fit(conn, "v_drop", deploy="always")
    deploy(conn, "v_drop", "rollback")
    assert conn.execute("SELECT tensile.drop_model('v_drop')").fetchone()[0] is True
    assert versions(conn, "v_drop") == [] and deployments(conn, "v_drop") == []
    assert sql_error(conn, "SELECT tensile.drop_model('v_drop')") == (
        "42704", 'model "v_drop" does not exist (or is owned by another role)')


def test_python_client_versions(cluster, digits):
    from tensile_db.client import TensileClient

    client = TensileClient(cluster.url("tensile_test"))
    try:
        for version in (1, 2):
            result = client.train("v_client", "digits_train", "label", architecture={"layers": [{"dense": 8}]},
                                  options={"epochs": 1, "deploy": "always", "replace": version == 1})
            assert (result["version"], result["deployed"]) == (version, True)
        assert client.deploy("v_client", 1) == 1
        assert client.deploy("v_client", "most_recent") == 2
        rows = [(m["name"], m["version"], m["deployed"]) for m in client.models() if m["name"] == "v_client"]
        assert rows == [("v_client", 1, False), ("v_client", 2, True)]
        assert all(m["score"] == m["metrics"].get("score") for m in client.models() if m["name"] == "v_client")
        client.drop("v_client")
    finally:
        client.engine.dispose()


# --- the upgrade from 0.2.0 ----------------------------------------------------------------------------

#: The extension's tables as the catalog holds them: columns, constraints, indexes, comments.
STRUCTURE = """
SELECT 'column', c.relname || '.' || a.attname, a.attnum::text || format_type(a.atttypid, a.atttypmod)
       || a.attnotnull::text || coalesce(pg_get_expr(d.adbin, d.adrelid), '') || a.attidentity::text
       || coalesce(col_description(c.oid, a.attnum), '')
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relnamespace = 'tensile'::regnamespace AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT 'constraint', conrelid::regclass::text || '.' || conname, pg_get_constraintdef(oid) FROM pg_constraint
WHERE connamespace = 'tensile'::regnamespace
UNION ALL
SELECT 'index', indexname, indexdef FROM pg_indexes WHERE schemaname = 'tensile'
UNION ALL
SELECT 'table', c.relname, coalesce(obj_description(c.oid, 'pg_class'), '') || c.relrowsecurity::text
FROM pg_class c WHERE c.relnamespace = 'tensile'::regnamespace AND c.relkind = 'r'
UNION ALL
SELECT 'dumped', unnest(extconfig)::regclass::text, '' FROM pg_extension WHERE extname = 'tensile_db'
ORDER BY 1, 2"""


def test_an_upgrade_from_0_2_0_keeps_each_model_as_version_1_deployed(cluster, conn):
    spec = models.ModelSpec(models.parse_architecture({"layers": [{"dense": 8}]}), 2, 2, "classification")
    structures = {}
    for db, create in (("tensile_up2", "CREATE EXTENSION tensile_db VERSION '0.2.0' CASCADE"),
                       ("tensile_fresh2", "CREATE EXTENSION tensile_db CASCADE")):
        conn.execute(f"DROP DATABASE IF EXISTS {db}")
        conn.execute(f"CREATE DATABASE {db}")
        with psycopg.connect(cluster.conninfo(db), autocommit=True) as c:
            c.execute(create)
            if db == "tensile_up2":
                for name in ("old_a", "old_b"):
                    c.execute("INSERT INTO tensile.models (name, task, architecture, options, feature_names, label_name, "
                              "label_classes, metrics, weights) VALUES (%s, 'classification', %s, '{}', '{a,b}', "
                              "'label', '{0,1}', '{}', %s)",
                              (name, '{"layers": [{"dense": 8}]}', serialize_weights(models.init_weights(spec, 0))))
                c.execute("ALTER EXTENSION tensile_db UPDATE")
                assert c.execute("SELECT name, version, deployed, preprocess, label_names, search FROM tensile.models "
                                 "ORDER BY name").fetchall() == [("old_a", 1, True, None, None, None),
                                                                 ("old_b", 1, True, None, None, None)]
                assert c.execute("SELECT d.name, d.version, d.strategy, d.deployed_at = m.created_at "
                                 "FROM tensile.deployments d JOIN tensile.models m ON m.id = d.model_id "
                                 "ORDER BY d.id").fetchall() == [("old_a", 1, "train", True),
                                                                 ("old_b", 1, "train", True)]
                assert c.execute("SELECT tensile.predict('old_a', ARRAY[0.5, 1]::real[])").fetchone()[0] in (0, 1)
            assert c.execute("SELECT extversion FROM pg_extension WHERE extname = 'tensile_db'").fetchone()[0] == tensile_db.__version__
            structures[db] = c.execute(STRUCTURE).fetchall() + c.execute(CATALOG).fetchall()
        conn.execute(f"DROP DATABASE {db}")
    assert structures["tensile_up2"] == structures["tensile_fresh2"]
    assert ("index", "models_one_deployed") in [row[:2] for row in structures["tensile_fresh2"]]


def test_the_extension_and_the_package_have_one_version():
    """``pyproject.toml`` holds the version; the control file's default version must be it."""
    from pathlib import Path

    control = (Path(__file__).resolve().parent.parent / "extension" / "tensile_db.control").read_text()
    assert f"default_version = '{tensile_db.__version__}'" in control
