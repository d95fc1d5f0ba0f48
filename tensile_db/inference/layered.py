"""One call's demand-layered forward pass: batches stream through the network while its layers
stream through the arena (Ji et al., arXiv 2210.04024, section 4, made to share one budget).

A network (:mod:`tensile_db.runtime.network`) is a graph of nodes in execution order; its
*layers* are the ``L`` nodes that hold weights (dense layers, convolutions, batch normalisations;
the output layer last), each one read-only tensor of :mod:`.store`. Every batch runs every node
in order. The call's *access sequence* is, for batch ``b`` and layer ``i``, the use
``k = b * L + i`` of layer ``i``; the nodes without weights (pooling, flatten, activation, add,
concatenation) run on activations only, each in the step of the next layer after it. With a
*prefetch window* of ``W`` layers, while use ``k`` computes, the layers of uses ``k + 1 .. k + W``
are loading or loaded: each one is prefetched
(:meth:`~tensile_db.memory.cache.WeightCache.prefetch`, a copy on the swap engine — the copy
thread on ``cpu``, the copy stream on ``cuda`` — that overlaps the computation) as soon as it
enters the window, and let go (:meth:`~tensile_db.memory.cache.WeightCache.unwant`) as soon as no
use in the window needs it. So a call holds at most ``min(W + 1, L)`` layers and one batch's live
activations: ``W = 1`` is the least memory, ``W >= L - 1`` keeps every layer for the whole call
(preloading). A layer let go stays in the device weight cache, unless the call asked for no
caching, until something needs its bytes.

Every activation — the batch's input, each node's output — is an arena tensor of the call,
freed after the last node that reads it (:attr:`~tensile_db.runtime.network.Network.consumers`),
so a residual's shortcut or a concatenation's branch stays alive until its join; a node's
workspace (a convolution's im2col buffers, a pool's padded input) is allocated with its output
and freed as soon as the node has run. A node's *step* holds its layer, the activations alive
across it (its inputs and any a later node reads: :func:`plan`), its output and its workspace;
the largest step is the least a call needs (:func:`check_fits`).

The arithmetic is :func:`tensile_db.runtime.network.evaluate` on views of the arena, with the
feature scaling and the softmax / target scaling of :mod:`tensile_db.runtime.model` on the host,
so the outputs are those of ``model.forward`` up to float32 rounding, and bit-identical across
window sizes (the same kernels on the same batches; only where the weights sit differs).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from ..errors import DeviceOutOfMemory, InvalidArgument, JobCancelled
from ..memory.manager import MemoryManager, Tensor
from ..runtime import layout
from ..runtime import model as models
from ..runtime.network import INPUT, Network, Node, evaluate
from ..runtime.program import Kind, Slot
from ..runtime.units import round_up
from ..settings import MAX_PREDICT_BATCH_ROWS
from . import INFERENCE_JOB
from .store import ServedModel

#: Largest batch a call may ask for, rows.
MAX_BATCH_ROWS = MAX_PREDICT_BATCH_ROWS


@dataclass
class CallStats:
    """What one call did. Bytes, counts and seconds."""

    window: int                      # the effective prefetch window, layers
    layers: int                      # nodes with weights, the output layer included
    batches: int
    batch_size: int                  # rows per batch (the last may be smaller)
    device_peak_nbytes: int = 0      # most arena bytes the call held at once: its layers and activations
    weight_loads: int = 0            # layers this call copied into the arena
    weight_loaded_nbytes: int = 0
    cache_hits: int = 0              # layers it found in the arena (cached or loaded by another call)
    load_wait_s: float = 0.0         # time spent waiting for layers and activations to be resident
    compute_s: float = 0.0           # time in the nodes' arithmetic
    time_s: float = 0.0              # the whole call

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Step:
    """One node's step of a batch. ``layer``: the node's index in ``ServedModel.layers`` (None: no
    weights). ``live``: the activations made before the node that are alive while it runs — its
    inputs and any a later node reads — as :data:`INPUT` or node indices. ``frees``: the
    activations freed after it, read last by it (its own output if no node reads it: the output
    layer's, copied to the host first)."""

    node: Node
    layer: int | None
    live: tuple[int, ...]
    frees: tuple[int, ...]


def plan(model: ServedModel) -> list[Step]:
    """The step of every node of ``model``'s network, in execution order: each activation lives
    from the node that makes it (the batch's input: from before the first node) to the last node
    that reads it."""
    network = model.spec.network
    layer_of = {node.index: i for i, node in enumerate(model.nodes)}
    last = {v: max(readers, default=v) for v, readers in network.consumers.items()}
    alive: dict[int, None] = {INPUT: None}           # an ordered set
    steps = []
    for node in network.nodes:
        live = tuple(alive)
        alive[node.index] = None
        frees = tuple(v for v in alive if last[v] == node.index)
        for v in frees:
            del alive[v]
        steps.append(Step(node, layer_of.get(node.index), live, frees))
    return steps


def _activation_nbytes(network: Network, v: int, rows: int) -> int:
    shape = network.input_shape if v == INPUT else network.nodes[v].shape
    return round_up(rows * math.prod(shape) * 4)


def _workspace_nbytes(node: Node, rows: int) -> int:
    numel = node.workspace_nelems(rows)
    return round_up(numel * 4) if numel else 0


def activations_nbytes(model: ServedModel, rows: int, steps: list[Step] | None = None) -> list[int]:
    """Arena bytes of the activations of every step (of ``steps``, default :func:`plan`) at
    ``rows`` rows per batch: the live activations, the node's output and its workspace, each
    rounded to the arena unit as the manager rounds them."""
    network = model.spec.network
    return [sum(_activation_nbytes(network, v, rows) for v in s.live) + _activation_nbytes(network, s.node.index, rows)
            + _workspace_nbytes(s.node, rows) for s in (steps if steps is not None else plan(model))]


def step_nbytes(model: ServedModel, rows: int, steps: list[Step] | None = None) -> list[int]:
    """Arena bytes of every step (of ``steps``, default :func:`plan`) at ``rows`` rows per batch:
    the node's layer tensor, if it has one, and :func:`activations_nbytes`."""
    steps = steps if steps is not None else plan(model)
    return [(model.layers[s.layer].arena_nbytes if s.layer is not None else 0) + a
            for s, a in zip(steps, activations_nbytes(model, rows, steps))]


def call_shape(model: ServedModel, n_rows: int, window: int, batch_size: int) -> tuple[int, int, int]:
    """(the effective window, rows per batch, batches) of a call on ``n_rows`` rows."""
    rows = min(batch_size, max(n_rows, 1))
    return min(window, len(model.layers)), rows, -(-n_rows // rows)


def fitting_batch(model: ServedModel, n_rows: int, budget_nbytes: int, most: int) -> int:
    """Rows per batch for a call that does not choose: the most, up to ``most`` and ``n_rows``,
    whose every step fits ``budget_nbytes`` with nothing else on the device (1 if none does;
    :func:`check_fits` then says why). A step's bytes grow with the rows, so a bisection finds it."""
    steps = plan(model)
    low, high = 1, max(1, min(most, n_rows))
    while low < high:
        mid = (low + high + 1) // 2
        if max(step_nbytes(model, mid, steps)) <= budget_nbytes:
            low = mid
        else:
            high = mid - 1
    return low


def check_fits(model: ServedModel, rows: int, budget_nbytes: int, in_use_nbytes: int) -> None:
    """Raise DeviceOutOfMemory, naming the node and saying what to change, if a step of ``rows``
    rows cannot fit the budget even with nothing else on the device."""
    steps = plan(model)
    one_row = step_nbytes(model, 1, steps)
    if max(one_row) > budget_nbytes:
        p = max(range(len(steps)), key=one_row.__getitem__)
        raise DeviceOutOfMemory(one_row[p], in_use_nbytes, budget_nbytes,
                                f"{_named(model, steps[p].node)} even with a batch of 1 row (raise "
                                "tensile.device_budget)")
    need = step_nbytes(model, rows, steps)
    p = max(range(len(steps)), key=need.__getitem__)
    if need[p] > budget_nbytes:
        raise DeviceOutOfMemory(need[p], in_use_nbytes, budget_nbytes,
                                f"{_named(model, steps[p].node)} with a batch of {rows} rows (lower "
                                "options.batch_size)")


def _named(model: ServedModel, node: Node) -> str:
    return f"layer {node.index} ({node.where}) of model {model.name!r}"


def check(model: ServedModel, x: np.ndarray, window, batch_size) -> None:
    """Raise InvalidArgument, naming the value, for features of the wrong width, a window that is
    not an integer >= 1 or a batch size outside 1 .. :data:`MAX_BATCH_ROWS`."""
    if x.ndim != 2 or x.shape[1] != model.spec.n_features:
        raise InvalidArgument(f"features of shape {x.shape} do not match model {model.name!r}, which expects "
                              f"{model.spec.n_features} per row")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise InvalidArgument(f"window must be an integer >= 1 (layers in flight), got {window!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or not 1 <= batch_size <= MAX_BATCH_ROWS:
        raise InvalidArgument(f"batch_size must be from 1 to {MAX_BATCH_ROWS}, got {batch_size!r}")


def run(mm: MemoryManager, model: ServedModel, x: np.ndarray, window: int, batch_size: int,
        cache: bool = True, cancelled: Callable[[], bool] | None = None) -> tuple[np.ndarray, CallStats]:
    """The model's outputs for raw features ``x`` (N, F) float32: (N, n_outputs) float32 class
    probabilities (classification) or values in the label's units (regression), as
    :func:`tensile_db.runtime.model.forward` computes them.

    ``window``: layers in flight ahead of the one computing, >= 1 (values of ``L - 1`` and more
    preload every layer); ``batch_size``: rows per batch, 1 .. :data:`MAX_BATCH_ROWS`; ``cache``:
    leave the layers in the device weight cache after use. ``cancelled`` is polled before every
    node. Raises InvalidArgument for a bad window or batch size or features of the wrong width,
    JobCancelled when cancelled, DeviceOutOfMemory when even one step cannot fit the budget (its
    message names the node). Every tensor the call held is released however it ends.
    """
    x = np.asarray(x, dtype=np.float32)
    check(model, x, window, batch_size)
    n_layers, n_rows = len(model.layers), len(x)
    started = time.perf_counter()
    window, batch_size, n_batches = call_shape(model, n_rows, window, batch_size)
    stats = CallStats(window, n_layers, n_batches, batch_size)
    uses = n_batches * n_layers
    steps = plan(model)
    segments = _segments(steps)

    def window_of(k: int) -> list[int]:
        """The layers of uses k .. k + W, in use order, each once (none past the last use)."""
        return list(dict.fromkeys(u % n_layers for u in range(k, min(k + window, uses - 1) + 1)))

    logits = np.empty((n_rows, model.spec.n_outputs), np.float32)
    held: set[int] = set()              # layers in this call's window
    acts: dict[int, Tensor] = {}        # the batch's live activations, by INPUT or node index
    try:
        for k in range(uses):
            b, i = divmod(k, n_layers)
            for j in window_of(k):
                if j not in held:
                    held.add(j)
                    _count_prefetch(mm, model.layers[j], stats)
            rows = slice(b * batch_size, min((b + 1) * batch_size, n_rows))
            n = rows.stop - rows.start
            if i == 0:
                xs = models.standardize(model.scaling, x[rows])        # one batch's scaled inputs
                acts[INPUT] = mm.adopt(INFERENCE_JOB, "x", Kind.INPUT,
                                      layout.images_from_rows(xs, model.spec.network.input_shape))
                del xs
            for s in segments[i]:
                if cancelled is not None and cancelled():
                    raise JobCancelled("cancelled by the caller")
                _step(mm, model, s, n, acts, held, stats)
                if s is steps[-1]:
                    logits[rows] = mm.to_host(acts[s.node.index])
                for v in s.frees:
                    mm.free(acts.pop(v))
            for j in sorted(held - set(window_of(k + 1))):
                held.discard(j)
                mm.cache.unwant(model.layers[j], keep=cache)
    finally:
        _release(mm, model, acts, held, cache)
    stats.time_s = time.perf_counter() - started
    return models.finish(model.spec, model.scaling, logits), stats


def _segments(steps: list[Step]) -> list[list[Step]]:
    """The steps by layer: ``[i]`` holds layer i's step and the steps without weights before it."""
    segments: list[list[Step]] = [[]]
    for s in steps:
        segments[-1].append(s)
        if s.layer is not None and s is not steps[-1]:
            segments.append([])
    return segments


def _release(mm: MemoryManager, model: ServedModel, acts: dict[int, Tensor], held: set[int], cache: bool) -> None:
    """Free a call's activations and let go of the layers in its window, however the call ends."""
    for t in acts.values():
        mm.free(t)
    for j in held:                  # each let go, whatever a failed load of another raises
        try:
            mm.cache.unwant(model.layers[j], keep=cache)
        except Exception:           # the call's own error, if any, is the one raised
            pass


def _step(mm: MemoryManager, model: ServedModel, s: Step, n: int, acts: dict[int, Tensor], held: set[int],
          stats: CallStats) -> None:
    """Run node ``s.node`` on a batch of ``n`` rows: its layer (if any) and inputs made resident,
    its output allocated into ``acts`` (freed by the caller) and its workspace for the node's
    run only."""
    node = s.node
    layer = model.layers[s.layer] if s.layer is not None else None
    tensors = ([layer] if layer is not None else []) + [acts[v] for v in dict.fromkeys(node.inputs)]
    slots = [Slot(f"h{node.index}", Kind.ACTIVATION, (n, *layout.stored(node.shape)))]
    if node.workspace_nelems(n):
        slots.append(Slot(f"ws{node.index}", Kind.WORKSPACE, (node.workspace_nelems(n),)))
    if layer is not None and layer.offset is None:     # not prefetched (no room) or evicted since: loaded now
        stats.weight_loads += 1
        stats.weight_loaded_nbytes += layer.nbytes
    waiting = time.perf_counter()
    created = mm.acquire(INFERENCE_JOB, tensors, slots, what=f"{_named(model, node)} (batch of {n} rows)", wait=True)
    stats.load_wait_s += time.perf_counter() - waiting
    out, workspace = created[0], (created[1] if len(created) > 1 else None)
    acts[node.index] = out
    try:
        stats.device_peak_nbytes = max(stats.device_peak_nbytes, sum(
            t.arena_nbytes for t in [*acts.values(), *created[1:], *(model.layers[j] for j in held)]
            if t.offset is not None))
        weights = model.split(s.layer, mm.array(layer)) if layer is not None else {}
        with mm.device.computing():
            computing = time.perf_counter()
            evaluate(node, [mm.array(acts[v]) for v in node.inputs], weights, mm.array(out),
                     mm.array(workspace) if workspace is not None else None)
            mm.device.synchronize()
            stats.compute_s += time.perf_counter() - computing
    finally:
        mm.unpin(tensors + created)
        if workspace is not None:
            mm.free(workspace)


def _count_prefetch(mm: MemoryManager, layer, stats: CallStats) -> None:
    if mm.cache.prefetch(layer):
        stats.weight_loads += 1
        stats.weight_loaded_nbytes += layer.nbytes
    elif layer.offset is not None:
        stats.cache_hits += 1
