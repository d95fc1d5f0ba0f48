"""Training programs: one iteration of a job as an ordered list of operators over named slots.

A *slot* is a tensor of an iteration (``x``, ``h0``, ``W1``, ``dW1`` ...) with its kind, shape and
dtype. An :class:`Op` names the slots it reads and writes and carries a ``run`` function that calls
the kernels on the slots' arrays. Because a training iteration of an MLP is static, the program is
also the job's **access sequence** (TENSILE, arXiv 2105.13336, section 3): for each slot the op
indices at which it is accessed, from which lifetimes, next uses and working sets follow exactly,
from the very first iteration.

Lifetimes: a non-persistent slot is allocated by the first op that writes it and freed after its
last access in the iteration; persistent slots (weights and optimizer state) live across
iterations.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import kernels
from .model import ModelSpec, TrainOptions
from .units import round_up


class Kind(str, enum.Enum):
    """What a tensor is for; shown in statistics, and persistent kinds live across iterations."""

    INPUT = "input"
    WEIGHT = "weight"
    ACTIVATION = "activation"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    WORKSPACE = "workspace"

    @property
    def persistent(self) -> bool:
        return self in (Kind.WEIGHT, Kind.OPTIMIZER_STATE)


@dataclass(frozen=True)
class Slot:
    """A named tensor of one iteration. ``shape`` in elements, ``nbytes`` in bytes (unrounded)."""

    name: str
    kind: Kind
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def arena_nbytes(self) -> int:
        """Bytes the slot takes in the arena (rounded to the allocation unit)."""
        return round_up(self.nbytes)


@dataclass
class StepContext:
    """What an op may need beyond its tensors: the device, the optimizer step ``t`` (from 1), a
    per-iteration seed for dropout, and the host arrays of the current batch."""

    device: object
    step: int = 0
    seed: int = 0
    batch_x: np.ndarray | None = None
    batch_y: np.ndarray | None = None


@dataclass(frozen=True)
class Op:
    """One operator: reads and writes slots by name; ``run(arrays, ctx)`` does the arithmetic."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    run: Callable[[dict, StepContext], None] = field(repr=False, compare=False)

    @property
    def accesses(self) -> tuple[str, ...]:
        """Slots the op touches, each once, reads first."""
        return tuple(dict.fromkeys(self.reads + self.writes))


class Program:
    """The ops of one iteration and the slots they touch, with derived lifetimes.

    Attributes:
        slots: name -> Slot.
        ops: the ops in execution order.
        positions: name -> sorted op indices that access the slot (the access sequence).
        frees_after: for each op index, the non-persistent slots whose last access it is.
    """

    def __init__(self, slots: dict[str, Slot], ops: list[Op]):
        self.slots = slots
        self.ops = ops
        self.positions: dict[str, list[int]] = {name: [] for name in slots}
        for i, op in enumerate(ops):
            for name in op.accesses:
                self.positions[name].append(i)
        self.frees_after: list[list[str]] = [[] for _ in ops]
        for name, pos in self.positions.items():
            if not pos:
                raise ValueError(f"slot {name!r} is never accessed")
            if not slots[name].kind.persistent:
                self.frees_after[pos[-1]].append(name)

    def next_use(self, name: str, position: int) -> int:
        """Ops from ``position`` (the op just run, or -1 before the first) until the next access
        of ``name``, wrapping into the next iteration; a slot accessed only at ``position`` in a
        non-persistent way is not used again and gets ``len(ops) * 2``."""
        pos = self.positions[name]
        for p in pos:
            if p > position:
                return p - position
        if self.slots[name].kind.persistent:
            return pos[0] + len(self.ops) - position
        return 2 * len(self.ops)

    def recipe(self, name: str) -> tuple[int, ...] | None:
        """The op indices that recompute ``name`` exactly, or None if it is not recomputable.

        A slot is recomputable when it is an activation whose writers are the first ops that
        access it, each writing nothing else (a dense op and its in-place activation), when every
        slot they read lives at least as long as it (persistent, or accessed again no earlier
        than its last access), and when no op after the writers and up to its last access writes
        any of those slots. Re-running
        the writers in backward then reproduces the value bit for bit. Dropout is excluded: it
        writes its mask and output together.
        """
        if self.slots[name].kind is not Kind.ACTIVATION:
            return None
        pos = self.positions[name]
        writers = [p for p in pos if name in self.ops[p].writes]
        if not writers or writers != pos[:len(writers)] or len(writers) == len(pos):
            return None
        if any(self.ops[p].writes != (name,) for p in writers):
            return None
        inputs = self.recipe_inputs_of(writers, name)
        if any(not self.slots[s].kind.persistent and self.positions[s][-1] < pos[-1] for s in inputs):
            return None
        for p in range(writers[-1] + 1, pos[-1] + 1):
            if inputs & set(self.ops[p].writes):
                return None
        return tuple(writers)

    def recipe_inputs_of(self, recipe, name: str) -> set[str]:
        """Slots other than ``name`` that the ops of ``recipe`` read."""
        return {s for p in recipe for s in self.ops[p].reads if s != name}

    def working_set_nbytes(self, i: int) -> int:
        """Arena bytes (rounded) the op ``i`` needs resident at once: its reads and writes."""
        return sum(self.slots[s].arena_nbytes for s in self.ops[i].accesses)

    @property
    def min_working_set_nbytes(self) -> int:
        """Lower bound on the peak: the largest working set of any op, bytes."""
        return max(self.working_set_nbytes(i) for i in range(len(self.ops)))

    @property
    def persistent_nbytes(self) -> int:
        return sum(s.arena_nbytes for s in self.slots.values() if s.kind.persistent)

    def vanilla_peak_nbytes(self) -> int:
        """Peak arena bytes of one steady-state iteration with unlimited memory and no scheduling:
        persistent slots plus the largest sum of live (rounded) slots at any op, bytes. This is the
        allocator's high-water mark of allocated bytes, whatever the offsets."""
        live = self.persistent_nbytes
        peak = live
        for i, op in enumerate(self.ops):
            born = {name for name in op.writes if not self.slots[name].kind.persistent
                    and self.positions[name][0] == i}
            live += sum(self.slots[name].arena_nbytes for name in born)
            peak = max(peak, live)
            live -= sum(self.slots[name].arena_nbytes for name in self.frees_after[i])
        return peak


