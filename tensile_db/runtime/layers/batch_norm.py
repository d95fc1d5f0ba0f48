"""Batch normalisation: ``{"batch_norm": {}}``, over the batch (and H, W) per channel (Ioffe and
Szegedy, 2015), with ``gamma{i}``, ``beta{i}`` and the running statistics ``mean{i}``, ``var{i}``
(C,); the running statistics at inference.

Recompute: the forward op also updates the running statistics, so re-running it would update
them twice; it carries a *replay* op that applies the saved batch statistics ``bm{i}`` / ``bs{i}``
instead (``batch_norm_apply``), which gives the forward pass's values bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import conv_kernels as ck
from .. import kernels
from ..program import Kind
from .base import NodeOp, activation_option, layer_kind, node_op, number_option, options_object


@layer_kind("batch_norm", options=("activation",))
@dataclass(frozen=True)
class BatchNorm:
    """Batch normalisation over the batch (and H, W) per channel, then an activation."""

    momentum: float = 0.1
    eps: float = 1e-5
    activation: str = "none"

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> BatchNorm:
        options = options_object(layer, key, where, ("momentum", "eps"), '{"momentum": 0.1, "eps": 1e-5}')
        return cls(number_option(options, "momentum", f'{where}."batch_norm"', 0.1, 0, 1),
                   number_option(options, "eps", f'{where}."batch_norm"', 1e-5, 1e-12, 1),
                   activation_option(layer, where, "none"))

    def to_json(self) -> dict:
        return {"batch_norm": {"momentum": self.momentum, "eps": self.eps}, "activation": self.activation}

    def build(self, b, j: int, where: str) -> int:
        return b.same_shape("batch_norm", j, where, self.activation, self)


@node_op("batch_norm")
class BatchNormOp(NodeOp):
    def params(self, node):
        i = node.index
        return {f"gamma{i}": node.shape[:1], f"beta{i}": node.shape[:1]}

    def buffers(self, node):
        i = node.index
        return {f"mean{i}": node.shape[:1], f"var{i}": node.shape[:1]}

    def init_weights(self, node, rng):
        """gamma 1, beta 0, running mean 0, running variance 1."""
        i, c = node.index, node.shape[0]
        return {f"gamma{i}": np.ones(c, np.float32), f"var{i}": np.ones(c, np.float32),
                f"beta{i}": np.zeros(c, np.float32), f"mean{i}": np.zeros(c, np.float32)}

    def evaluate(self, node, inputs, weights, out, workspace):
        i = node.index
        xp = kernels.array_module(out)
        invstd = 1.0 / xp.sqrt(weights[f"var{i}"] + np.float32(node.layer.eps))
        ck.batch_norm_apply(inputs[0], weights[f"gamma{i}"], weights[f"beta{i}"], weights[f"mean{i}"],
                            invstd.astype(np.float32), out)

    def forward(self, tb, node, ins, h):
        i, inp = node.index, ins[0]
        tb.params(node)
        gamma, beta, rmean, rvar = f"gamma{i}", f"beta{i}", f"mean{i}", f"var{i}"
        c = node.shape[0]
        bm, bs = tb.slot(f"bm{i}", Kind.ACTIVATION, (c,)), tb.slot(f"bs{i}", Kind.ACTIVATION, (c,))
        momentum, eps = node.layer.momentum, node.layer.eps
        replay = tb.make_op(f"batch_norm{i}_replay", (inp, gamma, beta, bm, bs), (h,),
                            lambda a, ctx: ck.batch_norm_apply(a[inp], a[gamma], a[beta], a[bm], a[bs], a[h]),
                            flops=2 * tb.numel(h))
        tb.op(f"batch_norm{i}", (inp, gamma, beta, rmean, rvar), (h, bm, bs, rmean, rvar),
              lambda a, ctx: ck.batch_norm_forward(a[inp], a[gamma], a[beta], a[h], a[bm], a[bs], a[rmean], a[rvar],
                                                   momentum, eps), replay, flops=6 * tb.numel(h))

    def backward(self, tb, node, g, inp, dx):
        i = node.index
        gamma, bm, bs = f"gamma{i}", f"bm{i}", f"bs{i}"
        dgamma, dbeta = tb.gradients(node)
        tb.op(f"batch_norm{i}_backward", (inp, gamma, bm, bs, g), (dgamma, dbeta) + ((dx,) if dx else ()),
              lambda a, ctx: ck.batch_norm_backward(a[inp], a[gamma], a[bm], a[bs], a[g], a[dx] if dx else None,
                                                    a[dgamma], a[dbeta]),
              flops=10 * tb.numel(g))
