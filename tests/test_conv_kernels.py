"""Check every kernel in ``tensile_db.runtime.conv_kernels`` against PyTorch on the CPU in float64:
forward values, and backward gradients against ``torch.autograd``. Kernels write into
caller-provided outputs and workspaces, which the tests allocate with ``np.empty`` (filled with
NaN, so a kernel that leaves part of an output unwritten fails). Images are drawn in PyTorch's
axes (B, C, H, W) and given to the kernels stored channels last (:func:`cl`); the kernels'
images are compared in PyTorch's axes (:func:`cf`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tensile_db.runtime import conv_kernels as K
from tensile_db.runtime.conv_kernels import ConvGeometry
from tensile_db.runtime.layout import channels_first as cf

RTOL, ATOL = 1e-10, 1e-12


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def empty(shape, dtype=np.float64):
    a = np.empty(shape, dtype)
    if dtype == np.float64:
        a.fill(np.nan)
    return a


def cl(a):
    """An image array in PyTorch's axes (B, C, H, W) stored channels last, (B, H, W, C), C-contiguous."""
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def tt(a, grad=False):
    return torch.tensor(np.array(a), requires_grad=grad)


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected.detach().numpy() if isinstance(expected, torch.Tensor) else expected,
                               rtol=RTOL, atol=ATOL)


def workspaces(g: ConvGeometry):
    """The forward and the backward workspace of ``g``."""
    return empty(g.forward_workspace_nelems), empty(g.backward_workspace_nelems)


@pytest.mark.parametrize("b, c, h, w, o, k, stride, padding, dilation, groups, bias", [
    (2, 3, 7, 6, 4, 3, 1, 1, 1, 1, True),
    (3, 4, 9, 9, 6, 3, 2, 0, 1, 2, True),
    (2, 2, 8, 7, 4, (3, 2), (2, 1), (1, 0), (2, 1), 1, False),
    (1, 6, 5, 5, 6, 3, 1, 1, 1, 6, True),          # depthwise
    (2, 3, 4, 4, 5, 1, 1, 0, 1, 1, True),          # 1x1
    (2, 4, 9, 8, 6, 3, 1, 2, (2, 1), 2, False),    # dilated, stride 1: both gradients from dy's lowering
])
def test_conv2d_matches_torch(rng, b, c, h, w, o, k, stride, padding, dilation, groups, bias):
    g = ConvGeometry.of((b, h, w, c), o, k, stride, padding, dilation, groups)
    x, wt = rng.normal(size=(b, c, h, w)), rng.normal(size=g.weight_shape)
    bv = rng.normal(size=o) if bias else None
    out = empty(g.out_shape)
    forward, backward = workspaces(g)
    K.conv2d_forward(cl(x), wt, bv, out, g, forward)
    tx, tw, tb = tt(x, True), tt(wt, True), (tt(bv, True) if bias else None)
    ref = F.conv2d(tx, tw, tb, stride=stride, padding=padding, dilation=dilation, groups=groups)
    assert_close(cf(out), ref)

    dy = rng.normal(size=ref.shape)
    ref.backward(tt(dy))
    dx, dw = empty(g.in_shape), empty(wt.shape)
    db = empty(o) if bias else None
    K.conv2d_backward(cl(x), wt, cl(dy), dx, dw, db, g, backward)
    assert_close(cf(dx), tx.grad)
    assert_close(dw, tw.grad)
    if bias:
        assert_close(db, tb.grad)


