"""Check ``tensile_db.runtime.metrics`` against scikit-learn on seeded random data.

Every classification and regression metric is compared with scikit-learn's own function (the
reference, used only here) to 1e-9 relative for float64 inputs and 1e-6 for float32: binary,
3- and 5-class problems, a class never predicted, a class absent from ``y_true``, tied and
clipped probabilities, constant targets and perfect predictions. Splits are checked by their
rules (sorted, disjoint, covering, ``ceil(n * test_size)`` test rows, class proportions) rather
than by exact rows, and the errors by their messages.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sklearn import metrics as skm
from sklearn.model_selection import train_test_split

from tensile_db.errors import InvalidArgument
from tensile_db.runtime.metrics import (
    SCORE_NAMES,
    better_or_equal,
    classification_metrics,
    regression_metrics,
    split_rows,
)

RTOL = {np.float64: 1e-9, np.float32: 1e-6}
ATOL = 1e-12


def _probabilities(rng: np.random.Generator, n: int, n_classes: int, dtype=np.float64) -> np.ndarray:
    """(n, n_classes) rows from a Dirichlet, normalized in float64 and then cast to ``dtype``."""
    proba = rng.dirichlet(np.ones(n_classes), size=n)
    return (proba / proba.sum(axis=1, keepdims=True)).astype(dtype)


def _assert_plain_json(value) -> None:
    """Only Python floats, ints, strings, None, lists and dicts with string keys; no NaN."""
    if isinstance(value, dict):
        assert all(type(k) is str for k in value)
        for v in value.values():
            _assert_plain_json(v)
    elif isinstance(value, list):
        for v in value:
            _assert_plain_json(v)
    else:
        assert type(value) in (float, int, str, type(None)), (value, type(value))
    json.dumps(value, allow_nan=False)


def _assert_matches_sklearn(y_true: np.ndarray, proba: np.ndarray, classes: list) -> dict:
    """Compare every classification metric with scikit-learn's; return ours."""
    got = classification_metrics(y_true, proba, classes)
    _assert_plain_json(got)
    n_classes = len(classes)
    labels = list(range(n_classes))
    y_pred = proba.argmax(axis=1)
    close = dict(rel=RTOL[proba.dtype.type], abs=ATOL)
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(y_true, y_pred), **close)
    for average in ("macro", None):
        precision, recall, f1, support = skm.precision_recall_fscore_support(
            y_true, y_pred, labels=labels, average=average, zero_division=0)
        if average == "macro":
            assert got["precision_macro"] == pytest.approx(precision, **close)
            assert got["recall_macro"] == pytest.approx(recall, **close)
            assert got["f1_macro"] == pytest.approx(f1, **close)
        else:
            for c, label in enumerate(classes):
                row = got["per_class"][str(label)]
                assert row["precision"] == pytest.approx(precision[c], **close)
                assert row["recall"] == pytest.approx(recall[c], **close)
                assert row["f1"] == pytest.approx(f1[c], **close)
                assert row["support"] == support[c]
    assert got["log_loss"] == pytest.approx(skm.log_loss(y_true, proba, labels=labels), **close)
    assert got["confusion_matrix"] == skm.confusion_matrix(y_true, y_pred, labels=labels).tolist()
    if len(np.unique(y_true)) == n_classes:
        expected = (skm.roc_auc_score(y_true, proba[:, 1]) if n_classes == 2 else
                    skm.roc_auc_score(y_true, proba, multi_class="ovr", average="macro", labels=labels))
        assert got["roc_auc"] == pytest.approx(expected, **close)
    assert got["n"] == len(y_true)
    assert got["score_name"] == SCORE_NAMES["classification"] == "f1_macro"
    assert got["score"] == got["f1_macro"]
    return got


# --- classification ---------------------------------------------------------------------------

@pytest.mark.parametrize("n, n_classes, dtype", [
    (200, 2, np.float64), (300, 3, np.float64), (500, 5, np.float64),
    (200, 2, np.float32), (400, 5, np.float32)])
def test_classification_matches_sklearn(n, n_classes, dtype):
    rng = np.random.default_rng(n + n_classes)
    proba = _probabilities(rng, n, n_classes, dtype)
    # Labels correlated with the probabilities, so the scores are far from chance.
    y_true = np.where(rng.random(n) < 0.6, proba.argmax(axis=1), rng.integers(0, n_classes, n))
    got = _assert_matches_sklearn(y_true, proba, [f"class {c}" for c in range(n_classes)])
    assert 0.5 < got["roc_auc"] < 1


