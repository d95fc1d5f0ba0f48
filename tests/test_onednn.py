"""The CPU's float32 convolutions and dense products by oneDNN (``tensile_db.runtime.onednn``):
the same values as the lowering on NumPy and as PyTorch, in the caller's arrays and workspace
only; and what it cannot take (float64, a small workspace or product, a strided array, the
setting off, a forked child) falls to the lowering or to NumPy. Skipped where the library is
not installed (it is on x86-64 Linux)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tensile_db.runtime import conv_kernels as K
from tensile_db.runtime import kernels as DK
from tensile_db.runtime import onednn
from tensile_db.runtime.conv_kernels import ConvGeometry
from tensile_db.runtime.layout import channels_first as cf

pytestmark = pytest.mark.skipif(not onednn.enabled(), reason="oneDNN is not installed here")

RTOL, ATOL = 1e-4, 1e-4


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def f32(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32)


def nans(shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype)


def convolve(g: ConvGeometry, x, w, b, dy, with_dx: bool):
    """(out, dx, dw) by :mod:`.conv_kernels` in workspaces full of NaN."""
    out = nans(g.out_shape)
    K.conv2d_forward(x, w, b, out, g, nans(g.forward_workspace_nelems))
    dx, dw = (nans(g.in_shape) if with_dx else None), nans(g.weight_shape)
    K.conv2d_backward(x, w, dy, dx, dw, None, g, nans(g.backward_workspace_nelems))
    return out, dx, dw


# Each with a lowering workspace that holds oneDNN's reordered weights and scratchpads (a smaller
# one is lowered: test_what_onednn_cannot_take_is_lowered).
GEOMETRIES = [  # b, c, h, w, o, k, stride, padding, dilation, groups, bias, dx
    (4, 3, 12, 12, 16, 3, 1, 1, 1, 1, False, False),     # a network's first layer: no dx
    (3, 16, 10, 9, 16, 3, 1, 1, 1, 1, True, True),
    (4, 16, 8, 8, 8, 1, 1, 0, 1, 1, True, True),          # 1x1
    (8, 6, 11, 9, 4, 3, 2, 1, 1, 2, True, True),          # strided, grouped
    (2, 4, 9, 9, 6, 3, 1, 2, 2, 1, False, True),          # dilated
    (2, 8, 7, 7, 8, 3, 1, 1, 1, 8, True, True),           # depthwise
    (16, 3, 9, 7, 5, (3, 2), (2, 1), (1, 0), 1, 1, True, True),
]


@pytest.mark.parametrize("b, c, h, w, o, k, stride, padding, dilation, groups, bias, with_dx", GEOMETRIES)
def test_onednn_gives_the_lowering_s_and_pytorch_s_values(rng, monkeypatch, b, c, h, w, o, k, stride, padding,
                                                          dilation, groups, bias, with_dx):
    g = ConvGeometry.of((b, h, w, c), o, k, stride, padding, dilation, groups)
    x, wt, dy = f32(rng, g.in_shape), f32(rng, g.weight_shape), f32(rng, g.out_shape)
    bv = f32(rng, o) if bias else None
    out = nans(g.out_shape)
    assert onednn.forward(x, wt, bv, out, g, nans(g.forward_workspace_nelems))
    dx, dw = (nans(g.in_shape) if with_dx else None), nans(g.weight_shape)
    assert onednn.backward(x, wt, dy, dx, dw, g, nans(g.backward_workspace_nelems))
    ran = convolve(g, x, wt, bv, dy, with_dx)                       # the kernels choose oneDNN: the same bits
    for a, e in zip((out, dx, dw), ran):
        np.testing.assert_array_equal(a, e)
    monkeypatch.setenv("TENSILE_ONEDNN", "0")
    lowered = convolve(g, x, wt, bv, dy, with_dx)
    tx, tw = torch.tensor(cf(x), requires_grad=True), torch.tensor(wt, requires_grad=True)
    ref = F.conv2d(tx, tw, None if bv is None else torch.tensor(bv), g.stride, g.padding, g.dilation, groups)
    ref.backward(torch.tensor(cf(dy)))
    expected = (ref.detach().numpy(), tx.grad.numpy() if with_dx else None, tw.grad.numpy())
    for a, low, e, image in zip((out, dx, dw), lowered, expected, (True, True, False)):
        if a is None:
            continue
        np.testing.assert_allclose(a, low, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(cf(a) if image else a, e, rtol=RTOL, atol=ATOL)


def test_what_onednn_cannot_take_is_lowered(rng, monkeypatch):
    """float64, a strided array, an output of another shape or read-only, a workspace smaller
    than its primitives need and the setting off: nothing written, and the kernels lower the
    convolution (PyTorch's values)."""
    g = ConvGeometry.of((2, 6, 6, 4), 8, 3, padding=1)
    x, wt = f32(rng, g.in_shape), f32(rng, g.weight_shape)
    workspace = nans(g.forward_workspace_nelems)
    out = nans(g.out_shape)
    assert not onednn.forward(x.astype(np.float64), wt.astype(np.float64), None, out.astype(np.float64), g,
                              workspace.astype(np.float64))
    assert not onednn.forward(np.asfortranarray(x), wt, None, out, g, workspace)
    assert not onednn.forward(x, wt, None, out, g, nans(1))
    assert not onednn.forward(x, wt, None, out[:1], g, workspace)            # not the geometry's shape
    read_only = out.copy()
    read_only.flags.writeable = False
    assert not onednn.forward(x, wt, None, read_only, g, workspace)
    with monkeypatch.context() as m:
        m.setenv("TENSILE_ONEDNN", "0")
        assert not onednn.enabled() and not onednn.forward(x, wt, None, out, g, workspace)
    assert np.isnan(out).all()
    # a workspace the primitives do not fit: conv2d_forward lowers instead
    m_bytes = onednn._primitives(g, "forward", False).workspace_nbytes
    small = g.forward_workspace_nelems if m_bytes <= 4 * g.forward_workspace_nelems else None
    assert small is not None                                # the lowering's workspace holds them here
    monkeypatch.setattr(onednn._Primitives, "workspace_nbytes", property(lambda self: 1 << 40))
    K.conv2d_forward(x, wt, None, out, g, nans(small))
    ref = F.conv2d(torch.tensor(cf(x)), torch.tensor(wt), padding=1)
    np.testing.assert_allclose(cf(out), ref.numpy(), rtol=RTOL, atol=ATOL)


def test_threads_share_a_geometry_s_primitives(rng):
    """Executors of several devices run convolutions of one geometry at once: the primitive is
    shared, each thread runs it on its own stream with its own workspace, and each gets its own
    input's result."""
    g = ConvGeometry.of((4, 10, 10, 8), 8, 3, padding=1)
    wt = f32(rng, g.weight_shape)
    xs = [f32(rng, g.in_shape) for _ in range(4)]
    alone = []
    for x in xs:
        alone.append(nans(g.out_shape))
        assert onednn.forward(x, wt, None, alone[-1], g, nans(g.forward_workspace_nelems))
    together = [nans(g.out_shape) for _ in xs]
    barrier = threading.Barrier(len(xs))

    def run(i):
        barrier.wait()
        for _ in range(20):
            assert onednn.forward(xs[i], wt, None, together[i], g, nans(g.forward_workspace_nelems))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, e in zip(together, alone):
        np.testing.assert_array_equal(a, e)


def test_primitives_are_kept_for_the_latest_geometries_only(rng, monkeypatch):
    monkeypatch.setattr(onednn, "PRIMITIVES_KEPT", 2)
    monkeypatch.setitem(onednn._state, "primitives", type(onednn._state["primitives"])())
    for batch in (1, 2, 3):
        g = ConvGeometry.of((batch, 5, 5, 4), 4, 3, padding=1)
        assert onednn.forward(f32(rng, g.in_shape), f32(rng, g.weight_shape), None, nans(g.out_shape), g,
                              nans(g.forward_workspace_nelems))
    assert [key[1].batch for key in onednn._state["primitives"]] == [2, 3]


def test_a_child_forked_after_onednn_ran_lowers_its_convolutions(rng):
    """GNU OpenMP's threads do not survive a fork: a parallel region in the child would wait for
    them for ever, so the child lowers instead (and finishes)."""
    g = ConvGeometry.of((2, 6, 6, 4), 4, 3, padding=1)
    x, wt = f32(rng, g.in_shape), f32(rng, g.weight_shape)
    assert onednn.forward(x, wt, None, nans(g.out_shape), g, nans(g.forward_workspace_nelems))
    pid = os.fork()
    if pid == 0:                                           # the child: exit status 0 if it lowered
        code = 1
        try:
            out = nans(g.out_shape)
            if not onednn.enabled():
                K.conv2d_forward(x, wt, None, out, g, nans(g.forward_workspace_nelems))
                code = 0 if not np.isnan(out).any() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert onednn.enabled()                                # the parent still uses it


def test_a_primitive_is_built_for_the_threads_kernels_may_use(rng, monkeypatch):
    """A primitive takes its OpenMP threads when built: one is built per thread count
    (:func:`.workers.count`), with the same values."""
    g = ConvGeometry.of((4, 8, 8, 8), 8, 3, padding=1)
    x, wt = f32(rng, g.in_shape), f32(rng, g.weight_shape)
    outs = []
    for n in (1, 2):
        monkeypatch.setattr(onednn.workers, "count", lambda n=n: n)
        outs.append(nans(g.out_shape))
        assert onednn.forward(x, wt, None, outs[-1], g, nans(g.forward_workspace_nelems))
    assert {key[-1] for key in onednn._state["primitives"] if key[1] == g} == {1, 2}
    np.testing.assert_allclose(outs[0], outs[1], rtol=RTOL, atol=ATOL)


# --- dense products (onednn.matmul) -------------------------------------------------------------

PRODUCTS = [  # m, k, n, a transposed, b transposed, bias
    (128, 64, 512, False, False, True),       # a dense layer's forward
    (512, 128, 256, True, False, False),      # its weight gradient, x.T @ dy
    (128, 256, 512, False, True, False),      # its input gradient, dy @ w.T
    (96, 120, 100, True, True, True),
]


def operand(rng, rows, cols, transposed):
    return f32(rng, (cols, rows)).T if transposed else f32(rng, (rows, cols))


@pytest.mark.parametrize("m, k, n, ta, tb, bias", PRODUCTS)
def test_a_product_on_onednn_matches_numpy_s(rng, m, k, n, ta, tb, bias):
    a, b = operand(rng, m, k, ta), operand(rng, k, n, tb)
    bv = f32(rng, n) if bias else None
    out = nans((m, n))
    assert onednn.matmul(a, b, out, bv)
    expected = a.astype(np.float64) @ b.astype(np.float64) + (0 if bv is None else bv)
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)


