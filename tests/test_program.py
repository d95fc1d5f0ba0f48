"""Training programs and the jobs that run them under a memory budget.

The first half checks the program as an access sequence: data flow (nothing is read before it
is written), lifetimes (``frees_after``), next uses (wrapping for weights and optimizer state),
and the peak and working-set figures, against straightforward recomputations; and that a
program's skeleton (no kernels, picklable) answers every question a planner asks as the program
does, for MLPs, a small CNN and every named network.

The second half checks the key invariant of the memory manager: training under a tight budget,
with real swapping, gives bit-identical weights to training with unlimited memory, alone or with
other jobs sharing the device.
"""

from __future__ import annotations

import math
import pickle
import queue

import numpy as np
import pytest

from program_helpers import HostDevice, allocate, batch_of, member_views
from tensile_db.coordinator.executor import Executor
from tensile_db.coordinator.jobs import JobInfo, JobState, TrainingJob
from tensile_db.errors import DeviceOutOfMemory, InvalidArgument
from tensile_db.memory.arena import UNIT_NBYTES, round_up
from tensile_db.memory.manager import MemoryManager
from tensile_db.runtime import builder, zoo
from tensile_db.runtime.builder import ProgramBuilder, build_training_program
from tensile_db.runtime.device import CpuDevice
from tensile_db.runtime.model import Architecture, Layer, ModelSpec, TrainOptions, parse_architecture
from tensile_db.runtime.program import Kind, Op, Program, Slot, StepContext

SPECS = {
    "clf-relu-dropout-tanh-adam": (
        ModelSpec(Architecture((Layer(16, "relu", 0.2), Layer(8, "tanh"))), 6, 3, "classification"),
        TrainOptions(optimizer="adam")),
    "reg-sigmoid-none-dropout-sgd": (
        ModelSpec(Architecture((Layer(12, "sigmoid"), Layer(6, "none", 0.5))), 5, 1, "regression"),
        TrainOptions(optimizer="sgd")),
    "clf-none-sgd": (
        ModelSpec(Architecture((Layer(10, "none"),)), 4, 2, "classification"),
        TrainOptions(optimizer="sgd", momentum=0.5)),
    "reg-tanh-dropout-adam": (
        ModelSpec(Architecture((Layer(9, "tanh", 0.1), Layer(7, "relu"), Layer(5, "sigmoid", 0.3))), 3, 1,
                  "regression"),
        TrainOptions(optimizer="adam", weight_decay=0.01)),
}
BATCH = 7


@pytest.fixture(params=list(SPECS), ids=list(SPECS))
def program(request) -> tuple[ModelSpec, TrainOptions, Program]:
    spec, options = SPECS[request.param]
    return spec, options, build_training_program(spec, options, BATCH)


# --- the access sequence -------------------------------------------------------------------------


def test_every_read_was_written_earlier_or_is_persistent(program):
    _, _, prog = program
    written: set[str] = set()
    for op in prog.ops:
        for name in op.reads:
            assert name in prog.slots, f"{op.name} reads unknown slot {name}"
            assert prog.slots[name].kind.persistent or name in written, \
                f"{op.name} reads {name} before any op writes it"
        for name in op.writes:
            assert name in prog.slots
        written.update(op.writes)
    # every non-persistent slot is produced by some op; persistent ones are updated by the optimizer
    for name, slot in prog.slots.items():
        assert name in written, f"slot {name} is never written"


def test_frees_after_once_and_after_last_access(program):
    _, _, prog = program
    freed_at: dict[str, int] = {}
    for i, names in enumerate(prog.frees_after):
        for name in names:
            assert name not in freed_at, f"{name} freed twice"
            freed_at[name] = i
    non_persistent = {n for n, s in prog.slots.items() if not s.kind.persistent}
    assert set(freed_at) == non_persistent
    for i, op in enumerate(prog.ops):
        for name in op.accesses:
            if name in freed_at:
                assert i <= freed_at[name], f"{op.name} accesses {name} after it was freed"
    for name, i in freed_at.items():                     # freed exactly at the last access
        assert name in prog.ops[i].accesses


def test_positions_match_ops(program):
    _, _, prog = program
    for name, pos in prog.positions.items():
        assert pos == sorted(pos) and pos
        assert pos == [i for i, op in enumerate(prog.ops) if name in op.accesses]


