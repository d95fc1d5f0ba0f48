"""Networks: the layers of an architecture as a graph of nodes with shapes and parameters.

An architecture (JSON, validated by :func:`parse_layers`) is a list of layers; blocks nest lists:
a residual block adds its body to a shortcut, a concatenation joins branches on the channel axis.
:func:`build_network` turns it into a :class:`Network`: its nodes in topological (execution) order,
each with the nodes it reads, its output shape per row, and its parameters. The training program
(:mod:`.builder`), inference on the host (:func:`Network.forward`) and demand-layered inference
in the coordinator (:mod:`tensile_db.inference.layered`) all read this one graph. Each layer kind
(parsing, shapes, weights, inference and training ops) is one module of :mod:`.layers`; this module
names none of them.

An image row is named (C, H, W) and stored (H, W, C) (:mod:`.layout`); a vector row is (F,).
The last node is always the output layer, a dense layer to the task's outputs, which the
architecture does not list.

Parameters are named by node index ``i`` (counting nodes from 0 in execution order): ``W{i}`` and
``b{i}`` for a dense layer (W (I, O)) or a convolution (W (O, C/groups, KH, KW), b only with a
bias); ``gamma{i}``, ``beta{i}`` and the running statistics ``mean{i}``, ``var{i}`` (C,) for batch
normalisation. An MLP's nodes are its dense layers, so its weights are ``W0, b0, W1, ...``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import InvalidArgument
from . import layout
from .layers import base
from .layers.base import (  # noqa: F401  (re-exported: the parsed layers' module is where users look)
    INPUT,
    MAX_DEPTH,
    MAX_WIDTH,
    MAX_WINDOW,
    OPS,
    GraphBuilder,
    Node,
    layer_keys,
    layers_to_json,
    parse_layers,
)
from .layers.batch_norm import BatchNorm  # noqa: F401
from .layers.blocks import Concat, Residual  # noqa: F401
from .layers.conv import Conv  # noqa: F401
from .layers.dense import Layer
from .layers.elementwise import Activation, Dropout, Flatten  # noqa: F401
from .layers.pool import GlobalAvgPool, Pool  # noqa: F401

# --- the graph ---------------------------------------------------------------------------------------


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
        """Float32 initial weights, each node's by its op (:meth:`.layers.base.NodeOp.init_weights`:
        He-uniform or Glorot-uniform dense and convolution weights, zero biases, batch norm gamma 1,
        beta 0, running mean 0, running variance 1). Fixed by ``seed``."""
        return dict(self.iter_init_weights(seed))

    def iter_init_weights(self, seed: int):
        """The arrays of :meth:`init_weights` one at a time, as ``(name, array)`` in node order:
        the same values, without holding every array at once (a training job adopts each as it
        comes, so a model larger than the host budget goes to the disk tier array by array)."""
        rng = np.random.default_rng(seed)
        for node in self.nodes:
            yield from node.kind.init_weights(node, rng).items()

    def forward(self, weights: dict[str, np.ndarray], x: np.ndarray, chunk_rows: int = 256,
                scale=None) -> np.ndarray:
        """Inference on the host: network inputs x (N, F) float32 -> the output layer's values
        (N, n_outputs) float32, ``chunk_rows`` rows at a time, each chunk first through ``scale``
        (``scale(rows, out=buffer)``, returning the scaled rows: written into one buffer the chunks
        share; None: x is scaled already). Batch norm uses the running statistics; dropout is the
        identity."""
        outs = []
        buffer = None
        for start in range(0, len(x), chunk_rows):
            part = np.asarray(x[start:start + chunk_rows], np.float32)
            if scale is not None:
                if buffer is None:
                    buffer = np.empty((min(chunk_rows, len(x)), *part.shape[1:]), np.float32)
                part = scale(part, out=buffer[:len(part)])
            values: dict[int, np.ndarray] = {INPUT: layout.images_from_rows(part, self.input_shape)}
            left = {k: len(v) for k, v in self.consumers.items()}
            for node in self.nodes:
                out = np.empty((len(part), *layout.stored(node.shape)), np.float32)
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
    """One node at inference, into ``out`` (B, *:func:`.layout.stored` (node.shape)): its op (:meth:`.layers.base.NodeOp.evaluate`:
    batch norm with its running statistics, dropout as the identity), then its activation in
    place. ``inputs``: the arrays of ``node.inputs`` (B, *stored shape); ``weights``: at least the node's
    arrays by name (:attr:`Node.weights`); ``workspace``: a flat float32 array of at least
    :meth:`Node.workspace_nelems` elements. NumPy or CuPy arrays."""
    node.kind.evaluate(node, inputs, weights, out, workspace)
    if node.activation != "none":
        base.ACTIVATIONS[node.activation].forward(out, out)


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
    b = GraphBuilder(shape)
    last = b.flatten(b.chain(layers, INPUT, where), "the output layer")
    b.add("dense", [last], (n_outputs,), "the output layer", "none", layer=Layer(n_outputs, "none"))
    return Network(shape, b.nodes)


