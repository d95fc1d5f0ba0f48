"""What an analyst uses every day, against a real cluster: categorical and missing values with the
preprocessing stored with the model and applied by every predict path, refused column types,
held-out metrics checked against scikit-learn, early stopping, and a hyperparameter search whose
trials train at once (visible in tensile.jobs, cancellable as a whole)."""

from __future__ import annotations

import json
import threading

import numpy as np
import psycopg
import pytest
from sklearn import metrics as skm

from conftest import wait_until

pytestmark = pytest.mark.db

SMALL = '{"layers": [{"dense": 32}]}'


def train(conn, name, source, label="label", options=None, features=None, architecture=SMALL):
    """CALL train_model; returns (task, metrics, version, deployed)."""
    return conn.execute(
        "CALL tensile.train_model(model_name => %s, source => %s, label => %s, features => %s, "
        "architecture => %s, options => %s)",
        (name, source, label, features, architecture, json.dumps(options or {"epochs": 20}))).fetchone()


def error_of(conn, sql, params=None) -> str:
    with pytest.raises(psycopg.Error) as info:
        conn.execute(sql, params)
    return str(info.value)


def assert_nothing_left(conn):
    assert wait_until(lambda: conn.execute("SELECT count(*) FROM tensile.jobs").fetchone()[0] == 0)
    mem = conn.execute("SELECT in_use_bytes - weight_cache_bytes FROM tensile.memory").fetchone()
    assert mem is None or mem[0] == 0


