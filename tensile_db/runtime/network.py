"""Networks: the layers of an architecture as a graph of nodes with shapes and parameters.

An architecture (JSON, validated by :func:`parse_layers`) is a list of layers; blocks nest lists:
a residual block adds its body to a shortcut, a concatenation joins branches on the channel axis.
:func:`build_network` turns it into a :class:`Network`: its nodes in topological (execution) order,
each with the nodes it reads, its output shape per row, and its parameters. The training program
(:mod:`.builder`), inference on the host (:func:`Network.forward`) and demand-layered inference
in the coordinator (:mod:`tensile_db.inference.layered`) all read this one graph.

Layout is NCHW: an image row is (C, H, W); a vector row is (F,). The last node is always the
output layer, a dense layer to the task's outputs, which the architecture does not list.

Parameters are named by node index ``i`` (counting nodes from 0 in execution order): ``W{i}`` and
``b{i}`` for a dense layer (W (I, O)) or a convolution (W (O, C/groups, KH, KW), b only with a
bias); ``gamma{i}``, ``beta{i}`` and the running statistics ``mean{i}``, ``var{i}`` (C,) for batch
normalisation. An MLP's nodes are its dense layers, so its weights are ``W0, b0, W1, ...``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..errors import InvalidArgument
from . import conv_kernels as ck
from . import kernels
from .checks import check_keys, shown

ACTIVATIONS = ("relu", "tanh", "sigmoid", "none")
#: Largest width of one dense layer and largest channel count of a convolution.
MAX_WIDTH = 1 << 16
#: Largest kernel side, stride, padding and dilation of a convolution or a pooling window.
MAX_WINDOW = 64
#: Deepest nesting of blocks (a residual inside a concatenation inside ...).
MAX_DEPTH = 8


# --- layers as written -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """A dense layer: ``units`` outputs, an activation, a dropout probability (applied after the
    activation, at training only)."""

    units: int
    activation: str = "relu"
    dropout: float = 0.0


@dataclass(frozen=True)
class Conv:
    """A 2-D convolution to ``channels`` output channels, then an activation."""

    channels: int
    kernel: tuple[int, int] = (3, 3)
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    bias: bool = True
    activation: str = "relu"


@dataclass(frozen=True)
class BatchNorm:
    """Batch normalisation over the batch (and H, W) per channel, then an activation."""

    momentum: float = 0.1
    eps: float = 1e-5
    activation: str = "none"


@dataclass(frozen=True)
class Pool:
    """Max or average pooling (``kind``: ``max`` or ``avg``) over a window."""

    kind: str
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class GlobalAvgPool:
    """(C, H, W) -> (C,): the mean of each channel."""


@dataclass(frozen=True)
class Flatten:
    """(C, H, W) -> (C·H·W,), C-order."""


@dataclass(frozen=True)
class Activation:
    name: str


@dataclass(frozen=True)
class Dropout:
    p: float


@dataclass(frozen=True)
class Residual:
    """``activation(body(x) + shortcut(x))``; an empty shortcut is the identity."""

    body: tuple
    shortcut: tuple = ()
    activation: str = "none"


@dataclass(frozen=True)
class Concat:
    """The branches' outputs joined on the channel axis; an empty branch is the identity."""

    branches: tuple


#: Each layer kind's key and the other keys it allows.
_KEYS = {
    "dense": ("activation", "dropout"),
    "conv": ("kernel", "stride", "padding", "dilation", "groups", "bias", "activation"),
    "batch_norm": ("activation",),
    "max_pool": ("stride", "padding"),
    "avg_pool": ("stride", "padding"),
    "global_avg_pool": (),
    "flatten": (),
    "residual": ("shortcut", "activation"),
    "concat": (),
}
LAYER_KINDS = tuple(_KEYS) + ("activation", "dropout")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(layer: dict, key: str, where: str, default, low: int, high: int) -> int:
    v = layer.get(key, default)
    if not _is_int(v) or not low <= v <= high:
        raise InvalidArgument(f'{where}."{key}" must be an integer from {low} to {high}, got {shown(v)}')
    return v


