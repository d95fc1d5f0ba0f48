"""The backend's preparation of training rows, without PostgreSQL: the held-out split, the
preprocessing fitted on the training rows, and the limits checked before the inputs are built."""

from __future__ import annotations

import numpy as np
import pytest

from tensile_db.errors import InvalidArgument
from tensile_db.pg.data import TrainingData, encode_labels
from tensile_db.pg.prepare import prepare
from tensile_db.pg.train import _check_inputs
from tensile_db.runtime import model as models
from tensile_db.runtime.metrics import split_rows
from tensile_db.runtime.preprocess import Categories


def data(n=200, categories=3) -> TrainingData:
    rng = np.random.default_rng(0)
    city = Categories.of([f"c{i % categories}" for i in range(n)])
    size = rng.normal(size=n).astype(np.float32)
    size[::17] = np.nan                                   # missing, imputed
    y = Categories.of(["big" if s > 0 else "small" for s in np.nan_to_num(size)])
    return TrainingData({"city": city, "size": size}, {"city": "categorical", "size": "numeric"}, y,
                        ["city", "size"], "label", "categorical", False, n, 0)


def test_the_split_holds_out_rows_and_the_fit_sees_only_the_training_rows():
    opts = models.parse_options({"impute": "mean", "test_size": 0.25})
    p = prepare(data(), opts)
    assert p.task == "classification" and p.label_names == ["big", "small"] and p.classes == [0.0, 1.0]
    assert len(p.x) == 150 and len(p.x_test) == 50 and p.x.shape[1] == p.pre.width == 4
    assert not np.isnan(p.x).any() and not np.isnan(p.x_test).any()
    # stratified: both classes in proportion on each side
    assert abs(np.mean(p.y == 0) - np.mean(p.y_test == 0)) < 0.05
    d = data()
    y = np.unique(np.array(d.y.values)[d.y.codes], return_inverse=True)[1]
    train, test = split_rows(200, 0.25, "stratified", 0, y)
    size = next(c for c in p.pre.columns if c.name == "size")
    assert size.fill == pytest.approx(float(np.nanmean(d.raw["size"][train].astype(np.float64))))
    assert size.fill != pytest.approx(float(np.nanmean(d.raw["size"].astype(np.float64))))
    missing = np.isnan(d.raw["size"][test])
    assert missing.any() and np.all(p.x_test[missing, -1] == np.float32(size.fill))


def test_the_limits_are_checked_before_the_inputs_are_built():
    seen = []

    def check(task, n_outputs, pre, rows):
        seen.append((task, n_outputs, pre.width, rows))
        raise InvalidArgument("too wide")

    with pytest.raises(InvalidArgument, match="too wide"):
        prepare(data(categories=50), models.parse_options({"impute": "mean"}), check)
    assert seen == [("classification", 2, 51, 200)]


def test_encoded_inputs_beyond_max_job_bytes_are_refused_naming_the_widest_columns():
    p = prepare(data(categories=50), models.parse_options({"impute": "mean"}))
    arch = models.parse_architecture({"layers": [{"dense": 8}]})
    _check_inputs(arch, models.Limits(max_job_nbytes=1 << 20), "m", "classification", 2, p.pre, 5000)
    with pytest.raises(InvalidArgument) as info:
        _check_inputs(arch, models.Limits(max_job_nbytes=1 << 16), "m", "classification", 2, p.pre, 5000)
    assert str(info.value) == (
        "the encoded inputs of 5,000 rows by 51 inputs take 1,020,000 bytes, more than tensile.max_job_bytes "
        '(65,536); the widest columns: "city" (50), "size" (1): lower options.max_categories, encode them ordinal, '
        "or read fewer rows")
    with pytest.raises(InvalidArgument, match="parameters, more than tensile.max_parameters"):
        _check_inputs(arch, models.Limits(max_parameters=100), "m", "classification", 2, p.pre, 10)


