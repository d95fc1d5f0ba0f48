"""The ``layer_norm`` layer kind against PyTorch: its kernels, forward and backward, on vectors
and images; a network's inference and its whole training gradients; recompute bit for bit; its
JSON, parameters and errors; and, from SQL, a model with it and GELU trained and served."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_helpers import random_weights
from program_helpers import batch_of, forward_backward, recompute_each_at_its_last_access
from sql_helpers import FEATURES, assert_nothing_left, train
from tensile_db.errors import InvalidArgument
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.layers.layer_norm import LayerNorm, layer_norm_backward, layer_norm_forward
from tensile_db.runtime.model import ModelSpec, TrainOptions
from tensile_db.runtime.network import layers_to_json, parse_layers

#: Rows of 6 features: a dense layer, layer normalisation, a dense layer.
VECTORS = {"layers": [{"dense": 12, "activation": "none"}, {"layer_norm": {}, "activation": "tanh"},
                      {"dense": 8, "activation": "relu"}]}
#: Images 2x4x5: a convolution, then layer normalisation over each row of 5 pixels.
IMAGES = {"input": {"shape": [2, 4, 5]}, "layers": [{"conv": 3, "padding": 1, "activation": "none"},
                                                    {"layer_norm": {"eps": 1e-3}}]}


@pytest.mark.parametrize("shape", [(5, 7), (3, 2, 4, 6)])
def test_kernels_equal_torch(shape):
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=shape), rng.normal(size=shape)
    gamma, beta = rng.normal(size=shape[-1]), rng.normal(size=shape[-1])
    out, mean, invstd = np.empty(shape), np.empty(shape[:-1]), np.empty(shape[:-1])
    layer_norm_forward(x, gamma, beta, out, mean, invstd, 1e-5)
    dx, dgamma, dbeta = np.empty(shape), np.empty(shape[-1]), np.empty(shape[-1])
    layer_norm_backward(x, gamma, mean, invstd, dy, dx, dgamma, dbeta)

    t = {k: torch.tensor(v, requires_grad=True) for k, v in dict(x=x, gamma=gamma, beta=beta).items()}
    y = F.layer_norm(t["x"], shape[-1:], t["gamma"], t["beta"], 1e-5)
    y.backward(torch.tensor(dy))
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=1e-10, atol=1e-12)
    for got, name in ((dx, "x"), (dgamma, "gamma"), (dbeta, "beta")):
        np.testing.assert_allclose(got, t[name].grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)

    no_dx_gamma, no_dx_beta = np.empty(shape[-1]), np.empty(shape[-1])
    layer_norm_backward(x, gamma, mean, invstd, dy, None, no_dx_gamma, no_dx_beta)
    assert np.array_equal(no_dx_gamma, dgamma) and np.array_equal(no_dx_beta, dbeta)


def _spec(architecture, n_features) -> ModelSpec:
    return ModelSpec.parse(architecture, n_features, 3, "classification")


def _torch_network(spec, t, x):
    """The logits of VECTORS or IMAGES in PyTorch on tensors ``t`` of the network's weights."""
    if spec.network.input_shape == (6,):
        v = F.layer_norm(x @ t["W0"] + t["b0"], (12,), t["gamma1"], t["beta1"], 1e-5).tanh()
        v = torch.relu(v @ t["W2"] + t["b2"])
        return v @ t["W3"] + t["b3"]
    v = F.conv2d(x.reshape(len(x), 2, 4, 5), t["W0"], t["b0"], padding=1)
    v = F.layer_norm(v, (5,), t["gamma1"], t["beta1"], 1e-3)
    return v.flatten(1) @ t["W3"] + t["b3"]


@pytest.mark.parametrize("architecture, n_features", [(VECTORS, 6), (IMAGES, 40)], ids=["vectors", "images"])
def test_a_network_trains_and_predicts_as_torch(architecture, n_features):
    spec = _spec(architecture, n_features)
    assert [n.op for n in spec.network.nodes][:2] == ["dense" if n_features == 6 else "conv", "layer_norm"]
    weights = random_weights(spec.network, seed=2)
    for name in ("gamma1", "beta1"):                      # every array matters
        weights[name] = weights[name] + np.random.default_rng(3).normal(scale=0.3, size=weights[name].shape)
    x, y = batch_of(spec, 5, seed=4)
    prog = build_training_program(spec, TrainOptions(), 5)
    arrays = forward_backward(spec, prog, weights, x, y, np.float64)

    params = set(spec.network.weight_shapes())
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in weights.items() if k in params}
    logits = _torch_network(spec, t, torch.tensor(x))
    loss = F.cross_entropy(logits, torch.tensor(y, dtype=torch.long))
    loss.backward()
    np.testing.assert_allclose(arrays["loss"][0], loss.item(), rtol=1e-10)
    for name, tensor in t.items():
        np.testing.assert_allclose(arrays[f"d{name}"], tensor.grad.numpy(), rtol=1e-8, atol=1e-12, err_msg=name)

    predicted = spec.network.forward({k: v.astype(np.float32) for k, v in weights.items()}, x.astype(np.float32))
    np.testing.assert_allclose(predicted, logits.detach().numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("architecture, n_features", [(VECTORS, 6), (IMAGES, 40)], ids=["vectors", "images"])
def test_recompute_is_bit_identical(architecture, n_features):
    spec = _spec(architecture, n_features)
    replayed = recompute_each_at_its_last_access(spec, build_training_program(spec, TrainOptions(), 4), 4)
    assert "layer_norm1_replay" in replayed


def test_parameters_json_and_errors():
    net = _spec(IMAGES, 40).network
    assert net.nodes[1].params == {"gamma1": (5,), "beta1": (5,)} and net.nodes[1].buffers == {}
    layers = parse_layers([{"layer_norm": {}}, {"layer_norm": True, "activation": "relu"}], "l")
    assert layers == (LayerNorm(1e-5, "none"), LayerNorm(1e-5, "relu"))
    assert parse_layers(layers_to_json(layers), "l") == layers
    for layer, fragment in [({"layer_norm": {"eps": 0}}, 'l[0]."layer_norm"."eps" must be a number in [1e-12, 1]'),
                            ({"layer_norm": {"epsilon": 1}}, "epsilon"),
                            ({"layer_norm": 3}, 'l[0]."layer_norm" must be an object'),
                            ({"layer_norm": {}, "momentum": 0.1}, "momentum")]:
        with pytest.raises(InvalidArgument, match=None) as info:
            parse_layers([layer], "l")
        assert fragment in str(info.value)


@pytest.mark.db
def test_from_sql_with_gelu_a_model_trains_stores_and_predicts(conn, digits):
    """A pre-norm MLP block (dense, layer_norm with GELU, dense with GELU) on the digits, trained
    and served through the extension: the server finds both kinds by their modules alone."""
    architecture = {"layers": [{"dense": 96, "activation": "none"}, {"layer_norm": {}, "activation": "gelu"},
                               {"dense": 48, "activation": "gelu"}]}
    train(conn, "t_layer_norm", architecture=json.dumps(architecture),
          options='{"epochs": 15, "lr": 0.003, "seed": 0, "replace": true}', features=None)
    stored = conn.execute("SELECT architecture FROM tensile.models WHERE name = 't_layer_norm'").fetchone()[0]
    assert stored["layers"][1] == {"layer_norm": {"eps": 1e-5}, "activation": "gelu"}
    accuracy = conn.execute(f"SELECT avg((tensile.predict('t_layer_norm', {FEATURES}) = label)::int) "
                            "FROM digits_test").fetchone()[0]
    assert float(accuracy) >= 0.9
    assert_nothing_left(conn)
