"""Held-out accuracy of models trained from SQL beside scikit-learn's MLP on the same rows.

Three public data sets, loaded offline by :mod:`tensile_db.datasets` into a PostgreSQL cluster
this script starts in a temporary directory (and removes at the end):

- penguins (344 rows; species from two text and four numeric columns, with real missing values:
  numeric gaps imputed with the training rows' mean, ``sex`` with their mode; text columns one-hot),
- breast cancer (569 rows, 30 numeric columns, two classes),
- diabetes (442 rows, 10 numeric columns, a numeric target: regression).

For every data set and seed, both sides train on exactly the same rows and are scored on exactly
the same held-out rows: the source query orders the table by ``md5(seed:id)`` (a shuffle that the
seed fixes), ``CALL tensile.train_model`` holds out the last 20% of it (``test_sampling: "last"``),
and scikit-learn reads the same query and holds out its last 20%. The bench checks that this is
so: tensile's stored held-out metric must equal the one recomputed from ``tensile.predict`` on
the rows held out here.

Both sides fit the same preprocessing on the training rows (scikit-learn: ``SimpleImputer``,
``OneHotEncoder`` for text columns, ``StandardScaler`` for numeric ones, and the regression target
standardized as tensile does) and train the same network: the same hidden layers (ReLU), Adam at
the same learning rate, the same batch size, ``max_iter`` = epochs, no weight decay
(``alpha=0``) and no early stopping. Initialisation and batch order differ (each side's own,
seeded by the seed).

Printed: one table with each metric's median over the seeds and its [min, max] on both sides,
and which side is better only where the ranges do not overlap ("not decided" otherwise); then
whether every held-out split matched.

    python bench/accuracy.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import create_engine, text
from tabulate import tabulate

import cnn
from common import better, spread
from tensile_db import datasets
from tensile_db.client import TensileClient
from tensile_db.cluster import scratch_cluster

DATABASE = "tensile_bench_accuracy"
TEST_SIZE = 0.2
#: Columns never used as features.
NOT_FEATURES = ("id", "year")


@dataclass(frozen=True)
class Metric:
    """A reported figure: its name, how tensile's stored metrics name it, and whether higher is better."""

    name: str
    key: str
    higher_is_better: bool = True


@dataclass(frozen=True)
class Case:
    """One data set and how both sides train on it. ``hidden``: units of the hidden layers;
    ``impute``: tensile's ``impute`` option for numeric columns, ``impute_text`` for text columns
    (scikit-learn's SimpleImputer strategies follow them)."""

    table: str
    load: object
    label: str
    task: str
    hidden: tuple[int, ...]
    lr: float
    epochs: int
    batch_size: int
    metrics: tuple[Metric, ...]
    impute: str = "error"
    impute_text: str = "error"
    text_label: bool = False


ACCURACY, F1 = Metric("accuracy", "accuracy"), Metric("F1 macro", "f1_macro")
CASES = (
    Case("penguins", datasets.load_penguins, "species", "classification", (16,), 0.01, 60, 32,
         (ACCURACY, F1), impute="mean", impute_text="mode", text_label=True),
    Case("breast_cancer", datasets.load_breast_cancer, "label", "classification", (32, 16), 0.001, 60, 32,
         (ACCURACY, Metric("ROC AUC", "roc_auc"))),
    Case("diabetes", datasets.load_diabetes, "target", "regression", (32,), 0.003, 100, 32,
         (Metric("R²", "r2"), Metric("RMSE", "rmse", higher_is_better=False))),
)
#: SimpleImputer's strategy for tensile's impute names.
SKLEARN_IMPUTE = {"mean": "mean", "median": "median", "mode": "most_frequent"}


@dataclass
class Results:
    """Per case and side ("tensile_db", "scikit-learn"): metric name -> one value per seed."""

    values: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)          # case table -> (train rows, test rows)
    split_checks: list = field(default_factory=list)  # (case table, seed, stored, recomputed, same)

    def add(self, table: str, side: str, name: str, value: float) -> None:
        self.values.setdefault((table, side, name), []).append(value)


