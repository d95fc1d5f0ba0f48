"""The fused optimiser steps (``tensile_db.runtime.fused``): built wherever the package installs
with a C compiler, the NumPy kernels' results bit for bit, through the kernels too, and what
they cannot take (float64, a strided or read-only array, shapes that differ, the setting off)
left to the NumPy passes with nothing written."""

from __future__ import annotations

import shutil
import sys
import threading

import numpy as np
import pytest
import torch

from tensile_db.runtime import fused, workers
from tensile_db.runtime import kernels as K

ADAM = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.fixture
def rng():
    return np.random.default_rng(5)


def state(rng, n: int, count: int):
    """``count`` float32 arrays of ``n`` elements; the last one (Adam's v) not negative."""
    arrays = [rng.standard_normal(n).astype(np.float32) for _ in range(count)]
    np.abs(arrays[-1], out=arrays[-1])
    return arrays


def numpy_passes(monkeypatch, step):
    """Run ``step()`` with the fused steps off, as the kernels' NumPy passes."""
    with monkeypatch.context() as m:
        m.setenv("TENSILE_FUSED", "0")
        step()


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("gcc") is None, reason="no C compiler here")
def test_the_library_is_built_and_loads():
    assert fused.enabled()


needs_library = pytest.mark.skipif(not fused.enabled(), reason="the fused library is not built here")


@needs_library
@pytest.mark.parametrize("n", [1, 15, 17, 1000, 262_147])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_equals_the_numpy_passes_bit_for_bit(rng, monkeypatch, n, weight_decay):
    ours = state(rng, n, 4)
    theirs = [a.copy() for a in ours]
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    for step, g in enumerate(grads, start=1):
        assert fused.adam(ours[0], g.copy(), ours[2], ours[3], step=step, weight_decay=weight_decay, **ADAM)
        numpy_passes(monkeypatch, lambda: K.adam_update(theirs[0], g.copy(), theirs[2], theirs[3], step=step,
                                                        weight_decay=weight_decay, **ADAM))
    for name, a, b in zip("wgmv", ours, theirs):
        if name != "g":
            assert np.array_equal(a, b), name


@needs_library
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_equals_the_numpy_passes_bit_for_bit(rng, monkeypatch, momentum, weight_decay):
    ours = state(rng, 4099, 3)
    theirs = [a.copy() for a in ours]
    for _ in range(3):
        g = rng.standard_normal(4099).astype(np.float32)
        assert fused.sgd(ours[0], g.copy(), ours[2], 0.1, momentum, weight_decay)
        numpy_passes(monkeypatch, lambda: K.sgd_update(theirs[0], g.copy(), theirs[2], 0.1, momentum, weight_decay))
    assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[2], theirs[2])


@needs_library
def test_the_gradient_is_only_read(rng):
    w, g, m, v = state(rng, 100, 4)
    before = g.copy()
    assert fused.adam(w, g, m, v, step=1, weight_decay=0.01, **ADAM)
    assert fused.sgd(w, g, m, 0.1, 0.9, 0.01)
    assert np.array_equal(g, before)


@needs_library
def test_float32_adam_through_the_kernel_matches_torch(rng):
    w0 = rng.standard_normal((64, 32)).astype(np.float32)
    w, m, v = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    wt = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.Adam([wt], lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                           weight_decay=0.01)
    for step in range(1, 6):
        g = rng.standard_normal(w0.shape).astype(np.float32)
        K.adam_update(w, g.copy(), m, v, step=step, weight_decay=0.01, **ADAM)
        wt.grad = torch.tensor(g)
        opt.step()
    assert not np.allclose(w, w0)
    np.testing.assert_allclose(w, wt.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, opt.state[wt]["exp_avg"].numpy(), rtol=1e-5, atol=1e-6)


