"""Training programs of convolutional graph networks (``tensile_db.runtime.builder``).

Four kinds of checks, on a residual network, a network of concatenations, and one with dropout,
average pooling, flatten and standalone activations:

- the access-sequence invariants of ``tests/test_program.py`` (data flow, lifetimes, next uses,
  peaks), and that a gradient with several contributions is whole before it is read;
- whole-network gradients: the program's ops, run once on plain NumPy arrays, give the loss,
  every parameter's gradient and the updated batch-norm running statistics of PyTorch autograd
  on the same network: float64-tight in float64, to float32 rounding in float32;
- recompute: every recomputable slot, recomputed at its last access by its recipe's replays, is
  bit-identical, and the replays write nothing else (batch norm's running statistics included);
- the memory invariants of ``tests/test_scheduler.py`` on the executor: under every policy and a
  tight budget the budget is never exceeded, every tensor an op touches is resident while it
  runs, and the trained weights (running statistics included) are bit-identical to an unlimited
  run, with recompute happening, alone and with two jobs sharing the device.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from conftest import TEST_DEVICE
from job_helpers import SLOW, budget_of, run
from model_helpers import random_weights
from program_helpers import batch_of, forward_backward, recompute_each_at_its_last_access
from tensile_db.coordinator.jobs import JobInfo, TrainingJob
from tensile_db.memory.manager import JobMemory, MemoryManager, Residency
from tensile_db.runtime.builder import build_training_program
from tensile_db.runtime.devices import make_device
from tensile_db.runtime.layout import channels_first
from tensile_db.runtime.model import ModelSpec, TrainOptions
from tensile_db.runtime.network import INPUT
from tensile_db.runtime.program import Kind, Op, Program
from tensile_db.scheduler import Scheduler
from tensile_db.settings import POLICIES, UNPLANNED_POLICIES

# The access-sequence invariants of the MLP programs, collected here with this module's
# ``program`` fixture, so that they run on the CNN programs below.
from test_program import (  # noqa: F401
    test_every_read_was_written_earlier_or_is_persistent,
    test_frees_after_once_and_after_last_access,
    test_next_use,
    test_peak_and_working_set,
    test_positions_match_ops,
)

#: Rows of 64 features seen as 1x8x8 images (sklearn's digits), 10 classes.
RESIDUAL = ModelSpec.parse({"input": {"shape": [1, 8, 8]}, "layers": [
    {"conv": 6, "padding": 1, "bias": False, "activation": "none"}, {"batch_norm": {}, "activation": "relu"},
    {"residual": [{"conv": 6, "padding": 1}, {"conv": 6, "padding": 1, "activation": "none"}], "activation": "relu"},
    {"residual": [{"conv": 8, "stride": 2, "padding": 1, "bias": False, "activation": "none"},
                  {"batch_norm": {}, "activation": "relu"}, {"conv": 8, "padding": 1, "activation": "none"}],
     "shortcut": [{"conv": 8, "kernel": 1, "stride": 2, "bias": False, "activation": "none"},
                  {"batch_norm": {"momentum": 0.2}}], "activation": "relu"},
    {"global_avg_pool": {}}]}, 64, 10, "classification")

CONCAT = ModelSpec.parse({"input": {"shape": [1, 8, 8]}, "layers": [
    {"concat": [[], [{"conv": 3, "kernel": 1}]]},              # an identity branch of the input: no gradient
    {"conv": 6, "padding": 1, "activation": "tanh"},
    {"concat": [[], [{"conv": 4, "kernel": 1}],
                [{"conv": 2, "kernel": 1}, {"conv": 4, "kernel": [3, 1], "padding": [1, 0], "groups": 2}],
                [{"max_pool": 3, "stride": 1, "padding": 1}, {"conv": 2, "kernel": 1, "groups": 2}]]},
    {"batch_norm": {}, "activation": "relu"},
    {"max_pool": 2},
    {"concat": [[], []]},                                      # one input read twice
    {"conv": 8, "dilation": 2, "padding": 2, "activation": "sigmoid"},
    {"dense": 16}]}, 64, 10, "classification")

MISC = ModelSpec.parse({"input": {"shape": [2, 6, 6]}, "layers": [
    {"conv": 4, "padding": 1, "activation": "sigmoid"},
    {"avg_pool": 2},
    {"dropout": 0.25},
    {"conv": 6, "kernel": 2, "activation": "none"},
    {"activation": "tanh"},
    {"avg_pool": 3, "stride": 1, "padding": 1},
    {"flatten": {}},
    {"dense": 12, "dropout": 0.2},
    {"batch_norm": {}},
    {"activation": "relu"},
    {"residual": [{"dense": 12, "activation": "tanh"}, {"dense": 12, "activation": "none"}]},
    {"activation": "none"},
    {"dropout": 0.1}]}, 72, 1, "regression")

SPECS = {
    "residual-adam": (RESIDUAL, TrainOptions(optimizer="adam", lr=0.01)),
    "concat-sgd": (CONCAT, TrainOptions(optimizer="sgd", momentum=0.9, weight_decay=1e-3)),
    "dropout-pool-flatten-regression": (MISC, TrainOptions(optimizer="adam", weight_decay=0.01)),
}
BATCH = 6


@pytest.fixture(params=list(SPECS), ids=list(SPECS))
def program(request) -> tuple[ModelSpec, TrainOptions, Program]:
    spec, options = SPECS[request.param]
    return spec, options, build_training_program(spec, options, BATCH)


# --- the access sequence ----------------------------------------------------------------------------


def test_every_node_and_parameter_has_its_ops(program):
    spec, options, prog = program
    names = [op.name for op in prog.ops]
    stepped = []                                    # a node's joined parameters take one step
    for node in spec.network.nodes:
        assert f"{node.op}{node.index}" in names
        for p in dict.fromkeys(prog.members[p][0] if p in prog.members else p for p in node.params):
            assert names.index(f"{node.op}{node.index}_backward") < names.index(f"{options.optimizer}_{p}")
            stepped.append(p)
    assert names[-len(stepped):] == [f"{options.optimizer}_{p}" for p in stepped]
    c, h, w = spec.network.input_shape                      # images are stored channels last
    assert prog.slots["x"].shape == (BATCH, h, w, c)


def test_a_gradient_is_whole_before_it_is_read(program):
    """A node read by several others collects its gradient from each: every write of ``g{j}``
    (the first contribution, then each ``accumulate``) comes before every other read of it."""
    _, _, prog = program
    accumulated = 0
    for name, slot in prog.slots.items():
        if slot.kind is not Kind.GRADIENT:
            continue
        writes = [p for p in prog.positions[name] if name in prog.ops[p].writes]
        reads = [p for p in prog.positions[name] if name not in prog.ops[p].writes]
        if any(prog.ops[p].name.startswith("accumulate_") for p in writes):
            accumulated += 1
            assert reads and max(writes) < min(reads), name
        if "." in name:                                  # a temporary contribution: added in, then dead
            assert [prog.ops[p].name for p in prog.positions[name]][-1] == f"accumulate_{name.split('.')[0]}"
    assert accumulated                                    # every network here has a node read twice


def torch_reference(spec: ModelSpec, weights: dict, x, y, masks: dict, dtype):
    """The loss, the gradients of every parameter and the running statistics after one
    training-mode forward pass in PyTorch, by walking the network's nodes."""
    net = spec.network
    params = {p for node in net.nodes for p in node.params}
    t = {k: torch.tensor(v, dtype=dtype, requires_grad=k in params) for k, v in weights.items()}
    values = {INPUT: torch.tensor(x, dtype=dtype).reshape(len(x), *net.input_shape)}
    for node in net.nodes:
        i, l = node.index, node.layer
        ins = [values[j] for j in node.inputs]
        v = ins[0]
        if node.op == "dense":
            v = v @ t[f"W{i}"] + t[f"b{i}"]
        elif node.op == "conv":
            v = F.conv2d(v, t[f"W{i}"], t.get(f"b{i}"), l.stride, l.padding, l.dilation, l.groups)
        elif node.op == "batch_norm":
            v = F.batch_norm(v, t[f"mean{i}"], t[f"var{i}"], t[f"gamma{i}"], t[f"beta{i}"], True, l.momentum, l.eps)
        elif node.op == "max_pool":
            v = F.max_pool2d(v, l.kernel, l.stride, l.padding)
        elif node.op == "avg_pool":
            v = F.avg_pool2d(v, l.kernel, l.stride, l.padding)
        elif node.op == "global_avg_pool":
            v = v.mean((2, 3))
        elif node.op == "flatten":
            v = v.flatten(1)
        elif node.op == "dropout":
            v = v * torch.tensor(masks[i], dtype=dtype)
        elif node.op == "add":
            v = ins[0] + ins[1]
        elif node.op == "concat":
            v = torch.cat(ins, 1)
        if node.activation != "none":
            v = getattr(torch, node.activation)(v)
        if node.op == "dense" and node.dropout:
            v = v * torch.tensor(masks[i], dtype=dtype)
        values[i] = v
    out = values[net.nodes[-1].index]
    if spec.task == "classification":
        loss = F.cross_entropy(out, torch.tensor(y, dtype=torch.long))
    else:
        loss = F.mse_loss(out, torch.tensor(y, dtype=dtype))
    loss.backward()
    stats = {k: v.detach().numpy() for k, v in t.items() if k.startswith(("mean", "var"))}
    return loss.item(), {p: t[p].grad.numpy() for p in params}, stats


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-9), (np.float32, 2e-3)], ids=["float64", "float32"])
def test_gradients_equal_torch_autograd(program, dtype, rtol):
    spec, _, prog = program
    weights = random_weights(spec.network, seed=5)
    x, y = batch_of(spec, BATCH, seed=6)
    arrays = forward_backward(spec, prog, weights, x, y, dtype)

    # the program's dropout masks, an image's stored channels last, in PyTorch's axes
    masks = {int(k[4:]): (channels_first(v) if v.ndim == 4 else v) for k, v in arrays.items() if k.startswith("mask")}
    loss, grads, stats = torch_reference(spec, weights, x.astype(dtype), y, masks,
                                         torch.float64 if dtype == np.float64 else torch.float32)
    assert arrays["loss"].dtype == dtype
    np.testing.assert_allclose(arrays["loss"][0], loss, rtol=rtol)
    for name, expected in {**grads, **stats}.items():
        got = arrays[f"d{name}" if name in grads else name]
        assert got.shape == expected.shape, name
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * np.abs(expected).max(), err_msg=name)