def test_next_use(program):
    _, _, prog = program
    n = len(prog.ops)
    for name, slot in prog.slots.items():
        pos = set(prog.positions[name])
        for position in range(-1, n):
            got = prog.next_use(name, position)
            later = [p - position for p in pos if p > position]
            if later:
                assert got == min(later)
            elif slot.kind.persistent:                   # wraps into the next iteration
                assert got == min(pos) + n - position
                assert (position + got) % n in pos
            else:
                assert got == 2 * n
            assert got > 0


def test_structure_follows_the_spec(program):
    spec, options, prog = program
    names = [op.name for op in prog.ops]
    assert names[0] == "load_batch"
    for i, layer in enumerate(spec.architecture.layers):
        has_activation = layer.activation != "none"
        assert (f"{layer.activation}{i}" in names) == has_activation
        assert (f"{layer.activation}{i}_backward" in names) == has_activation
        assert (f"dropout{i}" in names) == bool(layer.dropout)
        assert (f"dropout{i}_backward" in names) == bool(layer.dropout)
    n_dense = len(spec.architecture.layers) + 1
    steps = [[f"params{i}"] if f"params{i}" in prog.slots else [f"W{i}", f"b{i}"] for i in range(n_dense)]
    steps = [p for node in steps for p in node]     # a dense layer's joined W and b take one step
    assert names[-len(steps):] == [f"{options.optimizer}_{p}" for p in steps]
    persistent = {n for n, s in prog.slots.items() if s.kind.persistent}
    per_param = 2 if options.optimizer == "adam" else 1
    assert len(persistent) == len(steps) * (1 + per_param)
    assert prog.slots["y"].dtype == ("int32" if spec.task == "classification" else "float32")
    assert prog.slots["x"].shape == (BATCH, spec.n_features)


def _separate(spec: ModelSpec, options: TrainOptions, batch: int = BATCH) -> Program:
    """The program with one slot per parameter (no node's parameters joined)."""
    return ProgramBuilder(spec, options, batch).program()


def test_joining_a_node_s_parameters_never_raises_the_largest_working_set(program):
    spec, options, prog = program
    separate = _separate(spec, options)
    assert prog.min_working_set_nbytes <= separate.min_working_set_nbytes
    assert prog.vanilla_peak_nbytes() <= separate.vanilla_peak_nbytes() + UNIT_NBYTES * len(prog.ops)
    for name, (slot, start, shape) in prog.members.items():        # the parameters, one after another
        assert prog.slots[slot].kind is Kind.WEIGHT and name in separate.slots
        assert separate.slots[name].shape == shape and start + math.prod(shape) <= prog.slots[slot].shape[0]


def test_a_node_s_parameters_are_joined_unless_that_raises_the_largest_working_set():
    # the bench's MLP: its largest op is the backward of the 512 x 512 layer (its Adam step runs in
    # sub-groups), which would hold the layer's bias and its gradient too: that layer keeps its
    # slots, the others are joined
    mlp = ModelSpec(Architecture((Layer(512, "relu"), Layer(512, "relu"), Layer(256, "relu"))), 64, 10,
                    "classification")
    options = TrainOptions(optimizer="adam")
    prog, separate = build_training_program(mlp, options, 128), _separate(mlp, options, 128)
    assert separate.ops[max(range(len(separate.ops)), key=separate.working_set_nbytes)].name == "dense1_backward"
    assert [op.name for op in prog.ops if op.unit == "optimizer"] == \
        ["adam_params0", "adam_W1.0", "adam_W1.1", "adam_W1.2", "adam_b1", "adam_params2", "adam_params3"]
    assert {"dparams0", "adam_v_params3"} <= set(prog.slots) and not {"W0", "dW2", "adam_m_b3"} & set(prog.slots)
    assert prog.min_working_set_nbytes == separate.min_working_set_nbytes
    # a narrow net whose largest op is a layer's backward, which reads the weight but not the bias
    narrow = ModelSpec(Architecture((Layer(96, "relu", 0.2), Layer(64, "tanh"), Layer(48, "relu"))), 16, 4,
                       "classification")
    prog, separate = build_training_program(narrow, options, 64), _separate(narrow, options, 64)
    assert separate.ops[max(range(len(separate.ops)), key=separate.working_set_nbytes)].name == "dense1_backward"
    assert {"W1", "b1", "dW1", "db1", "params0", "params2", "params3"} <= set(prog.slots)
    assert prog.min_working_set_nbytes == separate.min_working_set_nbytes


