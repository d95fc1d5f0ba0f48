"""Training jobs: one model being trained for one backend, executed one op at a time.

A :class:`TrainingJob` holds the caller's data on the host, the training program (its access
sequence), and the tensors it registered with the memory manager. :meth:`TrainingJob.ops` is a
generator that runs exactly one op of the program per ``next()``, so the executor can interleave
the ops of all running jobs on the device; the scheduler's hooks run before and after each op
(planned swaps) and receive the op's measured time. A tensor dropped (by a plan, or by an eviction
under ``dtr``) is recomputed by re-running the forward ops that produced it, with the same inputs
and dropout seed, before the op that reads it; the op's inputs are kept
(:meth:`MemoryManager.keep`) from that check to the op's acquire, so no eviction in between drops
one again. Progress (epoch, loss, device bytes) is published to
the job's event queue, which the connection thread of its backend relays.
"""

from __future__ import annotations

import collections.abc
import enum
import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol

import numpy as np

from ..errors import InvalidArgument, TensileError
from ..memory.manager import JobMemory, MemoryManager, Residency, Tensor
from ..memory.spill import SpilledArrays
from ..runtime import model as models
from ..runtime import preprocess
from ..runtime.builder import build_training_program
from ..runtime.program import Kind, Program, StepContext
from .reports import JobRow

_job_ids = itertools.count(1)
#: Most held-out rows whose loss a job computes after each epoch (on the host, on the executor's
#: thread, so it bounds that pause); the stored held-out metrics use every held-out row.
VALIDATION_ROWS = 8192


class JobState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class OpHooks(Protocol):
    """What the executor's scheduler does around each op of a job."""

    def before(self, job: "TrainingJob", position: int) -> None: ...

    def after(self, job: "TrainingJob", position: int, seconds: float) -> None: ...


@dataclass
class JobInfo:
    """Who asked for the job: the backend's pid, the role, the model name."""

    backend_pid: int
    role: str
    model_name: str


