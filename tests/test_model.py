"""Model descriptions: parsing and validating architectures and options, weights on disk, and
host inference.

Every rejected input must raise :class:`InvalidArgument` whose message names the offending key,
so the tests match on the key rather than on whole messages.
"""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from tensile_db.errors import CorruptModel, InvalidArgument
from tensile_db.runtime.model import (
    MAX_WIDTH,
    Architecture,
    Layer,
    Limits,
    ModelSpec,
    TrainOptions,
    forward,
    init_weights,
    parse_architecture,
    parse_options,
)
from tensile_db.runtime.weights import load_weights, serialize_weights

ARCH = {"layers": [{"dense": 16, "activation": "tanh", "dropout": 0.25}, {"dense": 8}]}


# --- architecture --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [ARCH, json.dumps(ARCH), json.dumps(ARCH).encode()], ids=["dict", "str", "bytes"])
def test_parse_architecture_valid(value):
    arch = parse_architecture(value)
    assert arch == Architecture((Layer(16, "tanh", 0.25), Layer(8, "relu", 0.0)))
    assert parse_architecture(arch.to_json()) == arch    # to_json round trips


def test_parse_architecture_defaults_and_limits():
    arch = parse_architecture({"layers": [{"dense": 1}, {"dense": MAX_WIDTH, "activation": "none", "dropout": 0}]})
    assert arch.layers == (Layer(1, "relu", 0.0), Layer(MAX_WIDTH, "none", 0.0))
    assert isinstance(arch.layers[1].dropout, float)
    for act in ("relu", "tanh", "sigmoid", "none"):
        assert parse_architecture({"layers": [{"dense": 4, "activation": act}]}).layers[0].activation == act


@pytest.mark.parametrize("value, key", [
    ({"layers": [{"dense": 4}], "extra": 1}, "'extra'"),
    ({"layers": [{"dense": 4, "units": 4}]}, "'units'"),
    ({"layers": [{"dense": "8"}]}, '"dense"'),
    ({"layers": [{"dense": 8.0}]}, '"dense"'),
    ({"layers": [{"dense": True}]}, '"dense"'),
    ({"layers": [{"dense": 0}]}, '"dense"'),
    ({"layers": [{"dense": -3}]}, '"dense"'),
    ({"layers": [{"dense": MAX_WIDTH + 1}]}, '"dense"'),
    ({"layers": [{}]}, "layers[0] must have one of the keys activation, avg_pool, batch_norm"),
    ({"layers": [{"dense": 4, "activation": "mish"}]}, '"activation"'),
    ({"layers": [{"dense": 4, "activation": None}]}, '"activation"'),
    ({"layers": [{"dense": 4, "dropout": 1.0}]}, '"dropout"'),
    ({"layers": [{"dense": 4, "dropout": -0.1}]}, '"dropout"'),
    ({"layers": [{"dense": 4, "dropout": "0.1"}]}, '"dropout"'),
    ({"layers": [{"dense": 4, "dropout": True}]}, '"dropout"'),
    ({"layers": []}, '"layers"'),
    ({"layers": {"dense": 4}}, '"layers"'),
    ({}, '"layers"'),
    ({"layers": [4]}, "layers[0]"),
    ('{"layers": [', "architecture is not valid JSON"),
    ("[1, 2]", "architecture must be a JSON object"),
    (["layers"], "architecture must be a JSON object"),
])
def test_parse_architecture_rejects(value, key):
    with pytest.raises(InvalidArgument) as info:
        parse_architecture(value)
    assert key in str(info.value)


def test_architecture_error_names_the_layer_index():
    with pytest.raises(InvalidArgument, match=r"architecture\.layers\[1\]\.\"dense\""):
        parse_architecture({"layers": [{"dense": 4}, {"dense": 0}]})


# --- options -------------------------------------------------------------------------------------


def test_parse_options_valid():
    text = json.dumps({"task": "regression", "epochs": 3, "batch_size": 16, "optimizer": "sgd", "lr": 0.5,
                       "momentum": 0, "weight_decay": 1e-4, "seed": 9, "standardize": False,
                       "replace": True, "skip_nulls": True})
    opts = parse_options(text)
    assert opts == TrainOptions("regression", 3, 16, "sgd", 0.5, 0, 1e-4, 9, False, True, True)
    assert parse_options(opts.to_json()) == opts


@pytest.mark.parametrize("value", [None, "", {}, "{}"])
def test_parse_options_defaults(value):
    opts = parse_options(value)
    assert opts == TrainOptions()
    assert opts.learning_rate == 0.001