#: a network of every layer kind with parameters: a convolution without bias and one with, batch and
#: layer normalisation, a residual block, a concatenation, dense with dropout
IMAGES = ModelSpec.parse({"input": {"shape": [3, 8, 8]}, "layers": [
    {"conv": 4, "kernel": 3, "padding": 1, "bias": False, "activation": "none"}, {"batch_norm": {}, "activation": "relu"},
    {"residual": [{"conv": 4, "padding": 1}, {"conv": 4, "padding": 1, "activation": "none"}], "activation": "relu"},
    {"layer_norm": {}}, {"max_pool": 2}, {"concat": [[], [{"conv": 2, "kernel": 1}]]},
    {"conv": 8, "padding": 1}, {"global_avg_pool": {}}, {"dense": 16, "dropout": 0.3}]}, 3 * 8 * 8, 5, "classification")


def _trained(spec: ModelSpec, prog: Program, weights: dict, batch: int) -> dict[str, np.ndarray]:
    """``weights`` after two training steps of ``prog`` on one batch of ``spec``'s rows, by name."""
    x, y = batch_of(spec, batch, seed=6)
    arrays = allocate(prog, weights, np.float32)
    for step in (1, 2):
        ctx = StepContext(HostDevice(), step=step, seed=3 + step, batch_x=x.astype(np.float32), batch_y=y)
        for op in prog.ops:
            op.run(arrays, ctx)
    views = member_views(prog, arrays)
    return {w: (views[w] if w in views else arrays[w]).copy() for w in weights}


@pytest.mark.parametrize("name", [*SPECS, "images-adam", "images-sgd"])
def test_joined_parameters_train_bit_for_bit_as_separate_ones(name):
    spec, options = SPECS[name] if name in SPECS else \
        (IMAGES, TrainOptions(optimizer=name.split("-")[1], lr=0.01, weight_decay=0.01))
    weights = spec.network.init_weights(5)
    joined = build_training_program(spec, options, BATCH)
    assert joined.members                               # some node's parameters are one slot
    values = [_trained(spec, prog, weights, BATCH) for prog in (joined, _separate(spec, options))]
    assert values[0].keys() == values[1].keys()
    for w in weights:
        np.testing.assert_array_equal(values[0][w], values[1][w])
        assert not np.array_equal(values[0][w], weights[w]) or w.startswith(("rm", "rv"))   # trained


#: the bench's MLP: one Adam step of its 512 x 512 layer would hold 4 MiB (the weight, its gradient
#: and two moments), more than any op of the forward and backward passes
MLP = ModelSpec(Architecture((Layer(512, "relu"), Layer(512, "relu"), Layer(256, "relu"))), 64, 10, "classification")


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "NumPy's passes"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_an_optimizer_step_in_sub_groups_trains_bit_for_bit_as_one_step(optimizer, fused, monkeypatch):
    monkeypatch.setenv("TENSILE_FUSED", fused)            # the fused step, or the passes CuPy runs too
    options = TrainOptions(optimizer=optimizer, lr=0.01, weight_decay=0.01)
    grouped = build_training_program(MLP, options, 128)
    monkeypatch.setattr(builder, "MAX_SUBGROUPS", 1)
    whole = build_training_program(MLP, options, 128)
    first = min(i for i, op in enumerate(grouped.ops) if op.unit == "optimizer")
    passes = max(grouped.working_set_nbytes(i) for i in range(first))         # forward and backward
    steps = [i for i, op in enumerate(grouped.ops) if op.name.startswith(f"{options.optimizer}_W1.")]
    assert len(steps) > 1 and grouped.min_working_set_nbytes == passes < whole.min_working_set_nbytes
    assert all(grouped.working_set_nbytes(i) <= passes for i in steps)
    one = next(op for op in whole.ops if op.name == f"{options.optimizer}_W1")     # the same cost, in parts
    assert sum(grouped.ops[i].flops for i in steps) == one.flops
    assert sum(grouped.ops[i].nbytes for i in steps) == one.nbytes
    state = [s for s in grouped.slots.values() if s.kind is Kind.OPTIMIZER_STATE and "W1." in s.name]
    assert sum(s.nbytes for s in state) == sum(s.nbytes for s in whole.slots.values()
                                               if s.kind is Kind.OPTIMIZER_STATE and s.name.endswith("_W1"))
    weights = MLP.network.init_weights(5)
    values = [_trained(MLP, prog, weights, 128) for prog in (grouped, whole)]
    for w in weights:
        np.testing.assert_array_equal(values[0][w], values[1][w])
        assert not np.array_equal(values[0][w], weights[w])                     # trained