def test_conv_geometry_names_what_does_not_fit():
    with pytest.raises(ValueError, match="groups 2 must divide the input channels 3"):
        ConvGeometry.of((1, 8, 8, 3), 4, 3, groups=2)
    with pytest.raises(ValueError, match=r"a \(5, 5\) kernel .* does not fit an input of 4x4"):
        ConvGeometry.of((1, 4, 4, 3), 4, 5)
    g = ConvGeometry.of((2, 8, 8, 3), 4, 3, padding=1)
    assert g.workspace_nelems == 2 * 3 * 10 * 10 + 2 * 8 * 8 * 27 + 2 * 8 * 8 * 4


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k, stride, padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1), ((2, 3), (2, 1), (1, 1))])
def test_max_and_average_pooling_match_torch(rng, k, stride, padding, ties):
    """Random values, and small integers (windows with several maxima: the first in the window's
    order takes the gradient, as in PyTorch) with the uint8 argmax of training."""
    x = rng.integers(0, 3, size=(2, 3, 7, 8)).astype(np.float64) if ties else rng.normal(size=(2, 3, 7, 8))
    g = ConvGeometry.of(cl(x).shape, 3, k, stride, padding)
    dy = rng.normal(size=g.out_shape)

    out, padded = empty(g.out_shape), empty(g.padded_shape)
    argmax = np.empty(g.out_shape, np.uint8 if ties else np.int64)
    K.max_pool_forward(cl(x), out, argmax, g, padded)
    tx = tt(x, True)
    ref = F.max_pool2d(tx, k, stride, padding)
    assert_close(cf(out), ref)
    ref.backward(tt(cf(dy)))
    dx = empty(g.in_shape)
    K.max_pool_backward(dy, argmax, dx, g, padded)
    assert_close(cf(dx), tx.grad)

    out = empty(g.out_shape)
    K.avg_pool_forward(cl(x), out, g, padded)
    tx = tt(x, True)
    ref = F.avg_pool2d(tx, k, stride, padding, count_include_pad=True)
    assert_close(cf(out), ref)
    ref.backward(tt(cf(dy)))
    dx = empty(g.in_shape)
    K.avg_pool_backward(dy, dx, g, padded)
    assert_close(cf(dx), tx.grad)


def test_global_average_pooling_matches_torch(rng):
    x = rng.normal(size=(3, 4, 5, 6))
    out = empty((3, 4))
    K.global_avg_pool_forward(cl(x), out)
    tx = tt(x, True)
    ref = tx.mean(dim=(2, 3))
    assert_close(out, ref)
    dy = rng.normal(size=(3, 4))
    ref.backward(tt(dy))
    dx = empty(cl(x).shape)
    K.global_avg_pool_backward(dy, dx)
    assert_close(cf(dx), tx.grad)


@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5, 5), (2, 3, 1, 1)])
def test_batch_norm_matches_torch_in_training_and_its_saved_statistics_reproduce_it(rng, shape):
    c = shape[1]
    x, gamma, beta = rng.normal(2.0, 3.0, size=shape), rng.normal(size=c), rng.normal(size=c)
    running_mean, running_var = rng.normal(size=c), rng.uniform(0.5, 2.0, size=c)
    t_mean, t_var = tt(running_mean), tt(running_var)
    stored = cl if len(shape) == 4 else np.ascontiguousarray
    shown = cf if len(shape) == 4 else np.asarray
    out, mean, invstd = empty(stored(x).shape), empty(c), empty(c)
    K.batch_norm_forward(stored(x), gamma, beta, out, mean, invstd, running_mean, running_var, momentum=0.2, eps=1e-4)
    tx, tg, tb = tt(x, True), tt(gamma, True), tt(beta, True)
    ref = F.batch_norm(tx, t_mean, t_var, tg, tb, training=True, momentum=0.2, eps=1e-4)
    assert_close(shown(out), ref)
    assert_close(running_mean, t_mean)
    assert_close(running_var, t_var)

    again = empty(out.shape)        # a recompute from the saved statistics gives the same bits
    K.batch_norm_apply(stored(x), gamma, beta, mean, invstd, again)
    assert np.array_equal(again, out)

    dy = rng.normal(size=shape)
    ref.backward(tt(dy))
    dx, dgamma, dbeta = empty(out.shape), empty(c), empty(c)
    K.batch_norm_backward(stored(x), gamma, mean, invstd, stored(dy), dx, dgamma, dbeta)
    assert_close(shown(dx), tx.grad)
    assert_close(dgamma, tg.grad)
    assert_close(dbeta, tb.grad)
    K.batch_norm_backward(stored(x), gamma, mean, invstd, stored(dy), None, dgamma, dbeta)     # no input gradient
    assert_close(dgamma, tg.grad)


def test_batch_norm_at_inference_uses_the_running_statistics(rng):
    x, gamma, beta = rng.normal(size=(3, 2, 4, 4)), rng.normal(size=2), rng.normal(size=2)
    running_mean, running_var = rng.normal(size=2), rng.uniform(0.5, 2.0, size=2)
    out = empty(cl(x).shape)
    K.batch_norm_apply(cl(x), gamma, beta, running_mean, 1 / np.sqrt(running_var + 1e-5), out)
    assert_close(cf(out), F.batch_norm(tt(x), tt(running_mean), tt(running_var), tt(gamma), tt(beta), training=False))


