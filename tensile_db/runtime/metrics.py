"""Held-out evaluation of a trained model: the train/test split of the rows and the metrics.

This module owns three things, in pure NumPy:

- :func:`split_rows`: which rows train and which rows test (``last``, ``random`` or
  ``stratified``), deterministic for a given seed.
- :func:`classification_metrics` and :func:`regression_metrics`: scores of predictions on the
  test rows, defined as scikit-learn 1.9 defines them (checked against it in
  ``tests/test_metrics.py``) and returned as plain JSON values: Python floats, ints, lists and
  dicts, never a NumPy type, never NaN (``None`` where a metric is undefined).
- :data:`SCORE_NAMES` and :func:`better_or_equal`: the one score per task that decides whether a
  model improved (higher is better for both tasks).
"""

from __future__ import annotations

import math

import numpy as np

from tensile_db.errors import InvalidArgument

SAMPLINGS = ("last", "random", "stratified")

#: The metric reported as ``score`` for each task; higher is better for both.
SCORE_NAMES = {"classification": "f1_macro", "regression": "r2"}


def class_text(value: float) -> str:
    """A numeric class label as text, exactly: ``3`` for 3.0, ``1234567`` for 1234567.0 (labels
    are integers, but read as double precision)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def better_or_equal(new_score: float | None, old_score: float | None) -> bool:
    """Whether ``new_score`` is at least as good as ``old_score``: a missing old score loses to
    anything, a missing new score never beats a present old one."""
    return True if old_score is None else False if new_score is None else new_score >= old_score


def split_rows(n: int, test_size: float, sampling: str, seed: int,
               y: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split rows ``0..n-1`` into training and test rows.

    The test part has ``ceil(n * test_size)`` rows (as scikit-learn's ``train_test_split`` counts
    a float ``test_size``); ``test_size`` 0 puts every row in training.

    - ``last``: the last rows in source order are the test rows.
    - ``random``: the test rows are drawn without replacement by
      ``np.random.default_rng(seed)`` (``Generator.choice``: as many draws as test rows, where a
      whole permutation of a million rows took 0.04 s here).
    - ``stratified``: each class's share of the test rows follows its frequency in ``y``, the
      shares summing to exactly the test size by largest remainder (ties to the lower class).
      Every class keeps at least one training row, so a class with a single row stays in
      training. Rows within a class are drawn by ``np.random.default_rng(seed)``. ``y`` may be
      omitted when ``test_size`` is 0.

    Args:
        n: number of rows.
        test_size: fraction of the rows held out, in ``[0, 1)``.
        sampling: ``"last"``, ``"random"`` or ``"stratified"``.
        seed: seed of the random generator (unused by ``last``).
        y: ``(n,)`` integer class of each row; required by ``stratified`` only.

    Returns:
        ``(train_index, test_index)``: int64 row positions, each sorted ascending, disjoint,
        together covering ``0..n-1``.

    Raises:
        InvalidArgument: ``test_size`` outside ``[0, 1)``; an unknown ``sampling``; a non-zero
        ``test_size`` that leaves no training or no test row; ``stratified`` without ``y``, with
        ``y`` not of shape ``(n,)``, or with more test rows than the classes can spare.
    """
    if not 0 <= test_size < 1:
        raise InvalidArgument(
            f"test_size {test_size!r} is outside [0, 1); give a fraction such as 0.2, or 0 for no test rows")
    if sampling not in SAMPLINGS:
        raise InvalidArgument(f"sampling {sampling!r} is unknown; use one of {', '.join(SAMPLINGS)}")
    n_test = math.ceil(test_size * n)
    if test_size > 0 and (n_test == 0 or n_test == n):
        raise InvalidArgument(
            f"test_size {test_size} of {n} rows leaves {n - n_test} training and {n_test} test rows; "
            f"lower test_size, give more rows, or use test_size 0")
    rng = np.random.default_rng(seed)
    if n_test == 0:
        test = np.zeros(0, dtype=np.int64)
    elif sampling == "last":
        test = np.arange(n - n_test, n)
    elif sampling == "random":
        test = rng.choice(n, n_test, replace=False)
    else:
        test = _stratified_test_rows(n, n_test, y, rng)
    is_test = np.zeros(n, dtype=bool)
    is_test[test] = True
    return np.flatnonzero(~is_test).astype(np.int64), np.flatnonzero(is_test).astype(np.int64)


