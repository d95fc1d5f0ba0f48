"""Kernels: the forward and backward arithmetic of every operator, on NumPy or CuPy arrays.

Each kernel writes into output arrays its caller passes in (``out=``), so that on the device the
bytes an operator touches are tensors the memory manager placed in the arena. The exceptions are
small: cross-entropy builds (B,) index temporaries for the label gather, which on ``cpu`` live
outside the arena (on ``cuda`` CuPy's allocator is routed into it). Shapes use ``B`` for the batch, ``I`` / ``O`` for a dense layer's input and
output widths and ``C`` for classes. Kernels are dtype-generic (float32 in training, float64 in
the gradient tests) and array-module generic: ``xp`` is taken from the arguments.

The backward kernels compute gradients of a scalar loss ``L``: given ``dy = dL/dy`` they write
``dx = dL/dx`` and parameter gradients. ``dx`` must not alias ``dy`` or ``y`` unless a kernel says
it may (dropout's may).
"""

from __future__ import annotations

import functools

import numpy as np

from . import fused, onednn, workers


def array_module(*arrays):
    """Return ``cupy`` if any argument is a CuPy array, else ``numpy``."""
    for a in arrays:
        if type(a).__module__.startswith("cupy"):
            import cupy

            return cupy
    return np


# --- dense -------------------------------------------------------------------------------------


def dense_forward(x, w, b, out) -> None:
    """``out = x @ w + b``. x: (B, I), w: (I, O), b: (O,), out: (B, O). A float32 product large
    enough runs on oneDNN (:func:`.onednn.matmul`), the bias added in it."""
    if onednn.matmul(x, w, out, b):
        return
    xp = array_module(x)
    xp.matmul(x, w, out=out)
    xp.add(out, b, out=out)


def dense_backward(x, w, dy, dx, dw, db) -> None:
    """Gradients of ``y = x @ w + b``.

    x: (B, I), w: (I, O), dy: (B, O); writes dw: (I, O), db: (O,) and, unless ``dx`` is None
    (the first layer needs no input gradient), dx: (B, I). A float32 product large enough runs on
    oneDNN (:func:`.onednn.matmul`).
    """
    xp = array_module(x)
    if not onednn.matmul(x.T, dy, dw):
        xp.matmul(x.T, dy, out=dw)
    column_sums(dy, db)
    if dx is not None and not onednn.matmul(dy, w.T, dx):
        xp.matmul(dy, w.T, out=dx)


# --- reductions over a short axis ----------------------------------------------------------------
#
# Note [Reductions over a short axis]: NumPy 2.4 reduces the short axis of a 2-D array one short
# inner loop at a time: a (4096, 8) float32 array's sum over its rows took 110 us, its maximum over
# the 2 columns of a (4096, 2) one 195 us, where a product with a vector of ones took 7.6 us and
# the column-by-column maximum 19 us (medians of 300 calls). A small model's iteration is a
# handful of such reductions (the bias gradients, the cross-entropy's softmax), so on NumPy these
# take the fast form: the sum over rows (of any width) as the BLAS's product ones @ a (its own
# order of additions: a float32 sum like NumPy's, to rounding), the maximum and the sum over up to
# SHORT_ROW columns column by column (the same values as NumPy's: a maximum is exact, and its sum
# of fewer than 8 elements adds them in this order too).

#: Columns up to which a row's maximum and sum are taken column by column on NumPy.
SHORT_ROW = 7


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype) -> np.ndarray:
    ones = np.ones(n, dtype)
    ones.flags.writeable = False
    return ones


def column_sums(a, out) -> None:
    """``out = a.sum(axis=0)``: a (B, N) float, out (N,) (Note [Reductions over a short axis])."""
    xp = array_module(a)
    if xp is np and a.dtype in (np.float32, np.float64) and out.dtype == a.dtype and len(a):
        np.matmul(_ones(len(a), a.dtype), a, out=out)
    else:
        xp.sum(a, axis=0, out=out)