def _pair(layer: dict, key: str, where: str, default, low: int) -> tuple[int, int]:
    written = layer.get(key, default)
    v = [written, written] if _is_int(written) else written
    if (not isinstance(v, (list, tuple)) or len(v) != 2 or not all(_is_int(e) and low <= e <= MAX_WINDOW for e in v)):
        raise InvalidArgument(f'{where}."{key}" must be an integer from {low} to {MAX_WINDOW} or a pair [h, w] of '
                              f"them, got {shown(written)}")
    return int(v[0]), int(v[1])


def _activation(layer: dict, where: str, default: str) -> str:
    v = layer.get("activation", default)
    if v not in ACTIVATIONS:
        raise InvalidArgument(f'{where}."activation" must be one of {", ".join(ACTIVATIONS)}, got {shown(v)}')
    return v


def _probability(v, where: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1:
        raise InvalidArgument(f"{where} must be a number in [0, 1), got {shown(v)}")
    return float(v)


def parse_layers(layers, where: str, depth: int = 0) -> tuple:
    """Validate a list of layers as written in an architecture (see the README's table) and return
    them as layer objects. ``where`` names the list in errors (``architecture.layers``). Raises
    InvalidArgument naming the layer and the field, the value and what is allowed."""
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"{where}: blocks nest more than {MAX_DEPTH} deep")
    if not isinstance(layers, list):
        raise InvalidArgument(f"{where} must be an array of layers, got {shown(layers)}")
    return tuple(_parse_layer(layer, f"{where}[{i}]", depth) for i, layer in enumerate(layers))


def _parse_layer(layer, where: str, depth: int):
    if not isinstance(layer, dict):
        raise InvalidArgument(f'{where} must be an object like {{"dense": 128}}, got {shown(layer)}')
    kinds = [k for k in _KEYS if k in layer]
    if not kinds:
        if set(layer) == {"activation"}:
            return Activation(_activation(layer, where, "none"))
        if set(layer) == {"dropout"}:
            return Dropout(_probability(layer["dropout"], f'{where}."dropout"'))
        raise InvalidArgument(f"{where} must have one of the keys {', '.join(LAYER_KINDS)}, got {shown(layer)}")
    if len(kinds) > 1:
        raise InvalidArgument(f"{where} has the keys {' and '.join(kinds)}; a layer is of one kind: split it in two")
    kind = kinds[0]
    check_keys(layer, (kind,) + _KEYS[kind], where, f"a {kind} layer")
    value = layer[kind]
    if kind == "dense":
        units = _int(layer, "dense", where, None, 1, MAX_WIDTH)
        return Layer(units, _activation(layer, where, "relu"), _probability(layer.get("dropout", 0.0),
                                                                            f'{where}."dropout"'))
    if kind == "conv":
        return Conv(_int(layer, "conv", where, None, 1, MAX_WIDTH), _pair(layer, "kernel", where, 3, 1),
                    _pair(layer, "stride", where, 1, 1), _pair(layer, "padding", where, 0, 0),
                    _pair(layer, "dilation", where, 1, 1), _int(layer, "groups", where, 1, 1, MAX_WIDTH),
                    _bool(layer, "bias", where, True), _activation(layer, where, "relu"))
    if kind == "batch_norm":
        return _parse_batch_norm(layer, where)
    if kind in ("max_pool", "avg_pool"):
        kernel = _pair(layer, kind, where, None, 1)
        return Pool(kind[:3], kernel, _pair(layer, "stride", where, list(kernel), 1),
                    _pair(layer, "padding", where, 0, 0))
    if kind in ("global_avg_pool", "flatten"):
        if value is not True and value != {}:              # not ``in ({}, True)``: 1 == True
            raise InvalidArgument(f'{where}."{kind}" takes no options: write {{"{kind}": {{}}}}, got {shown(value)}')
        return GlobalAvgPool() if kind == "global_avg_pool" else Flatten()
    return _parse_block(kind, layer, where, depth)