@needs_library
@pytest.mark.parametrize("n", [1, 17, 65_536, 1_048_579])
def test_relu_backward_equals_the_numpy_passes_bit_for_bit(rng, monkeypatch, n):
    """Over the OpenMP team too (from 65,536 elements), with zeros, -0, NaNs and infinities in
    ``y`` and in ``dy``: 0 * NaN and 0 * inf stay NaN, 0 * a negative stays -0."""
    y, dy = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, -1.0], np.float32)
    y[:min(n, 6)], dy[:min(n, 6)] = special[:min(n, 6)], special[::-1][:min(n, 6)]
    ours, theirs = np.full(n, 7, np.float32), np.full(n, 7, np.float32)
    # without the team (oneDNN off) a large one keeps NumPy's passes, split over the workers
    split = fused._threads(n) == 1 and n >= workers.SPLIT_NELEMS and workers.count() > 1
    assert fused.relu_backward(y, dy, ours) is not split
    with np.errstate(invalid="ignore"):
        if split:
            K.relu_backward(y, dy, ours)
        numpy_passes(monkeypatch, lambda: K.relu_backward(y, dy, theirs))
    assert ours.tobytes() == theirs.tobytes()
    if n >= 6:      # dy = -1, -inf, inf, nan, -0, 0 against y = 0, -0, nan, inf, -inf, -1
        assert np.isnan(ours[:6]).tolist() == [False, True, False, True, False, False]
        assert np.signbit(ours[[0, 4]]).all() and ours[2] == np.inf


@needs_library
def test_relu_backward_leaves_what_it_cannot_take_to_numpy(rng, monkeypatch):
    y, dy = state(rng, 64, 2)
    dx = np.zeros_like(y)
    assert not fused.relu_backward(y, dy, dy)                           # dx is dy: NumPy's passes
    assert not fused.relu_backward(y.astype(np.float64), dy.astype(np.float64), dx.astype(np.float64))
    assert not fused.relu_backward(y[::2], dy[::2], dx[::2])
    monkeypatch.setenv("TENSILE_FUSED", "0")
    assert not fused.relu_backward(y, dy, dx)
    assert not dx.any()


@needs_library
@pytest.mark.parametrize("nbytes", [fused.COPY_PARALLEL_MIN_NBYTES, (4 << 20) + 13])
def test_a_copy_on_the_team_copies_every_byte(rng, nbytes):
    """Over the OpenMP team, whatever the length (here not a multiple of 4): the parts end where
    the next begins, the last at the copy's end, and nothing past it is written."""
    if fused._threads(fused.PARALLEL_MIN_NELEMS) == 1:
        pytest.skip("no OpenMP team here (oneDNN off, or one core)")
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 64, np.uint8)
    workers.note_team()                                 # this thread runs the kernels' team
    assert fused.copy(dst[:nbytes], src)
    assert np.array_equal(dst[:nbytes], src) and not dst[nbytes:].any()


@needs_library
def test_a_copy_on_another_thread_than_the_teams_starts_no_team(rng):
    """Note [One OpenMP team]: a thread that has run no region on the kernels' team leaves its
    copy to NumPy, even a large one."""
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    workers.note_team()
    took = []
    thread = threading.Thread(target=lambda: took.append(fused.copy(dst, src)))
    thread.start()
    thread.join()
    assert took == [False] and not dst.any()
    assert workers.on_team() and not fused.copy(dst[:16], src[:16])     # too small here too