def _along_rows(ufunc, reduction: str, a, out) -> None:
    """``out = a.<reduction>(axis=1, keepdims=True)`` for the ufunc's reduction: a (B, C), out
    (B, 1); on NumPy column by column up to :data:`SHORT_ROW` columns, the ufunc applied in
    column order (Note [Reductions over a short axis])."""
    xp = array_module(a)
    if xp is np and 1 < a.shape[1] <= SHORT_ROW:
        ufunc(a[:, 0], a[:, 1], out=out[:, 0])
        for j in range(2, a.shape[1]):
            ufunc(out[:, 0], a[:, j], out=out[:, 0])
    else:
        getattr(xp, reduction)(a, axis=1, keepdims=True, out=out)


def row_max(a, out) -> None:
    """``out = a.max(axis=1, keepdims=True)``: a (B, C), out (B, 1)."""
    _along_rows(np.maximum, "max", a, out)


def row_sums(a, out) -> None:
    """``out = a.sum(axis=1, keepdims=True)``: a (B, C), out (B, 1)."""
    _along_rows(np.add, "sum", a, out)


def by_row(ufunc, a, column, out) -> None:
    """``ufunc(a, column, out=out)``: a and out (B, C), column (B, 1), one value a row; on NumPy
    column by column up to :data:`SHORT_ROW` columns (Note [Reductions over a short axis]: a
    (4096, 2) array less a column took 33 us broadcast, 12 us column by column)."""
    if array_module(a) is np and 1 < a.shape[1] <= SHORT_ROW:
        for j in range(a.shape[1]):
            ufunc(a[:, j], column[:, 0], out=out[:, j])
    else:
        ufunc(a, column, out=out)


@functools.lru_cache(maxsize=16)
def _row_starts(rows: int, columns: int) -> np.ndarray:
    starts = np.arange(rows, dtype=np.intp) * columns
    starts.flags.writeable = False
    return starts


def _at_labels(a, labels):
    """The flat positions of ``a[i, labels[i]]`` in ``a`` (B, C), C-contiguous, as an index array
    (B,): the rows' starts, kept per shape, plus the labels."""
    xp = array_module(a)
    if xp is np:
        return _row_starts(*a.shape) + labels
    return xp.arange(a.shape[0]) * a.shape[1] + labels


# --- activations (backward from the forward output y, which is what the layer keeps) ------------


#: Elements of the zero row :func:`relu_forward` compares against on the CPU.
ZERO_ROW_NELEMS = 1 << 14


@functools.lru_cache(maxsize=None)
def _zero_row(dtype) -> np.ndarray:
    row = np.zeros(ZERO_ROW_NELEMS, dtype)
    row.flags.writeable = False
    return row


def _relu_flat(x, out) -> None:
    """``out = max(x, 0)`` of 1-D contiguous NumPy arrays, as rows of :data:`ZERO_ROW_NELEMS`
    against a row of zeros: NumPy 2.4's maximum of float32 against a scalar took 0.39 ms for
    2^20 elements, against 0.15 ms with the zeros as an array (the tail, with the scalar)."""
    full = x.size - x.size % ZERO_ROW_NELEMS
    if full:
        np.maximum(x[:full].reshape(-1, ZERO_ROW_NELEMS), _zero_row(x.dtype),
                   out=out[:full].reshape(-1, ZERO_ROW_NELEMS))
    np.maximum(x[full:], 0, out=out[full:])


def relu_forward(x, out) -> None:
    """``out = max(x, 0)``, elementwise (a NaN stays NaN); x and out of one shape (on the CPU,
    a large one split by rows over the workers: :func:`.workers.split`)."""
    xp = array_module(x)
    if xp is np and x.flags.c_contiguous and out.flags.c_contiguous:
        workers.split(lambda a, b: _relu_flat(x[a:b].reshape(-1), out[a:b].reshape(-1)), len(x), x.size, xp)
    else:
        workers.split(lambda a, b: xp.maximum(x[a:b], 0, out=out[a:b]), len(x), x.size, xp)