def test_a_step_within_the_passes_stays_whole(program):
    _, _, prog = program
    steps = [i for i, op in enumerate(prog.ops) if op.unit == "optimizer"]
    passes = max(prog.working_set_nbytes(i) for i in range(steps[0]))
    assert all(prog.working_set_nbytes(i) <= passes and "." not in prog.ops[i].name for i in steps)


def _recomputed_peak(prog: Program) -> int:
    live = {n for n, s in prog.slots.items() if s.kind.persistent}
    peak = 0
    for i, op in enumerate(prog.ops):
        live.update(op.writes)
        peak = max(peak, sum(round_up(prog.slots[n].nbytes) for n in live))
        live.difference_update(prog.frees_after[i])
    return peak


def test_peak_and_working_set(program):
    _, _, prog = program
    vanilla = prog.vanilla_peak_nbytes()
    assert vanilla == _recomputed_peak(prog)
    assert vanilla % UNIT_NBYTES == 0
    assert prog.persistent_nbytes < vanilla
    ws = [sum(round_up(prog.slots[s].nbytes) for s in set(op.reads + op.writes)) for op in prog.ops]
    assert prog.min_working_set_nbytes == max(ws)
    assert prog.min_working_set_nbytes <= vanilla


def test_unaccessed_slot_is_rejected():
    slots = {"a": Slot("a", Kind.INPUT, (2,)), "b": Slot("b", Kind.ACTIVATION, (2,))}
    with pytest.raises(ValueError, match="never accessed"):
        Program(slots, [])
    with pytest.raises(ValueError, match="'b'"):
        Program(slots, [Op("load", (), ("a",), lambda a, ctx: None)])


# --- the skeleton --------------------------------------------------------------------------------

SMALL_CNN = ModelSpec(parse_architecture({"input": {"shape": [3, 8, 8]}, "layers": [
    {"conv": 4, "padding": 1}, {"batch_norm": {}, "activation": "relu"}, {"max_pool": 2},
    {"residual": [{"conv": 4, "padding": 1}, {"batch_norm": {}}], "activation": "relu"},
    {"concat": [[], [{"conv": 2, "kernel": 1}]]}, {"global_avg_pool": {}}, {"dense": 8, "dropout": 0.2}]}),
    192, 3, "classification")
#: named networks at small inputs, an eighth of their width: (model, square input side)
NAMED_SMALL = {"vgg16": 32, "resnet50": 32, "inception_v3": 75, "densenet121": 32}


def _named_spec(name: str) -> ModelSpec:
    side = NAMED_SMALL[name]
    return ModelSpec(parse_architecture({"model": name, "width": 0.125, "input": {"shape": [3, side, side]}}),
                     3 * side * side, 5, "classification")


SKELETON_SPECS = {**{name: spec for name, (spec, _) in SPECS.items()}, "small-cnn": SMALL_CNN,
                  **{name: _named_spec(name) for name in NAMED_SMALL}}


def test_every_named_network_has_a_skeleton_case():
    assert set(NAMED_SMALL) == set(zoo.NAMED)


def _op_fields(op: Op | None):
    if op is None:
        return None
    return op.name, op.reads, op.writes, op.flops, op.nbytes, op.unit, _op_fields(op.replay)


def _planner_answers(prog: Program) -> dict:
    """Everything a planner asks of a program, as plain values."""
    n = len(prog.ops)
    recipes = {name: prog.recipe(name) for name in prog.slots}
    return {
        "slots": prog.slots,
        "ops": [_op_fields(op) for op in prog.ops],
        "replay": [_op_fields(prog.replay(i)) for i in range(n)],
        "positions": prog.positions,
        "frees_after": prog.frees_after,
        "recipes": recipes,
        "recipe_inputs": {name: prog.recipe_inputs_of(r, name) for name, r in recipes.items() if r},
        "recipe_workspace": {name: prog.recipe_workspace_nbytes(r) for name, r in recipes.items() if r},
        "working_sets": [prog.working_set_nbytes(i) for i in range(n)],
        "min_working_set": prog.min_working_set_nbytes,
        "persistent": prog.persistent_nbytes,
        "vanilla_peak": prog.vanilla_peak_nbytes(),
        "next_use": {(name, p): prog.next_use(name, p) for name, pos in prog.positions.items()
                     for p in {-1, n - 1, *pos, *(q + 1 for q in pos if q + 1 < n)}},
    }