# --- building the training program of an MLP ---------------------------------------------------


def build_training_program(spec: ModelSpec, options: TrainOptions, batch: int) -> Program:
    """The training iteration of ``spec`` at batch size ``batch``: load the batch, forward, loss,
    backward, and one optimizer step per parameter (after the whole backward pass, as
    ``optimizer.step()`` in PyTorch).

    Activations run in place on the dense output (their backward needs only the output); dropout
    backward runs in place on the incoming gradient; activation backward writes a new gradient
    slot, since its kernels must not overwrite ``dy`` while reading it.
    """
    slots: dict[str, Slot] = {}
    ops: list[Op] = []

    def slot(name, kind, shape, dtype="float32"):
        slots[name] = Slot(name, kind, tuple(int(d) for d in shape), dtype)
        return name

    def op(name, reads, writes, run):
        ops.append(Op(name, tuple(reads), tuple(writes), run))

    classification = spec.task == "classification"
    x = slot("x", Kind.INPUT, (batch, spec.n_features))
    y = slot("y", Kind.INPUT, (batch,) if classification else (batch, spec.n_outputs),
             "int32" if classification else "float32")

    def load(a, ctx):
        ctx.device.to_device(ctx.batch_x, a[x])
        ctx.device.to_device(ctx.batch_y, a[y])

    op("load_batch", (), (x, y), load)

    hidden = spec.architecture.layers
    shapes = spec.dense_shapes()
    n = len(shapes) - 1                       # index of the output layer
    inputs: list[str] = []                    # input slot of each dense layer
    inp = x
    for i, (fan_in, fan_out) in enumerate(shapes):
        w = slot(f"W{i}", Kind.WEIGHT, (fan_in, fan_out))
        b = slot(f"b{i}", Kind.WEIGHT, (fan_out,))
        h = slot(f"h{i}", Kind.ACTIVATION, (batch, fan_out))
        inputs.append(inp)
        op(f"dense{i}", (inp, w, b), (h,),
           lambda a, ctx, inp=inp, w=w, b=b, h=h: kernels.dense_forward(a[inp], a[w], a[b], a[h]))
        inp = h
        if i == n:
            break
        layer = hidden[i]
        if layer.activation != "none":
            fwd = kernels.ACTIVATIONS[layer.activation][0]
            op(f"{layer.activation}{i}", (h,), (h,), lambda a, ctx, h=h, fwd=fwd: fwd(a[h], a[h]))
        if layer.dropout:
            mask = slot(f"mask{i}", Kind.ACTIVATION, (batch, fan_out))
            d = slot(f"d{i}", Kind.ACTIVATION, (batch, fan_out))

            def dropout_mask(a, ctx, i=i, mask=mask, p=layer.dropout):
                ctx.device.uniform(ctx.seed * 4099 + i, a[mask])
                kernels.dropout_mask(a[mask], p, a[mask])

            # The mask is its own op, a function of the iteration's seed only, so a dropped mask
            # (and a dropped dropout output) is recomputed exactly from the same random stream.
            op(f"dropout_mask{i}", (), (mask,), dropout_mask)
            op(f"dropout{i}", (h, mask), (d,),
               lambda a, ctx, h=h, mask=mask, d=d: kernels.dropout_forward(a[h], a[mask], a[d]))
            inp = d

    # Backward. g{i} is dL/d(output of hidden layer i) (after dropout), gz{i} is dL/d(dense i's
    # output) (before the activation); without an activation they are one slot.
    def gz_name(i):
        return f"g{i}" if i < n and hidden[i].activation == "none" else f"gz{i}"

    logits = f"h{n}"
    loss = slot("loss", Kind.ACTIVATION, (1,))
    g_out = slot(gz_name(n), Kind.GRADIENT, (batch, spec.n_outputs))
    if classification:
        probs = slot("probs", Kind.ACTIVATION, (batch, spec.n_outputs))
        rowbuf = slot("rowbuf", Kind.WORKSPACE, (batch, 1))
        op("cross_entropy", (logits, y), (probs, rowbuf, loss),
           lambda a, ctx: kernels.softmax_cross_entropy_forward(a[logits], a[y], a[probs], a[rowbuf], a[loss]))
        op("cross_entropy_backward", (probs, y), (g_out,),
           lambda a, ctx: kernels.softmax_cross_entropy_backward(a[probs], a[y], a[g_out]))
    else:
        diff = slot("diff", Kind.ACTIVATION, (batch, spec.n_outputs))
        op("mse", (logits, y), (diff, loss), lambda a, ctx: kernels.mse_forward(a[logits], a[y], a[diff], a[loss]))
        op("mse_backward", (diff,), (g_out,), lambda a, ctx: kernels.mse_backward(a[diff], a[g_out]))

    for i in range(n, -1, -1):
        fan_in, fan_out = shapes[i]
        w, gz = f"W{i}", gz_name(i)
        dw = slot(f"dW{i}", Kind.GRADIENT, (fan_in, fan_out))
        db = slot(f"db{i}", Kind.GRADIENT, (fan_out,))
        g_prev = slot(f"g{i - 1}", Kind.GRADIENT, (batch, fan_in)) if i else None
        op(f"dense{i}_backward", (inputs[i], w, gz), (dw, db) + ((g_prev,) if g_prev else ()),
           lambda a, ctx, inp=inputs[i], w=w, gz=gz, dw=dw, db=db, gp=g_prev:
           kernels.dense_backward(a[inp], a[w], a[gz], a[gp] if gp else None, a[dw], a[db]))
        if i == 0:
            break
        layer = hidden[i - 1]
        if layer.dropout:
            mask = f"mask{i - 1}"
            op(f"dropout{i - 1}_backward", (mask, g_prev), (g_prev,),
               lambda a, ctx, mask=mask, gp=g_prev: kernels.dropout_backward(a[mask], a[gp], a[gp]))
        if layer.activation != "none":
            bwd = kernels.ACTIVATIONS[layer.activation][1]
            h, gz_prev = f"h{i - 1}", slot(gz_name(i - 1), Kind.GRADIENT, (batch, fan_in))
            op(f"{layer.activation}{i - 1}_backward", (h, g_prev), (gz_prev,),
               lambda a, ctx, h=h, gp=g_prev, gzp=gz_prev, bwd=bwd: bwd(a[h], a[gp], a[gzp]))

    _add_optimizer(slot, op, shapes, options)
    return Program(slots, ops)


def _add_optimizer(slot, op, shapes, options: TrainOptions) -> None:
    lr, wd = options.learning_rate, options.weight_decay
    for i, (fan_in, fan_out) in enumerate(shapes):
        for p, shape in ((f"W{i}", (fan_in, fan_out)), (f"b{i}", (fan_out,))):
            grad = f"d{p}"
            if options.optimizer == "adam":
                m = slot(f"adam_m_{p}", Kind.OPTIMIZER_STATE, shape)
                v = slot(f"adam_v_{p}", Kind.OPTIMIZER_STATE, shape)
                op(f"adam_{p}", (p, grad, m, v), (p, grad, m, v),
                   lambda a, ctx, p=p, grad=grad, m=m, v=v: kernels.adam_update(
                       a[p], a[grad], a[m], a[v], lr, 0.9, 0.999, 1e-8, ctx.step, wd))
            else:
                vel = slot(f"sgd_velocity_{p}", Kind.OPTIMIZER_STATE, shape)
                op(f"sgd_{p}", (p, grad, vel), (p, grad, vel),
                   lambda a, ctx, p=p, grad=grad, vel=vel: kernels.sgd_update(
                       a[p], a[grad], a[vel], lr, options.momentum, wd))