def test_learning_rate_defaults_per_optimizer():
    assert parse_options({"optimizer": "sgd"}).learning_rate == 0.01
    assert parse_options({"optimizer": "adam"}).learning_rate == 0.001
    assert parse_options({"optimizer": "sgd", "lr": 2}).learning_rate == 2


@pytest.mark.parametrize("value, key", [
    ({"epoch": 3}, "'epoch'"),
    ({"epochs": "3"}, "options.epochs"),
    ({"epochs": 3.0}, "options.epochs"),
    ({"epochs": True}, "options.epochs"),
    ({"epochs": 0}, "options.epochs"),
    ({"epochs": 100_001}, "options.epochs"),
    ({"batch_size": 0}, "options.batch_size"),
    ({"batch_size": False}, "options.batch_size"),
    ({"lr": -0.1}, "options.lr"),
    ({"lr": 0}, "options.lr"),
    ({"lr": True}, "options.lr"),
    ({"lr": "0.1"}, "options.lr"),
    ('{"lr": NaN}', "options.lr"),
    ('{"lr": Infinity}', "options.lr"),
    ({"optimizer": "rmsprop"}, "options.optimizer"),
    ({"optimizer": None}, "options.optimizer"),
    ({"task": "clustering"}, "options.task"),
    ({"momentum": 1}, "options.momentum"),
    ({"momentum": -0.5}, "options.momentum"),
    ({"weight_decay": -1}, "options.weight_decay"),
    ('{"weight_decay": Infinity}', "options.weight_decay"),
    ({"standardize": 1}, "options.standardize"),
    ({"seed": 1.5}, "options.seed"),
    ({"seed": -1}, "options.seed"),
    ('{"lr": ' + "1" + "0" * 400 + "}", "options.lr is 1000"),          # what jsonb makes of 1e400
    ({"lr": 1e39}, "options.lr is 1e+39, beyond the range of real"),
    ({"weight_decay": 10 ** 400}, "options.weight_decay"),
    ({"epochs": 10 ** 400}, "options.epochs must be from 1 to 100000, got 1000"),
    ("{bad json", "options is not valid JSON"),
    ("[]", "options must be a JSON object"),
    ("3", "options must be a JSON object"),
])
def test_parse_options_rejects(value, key):
    with pytest.raises(InvalidArgument) as info:
        parse_options(value)
    assert key in str(info.value)


# --- weights -------------------------------------------------------------------------------------


def test_serialize_round_trip():
    spec = ModelSpec(Architecture((Layer(5), Layer(3, "tanh"))), 4, 2, "classification")
    weights = init_weights(spec, seed=1)
    weights["x_mean"], weights["x_std"] = np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)
    data = serialize_weights(weights)
    assert isinstance(data, bytes)
    back = load_weights(data, spec, "m")
    assert back.keys() == weights.keys()
    for k, v in weights.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)


SPEC = ModelSpec(Architecture((Layer(5),)), 4, 2, "classification")


def test_load_weights_never_unpickles():
    weights = init_weights(SPEC, seed=0)
    buf = io.BytesIO()
    np.savez(buf, **dict(weights, W0=np.array([{"evil": 1}] * 20, dtype=object).reshape(4, 5)))   # needs pickle
    with pytest.raises(CorruptModel, match=r"'m': weight W0 must be a float array of shape \(4, 5\), its header "
                                           r"declares object"):
        load_weights(buf.getvalue(), SPEC, "m")


def test_load_weights_reads_no_array_whose_header_claims_another_shape():
    """A member's declared size is small, but its header claims 3e9 float64 (24 GB): refused from
    the header, before reading the array."""
    weights = {f"{k}.npy": _npy(v) for k, v in init_weights(SPEC, seed=0).items()}
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (3_000_000_000,)})
    weights["W0.npy"] = header.getvalue()
    with pytest.raises(CorruptModel, match=r"its header declares float64 \(3000000000,\)"):
        load_weights(_zip(weights), SPEC, "m")


