"""One call's demand-layered forward pass: batches stream through the layers while the layers
stream through the arena (Ji et al., arXiv 2210.04024, section 4, made to share one budget).

The call's *access sequence* is, for batch ``b`` and layer ``i``, the use ``k = b * L + i`` of layer
``i``, with ``L`` the number of dense layers. With a *prefetch window* of ``W`` layers, while use
``k`` computes, the layers of uses ``k + 1 .. k + W`` are loading or loaded: each one is
prefetched (:meth:`~tensile_db.memory.cache.WeightCache.prefetch`, a copy on the swap engine —
the copy thread on ``cpu``, the copy stream on ``cuda`` — that overlaps the computation) as soon
as it enters the window, and let go (:meth:`~tensile_db.memory.cache.WeightCache.unwant`) as soon
as no use in the window needs it. So a call holds at most ``min(W + 1, L)`` layers and one
batch's input and output activations: ``W = 1`` is the least memory, ``W >= L - 1`` keeps every
layer for the whole call (preloading).
A layer let go stays in the device weight cache, unless the call asked for no caching, until
something needs its bytes.

The arithmetic is :func:`tensile_db.runtime.model.dense_layer` on views of the arena, with the
feature scaling and the softmax / target scaling of :mod:`tensile_db.runtime.model` on the host,
so the outputs are those of ``model.forward`` up to float32 rounding, and bit-identical across
window sizes (the same kernels on the same batches; only where the weights sit differs).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from ..errors import DeviceOutOfMemory, InvalidArgument, JobCancelled
from ..memory.manager import MemoryManager
from ..runtime import model as models
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
    layers: int
    batches: int
    batch_size: int                  # rows per batch (the last may be smaller)
    device_peak_nbytes: int = 0      # most arena bytes the call held at once: its layers and activations
    weight_loads: int = 0            # layers this call copied into the arena
    weight_loaded_nbytes: int = 0
    cache_hits: int = 0              # layers it found in the arena (cached or loaded by another call)
    load_wait_s: float = 0.0         # time spent waiting for layers and activations to be resident
    compute_s: float = 0.0           # time in the layers' arithmetic
    time_s: float = 0.0              # the whole call

    def to_json(self) -> dict:
        return asdict(self)


def call_shape(model: ServedModel, n_rows: int, window: int, batch_size: int) -> tuple[int, int, int]:
    """(the effective window, rows per batch, batches) of a call on ``n_rows`` rows."""
    rows = min(batch_size, max(n_rows, 1))
    return min(window, len(model.layers)), rows, -(-n_rows // rows)


def step_nbytes(model: ServedModel, i: int, rows: int) -> int:
    """Arena bytes of one step: layer ``i`` and its input and output activations for ``rows``
    rows, each rounded to the arena unit as the manager rounds them."""
    n_in, n_out = model.shapes[i]
    return model.layers[i].arena_nbytes + round_up(rows * n_in * 4) + round_up(rows * n_out * 4)


def check_fits(model: ServedModel, rows: int, budget_nbytes: int, in_use_nbytes: int) -> None:
    """Raise DeviceOutOfMemory, saying what to change, if a step of ``rows`` rows cannot fit the
    budget even with nothing else on the device."""
    i = max(range(len(model.layers)), key=lambda i: step_nbytes(model, i, rows))
    need = step_nbytes(model, i, rows)
    if need <= budget_nbytes:
        return
    if step_nbytes(model, i, 1) > budget_nbytes:
        what = f"layer {i} of model {model.name!r} even with a batch of 1 row (raise tensile.device_budget)"
    else:
        what = f"layer {i} of model {model.name!r} with a batch of {rows} rows (lower options.batch_size)"
    raise DeviceOutOfMemory(need, in_use_nbytes, budget_nbytes, what)


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
    leave the layers in the device weight cache after use. ``cancelled`` is polled between two
    layers. Raises InvalidArgument for a bad window or batch size or features of the wrong width,
    JobCancelled when cancelled, DeviceOutOfMemory when even one step cannot fit the budget.
    Every tensor the call held is released however it ends.
    """
    x = np.asarray(x, dtype=np.float32)
    check(model, x, window, batch_size)
    n_layers, n_rows = len(model.layers), len(x)
    started = time.perf_counter()
    window, batch_size, n_batches = call_shape(model, n_rows, window, batch_size)
    stats = CallStats(window, n_layers, n_batches, batch_size)
    uses = n_batches * n_layers
    acts = models.activations(model.spec)

    def window_of(k: int) -> list[int]:
        """The layers of uses k .. k + W, in use order, each once (none past the last use)."""
        return list(dict.fromkeys(u % n_layers for u in range(k, min(k + window, uses - 1) + 1)))

    xs = models.standardize(model.scaling, x)
    logits = np.empty((n_rows, model.spec.n_outputs), np.float32)
    held: set[int] = set()              # layers in this call's window
    h = None                            # the activation entering the next layer
    try:
        for k in range(uses):
            if cancelled is not None and cancelled():
                raise JobCancelled("cancelled by the caller")
            b, i = divmod(k, n_layers)
            for j in window_of(k):
                if j not in held:
                    held.add(j)
                    _count_prefetch(mm, model.layers[j], stats)
            rows = slice(b * batch_size, min((b + 1) * batch_size, n_rows))
            n = rows.stop - rows.start
            if i == 0:
                h = mm.adopt(INFERENCE_JOB, "x", Kind.INPUT, xs[rows])
            layer = model.layers[i]
            if layer.offset is None:            # not prefetched (no room) or evicted since: loaded now
                stats.weight_loads += 1
                stats.weight_loaded_nbytes += layer.nbytes
            step = time.perf_counter()
            (out,) = mm.acquire(INFERENCE_JOB, [layer, h], [Slot(f"h{i + 1}", Kind.ACTIVATION, (n, model.shapes[i][1]))],
                                what=f"layer {i} of model {model.name!r} (batch of {n} rows)", wait=True)
            stats.load_wait_s += time.perf_counter() - step
            try:
                stats.device_peak_nbytes = max(stats.device_peak_nbytes, h.arena_nbytes + out.arena_nbytes + sum(
                    model.layers[j].arena_nbytes for j in held if model.layers[j].offset is not None))
                w, bias = model.split(i, mm.array(layer))
                with mm.device.computing():
                    computing = time.perf_counter()
                    models.dense_layer(mm.array(h), w, bias, acts[i], mm.array(out))
                    mm.device.synchronize()
                    stats.compute_s += time.perf_counter() - computing
            finally:
                mm.unpin([layer, h, out])
                mm.free(h)
                h = out                         # freed by the outer finally if the layer failed
            if i == n_layers - 1:
                logits[rows] = mm.to_host(h)
                mm.free(h)
                h = None
            for j in sorted(held - set(window_of(k + 1))):
                held.discard(j)
                mm.cache.unwant(model.layers[j], keep=cache)
    finally:
        if h is not None:
            mm.free(h)
        for j in held:
            mm.cache.unwant(model.layers[j], keep=cache)
    stats.time_s = time.perf_counter() - started
    return models.finish(model.spec, model.scaling, logits), stats


def _count_prefetch(mm: MemoryManager, layer, stats: CallStats) -> None:
    if mm.cache.prefetch(layer):
        stats.weight_loads += 1
        stats.weight_loaded_nbytes += layer.nbytes
    elif layer.offset is not None:
        stats.cache_hits += 1
