"""Pooling: ``{"max_pool": k}`` and ``{"avg_pool": k}`` over a window (average counts the
padding), and ``{"global_avg_pool": {}}``, (C, H, W) -> (C,)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import InvalidArgument
from .. import conv_kernels as ck
from ..program import Kind
from .base import KernelOp, NodeOp, layer_kind, no_options, node_op, pair_option, window_geometry


@layer_kind("max_pool", "avg_pool", options=("stride", "padding"))
@dataclass(frozen=True)
class Pool:
    """Max or average pooling (``kind``: ``max`` or ``avg``) over a window."""

    kind: str
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int] = (0, 0)

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> Pool:
        kernel = pair_option(layer, key, where, None, 1)
        return cls(key[:3], kernel, pair_option(layer, "stride", where, list(kernel), 1),
                   pair_option(layer, "padding", where, 0, 0))

    def to_json(self) -> dict:
        return {f"{self.kind}_pool": list(self.kernel), "stride": list(self.stride), "padding": list(self.padding)}

    def build(self, b, j: int, where: str) -> int:
        c, h, w = b.image(j, where, f"{self.kind}_pool")
        if any(2 * p > k for p, k in zip(self.padding, self.kernel)):
            raise InvalidArgument(f'{where}."padding" {list(self.padding)} must be at most half the window '
                                  f"{list(self.kernel)}")
        g = window_geometry(where, c, h, w, c, self.kernel, self.stride, self.padding, (1, 1), 1)
        return b.add(f"{self.kind}_pool", [j], g.out_image, where, layer=self)


@layer_kind("global_avg_pool")
@dataclass(frozen=True)
class GlobalAvgPool:
    """(C, H, W) -> (C,): the mean of each channel."""

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> GlobalAvgPool:
        no_options(layer, key, where)
        return cls()

    def to_json(self) -> dict:
        return {"global_avg_pool": {}}

    def build(self, b, j: int, where: str) -> int:
        return b.add("global_avg_pool", [j], b.image(j, where, "global_avg_pool")[:1], where)


def pool_workspace(geometry: ck.ConvGeometry, flat):
    """The padded input's view (B, H + 2p, W + 2p, C) of a flat workspace."""
    return flat[:math.prod(geometry.padded_shape)].reshape(geometry.padded_shape)


class _WindowOp(NodeOp):
    """A pool over a window: its padded input is its workspace, forward and backward."""

    def geometry(self, node, batch):
        l, (c, h, w) = node.layer, node.in_shapes[0]
        return ck.ConvGeometry(batch, c, h, w, c, l.kernel, l.stride, l.padding)

    def workspace_nelems(self, node, batch):
        return math.prod(self.geometry(node, batch).padded_shape)


@node_op("max_pool")
class MaxPoolOp(_WindowOp):
    """Saves the argmax of each window, ``am{i}`` (uint8 for windows up to 256, else int32)."""

    def evaluate(self, node, inputs, weights, out, workspace):
        g = self.geometry(node, out.shape[0])
        ck.max_pool_forward(inputs[0], out, None, g, pool_workspace(g, workspace))

    def forward(self, tb, node, ins, h):
        i, inp = node.index, ins[0]
        g = self.geometry(node, tb.batch)
        window = math.prod(g.kernel)
        am = tb.slot(f"am{i}", Kind.ACTIVATION, tb.rows(node.shape), "uint8" if window <= 256 else "int32")
        ws = tb.workspace(f"ws{i}", node.workspace_nelems(tb.batch))
        tb.op(f"max_pool{i}", (inp,), (h, am, ws),
              lambda a, ctx: ck.max_pool_forward(a[inp], a[h], a[am], g, pool_workspace(g, a[ws])),
              flops=window * tb.numel(h))

    def backward(self, tb, node, g, inp, dx):
        i = node.index
        geo, am = self.geometry(node, tb.batch), f"am{i}"
        ws = tb.workspace(f"wsb{i}", node.workspace_nelems(tb.batch))
        tb.op(f"max_pool{i}_backward", (g, am), ((dx,) if dx else ()) + (ws,),
              lambda a, ctx: ck.max_pool_backward(a[g], a[am], a[dx], geo, pool_workspace(geo, a[ws])))


@node_op("avg_pool")
class AvgPoolOp(_WindowOp):
    def evaluate(self, node, inputs, weights, out, workspace):
        g = self.geometry(node, out.shape[0])
        ck.avg_pool_forward(inputs[0], out, g, pool_workspace(g, workspace))

    def forward(self, tb, node, ins, h):
        i, inp = node.index, ins[0]
        g = self.geometry(node, tb.batch)
        ws = tb.workspace(f"ws{i}", node.workspace_nelems(tb.batch))
        tb.op(f"avg_pool{i}", (inp,), (h, ws),
              lambda a, ctx: ck.avg_pool_forward(a[inp], a[h], g, pool_workspace(g, a[ws])),
              flops=math.prod(g.kernel) * tb.numel(h))

    def backward(self, tb, node, g, inp, dx):
        i = node.index
        geo = self.geometry(node, tb.batch)
        ws = tb.workspace(f"wsb{i}", node.workspace_nelems(tb.batch))
        tb.op(f"avg_pool{i}_backward", (g,), ((dx,) if dx else ()) + (ws,),
              lambda a, ctx: ck.avg_pool_backward(a[g], a[dx], geo, pool_workspace(geo, a[ws])))


@node_op("global_avg_pool")
class GlobalAvgPoolOp(KernelOp):
    forward_kernel = staticmethod(ck.global_avg_pool_forward)
    backward_kernel = staticmethod(ck.global_avg_pool_backward)