def test_stratified_sampling_of_an_inferred_regression_is_refused_by_option_name():
    d = data()
    numeric = TrainingData(d.raw, d.kinds, np.linspace(0, 1, 200), d.feature_names, "price", "numeric", False, 200, 0)
    with pytest.raises(InvalidArgument) as info:
        prepare(numeric, models.parse_options({"impute": "mean", "test_sampling": "stratified"}))
    assert str(info.value) == ('options.test_sampling "stratified" needs classes, but label column "price" is a '
                               'regression target; use "random" or "last", or options.task "classification"')


@pytest.mark.parametrize("y", [
    np.array([3.0, 1.0, 3.0, -2.0, 1.0]),                     # integers close together: counted
    np.array([7, 7, 2, 9], dtype=np.int64),
    np.array([0.0, 1e9, 0.0]),                                # far apart: sorted
    np.array([2 ** 60 + 1, 2 ** 60, 2 ** 60 + 1], dtype=np.int64),   # beyond float64's integers: sorted
    np.array([-0.0, 1.0, 0.0]), np.array([True, False, True]), np.array([-3, 4], dtype=np.float32),
])
def test_numeric_class_labels_are_indexed_as_sorted_classes(y):
    d = data(len(y))
    labels = TrainingData(d.raw, d.kinds, y, d.feature_names, "label", "numeric", False, len(y), 0)
    index, classes, names = encode_labels(labels, "classification")
    want, want_index = np.unique(y, return_inverse=True)
    assert classes == [float(c) for c in want] and index.tolist() == want_index.tolist() and names is None


@pytest.mark.parametrize("y", [np.array([0.5, 1.0, 0.5]), np.array([np.nan, 1.0, 2.0]),
                               np.array([-5000, 1e-20, 0]), np.array([-1, 0.9999999999999999])])  # near integers
def test_numeric_class_labels_that_are_not_integers_are_refused(y):
    d = data(len(y))
    labels = TrainingData(d.raw, d.kinds, y, d.feature_names, "label", "numeric", False, len(y), 0)
    with pytest.raises(InvalidArgument, match="non-integer values"):
        encode_labels(labels, "classification")


def side_by_side_data(n=300, nan_at=None) -> TrainingData:
    """Three real columns as the scan writes them: strided views of one row-major block."""
    rng = np.random.default_rng(1)
    block = rng.normal(size=(n, 3)).astype(np.float32)
    if nan_at is not None:
        block[nan_at, 1] = np.nan
    y = Categories.of(["a" if v > 0 else "b" for v in block[:, 0]])
    raw = {name: block[:, j] for j, name in enumerate(("f0", "f1", "f2"))}
    return TrainingData(raw, dict.fromkeys(raw, "numeric"), y, list(raw), "label", "categorical", False, n, 0,
                        finite=frozenset(("f0", "f2")))


def test_rows_side_by_side_go_by_index_and_either_form_holds_the_split_rows():
    d = side_by_side_data()
    p = prepare(d, models.parse_options({"test_size": 0.2}))
    block = d.raw["f0"].base
    assert p.rows is not None and p.x.shape == (300, 3) and np.shares_memory(p.x, block)   # no copy made
    assert p.rows.dtype == p.test_rows.dtype == np.int32
    assert sorted(np.concatenate([p.rows, p.test_rows]).tolist()) == list(range(300))
    gathered = p.pre.transform(d.raw, p.rows.astype(np.int64), d.finite)
    by_index, copied = p.arrays(by_index=True), p.arrays(by_index=False)
    assert set(by_index) == {"x", "rows", "y", "test_rows", "y_test"} and by_index["x"] is p.x
    assert set(copied) == {"x", "y", "x_test", "y_test"}
    assert copied["x"].tobytes() == gathered.tobytes() == by_index["x"][by_index["rows"]].tobytes()
    assert copied["x_test"].tobytes() == p.x[p.test_rows].tobytes()
    assert len(p.y) == len(p.rows) and len(p.y_test) == len(p.test_rows)


def test_rows_that_need_a_transform_are_gathered_as_before():
    p = prepare(side_by_side_data(nan_at=5), models.parse_options({"test_size": 0.2, "impute": "mean"}))
    assert p.rows is None and p.x.shape == (240, 3) and not np.isnan(p.x).any()     # the gap imputed
    assert set(p.arrays(by_index=True)) == {"x", "y", "x_test", "y_test"}
