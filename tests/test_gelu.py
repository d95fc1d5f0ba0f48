"""The ``gelu`` activation against PyTorch's exact ``nn.GELU()``: its kernels; a network with it on
a dense layer, a convolution and a standalone activation, in inference and in its whole training
gradients; recompute bit for bit, its kept input included; and a job with it on the executor
under half its peak, bit for bit against unlimited memory."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from job_helpers import SLOW, budget_of, make_job, run
from model_helpers import random_weights
from program_helpers import batch_of, forward_backward, recompute_each_at_its_last_access
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.layers.gelu import gelu_backward, gelu_forward
from tensile_db.runtime.model import ModelSpec, TrainOptions
from tensile_db.scheduler import Scheduler

#: Images 2x4x4: a convolution with GELU, a standalone GELU after pooling, a dense layer with GELU.
NETWORK = {"input": {"shape": [2, 4, 4]},
           "layers": [{"conv": 3, "padding": 1, "activation": "gelu"}, {"avg_pool": 2}, {"activation": "gelu"},
                      {"dense": 10, "activation": "gelu", "dropout": 0.25}]}


def _spec() -> ModelSpec:
    return ModelSpec.parse(NETWORK, 32, 3, "classification")


def test_kernels_equal_torch():
    x = torch.tensor(np.random.default_rng(0).normal(scale=3, size=(6, 9)), requires_grad=True)
    dy = np.random.default_rng(1).normal(size=(6, 9))
    y = F.gelu(x)
    y.backward(torch.tensor(dy))
    out, dx = np.empty((6, 9)), np.empty((6, 9))
    gelu_forward(x.detach().numpy(), out)
    gelu_backward(x.detach().numpy(), dy, dx)
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=1e-12, atol=1e-15)
    inplace = x.detach().numpy().copy()
    gelu_forward(inplace, inplace)                          # forward may run in place, as at inference
    assert np.array_equal(inplace, out)


def test_a_network_trains_and_predicts_as_torch():
    spec = _spec()
    ops = [(n.op, n.activation) for n in spec.network.nodes]
    assert ops[:4] == [("conv", "gelu"), ("avg_pool", "none"), ("activation", "gelu"), ("flatten", "none")]
    weights = random_weights(spec.network, seed=2)
    x, y = batch_of(spec, 5, seed=4)
    prog = build_training_program(spec, TrainOptions(), 5)
    assert {"z0", "z2", "z4"} <= set(prog.slots)             # each GELU keeps its input for its backward
    arrays = forward_backward(spec, prog, weights, x, y, np.float64)

    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in weights.items()}
    v = F.gelu(F.conv2d(torch.tensor(x).reshape(5, 2, 4, 4), t["W0"], t["b0"], padding=1))
    v = F.gelu(F.avg_pool2d(v, 2)).flatten(1)
    v = F.gelu(v @ t["W4"] + t["b4"]) * torch.tensor(arrays["mask4"])
    logits = v @ t["W5"] + t["b5"]
    loss = F.cross_entropy(logits, torch.tensor(y, dtype=torch.long))
    loss.backward()
    np.testing.assert_allclose(arrays["loss"][0], loss.item(), rtol=1e-10)
    for name, tensor in t.items():
        np.testing.assert_allclose(arrays[f"d{name}"], tensor.grad.numpy(), rtol=1e-8, atol=1e-12, err_msg=name)

    with torch.no_grad():
        v = F.gelu(F.conv2d(torch.tensor(x).reshape(5, 2, 4, 4), t["W0"], t["b0"], padding=1))
        v = F.gelu(F.gelu(F.avg_pool2d(v, 2)).flatten(1) @ t["W4"] + t["b4"])
        expected = (v @ t["W5"] + t["b5"]).numpy()
    predicted = spec.network.forward({k: v.astype(np.float32) for k, v in weights.items()}, x.astype(np.float32))
    np.testing.assert_allclose(predicted, expected, rtol=1e-4, atol=1e-5)


def test_recompute_is_bit_identical():
    spec = _spec()
    replayed = recompute_each_at_its_last_access(spec, build_training_program(spec, TrainOptions(), 4), 4)
    assert {"conv0", "gelu0"} <= replayed


@pytest.mark.parametrize("policy", ["tensile", "checkpoint", "dtr"])
def test_a_job_under_half_its_peak_trains_as_unlimited(monkeypatch, policy):
    monkeypatch.setattr(Scheduler, "replan", functools.partialmethod(Scheduler.replan, wait=True))
    options = TrainOptions(epochs=2, batch_size=32, optimizer="adam", lr=0.01, seed=3)
    reference = make_job(_spec(), options, n=96)
    run([reference], 8 * reference.vanilla_peak_nbytes, "tensile")
    job = make_job(_spec(), options, n=96)
    budget = budget_of([job], 0.5)
    mm, ex = run([job], budget, policy, cost=SLOW)
    assert mm.peak_nbytes <= budget < job.vanilla_peak_nbytes
    assert job.memory.swap_outs + job.memory.recomputes > 0
    if policy == "checkpoint":                              # recomputes by design
        assert job.memory.recomputes > 0
    assert job.loss == reference.loss
    for name, value in reference.result.items():
        assert np.array_equal(job.result[name], value), name
