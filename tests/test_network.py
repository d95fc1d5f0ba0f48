"""Networks (``tensile_db.runtime.network``): parsing the layers of an architecture, building the
graph, and host inference.

Every layer kind parses with its defaults and round-trips through ``layers_to_json``; the graph's
nodes have the shapes, inputs and parameters PyTorch modules built from the same layers have
(output sizes of convolutions and pools, concatenated channels, residual joins, parameter counts);
every rejected architecture raises InvalidArgument naming the layer's path and the field; and
:meth:`Network.forward` agrees with the PyTorch modules in eval mode loaded with the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from model_helpers import random_weights
from tensile_db.errors import InvalidArgument
from tensile_db.runtime.model import ModelSpec, parse_architecture
from tensile_db.runtime.network import (
    INPUT,
    MAX_DEPTH,
    Activation,
    BatchNorm,
    Concat,
    Conv,
    Dropout,
    Flatten,
    GlobalAvgPool,
    Layer,
    Network,
    Pool,
    Residual,
    layers_to_json,
    parse_layers,
)

#: The example of the README: rows of 64 features seen as 1x8x8 images.
EXAMPLE = {"input": {"shape": [1, 8, 8]}, "layers": [
    {"conv": 16, "kernel": 3, "padding": 1, "bias": False, "activation": "none"},
    {"batch_norm": {}, "activation": "relu"},
    {"residual": [{"conv": 16, "padding": 1}, {"conv": 16, "padding": 1, "activation": "none"}], "activation": "relu"},
    {"max_pool": 2},
    {"concat": [[], [{"conv": 8, "kernel": 1}]]},
    {"conv": 32, "padding": 1}, {"global_avg_pool": {}}, {"dense": 64}]}

#: Small networks covering every layer kind and option: name -> (architecture, features, outputs).
NETS = {
    "example": (EXAMPLE, 64, 10),
    "strided-grouped-dilated": ({"input": {"shape": [4, 11, 9]}, "layers": [
        {"conv": 6, "kernel": [3, 2], "stride": [2, 1], "padding": [1, 0], "groups": 2, "activation": "tanh"},
        {"conv": 6, "kernel": 3, "dilation": 2, "padding": 1, "groups": 6, "bias": False, "activation": "sigmoid"},
        {"avg_pool": 3, "stride": 2, "padding": 1}, {"max_pool": [2, 3], "stride": 1, "padding": [1, 1]},
        {"batch_norm": {"momentum": 0.3, "eps": 1e-3}, "activation": "relu"}, {"flatten": {}},
        {"dense": 7, "activation": "tanh", "dropout": 0.5}]}, 396, 3),
    "projection-shortcut": ({"input": {"shape": [3, 8, 8]}, "layers": [
        {"residual": [{"conv": 5, "stride": 2, "padding": 1, "bias": False, "activation": "none"},
                      {"batch_norm": {}, "activation": "relu"}, {"conv": 5, "padding": 1, "activation": "none"}],
         "shortcut": [{"conv": 5, "kernel": 1, "stride": 2, "bias": False, "activation": "none"},
                      {"batch_norm": True}], "activation": "relu"},
        {"concat": [[{"residual": [{"conv": 5, "padding": 1}]}],
                    [{"max_pool": 3, "stride": 1, "padding": 1}, {"conv": 3, "kernel": 1}], []]},
        {"dropout": 0.2}, {"global_avg_pool": {}}, {"activation": "sigmoid"}]}, 192, 4),
    "vectors": ({"layers": [
        {"dense": 9, "activation": "none"}, {"batch_norm": {}, "activation": "tanh"},
        {"residual": [{"dense": 9}, {"dense": 9, "activation": "none"}],
         "shortcut": [{"dense": 9, "activation": "none"}], "activation": "relu"},
        {"flatten": {}}, {"activation": "none"}, {"dropout": 0.1}]}, 5, 1),
}


def spec_of(name: str) -> ModelSpec:
    arch, n_features, n_outputs = NETS[name]
    return ModelSpec.parse(arch, n_features, n_outputs, "classification")


# --- parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer, parsed", [
    ({"dense": 8}, Layer(8, "relu", 0.0)),
    ({"dense": 3, "activation": "none", "dropout": 0.5}, Layer(3, "none", 0.5)),
    ({"conv": 4}, Conv(4, (3, 3), (1, 1), (0, 0), (1, 1), 1, True, "relu")),
    ({"conv": 4, "kernel": [3, 1], "stride": 2, "padding": [1, 0], "dilation": [1, 2], "groups": 2, "bias": False,
      "activation": "tanh"}, Conv(4, (3, 1), (2, 2), (1, 0), (1, 2), 2, False, "tanh")),
    ({"batch_norm": {}}, BatchNorm(0.1, 1e-5, "none")),
    ({"batch_norm": True, "activation": "relu"}, BatchNorm(0.1, 1e-5, "relu")),
    ({"batch_norm": {"momentum": 0, "eps": 1e-3}}, BatchNorm(0.0, 1e-3, "none")),
    ({"max_pool": 2}, Pool("max", (2, 2), (2, 2), (0, 0))),
    ({"avg_pool": [3, 2], "stride": 1, "padding": [1, 0]}, Pool("avg", (3, 2), (1, 1), (1, 0))),
    ({"global_avg_pool": {}}, GlobalAvgPool()),
    ({"flatten": True}, Flatten()),
    ({"activation": "sigmoid"}, Activation("sigmoid")),
    ({"dropout": 0.25}, Dropout(0.25)),
    ({"residual": [{"dense": 4}]}, Residual((Layer(4),), (), "none")),
    ({"residual": [{"conv": 2}], "shortcut": [{"max_pool": 1}], "activation": "relu"},
     Residual((Conv(2),), (Pool("max", (1, 1), (1, 1)),), "relu")),
    ({"concat": [[], [{"flatten": {}}], []]}, Concat(((), (Flatten(),), ()))),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_every_layer_kind_parses_with_its_defaults(layer, parsed):
    assert parse_layers([layer], "architecture.layers") == (parsed,)
    assert parse_layers(layers_to_json((parsed,)), "architecture.layers") == (parsed,)


@pytest.mark.parametrize("name", list(NETS))
def test_architecture_round_trips_through_json(name):
    arch = parse_architecture(NETS[name][0])
    assert parse_architecture(arch.to_json()) == arch


def test_blocks_nest_up_to_the_limit():
    layer = {"conv": 1, "padding": 1}
    for _ in range(MAX_DEPTH):
        layer = {"residual": [layer]}
    spec = ModelSpec.parse({"input": {"shape": [1, 3, 3]}, "layers": [layer]}, 9, 2, "classification")
    assert [n.op for n in spec.network.nodes] == ["conv"] + ["add"] * MAX_DEPTH + ["flatten", "dense"]


# --- errors ----------------------------------------------------------------------------------------


def img(*layers, shape=(2, 8, 8)) -> dict:
    return {"input": {"shape": list(shape)}, "layers": list(layers)}


def nested(depth: int) -> dict:
    layer = {"conv": 2, "padding": 1}
    for _ in range(depth):
        layer = {"residual": [layer]}
    return layer


L0 = "architecture.layers[0]"

# (architecture, feature columns, fragments the message must hold: the path, the field, the values)
REJECTED = {
    # shapes, checked when the graph is built
    "conv-on-vectors": ({"layers": [{"conv": 4}]}, 64, [f"{L0}: a convolution needs images", '"input"']),
    "conv-after-dense": (img({"dense": 4}, {"conv": 4}), 128, ["architecture.layers[1]: a convolution needs images"]),
    "pool-on-vectors": (img({"flatten": {}}, {"max_pool": 2}), 128, ["architecture.layers[1]: a max_pool needs"]),
    "gap-on-vectors": ({"layers": [{"global_avg_pool": {}}]}, 8, [f"{L0}: a global_avg_pool needs images"]),
    "input-shape-vs-features": (img({"conv": 4}), 100, ["architecture.input.shape [2, 8, 8]", "128 values",
                                                         "100 feature columns"]),
    "kernel-larger-than-input": (img({"conv": 4, "kernel": 9}), 128, [f"{L0}: a [9, 9] window", "input of 8x8"]),
    "dilated-kernel-too-large": (img({"conv": 4, "dilation": 4}), 128, [f"{L0}: a [3, 3] window (dilation [4, 4]"]),
    "pool-larger-than-input": (img({"max_pool": 3}, {"max_pool": 3}), 128, ["architecture.layers[1]: a [3, 3] window",
                                                                           "input of 2x2"]),
    "kernel-too-large-nested": (img({"max_pool": 4}, {"residual": [{"conv": 2, "kernel": 3}]}), 128,
                                ["architecture.layers[1].residual[0]: a [3, 3] window", "input of 2x2"]),
    "residual-channels": (img({"residual": [{"conv": 4, "padding": 1}]}), 128,
                          [f"{L0}: the residual body gives [4, 8, 8]", "the shortcut gives [2, 8, 8]"]),
    "residual-stride": (img({"residual": [{"conv": 2, "stride": 2, "padding": 1}],
                             "shortcut": [{"conv": 2, "kernel": 1}]}), 128,
                        [f"{L0}: the residual body gives [2, 4, 4]", "the shortcut gives [2, 8, 8]"]),
    "residual-of-nothing": ({"layers": [{"residual": [{"flatten": {}}]}]}, 8,
                            [f"{L0}: the residual body must hold at least one layer"]),
    "concat-hw": (img({"concat": [[], [{"max_pool": 2}]]}), 128, [f"{L0}: the branches give [[2, 8, 8], [2, 4, 4]]"]),
    "concat-vectors": (img({"flatten": {}}, {"concat": [[], [{"dense": 3}]]}), 128,
                       ["architecture.layers[1]: the branches give [[128], [3]]", "joins images"]),
    "groups-input": (img({"conv": 6, "groups": 4}), 128, [f'{L0}."groups" 4', "input channels (2)"]),
    "groups-output": (img({"conv": 3, "groups": 2}), 128, [f'{L0}."groups" 2', "output channels (3)"]),
    "pool-padding": (img({"max_pool": 2, "padding": 2}), 128, [f'{L0}."padding" [2, 2]', "half the window [2, 2]"]),
    # keys
    "unknown-key": (img({"conv": 4, "kernal": 3}), 128, [f"{L0}: unknown key 'kernal' for a conv layer",
                                                           "allowed keys: conv, kernel, stride"]),
    "dropout-on-conv": (img({"conv": 4, "dropout": 0.5}), 128, [f"{L0}: unknown key 'dropout' for a conv layer"]),
    "unknown-key-nested": (img({"residual": [{"conv": 2, "padding": 1, "units": 3}]}), 128,
                           [f"{L0}.residual[0]: unknown key 'units'"]),
    "unknown-key-in-branch": (img({"concat": [[], [{"max_pool": 1, "kernel": 2}]]}), 128,
                              [f"{L0}.concat[1][0]: unknown key 'kernel' for a max_pool layer"]),
    "unknown-key-in-shortcut": (img({"residual": [{"conv": 2, "padding": 1}], "shortcut": [{"flatten": {}, "x": 1}]}),
                                128, [f"{L0}.shortcut[0]: unknown key 'x'"]),
    "unknown-batch-norm-option": (img({"batch_norm": {"momentun": 0.1}}), 128,
                                  [f"{L0}.\"batch_norm\": unknown key 'momentun'", "momentum, eps"]),
    "two-kinds": (img({"conv": 4, "dense": 8}), 128, [f"{L0} has the keys conv and dense", "split it in two"]),
    "two-pools": (img({"max_pool": 2, "avg_pool": 2}), 128, [f"{L0} has the keys max_pool and avg_pool"]),
    "no-kind": (img({"kernel": 3}), 128, [f"{L0} must have one of the keys activation, avg_pool, batch_norm"]),
    "activation-and-dropout": (img({"activation": "relu", "dropout": 0.1}), 128, [f"{L0} must have one of the keys"]),
    "too-deep": (img(nested(MAX_DEPTH + 1)), 128,
                 [f"{L0}{'.residual[0]' * MAX_DEPTH}.residual: blocks nest more than {MAX_DEPTH} deep"]),
    # values
    "kernel-zero-in-residual": (img({"conv": 2, "padding": 1}, {"batch_norm": {}},
                                    {"residual": [{"conv": 2, "kernel": 0}]}), 128,
                                ['architecture.layers[2].residual[0]."kernel" must be an integer from 1 to 64',
                                 "got 0"]),
    "kernel-one-side": (img({"conv": 2, "kernel": [3]}), 128, [f'{L0}."kernel"', "got [3]"]),
    "kernel-text": (img({"conv": 2, "kernel": "3"}), 128, [f'{L0}."kernel"']),
    "kernel-bool": (img({"conv": 2, "kernel": True}), 128, [f'{L0}."kernel"']),
    "kernel-too-wide": (img({"conv": 2, "kernel": [3, 65]}), 128, [f'{L0}."kernel"', "[3, 65]"]),
    "stride-zero": (img({"conv": 2, "stride": 0}), 128, [f'{L0}."stride"']),
    "padding-negative": (img({"conv": 2, "padding": -1}), 128, [f'{L0}."padding" must be an integer from 0']),
    "dilation-zero": (img({"conv": 2, "dilation": [1, 0]}), 128, [f'{L0}."dilation"']),
    "groups-zero": (img({"conv": 2, "groups": 0}), 128, [f'{L0}."groups" must be an integer from 1']),
    "bias-text": (img({"conv": 2, "bias": "no"}), 128, [f'{L0}."bias" must be true or false']),
    "channels-zero": (img({"conv": 0}), 128, [f'{L0}."conv" must be an integer from 1 to 65536']),
    "channels-float": (img({"conv": 2.0}), 128, [f'{L0}."conv"']),
    "conv-activation": (img({"conv": 2, "activation": "mish"}), 128, [f'{L0}."activation" must be one of relu']),
    "residual-activation": (img({"residual": [{"conv": 2, "padding": 1}], "activation": "elu"}), 128,
                            [f'{L0}."activation"', '"elu"']),
    "momentum": (img({"batch_norm": {"momentum": 1.5}}), 128, [f'{L0}."batch_norm"."momentum"', "got 1.5"]),
    "eps": (img({"batch_norm": {"eps": 0}}), 128, [f'{L0}."batch_norm"."eps"', "got 0"]),
    "batch-norm-number": (img({"batch_norm": 5}), 128, [f'{L0}."batch_norm" must be an object']),
    "pool-zero": (img({"max_pool": 0}), 128, [f'{L0}."max_pool"']),
    "pool-three-sides": (img({"avg_pool": [2, 2, 2]}), 128, [f'{L0}."avg_pool"']),
    "gap-options": (img({"global_avg_pool": 1}), 128, [f'{L0}."global_avg_pool" takes no options']),
    "flatten-options": (img({"flatten": {"x": 1}}), 128, [f'{L0}."flatten" takes no options']),
    "dropout-one": (img({"dropout": 1}), 128, [f'{L0}."dropout" must be a number in [0, 1)']),
    "activation-alone": (img({"activation": "mish"}), 128, [f'{L0}."activation"']),
    "residual-empty": (img({"residual": []}), 128, [f"{L0}.residual must hold at least one layer"]),
    "residual-object": (img({"residual": {"conv": 2}}), 128, [f"{L0}.residual must be an array of layers"]),
    "shortcut-text": (img({"residual": [{"conv": 2, "padding": 1}], "shortcut": "x"}), 128,
                      [f"{L0}.shortcut must be an array of layers"]),
    "concat-one-branch": (img({"concat": [[]]}), 128, [f"{L0}.concat must be an array of at least two branches"]),
    "concat-branch-number": (img({"concat": [[], 3]}), 128, [f"{L0}.concat[1] must be an array of layers"]),
    "layer-number-in-block": (img({"residual": [3]}), 128, [f"{L0}.residual[0] must be an object"]),
}


@pytest.mark.parametrize("arch, n_features, fragments", list(REJECTED.values()), ids=list(REJECTED))
def test_bad_architectures_name_the_layer_and_the_field(arch, n_features, fragments):
    with pytest.raises(InvalidArgument) as info:
        ModelSpec.parse(arch, n_features, 3, "classification")
    for fragment in fragments:
        assert fragment in str(info.value)


# --- the graph -------------------------------------------------------------------------------------


def test_example_graph_nodes_shapes_and_parameters():
    net = spec_of("example").network
    assert net.input_shape == (1, 8, 8) and net.n_features == 64 and net.n_outputs == 10
    assert [(n.op, n.inputs, n.shape, n.activation) for n in net.nodes] == [
        ("conv", (INPUT,), (16, 8, 8), "none"),
        ("batch_norm", (0,), (16, 8, 8), "relu"),
        ("conv", (1,), (16, 8, 8), "relu"),                 # the residual body
        ("conv", (2,), (16, 8, 8), "none"),
        ("add", (3, 1), (16, 8, 8), "relu"),                # body + identity shortcut
        ("max_pool", (4,), (16, 4, 4), "none"),
        ("conv", (5,), (8, 4, 4), "relu"),                  # the second branch
        ("concat", (5, 6), (24, 4, 4), "none"),             # identity branch first
        ("conv", (7,), (32, 4, 4), "relu"),
        ("global_avg_pool", (8,), (32,), "none"),
        ("dense", (9,), (64,), "relu"),
        ("dense", (10,), (10,), "none"),                    # the output layer
    ]
    assert [n.where for n in net.nodes[:5]] == [
        "architecture.layers[0]", "architecture.layers[1]", "architecture.layers[2].residual[0]",
        "architecture.layers[2].residual[1]", "architecture.layers[2]"]
    assert net.weight_shapes() == {
        "W0": (16, 1, 3, 3), "gamma1": (16,), "beta1": (16,), "mean1": (16,), "var1": (16,),
        "W2": (16, 16, 3, 3), "b2": (16,), "W3": (16, 16, 3, 3), "b3": (16,), "W6": (8, 16, 1, 1), "b6": (8,),
        "W8": (32, 24, 3, 3), "b8": (32,), "W10": (32, 64), "b10": (64,), "W11": (64, 10), "b11": (10,)}
    assert net.n_parameters() == 144 + 32 + 2 * 2320 + 136 + 6944 + 2112 + 650
    assert [n.index for n in net.layered] == [0, 1, 2, 3, 6, 8, 10, 11]
    assert net.consumers[INPUT] == [0] and net.consumers[1] == [2, 4] and net.consumers[5] == [6, 7]


def test_flatten_is_added_before_a_dense_layer_and_the_output_layer():
    net = ModelSpec.parse(img({"conv": 3}, {"dense": 4}, {"dense": 2}), 128, 5,
                          "regression").network
    assert [(n.op, n.shape) for n in net.nodes] == [
        ("conv", (3, 6, 6)), ("flatten", (108,)), ("dense", (4,)), ("dense", (2,)), ("dense", (5,))]
    net = ModelSpec.parse(img({"max_pool": 2}), 128, 3, "classification").network
    assert [(n.op, n.shape, n.where) for n in net.nodes] == [
        ("max_pool", (2, 4, 4), L0), ("flatten", (32,), "the output layer"), ("dense", (3,), "the output layer")]
    net = ModelSpec.parse({"layers": [{"flatten": {}}, {"dense": 4}]}, 6, 2, "classification").network
    assert [n.op for n in net.nodes] == ["dense", "dense"]          # flatten of vectors is no node


@pytest.mark.parametrize("h, kernel, stride, padding, dilation", [
    (8, 3, 1, 0, 1), (8, 3, 1, 1, 1), (9, 3, 2, 1, 1), (10, 4, 3, 0, 1), (7, 3, 1, 2, 2), (5, 5, 1, 0, 1),
    (6, 1, 2, 0, 1), (11, 2, 2, 1, 3),
])
def test_conv_and_pool_output_sizes(h, kernel, stride, padding, dilation):
    expected = (h + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    conv = {"conv": 2, "kernel": [kernel, 1], "stride": stride, "padding": [padding, 0], "dilation": [dilation, 1]}
    net = ModelSpec.parse(img(conv, shape=(1, h, 3)), 3 * h, 2, "classification").network
    assert net.nodes[0].shape == (2, expected, (3 - 1) // stride + 1)
    if dilation == 1 and 2 * padding <= kernel:
        for kind in ("max_pool", "avg_pool"):
            pool = {kind: [kernel, 1], "stride": stride, "padding": [padding, 0]}
            net = ModelSpec.parse(img(pool, shape=(1, h, 3)), 3 * h, 2, "classification").network
            assert net.nodes[0].shape == (1, expected, (3 - 1) // stride + 1)


# --- against PyTorch modules -----------------------------------------------------------------------

_TORCH_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


def torch_modules(net: Network) -> dict[int, nn.Module]:
    """One PyTorch module per node, from the node's layer and input shape: what runs after the
    node's inputs are joined (added or concatenated), its activation and dropout included."""
    modules = {}
    for node in net.nodes:
        l, c = node.layer, node.in_shapes[0][0]
        if node.op == "dense":
            m = nn.Linear(c, node.shape[0])
        elif node.op == "conv":
            m = nn.Conv2d(c, l.channels, l.kernel, l.stride, l.padding, l.dilation, l.groups, bias=l.bias)
        elif node.op == "batch_norm":
            m = (nn.BatchNorm2d if len(node.shape) == 3 else nn.BatchNorm1d)(c, eps=l.eps, momentum=l.momentum)
        elif node.op == "max_pool":
            m = nn.MaxPool2d(l.kernel, l.stride, l.padding)
        elif node.op == "avg_pool":
            m = nn.AvgPool2d(l.kernel, l.stride, l.padding)
        elif node.op == "global_avg_pool":
            m = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        elif node.op == "flatten":
            m = nn.Flatten()
        elif node.op == "dropout":
            m = nn.Dropout(l.p)
        else:                                               # activation, add, concat
            m = nn.Identity()
        tail = [_TORCH_ACTIVATIONS[node.activation]()] if node.activation != "none" else []
        if node.dropout:
            tail.append(nn.Dropout(node.dropout))
        modules[node.index] = nn.Sequential(m, *tail) if tail else m
    return modules