def _parse_batch_norm(layer: dict, where: str) -> BatchNorm:
    value = layer["batch_norm"]
    options = {} if value is True else value
    if not isinstance(options, dict):
        raise InvalidArgument(f'{where}."batch_norm" must be an object such as {{}} or {{"momentum": 0.1, '
                              f'"eps": 1e-5}}, got {shown(value)}')
    check_keys(options, ("momentum", "eps"), f'{where}."batch_norm"')
    momentum, eps = options.get("momentum", 0.1), options.get("eps", 1e-5)
    if not isinstance(momentum, (int, float)) or isinstance(momentum, bool) or not 0 <= momentum <= 1:
        raise InvalidArgument(f'{where}."batch_norm"."momentum" must be a number in [0, 1], got {shown(momentum)}')
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 1e-12 <= eps <= 1:
        raise InvalidArgument(f'{where}."batch_norm"."eps" must be a number in [1e-12, 1], got {shown(eps)}')
    return BatchNorm(float(momentum), float(eps), _activation(layer, where, "none"))


def _parse_block(kind: str, layer: dict, where: str, depth: int) -> Residual | Concat:
    """A ``residual`` or ``concat`` layer: blocks of layers, one level deeper."""
    value = layer[kind]
    if kind == "residual":
        body = parse_layers(value, f"{where}.residual", depth + 1)
        if not body:
            raise InvalidArgument(f"{where}.residual must hold at least one layer")
        return Residual(body, parse_layers(layer.get("shortcut", []), f"{where}.shortcut", depth + 1),
                        _activation(layer, where, "none"))
    if not isinstance(value, list) or len(value) < 2:
        raise InvalidArgument(f"{where}.concat must be an array of at least two branches (arrays of layers; [] is the "
                              f"identity), got {shown(value)}")
    return Concat(tuple(parse_layers(b, f"{where}.concat[{i}]", depth + 1) for i, b in enumerate(value)))


def _bool(layer: dict, key: str, where: str, default: bool) -> bool:
    v = layer.get(key, default)
    if not isinstance(v, bool):
        raise InvalidArgument(f'{where}."{key}" must be true or false, got {shown(v)}')
    return v


def layers_to_json(layers) -> list:
    """The layer objects back as the JSON a user writes (with every default spelled out)."""
    out = []
    for l in layers:
        if isinstance(l, Layer):
            out.append({"dense": l.units, "activation": l.activation, **({"dropout": l.dropout} if l.dropout else {})})
        elif isinstance(l, Conv):
            out.append({"conv": l.channels, "kernel": list(l.kernel), "stride": list(l.stride),
                        "padding": list(l.padding), "dilation": list(l.dilation), "groups": l.groups,
                        "bias": l.bias, "activation": l.activation})
        elif isinstance(l, BatchNorm):
            out.append({"batch_norm": {"momentum": l.momentum, "eps": l.eps}, "activation": l.activation})
        elif isinstance(l, Pool):
            out.append({f"{l.kind}_pool": list(l.kernel), "stride": list(l.stride), "padding": list(l.padding)})
        elif isinstance(l, GlobalAvgPool):
            out.append({"global_avg_pool": {}})
        elif isinstance(l, Flatten):
            out.append({"flatten": {}})
        elif isinstance(l, Activation):
            out.append({"activation": l.name})
        elif isinstance(l, Dropout):
            out.append({"dropout": l.p})
        elif isinstance(l, Residual):
            out.append({"residual": layers_to_json(l.body), "shortcut": layers_to_json(l.shortcut),
                        "activation": l.activation})
        else:
            out.append({"concat": [layers_to_json(b) for b in l.branches]})
    return out


# --- the graph ---------------------------------------------------------------------------------------


#: Input index of a node that reads the network's input.
INPUT = -1


