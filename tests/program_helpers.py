"""Shared set-up of the tests that run a training program's ops directly on NumPy arrays, without
the executor: a host "device", arrays for every slot, a random batch, one forward and backward
pass, and the check that every recomputable slot recomputes bit for bit."""

from __future__ import annotations

import numpy as np

from tensile_db.runtime.model import ModelSpec
from tensile_db.runtime.program import Kind, Program, StepContext


class HostDevice:
    """What the ops ask of a device, on plain NumPy arrays of any float dtype."""

    def to_device(self, host, array) -> None:
        array[...] = host

    def uniform(self, seed: int, out) -> None:
        np.random.Generator(np.random.Philox(seed)).random(out=out, dtype=out.dtype)


def allocate(prog: Program, weights: dict, dtype) -> dict[str, np.ndarray]:
    """An array per slot, float32 slots in ``dtype``: the weights given (a node's joined
    parameters filled from theirs), zero optimizer state, NaN elsewhere (so that reading what no
    op wrote shows)."""
    arrays = {}
    for name, slot in prog.slots.items():
        dt = np.dtype(dtype if slot.dtype == "float32" else slot.dtype)
        if name in weights:
            arrays[name] = weights[name].astype(dt)
        elif slot.kind.persistent or dt.kind != "f":
            arrays[name] = np.zeros(slot.shape, dt)
        else:
            arrays[name] = np.full(slot.shape, np.nan, dt)
    for name, view in member_views(prog, arrays).items():
        if name in weights:
            view[...] = weights[name]
    return arrays


def member_views(prog: Program, arrays: dict) -> dict[str, np.ndarray]:
    """Each weight held in a node's joined slot, as a view of that slot's array in ``arrays``."""
    return {name: arrays[slot][start:start + int(np.prod(shape))].reshape(shape)
            for name, (slot, start, shape) in prog.members.items()}


def first_optimizer_op(spec: ModelSpec, prog: Program) -> int:
    return next(i for i, op in enumerate(prog.ops) if op.unit == "optimizer")


def batch_of(spec: ModelSpec, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, spec.n_features))
    if spec.task == "classification":
        return x, rng.integers(0, spec.n_outputs, rows).astype(np.int32)
    return x, rng.normal(size=(rows, spec.n_outputs))


def forward_backward(spec: ModelSpec, prog: Program, weights: dict, x, y, dtype) -> dict[str, np.ndarray]:
    """Every slot's array after the program's ops up to its first optimizer step (the loss and
    every gradient written), run once in ``dtype`` on the batch ``x``, ``y``."""
    arrays = allocate(prog, weights, dtype)
    ctx = StepContext(HostDevice(), step=1, seed=11, batch_x=x.astype(dtype), batch_y=y)
    for op in prog.ops[:first_optimizer_op(spec, prog)]:
        op.run(arrays, ctx)
    return arrays


def recompute_each_at_its_last_access(spec: ModelSpec, prog: Program, rows: int) -> set[str]:
    """Run one iteration in float32; at each recomputable slot's last access, recompute it by its
    recipe's replays into a copy whose slot (and workspaces) are NaN, and assert that it comes
    out bit-identical and that nothing else was written. Returns the names of the ops replayed."""
    arrays = allocate(prog, spec.network.init_weights(3), np.float32)
    x, y = batch_of(spec, rows, seed=4)
    ctx = StepContext(HostDevice(), step=1, seed=9, batch_x=x.astype(np.float32), batch_y=y)
    recipes = {name: prog.recipe(name) for name in prog.slots}
    at_last = {}
    for name, recipe in recipes.items():
        if recipe is not None:
            at_last.setdefault(prog.positions[name][-1], []).append(name)
    replayed = set()
    for position, op in enumerate(prog.ops):
        for name in at_last.get(position, []):
            before = {k: v.copy() for k, v in arrays.items()}
            trial = dict(arrays)
            trial[name] = np.full_like(arrays[name], np.nan)
            for s, slot in prog.slots.items():                     # a replay allocates its own workspaces
                if slot.kind is Kind.WORKSPACE:
                    trial[s] = np.full_like(arrays[s], np.nan)
            for p in recipes[name]:
                prog.replay(p).run(trial, ctx)
                replayed.add(prog.replay(p).name)
            assert np.array_equal(trial[name], before[name]), f"{name} recomputed differently at op {op.name}"
            for s, value in before.items():                        # nothing else written, running stats included
                assert np.array_equal(arrays[s], value, equal_nan=True), f"recomputing {name} wrote {s}"
        op.run(arrays, ctx)
    assert at_last
    return replayed
