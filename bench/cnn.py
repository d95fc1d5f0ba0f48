"""Convolutional workloads shared by the benchmarks, and what they print about them.

- The networks, as architecture JSON a user writes (:data:`SMALL_CNN`, :data:`RESNET`,
  :data:`VGG`): a small residual CNN with a concatenation, and two named networks of
  :mod:`tensile_db.runtime.zoo` narrowed to run in seconds on a two-core CPU.
- :func:`images`: generated labelled images (no data set is downloaded).
- :func:`torch_module`: the same network in ``torch.nn``, node for node, for comparisons with
  PyTorch (the parameter counts are equal; :func:`check_same_parameters` says so or raises).
- :func:`op_kind`: an op of a training program named by its kind (``conv backward``, ``adam``),
  to group per-op times into a profile; :func:`producer`: the ops that write a slot, by kind,
  to say what a recomputed tensor is.
- :func:`machine`: the line that labels every figure with the machine it was measured on.
"""

from __future__ import annotations

import math
import os
import platform
import re

import numpy as np

from tensile_db.runtime import model as models
from tensile_db.runtime import workers
from tensile_db.runtime.network import INPUT, Network
from tensile_db.runtime.program import Program

CLASSES = 10
IMAGE = [3, 32, 32]          # C, H, W of the generated images
#: A small CNN with a layer of every common kind (convolution, batch norm, a residual block, max
#: pool, a concatenation, global average pool, dense; about 0.97 accuracy on the 8x8 digits),
#: here on 3x32x32 images.
SMALL_CNN = {"input": {"shape": IMAGE}, "layers": [
    {"conv": 16, "kernel": 3, "padding": 1, "bias": False, "activation": "none"}, {"batch_norm": {}, "activation": "relu"},
    {"residual": [{"conv": 16, "padding": 1}, {"conv": 16, "padding": 1, "activation": "none"}], "activation": "relu"},
    {"max_pool": 2}, {"concat": [[], [{"conv": 8, "kernel": 1}]]},
    {"conv": 32, "padding": 1}, {"global_avg_pool": {}}, {"dense": 64}]}
#: ResNet-50's topology (bottleneck blocks 3, 4, 6, 3, batch norm) at an eighth of its channels:
#: many small tensors (474 ops an iteration).
RESNET = {"model": "resnet50", "width": 0.125, "input": {"shape": IMAGE}}
#: VGG-16's topology (13 convolutions, 5 max pools, two dense layers with dropout) at an eighth.
VGG = {"model": "vgg16", "width": 0.125, "input": {"shape": IMAGE}}


def spec_of(architecture: dict, n_features: int, n_classes: int = CLASSES) -> models.ModelSpec:
    """The classification model of ``architecture`` (JSON as a user writes it)."""
    return models.ModelSpec(models.parse_architecture(architecture), n_features, n_classes, "classification")


def describe(architecture: dict) -> str:
    """A short name of an architecture: the named model and its width, or its layer kinds."""
    shape = architecture.get("input", {}).get("shape")
    on = f" on {'x'.join(map(str, shape))}" if shape else ""
    if "model" in architecture:
        return f"{architecture['model']} width {architecture.get('width', 1)}{on}"
    return " ".join(next(k for k in layer if k != "activation") for layer in architecture["layers"]) + on