@dataclass(frozen=True)
class Node:
    """One node of a network.

    ``op``: ``dense``, ``conv``, ``batch_norm``, ``max_pool``, ``avg_pool``, ``global_avg_pool``,
    ``flatten``, ``activation``, ``dropout``, ``add`` or ``concat``. ``inputs``: the nodes it reads
    (:data:`INPUT` for the network's input). ``shape``: its output per row, (C, H, W) or (F,).
    ``activation`` runs on the output in place (``none``: no activation); ``dropout`` is a dense
    layer's dropout after it, or a dropout node's probability. ``layer``: the layer as written
    (for a convolution's or pool's window, batch norm's momentum and eps). ``where``: the layer's
    place in the architecture, for errors."""

    index: int
    op: str
    inputs: tuple[int, ...]
    shape: tuple[int, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    where: str
    activation: str = "none"
    dropout: float = 0.0
    layer: object = field(default=None, compare=False)

    def geometry(self, batch: int) -> ck.ConvGeometry:
        """The window geometry of a convolution or pooling node at ``batch`` rows."""
        l, (c, h, w) = self.layer, self.in_shapes[0]
        if self.op == "conv":
            return ck.ConvGeometry(batch, c, h, w, l.channels, l.kernel, l.stride, l.padding, l.dilation, l.groups)
        return ck.ConvGeometry(batch, c, h, w, c, l.kernel, l.stride, l.padding)

    @property
    def params(self) -> dict[str, tuple[int, ...]]:
        """The node's trained parameters: name -> shape (float32)."""
        i, l = self.index, self.layer
        if self.op == "dense":
            return {f"W{i}": (self.in_shapes[0][0], self.shape[0]), f"b{i}": (self.shape[0],)}
        if self.op == "conv":
            c = self.in_shapes[0][0]
            shapes = {f"W{i}": (l.channels, c // l.groups, *l.kernel)}
            return {**shapes, f"b{i}": (l.channels,)} if l.bias else shapes
        if self.op == "batch_norm":
            return {f"gamma{i}": self.shape[:1], f"beta{i}": self.shape[:1]}
        return {}

    @property
    def buffers(self) -> dict[str, tuple[int, ...]]:
        """State kept with the weights but not trained: batch norm's running mean and variance."""
        i = self.index
        return {f"mean{i}": self.shape[:1], f"var{i}": self.shape[:1]} if self.op == "batch_norm" else {}

    @property
    def weights(self) -> dict[str, tuple[int, ...]]:
        """Parameters and buffers: every array the node keeps in a stored model."""
        return {**self.params, **self.buffers}

    def workspace_nelems(self, batch: int) -> int:
        """float32 elements of the forward pass's workspace at ``batch`` rows (0: none): the
        convolution's padded input, im2col matrix and product, or a pool's padded input."""
        if self.op == "conv":
            return self.geometry(batch).chunked_workspace_nelems
        if self.op in ("max_pool", "avg_pool"):
            return math.prod(self.geometry(batch).padded_shape)
        return 0


def pool_workspace(geometry: ck.ConvGeometry, flat):
    return flat[:math.prod(geometry.padded_shape)].reshape(geometry.padded_shape)


@dataclass
class Network:
    """The nodes of a network in execution order, the output layer last; ``input_shape`` per row."""

    input_shape: tuple[int, ...]
    nodes: list[Node]

    @cached_property
    def consumers(self) -> dict[int, list[int]]:
        """Node index (or INPUT) -> the nodes that read it, in order."""
        out: dict[int, list[int]] = {INPUT: []}
        for node in self.nodes:
            out.setdefault(node.index, [])
            for j in node.inputs:
                out[j].append(node.index)
        return out

    @property
    def n_features(self) -> int:
        return math.prod(self.input_shape)

    @property
    def n_outputs(self) -> int:
        return self.nodes[-1].shape[0]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every array of a stored model (parameters and buffers), in node order."""
        return {k: v for node in self.nodes for k, v in node.weights.items()}

    def n_parameters(self) -> int:
        """Trained parameters (batch norm's running statistics not counted, as in PyTorch)."""
        return sum(math.prod(s) for node in self.nodes for s in node.params.values())

    @property
    def layered(self) -> list[Node]:
        """The nodes that hold weights, in execution order: the layers demand layering streams."""
        return [n for n in self.nodes if n.weights]

    def init_weights(self, seed: int) -> dict[str, np.ndarray]:
        """Float32 initial weights: He-uniform (relu) or Glorot-uniform (other activations) for
        dense and convolution weights, zero biases, batch norm gamma 1, beta 0, running mean 0,
        running variance 1. Fixed by ``seed``."""
        return dict(self.iter_init_weights(seed))

    def iter_init_weights(self, seed: int):
        """The arrays of :meth:`init_weights` one at a time, as ``(name, array)`` in node order:
        the same values, without holding every array at once (a training job adopts each as it
        comes, so a model larger than the host budget goes to the disk tier array by array)."""
        rng = np.random.default_rng(seed)
        for node in self.nodes:
            weights: dict[str, np.ndarray] = {}
            i = node.index
            if node.op in ("dense", "conv"):
                shape = node.params[f"W{i}"]
                if node.op == "dense":
                    fan_in, fan_out = shape
                else:
                    fan_in, fan_out = math.prod(shape[1:]), shape[0] * math.prod(shape[2:])
                relu = node.activation == "relu" or (node.op == "conv" and node.activation == "none")
                limit = math.sqrt(6.0 / fan_in) if relu else math.sqrt(6.0 / (fan_in + fan_out))
                weights[f"W{i}"] = rng.uniform(-limit, limit, size=shape).astype(np.float32)
                if f"b{i}" in node.params:
                    weights[f"b{i}"] = np.zeros(node.params[f"b{i}"], dtype=np.float32)
            elif node.op == "batch_norm":
                c = node.shape[0]
                weights[f"gamma{i}"], weights[f"var{i}"] = np.ones(c, np.float32), np.ones(c, np.float32)
                weights[f"beta{i}"], weights[f"mean{i}"] = np.zeros(c, np.float32), np.zeros(c, np.float32)
            yield from weights.items()

    def forward(self, weights: dict[str, np.ndarray], x: np.ndarray, chunk_rows: int = 256) -> np.ndarray:
        """Inference on the host: network inputs x (N, F) float32 (already scaled) -> the output
        layer's values (N, n_outputs) float32, ``chunk_rows`` rows at a time. Batch norm uses the
        running statistics; dropout is the identity."""
        outs = []
        for start in range(0, len(x), chunk_rows):
            part = np.asarray(x[start:start + chunk_rows], np.float32)
            values: dict[int, np.ndarray] = {INPUT: part.reshape(len(part), *self.input_shape)}
            left = {k: len(v) for k, v in self.consumers.items()}
            for node in self.nodes:
                out = np.empty((len(part), *node.shape), np.float32)
                ws = np.empty(node.workspace_nelems(len(part)), np.float32)
                evaluate(node, [values[j] for j in node.inputs], weights, out, ws)
                values[node.index] = out
                for j in node.inputs:
                    left[j] -= 1
                    if not left[j]:
                        del values[j]
            outs.append(values[self.nodes[-1].index])
        return np.concatenate(outs) if outs else np.empty((0, self.n_outputs), np.float32)


def evaluate(node: Node, inputs: list, weights: dict, out, workspace) -> None:
    """One node at inference, into ``out`` (B, *node.shape): batch norm with its running
    statistics, dropout as the identity, then the node's activation in place. ``inputs``: the
    arrays of ``node.inputs`` (B, *shape); ``weights``: at least the node's arrays by name
    (:attr:`Node.weights`); ``workspace``: a flat float32 array of at least
    :meth:`Node.workspace_nelems` elements. NumPy or CuPy arrays."""
    i, x, batch = node.index, inputs[0], out.shape[0]
    if node.op == "dense":
        kernels.dense_forward(x.reshape(batch, -1), weights[f"W{i}"], weights[f"b{i}"], out)
    elif node.op == "conv":
        g = node.geometry(batch)
        ck.conv2d_forward_chunked(x, weights[f"W{i}"], weights.get(f"b{i}"), out, g, workspace)
    elif node.op == "batch_norm":
        xp = kernels.array_module(out)
        invstd = 1.0 / xp.sqrt(weights[f"var{i}"] + np.float32(node.layer.eps))
        ck.batch_norm_apply(x, weights[f"gamma{i}"], weights[f"beta{i}"], weights[f"mean{i}"],
                            invstd.astype(np.float32), out)
    elif node.op == "max_pool":
        g = node.geometry(batch)
        ck.max_pool_forward(x, out, None, g, pool_workspace(g, workspace))
    elif node.op == "avg_pool":
        g = node.geometry(batch)
        ck.avg_pool_forward(x, out, g, pool_workspace(g, workspace))
    elif node.op == "global_avg_pool":
        ck.global_avg_pool_forward(x, out)
    elif node.op == "add":
        ck.add_forward(inputs[0], inputs[1], out)
    elif node.op == "concat":
        ck.concat_forward(inputs, out)
    else:                                                  # flatten, activation, dropout: a copy
        out[...] = x.reshape(out.shape)
    if node.activation != "none":
        kernels.ACTIVATIONS[node.activation][0](out, out)


def build_network(layers, input_shape: tuple[int, ...] | None, n_features: int, n_outputs: int,
                  where: str = "architecture.layers") -> Network:
    """The network of parsed ``layers`` (:func:`parse_layers`) on rows of ``input_shape`` ((C, H, W)
    or (F,); None: (n_features,)), with the output layer to ``n_outputs`` appended. Raises
    InvalidArgument naming the layer whose input does not suit it (a convolution on vectors, a
    kernel larger than its padded input, a residual whose two sides differ in shape, ...)."""
    shape = tuple(input_shape) if input_shape else (n_features,)
    if math.prod(shape) != n_features:
        raise InvalidArgument(f"architecture.input.shape {list(shape)} holds {math.prod(shape):,} values per row, but "
                              f"the data has {n_features:,} feature columns; give the input shape of the rows")
    b = _Builder(shape)
    last = b.chain(layers, INPUT, where)
    if len(b.shape_of(last)) == 3:
        last = b.add("flatten", [last], (math.prod(b.shape_of(last)),), "the output layer")
    b.add("dense", [last], (n_outputs,), "the output layer", "none", layer=Layer(n_outputs, "none"))
    return Network(shape, b.nodes)


class _Builder:
    """The nodes of a network being built from parsed layers (:func:`build_network`): one method
    per layer kind, each checking that its input suits it and adding its node(s)."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape
        self.nodes: list[Node] = []

    def add(self, op, inputs, out_shape, where, activation="none", dropout=0.0, layer=None) -> int:
        in_shapes = tuple(self.shape_of(j) for j in inputs)
        self.nodes.append(Node(len(self.nodes), op, tuple(inputs), tuple(int(d) for d in out_shape), in_shapes,
                               where, activation, dropout, layer))
        return len(self.nodes) - 1

    def shape_of(self, j: int) -> tuple[int, ...]:
        return self.shape if j == INPUT else self.nodes[j].shape

    def image(self, j: int, where: str, what: str) -> tuple[int, int, int]:
        s = self.shape_of(j)
        if len(s) != 3:
            raise InvalidArgument(f"{where}: a {what} needs images (C, H, W) as input, got vectors of {s[0]}; "
                                  'give the rows\' shape as "input": {"shape": [C, H, W]} and put it before any '
                                  "dense, flatten or global_avg_pool layer")
        return s

    def chain(self, layers, j: int, where: str) -> int:
        for k, layer in enumerate(layers):
            j = _BUILDS[type(layer)](self, layer, j, f"{where}[{k}]")
        return j

    def dense(self, l: Layer, j: int, where: str) -> int:
        if len(self.shape_of(j)) == 3:
            j = self.add("flatten", [j], (math.prod(self.shape_of(j)),), where)
        return self.add("dense", [j], (l.units,), where, l.activation, l.dropout, l)

    def conv(self, l: Conv, j: int, where: str) -> int:
        c, h, w = self.image(j, where, "convolution")
        if c % l.groups or l.channels % l.groups:
            raise InvalidArgument(f'{where}."groups" {l.groups} must divide the input channels ({c}) and the '
                                  f"output channels ({l.channels})")
        g = _geometry(where, c, h, w, l.channels, l.kernel, l.stride, l.padding, l.dilation, l.groups)
        return self.add("conv", [j], g.out_shape[1:], where, l.activation, layer=l)

    def batch_norm(self, l: BatchNorm, j: int, where: str) -> int:
        return self.add("batch_norm", [j], self.shape_of(j), where, l.activation, layer=l)

    def pool(self, l: Pool, j: int, where: str) -> int:
        c, h, w = self.image(j, where, f"{l.kind}_pool")
        if any(2 * p > k for p, k in zip(l.padding, l.kernel)):
            raise InvalidArgument(f'{where}."padding" {list(l.padding)} must be at most half the window '
                                  f"{list(l.kernel)}")
        g = _geometry(where, c, h, w, c, l.kernel, l.stride, l.padding, (1, 1), 1)
        return self.add(f"{l.kind}_pool", [j], g.out_shape[1:], where, layer=l)

    def global_avg_pool(self, l: GlobalAvgPool, j: int, where: str) -> int:
        return self.add("global_avg_pool", [j], self.image(j, where, "global_avg_pool")[:1], where)

    def flatten(self, l: Flatten, j: int, where: str) -> int:
        return j if len(self.shape_of(j)) == 1 else self.add("flatten", [j], (math.prod(self.shape_of(j)),), where)

    def activation(self, l: Activation, j: int, where: str) -> int:
        return self.add("activation", [j], self.shape_of(j), where, l.name)

    def dropout(self, l: Dropout, j: int, where: str) -> int:
        return self.add("dropout", [j], self.shape_of(j), where, dropout=l.p)

    def residual(self, l: Residual, j: int, where: str) -> int:
        body = self.chain(l.body, j, f"{where}.residual")
        short = self.chain(l.shortcut, j, f"{where}.shortcut")
        if self.shape_of(body) != self.shape_of(short):
            raise InvalidArgument(f"{where}: the residual body gives {list(self.shape_of(body))} per row but the "
                                  f"shortcut gives {list(self.shape_of(short))}; they are added, so they must match "
                                  "(give the shortcut a 1x1 convolution with the body's channels and stride)")
        if body == short:
            raise InvalidArgument(f"{where}: the residual body must hold at least one layer")
        return self.add("add", [body, short], self.shape_of(body), where, l.activation)

    def concat(self, l: Concat, j: int, where: str) -> int:
        ends = [self.chain(b, j, f"{where}.concat[{k}]") for k, b in enumerate(l.branches)]
        shapes = [self.shape_of(e) for e in ends]
        if any(len(s) != 3 for s in shapes) or len({s[1:] for s in shapes}) != 1:
            raise InvalidArgument(f"{where}: the branches give {[list(s) for s in shapes]} per row; concatenation "
                                  "joins images (C, H, W) of the same H and W")
        return self.add("concat", ends, (sum(s[0] for s in shapes), *shapes[0][1:]), where)


#: Each parsed layer kind's method of :class:`_Builder`.
_BUILDS = {Layer: _Builder.dense, Conv: _Builder.conv, BatchNorm: _Builder.batch_norm, Pool: _Builder.pool,
           GlobalAvgPool: _Builder.global_avg_pool, Flatten: _Builder.flatten, Activation: _Builder.activation,
           Dropout: _Builder.dropout, Residual: _Builder.residual, Concat: _Builder.concat}


def _geometry(where: str, c, h, w, out, kernel, stride, padding, dilation, groups) -> ck.ConvGeometry:
    try:
        return ck.ConvGeometry(1, c, h, w, out, kernel, stride, padding, dilation, groups)
    except ValueError:
        raise InvalidArgument(f"{where}: a {list(kernel)} window (dilation {list(dilation)}, padding "
                              f"{list(padding)}) does not fit its input of {h}x{w}; use a smaller kernel, more "
                              "padding, or fewer pooling layers before it") from None
