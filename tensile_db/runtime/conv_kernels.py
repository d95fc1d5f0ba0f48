"""Kernels of convolutional networks: the forward and backward arithmetic of 2-D convolution,
max / average / global average pooling, batch normalisation, residual addition, channel
concatenation and flatten, on NumPy or CuPy arrays through the same code.

As in :mod:`.kernels`, every kernel writes into arrays its caller passes in, so on the device the
bytes it touches are tensors the memory manager placed — the convolution's lowering buffers
included: :class:`ConvGeometry` says how many elements its forward and backward workspaces take
(the weights as a matrix, the padded input, the im2col matrix and the product of a chunk of the
batch; backward also two weight gradients a worker adds its chunks' into), and the caller
allocates them as arena tensors. Temporaries are per-channel vectors and,
in pooling, masks of the output's size. Images are stored channels last (Note [Channels last] in
:mod:`.layout`): ``x`` (B, H, W, C), and a (C,) vector broadcasts over the last axis. Kernels are
dtype-generic (float32 in training, float64 in the gradient tests) and array-module generic.

On the CPU a float32 convolution runs on oneDNN's primitives instead (:mod:`.onednn`, Note
[Convolutions by oneDNN]) where it can; the lowering below serves CuPy, float64 and what oneDNN
does not take. Convolution is lowered to matrix products (im2col; Chellapilla, Puri and Simard,
"High Performance Convolutional Neural Networks for Document Processing", 2006): a chunk of the
batch is padded into (B, HP, WP, C), and each window of one group becomes a row of a
(B·OH·OW, KH·KW·C/g) matrix in one strided copy whose innermost run is the window's KW·C adjacent
elements (with the channels first, the copy ran an image row or, with the kernel innermost, three
elements at a time). The forward pass is one product per group with the weights as a (O, KH·KW·C/g) matrix,
written into the output's rows (B·OH·OW, O) where there is one group; the weight gradient is
another; the input gradient is, with stride 1, the forward lowering of ``dy`` with the flipped,
transposed weights (the rows of the product in the order of ``dx``, no scatter), else a product
and a scatter-add of the columns back into the padded input (col2im, one strided add per kernel
offset). A 1x1 convolution of stride 1 without padding needs no lowering: its input's rows are
its columns. On the CPU the chunks are cache-sized
and run on all cores (Note [Chunk pipelines on the CPU] in :mod:`.workers`). The backward kernels
compute gradients of a scalar loss ``L``: given ``dy = dL/dy`` they write ``dx = dL/dx`` and the
parameter gradients.

Note [One lowering for both gradients]
--------------------------------------
Rationale: with stride 1 the backward pass lowered twice per chunk: ``x`` (padded, transposed
channels last, im2col) for the weight gradient, and ``dy`` for the input gradient as the
transposed convolution, besides copying ``dy`` channels last for the first product.

Approach: the columns of ``dy``'s lowering are, for each input position ``(b, u, v)``, the
``dy`` values under the flipped kernel's taps, ``dy[b, u + i·D − P', v + j·D − P', o]`` with
``P' = D·(K − 1) − P``; so ``x`` as a matrix, (B·H·W, C/g), transposed, times those columns is
``Σ_{b,u,v} x[b, u, v, c] · dy[b, u + i·D − P', v + j·D − P', o]``, the weight gradient at
``(o, c, K − 1 − i, K − 1 − j)``: the weight gradient in the transposed weight matrix's layout
(:func:`_transposed_weight_matrix`). One lowering, of ``dy``, then serves both products; with
groups, a group's channels of ``x`` go into the product workspace, which the input gradient's
product fills after the weight gradient's has read it. The network's first layer
(no ``dx``) and strided convolutions keep the lowering of ``x``. A chunk of the small CNN's
16 -> 16 3x3 convolution at 32x32 (two rows of the batch, one thread, medians of 101 calls, three
alternated runs): 509-541 -> 406-425 µs; of its 24 -> 32 one at 16x16 (five rows): 638-661 ->
551-559 µs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from . import layout, onednn, workers
from .kernels import array_module

#: Workspace elements a convolution may take without chunking its batch (16 MB of float32): below
#: it, more and smaller products cost more in kernel calls than the memory they save.
UNCHUNKED_NELEMS = 1 << 22
#: Lowering workspace elements of one chunk on the CPU (2 MB of float32, about a core's L2 cache
#: here): the 16 -> 16 3x3 convolution at 32x32, batch 64, on two workers, ran its forward pass in
#: 4.7 ms in chunks of 2 rows (this size), 6.9 ms in chunks of 5 and 8.8 ms in chunks of 1.
CACHE_NELEMS = 1 << 19


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))


@dataclass(frozen=True)
class ConvGeometry:
    """The shapes of one 2-D convolution (or pooling window): input of B rows of C channels of
    H x W (stored (B, H, W, C): :attr:`in_shape`), kernel (KH, KW), stride, padding (zeros on
    both sides), dilation, groups, output channels O.

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
        """The geometry of a stored input of shape ``x_shape`` (B, H, W, C)."""
        b, h, w, c = x_shape
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
    def in_shape(self) -> tuple[int, int, int, int]:
        """The stored input, (B, H, W, C)."""
        return self.batch, self.height, self.width, self.channels

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """The stored output, (B, OH, OW, O)."""
        return self.batch, self.out_height, self.out_width, self.out_channels

    @property
    def out_image(self) -> tuple[int, int, int]:
        """The output's per-row shape as a network names it, (O, OH, OW)."""
        return self.out_channels, self.out_height, self.out_width

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """(O, C / groups, KH, KW)."""
        return self.out_channels, self.channels // self.groups, *self.kernel

    @property
    def padded_shape(self) -> tuple[int, int, int, int]:
        """The padded input (B, H + 2·PH, W + 2·PW, C): a lowering's and a pooling window's workspace."""
        return self.batch, self.height + 2 * self.padding[0], self.width + 2 * self.padding[1], self.channels

    @property
    def cols_shape(self) -> tuple[int, int]:
        """Workspace: one group's receptive fields as rows (B·OH·OW, KH·KW·C/g), a window's elements
        in the order (i, j, c): kernel offset, then channel."""
        kh, kw = self.kernel
        return self.batch * self.out_height * self.out_width, kh * kw * (self.channels // self.groups)

    @property
    def product_shape(self) -> tuple[int, int]:
        """Workspace: one group's matrix product (B·OH·OW, O/g), channels last."""
        return self.batch * self.out_height * self.out_width, self.out_channels // self.groups

    @property
    def pointwise(self) -> bool:
        """A 1x1 convolution of stride 1 without padding in one group: its input's rows are its
        columns, lowered by no copy."""
        return self.kernel == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0) and self.groups == 1

    @property
    def workspace_nelems(self) -> int:
        """Elements of the three lowering workspaces (padded input, columns, product) together,
        for the whole batch at once."""
        return sum(math.prod(s) for s in (self.padded_shape, self.cols_shape, self.product_shape))

    @property
    def weight_nelems(self) -> int:
        return math.prod(self.weight_shape)

    @cached_property
    def transposed(self) -> ConvGeometry | None:
        """The input gradient as a convolution: with stride 1, ``dx`` is the convolution of ``dy``
        (channels O, zero-padded by D·(K − 1) − P) with the weights flipped in both kernel axes
        and their channel axes swapped, to C output channels in the same groups. None where that
        padding would be negative or the stride is not 1 (the gradient then goes through col2im)."""
        pad = tuple(d * (k - 1) - p for d, k, p in zip(self.dilation, self.kernel, self.padding))
        if self.stride != (1, 1) or min(pad) < 0:
            return None
        return ConvGeometry(self.batch, self.out_channels, self.out_height, self.out_width, self.channels,
                            self.kernel, (1, 1), pad, self.dilation, self.groups)

    def row_nelems(self, backward: bool) -> int:
        """Lowering workspace elements of one row of the batch: the forward pass's, or in the
        backward pass the larger of those and the transposed convolution's (:attr:`transposed`)."""
        return self._row_nelems[backward]

    @cached_property
    def _row_nelems(self) -> tuple[int, int]:
        """(forward, backward) of :meth:`row_nelems`, worked out once per geometry: every call of
        a convolution's kernel asks for them."""
        one = replace(self, batch=1)
        reverse = one.transposed
        return one.workspace_nelems, max(one.workspace_nelems, reverse.workspace_nelems if reverse else 0)

    @property
    def rows_per_chunk(self) -> int:
        """Rows of the batch a workspace holds lowered at once: the most whose lowering workspaces
        (backward pass) hold no more elements than the layer's input and output for the whole
        batch, or than :data:`UNCHUNKED_NELEMS` (at least one row). Lowering a whole batch at once
        made the columns of a 3x3 convolution nine times its input: VGG-16's first convolutions at
        224x224, batch 16, took 2.2 GB of workspace beside 0.2 GB tensors, more than half the
        network's unscheduled peak, a floor no schedule could go below. The CPU lowers fewer rows
        at a time within that room (:func:`chunk_plan`)."""
        limit = max(self.batch * (self.channels * self.height * self.width
                                  + self.out_channels * self.out_height * self.out_width), UNCHUNKED_NELEMS)
        return max(1, min(self.batch, limit // self.row_nelems(backward=True)))

    @property
    def forward_workspace_nelems(self) -> int:
        """Elements of the forward pass's workspace: the weights as a matrix, then the lowering
        workspaces of :attr:`rows_per_chunk` rows."""
        return self.weight_nelems + self.rows_per_chunk * self.row_nelems(backward=False)

    @property
    def backward_workspace_nelems(self) -> int:
        """Elements of the backward pass's workspace: the weights as a matrix (plain or
        transposed), a weight gradient of the chunks so far and one of a chunk, then the lowering
        workspaces of :attr:`rows_per_chunk` rows."""
        return 3 * self.weight_nelems + self.rows_per_chunk * self.row_nelems(backward=True)

    def tap(self, padded, i: int, j: int):
        """(B, OH, OW, C): the input element under kernel offset (i, j) of every window, as a
        strided view of ``padded`` (B, HP, WP, C)."""
        (sh, sw), (dh, dw) = self.stride, self.dilation
        oh, ow = self.out_height, self.out_width
        return padded[:, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]

    def interior(self, padded):
        """The input's elements of ``padded`` (B, HP, WP, C): a (B, H, W, C) view."""
        ph, pw = self.padding
        return padded[:, ph:ph + self.height, pw:pw + self.width]


def _pad_into(x, padded, geometry: ConvGeometry, fill=0) -> None:
    """``x`` (B, H, W, C) into ``padded`` (B, HP, WP, C), ``fill`` around it."""
    if any(geometry.padding):
        padded.fill(fill)
    geometry.interior(padded)[...] = x


# --- convolution ---------------------------------------------------------------------------------


def chunk_plan(geometry: ConvGeometry, workspace_nelems: int, backward: bool, xp=np,
               input_gradient: bool = True) -> tuple[int, int]:
    """(rows of a chunk, workers) for lowering ``geometry``'s batch in a workspace of
    ``workspace_nelems`` elements. On the GPU: :attr:`ConvGeometry.rows_per_chunk` rows, one
    worker (the largest products). On the CPU: chunks of at most :data:`CACHE_NELEMS` lowering
    elements, on as many workers (:func:`.workers.count`) as there are chunks and as the workspace
    holds each a chunk's room (and, backward, two weight gradients) beside the shared weight
    matrix (Note [Chunk pipelines on the CPU]). A backward pass without ``input_gradient`` (the
    network's first layer) needs no room for the transposed convolution, so its chunks are larger."""
    rows = geometry.rows_per_chunk
    if xp is not np:
        return rows, 1
    per_row, available = geometry.row_nelems(backward and input_gradient), workers.count()
    rows = max(1, min(rows, CACHE_NELEMS // per_row, -(-geometry.batch // available)))
    n = min(available, -(-geometry.batch // rows))
    per_worker = _worker_room(geometry, rows, backward, input_gradient)
    while n > 1 and geometry.weight_nelems + n * per_worker > workspace_nelems:
        n -= 1
    return rows, n


def _worker_room(geometry: ConvGeometry, rows: int, backward: bool, input_gradient: bool = True) -> int:
    """Workspace elements one worker takes after the shared weight matrix: the lowering
    workspaces of ``rows`` rows and, backward, first its two weight gradients."""
    return rows * geometry.row_nelems(backward and input_gradient) + (2 * geometry.weight_nelems if backward else 0)


def _lowering_views(geometry: ConvGeometry, flat):
    """The lowering workspaces of ``geometry`` as views of the flat array ``flat`` from its start:
    the padded input (B, HP, WP, C), the columns and the product."""
    views, start = [], 0
    for shape in (geometry.padded_shape, geometry.cols_shape, geometry.product_shape):
        n = math.prod(shape)
        views.append(flat[start:start + n].reshape(shape))
        start += n
    return views


def _windows(geometry: ConvGeometry, padded, group: int):
    """(B, OH, OW, KH, KW, C/g): every window of one group's channels, a strided view of the
    channels-last ``padded``; its innermost (KW, C/g) elements are adjacent in memory where the
    group is the whole input and the dilation 1."""
    xp = array_module(padded)
    cg = geometry.channels // geometry.groups
    source = padded[..., group * cg:(group + 1) * cg]
    sb, sh, sw, sc = source.strides
    (th, tw), (dh, dw) = geometry.stride, geometry.dilation
    b, oh, ow, _ = geometry.out_shape
    return xp.lib.stride_tricks.as_strided(source, (b, oh, ow, *geometry.kernel, cg),
                                           (sb, sh * th, sw * tw, sh * dh, sw * dw, sc))


def _matrix_as_weights(mat, geometry: ConvGeometry):
    """The weight matrix ``mat`` (O, KH·KW·C/g: filter o in the order of the columns' elements
    (i, j, c)) as a view in the weights' axes, (O, C/g, KH, KW)."""
    o, cg, kh, kw = geometry.weight_shape
    return mat.reshape(o, kh, kw, cg).transpose(0, 3, 1, 2)


def _transposed_matrix_as_weights(mat, geometry: ConvGeometry):
    """The weight matrix of :attr:`ConvGeometry.transposed`, ``mat`` (C, KH·KW·O/g: filter c of
    group g holds ``w[g·O/g + o, c − g·C/g, KH − 1 − i, KW − 1 − j]`` at (i, j, o)), as a view in
    the weights' axes with the groups apart, (g, O/g, C/g, KH, KW)."""
    o, cg, kh, kw = geometry.weight_shape
    g = geometry.groups
    return mat.reshape(g, cg, kh, kw, o // g).transpose(0, 4, 1, 2, 3)[:, :, :, ::-1, ::-1]


def _weight_matrix(w, geometry: ConvGeometry, out) -> None:
    """``out`` (O, KH·KW·C/g): the weights ``w`` as the forward pass's matrix (:func:`_matrix_as_weights`)."""
    _matrix_as_weights(out, geometry)[...] = w


def _transposed_weight_matrix(w, geometry: ConvGeometry, out) -> None:
    """``out`` (C, KH·KW·O/g): the weights ``w`` as the matrix of :attr:`ConvGeometry.transposed`
    (:func:`_transposed_matrix_as_weights`)."""
    _transposed_matrix_as_weights(out, geometry)[...] = w.reshape(geometry.groups, -1, *w.shape[1:])


def _lowered(x, geometry: ConvGeometry, flat):
    """For each group of ``geometry``, yield (group, columns, product workspace): the group's
    windows of ``x`` (the rows of ``geometry``, (B, H, W, C)) as rows, in the lowering workspaces
    of ``flat`` after padding ``x`` into them; or, for a pointwise convolution
    (:attr:`ConvGeometry.pointwise`), ``x`` itself as a (B·H·W, C) matrix."""
    padded, cols, product = _lowering_views(geometry, flat)
    if geometry.pointwise:
        yield 0, x.reshape(cols.shape), product
        return
    _pad_into(x, padded, geometry)
    bsz, oh, ow, _ = geometry.out_shape
    for g in range(geometry.groups):
        cols.reshape(bsz, oh, ow, *geometry.kernel, -1)[...] = _windows(geometry, padded, g)
        yield g, cols, product


def _group_matrix(a, group: int, groups: int, workspace):
    """One group's channels of ``a`` (B, H, W, C) as a (B·H·W, C/g) matrix: ``a`` itself where
    there is one group, else a copy into ``workspace`` (at least that many elements, C-order)."""
    rows, channels = math.prod(a.shape[:-1]), a.shape[-1]
    if groups == 1:
        return a.reshape(rows, channels)
    cg = channels // groups
    matrix = workspace.reshape(-1)[:rows * cg].reshape(rows, cg)
    matrix.reshape(*a.shape[:-1], cg)[...] = a[..., group * cg:(group + 1) * cg]
    return matrix


def _add_per_channel(a, v) -> None:
    """``a += v`` over the last axis: ``a`` (..., C) C-contiguous, ``v`` (C,). An image is added
    to as a (B·H, W·C) matrix with ``v`` tiled W times: a broadcast over a last axis of a few
    channels took twice as long (Note [Channels last] in :mod:`.layout`)."""
    matrix = _tiled_rows(a)
    array_module(a).add(matrix, _tile_for(v, matrix), out=matrix)


def _tile_for(v, matrix):
    """The (C,) vector ``v`` tiled to the length of ``matrix``'s rows (:func:`_tiled_rows`)."""
    if matrix.shape[-1] == v.shape[0]:
        return v
    return array_module(v).tile(v, matrix.shape[-1] // v.shape[0])


def _tiled_rows(a):
    """``a`` (..., C), C-contiguous, as a matrix whose rows are its last two axes' elements (one
    row of an image, W·C), or ``a`` itself when it has at most two axes; a view, never a copy
    (ValueError otherwise: a write into a copy would be lost)."""
    if a.ndim <= 2:
        return a
    if not a.flags.c_contiguous:
        raise ValueError(f"an array of shape {a.shape} and strides {a.strides} is not C-contiguous")
    return a.reshape(-1, a.shape[-2] * a.shape[-1])


def _forward_rows(x, wmat, b, out, geometry: ConvGeometry, flat) -> None:
    """``out = conv2d(x, w) + b`` for the rows of ``geometry``, ``wmat`` the weights as a matrix
    (:func:`_weight_matrix`), ``b`` (O,) or tiled to a row of ``out`` (:func:`_tile_for`), or
    None, ``flat`` room for its lowering workspaces. With one group the
    product is written into ``out`` as its (B·OH·OW, O) matrix."""
    xp = array_module(x)
    og = geometry.out_channels // geometry.groups
    for g, cols, product in _lowered(x, geometry, flat):
        if geometry.groups == 1:
            xp.matmul(cols, wmat.T, out=out.reshape(product.shape))
        else:
            xp.matmul(cols, wmat[g * og:(g + 1) * og].T, out=product)
            out[..., g * og:(g + 1) * og] = product.reshape(*out.shape[:-1], og)
    if b is not None:
        _add_per_channel(out, b)


def _weight_gradient_rows(x, dy, dwmat, geometry: ConvGeometry, flat) -> None:
    """``dwmat`` (O, KH·KW·C/g): the weight gradient of the rows of ``geometry`` alone, in the
    order of :func:`_weight_matrix`."""
    xp = array_module(dy)
    og = geometry.out_channels // geometry.groups
    for g, cols, product in _lowered(x, geometry, flat):
        xp.matmul(_group_matrix(dy, g, geometry.groups, product).T, cols, out=dwmat[g * og:(g + 1) * og])


def _gradients_transposed_rows(x, dy, wmat_t, dx, dwmat_t, geometry: ConvGeometry, flat) -> None:
    """``dx`` and the weight gradient of the rows of ``geometry`` from one lowering, that of
    ``dy`` for the transposed convolution (:attr:`ConvGeometry.transposed`; Note [One lowering
    for both gradients]). ``wmat_t``: the weights as :func:`_transposed_weight_matrix` lays them
    out; ``dwmat_t`` (C, KH·KW·O/g): the weight gradient of these rows alone, in that layout."""
    xp = array_module(dy)
    cg = geometry.channels // geometry.groups
    for g, cols, product in _lowered(dy, geometry.transposed, flat):
        xg = _group_matrix(x, g, geometry.groups, product)      # group g of x, then of dx
        xp.matmul(xg.T, cols, out=dwmat_t[g * cg:(g + 1) * cg])
        if geometry.groups == 1:
            xp.matmul(cols, wmat_t.T, out=dx.reshape(xg.shape))
        else:
            xp.matmul(cols, wmat_t[g * cg:(g + 1) * cg].T, out=xg)
            dx[..., g * cg:(g + 1) * cg] = xg.reshape(*dx.shape[:-1], cg)


def _input_gradient_col2im(dy, wmat, dx, geometry: ConvGeometry, flat) -> None:
    """``dx`` of the rows of ``geometry`` by a product with the weights (``wmat``:
    :func:`_weight_matrix`) and a scatter-add of the columns into the padded input (col2im, one
    strided add per kernel offset): the path of strided convolutions."""
    xp = array_module(dy)
    padded, cols, product = _lowering_views(geometry, flat)
    padded.fill(0)                                           # the padded input's gradient meanwhile
    og, cg = geometry.out_channels // geometry.groups, geometry.channels // geometry.groups
    bsz, oh, ow, _ = geometry.out_shape
    (th, tw), (dh, dw) = geometry.stride, geometry.dilation
    for g in range(geometry.groups):
        xp.matmul(_group_matrix(dy, g, geometry.groups, product), wmat[g * og:(g + 1) * og], out=cols)
        windows = cols.reshape(bsz, oh, ow, *geometry.kernel, cg)
        target = padded[..., g * cg:(g + 1) * cg]
        for i in range(geometry.kernel[0]):
            for j in range(geometry.kernel[1]):
                target[:, i * dh:i * dh + th * (oh - 1) + 1:th, j * dw:j * dw + tw * (ow - 1) + 1:tw] += windows[
                    :, :, :, i, j]
    dx[...] = geometry.interior(padded)


def _chunks(rows: int, batch: int) -> list[tuple[int, int]]:
    """(start, stop) of each chunk of ``rows`` rows of a batch of ``batch``, in order."""
    return [(start, min(start + rows, batch)) for start in range(0, batch, rows)]


class _InOrder:
    """The chunks of a backward pass, handed out in order to whichever worker asks first, each
    with a buffer for its weight gradient; the buffers are added into ``total`` in chunk order,
    whichever worker finishes first (Note [Chunks to the first free worker] in :mod:`.workers`).
    Chunk 0 writes into ``total`` itself; the others take one of ``spares`` and give it back once
    added. A worker that fails calls :meth:`fail`: the others then take no more chunks."""

    def __init__(self, chunks: list, total, spares: list, xp):
        self._chunks, self._total, self._free, self._xp = chunks, total, list(spares), xp
        self._cond = threading.Condition()
        self._next = self._added = 0                 # the next chunk to hand out, and to add
        self._ready: dict = {}                       # chunk -> its buffer, done, not yet added
        self._failed = False

    def take(self):
        """(chunk index, (start, stop), buffer), or None when no chunk is left."""
        with self._cond:
            while self._next and not self._free and not self._failed and self._next < len(self._chunks):
                self._cond.wait()                    # an earlier chunk, being computed, frees one
            if self._failed or self._next >= len(self._chunks):
                return None
            i, self._next = self._next, self._next + 1
            return i, self._chunks[i], self._free.pop() if i else self._total

    def done(self, i: int, buffer) -> None:
        with self._cond:
            self._ready[i] = buffer
            while self._added in self._ready:
                b = self._ready.pop(self._added)
                if self._added:
                    self._xp.add(self._total, b, out=self._total)
                    self._free.append(b)
                self._added += 1
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()


def conv2d_forward(x, w, b, out, geometry: ConvGeometry, flat) -> None:
    """``out = conv2d(x, w) + b``, lowered to matrix products chunk by chunk (:func:`chunk_plan`).
    x: (B, H, W, C), w: (O, C/g, KH, KW), b: (O,) or None, out: (B, OH, OW, O), all of one float
    dtype; ``flat``: a workspace of :attr:`ConvGeometry.forward_workspace_nelems` elements. On
    the CPU in float32, oneDNN's primitive where it can (:mod:`.onednn`)."""
    if onednn.forward(x, w, b, out, geometry, flat):
        return
    rows, n = chunk_plan(geometry, flat.size, False, array_module(x))
    wn = geometry.weight_nelems
    wmat = flat[:wn].reshape(geometry.out_channels, -1)
    _weight_matrix(w, geometry, wmat)
    room = _worker_room(geometry, rows, backward=False)
    bias = None if b is None else _tile_for(b, _tiled_rows(out))      # tiled once, for every chunk

    chunks = iter(_chunks(rows, geometry.batch))      # shared: the first free worker takes the next

    def work(k: int) -> None:
        region = flat[wn + k * room:wn + (k + 1) * room]
        for start, stop in chunks:
            _forward_rows(x[start:stop], wmat, bias, out[start:stop], replace(geometry, batch=stop - start), region)

    workers.run(work, n)


def conv2d_backward(x, w, dy, dx, dw, db, geometry: ConvGeometry, flat) -> None:
    """Gradients of :func:`conv2d_forward` at input ``x``: dw (O, C/g, KH, KW), db (O,) unless
    None, dx (B, H, W, C) unless None (the network's input), from dy (B, OH, OW, O); ``flat``: a
    workspace of :attr:`ConvGeometry.backward_workspace_nelems` elements. Where the stride is 1,
    ``dx`` is the convolution of ``dy`` with the transposed weights
    (:attr:`ConvGeometry.transposed`) and the weight gradient a product with the same lowering of
    ``dy`` (Note [One lowering for both gradients]); else the weight gradient is a product with
    ``x`` lowered, and ``dx`` a product and col2im. The chunks' weight gradients are added in
    chunk order, whichever worker made them (:class:`_InOrder`). On the CPU in float32, oneDNN's
    primitives where they can (:mod:`.onednn`), the bias gradient still the sum here."""
    xp = array_module(dy)
    if db is not None:
        _channel_sum(dy, db)
    if onednn.backward(x, w, dy, dx, dw, geometry, flat):
        return
    rows, n = chunk_plan(geometry, flat.size, True, xp, input_gradient=dx is not None)
    wn, reverse = geometry.weight_nelems, geometry.transposed
    one_lowering = dx is not None and reverse is not None
    # the weight gradients' layout: the transposed weight matrix's with one lowering, else the weight matrix's
    grad_rows = geometry.channels if one_lowering else geometry.out_channels
    wmat = flat[:wn]
    if one_lowering:
        wmat = wmat.reshape(geometry.channels, -1)
        _transposed_weight_matrix(w, geometry, wmat)
    elif dx is not None:
        wmat = wmat.reshape(geometry.out_channels, -1)
        _weight_matrix(w, geometry, wmat)
    room = _worker_room(geometry, rows, backward=True, input_gradient=dx is not None)

    # each worker's room starts with two weight gradients: worker 0's first is the sum, the others hold a chunk's
    grads = [flat[wn + k * room + i * wn:wn + k * room + (i + 1) * wn].reshape(grad_rows, -1)
             for k in range(n) for i in (0, 1)]
    queue = _InOrder(_chunks(rows, geometry.batch), grads[0], grads[1:], xp) if n else None

    def work(k: int) -> None:
        region = flat[wn + k * room + 2 * wn:wn + (k + 1) * room]
        try:
            while (taken := queue.take()) is not None:
                index, (start, stop), into = taken
                g = replace(geometry, batch=stop - start)
                if one_lowering:
                    _gradients_transposed_rows(x[start:stop], dy[start:stop], wmat, dx[start:stop], into, g, region)
                else:
                    _weight_gradient_rows(x[start:stop], dy[start:stop], into, g, region)
                    if dx is not None:
                        _input_gradient_col2im(dy[start:stop], wmat, dx[start:stop], g, region)
                queue.done(index, into)
        except BaseException:
            queue.fail()
            raise

    workers.run(work, n)
    if n == 0:                                              # an empty batch: no chunk wrote a gradient
        dw.fill(0)
        return
    total = grads[0]
    if one_lowering:
        dw.reshape(geometry.groups, -1, *dw.shape[1:])[...] = _transposed_matrix_as_weights(total, geometry)
    else:
        dw[...] = _matrix_as_weights(total, geometry)


# --- pooling -------------------------------------------------------------------------------------


def max_pool_forward(x, out, argmax, geometry: ConvGeometry, padded) -> None:
    """Max over each window (padding counts as -inf, as in PyTorch). x: (B, H, W, C), out and
    argmax: (B, OH, OW, C), argmax an integer array (the window's flat offset, for the backward
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
    step = xp.empty_like(argmax)
    for offset in range(1, kh * kw):                        # the first maximum wins, as in PyTorch
        v = geometry.tap(padded, offset // kw, offset % kw)
        larger = v > out
        xp.maximum(out, v, out=out)
        # argmax += (offset - argmax) · larger: integer arithmetic (modular in uint8, which gives the
        # same result); a select (where) took 0.9 ms of the 1.0 ms per offset at 64x16x32x32
        xp.subtract(offset, argmax, out=step, dtype=argmax.dtype)
        xp.multiply(step, larger, out=step)
        xp.add(argmax, step, out=argmax)


def max_pool_backward(dy, argmax, dx, geometry: ConvGeometry, padded) -> None:
    """Gradient of :func:`max_pool_forward`: each output's gradient goes to its window's maximum
    (summed where windows overlap). ``padded`` is scratch. Windows that neither overlap nor reach
    into padding (stride equal to the kernel, no dilation) write ``dx`` directly, each input
    element once."""
    xp = array_module(dy)
    kh, kw = geometry.kernel
    tiled = geometry.stride == geometry.kernel and not any(geometry.padding) and geometry.dilation == (1, 1)
    if tiled:
        if geometry.out_height * kh != geometry.height or geometry.out_width * kw != geometry.width:
            dx.fill(0)                                      # rows and columns no window covers
        for offset in range(kh * kw):
            xp.multiply(dy, argmax == offset, out=geometry.tap(dx, offset // kw, offset % kw))
        return
    padded.fill(0)
    for offset in range(kh * kw):
        geometry.tap(padded, offset // kw, offset % kw)[...] += dy * (argmax == offset)
    dx[...] = geometry.interior(padded)


def avg_pool_forward(x, out, geometry: ConvGeometry, padded) -> None:
    """Mean over each window, zero padding counted (PyTorch's ``count_include_pad=True``). x: (B,
    H, W, C), out: (B, OH, OW, C)."""
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
    dx[...] = geometry.interior(padded)


def global_avg_pool_forward(x, out) -> None:
    """``out = mean over H, W``. x: (B, H, W, C), out: (B, C)."""
    array_module(x).mean(x, axis=(1, 2), out=out)


def global_avg_pool_backward(dy, dx) -> None:
    """dy: (B, C) -> dx: (B, H, W, C), each position dy / (H·W)."""
    dx[...] = (dy / (dx.shape[1] * dx.shape[2]))[:, None, None, :]


# --- batch normalisation ---------------------------------------------------------------------------


def _channel_sum(a, out) -> None:
    """``out`` (C,): the sum of ``a`` (..., C), C-contiguous, over every axis but the last."""
    out[...] = _fold([_tiled_rows(a).sum(axis=0)], out.shape[0])


def _fold(partials: list, channels: int):
    """(C,): the row sums ``partials`` (vectors of a :func:`_tiled_rows` row, W·C), added in
    order, then over the width."""
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    return total.reshape(-1, channels).sum(axis=0)


def _row_parts(x, work) -> list:
    """``work(start, stop)`` on ranges of the rows of ``x`` as :func:`_tiled_rows` gives them, at
    once on the CPU's workers (:func:`.workers.split`); returns what each returned, in row order.
    Batch normalisation's arithmetic is elementwise on rows and sums over them: parts of the rows
    give the bits of one call elementwise, and sums equal to rounding (added part by part, in the
    same order on every run with the same workers)."""
    results = {}

    def part(start: int, stop: int) -> None:
        results[start] = work(start, stop)

    workers.split(part, _tiled_rows(x).shape[0], x.size, array_module(x))
    return [results[k] for k in sorted(results)]


def batch_norm_forward(x, gamma, beta, out, mean, invstd, running_mean=None, running_var=None,
                       momentum: float = 0.1, eps: float = 1e-5) -> None:
    """Training: normalise over the batch (and H, W) per channel, ``out = gamma · (x − mean) ·
    invstd + beta`` (Ioffe and Szegedy, 2015). x: (B, C) or (B, H, W, C), C-contiguous; gamma,
    beta, mean, invstd: (C,). Writes the batch statistics ``mean`` and ``invstd = 1 / sqrt(var +
    eps)`` (biased variance) for the backward pass and for a recompute that must give identical
    values (:func:`batch_norm_apply`), and, when given, updates ``running_mean`` / ``running_var``
    in place with ``momentum`` and the unbiased variance, as PyTorch does. An image's rows are
    its W·C elements, the vectors tiled to them (Note [Channels last] in :mod:`.layout`); ranges
    of rows run at once on the CPU's workers (:func:`_row_parts`)."""
    xp, c = array_module(x), x.shape[-1]
    n = x.size // c
    rows, into = _tiled_rows(x), _tiled_rows(out)
    mean[...] = _fold(_row_parts(x, lambda a, b: rows[a:b].sum(axis=0)), c) / n
    centre = _tile_for(mean, rows)

    def centred(a: int, b: int):                             # out holds x - mean meanwhile
        xp.subtract(rows[a:b], centre, out=into[a:b])
        return xp.einsum("nc,nc->c", into[a:b], into[a:b])

    var = _fold(_row_parts(x, centred), c) / n
    xp.sqrt(var + eps, out=invstd)
    xp.divide(1.0, invstd, out=invstd)
    scale, shift = _tile_for(invstd * gamma, rows), _tile_for(beta, rows)

    def affine(a: int, b: int) -> None:
        xp.multiply(into[a:b], scale, out=into[a:b])
        xp.add(into[a:b], shift, out=into[a:b])

    _row_parts(x, affine)
    if running_mean is not None:
        running_mean *= 1 - momentum
        running_mean += momentum * mean
        running_var *= 1 - momentum
        running_var += momentum * var * (n / max(n - 1, 1))


def batch_norm_apply(x, gamma, beta, mean, invstd, out) -> None:
    """``out = gamma · (x − mean) · invstd + beta`` with given statistics: the saved batch
    statistics in a recompute (bit-identical to :func:`batch_norm_forward`: the same three
    elementwise steps), or ``invstd = 1 / sqrt(running_var + eps)`` with the running mean at
    inference."""
    xp = array_module(x)
    rows, into = _tiled_rows(x), _tiled_rows(out)
    centre, scale, shift = (_tile_for(v, rows) for v in (mean, invstd * gamma, beta))

    def normalise(a: int, b: int) -> None:
        xp.subtract(rows[a:b], centre, out=into[a:b])
        xp.multiply(into[a:b], scale, out=into[a:b])
        xp.add(into[a:b], shift, out=into[a:b])

    _row_parts(x, normalise)


def batch_norm_backward(x, gamma, mean, invstd, dy, dx, dgamma, dbeta) -> None:
    """Gradients of the training-mode :func:`batch_norm_forward` from its saved statistics.
    Writes dgamma, dbeta: (C,) and dx (shape of x) unless None."""
    xp, c = array_module(x), x.shape[-1]
    n = x.size // c
    rows, grads = _tiled_rows(x), _tiled_rows(dy)
    xhat = _tiled_rows(dx) if dx is not None else xp.empty_like(rows)    # dx holds x̂ meanwhile
    centre, spread = _tile_for(mean, rows), _tile_for(invstd, rows)

    def sums(a: int, b: int):
        xp.subtract(rows[a:b], centre, out=xhat[a:b])
        xp.multiply(xhat[a:b], spread, out=xhat[a:b])
        return grads[a:b].sum(axis=0), xp.einsum("nc,nc->c", grads[a:b], xhat[a:b])

    parts = _row_parts(x, sums)
    dbeta[...] = _fold([p[0] for p in parts], c)
    dgamma[...] = _fold([p[1] for p in parts], c)
    if dx is None:
        return
    g, b, k = (_tile_for(v, rows) for v in (dgamma, dbeta, gamma * invstd))

    def input_gradient(lo: int, hi: int) -> None:     # dx = gamma · invstd · (dy − (dbeta + x̂ · dgamma) / n)
        d = xhat[lo:hi]
        xp.multiply(d, g, out=d)
        xp.add(d, b, out=d)
        xp.multiply(d, -1.0 / n, out=d)
        xp.add(d, grads[lo:hi], out=d)
        xp.multiply(d, k, out=d)

    _row_parts(x, input_gradient)


# --- graph structure -------------------------------------------------------------------------------


def add_forward(a, b, out) -> None:
    """Residual addition ``out = a + b`` (same shapes); its backward passes ``dy`` to both inputs."""
    array_module(a).add(a, b, out=out)


def concat_forward(inputs, out) -> None:
    """Channel concatenation of (B, H, W, C_i) inputs into out: (B, H, W, ΣC_i)."""
    start = 0
    for a in inputs:
        out[..., start:start + a.shape[-1]] = a
        start += a.shape[-1]


def concat_backward(dy, dxs) -> None:
    """Split dy: (B, H, W, ΣC_i) into the inputs' gradients, in order."""
    start = 0
    for dx in dxs:
        dx[...] = dy[..., start:start + dx.shape[-1]]
        start += dx.shape[-1]


def flatten_forward(x, out) -> None:
    """(B, H, W, C) -> (B, C·H·W), each row in the order of (C, H, W) (as ``torch.flatten(x, 1)``
    of the image in PyTorch's axes): a transposing copy. Vectors and other shapes: a copy."""
    if x.ndim == 4:
        b, h, w, c = x.shape
        out.reshape(b, c, h, w)[...] = layout.channels_first(x)
    else:
        out[...] = x.reshape(out.shape)


def flatten_backward(dy, dx) -> None:
    """The gradient of :func:`flatten_forward`: dy (B, C·H·W) back to dx's shape."""
    if dx.ndim == 4:
        b, h, w, c = dx.shape
        layout.channels_first(dx)[...] = dy.reshape(b, c, h, w)
    else:
        dx[...] = dy.reshape(dx.shape)
