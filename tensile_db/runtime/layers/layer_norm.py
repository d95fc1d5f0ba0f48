"""Layer normalisation: ``{"layer_norm": {}}``, each row's values normalised over the last
dimension of its shape, then scaled and shifted per position of that dimension (Ba, Kiros and
Hinton, "Layer Normalization", 2016; PyTorch's ``nn.LayerNorm(shape[-1])``):

    y = gamma · (x − mean(x)) / sqrt(var(x) + eps) + beta,    mean and var over the last axis,

with ``gamma{i}``, ``beta{i}`` (D,) for a last dimension of D, and the biased variance. The same at
training and inference (no running statistics). The forward op saves each row's mean ``lm{i}``
and inverse standard deviation ``ls{i}`` (B, *shape[:-1]) for its backward; it is a function of
its input, but a recompute runs a *replay* that applies the saved statistics instead, so that it
writes the output alone (bit for bit the same)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import layout
from ..kernels import array_module
from ..program import Kind
from .base import NodeOp, activation_option, layer_kind, node_op, number_option, options_object


def layer_norm_forward(x, gamma, beta, out, mean, invstd, eps: float) -> None:
    """x, out: (B, ..., D); gamma, beta: (D,); writes mean and ``invstd = 1 / sqrt(var + eps)``:
    (B, ...). Any float dtype; NumPy or CuPy."""
    xp = array_module(x)
    xp.mean(x, axis=-1, out=mean)
    xp.subtract(x, mean[..., None], out=out)                # out holds x − mean meanwhile
    var = xp.mean(out * out, axis=-1)
    xp.sqrt(var + eps, out=invstd)
    xp.divide(1.0, invstd, out=invstd)
    layer_norm_apply(x, gamma, beta, mean, invstd, out)


def layer_norm_apply(x, gamma, beta, mean, invstd, out) -> None:
    """``out = gamma · (x − mean) · invstd + beta`` with given statistics (B, ...): what
    :func:`layer_norm_forward` computes once it has them, bit for bit (a recompute's replay)."""
    xp = array_module(x)
    xp.subtract(x, mean[..., None], out=out)
    xp.multiply(out, invstd[..., None], out=out)
    xp.multiply(out, gamma, out=out)
    xp.add(out, beta, out=out)


def layer_norm_backward(x, gamma, mean, invstd, dy, dx, dgamma, dbeta) -> None:
    """Gradients of :func:`layer_norm_forward` from its saved statistics: dgamma, dbeta (D,) and,
    unless None, dx (shape of x): ``dx = invstd · (dx̂ − mean(dx̂) − x̂ · mean(dx̂ · x̂))`` with
    ``dx̂ = dy · gamma``, the means over the last axis."""
    xp = array_module(x)
    rows = tuple(range(x.ndim - 1))
    xhat = (x - mean[..., None]) * invstd[..., None]
    xp.sum(dy, axis=rows, out=dbeta)
    xp.sum(dy * xhat, axis=rows, out=dgamma)
    if dx is not None:
        dxhat = dy * gamma
        mean_dxhat = xp.mean(dxhat, axis=-1, keepdims=True)
        mean_dxhat_xhat = xp.mean(dxhat * xhat, axis=-1, keepdims=True)
        xp.subtract(dxhat, mean_dxhat, out=dx)
        xp.subtract(dx, xhat * mean_dxhat_xhat, out=dx)
        xp.multiply(dx, invstd[..., None], out=dx)


@layer_kind("layer_norm", options=("activation",))
@dataclass(frozen=True)
class LayerNorm:
    """Layer normalisation over the last dimension, then an activation."""

    eps: float = 1e-5
    activation: str = "none"

    @classmethod
    def parse(cls, key: str, layer: dict, where: str, depth: int) -> LayerNorm:
        options = options_object(layer, key, where, ("eps",), '{"eps": 1e-5}')
        return cls(number_option(options, "eps", f'{where}."layer_norm"', 1e-5, 1e-12, 1),
                   activation_option(layer, where, "none"))

    def to_json(self) -> dict:
        return {"layer_norm": {"eps": self.eps}, "activation": self.activation}

    def build(self, b, j: int, where: str) -> int:
        return b.same_shape("layer_norm", j, where, self.activation, self)


@node_op("layer_norm")
class LayerNormOp(NodeOp):
    def params(self, node):
        i = node.index
        return {f"gamma{i}": node.shape[-1:], f"beta{i}": node.shape[-1:]}

    def init_weights(self, node, rng):
        """gamma 1, beta 0."""
        i, d = node.index, node.shape[-1]
        return {f"gamma{i}": np.ones(d, np.float32), f"beta{i}": np.zeros(d, np.float32)}

    def workspace_nelems(self, node, batch):
        """At inference, each row's mean and inverse standard deviation."""
        return 2 * batch * math.prod(node.shape[:-1])

    def evaluate(self, node, inputs, weights, out, workspace):
        v = _normalised_axes(node)
        i, stats = node.index, v(out).shape[:-1]
        n = math.prod(stats)
        layer_norm_forward(v(inputs[0]), weights[f"gamma{i}"], weights[f"beta{i}"], v(out),
                           workspace[:n].reshape(stats), workspace[n:2 * n].reshape(stats), node.layer.eps)

    def forward(self, tb, node, ins, h):
        i, inp, eps, v = node.index, ins[0], node.layer.eps, _normalised_axes(node)
        tb.params(node)
        gamma, beta = f"gamma{i}", f"beta{i}"
        lm = tb.slot(f"lm{i}", Kind.ACTIVATION, tb.rows(node.shape[:-1]))
        ls = tb.slot(f"ls{i}", Kind.ACTIVATION, tb.rows(node.shape[:-1]))
        replay = tb.make_op(f"layer_norm{i}_replay", (inp, gamma, beta, lm, ls), (h,),
                            lambda a, ctx: layer_norm_apply(v(a[inp]), a[gamma], a[beta], a[lm], a[ls], v(a[h])),
                            flops=4 * tb.numel(h))
        tb.op(f"layer_norm{i}", (inp, gamma, beta), (h, lm, ls),
              lambda a, ctx: layer_norm_forward(v(a[inp]), a[gamma], a[beta], v(a[h]), a[lm], a[ls], eps), replay,
              flops=8 * tb.numel(h))

    def backward(self, tb, node, g, inp, dx):
        i, v = node.index, _normalised_axes(node)
        gamma, lm, ls = f"gamma{i}", f"lm{i}", f"ls{i}"
        dgamma, dbeta = tb.gradients(node)
        tb.op(f"layer_norm{i}_backward", (inp, gamma, lm, ls, g), (dgamma, dbeta) + ((dx,) if dx else ()),
              lambda a, ctx: layer_norm_backward(v(a[inp]), a[gamma], a[lm], a[ls], v(a[g]), v(a[dx]) if dx else None,
                                                 a[dgamma], a[dbeta]),
              flops=12 * tb.numel(g))


def _normalised_axes(node):
    """How the node's arrays are read: an image's stored (B, H, W, C) in the network's axes
    (:func:`.layout.channels_first`), whose last, the width, is the one normalised; other
    shapes as they are."""
    return layout.channels_first if layout.is_image(node.shape) else _as_is


def _as_is(a):
    return a