@pytest.fixture(scope="module")
def shop(dsn):
    """600 rows: the label depends on a text column (3 categories + a rare 4th), an enum, a
    boolean and a numeric column; NULLs in the numeric, text and boolean columns."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS shop; DROP TYPE IF EXISTS tier")
        c.execute("CREATE TYPE tier AS ENUM ('bronze', 'silver', 'gold')")
        c.execute("""
            CREATE TABLE shop AS
            SELECT g AS id,
                   (ARRAY['north', 'south', 'east'])[1 + g % 3] AS region,
                   (ARRAY['bronze', 'silver', 'gold'])[1 + (g / 3) % 3]::tier AS tier,
                   g % 2 = 0 AS member,
                   ((g * 37) % 100)::real / 10 AS spend,
                   CASE WHEN (g % 3 = 0) = (g % 2 = 0) THEN 'yes' ELSE 'no' END AS label
            FROM generate_series(1, 600) g""")
        c.execute("UPDATE shop SET region = 'west' WHERE id IN (7, 8)")          # rare
        c.execute("UPDATE shop SET spend = NULL WHERE id % 50 = 0")
        c.execute("UPDATE shop SET region = NULL WHERE id % 97 = 0")
        c.execute("UPDATE shop SET member = NULL WHERE id % 89 = 0")
        c.execute("ALTER TABLE shop ADD COLUMN doc jsonb DEFAULT '{}'")
        c.execute("ALTER TABLE shop ADD COLUMN code char(4)")            # padded: 'ab  '
        c.execute("UPDATE shop SET code = (ARRAY['ab', 'cd'])[1 + id % 2]")
    return 600


IMPUTE_ALL = {"epochs": 40, "lr": 0.01, "impute": "mode",
              "preprocess": {"spend": {"impute": "median", "scale": "minmax"}}}


def test_categorical_columns_are_one_hot_encoded_and_imputed(conn, shop):
    task, metrics, version, deployed = train(conn, "a_shop", "SELECT id, region, tier, member, spend, code, label "
                                             "FROM shop", features=["region", "tier", "member", "spend", "code"],
                                             options=IMPUTE_ALL)
    assert task == "classification" and version == 1 and deployed
    assert metrics["accuracy"] >= 0.95 and metrics["test_samples"] == 120
    row = conn.execute("SELECT preprocess, label_names, label_classes, feature_names FROM tensile.models "
                       "WHERE name = 'a_shop'").fetchone()
    pre = {c["name"]: c for c in row[0]["columns"]}
    assert row[1] == ["no", "yes"] and row[2] == [0.0, 1.0]
    assert row[3] == ["region", "tier", "member", "spend", "code"]
    assert pre["region"]["kind"] == "categorical" and pre["region"]["encode"] == "one_hot"
    assert set(pre["region"]["categories"]) == {"north", "south", "east", "west"} and not pre["region"]["other"]
    assert pre["region"]["fill"] in ("north", "south", "east")                  # the mode of the training rows
    assert pre["member"]["categories"] == ["false", "true"] or pre["member"]["categories"] == ["true", "false"]
    assert pre["tier"]["kind"] == "categorical" and sorted(pre["code"]["categories"]) == ["ab  ", "cd  "]
    assert pre["spend"]["kind"] == "numeric" and pre["spend"]["impute"] == "median" and pre["spend"]["scale"] == "minmax"

    # Every predict path applies the same preprocessing: a row, jsonb, predict_batch, predict_label.
    by_row = conn.execute("SELECT id, tensile.predict('a_shop', s) FROM shop s ORDER BY id").fetchall()
    by_batch = conn.execute("SELECT id, prediction FROM tensile.predict_batch('a_shop', "
                            "'SELECT id, region, tier, member, spend, code FROM shop', key => 'id') ORDER BY id").fetchall()
    assert by_row == by_batch
    labels = [r[0] for r in conn.execute("SELECT tensile.predict_label('a_shop', s) FROM shop s ORDER BY id")]
    assert labels == [["no", "yes"][int(p)] for _, p in by_row]
    assert labels == [r[0] for r in conn.execute("SELECT class_name FROM tensile.predict_batch('a_shop', "
                                                 "'SELECT id, region, tier, member, spend, code FROM shop', "
                                                 "key => 'id') ORDER BY id")]
    truth = [r[0] for r in conn.execute("SELECT label FROM shop ORDER BY id")]
    assert np.mean([a == b for a, b in zip(labels, truth)]) >= 0.95
    as_json = conn.execute("""SELECT tensile.predict_proba('a_shop', '{"region": "north", "tier": "gold",
                              "member": true, "spend": null, "code": "ab  "}'::jsonb)""").fetchone()[0]
    as_row = conn.execute("SELECT tensile.predict_proba('a_shop', s) FROM (SELECT 'north'::text AS region, "
                          "'gold'::tier AS tier, true AS member, NULL::real AS spend, 'ab'::char(4) AS code) s").fetchone()[0]
    assert as_json == as_row
    message = error_of(conn, """SELECT tensile.predict('a_shop', '{"region": "north"}'::jsonb)""")
    assert 'model "a_shop" reads the columns region, tier, member, spend, code; the row has no tier, member, spend, ' \
           "code (give null for a missing value)" in message
    # A row array is refused for a model with categorical columns, naming them.
    message = error_of(conn, "SELECT tensile.predict('a_shop', ARRAY[1, 2, 3, 4]::real[])")
    assert 'model "a_shop" has categorical feature columns (region, tier, member, code)' in message


def test_unseen_categories_go_to_other_or_raise(conn, shop):
    train(conn, "a_other", "SELECT region, spend, label FROM shop WHERE region IS NOT NULL AND spend IS NOT NULL",
          options={"epochs": 2, "max_categories": 2})
    pre = conn.execute("SELECT preprocess FROM tensile.models WHERE name = 'a_other'").fetchone()[0]
    region = pre["columns"][0]
    assert len(region["categories"]) == 2 and region["other"] and region["width"] == 3
    assert "west" not in region["categories"]                     # 2 rows: among the rarer, "other"
    mars, west = (conn.execute("SELECT tensile.predict_proba('a_other', %s::jsonb)",
                               (json.dumps({"region": r, "spend": 1}),)).fetchone()[0] for r in ("mars", "west"))
    assert mars == west                                          # unseen and rare alike: the other input

    train(conn, "a_strict", "SELECT region, spend, label FROM shop WHERE region IS NOT NULL AND spend IS NOT NULL",
          options={"epochs": 2, "unseen": "error"})
    message = error_of(conn, """SELECT tensile.predict('a_strict', '{"region": "mars", "spend": 1}'::jsonb)""")
    assert 'column "region" has 1 value never seen in training (the first: "mars")' in message
    message = error_of(conn, "SELECT * FROM tensile.predict_batch('a_strict', "
                             "'SELECT ''mars'' AS region, 1.0::real AS spend UNION ALL SELECT ''venus'', 2')")
    assert 'column "region" has 2 values never seen in training' in message


