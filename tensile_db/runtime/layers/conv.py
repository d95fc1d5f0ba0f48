"""2-D convolutions: ``{"conv": O}`` on images (C, H, W) stored channels last, weight ``W{i}`` (O, C/groups, KH, KW) and, with a bias,
``b{i}`` (O,); forward and backward by im2col in chunks of the batch (:mod:`..conv_kernels`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import InvalidArgument
from .. import conv_kernels as ck
from .base import (
    MAX_WIDTH,
    NodeOp,
    activation_option,
    bool_option,
    int_option,
    layer_kind,
    node_op,
    pair_option,
    uniform_weights,
    window_geometry,
)


@layer_kind("conv", options=("kernel", "stride", "padding", "dilation", "groups", "bias", "activation"))
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

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> Conv:
        return cls(int_option(layer, "conv", where, None, 1, MAX_WIDTH), pair_option(layer, "kernel", where, 3, 1),
                   pair_option(layer, "stride", where, 1, 1), pair_option(layer, "padding", where, 0, 0),
                   pair_option(layer, "dilation", where, 1, 1), int_option(layer, "groups", where, 1, 1, MAX_WIDTH),
                   bool_option(layer, "bias", where, True), activation_option(layer, where, "relu"))

    def to_json(self) -> dict:
        return {"conv": self.channels, "kernel": list(self.kernel), "stride": list(self.stride),
                "padding": list(self.padding), "dilation": list(self.dilation), "groups": self.groups,
                "bias": self.bias, "activation": self.activation}

    def build(self, b, j: int, where: str) -> int:
        c, h, w = b.image(j, where, "convolution")
        if c % self.groups or self.channels % self.groups:
            raise InvalidArgument(f'{where}."groups" {self.groups} must divide the input channels ({c}) and the '
                                  f"output channels ({self.channels})")
        g = window_geometry(where, c, h, w, self.channels, self.kernel, self.stride, self.padding, self.dilation,
                            self.groups)
        return b.add("conv", [j], g.out_image, where, self.activation, layer=self)


@node_op("conv")
class ConvOp(NodeOp):
    def geometry(self, node, batch):
        l, (c, h, w) = node.layer, node.in_shapes[0]
        return ck.ConvGeometry(batch, c, h, w, l.channels, l.kernel, l.stride, l.padding, l.dilation, l.groups)

    def params(self, node):
        i, l = node.index, node.layer
        shapes = {f"W{i}": (l.channels, node.in_shapes[0][0] // l.groups, *l.kernel)}
        return {**shapes, f"b{i}": (l.channels,)} if l.bias else shapes

    def workspace_nelems(self, node, batch):
        """The forward pass's: the weight matrix, the padded input, im2col matrix and product of a chunk."""
        return self.geometry(node, batch).forward_workspace_nelems

    def init_weights(self, node, rng):
        """He-uniform after relu or no activation (a convolution before batch norm), Glorot-uniform
        otherwise; zero bias."""
        i = node.index
        shape = node.params[f"W{i}"]
        relu = node.activation in ("relu", "none")
        weights = {f"W{i}": uniform_weights(rng, shape, math.prod(shape[1:]), shape[0] * math.prod(shape[2:]), relu)}
        if f"b{i}" in node.params:
            weights[f"b{i}"] = np.zeros(node.params[f"b{i}"], dtype=np.float32)
        return weights

    def evaluate(self, node, inputs, weights, out, workspace):
        i = node.index
        ck.conv2d_forward(inputs[0], weights[f"W{i}"], weights.get(f"b{i}"), out, self.geometry(node, out.shape[0]),
                          workspace)

    def forward(self, tb, node, ins, h):
        i, b, inp = node.index, tb.batch, ins[0]
        g = self.geometry(node, b)
        tb.params(node)
        w, bias = f"W{i}", f"b{i}" if f"b{i}" in node.params else None
        ws = tb.workspace(f"ws{i}", node.workspace_nelems(b))
        tb.op(f"conv{i}", (inp, w) + ((bias,) if bias else ()), (h, ws),
              lambda a, ctx: ck.conv2d_forward(a[inp], a[w], a[bias] if bias else None, a[h], g, a[ws]),
              flops=conv_flops(tb, h, w), unit="conv")

    def backward(self, tb, node, g, inp, dx):
        i, b = node.index, tb.batch
        geo = self.geometry(node, b)
        w = f"W{i}"
        dw, db = (*tb.gradients(node), None)[:2]                # db: None without a bias
        ws = tb.workspace(f"wsb{i}", geo.backward_workspace_nelems)
        tb.op(f"conv{i}_backward", (inp, w, g), (dw,) + ((db,) if db else ()) + ((dx,) if dx else ()) + (ws,),
              lambda a, ctx: ck.conv2d_backward(a[inp], a[w], a[g], a[dx] if dx else None, a[dw],
                                                a[db] if db else None, geo, a[ws]),
              flops=conv_flops(tb, f"h{i}", w) * (1 + bool(dx)), unit="conv")


def conv_flops(tb, out: str, w: str) -> int:
    """Multiply-adds of a convolution, times two: each output element (``out``: B, OH, OW, OC)
    takes a dot product over the kernel's ``C/g * KH * KW`` taps (``w``: OC, C/g, KH, KW)."""
    return 2 * tb.numel(out) * math.prod(tb.shape(w)[1:])