@pytest.mark.parametrize("name", list(SKELETON_SPECS))
def test_skeleton_answers_as_the_program_does(name):
    prog = build_training_program(SKELETON_SPECS[name], TrainOptions(optimizer="adam"), 2)
    skeleton = prog.skeleton()
    assert skeleton is prog.skeleton() and skeleton.skeleton() is skeleton        # made once
    assert all(op.run is None and (op.replay is None or op.replay.run is None) for op in skeleton.ops)
    assert any(op.replay is not None for op in prog.ops) == (name not in SPECS and name != "vgg16")
    expected = _planner_answers(prog)
    assert expected["recipe_inputs"]                   # something to compare: some slot recomputes
    assert _planner_answers(skeleton) == expected
    assert _planner_answers(pickle.loads(pickle.dumps(skeleton))) == expected   # as a planning process sees it


def test_skeleton_does_not_run_and_a_program_does_not_pickle():
    spec, options = SPECS["clf-none-sgd"]
    prog = build_training_program(spec, options, BATCH)
    with pytest.raises(InvalidArgument, match="op 'load_batch' has no kernel.*skeleton"):
        CpuDevice().execute(prog.skeleton().ops[0], {}, None)
    with pytest.raises(TypeError, match="send its skeleton"):
        pickle.dumps(prog)


# --- training under a budget ---------------------------------------------------------------------


def _data(spec: ModelSpec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, spec.n_features)).astype(np.float32) * 3 + 1
    w = rng.standard_normal((spec.n_features, max(spec.n_outputs, 1)))
    if spec.task == "classification":
        y = np.argmax(x @ w, axis=1).astype(np.int32)
    else:
        y = (x @ w[:, 0] + 0.1 * rng.standard_normal(n)).astype(np.float32)
    return x, y


def _job(spec: ModelSpec, options: TrainOptions, seed: int = 0, n: int = 192) -> TrainingJob:
    x, y = _data(spec, n, seed)
    return TrainingJob(JobInfo(0, "tester", f"m{seed}"), spec, options, x, y)


TRAIN_SPEC = ModelSpec(Architecture((Layer(64, "relu", 0.1), Layer(32, "tanh"))), 20, 3, "classification")
TRAIN_OPTIONS = TrainOptions(epochs=3, batch_size=32, optimizer="adam", lr=0.01, seed=7)


def _run(jobs: list[TrainingJob], budget_nbytes: int) -> MemoryManager:
    """Run ``jobs`` concurrently on a fresh CPU manager of ``budget_nbytes``; wait for all."""
    mm = MemoryManager(CpuDevice(), budget_nbytes)
    executor = Executor(mm)
    executor.start()
    for job in jobs:
        executor.submit(job)
    for job in jobs:
        progress = []
        while True:
            kind, payload = job.events.get(timeout=60)
            if kind == "progress":
                progress.append(payload)
                continue
            assert kind == "done", f"job {job.id} failed: {payload!r}"
            break
        assert job.state is JobState.DONE and job.error is None
        assert [p["epoch"] for p in progress] == list(range(1, job.options.epochs + 1))
        assert all(np.isfinite(p["loss"]) for p in progress)
    with pytest.raises(queue.Empty):
        jobs[0].events.get_nowait()
    assert mm.in_use_nbytes == 0 and not mm.jobs         # everything released
    return mm


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{k} differs"


def test_unlimited_budget_peak_equals_vanilla_peak():
    job = _job(TRAIN_SPEC, TRAIN_OPTIONS)
    mm = _run([job], 64 * job.vanilla_peak_nbytes)
    assert mm.peak_nbytes == job.vanilla_peak_nbytes
    assert job.memory.swap_outs == 0 and job.memory.swap_ins == 0