# --- recompute --------------------------------------------------------------------------------------


def test_recompute_at_the_last_access_is_bit_identical(program):
    spec, _, prog = program
    replayed = recompute_each_at_its_last_access(spec, prog, BATCH)
    for node in spec.network.nodes:
        if node.op == "batch_norm" and prog.recipe(f"h{node.index}"):
            assert f"batch_norm{node.index}_replay" in replayed
    assert any(name.startswith("batch_norm") for name in replayed) == any(
        n.op == "batch_norm" for n in spec.network.nodes)


# --- under a budget, on the executor -----------------------------------------------------------------

EXECUTOR_SPECS = {
    "residual": (RESIDUAL, TrainOptions(epochs=1, batch_size=16, optimizer="adam", lr=0.01, seed=3)),
    "concat": (CONCAT, TrainOptions(epochs=1, batch_size=16, optimizer="sgd", lr=0.05, seed=4)),
}


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray]:
    data = load_digits()
    return data.data.astype(np.float32), data.target.astype(np.int32)


def digits_job(name: str, rows: int = 64) -> TrainingJob:
    spec, options = EXECUTOR_SPECS[name]
    x, y = digits()
    start = 100 * list(EXECUTOR_SPECS).index(name)
    return TrainingJob(JobInfo(1, "tester", name), spec, options, x[start:start + rows], y[start:start + rows])


