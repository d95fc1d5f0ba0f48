"""The backend's side of a hyperparameter search (``options.search``): the trials to train, the
``search`` request that trains them at once on the coordinator, and what each trial sends back.

Every trial is checked here — its options, its architecture and the limits — before anything
is sent, so a search with one impossible trial fails whole, at once. The coordinator trains the
trials as concurrent jobs under the one device budget (:mod:`tensile_db.coordinator.training`);
the backend relays one NOTICE per trial as it ends (and as halving stops one), and waits in
slices so that a cancel reaches it, which cancels every trial (:func:`.session.await_result`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..errors import InvalidArgument
from ..runtime import model as models
from ..runtime import search as searching
from . import session


@dataclass
class Trial:
    """One trial: its index (0-based), parameter values, architecture and options (JSON objects),
    and once trained, its metrics and weights, or its error."""

    index: int
    params: dict
    architecture: dict
    options: dict
    metrics: dict | None = None
    weights: dict | None = None
    error: str | None = None
    version: object = None                   # once trained: the registry version built from it

    def record(self, search_id: str) -> dict:
        """The version's ``search`` column."""
        return {"search": search_id, "trial": self.index + 1, "params": self.params}


def plan(arch: models.Architecture, opts: models.TrainOptions, limits: models.Limits, n_inputs: int,
         n_outputs: int, task: str, name: str) -> tuple[searching.Search, list[Trial]]:
    """The search ``opts.search`` asks for and its trials, each checked (options, architecture,
    limits). Raises InvalidArgument naming the trial and what is wrong with it."""
    found = searching.parse(opts.search)
    trials, nbytes = [], 0
    for i, params in enumerate(searching.combinations(found, opts.seed)):
        architecture, options = searching.trial_inputs(params, arch.to_json(), opts.to_json())
        try:
            trial_opts = models.parse_options(options)
            spec = models.ModelSpec.parse(architecture, n_inputs, n_outputs, task)
            limits.check(spec, name)
        except InvalidArgument as exc:
            raise InvalidArgument(f"search trial {i + 1} ({json.dumps(params)}): {exc}") from None
        nbytes += searching.weights_nbytes(spec)
        trials.append(Trial(i, params, architecture, trial_opts.to_json()))
    searching.check_weights_nbytes(nbytes, len(trials), limits)
    return found, trials


def run(plpy, GD, client, header: dict, arrays: dict, found: searching.Search, trials: list[Trial],
        name: str, on_trial) -> float:
    """Send the ``search`` request and collect every trial's outcome into ``trials``, handing each
    trained one to ``on_trial(trial)`` as it arrives (which may keep its weights serialized and drop
    the arrays); returns the search's wall time, seconds. Raises what the coordinator sends (the
    connection is shut down, cancelling every trial, on any error or cancel)."""
    request = dict(header, type="search", parallel=found.parallel, halving=found.halving,
                   trials=[{"architecture": t.architecture, "options": t.options, "params": t.params}
                           for t in trials])
    reply, _ = session.request(plpy, GD, client, request, arrays, doing="the start of a search")
    plpy.notice(f"tensile: search of {len(trials)} trials for {name!r} accepted ({found.parallel} at a time"
                f"{', successive halving' if found.halving else ''}); unscheduled peaks "
                f"{', '.join(f'{p:,}' for p in reply['vanilla_peak_nbytes'])} bytes, device budget "
                + ", ".join(f"{b:,} bytes on {d}" for d, b in reply["devices"].items()))

    def on_message(message: dict, weights: dict) -> None:
        if message["type"] == "trial":
            t = trials[message["trial"]]
            t.metrics, t.weights, t.error = message.get("metrics"), weights, message.get("error")
            plpy.notice(f"tensile: trial {t.index + 1}/{len(trials)} {json.dumps(t.params)}: " + (
                f"failed: {t.error}" if t.error else f"{_summary(t.metrics)} (on {t.metrics['device']})"))
            if t.metrics is not None:
                on_trial(t)

    result, _ = session.await_result(plpy, GD, client, "search", on_message)
    return float(result["wall_s"])


def _summary(metrics: dict) -> str:
    score = metrics.get("score")
    shown = f"{metrics.get('score_name', 'score')} {score:.4f}" if isinstance(score, float) else "no held-out score"
    stopped = f", stopped at epoch {metrics['epochs']} ({metrics['stopped']})" if metrics.get("stopped") else ""
    return f"{shown}, {metrics['epochs']} epochs{stopped}"


def new_id() -> str:
    """An id naming one search in its versions' ``search`` column."""
    return uuid.uuid4().hex[:12]
