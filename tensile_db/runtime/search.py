"""Hyperparameter search: which trials a ``search`` option asks for, and when a trial stops.

``options.search`` is ``{"method": "grid" | "random", "params": {name: [values...]},
"trials": N, "parallel": K, "halving": false}``:

- ``grid`` trains every combination of the values (at most ``MAX_TRIALS``; with ``trials``, a
  seeded sample of that many combinations); ``random`` draws ``trials`` (default 8) combinations,
  each value uniformly from its list, seeded by ``options.seed``.
- ``params`` may name the options ``lr``, ``batch_size``, ``epochs``, ``optimizer``,
  ``momentum``, ``weight_decay``, ``seed`` and ``layers`` (each value a whole ``layers`` array of
  the architecture); a trial is the call's options and architecture with its values put in.
- ``parallel`` (default 4): trials trained at the same time, as concurrent jobs under the one
  device budget; the others wait for one to end.
- ``halving``: asynchronous successive halving (ASHA; Li et al., "A System for Massively Parallel
  Hyperparameter Tuning", arXiv 1810.05934) with reduction factor 2: a trial reaching a rung
  (an eighth, a quarter and half of its epochs) goes on only if its held-out loss there is in the
  better half of the losses every trial of as many epochs has reported at that rung so far
  (:class:`Halving`, one per epoch count).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument
from .checks import check_keys, shown

METHODS = ("grid", "random")
#: The options a search may vary, besides the architecture's ``layers``.
OPTION_PARAMS = ("lr", "batch_size", "epochs", "optimizer", "momentum", "weight_decay", "seed")
PARAMS = OPTION_PARAMS + ("layers",)
KEYS = ("method", "params", "trials", "parallel", "halving")
#: Most trials one search trains, and most values one parameter may list.
MAX_TRIALS = 64
DEFAULT_RANDOM_TRIALS = 8
DEFAULT_PARALLEL = 4


@dataclass(frozen=True)
class Search:
    """A parsed ``options.search``."""

    method: str
    params: tuple[tuple[str, tuple], ...]      # (name, its values), in the order given
    trials: int | None
    parallel: int
    halving: bool


def parse(value) -> Search:
    """Validate ``options.search`` (a dict). Raises InvalidArgument naming the key and value.
    The values themselves are checked when the trials' options are (:func:`trials`)."""
    if not isinstance(value, dict):
        raise InvalidArgument(f'options.search must be an object such as {{"method": "grid", "params": {{"lr": '
                              f"[0.001, 0.01]}}}}, got {shown(value)}")
    check_keys(value, KEYS, "options.search")
    method = value.get("method", "grid")
    if method not in METHODS:
        raise InvalidArgument(f"options.search.method must be one of {', '.join(METHODS)}, got {shown(method)}")
    params = value.get("params")
    if not isinstance(params, dict) or not params:
        raise InvalidArgument('options.search.params must be a non-empty object of lists, such as {"lr": [0.001, '
                              f"0.01], \"batch_size\": [32, 128]}}, got {shown(params)}")
    for name, values in params.items():
        if name not in PARAMS:
            raise InvalidArgument(f"options.search.params: unknown parameter {name!r}; a search may vary "
                                  f"{', '.join(PARAMS)}")
        if not isinstance(values, list) or not 1 <= len(values) <= MAX_TRIALS:
            raise InvalidArgument(f'options.search.params."{name}" must be a list of 1 to {MAX_TRIALS} values, got '
                                  f"{shown(values)}")
    trials = value.get("trials")
    if trials is not None and not (_is_int(trials) and 1 <= trials <= MAX_TRIALS):
        raise InvalidArgument(f"options.search.trials must be an integer from 1 to {MAX_TRIALS}, got {shown(trials)}")
    grid = math.prod(len(v) for v in params.values())
    if method == "grid" and trials is None and grid > MAX_TRIALS:
        raise InvalidArgument(f"options.search asks for a grid of {grid:,} trials, more than {MAX_TRIALS}; list fewer "
                              f'values, or sample the grid with "trials": N')
    parallel = value.get("parallel", DEFAULT_PARALLEL)
    if not (_is_int(parallel) and 1 <= parallel <= MAX_TRIALS):
        raise InvalidArgument(f"options.search.parallel must be an integer from 1 to {MAX_TRIALS}, got "
                              f"{shown(parallel)}")
    halving = value.get("halving", False)
    if not isinstance(halving, bool):
        raise InvalidArgument(f"options.search.halving must be true or false, got {shown(halving)}")
    return Search(method, tuple((k, tuple(v)) for k, v in params.items()), trials, parallel, halving)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def combinations(search: Search, seed: int) -> list[dict]:
    """Each trial's parameter values, ``{name: value}``, in trial order."""
    names = [k for k, _ in search.params]
    rng = np.random.default_rng(seed)
    if search.method == "grid":
        grid = [dict(zip(names, combo)) for combo in itertools.product(*(v for _, v in search.params))]
        if search.trials is None or search.trials >= len(grid):
            return grid
        return [grid[i] for i in sorted(rng.choice(len(grid), size=search.trials, replace=False))]
    n = search.trials or DEFAULT_RANDOM_TRIALS
    return [{k: v[int(rng.integers(len(v)))] for k, v in search.params} for _ in range(n)]


