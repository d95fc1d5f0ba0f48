"""The registries every layer kind fills, and what the kinds share.

A layer kind lives in one module of this package. It registers

- its layer class (:func:`layer_kind`): the JSON keys that name it and the other keys it allows,
  ``parse`` (the value as written -> a frozen layer object, or InvalidArgument naming the field),
  ``to_json`` (the object back as JSON, defaults spelled out) and ``build`` (the node(s) it adds to
  a network being built, after checking that its input suits it);
- the ops of the nodes it adds (:func:`node_op`, a :class:`NodeOp`): their parameters, buffers,
  workspace, initial weights, inference (:meth:`NodeOp.evaluate`) and the training program's
  forward and backward ops (:meth:`NodeOp.forward`, :meth:`NodeOp.backward`);
- and, for an activation, its kernels (:func:`register_activation`).

:mod:`tensile_db.runtime.network` parses, builds and evaluates through these registries, and
:mod:`tensile_db.runtime.builder` emits the training program through them; neither names a kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...errors import InvalidArgument
from .. import conv_kernels as ck
from .. import kernels
from ..checks import check_keys, shown

#: Largest width of one dense layer and largest channel count of a convolution.
MAX_WIDTH = 1 << 16
#: Largest kernel side, stride, padding and dilation of a convolution or a pooling window.
MAX_WINDOW = 64
#: Deepest nesting of blocks (a residual inside a concatenation inside ...).
MAX_DEPTH = 8
#: Input index of a node that reads the network's input.
INPUT = -1


# --- activations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationKernels:
    """An activation's kernels: ``forward(x, out)`` elementwise (``out`` may be ``x``), and
    ``backward(saved, dy, dx)``, where ``saved`` is the forward output, or the forward input when
    ``saves_input`` (an activation whose derivative is not a function of its output, as GELU's)."""

    forward: object
    backward: object
    saves_input: bool = False


#: Activation name -> its kernels; ``none`` is no activation and has no entry.
ACTIVATIONS: dict[str, ActivationKernels] = {name: ActivationKernels(f, b) for name, (f, b) in kernels.ACTIVATIONS.items()}


def register_activation(name: str, forward, backward, saves_input: bool = False) -> None:
    """Make ``name`` an activation a layer's ``activation`` field may name (:class:`ActivationKernels`)."""
    ACTIVATIONS[name] = ActivationKernels(forward, backward, saves_input)


def activation_names() -> tuple[str, ...]:
    return (*ACTIVATIONS, "none")


# --- parsing helpers -------------------------------------------------------------------------------


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_option(layer: dict, key: str, where: str, default, low: int, high: int) -> int:
    v = layer.get(key, default)
    if not is_int(v) or not low <= v <= high:
        raise InvalidArgument(f'{where}."{key}" must be an integer from {low} to {high}, got {shown(v)}')
    return v


def pair_option(layer: dict, key: str, where: str, default, low: int) -> tuple[int, int]:
    written = layer.get(key, default)
    v = [written, written] if is_int(written) else written
    if (not isinstance(v, (list, tuple)) or len(v) != 2 or not all(is_int(e) and low <= e <= MAX_WINDOW for e in v)):
        raise InvalidArgument(f'{where}."{key}" must be an integer from {low} to {MAX_WINDOW} or a pair [h, w] of '
                              f"them, got {shown(written)}")
    return int(v[0]), int(v[1])


def bool_option(layer: dict, key: str, where: str, default: bool) -> bool:
    v = layer.get(key, default)
    if not isinstance(v, bool):
        raise InvalidArgument(f'{where}."{key}" must be true or false, got {shown(v)}')
    return v


def activation_option(layer: dict, where: str, default: str) -> str:
    v = layer.get("activation", default)
    if v not in activation_names():
        raise InvalidArgument(f'{where}."activation" must be one of {", ".join(activation_names())}, got {shown(v)}')
    return v


def probability(v, where: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1:
        raise InvalidArgument(f"{where} must be a number in [0, 1), got {shown(v)}")
    return float(v)


def number_option(options: dict, key: str, where: str, default: float, low: float, high: float) -> float:
    v = options.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v <= high:
        raise InvalidArgument(f'{where}."{key}" must be a number in [{low:g}, {high:g}], got {shown(v)}')
    return float(v)


def options_object(layer: dict, key: str, where: str, allowed: tuple[str, ...], example: str) -> dict:
    """The options object of a kind written ``{"<key>": {...}}`` (``true`` for ``{}``), with its
    keys checked."""
    value = layer[key]
    options = {} if value is True else value
    if not isinstance(options, dict):
        raise InvalidArgument(f'{where}."{key}" must be an object such as {{}} or {example}, got {shown(value)}')
    check_keys(options, allowed, f'{where}."{key}"')
    return options


def no_options(layer: dict, key: str, where: str) -> None:
    """Check the value of a kind that takes no options: ``{}`` (or ``true``)."""
    value = layer[key]
    if value is not True and value != {}:                  # not ``in ({}, True)``: 1 == True
        raise InvalidArgument(f'{where}."{key}" takes no options: write {{"{key}": {{}}}}, got {shown(value)}')


# --- layer kinds ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerKind:
    """A registered kind: its class, the keys it allows beside its own, and whether it is
    written alone (``{"activation": "relu"}``, ``{"dropout": 0.2}``: keys that are also options of
    other kinds, so a layer is of this kind only when it has no other key)."""

    cls: type
    options: tuple[str, ...]
    standalone: bool


#: JSON key -> its kind.
KINDS: dict[str, LayerKind] = {}


def layer_kind(*keys: str, options: tuple[str, ...] = (), standalone: bool = False):
    """Class decorator: register a layer class under ``keys``. The class provides
    ``parse(key, layer, where, depth)`` (a classmethod), ``to_json()`` and ``build(b, j, where)``
    (``b`` a :class:`GraphBuilder`, ``j`` the node it reads; returns its last node)."""
    def register(cls):
        for key in keys:
            if key in KINDS:
                raise ValueError(f"layer kind {key!r} is registered twice")
            KINDS[key] = LayerKind(cls, tuple(options), standalone)
        return cls
    return register


def layer_keys() -> tuple[str, ...]:
    """Every key that names a layer kind, sorted."""
    return tuple(sorted(KINDS))


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
    named = [k for k in layer if k in KINDS and not KINDS[k].standalone]    # in the order written
    if not named:
        alone = [k for k in layer if k in KINDS and set(layer) == {k}]
        if not alone:
            raise InvalidArgument(f"{where} must have one of the keys {', '.join(layer_keys())}, got {shown(layer)}")
        named = alone
    if len(named) > 1:
        raise InvalidArgument(f"{where} has the keys {' and '.join(named)}; a layer is of one kind: split it in two")
    key = named[0]
    kind = KINDS[key]
    check_keys(layer, (key,) + kind.options, where, f"a {key} layer")
    return kind.cls.parse(key, layer, where, depth)


def layers_to_json(layers) -> list:
    """The layer objects back as the JSON a user writes (with every default spelled out)."""
    return [layer.to_json() for layer in layers]


# --- nodes -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One node of a network.

    ``op``: a registered op (:data:`OPS`: ``dense``, ``conv``, ``batch_norm``, ``max_pool``, ...,
    ``add``, ``concat``). ``inputs``: the nodes it reads (:data:`INPUT` for the network's input).
    ``shape``: its output per row, (C, H, W) or (F,). ``activation`` runs on the output (``none``:
    no activation); ``dropout`` is a dropout after it at training (a dense layer's). ``layer``:
    the layer as written (a convolution's or pool's window, batch norm's momentum and eps, a
    dropout node's probability). ``where``: the layer's place in the architecture, for errors."""

    index: int
    op: str
    inputs: tuple[int, ...]
    shape: tuple[int, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    where: str
    activation: str = "none"
    dropout: float = 0.0
    layer: object = field(default=None, compare=False)

    @property
    def kind(self) -> NodeOp:
        return OPS[self.op]

    def geometry(self, batch: int) -> ck.ConvGeometry:
        """The window geometry of a convolution or pooling node at ``batch`` rows."""
        return self.kind.geometry(self, batch)

    @property
    def params(self) -> dict[str, tuple[int, ...]]:
        """The node's trained parameters: name -> shape (float32)."""
        return self.kind.params(self)

    @property
    def buffers(self) -> dict[str, tuple[int, ...]]:
        """State kept with the weights but not trained (batch norm's running mean and variance)."""
        return self.kind.buffers(self)

    @property
    def weights(self) -> dict[str, tuple[int, ...]]:
        """Parameters and buffers: every array the node keeps in a stored model."""
        return {**self.params, **self.buffers}

    def workspace_nelems(self, batch: int) -> int:
        """float32 elements of the forward pass's workspace at ``batch`` rows (0: none)."""
        return self.kind.workspace_nelems(self, batch)


class NodeOp:
    """What the nodes of one op are: the defaults are those of a node without weights whose
    output is its input's values (an activation node): a copy forward, a copy of the
    gradient backward.

    The training methods take ``tb``, the program being built
    (:class:`tensile_db.runtime.builder.ProgramBuilder`), which names slots and emits ops."""

    name = ""

    def params(self, node: Node) -> dict[str, tuple[int, ...]]:
        return {}

    def buffers(self, node: Node) -> dict[str, tuple[int, ...]]:
        return {}

    def workspace_nelems(self, node: Node, batch: int) -> int:
        return 0

    def geometry(self, node: Node, batch: int) -> ck.ConvGeometry:
        raise TypeError(f"a {node.op} node has no window")

    def init_weights(self, node: Node, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """The node's initial weights (float32), drawing from ``rng`` in a fixed order."""
        return {}

    def evaluate(self, node: Node, inputs: list, weights: dict, out, workspace) -> None:
        """Inference into ``out`` (B, *node.shape stored: :func:`.layout.stored`), before the
        node's activation."""
        out[...] = inputs[0].reshape(out.shape)

    def forward(self, tb, node: Node, ins: list[str], h: str) -> None:
        """The training ops that compute the node's output slot ``h`` from its inputs' slots ``ins``
        (before its activation)."""
        inp = ins[0]
        tb.op(f"{node.op}{node.index}", (inp,), (h,), lambda a, ctx: copy_into(a[inp], a[h]))

    def backward(self, tb, node: Node, g: str, inp: str, dx: str | None) -> None:
        """The training ops from ``g``, the gradient of the node's output (after its activation's
        backward), to its parameters' gradients and ``dx``, where its first input's gradient
        contribution goes (None: nowhere; ``inp``: that input's slot)."""
        tb.op(f"{node.op}{node.index}_backward", (g,), (dx,) if dx else (), lambda a, ctx: copy_into(a[g], a[dx]))


#: Op name -> its :class:`NodeOp`.
OPS: dict[str, NodeOp] = {}


def node_op(name: str):
    """Class decorator: register one instance of a :class:`NodeOp` subclass as op ``name``."""
    def register(cls):
        if name in OPS:
            raise ValueError(f"node op {name!r} is registered twice")
        OPS[name] = cls()
        OPS[name].name = name
        return cls
    return register


class KernelOp(NodeOp):
    """A node without weights whose op is one kernel of its one input, ``forward_kernel(x,
    out)``, and one of its gradient, ``backward_kernel(dy, dx)``; its ops are named after the
    node op (``flatten3``, ``flatten3_backward``)."""

    forward_kernel = backward_kernel = None

    def evaluate(self, node, inputs, weights, out, workspace):
        self.forward_kernel(inputs[0], out)

    def forward(self, tb, node, ins, h):
        inp, run = ins[0], self.forward_kernel
        tb.op(f"{self.name}{node.index}", (inp,), (h,), lambda a, ctx: run(a[inp], a[h]))

    def backward(self, tb, node, g, inp, dx):
        run = self.backward_kernel
        tb.op(f"{self.name}{node.index}_backward", (g,), (dx,) if dx else (), lambda a, ctx: run(a[g], a[dx]))


@node_op("flatten")
class FlattenOp(KernelOp):
    """(C, H, W) -> (C·H·W,), C-order: a transposing copy of the stored image (the node of a
    ``flatten`` layer, and the one a dense layer or the output layer puts before itself on
    images; :func:`.conv_kernels.flatten_forward`)."""

    forward_kernel = staticmethod(ck.flatten_forward)
    backward_kernel = staticmethod(ck.flatten_backward)


def copy_into(src, dst) -> None:
    """``dst[...] = src`` in ``dst``'s shape (a node that passes its input on, and the gradients of a join)."""
    dst[...] = src.reshape(dst.shape)


def uniform_weights(rng: np.random.Generator, shape, fan_in: int, fan_out: int, relu: bool) -> np.ndarray:
    """He-uniform (``relu``) or Glorot-uniform initial weights of ``shape``, float32."""
    limit = math.sqrt(6.0 / fan_in) if relu else math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


# --- building a network ------------------------------------------------------------------------------


class GraphBuilder:
    """The nodes of a network being built from parsed layers: each layer's ``build`` checks that
    its input suits it and adds its node(s) with :meth:`add`."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape
        self.nodes: list[Node] = []

    def add(self, op, inputs, out_shape, where, activation="none", dropout=0.0, layer=None) -> int:
        in_shapes = tuple(self.shape_of(j) for j in inputs)
        self.nodes.append(Node(len(self.nodes), op, tuple(inputs), tuple(int(d) for d in out_shape), in_shapes,
                               where, activation, dropout, layer))
        return len(self.nodes) - 1

    def same_shape(self, op: str, j: int, where: str, activation: str = "none", layer=None) -> int:
        """Add a node of ``op`` reading node ``j`` whose output has ``j``'s shape."""
        return self.add(op, [j], self.shape_of(j), where, activation, layer=layer)

    def shape_of(self, j: int) -> tuple[int, ...]:
        return self.shape if j == INPUT else self.nodes[j].shape

    def image(self, j: int, where: str, what: str) -> tuple[int, int, int]:
        s = self.shape_of(j)
        if len(s) != 3:
            raise InvalidArgument(f"{where}: a {what} needs images (C, H, W) as input, got vectors of {s[0]}; "
                                  'give the rows\' shape as "input": {"shape": [C, H, W]} and put it before any '
                                  "dense, flatten or global_avg_pool layer")
        return s

    def flatten(self, j: int, where: str) -> int:
        """Node ``j`` as vectors: itself, or a flatten node after it."""
        return j if len(self.shape_of(j)) == 1 else self.add("flatten", [j], (math.prod(self.shape_of(j)),), where)

    def chain(self, layers, j: int, where: str) -> int:
        for k, layer in enumerate(layers):
            j = layer.build(self, j, f"{where}[{k}]")
        return j


def window_geometry(where: str, c, h, w, out, kernel, stride, padding, dilation, groups) -> ck.ConvGeometry:
    """A convolution's or pool's geometry on a (c, h, w) input, or InvalidArgument naming the layer
    when the window does not fit."""
    try:
        return ck.ConvGeometry(1, c, h, w, out, kernel, stride, padding, dilation, groups)
    except ValueError:
        raise InvalidArgument(f"{where}: a {list(kernel)} window (dilation {list(dilation)}, padding "
                              f"{list(padding)}) does not fit its input of {h}x{w}; use a smaller kernel, more "
                              "padding, or fewer pooling layers before it") from None