def test_binary_ties_and_clipped_probabilities():
    rng = np.random.default_rng(1)
    p1 = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=300)
    y_true = (rng.random(300) < p1 * 0.8 + 0.1).astype(np.int64)
    for dtype in (np.float64, np.float32):
        proba = np.stack([1 - p1, p1], axis=1).astype(dtype)
        got = _assert_matches_sklearn(y_true, proba, [0, 1])
        assert math.isfinite(got["log_loss"])


def test_multiclass_ties():
    rng = np.random.default_rng(2)
    prototypes = _probabilities(rng, 6, 4).round(1)  # few distinct rows: many tied scores per column
    prototypes /= prototypes.sum(axis=1, keepdims=True)
    rows = rng.integers(0, len(prototypes), 400)
    proba, y_true = prototypes[rows], rng.integers(0, 4, 400)
    assert len(np.unique(proba[:, 0])) <= 6
    _assert_matches_sklearn(y_true, proba, ["a", "b", "c", "d"])


def test_class_never_predicted():
    rng = np.random.default_rng(3)
    proba = _probabilities(rng, 300, 3)
    proba[:, 2] *= 0.01
    proba /= proba.sum(axis=1, keepdims=True)
    y_true = rng.integers(0, 3, 300)
    got = _assert_matches_sklearn(y_true, proba, [10, 20, 30])
    assert [row[2] for row in got["confusion_matrix"]] == [0, 0, 0]
    assert got["per_class"]["30"]["precision"] == 0.0
    assert got["per_class"]["30"]["support"] == int((y_true == 2).sum())


def test_class_absent_from_y_true_has_no_roc_auc():
    rng = np.random.default_rng(4)
    proba = _probabilities(rng, 200, 3)
    y_true = rng.integers(0, 2, 200)
    got = _assert_matches_sklearn(y_true, proba, ["x", "y", "z"])
    assert got["roc_auc"] is None
    assert got["per_class"]["z"] == {"precision": got["per_class"]["z"]["precision"],
                                     "recall": 0.0, "f1": 0.0, "support": 0}
    binary = classification_metrics(np.zeros(50, dtype=np.int64), _probabilities(rng, 50, 2), [0, 1])
    assert binary["roc_auc"] is None


def test_perfect_classification():
    rng = np.random.default_rng(5)
    y_true = np.concatenate([np.arange(5), rng.integers(0, 5, 95)])
    for dtype in (np.float64, np.float32):
        proba = np.eye(5, dtype=dtype)[y_true]
        got = _assert_matches_sklearn(y_true, proba, list(range(5)))
        assert got["accuracy"] == got["f1_macro"] == got["roc_auc"] == 1.0
        assert got["log_loss"] == pytest.approx(-math.log(1 - np.finfo(dtype).eps), rel=1e-6)
        assert np.array_equal(got["confusion_matrix"], np.diag(np.bincount(y_true)))


def test_classification_errors():
    proba = np.full((4, 2), 0.5)
    with pytest.raises(InvalidArgument, match=r"proba has shape \(4, 2\) and y_true \(3,\) for 2 classes"):
        classification_metrics(np.zeros(3, dtype=np.int64), proba, [0, 1])
    with pytest.raises(InvalidArgument, match=r"give y_true \(N,\) and proba \(N, 3\)"):
        classification_metrics(np.zeros(4, dtype=np.int64), proba, [0, 1, 2])
    with pytest.raises(InvalidArgument, match=r"outside the class indices 0\.\.1; encode the classes"):
        classification_metrics(np.array([0, 1, 2, 1]), proba, [0, 1])
    proba[1, 0] = np.nan
    with pytest.raises(InvalidArgument, match=r"proba \(float64\) is not all finite floats"):
        classification_metrics(np.zeros(4, dtype=np.int64), proba, [0, 1])


# --- regression -------------------------------------------------------------------------------