def trial_inputs(params: dict, architecture: dict, options: dict) -> tuple[dict, dict]:
    """A trial's architecture and options (JSON objects): the call's, with ``params`` put in and
    ``search`` taken out of the options."""
    options = {k: v for k, v in options.items() if k != "search"}
    options.update((k, v) for k, v in params.items() if k in OPTION_PARAMS)
    if "layers" in params:
        if "model" in architecture:
            raise InvalidArgument("options.search.params.layers replaces the architecture's layers, but the "
                                  f'architecture names the network "{architecture["model"]}"; vary other parameters')
        architecture = dict(architecture, layers=params["layers"])
    return architecture, options


def weights_nbytes(spec) -> int:
    """Bytes of a trained trial's float32 weights (a :class:`.model.ModelSpec`)."""
    return 4 * spec.n_parameters()


def check_weights_nbytes(nbytes: int, trials: int, limits) -> None:
    """Raise InvalidArgument when the weights of all ``trials`` trials, ``nbytes`` together (each
    is held until the search ends), exceed ``limits.max_job_nbytes``."""
    if nbytes > limits.max_job_nbytes:
        raise InvalidArgument(f"the {trials} trials of the search hold {nbytes:,} bytes of weights together, more than "
                              f"tensile.max_job_bytes ({limits.max_job_nbytes:,}); search fewer trials or smaller "
                              "layers, or ask the administrator to raise tensile.max_job_bytes")


def rungs(epochs: int) -> list[int]:
    """The epochs at which halving compares a trial of ``epochs`` epochs: an eighth, a quarter
    and half of them, those from 1 to ``epochs - 1``."""
    return sorted({e for e in (epochs // 8, epochs // 4, epochs // 2) if 1 <= e < epochs})


class Halving:
    """Asynchronous successive halving with reduction factor 2 (ASHA, arXiv 1810.05934, section
    3.2): the held-out losses reported at each rung, and whether a trial reaching one goes on."""

    def __init__(self, epochs: int):
        self.rungs = rungs(epochs)
        self.losses: dict[int, list[float]] = {r: [] for r in self.rungs}

    def keeps(self, epoch: int, loss: float) -> bool:
        """Record a trial's held-out ``loss`` after ``epoch``; False when it is a rung and the loss
        is not in the better half (rounded up) of the losses reported there so far, itself
        included. Epochs that are not rungs always keep the trial."""
        if epoch not in self.losses:
            return True
        seen = self.losses[epoch]
        seen.append(loss)
        better = sum(v < loss for v in seen)
        return better < math.ceil(len(seen) / 2)
