"""Kernels of convolutional networks: the forward and backward arithmetic of 2-D convolution,
max / average / global average pooling, batch normalisation, residual addition, channel
concatenation and flatten, on NumPy or CuPy arrays through the same code.

As in :mod:`.kernels`, every kernel writes into arrays its caller passes in, so on the device the
bytes it touches are tensors the memory manager placed — the convolution's lowering buffers
included: :class:`ConvGeometry` says the shape of each *workspace* (the padded input, the im2col
matrix of one group, the matrix product of one group), and the caller allocates them as arena
tensors. Temporaries are per-channel vectors and, in pooling, masks of the output's size. Layout is NCHW: ``x`` (B, C, H, W). Kernels are dtype-generic (float32 in training,
float64 in the gradient tests) and array-module generic.

Convolution is lowered to matrix products (im2col; Chellapilla, Puri and Simard, "High
Performance Convolutional Neural Networks for Document Processing", 2006): the receptive fields
of one group become the columns of a (C/g·KH·KW, B·OH·OW) matrix, filled by one copy per kernel
offset whose innermost axis is an image row (a layout with the kernel innermost copied three
elements at a time and was several times slower), so the forward pass is one product per group,
the weight gradient another, and the input gradient a product followed by a scatter-add of the
columns back into the padded input (col2im, one strided add per kernel offset). The backward kernels compute gradients of a scalar
loss ``L``: given ``dy = dL/dy`` they write ``dx = dL/dx`` and the parameter gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .kernels import array_module

#: Workspace elements a convolution may take without chunking its batch (16 MB of float32): below
#: it, more and smaller products cost more in kernel calls than the memory they save.
UNCHUNKED_NELEMS = 1 << 22


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))


@dataclass(frozen=True)
class ConvGeometry:
    """The shapes of one 2-D convolution (or pooling window): input (B, C, H, W), kernel
    (KH, KW), stride, padding (zeros on both sides), dilation, groups, output channels O.

    Raises ValueError for a kernel that does not fit the padded input, or channels that the
    groups do not divide."""

    batch: int
    channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1

    def __post_init__(self):
        if self.channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"groups {self.groups} must divide the input channels {self.channels} and the output "
                             f"channels {self.out_channels}")
        if self.out_height < 1 or self.out_width < 1:
            raise ValueError(f"a {self.kernel} kernel (dilation {self.dilation}) does not fit an input of "
                             f"{self.height}x{self.width} with padding {self.padding}")

    @classmethod
    def of(cls, x_shape, out_channels: int, kernel, stride=1, padding=0, dilation=1, groups: int = 1):
        b, c, h, w = x_shape
        return cls(b, c, h, w, out_channels, _pair(kernel), _pair(stride), _pair(padding), _pair(dilation), groups)

    def _out(self, size: int, k: int, s: int, p: int, d: int) -> int:
        return (size + 2 * p - d * (k - 1) - 1) // s + 1

    @property
    def out_height(self) -> int:
        return self._out(self.height, self.kernel[0], self.stride[0], self.padding[0], self.dilation[0])

    @property
    def out_width(self) -> int:
        return self._out(self.width, self.kernel[1], self.stride[1], self.padding[1], self.dilation[1])

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """(B, O, OH, OW)."""
        return self.batch, self.out_channels, self.out_height, self.out_width

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """(O, C / groups, KH, KW)."""
        return self.out_channels, self.channels // self.groups, *self.kernel

    @property
    def padded_shape(self) -> tuple[int, int, int, int]:
        """Workspace: the zero-padded input (B, C, H + 2·PH, W + 2·PW); the convolution keeps it
        channels first, (C, B, H + 2·PH, W + 2·PW), in the same elements."""
        return self.batch, self.channels, self.height + 2 * self.padding[0], self.width + 2 * self.padding[1]

    @property
    def cols_shape(self) -> tuple[int, int]:
        """Workspace: one group's receptive fields as columns (C/g·KH·KW, B·OH·OW)."""
        kh, kw = self.kernel
        return self.channels // self.groups * kh * kw, self.batch * self.out_height * self.out_width

    @property
    def product_shape(self) -> tuple[int, int]:
        """Workspace: one group's matrix product (O/g, B·OH·OW)."""
        return self.out_channels // self.groups, self.batch * self.out_height * self.out_width

    @property
    def workspace_nelems(self) -> int:
        """Elements of the three workspaces (padded input, columns, product) together, for the
        whole batch at once."""
        return sum(int(np.prod(s)) for s in (self.padded_shape, self.cols_shape, self.product_shape))

    @property
    def rows_per_chunk(self) -> int:
        """Rows of the batch lowered at once by :func:`conv2d_forward_chunked` and
        :func:`conv2d_backward_chunked`: the most whose workspaces hold no more elements than the
        layer's input and output for the whole batch, or than :data:`UNCHUNKED_NELEMS` (at least
        one row). Lowering a whole batch
        at once made the columns of a 3x3 convolution nine times its input: VGG-16's first
        convolutions at 224x224, batch 16, took 2.2 GB of workspace beside 0.2 GB tensors, more
        than half the network's unscheduled peak, a floor no schedule could go below."""
        per_row = replace(self, batch=1).workspace_nelems
        limit = max(self.batch * (self.channels * self.height * self.width
                                  + self.out_channels * self.out_height * self.out_width), UNCHUNKED_NELEMS)
        return max(1, min(self.batch, limit // per_row))

    def chunks(self) -> list[tuple[int, int, "ConvGeometry"]]:
        """(first row, end row, geometry of those rows) of each chunk of :attr:`rows_per_chunk`."""
        step = self.rows_per_chunk
        return [(start, min(start + step, self.batch), replace(self, batch=min(step, self.batch - start)))
                for start in range(0, self.batch, step)]

    @property
    def chunked_workspace_nelems(self) -> int:
        """Elements of the workspace of the chunked kernels: one chunk's three workspaces, and,
        when the batch takes several chunks, room for a chunk's weight and bias gradients, which
        the backward pass adds up."""
        nelems = replace(self, batch=self.rows_per_chunk).workspace_nelems
        if self.rows_per_chunk < self.batch:
            nelems += math.prod(self.weight_shape) + self.out_channels
        return nelems

    def tap(self, padded, i: int, j: int):
        """(B, C, OH, OW): the input element under kernel offset (i, j) of every window, as a
        strided view of ``padded``."""
        (sh, sw), (dh, dw) = self.stride, self.dilation
        oh, ow = self.out_height, self.out_width
        return padded[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]


def _pad_into(x, padded, geometry: ConvGeometry, fill=0) -> None:
    ph, pw = geometry.padding
    padded.fill(fill)
    padded[:, :, ph:ph + geometry.height, pw:pw + geometry.width] = x


def _channels_first(padded, geometry: ConvGeometry):
    """The convolution's padded-input workspace (B, C, HP, WP) read as (C, B, HP, WP): the
    convolution keeps its padded input channels first, so that im2col and col2im copy whole
    image rows in the order of the columns' rows (one transposing copy of the input instead of
    one per kernel offset)."""
    b, c, hp, wp = geometry.padded_shape
    return padded.reshape(c, b, hp, wp)


# --- convolution ---------------------------------------------------------------------------------


def _im2col(geometry: ConvGeometry, padded_cf, cols, group: int) -> None:
    """Fill ``cols`` (C/g·KH·KW, B·OH·OW) with one group's receptive fields: row (c, i, j) holds
    input channel c under kernel offset (i, j) of every window. One copy of a (C/g, B, OH, OW)
    slab per kernel offset from the channels-first padded input, whose innermost axis is a row of
    the image."""
    cg = geometry.channels // geometry.groups
    kh, kw = geometry.kernel
    bsz, _, oh, ow = geometry.out_shape
    rows = cols.reshape(cg, kh, kw, bsz, oh, ow)
    source = padded_cf[group * cg:(group + 1) * cg]
    for i in range(kh):
        for j in range(kw):
            rows[:, i, j] = geometry.tap(source, i, j)


def _pad_channels_first(x, padded, geometry: ConvGeometry):
    """Zero-pad ``x`` (B, C, H, W) into the workspace, channels first; returns that view."""
    ph, pw = geometry.padding
    padded_cf = _channels_first(padded, geometry)
    if ph or pw:
        padded_cf.fill(0)
    padded_cf[:, :, ph:ph + geometry.height, pw:pw + geometry.width] = x.transpose(1, 0, 2, 3)
    return padded_cf


def conv2d_forward(x, w, b, out, geometry: ConvGeometry, padded, cols, product) -> None:
    """``out = conv2d(x, w) + b``. x: (B, C, H, W), w: (O, C/g, KH, KW), b: (O,) or None,
    out: (B, O, OH, OW); ``padded``, ``cols``, ``product``: the workspaces of ``geometry``."""
    xp = array_module(x)
    padded_cf = _pad_channels_first(x, padded, geometry)
    og = geometry.out_channels // geometry.groups
    bsz, _, oh, ow = geometry.out_shape
    for g in range(geometry.groups):
        _im2col(geometry, padded_cf, cols, g)
        xp.matmul(w[g * og:(g + 1) * og].reshape(og, -1), cols, out=product)
        out[:, g * og:(g + 1) * og] = product.reshape(og, bsz, oh, ow).transpose(1, 0, 2, 3)
    if b is not None:
        xp.add(out, b.reshape(1, -1, 1, 1), out=out)


def conv_workspaces(geometry: ConvGeometry, flat):
    """The convolution workspaces (padded, cols, product) of ``geometry`` as views of the flat
    array ``flat``, from its start."""
    views, start = [], 0
    for shape in (geometry.padded_shape, geometry.cols_shape, geometry.product_shape):
        n = math.prod(shape)
        views.append(flat[start:start + n].reshape(shape))
        start += n
    return views


def conv2d_forward_chunked(x, w, b, out, geometry: ConvGeometry, flat) -> None:
    """:func:`conv2d_forward` over the batch in chunks of ``geometry.rows_per_chunk`` rows;
    ``flat``: a workspace of ``geometry.chunked_workspace_nelems`` elements."""
    for start, stop, g in geometry.chunks():
        conv2d_forward(x[start:stop], w, b, out[start:stop], g, *conv_workspaces(g, flat))


def conv2d_backward_chunked(x, w, dy, dx, dw, db, geometry: ConvGeometry, flat) -> None:
    """:func:`conv2d_backward` over the batch in chunks of ``geometry.rows_per_chunk`` rows, the
    weight and bias gradients of the chunks added up; ``flat``: a workspace of
    ``geometry.chunked_workspace_nelems`` elements."""
    chunks = geometry.chunks()
    if len(chunks) == 1:
        conv2d_backward(x, w, dy, dx, dw, db, geometry, *conv_workspaces(geometry, flat))
        return
    partial_at = chunks[0][2].workspace_nelems                 # after the first chunk's workspaces
    partial_dw = flat[partial_at:partial_at + dw.size].reshape(dw.shape)
    partial_db = None if db is None else flat[partial_at + dw.size:partial_at + dw.size + db.size]
    xp = array_module(dy)
    for k, (start, stop, g) in enumerate(chunks):
        conv2d_backward(x[start:stop], w, dy[start:stop], None if dx is None else dx[start:stop],
                        dw if k == 0 else partial_dw, db if k == 0 else partial_db, g, *conv_workspaces(g, flat))
        if k:
            xp.add(dw, partial_dw, out=dw)
            if db is not None:
                xp.add(db, partial_db, out=db)


def conv2d_backward(x, w, dy, dx, dw, db, geometry: ConvGeometry, padded, cols, product) -> None:
    """Gradients of :func:`conv2d_forward` at input ``x``; ``padded``, ``cols`` and ``product`` are
    scratch (the workspaces of ``geometry``). Writes dw: (O, C/g, KH, KW), db: (O,) unless None,
    and dx: (B, C, H, W) unless None."""
    xp = array_module(dy)
    padded_cf = _pad_channels_first(x, padded, geometry)
    og = geometry.out_channels // geometry.groups
    cg = geometry.channels // geometry.groups
    bsz, _, oh, ow = geometry.out_shape
    kh, kw = geometry.kernel
    if db is not None:
        xp.sum(dy, axis=(0, 2, 3), out=db)
    for g in range(geometry.groups):
        _im2col(geometry, padded_cf, cols, g)
        product.reshape(og, bsz, oh, ow)[...] = dy[:, g * og:(g + 1) * og].transpose(1, 0, 2, 3)
        xp.matmul(product, cols.T, out=dw[g * og:(g + 1) * og].reshape(og, -1))
    if dx is None:
        return
    padded_cf.fill(0)
    for g in range(geometry.groups):
        product.reshape(og, bsz, oh, ow)[...] = dy[:, g * og:(g + 1) * og].transpose(1, 0, 2, 3)
        xp.matmul(w[g * og:(g + 1) * og].reshape(og, -1).T, product, out=cols)
        rows = cols.reshape(cg, kh, kw, bsz, oh, ow)
        target = padded_cf[g * cg:(g + 1) * cg]
        for i in range(kh):                                 # col2im: one strided add per kernel offset
            for j in range(kw):
                geometry.tap(target, i, j)[...] += rows[:, i, j]
    ph, pw = geometry.padding
    dx[...] = padded_cf[:, :, ph:ph + geometry.height, pw:pw + geometry.width].transpose(1, 0, 2, 3)


# --- pooling -------------------------------------------------------------------------------------


def max_pool_forward(x, out, argmax, geometry: ConvGeometry, padded) -> None:
    """Max over each window (padding counts as -inf, as in PyTorch). x: (B, C, H, W), out and
    argmax: (B, C, OH, OW), argmax an integer array (the window's flat offset, for the backward
    pass; None at inference);
    ``geometry``: a window geometry whose output channels are C; ``padded``: its padded-input
    workspace."""
    xp = array_module(x)
    if any(geometry.padding):
        _pad_into(x, padded, geometry, fill=-np.inf)
    else:                                                   # no padding: the windows are views of x
        padded = x
    kh, kw = geometry.kernel
    out[...] = geometry.tap(padded, 0, 0)
    if argmax is None:                                      # inference: no backward pass follows
        for offset in range(1, kh * kw):
            xp.maximum(out, geometry.tap(padded, offset // kw, offset % kw), out=out)
        return
    argmax.fill(0)
    for offset in range(1, kh * kw):                        # the first maximum wins, as in PyTorch
        v = geometry.tap(padded, offset // kw, offset % kw)
        larger = v > out
        xp.maximum(out, v, out=out)
        argmax[...] = xp.where(larger, offset, argmax)      # a select: masked copies were 10x slower


def max_pool_backward(dy, argmax, dx, geometry: ConvGeometry, padded) -> None:
    """Gradient of :func:`max_pool_forward`: each output's gradient goes to its window's maximum
    (summed where windows overlap). ``padded`` is scratch."""
    kh, kw = geometry.kernel
    padded.fill(0)
    for offset in range(kh * kw):
        geometry.tap(padded, offset // kw, offset % kw)[...] += dy * (argmax == offset)
    ph, pw = geometry.padding
    dx[...] = padded[:, :, ph:ph + geometry.height, pw:pw + geometry.width]


def avg_pool_forward(x, out, geometry: ConvGeometry, padded) -> None:
    """Mean over each window, zero padding counted (PyTorch's ``count_include_pad=True``)."""
    if any(geometry.padding):
        _pad_into(x, padded, geometry)
    else:
        padded = x
    kh, kw = geometry.kernel
    out.fill(0)
    for i in range(kh):
        for j in range(kw):
            out += geometry.tap(padded, i, j)
    out /= kh * kw


def avg_pool_backward(dy, dx, geometry: ConvGeometry, padded) -> None:
    """Gradient of :func:`avg_pool_forward`; ``padded`` is scratch."""
    kh, kw = geometry.kernel
    padded.fill(0)
    share = dy / (kh * kw)
    for i in range(kh):
        for j in range(kw):
            geometry.tap(padded, i, j)[...] += share
    ph, pw = geometry.padding
    dx[...] = padded[:, :, ph:ph + geometry.height, pw:pw + geometry.width]


def global_avg_pool_forward(x, out) -> None:
    """``out = mean over H, W``. x: (B, C, H, W), out: (B, C)."""
    array_module(x).mean(x, axis=(2, 3), out=out)


def global_avg_pool_backward(dy, dx) -> None:
    """dy: (B, C) -> dx: (B, C, H, W), each position dy / (H·W)."""
    dx[...] = (dy / (dx.shape[2] * dx.shape[3]))[:, :, None, None]


# --- batch normalisation ---------------------------------------------------------------------------


def _bn_axes(x) -> tuple[int, ...]:
    return (0,) if x.ndim == 2 else (0, 2, 3)


def _channel_dot(xp, a, b):
    """(C,): the sum over every axis but the channel axis of ``a · b``, without an (a · b) temporary."""
    return xp.einsum("nc,nc->c", a, b) if a.ndim == 2 else xp.einsum("nchw,nchw->c", a, b)


def _per_channel(v, x):
    return v.reshape(1, -1) if x.ndim == 2 else v.reshape(1, -1, 1, 1)


def batch_norm_forward(x, gamma, beta, out, mean, invstd, running_mean=None, running_var=None,
                       momentum: float = 0.1, eps: float = 1e-5) -> None:
    """Training: normalise over the batch (and H, W) per channel, ``out = gamma · (x − mean) ·
    invstd + beta`` (Ioffe and Szegedy, 2015). x: (B, C) or (B, C, H, W); gamma, beta, mean,
    invstd: (C,). Writes the batch statistics ``mean`` and ``invstd = 1 / sqrt(var + eps)``
    (biased variance) for the backward pass and for a recompute that must give identical values,
    and, when given, updates ``running_mean`` / ``running_var`` in place with ``momentum`` and the
    unbiased variance, as PyTorch does."""
    xp = array_module(x)
    axes = _bn_axes(x)
    n = x.size // x.shape[1]
    xp.mean(x, axis=axes, out=mean)
    xp.subtract(x, _per_channel(mean, x), out=out)          # out holds x - mean meanwhile
    var = _channel_dot(xp, out, out) / n
    xp.sqrt(var + eps, out=invstd)
    xp.divide(1.0, invstd, out=invstd)
    xp.multiply(out, _per_channel(invstd * gamma, x), out=out)
    xp.add(out, _per_channel(beta, x), out=out)
    if running_mean is not None:
        running_mean *= 1 - momentum
        running_mean += momentum * mean
        running_var *= 1 - momentum
        running_var += momentum * var * (n / max(n - 1, 1))


def batch_norm_apply(x, gamma, beta, mean, invstd, out) -> None:
    """``out = gamma · (x − mean) · invstd + beta`` with given statistics: the saved batch
    statistics in a recompute (bit-identical to the forward pass), or ``invstd = 1 / sqrt(
    running_var + eps)`` with the running mean at inference."""
    xp = array_module(x)
    xp.subtract(x, _per_channel(mean, x), out=out)
    xp.multiply(out, _per_channel(invstd * gamma, x), out=out)
    xp.add(out, _per_channel(beta, x), out=out)


def batch_norm_backward(x, gamma, mean, invstd, dy, dx, dgamma, dbeta) -> None:
    """Gradients of the training-mode :func:`batch_norm_forward` from its saved statistics.
    Writes dgamma, dbeta: (C,) and dx (shape of x) unless None."""
    xp = array_module(x)
    n = x.size // x.shape[1]
    xhat = dx if dx is not None else xp.empty_like(x)       # dx holds x̂ meanwhile
    xp.subtract(x, _per_channel(mean, x), out=xhat)
    xp.multiply(xhat, _per_channel(invstd, x), out=xhat)
    xp.sum(dy, axis=_bn_axes(x), out=dbeta)
    dgamma[...] = _channel_dot(xp, dy, xhat)
    if dx is not None:       # dx = gamma · invstd · (dy − (dbeta + x̂ · dgamma) / n)
        xp.multiply(dx, _per_channel(dgamma, x), out=dx)
        xp.add(dx, _per_channel(dbeta, x), out=dx)
        xp.multiply(dx, -1.0 / n, out=dx)
        xp.add(dx, dy, out=dx)
        xp.multiply(dx, _per_channel(gamma * invstd, x), out=dx)


# --- graph structure -------------------------------------------------------------------------------


def add_forward(a, b, out) -> None:
    """Residual addition ``out = a + b`` (same shapes); its backward passes ``dy`` to both inputs."""
    array_module(a).add(a, b, out=out)


def concat_forward(inputs, out) -> None:
    """Channel concatenation of (B, C_i, H, W) inputs into out: (B, ΣC_i, H, W)."""
    start = 0
    for a in inputs:
        out[:, start:start + a.shape[1]] = a
        start += a.shape[1]


def concat_backward(dy, dxs) -> None:
    """Split dy: (B, ΣC_i, H, W) into the inputs' gradients, in order."""
    start = 0
    for dx in dxs:
        dx[...] = dy[:, start:start + dx.shape[1]]
        start += dx.shape[1]


def flatten_forward(x, out) -> None:
    """(B, C, H, W) -> (B, C·H·W), C-order (as ``torch.flatten(x, 1)``)."""
    out[...] = x.reshape(x.shape[0], -1)


def flatten_backward(dy, dx) -> None:
    dx[...] = dy.reshape(dx.shape)