def _stratified_test_rows(n: int, n_test: int, y: np.ndarray | None,
                          rng: np.random.Generator) -> np.ndarray:
    """Test rows of a stratified split: per-class counts by largest remainder under a cap of
    ``count - 1`` per class, then rows drawn within each class by ``rng``."""
    if y is None:
        raise InvalidArgument(
            "sampling 'stratified' needs the class of every row; give y, or use sampling 'random'")
    y = np.asarray(y)
    if y.shape != (n,):
        raise InvalidArgument(f"y has shape {y.shape} but there are {n} rows; give one class per row")
    row_class, counts = _classes_of(y)
    cap = counts - 1
    if n_test > cap.sum():
        raise InvalidArgument(
            f"a stratified split of {n} rows over {len(counts)} classes keeps one training row per "
            f"class, so it can hold at most {cap.sum()} test rows, not {n_test}; lower test_size")
    share = n_test * counts  # exact: class c's quota is share[c] / n
    take = np.minimum(share // n, cap)
    order = np.argsort(-(share % n), kind="stable")
    remaining = n_test - take.sum()
    while remaining:
        for c in order:
            if remaining and take[c] < cap[c]:
                take[c] += 1
                remaining -= 1
    rows = [rng.choice(np.flatnonzero(row_class == c), k, replace=False) for c, k in enumerate(take)]
    return np.concatenate(rows).astype(np.int64)


def _classes_of(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What ``np.unique(y, return_inverse=True, return_counts=True)`` gives besides the values:
    each row's index among the sorted distinct values, and each value's rows. Class indices (non-
    negative integers, as training sends them) are counted instead of sorted (a million labels:
    about 5 ms against 40)."""
    if y.dtype.kind in "iu" and len(y) and 0 <= y.min() and y.max() < len(y):
        counts = np.bincount(y)
        present = counts > 0
        return (np.cumsum(present) - 1)[y], counts[present]
    _, row_class, counts = np.unique(y, return_inverse=True, return_counts=True)
    return row_class, counts


def classification_metrics(y_true: np.ndarray, proba: np.ndarray, classes: list) -> dict:
    """Scores of class probabilities against the true classes, as scikit-learn 1.9 computes them.

    The predicted class of a row is the argmax of its probabilities (the lower class on a tie).
    Precision, recall and F1 are averaged over all C classes, present or not, with 0 where a
    ratio is undefined (scikit-learn's ``zero_division=0``). ``roc_auc`` is the area under the ROC
    curve with tied scores counted as halves (average ranks, equal to scikit-learn's trapezoids):
    of column 1 when C == 2, else the macro average of one-vs-rest areas; it is ``None`` when
    ``y_true`` lacks any of the C classes (no area is defined for a class with no positives).
    ``log_loss`` is the mean of ``-log p[true class]`` with p clipped to ``[eps, 1 - eps]``,
    ``eps = np.finfo(proba.dtype).eps``; rows are not renormalized (scikit-learn 1.9 does not).

    Args:
        y_true: ``(N,)`` integer class indices in ``0..C-1``, N >= 1.
        proba: ``(N, C)`` float32 or float64 class probabilities, rows summing to about 1.
        classes: the C class labels (numbers or strings), for naming ``per_class``.

    Returns:
        ``accuracy``, ``precision_macro``, ``recall_macro``, ``f1_macro``, ``roc_auc``
        (float or None), ``log_loss``, ``confusion_matrix`` (C x C ints, rows the true class,
        columns the predicted class), ``per_class`` (``{str(label): {"precision", "recall", "f1",
        "support"}}``), ``n`` (rows), ``score_name`` (``"f1_macro"``) and ``score``.

    Raises:
        InvalidArgument: mismatched shapes, no rows, a class index outside ``0..C-1``, or
        non-finite probabilities.
    """
    y_true, proba = np.asarray(y_true), np.asarray(proba)
    n_classes = len(classes)
    if y_true.ndim != 1 or proba.shape != (len(y_true), n_classes) or len(y_true) == 0:
        raise InvalidArgument(
            f"proba has shape {proba.shape} and y_true {y_true.shape} for {n_classes} classes; "
            f"give y_true (N,) and proba (N, {n_classes}) with N >= 1")
    if not np.issubdtype(y_true.dtype, np.integer) or y_true.min() < 0 or y_true.max() >= n_classes:
        raise InvalidArgument(
            f"y_true holds values outside the class indices 0..{n_classes - 1}; encode the classes first")
    if not np.issubdtype(proba.dtype, np.floating) or not np.isfinite(proba).all():
        raise InvalidArgument(
            f"proba ({proba.dtype}) is not all finite floats; check the model's outputs")
    confusion = np.bincount(y_true.astype(np.int64) * n_classes + proba.argmax(axis=1),
                            minlength=n_classes * n_classes).reshape(n_classes, n_classes)
    tp, support, predicted = np.diag(confusion), confusion.sum(axis=1), confusion.sum(axis=0)
    precision, recall = _ratio(tp, predicted), _ratio(tp, support)
    f1 = _ratio(2 * tp, predicted + support)
    eps = np.finfo(proba.dtype).eps
    p_true = np.clip(proba[np.arange(len(y_true)), y_true], eps, 1 - eps).astype(np.float64)
    f1_macro = float(f1.mean())
    return {
        "accuracy": float(tp.sum() / len(y_true)),
        "precision_macro": float(precision.mean()),
        "recall_macro": float(recall.mean()),
        "f1_macro": f1_macro,
        "roc_auc": _roc_auc(y_true, proba, n_classes),
        "log_loss": float(-np.log(p_true).mean()),
        "confusion_matrix": confusion.tolist(),
        "per_class": {str(label): {"precision": float(precision[c]), "recall": float(recall[c]),
                                   "f1": float(f1[c]), "support": int(support[c])}
                      for c, label in enumerate(classes)},
        "n": len(y_true),
        "score_name": SCORE_NAMES["classification"],
        "score": f1_macro,
    }


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """``numerator / denominator`` elementwise, float64, 0 where the denominator is 0."""
    return np.divide(numerator, denominator, out=np.zeros(len(numerator)), where=denominator > 0)


def _roc_auc(y_true: np.ndarray, proba: np.ndarray, n_classes: int) -> float | None:
    """Binary or macro one-vs-rest ROC AUC; None unless every class occurs in ``y_true``."""
    if np.bincount(y_true, minlength=n_classes).min() == 0 or n_classes < 2:
        return None
    if n_classes == 2:
        return _binary_auc(y_true == 1, proba[:, 1])
    return float(np.mean([_binary_auc(y_true == c, proba[:, c]) for c in range(n_classes)]))


def _binary_auc(positive: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve by the Mann-Whitney statistic: the probability that a positive
    scores above a negative, ties counting one half (average ranks of tied scores)."""
    _, group, counts = np.unique(score, return_inverse=True, return_counts=True)
    rank = (np.cumsum(counts) - (counts - 1) / 2)[group]  # 1-based average rank
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    return float((rank[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def regression_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict:
    """Scores of predicted values against true values, computed in float64 as scikit-learn does.

    ``r2`` is ``1 - SSE / SST``; when ``y_true`` is constant (SST == 0) it is 1.0 for perfect
    predictions and 0.0 otherwise (scikit-learn's ``force_finite=True``), and it is ``None`` for
    a single row (scikit-learn returns NaN).

    Args:
        y_true: ``(N,)`` true values, any real dtype, N >= 1.
        y_pred: ``(N,)`` predicted values, any real dtype.

    Returns:
        ``r2`` (float or None), ``mae``, ``mse``, ``rmse`` (in the target's units, squared for
        ``mse``), ``n`` (rows), ``score_name`` (``"r2"``) and ``score``.

    Raises:
        InvalidArgument: mismatched shapes, no rows, or non-finite values.
    """
    y_true, y_pred = np.asarray(y_true, dtype=np.float64), np.asarray(y_pred, dtype=np.float64)
    if y_true.ndim != 1 or y_true.shape != y_pred.shape or len(y_true) == 0:
        raise InvalidArgument(
            f"y_true has shape {y_true.shape} and y_pred {y_pred.shape}; give two (N,) arrays with N >= 1")
    if not (np.isfinite(y_true).all() and np.isfinite(y_pred).all()):
        raise InvalidArgument(
            "y_true or y_pred holds NaN or infinite values; check the data and the model's outputs")
    error = y_true - y_pred
    sse, sst = float(np.sum(error ** 2)), float(np.sum((y_true - y_true.mean()) ** 2))
    r2 = None if len(y_true) < 2 else 1.0 if sse == 0 else 0.0 if sst == 0 else 1 - sse / sst
    mse = sse / len(y_true)
    return {"r2": r2, "mae": float(np.abs(error).mean()), "mse": mse, "rmse": math.sqrt(mse),
            "n": len(y_true), "score_name": SCORE_NAMES["regression"], "score": r2}