def torch_forward(net: Network, modules: dict[int, nn.Module], x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every node's output for network inputs x (N, F)."""
    values = {INPUT: x.reshape(len(x), *net.input_shape)}
    for node in net.nodes:
        ins = [values[j] for j in node.inputs]
        joined = ins[0] + ins[1] if node.op == "add" else torch.cat(ins, 1) if node.op == "concat" else ins[0]
        values[node.index] = modules[node.index](joined)
    return values


def load_torch(net: Network, modules: dict[int, nn.Module], weights: dict[str, np.ndarray]) -> None:
    """Copy the network's weights into the modules, checking every shape (a dense W (I, O) is
    nn.Linear's weight transposed)."""
    for node in net.nodes:
        i, m = node.index, modules[node.index]
        m = m[0] if isinstance(m, nn.Sequential) and node.op != "global_avg_pool" else m
        if node.op in ("dense", "conv"):
            w = weights[f"W{i}"].T if node.op == "dense" else weights[f"W{i}"]
            pairs = [(m.weight, w)] + ([(m.bias, weights[f"b{i}"])] if m.bias is not None else [])
            assert (m.bias is not None) == (f"b{i}" in node.params)
        elif node.op == "batch_norm":
            pairs = [(m.weight, weights[f"gamma{i}"]), (m.bias, weights[f"beta{i}"]),
                     (m.running_mean, weights[f"mean{i}"]), (m.running_var, weights[f"var{i}"])]
        else:
            pairs = []
        assert sum(p.numel() for p in m.parameters()) == sum(np.prod(s) for s in node.params.values())
        with torch.no_grad():
            for target, value in pairs:
                assert tuple(target.shape) == value.shape, (node.where, tuple(target.shape), value.shape)
                target.copy_(torch.from_numpy(np.ascontiguousarray(value)))


@pytest.mark.parametrize("name", list(NETS))
def test_shapes_and_parameter_counts_equal_torch_modules(name):
    net = spec_of(name).network
    modules = torch_modules(net)
    assert net.n_parameters() == sum(p.numel() for m in modules.values() for p in m.parameters())
    assert net.n_parameters() == sum(v.size for k, v in net.init_weights(0).items()
                                     if not k.startswith(("mean", "var")))
    load_torch(net, modules, net.init_weights(0))
    with torch.no_grad():
        values = torch_forward(net, modules, torch.zeros(2, net.n_features))
    for node in net.nodes:
        assert tuple(values[node.index].shape) == (2, *node.shape), node.where


@pytest.mark.parametrize("name", list(NETS))
def test_forward_agrees_with_torch_in_eval_mode(name):
    net = spec_of(name).network
    weights = random_weights(net, seed=3)
    x = np.random.default_rng(4).normal(size=(7, net.n_features)).astype(np.float32)
    out = net.forward(weights, x, chunk_rows=3)
    assert out.shape == (7, net.n_outputs) and out.dtype == np.float32

    modules = torch_modules(net)
    load_torch(net, modules, weights)
    for m in modules.values():
        m.eval()
    with torch.no_grad():
        ref = torch_forward(net, modules, torch.from_numpy(x))[net.nodes[-1].index].numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(ref).max()))
    assert net.forward(weights, x[:0]).shape == (0, net.n_outputs)
