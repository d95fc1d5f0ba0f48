"""Shared set-up of the tests of models, inference and their files: small networks (an MLP,
a convolutional network with every kind of join) and their specs, weights whose every array
matters, and random features."""

from __future__ import annotations

import numpy as np

from tensile_db.runtime import model as models
from tensile_db.runtime.model import ModelSpec, parse_architecture
from tensile_db.runtime.network import Network

HIDDEN = [{"dense": 96}, {"dense": 64, "activation": "tanh"}, {"dense": 128}, {"dense": 48, "activation": "sigmoid"},
          {"dense": 80}, {"dense": 64, "activation": "none"}]


#: A convolutional network on 1x8x8 images: convolution, batch normalisation, a residual block,
#: max pooling, a concatenation of the identity and a 1x1 convolution, global average pooling.
CNN = {"input": {"shape": [1, 8, 8]},
       "layers": [{"conv": 8, "padding": 1, "bias": False, "activation": "none"},
                  {"batch_norm": {}, "activation": "relu"},
                  {"residual": [{"conv": 8, "padding": 1}], "activation": "relu"}, {"max_pool": 2},
                  {"concat": [[], [{"conv": 4, "kernel": 1}]]}, {"global_avg_pool": {}}]}


def spec_of(task="classification", hidden=HIDDEN, n_features=20, n_outputs=7) -> models.ModelSpec:
    return models.ModelSpec(models.parse_architecture({"layers": hidden}), n_features,
                            n_outputs if task == "classification" else 1, task)


def cnn_spec(task="classification", architecture=CNN) -> ModelSpec:
    return ModelSpec(parse_architecture(architecture), 64, 10 if task == "classification" else 1, task)


def weights_of(spec, seed=0) -> dict[str, np.ndarray]:
    """Initial weights with random biases and batch norm parameters and running statistics, so
    that each of them matters, and a feature scaling."""
    rng = np.random.default_rng(seed)
    w = spec.network.init_weights(seed)
    for name in w:
        if name[0] in "bm" or name.startswith("gamma"):          # b, beta, mean; gamma
            w[name] = (w[name] + rng.normal(scale=0.1, size=w[name].shape)).astype(np.float32)
        elif name.startswith("var"):
            w[name] = rng.uniform(0.5, 2, size=w[name].shape).astype(np.float32)
    w["x_mean"] = rng.normal(size=spec.n_features).astype(np.float32)
    w["x_std"] = rng.uniform(0.5, 2, spec.n_features).astype(np.float32)
    if spec.task == "regression":
        w["y_mean"], w["y_std"] = np.array([3.0], np.float32), np.array([2.5], np.float32)
    return w


def features(spec, n=300, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, spec.n_features)).astype(np.float32)


def random_weights(net: Network, seed: int) -> dict[str, np.ndarray]:
    """The network's initial weights with random biases, batch norm scales, shifts and running
    statistics, so that every array matters."""
    rng = np.random.default_rng(seed)
    weights = net.init_weights(seed)
    for name, value in weights.items():
        if name[0] in "bgm":                                    # b, beta, gamma, mean
            value[...] = rng.normal(0.5 if name.startswith("gamma") else 0.0, 0.3, value.shape)
        elif name.startswith("var"):
            value[...] = rng.uniform(0.5, 2.0, value.shape)
    return weights


#: A small CNN with a residual block (the lower bound's and the scheduler's tests).
RESIDUAL_CNN = ModelSpec.parse({"input": {"shape": [1, 8, 8]}, "layers": [
    {"conv": 4, "padding": 1, "bias": False, "activation": "none"}, {"batch_norm": {}, "activation": "relu"},
    {"residual": [{"conv": 4, "padding": 1}, {"conv": 4, "padding": 1, "activation": "none"}], "activation": "relu"},
    {"max_pool": 2}, {"conv": 8, "padding": 1, "activation": "tanh"}, {"dense": 10}]}, 64, 10, "classification")