def test_residual_concat_and_flatten_match_torch(rng):
    a, b = rng.normal(size=(2, 3, 4, 5)), rng.normal(size=(2, 5, 4, 5))
    out = empty((2, 4, 5, 8))
    K.concat_forward([cl(a), cl(b)], out)
    assert_close(cf(out), torch.cat([tt(a), tt(b)], dim=1))
    dy = rng.normal(size=out.shape)
    da, dbb = empty(cl(a).shape), empty(cl(b).shape)
    K.concat_backward(dy, [da, dbb])
    assert_close(da, dy[..., :3])
    assert_close(dbb, dy[..., 3:])

    flat = empty((2, 8 * 20))
    K.flatten_forward(out, flat)
    assert_close(flat, torch.flatten(tt(cf(out)), 1))       # PyTorch's order: channel, row, column
    back = empty(out.shape)
    K.flatten_backward(flat, back)
    assert_close(back, out)

    total = empty(cl(a).shape)
    K.add_forward(cl(a), cl(a[:, ::-1]), total)
    assert_close(cf(total), tt(a) + tt(a[:, ::-1].copy()))


def test_a_small_network_of_these_kernels_matches_torch_end_to_end(rng):
    """conv → batch norm → relu → max pool → conv (residual add) → global average pool: the
    kernels chained by hand on stored images, gradients of every parameter against autograd."""
    x = cl(rng.normal(size=(4, 2, 8, 8)))
    g1 = ConvGeometry.of(x.shape, 3, 3, padding=1)
    w1, b1 = rng.normal(size=g1.weight_shape) * 0.5, rng.normal(size=3)
    gamma, beta = rng.uniform(0.5, 1.5, size=3), rng.normal(size=3)
    gp = ConvGeometry.of(g1.out_shape, 3, 2, 2)
    g2 = ConvGeometry.of(gp.out_shape, 3, 3, padding=1)
    w2 = rng.normal(size=g2.weight_shape) * 0.5

    ws1, wsp, ws2 = workspaces(g1), empty(gp.padded_shape), workspaces(g2)
    c1 = empty(g1.out_shape)
    K.conv2d_forward(x, w1, b1, c1, g1, ws1[0])
    bn, mean, invstd = empty(c1.shape), empty(3), empty(3)
    K.batch_norm_forward(c1, gamma, beta, bn, mean, invstd)
    r = np.maximum(bn, 0)
    p, argmax = empty(gp.out_shape), np.empty(gp.out_shape, np.int64)
    K.max_pool_forward(r, p, argmax, gp, wsp)
    c2 = empty(g2.out_shape)
    K.conv2d_forward(p, w2, None, c2, g2, ws2[0])
    s = empty(p.shape)
    K.add_forward(c2, p, s)
    y = empty((4, 3))
    K.global_avg_pool_forward(s, y)

    t = {k: tt(v, True) for k, v in dict(x=cf(x), w1=w1, b1=b1, gamma=gamma, beta=beta, w2=w2).items()}
    tc1 = F.conv2d(t["x"], t["w1"], t["b1"], padding=1)
    tbn = F.batch_norm(tc1, None, None, t["gamma"], t["beta"], training=True)
    tp = F.max_pool2d(F.relu(tbn), 2, 2)
    ty = (F.conv2d(tp, t["w2"], padding=1) + tp).mean(dim=(2, 3))
    assert_close(y, ty)
    dy = rng.normal(size=y.shape)
    ty.backward(tt(dy))

    ds = empty(s.shape)
    K.global_avg_pool_backward(dy, ds)
    dp, dw2 = empty(p.shape), empty(w2.shape)
    K.conv2d_backward(p, w2, ds, dp, dw2, None, g2, ws2[1])
    dp += ds                                                   # the residual branch
    dr = empty(r.shape)
    K.max_pool_backward(dp, argmax, dr, gp, wsp)
    dbn = dr * (bn > 0)
    dc1, dgamma, dbeta = empty(c1.shape), empty(3), empty(3)
    K.batch_norm_backward(c1, gamma, mean, invstd, dbn, dc1, dgamma, dbeta)
    dx, dw1, db1 = empty(x.shape), empty(w1.shape), empty(3)
    K.conv2d_backward(x, w1, dc1, dx, dw1, db1, g1, ws1[1])
    for name, grad in dict(x=cf(dx), w1=dw1, b1=db1, gamma=dgamma, beta=dbeta, w2=dw2).items():
        assert_close(grad, t[name].grad)


