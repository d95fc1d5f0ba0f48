"""Dynamic Tensor Rematerialization, the policy ``dtr``: no plan; when an allocation does not fit,
evict the resident tensor of least h, and recompute a dropped tensor when an op next reads it.

Kirisame, Lyubomirsky, Haan, Brennan, He, Roesch, Chen and Tatlock, "Dynamic Tensor
Rematerialization", ICLR 2021 (arXiv 2006.09616). DTR checkpoints online and greedily: it knows
no future and makes no plan; when memory runs out it evicts the tensor of least

    h(t) = c(t) / (m(t) x s(t))

with ``c`` the seconds it takes to get the tensor back, ``m`` its bytes and ``s`` its staleness,
the time since its last access; an evicted tensor is recomputed, recursively, when it is read.

What is taken, and where it lives here:

- h with the *local* cost, the paper's h_DTR^local: ``c`` is the tensor's own recompute cost,
  the sum of the measured seconds of the ops of its recipe
  (:meth:`~tensile_db.runtime.program.Program.recipe`, timed in the job's access sequence,
  :attr:`~.trace.AccessSequence.times_s`; an op not measured yet counts as the job's mean
  measured op, or :data:`FALLBACK_OP_S` before any). ``m`` is its arena bytes; ``s`` the device
  clock (``Device.now()``, virtual on ``sim``) since the memory manager registered it or last
  handed it to an op (:attr:`~tensile_db.memory.tensors.Tensor.accessed_s`), plus
  :data:`STALENESS_EPSILON_S`.
- Rematerialisation on access, recursively, with the arguments of an op being rematerialised
  locked: the job recomputes a dropped input before its op (``TrainingJob._recompute``), and the
  memory manager's ``keep`` holds the values of the op's inputs and of the tensor being
  recomputed, so no eviction in between drops them.
- The memory manager does the moving (Note [Eviction order] in
  :mod:`tensile_db.memory.eviction`): this module only ranks (:meth:`Rematerialization.__call__`,
  the manager's ``next_use``) and says drop or copy out (:meth:`Rematerialization.drops`, its
  ``droppable``).

What is extended: DTR evicts only tensors it can recompute, on a device with no host tier. Here a
tensor is dropped only when it has an exact recipe (an activation whose writer ops reproduce it
bit for bit from inputs that outlive it) and its job has run every writer of that recipe in the
current iteration, so it is complete: never between a convolution and its in-place activation.
Any other tensor (weights, optimizer state, gradients, activations without a recipe, other
callers' tensors) is copied out as under ``reactive``, with ``c`` its swap-out plus swap-in
seconds from the cost model (the host tier's: which tier a copy gets is decided as it is made).

What is left out: the full h_DTR, whose cost adds the costs of the evicted tensors a recompute
would have to recompute first (its evicted neighbourhood), and the union-find approximation of
it, h_DTR^eq; banishing (freeing for good a tensor no later op can need); ranking a random sample
of the candidates (every resident, unpinned tensor is ranked); and recomputing ops other than
the recipes' (DTR may replay any op; an activation without an exact recipe is copied out).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .cost import CostModel
from .reactive import FarthestNextUse
from .trace import AccessSequence

#: seconds added to every staleness, so that a tensor accessed just now divides by no zero
STALENESS_EPSILON_S = 1e-6
#: seconds an op counts for in a recompute cost before any op of its job has been measured
FALLBACK_OP_S = 1e-3


class Rematerialization:
    """DTR's eviction order. ``policy(tensor) -> float`` is minus the tensor's h (the memory
    manager evicts the highest first, so the least h first); :meth:`drops` says whether its
    eviction drops it (recompute) or copies it out (swap).

    Args:
        positions: where every running job is in its iteration (the scheduler's
            :class:`~.reactive.FarthestNextUse`, which follows them all).
        sequences: job id -> its access sequence (the scheduler's dict, read as it changes).
        cost: the cost model: the seconds of a swap.
        clock: the device's clock (``Device.now``), seconds.

    The manager calls it under its lock, in whichever thread needs the memory; it reads the
    scheduler's records without a lock, as :class:`~.reactive.FarthestNextUse` does (an entry is
    replaced whole, and an op time is one float).
    """

    def __init__(self, positions: FarthestNextUse, sequences: dict[int, AccessSequence], cost: CostModel,
                 clock: Callable[[], float]):
        self._positions = positions
        self._sequences = sequences
        self._cost = cost
        self._clock = clock

    def __call__(self, tensor) -> float:
        return -self.h(tensor)

    def h(self, tensor) -> float:
        """c / (m x s): the seconds to get ``tensor`` back (its recompute if :meth:`drops`, else
        its swap-out and swap-in) over its arena bytes times its staleness in seconds."""
        recipe = self._complete_recipe(tensor)
        cost_s = self.recompute_s(tensor.job_id, recipe) if recipe is not None else self.swap_s(tensor.nbytes)
        staleness_s = max(self._clock() - tensor.accessed_s, 0.0) + STALENESS_EPSILON_S
        return cost_s / (tensor.arena_nbytes * staleness_s)

    def drops(self, tensor) -> bool:
        """Whether evicting ``tensor`` drops it: it has an exact recipe and its job has run every
        writer of the recipe in the current iteration."""
        return self._complete_recipe(tensor) is not None

    def recompute_s(self, job_id: int, recipe: tuple[int, ...]) -> float:
        """Seconds the replays of the ops ``recipe`` of job ``job_id`` take: their measured
        times; an op not measured yet counts as the job's mean measured op (or
        :data:`FALLBACK_OP_S`)."""
        times = self._sequences[job_id].times_s
        mine = times[list(recipe)]
        if np.isnan(mine).any():
            known = times[~np.isnan(times)]
            mine = np.where(np.isnan(mine), known.mean() if known.size else FALLBACK_OP_S, mine)
        return float(mine.sum())

    def swap_s(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` out and back in (the host tier), and to issue both (Note
        [Issue cost] in :mod:`~tensile_db.scheduler.cost`)."""
        return self._cost.swap_out_s(nbytes) + self._cost.swap_in_s(nbytes) + 2 * self._cost.issue_s

    def _complete_recipe(self, tensor) -> tuple[int, ...] | None:
        """The recipe of ``tensor`` if it is droppable (see :meth:`drops`), else None."""
        sequence = self._sequences.get(tensor.job_id)
        if sequence is None or tensor.readonly or tensor.slot not in sequence.program.slots:
            return None
        recipe = sequence.program.recipe(tensor.slot)
        position = self._positions.position(tensor.job_id)
        if recipe is None or position is None or position < recipe[-1]:
            return None
        return recipe