@needs_library
def test_what_a_copy_on_the_team_cannot_take_is_left_to_numpy(rng):
    n = fused.COPY_PARALLEL_MIN_NBYTES // 4
    src = rng.standard_normal(n).astype(np.float32)
    assert not fused.copy(np.zeros(n - 16, np.float32), src[:n - 16])      # too small to split
    assert not fused.copy(np.zeros(n, np.float64), src)                      # another dtype: a cast
    assert not fused.copy(np.zeros((2, n), np.float32)[:, ::2], src.reshape(2, -1)[:, :n // 2])
    both = np.zeros(2 * n, np.float32)
    assert not fused.copy(both[n // 2:n // 2 + n], both[:n])                 # they overlap
    frozen = np.zeros(n, np.float32)
    frozen.flags.writeable = False
    assert not fused.copy(frozen, src) and not frozen.any()
    objects = np.empty(n, object)
    assert not fused.copy(np.empty(n, object), objects)                      # pointers: NumPy's copy


def declined(arrays) -> bool:
    """Whether the fused Adam refused ``arrays`` and wrote nothing."""
    before = [a.copy() for a in arrays]
    took = fused.adam(*arrays, step=1, weight_decay=0.0, **ADAM)
    return not took and all(np.array_equal(a, b) for a, b in zip(arrays, before))


@needs_library
def test_what_it_cannot_take_is_left_to_numpy(rng, monkeypatch):
    assert declined([a.astype(np.float64) for a in state(rng, 64, 4)])
    w, g, m, v = state(rng, 128, 4)
    assert declined([w[::2], g[::2], m[::2], v[::2]])
    assert declined([w, g, m, v[:64].copy()])
    assert declined([w, g, w, v])                                         # m is w
    assert not fused.adam(w, g, m, v, step=1, weight_decay=1e-50, **ADAM)  # 0 in float32: NumPy's passes
    w.flags.writeable = False
    assert declined([w, g, m, v])
    w = w.copy()
    monkeypatch.setenv("TENSILE_FUSED", "0")
    assert not fused.enabled()
    assert declined([w, g, m, v])


@pytest.mark.parametrize("rows, columns", [(1, 1), (70_001, 3), (5_000, 37)])
def test_moments_are_the_float64_sums_of_the_shifted_values(rng, rows, columns):
    x = (rng.standard_normal((rows, columns)) * 3 + 1e4).astype(np.float32)
    shift = x[:100].mean(axis=0, dtype=np.float64)
    s1, s2 = fused.moments(x, shift)
    d = x.astype(np.float64) - shift
    np.testing.assert_allclose(s1, d.sum(axis=0), rtol=1e-9, atol=1e-9 * rows)
    np.testing.assert_allclose(s2, (d * d).sum(axis=0), rtol=1e-9)
    again = fused.moments(x, shift)
    assert again[0].tobytes() == s1.tobytes() and again[1].tobytes() == s2.tobytes()   # the same on every run


def test_moments_of_rows_by_index_are_those_of_the_rows_gathered(rng):
    x = (rng.standard_normal((5_000, 7)) * 3 + 1e4).astype(np.float32)
    rows = rng.permutation(len(x))[:3_000]
    shift = x[rows[:100]].mean(axis=0, dtype=np.float64)
    want = fused.moments(np.ascontiguousarray(x[rows]), shift)
    got = fused.moments(x, shift, rows.astype(np.int32))
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()
    for bad in (np.array([0, 5_000]), np.array([-1])):
        with pytest.raises(ValueError, match="not indices"):
            fused.moments(x, shift, bad)


def test_scaled_rows_are_numpys_bits_in_place_or_not(rng):
    x = (rng.standard_normal((1_000, 9)) * 5 + 3).astype(np.float32)
    center, spread = x.mean(axis=0), x.std(axis=0) + np.float32(0.5)
    want = np.subtract(x, center, dtype=np.float32)
    want /= spread
    out = np.empty_like(x)
    assert fused.scale_rows(x, center, spread, out) and out.tobytes() == want.tobytes()
    inplace = x.copy()
    assert fused.scale_rows(inplace, center, spread, inplace) and inplace.tobytes() == want.tobytes()
    # what it may not take is left to NumPy, nothing written
    shifted = np.zeros(x.size + 9, np.float32)
    assert not fused.scale_rows(shifted[9:].reshape(x.shape), center, spread, shifted[:-9].reshape(x.shape))
    assert not shifted.any()
    strided_out = np.zeros((len(x), 5), np.float32)
    assert not fused.scale_rows(x[:, ::2], center[::2].copy(), spread[::2].copy(), strided_out)
    out[...] = 7
    assert not fused.scale_rows(x.astype(np.float64), center, spread, out)
    assert not fused.scale_rows(x, center[:3], spread[:3], out)
    assert not strided_out.any() and (out == 7).all()


def test_moments_leave_what_they_cannot_take_to_numpy(rng, monkeypatch):
    x = rng.standard_normal((100, 4)).astype(np.float32)
    shift = np.zeros(4)
    assert fused.moments(x[:, ::2], shift[:2]) is None                 # strided
    assert fused.moments(x.astype(np.float64), shift) is None
    with pytest.raises(ValueError, match="shift of shape"):
        fused.moments(x, shift[:3])
    monkeypatch.setenv("TENSILE_FUSED", "0")
    assert fused.moments(x, shift) is None


@needs_library
def test_a_library_without_a_later_function_runs_that_one_as_numpy_and_the_others_fused(monkeypatch, rng, caplog):
    """A library built from an earlier source (a stale in-place build) lacks the later symbols:
    only those fall back to NumPy."""
    signatures = dict(fused._SIGNATURES, tensile_from_a_later_source=[])
    monkeypatch.setattr(fused, "_SIGNATURES", signatures)
    monkeypatch.setitem(fused._state, "tried", False)
    monkeypatch.setitem(fused._state, "functions", frozenset())
    with caplog.at_level("WARNING", logger=fused.__name__):
        assert fused._library() is not None
    assert "lacks tensile_from_a_later_source" in caplog.text
    assert fused.enabled("tensile_adam_f32") and not fused.enabled("tensile_from_a_later_source")
    x = rng.standard_normal((10, 3)).astype(np.float32)
    assert fused.moments(x, np.zeros(3)) is not None                  # the others still run fused