def _assert_regression_matches_sklearn(y_true: np.ndarray, y_pred: np.ndarray) -> dict:
    got = regression_metrics(y_true, y_pred)
    _assert_plain_json(got)
    close = dict(rel=1e-9, abs=ATOL)  # computed in float64 from the same values as sklearn's
    t, p = y_true.astype(np.float64), y_pred.astype(np.float64)
    assert got["r2"] == pytest.approx(skm.r2_score(t, p), **close)
    assert got["mae"] == pytest.approx(skm.mean_absolute_error(t, p), **close)
    assert got["mse"] == pytest.approx(skm.mean_squared_error(t, p), **close)
    assert got["rmse"] == pytest.approx(skm.root_mean_squared_error(t, p), **close)
    assert got["n"] == len(y_true)
    assert got["score_name"] == SCORE_NAMES["regression"] == "r2"
    assert got["score"] == got["r2"]
    return got


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_regression_matches_sklearn(dtype):
    rng = np.random.default_rng(6)
    y_true = rng.normal(3.0, 2.0, 500).astype(dtype)
    y_pred = (y_true + rng.normal(0.0, 1.0, 500)).astype(dtype)
    got = _assert_regression_matches_sklearn(y_true, y_pred)
    assert 0.5 < got["r2"] < 1


def test_regression_constant_target_and_perfect_predictions():
    y_const = np.full(20, 4.0)
    assert _assert_regression_matches_sklearn(y_const, y_const)["r2"] == 1.0
    assert _assert_regression_matches_sklearn(y_const, y_const + 0.5)["r2"] == 0.0
    y_true = np.random.default_rng(7).normal(size=50)
    got = _assert_regression_matches_sklearn(y_true, y_true.copy())
    assert (got["r2"], got["mae"], got["mse"], got["rmse"]) == (1.0, 0.0, 0.0, 0.0)
    worse = _assert_regression_matches_sklearn(y_true, np.full(50, y_true.mean() + 1))
    assert worse["r2"] < 0


def test_regression_single_row_and_errors():
    got = regression_metrics(np.array([1.0]), np.array([2.0]))
    assert got["r2"] is None and got["score"] is None and got["mae"] == 1.0
    _assert_plain_json(got)
    with pytest.raises(InvalidArgument, match=r"y_true has shape \(3,\) and y_pred \(2,\); give two"):
        regression_metrics(np.zeros(3), np.zeros(2))
    with pytest.raises(InvalidArgument, match=r"give two \(N,\) arrays with N >= 1"):
        regression_metrics(np.zeros(0), np.zeros(0))
    with pytest.raises(InvalidArgument, match="NaN or infinite"):
        regression_metrics(np.zeros(3), np.array([0.0, np.inf, 0.0]))


def test_better_or_equal():
    assert better_or_equal(0.5, None) and better_or_equal(None, None)
    assert not better_or_equal(None, 0.1)
    assert better_or_equal(0.5, 0.5) and better_or_equal(0.6, 0.5)
    assert not better_or_equal(0.4, 0.5)
    assert better_or_equal(-1.0, -2.0)


# --- split_rows -------------------------------------------------------------------------------

def _classes(n: int, seed: int = 0) -> np.ndarray:
    """Imbalanced classes 0..3 (about 50/30/15/5 %)."""
    return np.random.default_rng(seed).choice(4, size=n, p=[0.5, 0.3, 0.15, 0.05])


def _assert_partition(train: np.ndarray, test: np.ndarray, n: int, n_test: int) -> None:
    assert train.dtype == test.dtype == np.int64
    assert np.all(np.diff(train) > 0) and np.all(np.diff(test) > 0)
    assert len(test) == n_test
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(n))


@pytest.mark.parametrize("sampling", ["last", "random", "stratified"])
@pytest.mark.parametrize("n, test_size", [(10, 0.3), (101, 0.2), (57, 0.5), (1000, 0.01), (30, 0.9)])
def test_split_is_a_partition_with_sklearn_test_count(sampling, n, test_size):
    train, test = split_rows(n, test_size, sampling, seed=0, y=np.arange(n) % 2)
    _, sk_test = train_test_split(np.arange(n), test_size=test_size, random_state=0)
    _assert_partition(train, test, n, len(sk_test))
    assert len(test) == math.ceil(n * test_size)


@pytest.mark.parametrize("sampling", ["last", "random", "stratified"])
def test_split_test_size_zero_keeps_every_row(sampling):
    train, test = split_rows(30, 0.0, sampling, seed=3, y=_classes(30))
    _assert_partition(train, test, 30, 0)
    assert np.array_equal(train, np.arange(30))
    assert len(split_rows(30, 0.0, sampling, seed=3)[0]) == 30  # no y needed without test rows