def images(n: int, shape=IMAGE, classes: int = CLASSES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` generated images, flattened: x (n, C·H·W) float32, y (n,) int32 class indices. Each
    class has a random template; an image is half its class's template plus unit normal noise,
    so the classes are learnable and every batch exercises the same arithmetic as real images."""
    rng = np.random.default_rng(seed)
    templates = rng.normal(size=(classes, math.prod(shape))).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int32)
    x = 0.5 * templates[y] + rng.normal(size=(n, math.prod(shape))).astype(np.float32)
    return x.astype(np.float32), y


# --- the same network in PyTorch ----------------------------------------------------------------


def torch_module(network: Network):
    """A ``torch.nn.Module`` computing ``network`` node for node (PyTorch's default
    initialisation): dense -> Linear, conv -> Conv2d (kernel, stride, padding, dilation, groups,
    bias), batch_norm -> BatchNorm1d/2d (eps, momentum), max_pool -> MaxPool2d, avg_pool ->
    AvgPool2d (zero padding counted), global_avg_pool -> mean over H and W, add, concat on the
    channels, flatten, dropout; each node's activation after it. Input: (B, F) float32 rows;
    output: (B, n_outputs) logits."""
    import torch
    from torch import nn

    acts = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "none": lambda h: h}
    without_weights = {"add": lambda ins: ins[0] + ins[1], "concat": lambda ins: torch.cat(ins, 1),
                       "flatten": lambda ins: torch.flatten(ins[0], 1),
                       "global_avg_pool": lambda ins: ins[0].mean((2, 3)), "activation": lambda ins: ins[0]}

    class Graph(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({str(n.index): m for n in network.nodes
                                         if (m := _torch_layer(nn, n)) is not None})

        def forward(self, x):
            values = {INPUT: x.reshape(len(x), *network.input_shape)}
            for node in network.nodes:
                ins = [values[j] for j in node.inputs]
                if node.op in without_weights:
                    h = without_weights[node.op](ins)
                else:
                    h = self.layers[str(node.index)](ins[0])
                h = acts[node.activation](h)
                if node.op == "dense" and node.dropout:
                    h = nn.functional.dropout(h, node.dropout, self.training)
                values[node.index] = h
            return values[network.nodes[-1].index]

    return Graph()


def _torch_layer(nn, node):
    """The ``torch.nn`` module of a node with weights or state (None for the others)."""
    l, in_shape = node.layer, node.in_shapes[0] if node.in_shapes else None
    if node.op == "dense":
        return nn.Linear(in_shape[0], node.shape[0])
    if node.op == "conv":
        return nn.Conv2d(in_shape[0], l.channels, l.kernel, l.stride, l.padding, l.dilation, l.groups, l.bias)
    if node.op == "batch_norm":
        kind = nn.BatchNorm2d if len(node.shape) == 3 else nn.BatchNorm1d
        return kind(node.shape[0], eps=l.eps, momentum=l.momentum)
    if node.op == "max_pool":
        return nn.MaxPool2d(l.kernel, l.stride, l.padding)
    if node.op == "avg_pool":
        return nn.AvgPool2d(l.kernel, l.stride, l.padding, count_include_pad=True)
    if node.op == "dropout":
        return nn.Dropout(l.p)
    return None


def check_same_parameters(network: Network, module) -> int:
    """The trained parameters of ``network``; raises AssertionError if ``module`` (its
    :func:`torch_module`) has another count."""
    ours, theirs = network.n_parameters(), sum(p.numel() for p in module.parameters())
    if ours != theirs:
        raise AssertionError(f"the PyTorch network has {theirs:,} parameters, ours {ours:,}")
    return ours


# --- naming ops and slots -----------------------------------------------------------------------


def op_kind(name: str) -> str:
    """The kind of a training program's op (:mod:`tensile_db.runtime.builder`'s names):
    ``conv3_backward`` -> ``conv backward``, ``relu4`` -> ``relu forward``, ``adam_W0`` ->
    ``adam``, ``accumulate_g1`` -> ``gradient accumulate``, ``load_batch`` -> ``load batch``."""
    if name.startswith(("adam_", "sgd_")):
        return name.split("_")[0]
    if name.startswith("accumulate_"):
        return "gradient accumulate"
    if name == "load_batch":
        return "load batch"
    base = re.sub(r"\d+", "", name)
    if base.endswith("_replay"):
        return f"{base.removesuffix('_replay')} replay"
    if base.endswith("_backward"):
        return f"{base.removesuffix('_backward')} backward"
    return base if base == "dropout_mask" else f"{base} forward"


def producer(program: Program, slot: str) -> str:
    """What writes ``slot`` in the forward pass: the kinds of its writer ops before its first
    read, joined with ``+`` (``conv+relu``: a convolution and its in-place activation)."""
    writers = []
    for p in program.positions[slot]:
        op = program.ops[p]
        if slot not in op.writes:
            break
        writers.append(op_kind(op.name).removesuffix(" forward"))
    return "+".join(writers) or "?"


# --- the machine --------------------------------------------------------------------------------


def machine() -> str:
    """``cpu: <model name>, N cores, NumPy BLAS T threads``: the device every figure is from."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"cpu ({name}, {os.cpu_count()} cores, NumPy's BLAS on {workers.count()} threads)"