@pytest.mark.parametrize("groups, bias, stride", [(1, True, 1), (2, False, 1), (1, False, 2)])
def test_chunked_convolution_matches_torch_with_bounded_workspace(rng, groups, bias, stride, monkeypatch):
    """A bounded workspace holds fewer rows than the batch; the CPU lowers cache-sized chunks of
    them on two workers (weight gradients added in chunk order), the transposed
    convolution (stride 1) or col2im (stride 2) giving dx."""
    g = ConvGeometry.of((20, 6, 6, 2), 4, 3, stride, 1, 1, groups)
    assert g.rows_per_chunk == 20                       # a small workspace is not worth chunking
    monkeypatch.setattr(K, "UNCHUNKED_NELEMS", 0)       # bounded by the layer's input and output
    assert 1 < g.rows_per_chunk < g.batch
    monkeypatch.setattr(K, "UNCHUNKED_NELEMS", 5 * g.row_nelems(backward=True))
    assert 5 <= g.rows_per_chunk < g.batch                  # the larger of the two bounds
    assert g.backward_workspace_nelems == g.rows_per_chunk * g.row_nelems(backward=True) + 3 * g.weight_nelems
    monkeypatch.setattr(K.workers, "count", lambda: 2)
    monkeypatch.setattr(K, "CACHE_NELEMS", g.row_nelems(backward=True))      # one row a chunk
    assert K.chunk_plan(g, g.forward_workspace_nelems, backward=False) == (1, 2)
    assert K.chunk_plan(g, g.backward_workspace_nelems, backward=True) == (1, 2)
    assert K.chunk_plan(g, g.forward_workspace_nelems, backward=False, xp=None) == (g.rows_per_chunk, 1)
    if g.transposed is not None:                         # without dx, no room for the transposed convolution
        with monkeypatch.context() as m:
            m.setattr(K, "CACHE_NELEMS", 2 * g.row_nelems(backward=False))
            assert K.chunk_plan(g, g.backward_workspace_nelems, backward=True)[0] == 1
            assert K.chunk_plan(g, g.backward_workspace_nelems, backward=True, input_gradient=False)[0] == 2
    x, wt = cl(rng.normal(size=(20, 2, 6, 6))), rng.normal(size=g.weight_shape)
    bv = rng.normal(size=4) if bias else None
    out = empty(g.out_shape)
    K.conv2d_forward(x, wt, bv, out, g, empty(g.forward_workspace_nelems))
    tx, tw, tb = tt(cf(x), True), tt(wt, True), (tt(bv, True) if bias else None)
    ref = F.conv2d(tx, tw, tb, stride=stride, padding=1, groups=groups)
    assert_close(cf(out), ref)
    dy = rng.normal(size=g.out_shape)
    ref.backward(tt(cf(dy)))
    dx, dw = empty(x.shape), empty(wt.shape)
    db = empty(4) if bias else None
    K.conv2d_backward(x, wt, dy, dx, dw, db, g, empty(g.backward_workspace_nelems))
    assert_close(cf(dx), tx.grad)
    assert_close(dw, tw.grad)
    if bias:
        assert_close(db, tb.grad)
    alone = empty(wt.shape)                              # the first layer's: no dx, larger chunks
    K.conv2d_backward(x, wt, dy, None, alone, None, g, empty(g.backward_workspace_nelems))
    assert_close(alone, tw.grad)


def test_two_workers_give_the_gradients_of_one(rng, monkeypatch):
    """The same backward pass on one worker and on two, in the same chunks (cache-sized, of two
    rows): the same bits, the weight gradients of the chunks added in chunk order whichever worker
    made them."""
    g = ConvGeometry.of((8, 5, 5, 3), 4, 3, padding=1)
    monkeypatch.setattr(K, "CACHE_NELEMS", 2 * g.row_nelems(backward=True))
    x, wt, dy = rng.normal(size=g.in_shape), rng.normal(size=g.weight_shape), rng.normal(size=g.out_shape)
    grads = {}
    for n in (1, 2, 2):
        monkeypatch.setattr(K.workers, "count", lambda n=n: n)
        assert K.chunk_plan(g, g.backward_workspace_nelems, backward=True) == (2, n)
        dx, dw = empty(x.shape), empty(wt.shape)
        K.conv2d_backward(x, wt, dy, dx, dw, None, g, empty(g.backward_workspace_nelems))
        grads.setdefault(n, []).append((dx, dw))
    np.testing.assert_array_equal(grads[1][0][1], grads[2][0][1])
    np.testing.assert_array_equal(grads[1][0][0], grads[2][0][0])
    np.testing.assert_array_equal(grads[2][0][1], grads[2][1][1])