def test_split_last_takes_the_last_rows():
    train, test = split_rows(20, 0.25, "last", seed=9)
    assert np.array_equal(test, np.arange(15, 20)) and np.array_equal(train, np.arange(15))


@pytest.mark.parametrize("sampling", ["random", "stratified"])
def test_split_is_seeded(sampling):
    y = _classes(200)
    first = split_rows(200, 0.3, sampling, seed=42, y=y)
    again = split_rows(200, 0.3, sampling, seed=42, y=y)
    other = split_rows(200, 0.3, sampling, seed=43, y=y)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[1], other[1])
    assert not np.array_equal(first[1], np.arange(140, 200))


@pytest.mark.parametrize("n, test_size, seed", [(200, 0.3, 0), (97, 0.25, 1), (1000, 0.1, 2), (40, 0.5, 3)])
def test_stratified_keeps_class_proportions(n, test_size, seed):
    y = _classes(n, seed)
    train, test = split_rows(n, test_size, "stratified", seed=seed, y=y)
    _assert_partition(train, test, n, math.ceil(n * test_size))
    counts = np.bincount(y, minlength=4)
    in_test = np.bincount(y[test], minlength=4)
    assert np.all(np.abs(in_test - len(test) * counts / n) < 1)


def test_stratified_allocates_by_largest_remainder():
    y = np.repeat([0, 1, 2], [2, 7, 11])  # 5 test rows: quotas 0.5, 1.75, 2.75 -> floors 0, 1, 2
    for seed in range(5):
        _, test = split_rows(20, 0.25, "stratified", seed=seed, y=y)
        assert np.bincount(y[test], minlength=3).tolist() == [0, 2, 3]


def test_stratified_single_row_class_stays_in_train_and_caps_hold():
    y = np.array([0] * 9 + [1] * 10 + [2])
    train, test = split_rows(20, 0.5, "stratified", seed=0, y=y)
    _assert_partition(train, test, 20, 10)
    assert 19 in train
    y = np.array([0] * 2 + [1] * 8)  # quotas 1.6 and 6.4; class 0 may give only 1 row
    train, test = split_rows(10, 0.8, "stratified", seed=0, y=y)
    _assert_partition(train, test, 10, 8)
    assert np.bincount(y[train]).tolist() == [1, 1]


def test_split_errors():
    with pytest.raises(InvalidArgument, match=r"test_size 0\.5 of 1 rows leaves 0 training and 1 test rows; "
                                              r"lower test_size, give more rows, or use test_size 0"):
        split_rows(1, 0.5, "random", seed=0)
    with pytest.raises(InvalidArgument, match=r"test_size 0\.2 of 0 rows leaves 0 training and 0 test rows"):
        split_rows(0, 0.2, "last", seed=0)
    with pytest.raises(InvalidArgument, match=r"test_size 0\.95 of 10 rows leaves 0 training and 10 test"):
        split_rows(10, 0.95, "last", seed=0)
    for bad in (1.0, -0.1):
        with pytest.raises(InvalidArgument, match=rf"test_size {bad} is outside \[0, 1\); give a fraction"):
            split_rows(10, bad, "random", seed=0)
    with pytest.raises(InvalidArgument, match="sampling 'bogus' is unknown; use one of last, random, stratified"):
        split_rows(10, 0.2, "bogus", seed=0)
    with pytest.raises(InvalidArgument, match="needs the class of every row; give y, or use sampling 'random'"):
        split_rows(10, 0.2, "stratified", seed=0)
    with pytest.raises(InvalidArgument, match=r"y has shape \(9,\) but there are 10 rows"):
        split_rows(10, 0.2, "stratified", seed=0, y=np.zeros(9, dtype=np.int64))
    with pytest.raises(InvalidArgument, match="4 rows over 2 classes keeps one training row per class, "
                                              "so it can hold at most 2 test rows, not 3; lower test_size"):
        split_rows(4, 0.75, "stratified", seed=0, y=np.array([0, 0, 1, 1]))


def test_class_text_is_exact():
    from tensile_db.runtime.metrics import class_text

    assert [class_text(v) for v in (3.0, 1234567.0, 1234568.0, -2.0, 0.5)] == ["3", "1234567", "1234568", "-2", "0.5"]
