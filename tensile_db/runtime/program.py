"""Training programs: one iteration of a job as an ordered list of operators over named slots.

A *slot* is a tensor of an iteration (``x``, ``h0``, ``params1`` a node's parameters, ``dparams1``
their gradients, ``W1`` ...) with its kind, shape and dtype. An :class:`Op` names the slots it reads
and writes and carries a ``run`` function that calls the kernels on the slots' arrays
(:mod:`.builder` builds the program of a network). A program's :meth:`~Program.skeleton` is the same
program without the kernels: it pickles, so a planning process (:mod:`tensile_db.scheduler.worker`)
can plan for it. Because a training iteration is static, the program is also the job's **access
sequence** (TENSILE, arXiv 2105.13336, section 3): for each slot the op indices at which it is
accessed, from which lifetimes, next uses and working sets follow exactly, from the very first
iteration.

Lifetimes: a non-persistent slot is allocated by the first op that writes it and freed after its
last access in the iteration; persistent slots (weights and optimizer state) live across
iterations.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

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

    # cached: the planners read them for every candidate they weigh (frozen, so never stale)
    @functools.cached_property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize

    @functools.cached_property
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


#: Classes of kernel, by how they use a GPU: ``conv`` (convolutions), ``matmul`` (dense layers),
#: ``elementwise`` (activations, joins, copies, pooling, normalisation, the loss), ``optimizer``
#: (parameter updates) and ``load`` (a host -> device copy on the compute stream: the batch).
UNITS = ("conv", "matmul", "elementwise", "optimizer", "load")


@dataclass(frozen=True)
class Op:
    """One operator: reads and writes slots by name; ``run(arrays, ctx)`` does the arithmetic
    (None in a program's :meth:`~Program.skeleton`, which only plans). ``replay``, when given, is
    the op a recompute runs instead: it writes only the op's first output, from slots that the op
    saved (batch normalisation replays from its saved batch statistics rather than updating the
    running ones again).

    Its cost, for the simulated device's roofline (:mod:`tensile_db.runtime.simulated`):
    ``flops`` floating-point operations, ``nbytes`` bytes of device memory read plus written
    (workspaces left out: a GPU library's convolution does not stage its im2col matrix in memory),
    and ``unit``, the class of kernel (:data:`UNITS`).
    """

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    run: Callable[[dict, StepContext], None] | None = field(default=None, repr=False, compare=False)
    replay: "Op | None" = field(default=None, repr=False, compare=False)
    flops: int = field(default=0, compare=False)
    nbytes: int = field(default=0, compare=False)
    unit: str = field(default="elementwise", compare=False)

    @functools.cached_property
    def accesses(self) -> tuple[str, ...]:
        """Slots the op touches, each once, reads first (worked out once: the executor asks
        before every op)."""
        return tuple(dict.fromkeys(self.reads + self.writes))


class Program:
    """The ops of one iteration and the slots they touch, with derived lifetimes.

    Attributes:
        slots: name -> Slot.
        ops: the ops in execution order.
        positions: name -> sorted op indices that access the slot (the access sequence).
        frees_after: for each op index, the non-persistent slots whose last access it is.
        members: each weight held within a slot of a node's parameters joined (Note [One tensor
            per node's parameters] in :mod:`.builder`): name -> (slot, first element, shape).
    """

    def __init__(self, slots: dict[str, Slot], ops: list[Op],
                 members: dict[str, tuple[str, int, tuple[int, ...]]] | None = None):
        self.slots = slots
        self.ops = ops
        self.members = members or {}
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
        self._recipes: dict[str, tuple[int, ...] | None] = {}   # recipe(), memoised: a program never changes
        self._skeleton: Program | None = None                     # skeleton(), made once

    def skeleton(self) -> "Program":
        """This program without its kernels: the same slots and ops (names, reads, writes, cost,
        replays) with every ``run`` None, made once. It answers everything a planner asks
        (positions, lifetimes, next uses, recipes, working sets, peaks) as this program does and,
        unlike it, pickles; a device refuses to run its ops."""
        if self._skeleton is None:
            def bare(op: Op | None) -> Op | None:
                return None if op is None else replace(op, run=None, replay=bare(op.replay))

            self._skeleton = Program(dict(self.slots), [bare(op) for op in self.ops], dict(self.members))
            self._skeleton._skeleton = self._skeleton
        return self._skeleton

    def __getstate__(self) -> dict:
        # Pickled whole, derived fields included: unpickling them is four times faster than
        # deriving them again, and a plan's unpickling costs the executor's thread its GIL.
        if any(op.run is not None or (op.replay is not None and op.replay.run is not None) for op in self.ops):
            raise TypeError("a program with kernels does not pickle; send its skeleton() instead")
        return self.__dict__

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

    def replay(self, position: int) -> Op:
        """The op a recompute runs for op ``position``: its replay op, or the op itself."""
        op = self.ops[position]
        return op.replay or op

    def _outputs(self, op: Op) -> tuple[str, ...]:
        return tuple(s for s in op.writes if self.slots[s].kind is not Kind.WORKSPACE)

    def recipe(self, name: str) -> tuple[int, ...] | None:
        """The op indices whose replays (:meth:`replay`) recompute ``name`` exactly, or None if
        it is not recomputable.

        A slot is recomputable when it is an activation whose writers are the first ops that
        access it, each of whose replays writes nothing else but workspaces (a convolution and
        its in-place activation; batch normalisation through its replay), when every slot they
        read lives at least as long as it (persistent, or accessed again no earlier than its last
        access), and when no op after the writers and up to its last access writes any of those
        slots. Re-running the writers in backward then reproduces the value bit for bit: a
        branch's input is still held, so a recipe never needs an op whose inputs are gone.
        """
        if name not in self._recipes:
            self._recipes[name] = self._find_recipe(name)
        return self._recipes[name]

    def _find_recipe(self, name: str) -> tuple[int, ...] | None:
        if self.slots[name].kind is not Kind.ACTIVATION:
            return None
        pos = self.positions[name]
        writers = [p for p in pos if name in self.ops[p].writes]
        if not writers or writers != pos[:len(writers)] or len(writers) == len(pos):
            return None
        if any(self._outputs(self.replay(p)) != (name,) for p in writers):
            return None
        inputs = self.recipe_inputs_of(writers, name)
        if any(not self.slots[s].kind.persistent and self.positions[s][-1] < pos[-1] for s in inputs):
            return None
        for p in range(writers[-1] + 1, pos[-1] + 1):
            if inputs & set(self.ops[p].writes):
                return None
        return tuple(writers)

    def recipe_inputs_of(self, recipe, name: str) -> set[str]:
        """Slots other than ``name`` (and workspaces) that the replays of ``recipe`` read."""
        return {s for p in recipe for s in self.replay(p).reads
                if s != name and self.slots[s].kind is not Kind.WORKSPACE}

    def recipe_workspace_nbytes(self, recipe) -> int:
        """Arena bytes (rounded) the replays of ``recipe`` allocate for workspaces at once, at
        most: each replay takes its own and frees them when it ends."""
        return max((sum(self.slots[s].arena_nbytes for s in self.replay(p).writes
                        if self.slots[s].kind is Kind.WORKSPACE) for p in recipe), default=0)

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