def test_chunks_that_finish_out_of_order_are_added_in_order(rng, monkeypatch):
    """Two workers take the chunks as they come free; the first chunk is the last to finish (its
    worker is held up), so the others wait for it to be added: the weight gradient has the bits
    of one worker all the same. A chunk that fails raises from the backward pass, and the other
    worker stops taking chunks (no hang)."""
    import threading
    import time

    g = ConvGeometry.of((12, 5, 5, 3), 4, 3, padding=1)
    monkeypatch.setattr(K, "CACHE_NELEMS", 2 * g.row_nelems(backward=True))
    x, wt, dy = rng.normal(size=g.in_shape), rng.normal(size=g.weight_shape), rng.normal(size=g.out_shape)
    rows = K._gradients_transposed_rows
    monkeypatch.setattr(K.workers, "count", lambda: 1)
    alone = empty(wt.shape)
    K.conv2d_backward(x, wt, dy, empty(x.shape), alone, None, g, empty(g.backward_workspace_nelems))
    monkeypatch.setattr(K.workers, "count", lambda: 2)
    others = threading.Event()
    first_thread = []

    def held_up(x_, dy_, *args):
        if x_.base is x and x_.ctypes.data == x.ctypes.data and not first_thread:   # chunk 0
            first_thread.append(threading.get_ident())
            others.wait(10)                              # until the other worker has done two
            time.sleep(0.05)
        rows(x_, dy_, *args)
        if threading.get_ident() not in first_thread and x_.ctypes.data == x[4:].ctypes.data:
            others.set()

    monkeypatch.setattr(K, "_gradients_transposed_rows", held_up)
    dw = empty(wt.shape)
    K.conv2d_backward(x, wt, dy, empty(x.shape), dw, None, g, empty(g.backward_workspace_nelems))
    assert others.is_set()
    np.testing.assert_array_equal(dw, alone)

    def fails(x_, *args):
        if x_.ctypes.data == x[2:].ctypes.data:
            raise RuntimeError("chunk 1 failed")
        rows(x_, *args)

    monkeypatch.setattr(K, "_gradients_transposed_rows", fails)
    with pytest.raises(RuntimeError, match="chunk 1 failed"):
        K.conv2d_backward(x, wt, dy, empty(x.shape), dw, None, g, empty(g.backward_workspace_nelems))


def test_kernels_split_over_workers_give_the_same_bits(rng, monkeypatch):
    """Batch norm of vectors split by channels and relu by rows, over three workers (parts of
    uneven size): the values of one call (a part's reductions may add in another order: to
    rounding), and the recompute of batch norm still gives the forward pass's bits."""
    from tensile_db.runtime import kernels as E

    x, dy = rng.normal(size=(54, 5)), rng.normal(size=(54, 5))
    gamma, beta = rng.uniform(0.5, 1.5, size=5), rng.normal(size=5)

    def run_all():
        out, mean, invstd, rm, rv = empty(x.shape), empty(5), empty(5), np.zeros(5), np.ones(5)
        K.batch_norm_forward(x, gamma, beta, out, mean, invstd, rm, rv)
        again = empty(x.shape)
        K.batch_norm_apply(x, gamma, beta, mean, invstd, again)
        dx, dgamma, dbeta = empty(x.shape), empty(5), empty(5)
        K.batch_norm_backward(x, gamma, mean, invstd, dy, dx, dgamma, dbeta)
        r, dr = empty(x.shape), empty(x.shape)
        E.relu_forward(x, r)
        E.relu_backward(r, dy, dr)
        return [out, mean, invstd, rm, rv, again, dx, dgamma, dbeta, r, dr]

    whole = run_all()
    monkeypatch.setattr(K.workers, "SPLIT_NELEMS", 0)
    monkeypatch.setattr(K.workers, "count", lambda: 3)
    calls = []
    run = K.workers.run
    monkeypatch.setattr(K.workers, "run", lambda work, n: (calls.append(n), run(work, n)))
    parts = run_all()
    assert set(calls) == {3}
    for a, b in zip(whole, parts):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(parts[9], whole[9])           # relu: elementwise, the same bits
    np.testing.assert_array_equal(parts[10], whole[10])
    np.testing.assert_array_equal(parts[5], parts[0])           # the recompute gives the forward's bits


def test_an_empty_batch_has_zero_gradients():
    g = ConvGeometry.of((0, 5, 5, 2), 3, 3, padding=1)
    x, dy = np.empty(g.in_shape), np.empty(g.out_shape)
    dw, db, dx = empty(g.weight_shape), empty(3), empty(x.shape)
    K.conv2d_backward(x, np.ones(g.weight_shape), dy, dx, dw, db, g, empty(g.backward_workspace_nelems))
    assert not dw.any() and not db.any()