def check_residency(job: TrainingJob) -> collections.Counter:
    """Wrap every op of the job, and its replay, so that it asserts that each tensor of the job it
    touches is on the device with no copy in flight (unlike ``test_scheduler._check_residency``,
    the replays are kept: batch norm must recompute through its own). Returns a counter of the
    ops run, by name."""
    ran: collections.Counter = collections.Counter()

    def wrap(op: Op | None) -> Op | None:
        if op is None:
            return None

        def run_checked(arrays, ctx):
            ran[op.name] += 1
            for s in op.accesses:
                t = job.tensors.get(s)
                if t is None:                           # a replay's own workspace, held around it
                    assert prog.slots[s].kind is Kind.WORKSPACE, f"{op.name}: {s} is not registered"
                    continue
                assert t.residency is Residency.DEVICE and t.transfer is None, \
                    f"{op.name}: {s} is {t.residency.value}"
            op.run(arrays, ctx)
        return Op(op.name, op.reads, op.writes, run_checked, wrap(op.replay))

    prog = job.program
    prog.ops[:] = [wrap(op) for op in prog.ops]
    return ran


def drops_after_each_read(prog: Program) -> dict[int, list[str]]:
    """Op position -> the recomputable slots to drop after it: every access of a slot but its
    last, from the end of its recipe on, so that it is recomputed before every later read."""
    drops = collections.defaultdict(list)
    for name in prog.slots:
        recipe = prog.recipe(name)
        if recipe is not None:
            for p in prog.positions[name][:-1]:
                if p >= recipe[-1]:
                    drops[p].append(name)
    return drops


class Dropping:
    """Op hooks that drop the job's tensors named by ``drops`` (op position -> slots) after the op."""

    def __init__(self, mm: MemoryManager, drops: dict[int, list[str]]):
        self.mm, self.drops = mm, drops

    def before(self, job: TrainingJob, position: int) -> None:
        pass

    def after(self, job: TrainingJob, position: int, seconds: float) -> None:
        for name in self.drops.get(position, ()):
            self.mm.drop(job.tensors[name])


