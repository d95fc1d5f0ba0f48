"""How the runtime lays out an image in memory: channels last.

A network names an image by its per-row shape (C, H, W), as a user writes ``"input": {"shape":
[C, H, W]}`` and as PyTorch does; its rows reach the model as C·H·W values in that order, and a
``flatten`` gives them back in that order. In the runtime's arrays (the arena's tensors, the host
arrays of inference) an image is stored (B, H, W, C): :func:`stored` is the one rule that maps a
per-row shape to its stored shape, :func:`images_from_rows` stores rows of features, and
:func:`channels_first` views a stored image in the network's axes. Vectors and every shape other
than an image's are stored as named.

Note [Channels last]
~~~~~~~~~~~~~~~~~~~~
Rationale: the CPU lowers a convolution to matrix products whose rows are output positions and
whose columns are channels (:mod:`.conv_kernels`): the product's efficient shape on the BLAS is
many rows by few columns. With images stored (B, C, H, W), each convolution transposed its input
into that layout before lowering it, its product back after, and in the backward pass did the same
for ``dy``, ``x`` and ``dx``: five transposing copies per chunk of the batch. Stored (B, H, W, C),
a chunk of the batch is already the (B·H·W, C) matrix: the padding copies whole image rows, the
forward product is written into the output, and both backward products read ``x`` and write
``dx`` in place. A chunk of the small CNN's 16 -> 16 3x3 convolution at 32x32 (two rows of the
batch, one thread, medians of 300 calls, two runs): forward 230 / 297 µs channels first against
178 / 188 µs channels last, backward 389 / 505 against 308 / 313 µs.

Approach: per-channel vectors broadcast over the last axis, so batch normalisation reads an image
as a (B·H, W·C) matrix with its vectors tiled W times (a broadcast over a last axis of a few
channels ran three times slower than over whole rows); pooling windows are strided views as
before, their innermost run the C channels of one position; a concatenation joins the last axis.

Limitations: a layer normalisation on an image normalises over its width, as PyTorch's
``layer_norm`` over the last dimension of (C, H, W) does; it reads the stored image through
:func:`channels_first`, strided, which is slower than over contiguous rows.
"""

from __future__ import annotations


def is_image(shape) -> bool:
    """Whether the per-row ``shape`` names an image (C, H, W): a network's only three-axis shapes."""
    return len(shape) == 3


def stored(shape) -> tuple[int, ...]:
    """The per-row shape an array of rows of ``shape`` is stored in: (H, W, C) for an image
    (C, H, W), else ``shape`` itself."""
    shape = tuple(shape)
    if is_image(shape):
        c, h, w = shape
        return h, w, c
    return shape


def images_from_rows(x, shape):
    """Rows of features ``x`` (N, prod(shape)), each in the order of ``shape``, as a contiguous
    array of stored rows (N, *:func:`stored` (``shape``)): a copy for images, a view otherwise.
    NumPy or CuPy arrays of any dtype."""
    rows = x.reshape(len(x), *shape)
    if not is_image(shape):
        return rows
    return rows.transpose(0, 2, 3, 1).copy()


def channels_first(a):
    """A stored image array ``a`` (B, H, W, C) viewed in the network's axes (B, C, H, W), strided."""
    return a.transpose(0, 3, 1, 2)