def columns(engine, case: Case) -> tuple[list[str], list[str]]:
    """(numeric, text) feature columns of the case's table in table order: all but the label and
    NOT_FEATURES."""
    with engine.connect() as conn:
        found = conn.execute(text(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = :t ORDER BY ordinal_position"),
            {"t": case.table}).all()
    kept = [(c, t) for c, t in found if c not in NOT_FEATURES and c != case.label]
    return [c for c, t in kept if t != "text"], [c for c, t in kept if t == "text"]


def source(case: Case, seed: int) -> str:
    """The query both sides read: the table in the order that ``seed`` shuffles it."""
    return (f"SELECT * FROM {case.table} "
            f"ORDER BY pg_catalog.md5('{int(seed)}:' || id) COLLATE \"C\", id")


def train_tensile(client: TensileClient, case: Case, features: list[str], text_columns: list[str],
                  seed: int) -> tuple[str, dict, float]:
    """``CALL tensile.train_model`` on ``source(case, seed)``; returns (model name, metrics, wall s)."""
    name = f"{case.table}_{seed}"
    options = {"task": case.task, "epochs": case.epochs, "batch_size": case.batch_size, "optimizer": "adam",
               "lr": case.lr, "seed": seed, "test_size": TEST_SIZE, "test_sampling": "last",
               "impute": case.impute, "replace": True}
    if case.impute_text != case.impute:
        options["preprocess"] = {c: {"impute": case.impute_text} for c in text_columns}
    layers = [{"dense": units, "activation": "relu"} for units in case.hidden]
    started = time.perf_counter()
    result = client.train(name, source(case, seed), case.label, features=features + text_columns,
                          architecture={"layers": layers}, options=options)
    return name, result["metrics"], time.perf_counter() - started


def sklearn_model(case: Case, numeric: list[str], text_columns: list[str], seed: int):
    """scikit-learn's pipeline for ``case`` on an object array of the ``numeric`` columns, then
    the ``text_columns``: imputation, scaling / one-hot, the MLP."""
    from sklearn.compose import ColumnTransformer, TransformedTargetRegressor
    from sklearn.impute import SimpleImputer
    from sklearn.neural_network import MLPClassifier, MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    def imputer(rule: str) -> list:
        return [SimpleImputer(strategy=SKLEARN_IMPUTE[rule])] if rule != "error" else []

    numeric_at = list(range(len(numeric)))
    text_at = list(range(len(numeric), len(numeric) + len(text_columns)))
    parts = [("numeric", make_pipeline(*imputer(case.impute), StandardScaler()), numeric_at)]
    if text_columns:
        parts.append(("text", make_pipeline(*imputer(case.impute_text), OneHotEncoder(handle_unknown="ignore")),
                      text_at))
    mlp = (MLPClassifier if case.task == "classification" else MLPRegressor)(
        hidden_layer_sizes=case.hidden, activation="relu", solver="adam", alpha=0.0, batch_size=case.batch_size,
        learning_rate_init=case.lr, max_iter=case.epochs, n_iter_no_change=case.epochs, shuffle=True,
        random_state=seed)
    model = make_pipeline(ColumnTransformer(parts), mlp)
    if case.task == "regression":
        model = TransformedTargetRegressor(regressor=model, transformer=StandardScaler())
    return model


def read_rows(engine, query: str, names: list[str]) -> dict[str, np.ndarray]:
    """The columns ``names`` of ``query``'s rows, in its order: numbers as float64 (NULL: NaN),
    text as object arrays (NULL: NaN, as SimpleImputer expects)."""
    with engine.connect() as conn:
        rows = conn.execute(text(query)).mappings().all()
    out = {}
    for n in names:
        values = [r[n] for r in rows]
        if any(isinstance(v, str) for v in values):
            out[n] = np.array([np.nan if v is None else v for v in values], dtype=object)
        else:
            out[n] = np.array([np.nan if v is None else float(v) for v in values])
    return out


def train_sklearn(engine, case: Case, numeric: list[str], text_columns: list[str],
                  seed: int) -> tuple[dict, np.ndarray, float]:
    """The scikit-learn side on the same rows; returns (metric name -> value, held-out ids, fit wall s)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.metrics import accuracy_score, f1_score, mean_squared_error, r2_score, roc_auc_score

    data = read_rows(engine, source(case, seed), ["id", case.label, *numeric, *text_columns])
    n = len(data["id"])
    n_test = math.ceil(TEST_SIZE * n)
    x = np.empty((n, len(numeric) + len(text_columns)), dtype=object)
    for j, c in enumerate(numeric + text_columns):
        x[:, j] = data[c]
    x_train, x_test = x[:n - n_test], x[n - n_test:]
    y_train, y_test = data[case.label][:n - n_test], data[case.label][n - n_test:]
    model = sklearn_model(case, numeric, text_columns, seed)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)       # max_iter is the epoch count on purpose
        model.fit(x_train, y_train)
    fit_s = time.perf_counter() - started
    if case.task == "classification":
        predicted = model.predict(x_test)
        scores = {"accuracy": accuracy_score(y_test, predicted),
                  "f1_macro": f1_score(y_test, predicted, average="macro")}
        proba = model.predict_proba(x_test)
        scores["roc_auc"] = (roc_auc_score(y_test, proba[:, 1]) if proba.shape[1] == 2
                             else roc_auc_score(y_test, proba, multi_class="ovr"))
    else:
        predicted = model.predict(x_test)
        scores = {"r2": r2_score(y_test, predicted), "rmse": math.sqrt(mean_squared_error(y_test, predicted))}
    return scores, data["id"][n - n_test:].astype(int), fit_s


def recomputed(engine, case: Case, model: str, test_ids: np.ndarray) -> float:
    """The case's first metric of ``model`` recomputed from ``tensile.predict`` (``predict_label``
    for a text label) on the rows ``test_ids`` of its table."""
    from sklearn.metrics import accuracy_score, r2_score

    predict = "tensile.predict_label" if case.text_label else "tensile.predict"
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT {predict}(:m, to_jsonb(t)) AS p, t.{case.label} AS y FROM {case.table} t "
                                 "WHERE t.id = ANY(:ids)"), {"m": model, "ids": test_ids.tolist()}).all()
    predicted, truth = [r.p for r in rows], [r.y for r in rows]
    if case.task == "regression":
        return r2_score(truth, predicted)
    return accuracy_score([str(y) for y in truth], [str(p) if isinstance(p, str) else f"{p:g}" for p in predicted])


def report(results: Results, seeds: list[int], device: str) -> bool:
    rows = []
    for case in CASES:
        n_train, n_test = results.rows[case.table]
        named = [(m.name, m.key, m.higher_is_better, ".3f" if m.key != "rmse" else ".1f") for m in case.metrics]
        named.append(("train wall s", "wall_s", False, ".2f"))
        for i, (name, key, higher, fmt) in enumerate(named):
            ours = results.values[(case.table, "tensile_db", key)]
            theirs = results.values[(case.table, "scikit-learn", key)]
            rows.append([case.table if i == 0 else "", case.task if i == 0 else "",
                         f"{n_train} / {n_test}" if i == 0 else "", name, spread(ours, fmt), spread(theirs, fmt),
                         {"ours": "tensile_db better", "theirs": "scikit-learn better", None: "not decided"}[
                             better(ours, theirs, higher)]])
    print(tabulate(rows, headers=["data set", "task", "rows train / test", "metric (held out)",
                                  "tensile_db median [min, max]", "scikit-learn median [min, max]", "difference"],
                   tablefmt="github", disable_numparse=True))
    print()
    for case in CASES:
        print(f"- {case.table}: hidden layers {list(case.hidden)} ReLU, Adam lr {case.lr}, batch {case.batch_size}, "
              f"{case.epochs} epochs (scikit-learn max_iter {case.epochs}, alpha 0, no early stopping)"
              + (f"; missing values: numeric {case.impute}, text {case.impute_text}" if case.impute != "error" else ""))
    print("- train wall s: tensile_db's whole CALL (reading the rows, the coordinator, storing the model) "
          "against scikit-learn's fit of rows already in memory")
    same = all(ok for *_, ok in results.split_checks)
    bad = [c for c in results.split_checks if not c[-1]]
    print(f"\nSame held-out rows on both sides ({len(results.split_checks)} trainings): "
          + ("checked: every stored held-out metric equals the one recomputed from tensile.predict on the rows "
             "held out here" if same else f"FAILED for {bad}"))
    print(f"Seeds {seeds}; tensile_db on the coordinator's {device} device; measured on this machine: {cnn.machine()}.")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="seeds per data set (0, 1, ...)")
    args = parser.parse_args()
    started = time.perf_counter()
    seeds = list(range(args.seeds))
    results = Results()
    with scratch_cluster(DATABASE) as cluster:
        engine = create_engine(cluster.url(DATABASE))
        client = TensileClient(engine)
        features = {}
        for case in CASES:
            n = case.load(engine, case.table)
            n_test = math.ceil(TEST_SIZE * n)
            results.rows[case.table] = (n - n_test, n_test)
            features[case.table] = columns(engine, case)
        for seed in seeds:
            for case in CASES:
                numeric, text_columns = features[case.table]
                # Alternate which side runs first, so drift of the machine falls on both alike.
                sides = ("tensile_db", "scikit-learn") if seed % 2 == 0 else ("scikit-learn", "tensile_db")
                for side in sides:
                    if side == "tensile_db":
                        model, metrics, wall_s = train_tensile(client, case, numeric, text_columns, seed)
                        scores = dict(metrics, wall_s=wall_s)
                    else:
                        sklearn_scores, test_ids, fit_s = train_sklearn(engine, case, numeric, text_columns, seed)
                        scores = dict(sklearn_scores, wall_s=fit_s)
                    for key in [m.key for m in case.metrics] + ["wall_s"]:
                        results.add(case.table, side, key, scores[key])
                stored = metrics[case.metrics[0].key]
                again = recomputed(engine, case, model, test_ids)
                results.split_checks.append((case.table, seed, stored, again,
                                             metrics["test_samples"] == len(test_ids) and abs(stored - again) < 1e-6))
        device = client.memory()["device"]
        engine.dispose()
    print("# Held-out metrics: tensile_db (from SQL) beside scikit-learn's MLP on the same rows, "
          "measured on this machine\n")
    ok = report(results, seeds, device)
    print(f"\nBenchmark took {time.perf_counter() - started:.0f} s.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