def test_dense_kernels_on_onednn_match_pytorch(rng):
    x, w, b, dy = f32(rng, (128, 64)), f32(rng, (64, 512)), f32(rng, 512), f32(rng, (128, 512))
    out, dx, dw, db = nans((128, 512)), nans((128, 64)), nans((64, 512)), nans(512)
    DK.dense_forward(x, w, b, out)
    DK.dense_backward(x, w, dy, dx, dw, db)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    ref = tx @ tw + tb
    ref.backward(torch.tensor(dy))
    for a, e in ((out, ref), (dx, tx.grad), (dw, tw.grad), (db, tb.grad)):
        np.testing.assert_allclose(a, e.detach().numpy(), rtol=RTOL, atol=ATOL)


def test_what_onednn_cannot_multiply_is_left_to_numpy(rng, monkeypatch):
    a, b, out = f32(rng, (128, 64)), f32(rng, (64, 512)), nans((128, 512))
    small = (f32(rng, (8, 8)), f32(rng, (8, 8)), nans((8, 8)))
    refused = [small,                                                  # below MATMUL_MIN_MACS
               (a.astype(np.float64), b, out),
               (a, f32(rng, (64, 1024))[:, ::2], out),                 # neither contiguous nor transposed
               (a, b, nans((512, 128)).T),                             # out not C-contiguous
               (a, f32(rng, (65, 512)), out)]                          # shapes that do not multiply
    square = f32(rng, (128, 128))
    refused.append((square, f32(rng, (128, 128)), square))                 # out overlaps an operand
    square[...] = np.nan
    read_only = nans((128, 512))
    read_only.flags.writeable = False
    refused.append((a, b, read_only))
    for args in refused:
        assert not onednn.matmul(*args)
        assert np.isnan(args[2]).all()
    assert not onednn.matmul(a, b, out, f32(rng, 256))                 # a bias of the wrong width
    monkeypatch.setenv("TENSILE_ONEDNN", "0")
    assert not onednn.matmul(a, b, out)
    assert np.isnan(out).all()