def relu_backward(y, dy, dx) -> None:
    """``dx = dy``, but 0 where ``y <= 0``, from the forward output ``y`` (as PyTorch's: a NaN in
    ``y`` passes ``dy`` on). The mask is written into ``dx`` as 0 or 1 first: 0.37 ms for 2^20
    float32, against 0.54 ms with ``sign``, which it replaced. Float32 NumPy arrays take one fused
    pass instead (:func:`.fused.relu_backward`, the same results bit for bit)."""
    if fused.relu_backward(y, dy, dx):
        return
    xp = array_module(y)

    def rows(a: int, b: int) -> None:
        xp.less_equal(y[a:b], 0, out=dx[a:b])
        xp.subtract(1, dx[a:b], out=dx[a:b])
        xp.multiply(dx[a:b], dy[a:b], out=dx[a:b])

    workers.split(rows, len(y), y.size, xp)


def tanh_forward(x, out) -> None:
    """``out = tanh(x)``, elementwise."""
    array_module(x).tanh(x, out=out)


def tanh_backward(y, dy, dx) -> None:
    """``dx = dy * (1 - y**2)`` from the forward output ``y``."""
    xp = array_module(y)
    xp.multiply(y, y, out=dx)
    xp.subtract(1, dx, out=dx)
    xp.multiply(dx, dy, out=dx)


def sigmoid_forward(x, out) -> None:
    """``out = 1 / (1 + exp(-x))``, elementwise, without overflow for large ``|x|``."""
    xp = array_module(x)
    # 1/(1+exp(-x)) == (1 + tanh(x/2)) / 2, which never overflows.
    xp.multiply(x, 0.5, out=out)
    xp.tanh(out, out=out)
    xp.add(out, 1, out=out)
    xp.multiply(out, 0.5, out=out)


def sigmoid_backward(y, dy, dx) -> None:
    """``dx = dy * y * (1 - y)`` from the forward output ``y``."""
    xp = array_module(y)
    xp.subtract(1, y, out=dx)
    xp.multiply(dx, y, out=dx)
    xp.multiply(dx, dy, out=dx)


ACTIVATIONS = {
    "relu": (relu_forward, relu_backward),
    "tanh": (tanh_forward, tanh_backward),
    "sigmoid": (sigmoid_forward, sigmoid_backward),
}


# --- dropout (inverted: scaled at training time, identity at inference) ------------------------


def dropout_mask(uniform, p: float, mask) -> None:
    """Turn uniform draws in [0, 1) into the inverted-dropout mask ``(u >= p) / (1 - p)``.

    uniform and mask have one shape; they may be the same array.
    """
    xp = array_module(uniform)
    xp.greater_equal(uniform, p, out=mask)
    xp.multiply(mask, 1.0 / (1.0 - p), out=mask)


def dropout_forward(x, mask, out) -> None:
    """``out = x * mask``; the mask comes from :func:`dropout_mask`."""
    array_module(x).multiply(x, mask, out=out)


def dropout_backward(mask, dy, dx) -> None:
    """``dx = dy * mask``; ``dx`` may be ``dy`` (in place)."""
    array_module(mask).multiply(dy, mask, out=dx)


# --- losses --------------------------------------------------------------------------------------


def softmax_cross_entropy_forward(logits, labels, probs, rowbuf, loss) -> None:
    """Mean softmax cross-entropy over the batch.

    logits: (B, C) float; labels: (B,) int32 class indices in [0, C); writes probs: (B, C), the
    softmax (kept for the backward pass); rowbuf: (B, 1) float workspace; loss: (1,) float, the
    mean of ``-log softmax(logits)[i, labels[i]]``.
    """
    xp = array_module(logits)
    row_max(logits, rowbuf)
    by_row(xp.subtract, logits, rowbuf, probs)
    xp.exp(probs, out=probs)
    row_sums(probs, rowbuf)
    by_row(xp.divide, probs, rowbuf, probs)
    # Gather p[i, label_i] into rowbuf, clamp away from 0, and average -log of it.
    rows = rowbuf.reshape(-1)
    xp.take(probs.reshape(-1), _at_labels(probs, labels), out=rows)
    xp.maximum(rows, np.finfo(probs.dtype).tiny, out=rows)
    xp.log(rows, out=rows)
    xp.mean(rows, keepdims=True, out=loss)
    xp.negative(loss, out=loss)


