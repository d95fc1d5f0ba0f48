"""Layers whose output is their input's values reshaped, activated or masked: ``{"flatten": {}}``
(a node only on images), ``{"activation": name}`` and ``{"dropout": p}`` (inverted dropout at
training, the identity at inference)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import kernels
from .base import NodeOp, activation_option, layer_kind, no_options, node_op, probability


@layer_kind("flatten")
@dataclass(frozen=True)
class Flatten:
    """(C, H, W) -> (C·H·W,), C-order."""

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> Flatten:
        no_options(layer, key, where)
        return cls()

    def to_json(self) -> dict:
        return {"flatten": {}}

    def build(self, b, j: int, where: str) -> int:
        return b.flatten(j, where)


@layer_kind("activation", standalone=True)
@dataclass(frozen=True)
class Activation:
    name: str

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> Activation:
        return cls(activation_option(layer, where, "none"))

    def to_json(self) -> dict:
        return {"activation": self.name}

    def build(self, b, j: int, where: str) -> int:
        return b.same_shape("activation", j, where, self.name)


@node_op("activation")
class ActivationOp(NodeOp):
    """A copy of its input, which the node's activation then runs on."""


@layer_kind("dropout", standalone=True)
@dataclass(frozen=True)
class Dropout:
    p: float

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> Dropout:
        return cls(probability(layer["dropout"], f'{where}."dropout"'))

    def to_json(self) -> dict:
        return {"dropout": self.p}

    def build(self, b, j: int, where: str) -> int:
        return b.same_shape("dropout", j, where, layer=self)


@node_op("dropout")
class DropoutOp(NodeOp):
    """At training, the input times the mask ``mask{i}`` drawn from the iteration's seed; at
    inference, a copy."""

    def forward(self, tb, node, ins, h):
        tb.dropout(node.index, ins[0], h, node.layer.p)

    def backward(self, tb, node, g, inp, dx):
        mask = f"mask{node.index}"
        tb.op(f"dropout{node.index}_backward", (mask, g), (dx,) if dx else (),
              lambda a, ctx: kernels.dropout_backward(a[mask], a[g], a[dx]))
