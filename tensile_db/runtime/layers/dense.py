"""Dense layers: ``{"dense": N}``, ``y = x @ W + b`` with W (I, O) and b (O,), then the layer's
activation, then its dropout at training (inverted dropout, after the activation)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import kernels
from .base import (
    MAX_WIDTH,
    NodeOp,
    activation_option,
    int_option,
    layer_kind,
    node_op,
    probability,
    uniform_weights,
)


@layer_kind("dense", options=("activation", "dropout"))
@dataclass(frozen=True)
class Layer:
    """A dense layer: ``units`` outputs, an activation, a dropout probability (applied after the
    activation, at training only)."""

    units: int
    activation: str = "relu"
    dropout: float = 0.0

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> Layer:
        return cls(int_option(layer, "dense", where, None, 1, MAX_WIDTH), activation_option(layer, where, "relu"),
                   probability(layer.get("dropout", 0.0), f'{where}."dropout"'))

    def to_json(self) -> dict:
        return {"dense": self.units, "activation": self.activation, **({"dropout": self.dropout} if self.dropout else {})}

    def build(self, b, j: int, where: str) -> int:
        """On images, a flatten node first."""
        j = b.flatten(j, where)
        return b.add("dense", [j], (self.units,), where, self.activation, self.dropout, self)


@node_op("dense")
class DenseOp(NodeOp):
    """Parameters ``W{i}`` (I, O) and ``b{i}`` (O,)."""

    def params(self, node):
        i = node.index
        return {f"W{i}": (node.in_shapes[0][0], node.shape[0]), f"b{i}": (node.shape[0],)}

    def init_weights(self, node, rng):
        """He-uniform after relu, Glorot-uniform otherwise; zero bias."""
        i = node.index
        fan_in, fan_out = shape = node.params[f"W{i}"]
        return {f"W{i}": uniform_weights(rng, shape, fan_in, fan_out, node.activation == "relu"),
                f"b{i}": np.zeros(node.params[f"b{i}"], dtype=np.float32)}

    def evaluate(self, node, inputs, weights, out, workspace):
        i = node.index
        kernels.dense_forward(inputs[0].reshape(out.shape[0], -1), weights[f"W{i}"], weights[f"b{i}"], out)

    def forward(self, tb, node, ins, h):
        i, b, inp = node.index, tb.batch, ins[0]
        w, bias = f"W{i}", f"b{i}"
        tb.params(node)
        tb.op(f"dense{i}", (inp, w, bias), (h,),
              lambda a, ctx: kernels.dense_forward(a[inp].reshape(b, -1), a[w], a[bias], a[h]),
              flops=2 * b * tb.numel(w), unit="matmul")

    def backward(self, tb, node, g, inp, dx):
        i, b = node.index, tb.batch
        w = f"W{i}"
        dw, db = tb.gradients(node)
        tb.op(f"dense{i}_backward", (inp, w, g), (dw, db) + ((dx,) if dx else ()),
              lambda a, ctx: kernels.dense_backward(a[inp].reshape(b, -1), a[w], a[g],
                                                    a[dx].reshape(b, -1) if dx else None, a[dw], a[db]),
              flops=2 * b * tb.numel(w) * (1 + bool(dx)), unit="matmul")