def softmax_cross_entropy_backward(probs, labels, dlogits) -> None:
    """``dlogits = (probs - onehot(labels)) / B``. probs, dlogits: (B, C); labels: (B,) int32."""
    xp = array_module(probs)
    b = probs.shape[0]
    dlogits[...] = probs
    flat, at = dlogits.reshape(-1), _at_labels(dlogits, labels)
    flat[at] -= 1
    xp.multiply(dlogits, 1.0 / b, out=dlogits)


def mse_forward(pred, target, diff, loss) -> None:
    """Mean squared error over every element.

    pred, target: (B, T) float; writes diff: (B, T) = pred - target (kept for backward) and
    loss: (1,) = mean(diff**2).
    """
    xp = array_module(pred)
    xp.subtract(pred, target, out=diff)
    loss[...] = xp.vdot(diff.reshape(-1), diff.reshape(-1)) / diff.size


def mse_backward(diff, dpred) -> None:
    """``dpred = 2 * diff / numel``. diff, dpred: (B, T)."""
    array_module(diff).multiply(diff, 2.0 / diff.size, out=dpred)


# --- optimizers ---------------------------------------------------------------------------------
#
# Both updates work in place with the gradient as their only scratch space (it is dead after the
# step), so an optimizer step allocates nothing beyond the tensors it updates.


def _add_weight_decay(xp, g, w, weight_decay: float) -> None:
    """``g += weight_decay * w`` without a temporary: g/wd + w, times wd."""
    if weight_decay:
        xp.divide(g, weight_decay, out=g)
        xp.add(g, w, out=g)
        xp.multiply(g, weight_decay, out=g)


def sgd_update(w, g, velocity, lr: float, momentum: float, weight_decay: float = 0.0) -> None:
    """SGD with momentum and L2 weight decay, in place (PyTorch's ``torch.optim.SGD``, no Nesterov).

    ``g' = g + weight_decay * w``; ``velocity = momentum * velocity + g'``; ``w -= lr * velocity``.
    w, g, velocity: arrays of one shape; ``g`` may be overwritten. On float32 NumPy arrays one
    fused pass (:func:`.fused.sgd`, the same results bit for bit), else NumPy's or CuPy's passes.
    """
    if fused.sgd(w, g, velocity, lr, momentum, weight_decay):
        return
    xp = array_module(w)
    _add_weight_decay(xp, g, w, weight_decay)
    xp.multiply(velocity, momentum, out=velocity)
    xp.add(velocity, g, out=velocity)
    xp.multiply(velocity, lr, out=g)
    xp.subtract(w, g, out=w)


def adam_update(w, g, m, v, lr: float, beta1: float, beta2: float, eps: float, step: int,
                weight_decay: float = 0.0) -> None:
    """Adam (Kingma & Ba, arXiv 1412.6980, Algorithm 1) with L2 weight decay, in place.

    ``g' = g + weight_decay * w``; ``m = b1*m + (1-b1)*g'``; ``v = b2*v + (1-b2)*g'**2``;
    ``w -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)``, as ``torch.optim.Adam``.
    ``step`` is t, counted from 1. w, g, m, v: arrays of one shape; ``g`` may be overwritten. On
    float32 NumPy arrays one fused pass (:func:`.fused.adam`, the same results bit for bit), else
    NumPy's or CuPy's passes.
    """
    if fused.adam(w, g, m, v, lr, beta1, beta2, eps, step, weight_decay):
        return
    xp = array_module(w)
    _add_weight_decay(xp, g, w, weight_decay)
    # m = b1*m + (1-b1)*g  ==  b1*(m - g) + g
    xp.subtract(m, g, out=m)
    xp.multiply(m, beta1, out=m)
    xp.add(m, g, out=m)
    xp.multiply(g, g, out=g)
    xp.subtract(v, g, out=v)
    xp.multiply(v, beta2, out=v)
    xp.add(v, g, out=v)
    xp.sqrt(v, out=g)
    xp.multiply(g, 1.0 / (1.0 - beta2 ** step) ** 0.5, out=g)
    xp.add(g, eps, out=g)
    xp.divide(m, g, out=g)
    xp.multiply(g, lr / (1.0 - beta1 ** step), out=g)
    xp.subtract(w, g, out=w)