@pytest.mark.parametrize("spec, options", [
    (TRAIN_SPEC, TRAIN_OPTIONS),
    (ModelSpec(Architecture((Layer(48, "sigmoid", 0.3), Layer(24, "none"))), 12, 1, "regression"),
     TrainOptions(epochs=2, batch_size=24, optimizer="sgd", seed=3)),
], ids=["classification-adam", "regression-sgd"])
def test_tight_budget_gives_bit_identical_weights(spec, options):
    free_job = _job(spec, options)
    _run([free_job], 64 * free_job.vanilla_peak_nbytes)

    tight_job = _job(spec, options)
    budget = max(tight_job.min_working_set_nbytes, int(0.45 * tight_job.vanilla_peak_nbytes))
    budget = -(-budget // UNIT_NBYTES) * UNIT_NBYTES
    assert budget < tight_job.vanilla_peak_nbytes
    mm = _run([tight_job], budget)

    mem = tight_job.memory
    assert mem.swap_outs > 0 and mem.swapped_out_nbytes > 0
    assert mem.swap_ins > 0 and mem.swapped_in_nbytes > 0
    assert mm.peak_nbytes <= budget
    assert mem.peak_nbytes <= budget
    assert free_job.memory.swap_outs == 0
    _assert_same_weights(free_job.result, tight_job.result)
    assert free_job.loss == tight_job.loss


def test_concurrent_jobs_under_shared_budget():
    variants = [
        (TRAIN_SPEC, TRAIN_OPTIONS, 1),
        (ModelSpec(Architecture((Layer(40, "tanh"),)), 10, 1, "regression"),
         TrainOptions(epochs=2, batch_size=16, optimizer="sgd", seed=2), 2),
        (ModelSpec(Architecture((Layer(32, "sigmoid", 0.2), Layer(16, "relu"))), 8, 4, "classification"),
         TrainOptions(epochs=2, batch_size=20, optimizer="adam", seed=5), 3),
    ]
    solo = []
    for spec, options, seed in variants:
        job = _job(spec, options, seed)
        _run([job], 64 * job.vanilla_peak_nbytes)
        solo.append(job)

    jobs = [_job(spec, options, seed) for spec, options, seed in variants]
    total = sum(j.vanilla_peak_nbytes for j in jobs)
    budget = max(max(j.min_working_set_nbytes for j in jobs), total // 2)
    budget = -(-budget // UNIT_NBYTES) * UNIT_NBYTES
    assert budget < total
    mm = _run(jobs, budget)
    assert mm.peak_nbytes <= budget
    assert sum(j.memory.swapped_out_nbytes for j in jobs) > 0
    for alone, shared in zip(solo, jobs):
        _assert_same_weights(alone.result, shared.result)


def test_submit_refuses_a_job_whose_working_set_exceeds_the_budget():
    job = _job(TRAIN_SPEC, TRAIN_OPTIONS)
    budget = job.min_working_set_nbytes - UNIT_NBYTES
    executor = Executor(MemoryManager(CpuDevice(), budget))
    with pytest.raises(DeviceOutOfMemory) as info:
        executor.submit(job)
    assert info.value.requested_nbytes == job.min_working_set_nbytes
    assert f"{job.min_working_set_nbytes:,}" in str(info.value)
    assert not executor.queued and job.state is JobState.QUEUED


def test_recipes_read_only_slots_that_outlive_the_target():
    spec = ModelSpec(Architecture((Layer(12, "none", 0.5), Layer(10, "relu", 0.2), Layer(8, "tanh"))), 6, 3,
                     "classification")
    prog = build_training_program(spec, TrainOptions(), 5)
    recipes = {name: prog.recipe(name) for name in prog.slots}
    assert recipes["d0"] is None                     # h0 (no activation) dies at dropout0
    assert recipes["h1"] is not None and recipes["mask0"] is not None and recipes["d1"] is not None
    assert recipes["probs"] is None and recipes["x"] is None
    assert all(recipes[s] is None for s, slot in prog.slots.items() if slot.kind is Kind.WEIGHT)
    for name, recipe in recipes.items():
        if recipe is None:
            continue
        last = prog.positions[name][-1]
        for s in prog.recipe_inputs_of(recipe, name):
            assert prog.slots[s].kind.persistent or prog.positions[s][-1] >= last
            assert not any(s in prog.ops[p].writes for p in range(recipe[-1] + 1, last + 1))
