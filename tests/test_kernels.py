"""Check every kernel in ``tensile_db.runtime.kernels`` against PyTorch on the CPU in float64.

Forward values and backward gradients are compared with ``torch.autograd``; dense, softmax
cross-entropy, MSE and the activations are also checked with central finite differences so
that the tests do not rest on PyTorch alone. Optimizer steps are compared with
``torch.optim.SGD`` / ``torch.optim.Adam`` over several steps fed identical gradients.
Kernels write into caller-provided outputs, which the tests allocate with ``np.empty``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tensile_db.runtime import kernels as K

RTOL = 1e-10
ATOL = 1e-13
FD_EPS = 1e-6
FD_RTOL = 1e-6
FD_ATOL = 1e-8

B, I, O, C = 7, 5, 4, 6


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def tt(a, grad=False):
    """A float64 (or integer) torch tensor sharing nothing with ``a``."""
    return torch.tensor(np.array(a), requires_grad=grad)


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    if isinstance(expected, torch.Tensor):
        expected = expected.detach().numpy()
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def numerical_grad(f, x, eps=FD_EPS):
    """Central-difference gradient of the scalar function ``f`` at ``x`` (``x`` is restored)."""
    grad = np.empty_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for k in range(flat.size):
        orig = flat[k]
        flat[k] = orig + eps
        f_plus = f()
        flat[k] = orig - eps
        f_minus = f()
        flat[k] = orig
        gflat[k] = (f_plus - f_minus) / (2 * eps)
    return grad


# --- dense -------------------------------------------------------------------------------------


def dense_grads(x, w, dy, with_dx=True):
    dx = np.empty_like(x) if with_dx else None
    dw, db = np.empty_like(w), np.empty(w.shape[1])
    K.dense_backward(x, w, dy, dx, dw, db)
    return dx, dw, db


def test_dense_forward_matches_torch(rng):
    x, w, b = rng.standard_normal((B, I)), rng.standard_normal((I, O)), rng.standard_normal(O)
    out = np.empty((B, O))
    K.dense_forward(x, w, b, out)
    assert_close(out, F.linear(tt(x), tt(w).T, tt(b)))


@pytest.mark.parametrize("with_dx", [True, False], ids=["dx", "dx=None"])
def test_dense_backward_matches_torch(rng, with_dx):
    x, w, b = rng.standard_normal((B, I)), rng.standard_normal((I, O)), rng.standard_normal(O)
    dy = rng.standard_normal((B, O))
    xt, wt, bt = tt(x, True), tt(w, True), tt(b, True)
    (xt @ wt + bt).backward(tt(dy))

    dx, dw, db = dense_grads(x, w, dy, with_dx)
    assert_close(dw, wt.grad)
    assert_close(db, bt.grad)
    if with_dx:
        assert_close(dx, xt.grad)
    else:
        assert dx is None


def test_dense_backward_matches_finite_differences(rng):
    x, w, b = rng.standard_normal((B, I)), rng.standard_normal((I, O)), rng.standard_normal(O)
    r = rng.standard_normal((B, O))  # L = sum(r * y), so dL/dy = r
    out = np.empty((B, O))

    def loss():
        K.dense_forward(x, w, b, out)
        return float(np.sum(r * out))

    dx, dw, db = dense_grads(x, w, r)
    for analytic, param in [(dx, x), (dw, w), (db, b)]:
        assert_close(analytic, numerical_grad(loss, param), FD_RTOL, FD_ATOL)


# --- activations -------------------------------------------------------------------------------

TORCH_ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


def activation_input(rng):
    x = 3 * rng.standard_normal((B, O))
    x[np.abs(x) < 1e-3] = 0.5  # keep away from relu's kink for the finite differences
    return x


@pytest.mark.parametrize("name", sorted(K.ACTIVATIONS))
def test_activation_matches_torch(rng, name):
    forward, backward = K.ACTIVATIONS[name]
    x, dy = activation_input(rng), rng.standard_normal((B, O))
    xt = tt(x, True)
    yt = TORCH_ACTIVATIONS[name](xt)
    yt.backward(tt(dy))

    y, dx = np.empty_like(x), np.empty_like(x)
    forward(x, y)
    backward(y, dy, dx)
    assert_close(y, yt)
    assert_close(dx, xt.grad)


def test_relu_gradient_at_zero_and_nan_is_pytorchs(rng):
    """0 where the input was 0 or below; a NaN input passes its gradient on, as in PyTorch."""
    x = np.array([[np.nan, 0.0, -0.0, -2.0, 3.0, 1e-30]])
    dy = rng.standard_normal(x.shape)
    xt = tt(x, True)
    torch.relu(xt).backward(tt(dy))
    y, dx = np.empty_like(x), np.empty_like(x)
    K.relu_forward(x, y)
    K.relu_backward(y, dy, dx)
    np.testing.assert_array_equal(dx, xt.grad.numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_of_many_rows_is_max_of_x_and_zero_nan_included(rng, dtype):
    """A tensor of more elements than the zero row, and not a multiple of it: the rows against
    the zero row and the tail against the scalar give ``max(x, 0)``, NaN kept, in place too."""
    x = rng.standard_normal((3, K.ZERO_ROW_NELEMS // 2 + 5)).astype(dtype)
    x[0, 1], x[2, -1], x[1, 3] = np.nan, np.nan, -0.0
    out = np.full_like(x, 7.0)
    K.relu_forward(x, out)
    np.testing.assert_array_equal(out, np.maximum(x, 0))
    assert np.isnan(out[2, -1]) and np.isnan(out[0, 1]) and out[1, 3] == 0
    K.relu_forward(x, x)
    np.testing.assert_array_equal(x, out)


@pytest.mark.parametrize("name", sorted(K.ACTIVATIONS))
def test_activation_matches_finite_differences(rng, name):
    forward, backward = K.ACTIVATIONS[name]
    x, r = activation_input(rng), rng.standard_normal((B, O))
    y = np.empty_like(x)

    def loss():
        forward(x, y)
        return float(np.sum(r * y))

    dx = np.empty_like(x)
    forward(x, y)
    backward(y, r, dx)
    assert_close(dx, numerical_grad(loss, x), FD_RTOL, FD_ATOL)


def test_sigmoid_large_inputs_do_not_overflow():
    x = np.array([-1000.0, -750.0, 0.0, 750.0, 1000.0])
    y, dx = np.empty_like(x), np.empty_like(x)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        K.sigmoid_forward(x, y)
        K.sigmoid_backward(y, np.ones_like(x), dx)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
    np.testing.assert_array_equal(y, [0.0, 0.0, 0.5, 1.0, 1.0])
    np.testing.assert_array_equal(dx, [0.0, 0.0, 0.25, 0.0, 0.0])


# --- dropout -----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 0.9])
def test_dropout_mask_values_and_keep_fraction(rng, p):
    u = rng.random(1_000_000)
    mask = np.empty_like(u)
    K.dropout_mask(u, p, mask)

    scale = 1.0 / (1.0 - p)
    np.testing.assert_array_equal(mask, np.where(u >= p, scale, 0.0))
    assert set(np.unique(mask)) <= {0.0, scale}
    kept = np.count_nonzero(mask) / mask.size
    assert abs(kept - (1.0 - p)) < 3e-3


def test_dropout_mask_in_place(rng):
    u = rng.random(10_000)
    expected = np.where(u >= 0.3, 1.0 / 0.7, 0.0)
    K.dropout_mask(u, 0.3, u)  # uniform and mask may be the same array
    np.testing.assert_array_equal(u, expected)


def test_dropout_forward_backward_matches_torch(rng):
    p = 0.4
    x, dy = rng.standard_normal((B, O)), rng.standard_normal((B, O))
    mask = np.empty_like(x)
    K.dropout_mask(rng.random((B, O)), p, mask)
    assert 0 < np.count_nonzero(mask) < mask.size

    xt = tt(x, True)
    yt = xt * tt(mask)
    yt.backward(tt(dy))

    y, dx = np.empty_like(x), np.empty_like(x)
    K.dropout_forward(x, mask, y)
    K.dropout_backward(mask, dy, dx)
    assert_close(y, yt)
    assert_close(dx, xt.grad)
    np.testing.assert_array_equal(dx, dy * mask)


# --- losses ------------------------------------------------------------------------------------


def softmax_ce(logits, labels):
    probs, rowbuf, loss = np.empty_like(logits), np.empty((logits.shape[0], 1)), np.empty(1)
    K.softmax_cross_entropy_forward(logits, labels, probs, rowbuf, loss)
    return probs, loss


@pytest.mark.parametrize("shift", [0.0, 1000.0], ids=["plain", "large-logits"])
def test_softmax_cross_entropy_matches_torch(rng, shift):
    logits = 3 * rng.standard_normal((B, C)) + shift
    labels = rng.integers(0, C, size=B).astype(np.int32)
    lt = tt(logits, True)
    loss_t = F.cross_entropy(lt, tt(labels).long(), reduction="mean")
    loss_t.backward()

    probs, loss = softmax_ce(logits, labels)
    dlogits = np.empty_like(logits)
    K.softmax_cross_entropy_backward(probs, labels, dlogits)
    assert loss.shape == (1,)
    assert_close(probs, torch.softmax(tt(logits), dim=1))
    assert_close(loss[0], loss_t)
    assert_close(dlogits, lt.grad)


@pytest.mark.parametrize("classes", [2, 3, 7, 8, 33])
def test_softmax_cross_entropy_of_few_and_many_classes_matches_torch(rng, classes):
    """Up to SHORT_ROW classes the softmax's row maximum and sum go column by column, beyond it
    through NumPy's reductions: both are torch's cross-entropy, in float32 as in training."""
    logits = (3 * rng.standard_normal((4096, classes))).astype(np.float32)
    labels = rng.integers(0, classes, size=4096).astype(np.int32)
    lt = torch.tensor(logits, requires_grad=True)
    loss_t = F.cross_entropy(lt, torch.tensor(labels).long(), reduction="mean")
    loss_t.backward()
    probs, rowbuf, loss = np.empty_like(logits), np.empty((4096, 1), np.float32), np.empty(1, np.float32)
    K.softmax_cross_entropy_forward(logits, labels, probs, rowbuf, loss)
    dlogits = np.empty_like(logits)
    K.softmax_cross_entropy_backward(probs, labels, dlogits)
    np.testing.assert_allclose(loss[0], loss_t.item(), rtol=1e-5)
    np.testing.assert_allclose(dlogits, lt.grad.numpy(), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("columns", [1, 2, 5, 7, 8, 40])
def test_reductions_over_a_short_axis_are_numpys(rng, columns):
    """A row's maximum (NaN included) and sum and a scaling by a row's value are NumPy's own bit for
    bit; the sums over rows (the BLAS's product with ones) are NumPy's to float32 rounding."""
    a = rng.standard_normal((1000, columns)).astype(np.float32)
    a[7, 0] = np.nan
    row = np.empty((1000, 1), np.float32)
    K.row_max(a, row)
    assert row.tobytes() == a.max(axis=1, keepdims=True).tobytes()
    K.row_sums(np.abs(a), row)
    assert row.tobytes() == np.abs(a).sum(axis=1, keepdims=True).tobytes()
    out = np.empty_like(a)
    K.by_row(np.divide, a, row, out)
    assert out.tobytes() == (a / row).tobytes()
    a[7, 0] = 1.0
    sums = np.empty(columns, np.float32)
    K.column_sums(a, sums)
    np.testing.assert_allclose(sums, a.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-4)
    K.column_sums(a[:0], sums)
    assert (sums == 0).all()


def test_softmax_cross_entropy_matches_finite_differences(rng):
    logits = rng.standard_normal((B, C))
    labels = rng.integers(0, C, size=B).astype(np.int32)

    probs, _ = softmax_ce(logits, labels)
    dlogits = np.empty_like(logits)
    K.softmax_cross_entropy_backward(probs, labels, dlogits)
    numeric = numerical_grad(lambda: float(softmax_ce(logits, labels)[1][0]), logits)
    assert_close(dlogits, numeric, FD_RTOL, FD_ATOL)


def mse(pred, target):
    diff, loss = np.empty_like(pred), np.empty(1)
    K.mse_forward(pred, target, diff, loss)
    return diff, loss


def test_mse_matches_torch(rng):
    pred, target = rng.standard_normal((B, 3)), rng.standard_normal((B, 3))
    pt = tt(pred, True)
    loss_t = F.mse_loss(pt, tt(target))
    loss_t.backward()

    diff, loss = mse(pred, target)
    dpred = np.empty_like(pred)
    K.mse_backward(diff, dpred)
    assert loss.shape == (1,)
    assert_close(diff, pred - target)
    assert_close(loss[0], loss_t)
    assert_close(dpred, pt.grad)


def test_mse_matches_finite_differences(rng):
    pred, target = rng.standard_normal((B, 3)), rng.standard_normal((B, 3))
    diff, _ = mse(pred, target)
    dpred = np.empty_like(pred)
    K.mse_backward(diff, dpred)
    numeric = numerical_grad(lambda: float(mse(pred, target)[1][0]), pred)
    assert_close(dpred, numeric, FD_RTOL, FD_ATOL)


# --- optimizers --------------------------------------------------------------------------------

STEPS = 5
SHAPE = (I, O)


def run_torch_optimizer(make_opt, w0, grads):
    wt = tt(w0, True)
    opt = make_opt([wt])
    for g in grads:
        wt.grad = tt(g)
        opt.step()
    return wt, opt.state[wt]


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_update_matches_torch(rng, momentum, weight_decay):
    lr = 0.1
    w0 = rng.standard_normal(SHAPE)
    grads = [rng.standard_normal(SHAPE) for _ in range(STEPS)]

    w, velocity = w0.copy(), np.zeros(SHAPE)
    for g in grads:
        K.sgd_update(w, g.copy(), velocity, lr, momentum, weight_decay)

    wt, state = run_torch_optimizer(
        lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, weight_decay=weight_decay),
        w0, grads)
    assert not np.allclose(w, w0)
    assert_close(w, wt)
    if momentum:
        assert_close(velocity, state["momentum_buffer"])


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_update_matches_torch(rng, weight_decay):
    lr, beta1, beta2, eps = 0.01, 0.9, 0.999, 1e-8
    w0 = rng.standard_normal(SHAPE)
    grads = [rng.standard_normal(SHAPE) for _ in range(STEPS)]

    w, m, v = w0.copy(), np.zeros(SHAPE), np.zeros(SHAPE)
    for step, g in enumerate(grads, start=1):
        K.adam_update(w, g.copy(), m, v, lr, beta1, beta2, eps, step, weight_decay)

    wt, state = run_torch_optimizer(
        lambda ps: torch.optim.Adam(ps, lr=lr, betas=(beta1, beta2), eps=eps,
                                    weight_decay=weight_decay),
        w0, grads)
    assert not np.allclose(w, w0)
    assert_close(w, wt)
    assert_close(m, state["exp_avg"])
    assert_close(v, state["exp_avg_sq"])
