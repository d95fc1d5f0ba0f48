"""``tensile_db.runtime.preprocess``: raw feature columns to network inputs, fitted on the
training rows only.

Every encoding (one-hot with and without its "other" input, ordinal in sorted and in a given
order), every imputation (and the rules a column refuses), the unseen-category rule, the
per-column overrides, the scale modes and :func:`fit_scaling` are checked against values worked
by hand; the JSON record must give back the same transform; a model stored without a record
reads its features as numeric (or as one array column). Errors are checked by their messages:
they reach SQL as they are.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tensile_db.errors import InvalidArgument
from tensile_db.runtime import model as models
from tensile_db.runtime import preprocess
from tensile_db.runtime.model import parse_options
from tensile_db.runtime.preprocess import Preprocessor, fit, fit_scaling


def num(*values) -> np.ndarray:
    """A numeric raw column: float32, None as NaN."""
    return np.array([np.nan if v is None else v for v in values], np.float32)


def cat(*values) -> np.ndarray:
    """A categorical raw column: object array of str or None."""
    out = np.empty(len(values), object)
    out[:] = values
    return out


def fitted(raw: dict, train=None, array_width=None, **options) -> Preprocessor:
    """Fit ``raw`` (kinds from the dtypes: float numeric, object categorical, 2-D array) on the
    rows ``train`` (all by default) under ``options``."""
    kinds = {name: "array" if v.ndim == 2 else "numeric" if v.dtype.kind == "f" else "categorical"
             for name, v in raw.items()}
    n = len(next(iter(raw.values())))
    index = np.arange(n) if train is None else np.asarray(train)
    return fit(raw, kinds, index, parse_options(options), array_width)


# --- encodings ----------------------------------------------------------------------------------


def test_one_hot_keeps_the_most_frequent_with_an_other_input():
    # counts: a 2, b 2, c 1, d 1 -> the two kept are a and b (tie by value), the rest are other
    pre = fitted({"c": cat("b", "a", "c", "a", "b", "d")}, max_categories=2)
    col = pre.columns[0]
    assert (col.encode, col.categories, col.other, col.width) == ("one_hot", ["a", "b"], True, 3)
    assert pre.input_names() == ["c=a", "c=b", "c=(other)"]
    got = pre.transform({"c": cat("b", "c", "a", "d")})
    assert got.dtype == np.float32
    assert got.tolist() == [[0, 1, 0], [0, 0, 1], [1, 0, 0], [0, 0, 1]]


def test_one_hot_orders_by_frequency_then_value_and_has_no_other_when_all_fit():
    pre = fitted({"c": cat("z", "m", "z", "a", "m", "z")}, max_categories=3)
    col = pre.columns[0]
    assert (col.categories, col.other, col.width) == (["z", "m", "a"], False, 3)     # counts 3, 2, 1
    assert pre.transform({"c": cat("a", "m", "z")}).tolist() == [[0, 0, 1], [0, 1, 0], [1, 0, 0]]
    # ties by value: every count is 1, so the kept ones are the smallest values
    tied = fitted({"c": cat("d", "b", "c", "a")}, max_categories=2).columns[0]
    assert (tied.categories, tied.other) == (["a", "b"], True)


def test_ordinal_in_sorted_order_and_in_a_given_order():
    raw = {"size": cat("mid", "low", "high", "low")}
    sorted_ = fitted(raw, encode="ordinal")
    assert sorted_.columns[0].categories == ["high", "low", "mid"] and sorted_.width == 1
    assert sorted_.transform({"size": cat("low", "high", "mid")})[:, 0].tolist() == [2, 1, 3]
    given = fitted(raw, preprocess={"size": {"encode": {"ordinal": ["low", "mid", "high"]}}})
    assert given.columns[0].categories == ["low", "mid", "high"] and given.input_names() == ["size"]
    assert given.transform({"size": cat("low", "high", "mid")})[:, 0].tolist() == [1, 3, 2]


def test_ordinal_beyond_max_categories_maps_the_rest_to_zero():
    pre = fitted({"c": cat("b", "b", "a", "a", "c")}, encode="ordinal", max_categories=2)
    assert (pre.columns[0].categories, pre.columns[0].other) == (["a", "b"], True)
    assert pre.transform({"c": cat("a", "b", "c")})[:, 0].tolist() == [1, 2, 0]


# --- imputation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("impute, fill", [
    ("mean", 3.0),                  # (1 + 2 + 6) / 3
    ("median", 2.0),
    ({"constant": -1.5}, -1.5),
    ({"constant": 7}, 7.0),
])
def test_numeric_imputation(impute, fill):
    pre = fitted({"n": num(1, 2, None, 6)}, impute=impute)
    assert pre.columns[0].fill == fill and pre.nullable("n")
    assert pre.transform({"n": num(None, 4)})[:, 0].tolist() == [fill, 4.0]


def test_mode_ties_go_to_the_smallest_value():
    numeric = fitted({"n": num(3, 1, 3, 1, None, 5)}, impute="mode")
    assert numeric.columns[0].fill == 1.0
    text = fitted({"c": cat("b", "a", None, "b", "a")}, impute="mode")
    assert text.columns[0].fill == "a"
    assert text.transform({"c": cat(None, "b")}).tolist() == [[1, 0], [0, 1]]


def test_string_constant_fills_a_categorical_column_as_its_own_category():
    pre = fitted({"c": cat("a", None, "b", None)}, impute={"constant": "missing"}, unseen="error")
    assert pre.columns[0].fill == "missing"
    assert pre.input_names() == ["c=missing", "c=a", "c=b"]      # two rows are "missing" once filled
    assert pre.transform({"c": cat(None, "a", "b")}).tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]


@pytest.mark.parametrize("impute, message", [
    ("mean", 'column "c" is categorical: impute mean needs numbers; use "mode" or {"constant": "..."}'),
    ("median", 'column "c" is categorical: impute median needs numbers; use "mode" or {"constant": "..."}'),
    ({"constant": 0}, 'column "c" is categorical; its impute constant must be a string, got 0'),
])
def test_a_categorical_column_refuses_numeric_imputation(impute, message):
    with pytest.raises(InvalidArgument) as info:
        fitted({"c": cat("a", None)}, preprocess={"c": {"impute": impute}})
    assert str(info.value) == message


def test_a_numeric_column_refuses_a_string_constant_and_an_encoding():
    with pytest.raises(InvalidArgument) as info:
        fitted({"n": num(1, None)}, impute={"constant": "zero"})
    assert str(info.value) == 'column "n" is numeric; its impute constant must be a number, got "zero"'
    with pytest.raises(InvalidArgument, match=r'options\.preprocess\."n"\.encode: column "n" is numeric'):
        fitted({"n": num(1, 2)}, preprocess={"n": {"encode": "ordinal"}})


def test_nothing_to_impute_from_is_refused_by_name():
    with pytest.raises(InvalidArgument, match='column "n" has no value in the training rows to impute its mean'):
        fitted({"n": num(None, None, 3)}, train=[0, 1], impute="mean")
    with pytest.raises(InvalidArgument, match='column "c" has no value in the training rows to impute its mode'):
        fitted({"c": cat(None, "x")}, train=[0], impute="mode")


def test_fit_reads_only_the_training_rows():
    # row 3 is held out: its 100 and its "z"s would change the mean, the mode and the categories
    raw = {"n": num(1, 2, None, 100), "c": cat("a", "b", "a", "z"), "m": cat("q", None, "q", "z")}
    rules = {"n": {"impute": "mean"}, "m": {"impute": "mode"}}
    pre = fitted(raw, train=[0, 1, 2], preprocess=rules, max_categories=1)
    n, c, m = pre.columns
    assert n.fill == 1.5
    assert (c.categories, c.other) == (["a"], True)
    assert (m.fill, m.categories, m.other) == ("q", ["q"], False)
    everything = fitted(raw, preprocess=rules, max_categories=1)
    assert everything.columns[0].fill == pytest.approx(103 / 3)    # the same fit on every row differs


# --- unseen categories and missing values -------------------------------------------------------


def test_unseen_categories_under_the_other_rule():
    train = {"c": cat("a", "b", "a")}
    unseen = {"c": cat("new", "a")}
    assert fitted(train, max_categories=1).transform(unseen).tolist() == [[0, 1], [1, 0]]    # other input
    assert fitted(train).transform(unseen).tolist() == [[0, 0], [1, 0]]                     # no input set
    assert fitted(train, encode="ordinal").transform(unseen)[:, 0].tolist() == [0, 1]       # 0


@pytest.mark.parametrize("encode", ["one_hot", "ordinal"])
def test_unseen_error_names_the_column_the_value_and_the_count(encode):
    pre = fitted({"colour": cat("red", "blue")}, encode=encode, unseen="error")
    with pytest.raises(InvalidArgument) as info:
        pre.transform({"colour": cat("red", "mauve", "teal", "blue")})
    assert str(info.value).startswith('column "colour" has 2 values never seen in training (the first: "mauve"); ')
    assert pre.transform({"colour": cat("blue")}).shape == (1, 1 if encode == "ordinal" else 2)


def test_unseen_error_refuses_nothing_in_a_column_with_an_other_category():
    pre = fitted({"c": cat("a", "a", "b")}, max_categories=1, unseen="error")
    assert pre.transform({"c": cat("b", "never")}).tolist() == [[0, 1], [0, 1]]


def test_a_null_that_is_not_imputed_is_refused_with_the_count():
    pre = fitted({"n": num(1, 2), "c": cat("a", "b")})
    assert not pre.nullable("n") and not pre.nullable("c")
    with pytest.raises(InvalidArgument) as info:
        pre.transform({"n": num(None, 1, None), "c": cat("a", "a", "a")})
    assert str(info.value) == ('column "n" has 2 missing values (NULL or NaN, of 3 rows) and the model does not '
                               "impute it; filter them (predict_batch: options.skip_nulls), or train with an impute "
                               "rule for the column")
    with pytest.raises(InvalidArgument, match=r'^column "c" has 1 missing value \(NULL or NaN, of 2 rows\)'):
        pre.transform({"n": num(1, 1), "c": cat("a", None)})


def test_the_inputs_of_some_rows_are_those_of_the_rows_indexed_first(monkeypatch):
    monkeypatch.setattr(preprocess, "TRANSFORM_BLOCK_ROWS", 4)          # several blocks
    rng = np.random.default_rng(0)
    raw = {"full": rng.normal(size=11).astype(np.float32), "gaps": num(*([1, None, 3] * 3 + [4, 5])),
           "c": cat(*(["a", "b", None] * 3 + ["a", "c"])), "v": rng.normal(size=(11, 2)).astype(np.float32)}
    pre = fitted(raw, array_width=2, preprocess={"gaps": {"impute": "mean"}, "c": {"impute": "mode"}})
    rows = np.array([10, 0, 3, 3, 7, 2, 9, 1, 5])
    want = pre.transform({name: v[rows] for name, v in raw.items()})
    assert np.array_equal(pre.transform(raw, rows), want) and want.shape == (9, pre.width)
    assert np.array_equal(pre.transform(dict(raw, c=list(raw["c"])), rows), want)     # a list of str or None too
    # the checks count the rows chosen only
    strict = fitted(raw, array_width=2, preprocess={"gaps": {"impute": "mean"}})
    with pytest.raises(InvalidArgument, match=r'^column "c" has 2 missing values \(NULL or NaN, of 9 rows\)'):
        strict.transform(raw, rows)


# --- per-column rules and scaling ---------------------------------------------------------------


def test_per_column_rules_override_the_defaults():
    raw = {"a": num(1, None, 3), "b": num(1, 2, None)}
    pre = fitted(raw, impute={"constant": 0}, preprocess={"a": {"impute": "mean", "scale": "minmax"}})
    assert [(c.impute, c.fill, c.scale) for c in pre.columns] == [("mean", 2.0, "minmax"),
                                                                    ("constant", 0.0, "standardize")]
    assert pre.transform(raw).tolist() == [[1, 1], [2, 2], [3, 0]]
    only_a = fitted({"a": num(1, None), "b": num(1, 2)}, preprocess={"a": {"impute": "median"}})
    with pytest.raises(InvalidArgument, match='column "b" has 1 missing value'):
        only_a.transform({"a": num(None, 1), "b": num(None, 1)})


def test_a_rule_for_a_column_that_is_not_a_feature_is_refused():
    with pytest.raises(InvalidArgument) as info:
        fitted({"a": num(1, 2), "b": cat("x", "y")}, preprocess={"zz": {"impute": "mean"}})
    assert str(info.value) == 'options.preprocess names "zz", which is not a feature column; the feature columns are: a, b'


def test_scale_modes_per_input_and_one_hot_never_scaled():
    raw = {"n": num(1, 2), "c": cat("x", "y"), "o": cat("p", "q"), "img": np.zeros((2, 3), np.float32)}
    rules = {"o": {"encode": "ordinal"}, "c": {"scale": "minmax"}}
    assert fitted(raw, array_width=3, preprocess=rules).scale_modes() == \
        ["standardize", "none", "none", "standardize"] + ["standardize"] * 3
    assert fitted(raw, array_width=3, preprocess=rules, scale="minmax").scale_modes() == \
        ["minmax", "none", "none", "minmax"] + ["minmax"] * 3
    assert fitted(raw, array_width=3, preprocess=rules, standardize=False).scale_modes() == ["none"] * 7
    assert fitted(raw, array_width=3, preprocess={"n": {"scale": "none"}}, scale="minmax").scale_modes() == \
        ["none", "none", "none", "none", "none"] + ["minmax"] * 3


def test_fit_scaling_against_hand_computed_values():
    x = np.array([[1, 5, 2, 7, 4],
                  [3, 5, 4, 7, 4],
                  [5, 5, 9, 7, 4]], np.float32)
    center, spread = fit_scaling(x, ["standardize", "standardize", "minmax", "none", "minmax"])
    assert center.dtype == spread.dtype == np.float32 and center.shape == spread.shape == (5,)
    # column 0: mean 3, population std sqrt(8/3); 1: constant, spread 1; 2: min 2, range 7;
    # 3: not scaled; 4: constant under minmax, spread 1
    np.testing.assert_allclose(center, [3, 5, 2, 0, 4], rtol=1e-7)
    np.testing.assert_allclose(spread, [np.sqrt(8 / 3), 1, 7, 1, 1], rtol=1e-7)
    scaled = (x - center) / spread
    np.testing.assert_allclose(scaled[:, 2], [0, 2 / 7, 1], rtol=1e-6)
    np.testing.assert_allclose(scaled[:, 0].std(), 1, rtol=1e-6)


# --- the stored record --------------------------------------------------------------------------


def test_json_round_trip_gives_the_same_transform():
    raw = {"n": num(1, None, 3, 4), "c": cat("a", "b", None, "c"), "o": cat("lo", "hi", "lo", "mid"),
           "img": np.arange(8, dtype=np.float32).reshape(4, 2)}
    pre = fitted(raw, array_width=2, impute="mode", max_categories=2, unseen="error",
                 preprocess={"o": {"encode": {"ordinal": ["lo", "mid", "hi"]}}, "n": {"impute": "median"}})
    record = json.loads(json.dumps(pre.to_json()))
    again = Preprocessor.from_json(record, ["n", "c", "o", "img"], pre.width)
    assert again == pre
    probe = {"n": num(None, 2, 9, 1), "c": cat("zz", None, "a", "b"), "o": cat("hi", "mid", "lo", "lo"),
             "img": np.ones((4, 2), np.float32)}
    assert np.array_equal(again.transform(probe), pre.transform(probe))
    assert again.transform(probe).shape == (4, 1 + 3 + 1 + 2)
    via_row = models.preprocessor_of_row(json.dumps(pre.to_json()), ["n", "c", "o", "img"], {"layers": [{"dense": 4}]})
    assert np.array_equal(via_row.transform(probe), pre.transform(probe))


def test_a_record_that_does_not_fit_is_refused():
    record = fitted({"a": num(1, 2)}).to_json()
    with pytest.raises(InvalidArgument, match="does not match its feature columns; train it again"):
        Preprocessor.from_json(record, ["b"], 1)
    with pytest.raises(InvalidArgument, match="malformed"):
        Preprocessor.from_json({"columns": [{"kind": "numeric"}]}, ["a"], 1)


def test_a_model_without_a_record_reads_numeric_features():
    pre = models.preprocessor_of_row(None, ["a", "b"], {"layers": [{"dense": 4}]})
    assert pre == Preprocessor.numeric_only(["a", "b"], 2)
    assert [(c.kind, c.fill, c.scale) for c in pre.columns] == [("numeric", None, "standardize")] * 2
    assert pre.transform({"a": num(1, 2), "b": num(3, 4)}).tolist() == [[1, 3], [2, 4]]
    with pytest.raises(InvalidArgument, match='column "b" has 1 missing value'):
        pre.transform({"a": num(1, 2), "b": num(3, None)})


def test_a_model_without_a_record_reads_one_array_column():
    arch = json.dumps({"layers": [{"dense": 4}], "input": {"shape": [1, 2, 3]}})
    pre = models.preprocessor_of_row(None, ["pixels"], arch)
    assert [(c.kind, c.width) for c in pre.columns] == [("array", 6)] and pre.width == 6
    assert pre.scale_modes() == ["standardize"] * 6
    assert pre.input_names()[0] == "pixels[1]" and pre.input_names()[-1] == "pixels[6]"
    image = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert np.array_equal(pre.transform({"pixels": image}), image)
    one = models.preprocessor_of_row(None, ["v"], {"layers": [{"dense": 4}]})
    assert [(c.kind, c.width) for c in one.columns] == [("numeric", 1)]


# --- option validation --------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"impute": "sum"}, 'options.impute must be one of error, mean, median, mode or {"constant": value} '
                        '(a finite number or a string), got "sum"'),
    ({"impute": {"constant": None}}, 'options.impute must be one of error, mean, median, mode or '
                                     '{"constant": value} (a finite number or a string), got {"constant": null}'),
    ({"unseen": "skip"}, 'options.unseen must be one of other, error, got "skip"'),
    ({"scale": "log"}, 'options.scale must be one of standardize, minmax, none, got "log"'),
    ({"encode": "binary"}, 'options.encode must be one of one_hot, ordinal or {"ordinal": [distinct strings, in '
                           'order]}, got "binary"'),
    ({"preprocess": {"a": {"impute": "mean", "fill": 0}}},
     "options.preprocess.\"a\": unknown key 'fill'; allowed keys: impute, encode, scale"),
    ({"preprocess": {"a": "mean"}}, 'options.preprocess."a" must be an object such as {"impute": "mean", '
                                    '"scale": "minmax"}, got "mean"'),
    ({"preprocess": {"a": {"encode": {"ordinal": ["x", "x"]}}}},
     'options.preprocess."a".encode must be one of one_hot, ordinal or {"ordinal": [distinct strings, in '
     'order]}, got {"ordinal": ["x", "x"]}'),
    ({"max_categories": 0}, "options.max_categories must be from 1 to 1000, got 0"),
])
def test_option_messages(options, message):
    with pytest.raises(InvalidArgument) as info:
        parse_options(options)
    assert str(info.value) == message


def test_valid_options_pass():
    opts = parse_options({"impute": {"constant": "none"}, "encode": "ordinal", "scale": "none", "unseen": "error",
                          "preprocess": {"a": {"impute": "median", "scale": "minmax"},
                                         "b": {"encode": {"ordinal": ["lo", "hi"]}}}})
    assert preprocess.imputes(opts, "a") and preprocess.imputes(opts, "zz")
    assert not preprocess.imputes(parse_options({}), "a")


def test_categories_read_as_codes_fit_and_transform_like_strings():
    """The scan's dictionary-encoded columns and plain sequences of str / None are one thing to
    the preprocessing."""
    from tensile_db.runtime.preprocess import Categories

    texts = ["b", None, "a", "b", "c", None, "b"]
    cats = Categories.of(texts)
    assert cats.values == ("b", "a", "c") and cats.codes.tolist() == [0, -1, 1, 0, 2, -1, 0]
    assert cats[np.array([0, 2])].codes.tolist() == [0, 1] and cats.counts().tolist() == [3, 1, 1]
    opts = parse_options({"impute": "mode", "max_categories": 2})
    by_codes = preprocess.fit({"k": cats}, {"k": "categorical"}, np.arange(7), opts)
    by_texts = preprocess.fit({"k": np.array(texts, dtype=object)}, {"k": "categorical"}, np.arange(7), opts)
    assert by_codes.to_json() == by_texts.to_json()
    column = by_codes.columns[0]
    assert column.fill == "b" and column.categories == ["b", "a"] and column.other       # c is "other"
    x = by_codes.transform({"k": cats})
    assert np.array_equal(x, by_texts.transform({"k": texts}))
    assert x.tolist() == [[1, 0, 0], [1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 0]]


def test_an_ordinal_order_must_name_every_training_value():
    opts = parse_options({"preprocess": {"size": {"encode": {"ordinal": ["S", "M", "L"]}}}})
    with pytest.raises(InvalidArgument) as info:
        preprocess.fit({"size": np.array(["S", "XL", "M", "XS"], dtype=object)}, {"size": "categorical"},
                       np.arange(4), opts)
    assert str(info.value) == ('column "size" holds "XL", "XS" in the training rows, which the ordinal order of '
                               'options.preprocess."size".encode does not name; add them to the list in its place')


def test_a_transform_of_many_row_blocks_equals_its_rows_transformed_apart():
    """The inputs are written a block of rows at a time (TRANSFORM_BLOCK_ROWS): a transform of
    rows spanning several blocks, the last one partial, gives each row what it gives alone."""
    rng = np.random.default_rng(3)
    n = 3 * preprocess.TRANSFORM_BLOCK_ROWS + 123
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < 0.05] = np.nan
    letters = np.array(list("abcdefg"), dtype=object)
    raw = {"x": x, "k": letters[rng.integers(0, 7, n)], "o": letters[rng.integers(0, 3, n)]}
    raw["k"][rng.random(n) < 0.05] = None
    pre = fitted(raw, impute="mean", max_categories=4, preprocess={"o": {"encode": "ordinal"}})
    whole = pre.transform(raw)
    apart = np.vstack([pre.transform({c: v[i:i + 1000] for c, v in raw.items()}) for i in range(0, n, 1000)])
    assert whole.shape == (n, pre.width) and whole.dtype == np.float32 and whole.flags["C_CONTIGUOUS"]
    assert np.array_equal(whole, apart)
    missing = np.isnan(x)
    assert np.all(whole[missing, 0] == pre.columns[0].fill) and np.array_equal(whole[~missing, 0], x[~missing])
    assert np.all(whole[:, 1:1 + pre.columns[1].width].sum(axis=1) == 1)          # one-hot, "other" included
    arrays = {"a": rng.standard_normal((n, 5)).astype(np.float32)}
    pre = fitted(arrays, array_width=5)
    assert np.array_equal(pre.transform(arrays), arrays["a"])


@pytest.mark.parametrize("fused", ["1", "0"])
def test_fit_scaling_far_from_zero_is_the_float64_mean_and_deviation(monkeypatch, fused):
    """One pass of shifted sums, by the C loop or by NumPy's blocks: columns whose mean is a
    million times their deviation still get the float64 figures, rounded to float32."""
    monkeypatch.setenv("TENSILE_FUSED", fused)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((100_000, 3)) * [1.0, 0.001, 5.0] + [1e6, -3e3, 0.0]).astype(np.float32)
    x[:40000] += 0.5                          # the first block's mean, the shift, is off the mean
    center, spread = fit_scaling(x, ["standardize"] * 3)
    exact = x.astype(np.float64)
    np.testing.assert_allclose(center, exact.mean(axis=0), rtol=1e-7)
    np.testing.assert_allclose(spread, exact.std(axis=0), rtol=1e-6)


@pytest.mark.parametrize("fused", ["1", "0"])          # the C loop, and NumPy's blocks where it is off
def test_a_scaling_fitted_on_rows_by_index_is_the_one_of_the_rows_gathered(monkeypatch, fused):
    monkeypatch.setenv("TENSILE_FUSED", fused)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((40_000, 5)) * [1, 2, 3, 4, 5] + [0, 100, -5, 1e3, 7]).astype(np.float32)
    rows = rng.permutation(len(x))[:33_000]           # more than a block of the shift's rows
    modes = ["standardize", "minmax", "none", "standardize", "minmax"]
    want = preprocess.fit_scaling(np.ascontiguousarray(x[rows]), modes)
    got = preprocess.fit_scaling(x, modes, rows)
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want))
