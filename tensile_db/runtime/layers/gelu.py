"""The GELU activation, ``"activation": "gelu"`` on any layer that takes one: ``x · Φ(x)`` with Φ
the standard normal distribution function, exact (with erf), as PyTorch's ``nn.GELU()``
(Hendrycks and Gimpel, "Gaussian Error Linear Units", 2016).

Its derivative ``Φ(x) + x · φ(x)`` is not a function of its output, so the training program keeps
its input (``saves_input``) where the in-place activations keep only their output."""

from __future__ import annotations

import math

import numpy as np

from ..kernels import array_module
from .base import register_activation

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _erf(xp):
    if xp is np:
        from scipy.special import erf
    else:
        from cupyx.scipy.special import erf
    return erf


def gelu_forward(x, out) -> None:
    """``out = x · (1 + erf(x / √2)) / 2``, elementwise; ``out`` may be ``x``."""
    xp = array_module(x)
    cdf = _erf(xp)(x * _SQRT_HALF)
    xp.add(cdf, 1.0, out=cdf)
    xp.multiply(cdf, 0.5, out=cdf)
    xp.multiply(x, cdf, out=out)


def gelu_backward(x, dy, dx) -> None:
    """``dx = dy · (Φ(x) + x · φ(x))`` from the forward input ``x``; ``dx`` must not alias ``x``."""
    xp = array_module(x)
    cdf = _erf(xp)(x * _SQRT_HALF)
    xp.add(cdf, 1.0, out=cdf)
    xp.multiply(cdf, 0.5, out=cdf)
    xp.multiply(x, x, out=dx)
    xp.multiply(dx, -0.5, out=dx)
    xp.exp(dx, out=dx)
    xp.multiply(dx, x, out=dx)
    xp.multiply(dx, _INV_SQRT_2PI, out=dx)
    xp.add(dx, cdf, out=dx)
    xp.multiply(dx, dy, out=dx)


register_activation("gelu", gelu_forward, gelu_backward, saves_input=True)
