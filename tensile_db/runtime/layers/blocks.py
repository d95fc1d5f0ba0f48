"""Blocks: ``{"residual": [layers], "shortcut": [layers]}``, ``activation(body(x) + shortcut(x))``
(an ``add`` node), and ``{"concat": [[layers], ...]}``, the branches joined on the channel axis (a
``concat`` node). Both nest lists of layers, at most :data:`~.base.MAX_DEPTH` deep.

Backward, each input of a join gets its part of the gradient (all of it for ``add``, its
channels for ``concat``); an input read by several nodes collects them through the program's
gradient contributions (:meth:`tensile_db.runtime.builder.ProgramBuilder.contribution`)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InvalidArgument
from .. import conv_kernels as ck
from ..checks import shown
from .base import NodeOp, activation_option, copy_into, layer_kind, layers_to_json, node_op, parse_layers


@layer_kind("residual", options=("shortcut", "activation"))
@dataclass(frozen=True)
class Residual:
    """``activation(body(x) + shortcut(x))``; an empty shortcut is the identity."""

    body: tuple
    shortcut: tuple = ()
    activation: str = "none"

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> Residual:
        body = parse_layers(layer["residual"], f"{where}.residual", depth + 1)
        if not body:
            raise InvalidArgument(f"{where}.residual must hold at least one layer")
        return cls(body, parse_layers(layer.get("shortcut", []), f"{where}.shortcut", depth + 1),
                   activation_option(layer, where, "none"))

    def to_json(self) -> dict:
        return {"residual": layers_to_json(self.body), "shortcut": layers_to_json(self.shortcut),
                "activation": self.activation}

    def build(self, b, j: int, where: str) -> int:
        body = b.chain(self.body, j, f"{where}.residual")
        short = b.chain(self.shortcut, j, f"{where}.shortcut")
        if b.shape_of(body) != b.shape_of(short):
            raise InvalidArgument(f"{where}: the residual body gives {list(b.shape_of(body))} per row but the "
                                  f"shortcut gives {list(b.shape_of(short))}; they are added, so they must match "
                                  "(give the shortcut a 1x1 convolution with the body's channels and stride)")
        if body == short:
            raise InvalidArgument(f"{where}: the residual body must hold at least one layer")
        return b.add("add", [body, short], b.shape_of(body), where, self.activation)


@layer_kind("concat")
@dataclass(frozen=True)
class Concat:
    """The branches' outputs joined on the channel axis; an empty branch is the identity."""

    branches: tuple

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> Concat:
        value = layer["concat"]
        if not isinstance(value, list) or len(value) < 2:
            raise InvalidArgument(f"{where}.concat must be an array of at least two branches (arrays of layers; [] is "
                                  f"the identity), got {shown(value)}")
        return cls(tuple(parse_layers(b, f"{where}.concat[{i}]", depth + 1) for i, b in enumerate(value)))

    def to_json(self) -> dict:
        return {"concat": [layers_to_json(b) for b in self.branches]}

    def build(self, b, j: int, where: str) -> int:
        ends = [b.chain(branch, j, f"{where}.concat[{k}]") for k, branch in enumerate(self.branches)]
        shapes = [b.shape_of(e) for e in ends]
        if any(len(s) != 3 for s in shapes) or len({s[1:] for s in shapes}) != 1:
            raise InvalidArgument(f"{where}: the branches give {[list(s) for s in shapes]} per row; concatenation "
                                  "joins images (C, H, W) of the same H and W")
        return b.add("concat", ends, (sum(s[0] for s in shapes), *shapes[0][1:]), where)


class _JoinOp(NodeOp):
    def backward(self, tb, node, g, inp, dx):
        ins = [tb.out[j] for j in node.inputs]
        targets = [dx] + [tb.contribution(j) for j in node.inputs[1:]]
        writes = tuple(dict.fromkeys(t for t in targets if t))
        if writes:
            tb.op(f"{node.op}{node.index}_backward", (g,), writes, self.gradients(g, targets, [tb.slots[s].shape for s in ins], writes))
        tb.accumulate(node.inputs[1:])


@node_op("add")
class AddOp(_JoinOp):
    def evaluate(self, node, inputs, weights, out, workspace):
        ck.add_forward(inputs[0], inputs[1], out)

    def forward(self, tb, node, ins, h):
        tb.op(f"add{node.index}", tuple(ins), (h,), lambda a, ctx: ck.add_forward(a[ins[0]], a[ins[1]], a[h]))

    @staticmethod
    def gradients(g, targets, shapes, writes):
        """Each input gets the whole gradient."""
        def run(a, ctx):
            for t in writes:
                copy_into(a[g], a[t])
        return run


@node_op("concat")
class ConcatOp(_JoinOp):
    def evaluate(self, node, inputs, weights, out, workspace):
        ck.concat_forward(inputs, out)

    def forward(self, tb, node, ins, h):
        tb.op(f"concat{node.index}", tuple(dict.fromkeys(ins)), (h,),
              lambda a, ctx: ck.concat_forward([a[s] for s in ins], a[h]))

    @staticmethod
    def gradients(g, targets, shapes, writes):
        """Each input gets its channels of the gradient."""
        def run(a, ctx):
            start = 0
            for t, shape in zip(targets, shapes):
                if t:
                    a[t][...] = a[g][..., start:start + shape[-1]]
                start += shape[-1]
        return run