def train_directly(job: TrainingJob, drops: dict[int, list[str]]) -> JobMemory:
    """Run the whole training of ``job`` on a manager of unlimited budget, without an executor,
    dropping ``drops`` (see :class:`Dropping`). Returns the job's memory counters."""
    mm = MemoryManager(make_device(TEST_DEVICE), 64 * job.vanilla_peak_nbytes)
    mm.register_job(job.id)
    try:
        for _ in job.ops(mm, mm.device, Dropping(mm, drops)):
            pass
        return mm.release_job(job.id)
    finally:
        mm.close()


def test_dropping_every_recomputable_tensor_after_each_read_trains_bit_identically(program):
    """The job's recompute path (``TrainingJob._recompute``) on every recipe, nested recomputes
    (a dropped tensor whose recipe reads a dropped tensor) and batch norm's replay included: the
    running statistics are not updated twice."""
    spec, options, _ = program
    x, y = batch_of(spec, 3 * BATCH, seed=8)
    options = dataclasses.replace(options, epochs=1, batch_size=BATCH, seed=2)

    def job():
        return TrainingJob(JobInfo(1, "tester", "m"), spec, options, x, y)

    reference, dropped = job(), job()
    assert train_directly(reference, {}).recomputes == 0
    ran = check_residency(dropped)
    drops = drops_after_each_read(dropped.program)
    memory = train_directly(dropped, drops)
    assert dropped.iterations == 3
    assert memory.recomputes == 3 * sum(map(len, drops.values()))        # one per drop
    has_batch_norm = any(n.op == "batch_norm" for n in spec.network.nodes)
    assert any(name.endswith("_replay") for name in ran) == has_batch_norm
    assert_same_training(reference, dropped)


@pytest.fixture(scope="module")
def unlimited() -> dict[str, TrainingJob]:
    jobs = {name: digits_job(name) for name in EXECUTOR_SPECS}
    for job in jobs.values():
        run([job], 64 * job.vanilla_peak_nbytes, "reactive")
        assert job.memory.swap_outs == 0 and job.memory.recomputes == 0
    return jobs


@pytest.fixture
def plans_at_once(monkeypatch):
    """Install each plan as soon as it is asked for, not when the planning thread is done: these
    jobs run a few iterations only, and a plan made in the background may come after they end
    (``tests/test_scheduler.py`` runs the planner in the background)."""
    monkeypatch.setattr(Scheduler, "replan", functools.partialmethod(Scheduler.replan, wait=True))


def assert_same_training(reference: TrainingJob, job: TrainingJob) -> None:
    assert job.loss == reference.loss
    assert reference.result.keys() == job.result.keys()
    for name, value in reference.result.items():
        assert np.array_equal(job.result[name], value), f"{job.policy}: {name} differs"


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_alone_stays_in_budget_and_matches_unlimited_bit_for_bit(unlimited, plans_at_once, policy):
    for name, reference in unlimited.items():
        job = digits_job(name)
        check_residency(job)
        budget = budget_of([job], 0.5)
        assert budget < job.vanilla_peak_nbytes
        mm, ex = run([job], budget, policy, cost=SLOW)
        assert mm.peak_nbytes <= budget and job.memory.peak_nbytes <= budget
        assert job.memory.swap_outs > 0
        assert (ex.scheduler.plans_made > 0) == (policy not in UNPLANNED_POLICIES)
        if policy == "tensile":                     # swaps cost more than recomputing: it recomputes
            assert job.memory.recomputes > 0, name
        assert_same_training(reference, job)
    stats = [k for k in unlimited["residual"].result if k.startswith(("mean", "var"))]
    assert len(stats) == 6                          # the three batch norms' running statistics compared too


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_with_two_jobs_sharing_the_device(unlimited, plans_at_once, policy):
    jobs = [digits_job(name) for name in EXECUTOR_SPECS]
    for job in jobs:
        check_residency(job)
    budget = budget_of(jobs, 0.5)
    mm, ex = run(jobs, budget, policy, cost=SLOW)
    assert mm.peak_nbytes <= budget and all(j.memory.peak_nbytes <= budget for j in jobs)
    assert sum(j.memory.swap_outs for j in jobs) > 0
    assert (ex.scheduler.plans_made > 0) == (policy not in UNPLANNED_POLICIES)
    if policy == "tensile":
        assert sum(j.memory.recomputes for j in jobs) > 0
    for job, reference in zip(jobs, unlimited.values()):
        assert_same_training(reference, job)