def test_a_call_wide_mean_imputes_categories_by_their_mode(conn, shop):
    train(conn, "a_mean", "SELECT region, spend, label FROM shop", options={"epochs": 1, "impute": "mean"})
    region, spend = conn.execute("SELECT preprocess FROM tensile.models WHERE name = 'a_mean'").fetchone()[0]["columns"]
    assert (region["impute"], spend["impute"]) == ("mode", "mean")
    counts = conn.execute("SELECT region, count(*) FROM shop WHERE id % 5 <> 0 GROUP BY 1").fetchall()
    assert region["fill"] in {r for r, _ in counts if r is not None}


def test_the_scan_of_categories_does_not_depend_on_string_settings(conn, shop):
    conn.execute("SET standard_conforming_strings = off")
    try:
        train(conn, "a_strings", "SELECT region, label FROM shop", options={"epochs": 1, "impute": "mode"})
        rows = conn.execute("SELECT count(*) FROM tensile.predict_batch('a_strings', 'SELECT region FROM shop')")
        assert rows.fetchone()[0] == 600
    finally:
        conn.execute("RESET standard_conforming_strings")


def test_ordinal_encoding_in_the_given_order(conn, shop):
    train(conn, "a_ordinal", "SELECT tier, spend, label FROM shop WHERE spend IS NOT NULL",
          options={"epochs": 2, "preprocess": {"tier": {"encode": {"ordinal": ["bronze", "silver", "gold"]}}}})
    tier = conn.execute("SELECT preprocess FROM tensile.models WHERE name = 'a_ordinal'").fetchone()[0]["columns"][0]
    assert tier["encode"] == "ordinal" and tier["categories"] == ["bronze", "silver", "gold"] and tier["width"] == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(source="SELECT region, spend, label FROM shop"),
     'column "region" has 6 NULLs, column "spend" has 12 NULLs (of 600 rows); filter them in the source or pass '
     'options => \'{"skip_nulls": true}\''),
    (dict(source="SELECT region, doc, label FROM shop WHERE region IS NOT NULL"),
     'feature column "doc" has type jsonb, which cannot be a feature'),
    (dict(source="SELECT spend, doc, label FROM shop", features=["spend", "doc"]),
     'feature column "doc" has type jsonb, which cannot be a feature'),
    (dict(source="SELECT spend, CASE WHEN id = 3 THEN NULL ELSE label END AS label FROM shop",
          options={"epochs": 1, "impute": "mean"}),
     'column "label" has 1 NULL (of 600 rows)'),
    (dict(source="SELECT region, spend, label FROM shop",
          options={"epochs": 1, "impute": "mean", "preprocess": {"region": {"impute": "median"}}}),
     'column "region" is categorical: impute median needs numbers'),
    (dict(source="SELECT region, spend, label FROM shop", options={"epochs": 1, "preprocess": {"nope": {}}}),
     'options.preprocess names "nope", which is not a feature column'),
    (dict(source="SELECT spend, pg_catalog.repeat('x', 2000) || label AS label FROM shop",
          options={"epochs": 1, "impute": "mean"}),
     'label column "label" holds a value of 2,003 characters; a class name may have at most 1,000'),
    (dict(source="SELECT spend, label FROM shop", options={"epochs": 1, "impute": "average"}),
     "options.impute must be one of error, mean, median, mode or {\"constant\": value}"),
])
def test_refused_columns_and_rules(conn, shop, kwargs, message):
    kwargs.setdefault("options", {"epochs": 1})
    name = "a_refused"
    with pytest.raises(psycopg.Error) as info:
        train(conn, name, **kwargs)
    assert message in str(info.value)
    assert conn.execute("SELECT count(*) FROM tensile.models WHERE name = %s", (name,)).fetchone()[0] == 0
    assert_nothing_left(conn)