class TrainingJob:
    """One training run. ``x``: (N, F) float32 features; ``y``: (N,) int32 class indices for
    classification or (N, 1) float32 targets for regression; with ``rows`` ((N,) integer), the
    training rows are ``x[rows]`` (x holds other rows too: a table's rows as the backend's scan
    wrote them, the held-out ones among them), row ``i`` labelled ``y[i]``, and no copy of them is
    made; ``x_val`` / ``y_val`` the held-out rows of the same kinds; ``scale_modes`` each input column's scaling
    (:func:`~tensile_db.runtime.preprocess.fit_scaling`). ``data_of``: another job on the same
    rows with the same scaling (a search's first trial), whose scaled arrays this one shares.

    Raises InvalidArgument (from the constructor) when the data does not fit the spec.
    """

    def __init__(self, info: JobInfo, spec: models.ModelSpec, options: models.TrainOptions,
                 x: np.ndarray, y: np.ndarray, x_val: np.ndarray | None = None, y_val: np.ndarray | None = None,
                 scale_modes: list[str] | None = None, data_of: "TrainingJob | None" = None,
                 rows: np.ndarray | None = None):
        n = len(x) if rows is None else len(rows)
        if x.ndim != 2 or x.shape[1] != spec.n_features or len(y) != n or n == 0:
            raise InvalidArgument(f"training data of shape {x.shape} / {y.shape} does not match "
                                  f"{spec.n_features} features")
        if rows is not None and (rows.ndim != 1 or rows.dtype.kind not in "iu" or rows.min() < 0
                                 or rows.max() >= len(x)):
            raise InvalidArgument(f"training rows of shape {rows.shape} ({rows.dtype}) are not indices of the "
                                  f"{len(x):,} rows given")
        if x_val is not None and (y_val is None or x_val.ndim != 2 or x_val.shape[1] != x.shape[1]
                                  or len(y_val) != len(x_val)):
            raise InvalidArgument(f"held-out data of shape {x_val.shape} does not match {spec.n_features} features")
        self.id = next(_job_ids)
        self.info = info
        self.spec = spec
        self.options = options
        self.batch = min(options.batch_size, n)
        self.program: Program = build_training_program(spec, options, self.batch)
        self.state = JobState.QUEUED
        self.epoch = 0
        self.loss = math.nan
        self.created_at = time.time()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        # On the device's clock (Device.now(), seconds; virtual on ``sim``): admitted no earlier
        # than ``arrival_s`` when it is set.
        self.arrival_s: float | None = None
        self.error: BaseException | None = None
        self.result: WeightsCopy | None = None    # the trained weights and scaling, once done
        self._copies: list[WeightsCopy] = []      # its copies of the weights for held-out losses, held now
        self.events: queue.Queue = queue.Queue()
        self.cancel_requested = threading.Event()
        if data_of is not None:        # another trial of one search: the same rows and scaling
            self.x, self.y, self.scaling, self.rows = data_of.x, data_of.y, data_of.scaling, data_of.rows
            self.x_val, self.y_val = data_of.x_val, data_of.y_val
        else:
            # x stays as sent, the rows a batch reads scaled as it is read (Note [Rows scaled
            # batch by batch])
            self.rows = None if rows is None else np.asarray(rows, np.intp)
            self.x, self.y, self.scaling = _scaling(spec, options, x, y, scale_modes, self.rows)
            # Held-out rows, scaled as the training rows are: the loss on them after every epoch
            # (``history``), early stopping (``options.patience``) and a search's halving.
            if x_val is not None and len(x_val) > VALIDATION_ROWS:       # evenly spaced, for the per-epoch loss
                step = -(-len(x_val) // VALIDATION_ROWS)
                x_val, y_val = x_val[::step], y_val[::step]
            self.x_val, self.y_val = (None, None) if x_val is None or len(x_val) == 0 else \
                _scaled(self.scaling, x_val, y_val, spec.task)
        self.history: list[dict] = []            # per epoch: epoch, loss, and val_loss with held-out rows
        self.best_epoch: int | None = None       # the epoch of the lowest held-out loss
        self.stopped: str | None = None          # why training ended before options.epochs: patience | halving
        # Set to end after the current epoch with the weights that training keeps; or asked at
        # the end of each epoch, on the executor's thread, with the epoch and its held-out loss
        # (a search's successive halving): False ends the training there.
        self.stop_requested = threading.Event()
        self.keep_going: Callable[[int, float], bool] | None = None
        self.tensors: dict[str, Tensor] = {}
        self.memory: JobMemory | None = None     # the job's memory counters, once finished
        self.next_position = 0                   # index of the op the next ``next()`` runs
        self.iterations = 0                      # iterations completed
        self.schedule = "cold start"             # 'cold start' | 'planned' | 'reactive'
        self.policy = ""
        self.device: str | None = None           # the device placement chose (Note [Placement]), once submitted
        self.iteration_estimate_s: float | None = None  # the device's estimate of one iteration (placement.remaining_s)

    @cached_property
    def vanilla_peak_nbytes(self) -> int:
        """Peak arena bytes of this job alone with unlimited memory (one steady iteration)."""
        return self.program.vanilla_peak_nbytes()

    @cached_property
    def min_working_set_nbytes(self) -> int:
        return self.program.min_working_set_nbytes

    @property
    def n_rows(self) -> int:
        """The training rows."""
        return len(self.y)

    @property
    def steps_per_epoch(self) -> int:
        return self.n_rows // self.batch

    def training_rows(self, step: int = 1) -> np.ndarray:
        """Every ``step``-th training row's features, (ceil(N / step), F) float32 as sent (a
        view, or a gather where ``rows`` picks them)."""
        if self.rows is None:
            return self.x[::step]
        return np.take(self.x, self.rows[::step], axis=0)

    def ops(self, mm: MemoryManager, device, hooks: OpHooks):
        """Generator: run the whole training, one op per ``next()``.

        ``hooks.before(job, position)`` runs before each op and ``hooks.after(job, position,
        seconds)`` after it, with the op's measured compute time in seconds. On completion
        ``self.result`` holds the trained weights and scaling (a :class:`WeightsCopy`: in host memory,
        or in a spill file when the host tier has no room for them); :meth:`discard_result` gives it back.
        """
        weights = list(self.spec.network.weight_shapes())     # the arrays a stored model holds
        self._adopt_state(mm, device)
        rng = np.random.default_rng(self.options.seed)
        ctx = StepContext(device)
        current = best = None                           # copies of the weights after the last and the best epoch
        for epoch in range(1, self.options.epochs + 1):
            loss_sum = yield from self._epoch_ops(mm, hooks, ctx, rng.permutation(self.n_rows))
            self.epoch = epoch
            self.loss = loss_sum / self.steps_per_epoch
            if not math.isfinite(self.loss):
                raise InvalidArgument(f"training diverged at epoch {epoch} (loss {self.loss}); "
                                      f"lower options.lr (now {self.options.learning_rate})")
            record = {"epoch": epoch, "loss": self.loss}
            if self.x_val is not None and device.holds_values:
                current, best = self._validate(mm, weights, current, best, record)
            self.history.append(record)
            mem = mm.jobs[self.id]
            self.events.put(("progress", {
                **record, "epochs": self.options.epochs,
                "device_nbytes": mem.device_nbytes, "peak_nbytes": mem.peak_nbytes,
                "swapped_out_nbytes": mem.swapped_out_nbytes}))
            if epoch < self.options.epochs:
                self.stopped = self._stop_reason(epoch, record)
            if self.stopped:
                break
        self.result = self._result(mm, weights, current, best)

    def _adopt_state(self, mm: MemoryManager, device) -> None:
        """Register the initial weights and the zeroed optimizer state with the manager, one
        array at a time (each goes to the host tier or the disk tier; a node's joined parameters
        one slot at a time, filled from its arrays); on a device without values, their shapes
        only."""
        initial = self.spec.network.iter_init_weights(self.options.seed) if device.holds_values else ()
        members, filling = self.program.members, {}   # joined slot -> [its array, elements not yet filled]
        for name, value in initial:
            if name in members:
                slot, start, shape = members[name]
                if value.shape != shape:
                    raise TensileError(f"internal error: initial weight {name!r} of job {self.id} has shape "
                                       f"{value.shape}, its slot {slot!r} holds {shape}; report this with the model")
                if slot not in filling:
                    array = np.empty(self.program.slots[slot].shape, np.float32)
                    filling[slot] = [array, array.size]
                filling[slot][0][start:start + value.size] = value.reshape(-1)
                filling[slot][1] -= value.size
                if not filling[slot][1]:                            # its last parameter
                    self.tensors[slot] = mm.adopt(self.id, slot, Kind.WEIGHT, filling.pop(slot)[0])
            elif name in self.program.slots:
                self.tensors[name] = mm.adopt(self.id, name, self.program.slots[name].kind, value)
        if filling:
            raise TensileError(f"internal error: the initial weights of job {self.id} leave part of "
                               f"{', '.join(filling)} unset; report this with the model")
        for name, slot in self.program.slots.items():
            if slot.kind.persistent and name not in self.tensors:     # optimizer state
                value = np.zeros(slot.shape, slot.dtype) if device.holds_values else device.host_empty(slot.shape, slot.dtype)
                self.tensors[name] = mm.adopt(self.id, name, slot.kind, value)

    def _epoch_ops(self, mm: MemoryManager, hooks: OpHooks, ctx: StepContext, order: np.ndarray):
        """Generator: one epoch's ops over the rows in ``order``, one per ``next()``; returns the
        sum of the steps' losses."""
        loss_sum = 0.0
        in_x = order if self.rows is None else np.take(self.rows, order)      # the rows of x in that order
        for it in range(self.steps_per_epoch):
            part = slice(it * self.batch, (it + 1) * self.batch)
            # np.take, not x[index]: 4,096 rows of 16 float32 took 0.35 ms against 1.09 by indexing;
            # the rows gathered are scaled where they lie
            batch = np.take(self.x, in_x[part], axis=0)
            ctx.batch_x = models.standardize(self.scaling, batch, out=batch)
            ctx.batch_y = np.take(self.y, order[part], axis=0)
            ctx.step += 1
            ctx.seed = self.options.seed * 1_000_003 + ctx.step
            for position, op in enumerate(self.program.ops):
                mm.at(self.id, position)
                hooks.before(self, position)
                loss, seconds = self._run_op(mm, position, op, ctx)
                if loss is not None:
                    loss_sum += loss
                hooks.after(self, position, seconds)
                self.next_position = (position + 1) % len(self.program.ops)
                if self.next_position == 0:
                    self.iterations += 1
                yield
        return loss_sum

    def _weight_views(self, names) -> dict[str, tuple[Tensor, int, tuple[int, ...]]]:
        """name -> (its tensor, first element, shape) of each of the weights ``names``: the
        tensor of a node's joined parameters for each of them, else its own."""
        members = self.program.members
        return {name: (self.tensors[members[name][0]], *members[name][1:]) if name in members
                else (self.tensors[name], 0, self.tensors[name].shape) for name in names}

    def _validate(self, mm: MemoryManager, weights: list, current, best, record: dict) -> tuple:
        """Copy the epoch's weights, put their held-out loss in ``record`` and keep the copy of
        the best epoch (for early stopping); returns the (current, best) copies."""
        if current is not None and current is not best:
            current.close()
        current = copy_weights(mm, self.id, self._weight_views(weights))
        self._copies = [c for c in (current, best) if c is not None]   # discard_result closes them
        record["val_loss"] = self.validation_loss(current)
        if self.best_epoch is None or record["val_loss"] < self.history[self.best_epoch - 1]["val_loss"]:
            self.best_epoch = record["epoch"]
            if best is not None and best is not current:
                best.close()
            best = current if self.options.patience is not None else None     # kept only for early stopping
            self._copies = [c for c in (current, best) if c is not None]
        return current, best

    def _stop_reason(self, epoch: int, record: dict) -> str | None:
        """Why training stops after ``epoch`` before its last: ``patience`` (no better held-out
        loss for that many epochs), ``halving`` (the search stopped it), or None."""
        patience = self.options.patience
        if patience is not None and self.best_epoch is not None and epoch - self.best_epoch >= patience:
            return "patience"
        if self.stop_requested.is_set() or (self.keep_going is not None and "val_loss" in record
                                            and not self.keep_going(epoch, record["val_loss"])):
            return "halving"
        return None

    def _result(self, mm: MemoryManager, weights: list, current, best) -> WeightsCopy:
        """The trained weights with the scaling: the best epoch's under early stopping, else the
        last epoch's."""
        if self.options.patience is not None and self.best_epoch is not None:
            result = best                         # early stopping keeps the best epoch's weights
            if current is not best:
                current.close()
        elif current is not None:
            result = current                      # the last epoch's, copied for its held-out loss
        else:
            result = copy_weights(mm, self.id, self._weight_views(weights))
        result.add(self.scaling)
        return result

    def discard_result(self) -> None:
        """Give back what the job's copies of its weights hold (host bytes or a spill file):
        after its result is sent, or when it will not be. Idempotent."""
        for copy in (self.result, *self._copies):
            if copy is not None:
                copy.close()
        self.result, self._copies = None, []

    def validation_loss(self, weights: dict[str, np.ndarray]) -> float:
        """The training loss on the held-out rows under ``weights`` (computed on the host): mean
        softmax cross-entropy for classification, mean squared error of the scaled target for
        regression."""
        out = self.spec.network.forward(weights, self.x_val, chunk_rows(self.spec, weights)).astype(np.float64)
        if self.spec.task == "classification":
            top = out.max(axis=1, keepdims=True)
            log_z = top[:, 0] + np.log(np.exp(out - top).sum(axis=1))
            return float(np.mean(log_z - out[np.arange(len(out)), self.y_val]))
        return float(np.mean((out - self.y_val) ** 2))

    def _run_op(self, mm: MemoryManager, position: int, op, ctx: StepContext) -> tuple[float | None, float]:
        """Run op ``position``; returns (the loss if the op computes it, the op's seconds)."""
        reads = [self.tensors[s] for s in op.reads if s in self.tensors]
        mm.keep(reads)
        try:
            self._recompute_dropped(mm, reads, ctx)
            live = [self.tensors[s] for s in op.accesses if s in self.tensors]
            new = [self.program.slots[s] for s in op.writes if s not in self.tensors]
            created = mm.acquire(self.id, live, new, what=f"op {op.name} of job {self.id}", wait=True)
        finally:
            mm.let_go(reads)
        for t in created:
            self.tensors[t.slot] = t
        try:
            arrays = {s: mm.array(self.tensors[s]) for s in op.accesses}
            with mm.device.computing():
                start = mm.device.now()
                mm.device.execute(op, arrays, ctx)
                seconds = mm.device.now() - start
            loss = float(arrays["loss"][0]) if "loss" in op.writes else None
        finally:
            mm.unpin(live + created)
        for s in self.program.frees_after[position]:
            mm.free(self.tensors.pop(s))
        return loss, seconds

    def _recompute(self, mm: MemoryManager, name: str, ctx: StepContext) -> None:
        """Re-run the forward ops that produced the dropped tensor ``name`` (their replays, the
        program's recipe), with fresh workspaces; their inputs are unchanged since the first run,
        so the values are identical. The caller keeps ``name`` (:meth:`MemoryManager.keep`), so
        it is not dropped again between two of its writers; each replay's inputs are kept from
        the recompute of those that were dropped to the replay's acquire."""
        recipe = self.program.recipe(name)
        if recipe is None:
            raise TensileError(f"internal error: tensor {name!r} of job {self.id} was dropped but "
                               "cannot be recomputed; report this with the model's architecture")
        target = self.tensors[name]
        for p in recipe:
            op = self.program.replay(p)
            inputs = [self.tensors[s] for s in op.reads if s != name and s in self.tensors]
            mm.keep(inputs)
            try:
                self._recompute_dropped(mm, inputs, ctx)
                live = [self.tensors[s] for s in op.accesses if s in self.tensors]
                workspaces = [self.program.slots[s] for s in op.writes if s not in self.tensors]
                created = mm.acquire(self.id, live, workspaces, what=f"recompute of {name} by op {op.name} of job "
                                     f"{self.id}", wait=True)
            finally:
                mm.let_go(inputs)
            try:
                arrays = {t.slot: mm.array(t) for t in live + created}
                with mm.device.computing():
                    mm.device.execute(op, arrays, ctx)
            finally:
                mm.unpin(live + created)
                for t in created:
                    mm.free(t)
        mm.note_recompute(target)

    def _recompute_dropped(self, mm: MemoryManager, tensors: list[Tensor], ctx: StepContext) -> None:
        """Recompute those of ``tensors`` (kept by the caller) that are dropped."""
        for t in tensors:
            if t.residency is Residency.DROPPED:
                self._recompute(mm, t.slot, ctx)

    def describe(self, mm: MemoryManager | None, device: str) -> JobRow:
        """The job's row of ``tensile.jobs``; ``mm`` the memory manager of ``device``, the name
        of the device it runs or waits on."""
        mem = mm.jobs.get(self.id) if mm else None
        return JobRow(
            job_id=self.id, backend_pid=self.info.backend_pid, role=self.info.role,
            model_name=self.info.model_name, state=self.state.value, device=device, epoch=self.epoch,
            epochs=self.options.epochs, loss=None if math.isnan(self.loss) else self.loss,
            device_nbytes=mem.device_nbytes if mem else 0,
            peak_nbytes=mem.peak_nbytes if mem else 0,
            vanilla_peak_nbytes=self.vanilla_peak_nbytes,
            swapped_out_nbytes=mem.swapped_out_nbytes if mem else 0,
            swapped_in_nbytes=mem.swapped_in_nbytes if mem else 0,
            host_nbytes=mem.host_nbytes if mem else 0,
            disk_nbytes=mem.disk_nbytes if mem else 0,
            policy=self.policy, schedule=self.schedule,
            planned_swap_ins=mem.planned_swap_ins if mem else 0,
            passive_swap_ins=mem.passive_swap_ins if mem else 0,
            recomputes=mem.recomputes if mem else 0,
            created_at=self.created_at, started_at=self.started_at)


class WeightsCopy(collections.abc.Mapping):
    """A copy of a job's weights by name (float32 arrays of the network's shapes): in host
    memory, where the host tier counts it against the host budget, or, when the host tier has
    no room for it, in a spill file (:class:`~tensile_db.memory.spill.SpilledArrays`), read back
    an array at a time; so a model larger than the host budget is never copied whole into
    memory. :meth:`add` keeps small arrays (the scaling) in memory beside it; :meth:`close` gives
    back its host bytes or removes its file. Made by :func:`copy_weights`."""

    def __init__(self, arrays: collections.abc.Mapping, release: Callable[[], None]):
        self._arrays, self._extra, self._release = arrays, {}, release

    @property
    def in_memory(self) -> bool:
        return not isinstance(self._arrays, SpilledArrays)

    def add(self, extra: dict[str, np.ndarray]) -> None:
        self._extra.update(extra)

    def meta(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape of ``name``'s array, without reading it from a spill file."""
        if name not in self._extra and not self.in_memory:
            return self._arrays.meta(name)
        a = self[name]
        return a.dtype, a.shape

    def __getitem__(self, name: str) -> np.ndarray:
        return self._extra[name] if name in self._extra else self._arrays[name]

    def __contains__(self, name) -> bool:          # without reading the array
        return name in self._extra or name in self._arrays

    def __iter__(self):
        return itertools.chain(self._arrays, self._extra)

    def __len__(self) -> int:
        return len(self._arrays) + len(self._extra)

    def close(self) -> None:
        """Give back the host bytes or remove the file, and forget the arrays (idempotent)."""
        release, self._release = self._release, None
        self._arrays, self._extra = {}, {}
        if release is not None:
            release()


_copy_names = itertools.count(1)


def copy_weights(mm: MemoryManager, job_id: int, views: dict[str, tuple[Tensor, int, tuple[int, ...]]]) -> WeightsCopy:
    """The current values of ``views`` by name (name -> (tensor, first element, shape): a
    tensor's values from that element on, in that shape): in host memory when the host tier has
    room for all of them (:meth:`MemoryManager.take_host`), else in a spill file, copied one
    tensor at a time. Raises TensileError when the spill file's I/O fails."""
    nbytes = sum(math.prod(shape) * t.dtype.itemsize for t, _, shape in views.values())
    if mm.take_host(nbytes):
        try:
            return WeightsCopy(dict(_host_values(mm, views)), lambda: mm.give_host(nbytes))
        except BaseException:
            mm.give_host(nbytes)
            raise
    spilled = SpilledArrays(mm.host_tier.spill.open(f"weights-{job_id}-{next(_copy_names)}"))
    try:
        for name, array in _host_values(mm, views):
            spilled.put(name, array)
    except BaseException:
        spilled.close()
        raise
    return WeightsCopy(spilled, spilled.close)


def _host_values(mm: MemoryManager, views: dict):
    """(name, host array) of each of ``views`` (as :func:`copy_weights` takes them), copying
    each tensor to the host once and holding one tensor's copy at a time (a spill file's copy
    never holds the model whole): the views of one tensor must come one after another, as a
    node's parameters do. Raises AssertionError where they do not."""
    last, done = None, set()
    for name, (t, start, shape) in views.items():
        if last is None or last[0] is not t:
            assert t.id not in done, f"the views of {t.slot} of job {t.job_id} are not one after another"
            done.add(t.id)
            last = (t, mm.to_host(t).reshape(-1))
        yield name, last[1][start:start + math.prod(shape)].reshape(shape)


#: Bytes of one node's output a host forward pass may hold per chunk of rows: each chunk costs a
#: pass of Python over the network (and, with weights in a spill file, a read of every array), so
#: chunks are as large as this allows.
FORWARD_CHUNK_NBYTES = 16 << 20


def chunk_rows(spec: models.ModelSpec, weights) -> int:
    """Rows per chunk for a host forward pass (:meth:`Network.forward`) with ``weights`` (in
    memory or in a spill file): as many as keep the widest node's output within
    :data:`FORWARD_CHUNK_NBYTES`, at least 256. A small network's chunk of 256 rows cost more in
    Python than in arithmetic: the forward pass over 800,000 rows of 16 inputs took 0.13 s here."""
    widest = max(math.prod(node.shape) for node in spec.network.nodes)
    return max(256, FORWARD_CHUNK_NBYTES // (4 * widest))


def _scaling(spec, options, x, y, scale_modes=None, rows=None):
    """The training rows x (N, F) float32, as sent (a copy only of rows of another dtype or
    layout), the targets y, scaled for regression, and the scaling stored with the model, fitted
    on ``x[rows]`` where ``rows`` is given: per
    input column ``x_mean`` / ``x_std`` from ``scale_modes`` (:func:`..runtime.preprocess.fit_scaling`;
    None: every column standardised when ``options.standardize``), and for regression the
    target's mean and standard deviation when ``options.standardize``.

    Note [Rows scaled batch by batch]: the job keeps its rows as they came and scales the rows of
    each batch as the batch is read (:func:`.models.standardize`, the same float32 operations, so
    the same bits as a scaled copy), and the forward passes over them scale each chunk. A scaled
    copy of 800,000 rows of 16 inputs took 0.03 s before a job was accepted, and 51 MB more of the
    coordinator's memory for as long as it ran."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    scaling: dict[str, np.ndarray] = {}
    if scale_modes is None:
        scale_modes = ["standardize" if options.standardize else "none"] * x.shape[1]
    if len(scale_modes) != x.shape[1]:
        raise InvalidArgument(f"{len(scale_modes)} scale modes for {x.shape[1]} input columns")
    if any(m != "none" for m in scale_modes):
        scaling["x_mean"], scaling["x_std"] = preprocess.fit_scaling(x, scale_modes, rows)
    if spec.task == "classification":
        y = np.asarray(y, dtype=np.int32).reshape(-1)
    else:
        y = np.asarray(y, dtype=np.float32).reshape(-1, 1)
        if options.standardize:
            std = float(y.std(dtype=np.float64)) or 1.0      # float64: squares of labels near 1e30 overflow float32
            scaling["y_mean"] = np.array([y.mean(dtype=np.float64)], dtype=np.float32)
            scaling["y_std"] = np.array([std], dtype=np.float32)
            y = ((y - scaling["y_mean"]) / scaling["y_std"]).astype(np.float32)
    return x, np.ascontiguousarray(y), scaling


def _scaled(scaling: dict, x: np.ndarray, y: np.ndarray, task: str) -> tuple[np.ndarray, np.ndarray]:
    """Held-out rows scaled with the training rows' ``scaling``: x (N, F) float32, y (N,) int32
    class indices or (N, 1) float32 scaled targets."""
    x = models.standardize(scaling, x)
    if task == "classification":
        return np.ascontiguousarray(x), np.asarray(y, np.int32).reshape(-1)
    y = np.asarray(y, np.float32).reshape(-1, 1)
    if "y_mean" in scaling:
        y = ((y - scaling["y_mean"]) / scaling["y_std"]).astype(np.float32)
    return np.ascontiguousarray(x), y