def _zip(members: dict[str, bytes], compression=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_load_weights_refuses_a_small_row_that_expands_before_decompressing_it():
    weights = {k: _npy(v) for k, v in init_weights(SPEC, seed=0).items()}
    weights["W0.npy"] = _npy(np.zeros((4, 5), np.float32)) + bytes(200 << 20)      # 200 MB of zeros
    data = _zip(weights, zipfile.ZIP_DEFLATED)
    assert len(data) < 1 << 20
    with pytest.raises(CorruptModel, match=r"weight W0 holds 209,715,\d+ bytes, more than its shape \(4, 5\)"):
        load_weights(data, SPEC, "m")


@pytest.mark.parametrize("change, message", [
    (lambda w: w.update(extra=np.zeros(3, np.float32)), "has no use for"),
    (lambda w: w.pop("b1"), r"weight b1 must be a float array of shape \(2,\), got nothing"),
    (lambda w: w.update(W1=np.zeros((5, 3), np.float32)), r"weight W1 must be a float array of shape \(5, 2\)"),
    (lambda w: w.update(b0=np.zeros(5, np.int64)), "weight b0 must be a float array"),
    (lambda w: w.update(W0=np.full((4, 5), np.nan, np.float32)), "weight W0 has NaN or infinite values"),
    (lambda w: w.update(x_mean=np.zeros(4, np.float32)), r"weight x_std must be a float array of shape \(4,\)"),
    (lambda w: w.update(y_mean=np.zeros(1, np.float32), y_std=np.ones(1, np.float32)), "has no use for"),
])
def test_load_weights_checks_names_shapes_dtypes_and_values(change, message):
    weights = init_weights(SPEC, seed=0)
    change(weights)
    with pytest.raises(CorruptModel, match=message):
        load_weights(serialize_weights(weights), SPEC, "m")


def test_load_weights_refuses_what_is_not_an_archive():
    with pytest.raises(CorruptModel, match="not a NumPy .npz archive"):
        load_weights(b"not a zip", SPEC, "m")


def test_limits_refuse_models_larger_than_the_settings():
    limits = Limits(max_layers=3, max_parameters=1000)
    limits.check(ModelSpec(Architecture((Layer(8), Layer(8))), 4, 2, "classification"), "ok")
    with pytest.raises(InvalidArgument, match=r"'deep' has 4 layers .* tensile.max_layers \(3\)"):
        limits.check(ModelSpec(Architecture((Layer(8),) * 3), 4, 2, "classification"), "deep")
    with pytest.raises(InvalidArgument, match=r"'wide' has 1,201 parameters, more than tensile.max_parameters"):
        limits.check(ModelSpec(Architecture((Layer(200),)), 4, 1, "regression"), "wide")


def test_init_weights_shapes_and_seed():
    spec = ModelSpec(Architecture((Layer(6, "relu"), Layer(4, "sigmoid"))), 3, 1, "regression")
    w = init_weights(spec, seed=5)
    assert {k: v.shape for k, v in w.items()} == {
        "W0": (3, 6), "b0": (6,), "W1": (6, 4), "b1": (4,), "W2": (4, 1), "b2": (1,)}
    assert all(v.dtype == np.float32 for v in w.values())
    assert all(not v.any() for k, v in w.items() if k.startswith("b"))
    assert np.abs(w["W0"]).max() <= np.sqrt(6 / 3)        # He-uniform limit for relu
    again, other = init_weights(spec, seed=5), init_weights(spec, seed=6)
    assert all(np.array_equal(w[k], again[k]) for k in w)
    assert not np.array_equal(w["W0"], other["W0"])
    assert spec.n_parameters() == sum(v.size for v in w.values())


# --- inference -----------------------------------------------------------------------------------


def test_forward_classification_probabilities():
    spec = ModelSpec(Architecture((Layer(8, "relu", 0.5), Layer(5, "tanh"))), 6, 4, "classification")
    weights = init_weights(spec, seed=0)
    weights["x_mean"] = np.full(6, 2.0, dtype=np.float32)
    weights["x_std"] = np.full(6, 3.0, dtype=np.float32)
    x = np.random.default_rng(0).standard_normal((11, 6)).astype(np.float32) * 50
    out = forward(spec, weights, x)
    assert out.shape == (11, 4) and out.dtype == np.float32
    assert np.all(out >= 0)
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-5)
    # same as a plain NumPy recomputation (dropout is the identity at inference)
    h = (x - 2) / 3
    h = np.maximum(h @ weights["W0"] + weights["b0"], 0)
    h = np.tanh(h @ weights["W1"] + weights["b1"])
    z = h @ weights["W2"] + weights["b2"]
    p = np.exp(z - z.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, p / p.sum(axis=1, keepdims=True), rtol=1e-4, atol=1e-6)


def test_forward_regression_undoes_target_scaling():
    spec = ModelSpec(Architecture((Layer(3, "sigmoid"),)), 2, 1, "regression")
    weights = init_weights(spec, seed=2)
    x = np.random.default_rng(1).standard_normal((5, 2)).astype(np.float32)
    raw = forward(spec, weights, x)
    assert raw.shape == (5, 1)
    weights["y_mean"] = np.array([10.0], dtype=np.float32)
    weights["y_std"] = np.array([4.0], dtype=np.float32)
    np.testing.assert_allclose(forward(spec, weights, x), raw * 4 + 10, rtol=1e-6)