def test_held_out_metrics_agree_with_scikit_learn(conn, digits):
    """With test_sampling 'last' the held-out rows are the source's last rows: the stored metrics
    must equal scikit-learn's on the model's own predictions of those rows."""
    conn.execute("DROP TABLE IF EXISTS a_digits; CREATE TABLE a_digits AS "
                 "SELECT row_number() OVER () AS id, * FROM digits_train")
    source = f"SELECT {', '.join(f'p{i}' for i in range(64))}, label FROM a_digits ORDER BY id"
    n = conn.execute("SELECT count(*) FROM a_digits").fetchone()[0]
    _, metrics, _, _ = train(conn, "a_heldout", source, architecture='{"layers": [{"dense": 32}]}',
                             options={"epochs": 3, "test_sampling": "last", "test_size": 0.25})
    held = n - int(np.floor(n * 0.75))
    assert metrics["test_samples"] == held and metrics["samples"] == n - held
    rows = conn.execute(f"SELECT label, tensile.predict_proba('a_heldout', ARRAY[{', '.join(f'p{i}' for i in range(64))}]) "
                        f"FROM ({source} OFFSET {n - held}) t").fetchall()
    y = np.array([r[0] for r in rows])
    proba = np.array([r[1] for r in rows], dtype=np.float64)
    proba /= proba.sum(axis=1, keepdims=True)          # real[] rounding: scikit-learn wants rows summing to 1
    predicted = proba.argmax(axis=1)
    assert metrics["accuracy"] == pytest.approx(skm.accuracy_score(y, predicted), abs=1e-9)
    assert metrics["f1_macro"] == pytest.approx(skm.f1_score(y, predicted, average="macro", zero_division=0), abs=1e-6)
    assert metrics["log_loss"] == pytest.approx(skm.log_loss(y, proba, labels=range(10)), rel=1e-4)
    assert metrics["roc_auc"] == pytest.approx(skm.roc_auc_score(y, proba, multi_class="ovr"), rel=1e-4)
    assert metrics["confusion_matrix"] == skm.confusion_matrix(y, predicted, labels=range(10)).tolist()
    assert metrics["score_name"] == "f1_macro" and metrics["score"] == metrics["f1_macro"]
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3]
    assert all(h["val_loss"] > 0 for h in metrics["history"])


def test_regression_metrics_agree_with_scikit_learn(conn):
    conn.execute("DROP TABLE IF EXISTS a_reg; CREATE TABLE a_reg AS SELECT g AS id, (g % 17)::real AS a, "
                 "(g % 5)::real AS b, ((g % 17) * 2 - (g % 5) + sin(g))::float8 AS target FROM generate_series(1, 400) g")
    _, metrics, _, _ = train(conn, "a_regression", "SELECT a, b, target FROM a_reg ORDER BY id", label="target",
                             options={"epochs": 30, "lr": 0.01, "test_sampling": "last"})
    rows = conn.execute("SELECT target, tensile.predict('a_regression', ARRAY[a, b]) FROM a_reg ORDER BY id OFFSET 320").fetchall()
    y, pred = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    assert metrics["r2"] == pytest.approx(skm.r2_score(y, pred), abs=1e-4)
    assert metrics["mae"] == pytest.approx(skm.mean_absolute_error(y, pred), rel=1e-4)
    assert metrics["rmse"] == pytest.approx(np.sqrt(skm.mean_squared_error(y, pred)), rel=1e-4)
    assert metrics["r2"] > 0.8


def test_early_stopping_keeps_the_best_epoch(conn, digits):
    """A wide network at a high learning rate on few rows overfits: the held-out loss stops
    improving, training ends early and the stored model is the best epoch's."""
    _, metrics, _, _ = train(conn, "a_patience", "SELECT * FROM digits_train LIMIT 300",
                             architecture='{"layers": [{"dense": 256}, {"dense": 256}]}',
                             options={"epochs": 200, "lr": 0.01, "patience": 3, "batch_size": 32})
    history = metrics["history"]
    assert metrics["stopped"] == "patience" and metrics["epochs"] < 200 and len(history) == metrics["epochs"]
    best = metrics["best_epoch"]
    assert metrics["epochs"] == best + 3
    assert history[best - 1]["val_loss"] == min(h["val_loss"] for h in history)
    # the stored model is that epoch's: its held-out log loss is the loss recorded then
    assert metrics["log_loss"] == pytest.approx(history[best - 1]["val_loss"], rel=1e-3)
    assert any("held-out loss" in n for n in conn.notices)


def search_options(parallel, halving=False, epochs=10):
    return {"epochs": epochs, "batch_size": 64,
            "search": {"method": "grid", "params": {"lr": [0.0003, 0.003], "layers": [[{"dense": 16}], [{"dense": 64}]]},
                       "parallel": parallel, "halving": halving}}


def test_a_search_trains_its_trials_at_once_and_deploys_the_best(conn, dsn, digits):
    seen = []

    def watch():
        with psycopg.connect(dsn, autocommit=True) as w:
            wait_until(lambda: seen.append(w.execute(
                "SELECT count(*) FROM tensile.jobs WHERE model_name LIKE 'a_search trial %' AND state = 'running'"
            ).fetchone()[0]) or max(seen) >= 2, 60)

    watcher = threading.Thread(target=watch)
    watcher.start()
    _, metrics, version, deployed = train(conn, "a_search", "SELECT * FROM digits_train", options=search_options(4))
    watcher.join()
    assert max(seen) >= 2                                  # trials ran at the same time
    rows = conn.execute("SELECT version, deployed, search, (metrics->>'score')::float8 FROM tensile.models "
                        "WHERE name = 'a_search' ORDER BY version").fetchall()
    assert [r[0] for r in rows] == [1, 2, 3, 4]
    assert sorted(r[2]["trial"] for r in rows) == [1, 2, 3, 4] and len({r[2]["search"] for r in rows}) == 1
    best = max(rows, key=lambda r: (r[3], r[0]))                # ties: the higher version, as deployment ranks
    assert [r[0] for r in rows if r[1]] == [best[0]] and version == best[0] and deployed
    assert metrics["score"] == best[3]
    assert sum("trial" in n and "f1_macro" in n for n in conn.notices) == 4
    assert_nothing_left(conn)


def test_successive_halving_stops_the_worse_trials(conn, digits):
    train(conn, "a_halving", "SELECT * FROM digits_train", options=search_options(1, halving=True, epochs=8))
    stopped = conn.execute("SELECT count(*) FROM tensile.models WHERE name = 'a_halving' "
                           "AND metrics->>'stopped' = 'halving'").fetchone()[0]
    assert stopped >= 1
    assert conn.execute("SELECT count(*) FROM tensile.models WHERE name = 'a_halving'").fetchone()[0] == 4


def test_cancelling_a_search_stops_every_trial(conn, dsn, digits):
    outcome = {}

    def run():
        with psycopg.connect(dsn, autocommit=True) as c:
            outcome["pid"] = c.execute("SELECT pg_backend_pid()").fetchone()[0]
            try:
                train(c, "a_cancelled", "SELECT * FROM digits_train", options=search_options(2, epochs=500))
            except psycopg.Error as exc:
                outcome["error"] = str(exc)

    t = threading.Thread(target=run)
    t.start()
    assert wait_until(lambda: conn.execute("SELECT count(*) FROM tensile.jobs WHERE model_name LIKE 'a_cancelled trial %' "
                                           "AND state = 'running'").fetchone()[0] == 2, 60)
    conn.execute("SELECT pg_cancel_backend(%s)", (outcome["pid"],))
    t.join(20)
    assert not t.is_alive() and "canceling statement due to user request" in outcome["error"]
    assert_nothing_left(conn)
    assert conn.execute("SELECT count(*) FROM tensile.models WHERE name = 'a_cancelled'").fetchone()[0] == 0
