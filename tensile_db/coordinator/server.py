"""The coordinator server: one process per cluster, driving one device or several
(``tensile.devices``), each with its own budget, arena, memory manager, executor and plans; a
training job, a search trial or a predict call runs on the device :mod:`.placement` chooses for
it. Each device serves predict calls from its own model store: the first keeps its files in the
models directory, each other one in a subdirectory named after it.

It listens on ``<socket_dir>/coordinator.sock`` (``socket_dir`` is 0700, so only processes of
the PostgreSQL OS user can connect; see :mod:`.address`) and serves each backend connection on
its own thread. Only one coordinator runs per ``socket_dir``: it holds an exclusive ``flock`` on
``coordinator.lock`` for its lifetime, and writes its pid there, so two backends racing to start
one cannot both win, and a backend that waits too long can say what the coordinator is doing.
Models larger than the :class:`~tensile_db.runtime.model.Limits` it was started with are refused
before anything is built for them.
Given the postmaster's pid file, it polls the postmaster's pid twice a second and exits when the
server has gone, taking every job with it.

Requests (``type`` in the header): ``ping`` (answered with the pid and ``devices``, each device's
budget by name), ``jobs`` (a row of ``tensile.jobs`` per job of every device), ``memory`` (a row
of ``tensile.memory`` per device, in ``devices``), ``train`` and ``search``
(:mod:`.training`: features and labels as arrays; answered by ``accepted``, ``progress`` per
epoch, a ``trial`` message per trial of a search, then ``result``, or ``error``; a ``cancel``
message or a closed connection cancels the job or every trial),
``predict`` (features ``x`` and the registry row's id, version and architecture; answered by
``need_weights`` when this coordinator has that version neither open nor in its model file — the
backend then sends ``weights``, written to the file array by array as they arrive — then
``accepted`` and ``result`` with the ``outputs`` array, or ``error``, or ``reload`` when a layer
read from the model's file was corrupt: the file is deleted and the backend repeats the call,
sending the weights again; a ``cancel`` message or a closed connection stops the call between two
layers), and ``shutdown``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Listener

import numpy as np

from .. import settings
from ..dirs import secure_dir
from ..errors import CorruptModel, InvalidArgument, JobCancelled, ProtocolError, TensileError
from ..inference.service import InferenceService
from ..inference.store import FILES_LIMIT_NBYTES
from ..memory.manager import MemoryManager
from ..memory.spill import SpillDir
from ..runtime import model as models
from ..runtime.devices import kind_and_index, make_device
from ..scheduler import worker
from . import placement, protocol, reports
from .address import LOCK_NAME, SOCKET_NAME, resident_set, socket_address
from .executor import Executor
from .training import TrainingService

log = logging.getLogger(__name__)

#: Connections the listener queues before the coordinator accepts them.
BACKLOG = 128
#: Seconds the start waits for the planning process to be ready before it serves (Note [Quiet once
#: serving] in :meth:`Coordinator.start`).
PLANNER_READY_S = 30.0


class Coordinator:
    """The server. ``serve_forever()`` blocks; returns False at once if another holds the lock.

    ``device`` is the one device it drives unless ``devices`` lists several (names of
    :func:`tensile_db.settings.parse_devices`: ``cpu:0``). ``budget_nbytes`` is every device's
    budget, or a sequence of one per device; ``max_active_jobs`` and ``max_pressure`` (Note
    [Admission by memory pressure]; None: no bound) hold per device; the host
    budget is shared, an equal part to each device's manager. ``policy`` is the scheduler policy,
    one of ``tensile_db.settings.POLICIES``; the executor raises InvalidArgument for another when
    the server starts. ``pool`` is one of ``tensile_db.settings.POOLS``.

    Raises:
        InvalidArgument: a budget count that is not one or one per device.
    """

    def __init__(self, socket_dir: str, device: str = settings.DEFAULT_DEVICE,
                 budget_nbytes: int | Sequence[int] = settings.DEFAULT_BUDGET_NBYTES,
                 max_active_jobs: int = settings.DEFAULT_MAX_ACTIVE_JOBS, postmaster_pid_file: str | None = None,
                 policy: str = settings.DEFAULT_POLICY, pool: str = settings.DEFAULT_POOL,
                 limits: models.Limits = models.Limits(),
                 host_budget_nbytes: int | None = settings.DEFAULT_HOST_BUDGET_NBYTES, spill_dir: str | None = None,
                 devices: Sequence[str] = (), max_pressure: float | None = settings.DEFAULT_MAX_PRESSURE):
        self.device_names = list(devices) or [device]
        budgets = [budget_nbytes] if isinstance(budget_nbytes, int) else list(budget_nbytes)
        if len(budgets) not in (1, len(self.device_names)):
            raise InvalidArgument(f"{len(budgets)} device budgets for {len(self.device_names)} devices "
                                  f"({', '.join(self.device_names)}); give one for all or one per device")
        self.budgets_nbytes = budgets * len(self.device_names) if len(budgets) == 1 else budgets
        self.socket_dir = secure_dir(socket_dir, "socket directory")
        self.host_budget_nbytes = host_budget_nbytes
        self.spill_root = spill_dir or os.path.join(self.socket_dir, settings.DEFAULT_SPILL_SUBDIR)
        self.models_dir = os.path.join(self.socket_dir, "models")    # the served models' files
        self.spill: SpillDir | None = None
        self.limits = limits
        self.max_active_jobs = max_active_jobs
        self.max_pressure = max_pressure
        self.policy = policy
        self.pool = pool
        self.postmaster_pid_file = postmaster_pid_file
        self.started_at = time.time()
        self.executors: list[Executor] = []     # one per device, in the order listed
        self.inference: list[InferenceService] = []     # one per device, as executors
        self.training: TrainingService | None = None
        self._lock_fd: int | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self.socket_dir, SOCKET_NAME)

    def serve_forever(self) -> bool:
        """Start (:meth:`start`), then accept connections until the process exits; False at once
        when another coordinator holds the lock."""
        listener = self.start()
        if listener is None:
            return False
        self.serve(listener)

    def serve(self, listener: Listener) -> None:
        """Accept connections on ``listener`` (:meth:`start`'s), each served on its own thread,
        until the process exits."""
        while True:
            conn = listener.accept()
            threading.Thread(target=self._serve, args=(conn,), name="tensile-conn", daemon=True).start()

    def start(self) -> Listener | None:
        """Take the lock, make the device, the spill directory, the manager and the services, and
        listen; None when another coordinator holds the lock. Raises what stops the start (an
        unusable spill directory, a device that cannot be opened)."""
        self._lock_fd = os.open(os.path.join(self.socket_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another coordinator holds %s; exiting", LOCK_NAME)
            return None
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        self.spill = SpillDir(self.spill_root)          # removes what dead coordinators left
        host_share = None if self.host_budget_nbytes is None else self.host_budget_nbytes // len(self.device_names)
        for name, budget in zip(self.device_names, self.budgets_nbytes):
            device = make_device(*kind_and_index(name))
            with device.using():           # its arena, copy streams and the bandwidth probe on that GPU
                manager = MemoryManager(device, budget, pool=self.pool, host_budget_nbytes=host_share,
                                        spill=self.spill)
                device.route_allocations(manager)
                self.executors.append(Executor(manager, self.max_active_jobs, policy=self.policy, name=name,
                                               max_pressure=self.max_pressure))
        for executor in self.executors:
            executor.start()
        for directory, executor in zip(self._model_dirs(), self.executors):
            self.inference.append(InferenceService(executor.manager, secure_dir(directory, "model directory"),
                                                   FILES_LIMIT_NBYTES // len(self.executors)))
        self.training = TrainingService(self.executors, self.limits, self.policy)
        # Note [Quiet once serving]: the planning process's start (a new interpreter importing the
        # package: about 0.7 s of CPU here) finishes before the first request, not beside it: a
        # training started just after the coordinator read its rows 0.1 to 0.2 s slower with it.
        if not worker.shared().ready(PLANNER_READY_S):
            log.warning("the planning process was not ready after %s s; serving without waiting for it",
                        PLANNER_READY_S)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)          # stale: we hold the lock, nobody serves it
        with socket_address(self.socket_dir) as address:
            listener = Listener(address, family="AF_UNIX", backlog=BACKLOG)
            os.chmod(address, 0o600)
        if self.postmaster_pid_file:
            threading.Thread(target=self._watch_postmaster, name="tensile-watch", daemon=True).start()
        log.info("coordinator %d serving %s on %s, budgets %s bytes, policy %s, pool %s", os.getpid(),
                 self.socket_path, ", ".join(self.device_names), ", ".join(map(str, self.budgets_nbytes)),
                 self.policy, self.pool)
        return listener

    def _model_dirs(self) -> list[str]:
        """Each device's directory of model files: the models directory for the first, a
        subdirectory named after the device for each other (``models/cpu-1``). Subdirectories of
        devices no longer listed are removed, with their files."""
        secure_dir(self.models_dir, "model directory")
        dirs = [self.models_dir] + [os.path.join(self.models_dir, e.name.replace(":", "-")) for e in self.executors[1:]]
        for entry in os.scandir(self.models_dir):
            if entry.is_dir(follow_symlinks=False) and entry.path not in dirs:
                shutil.rmtree(entry.path, ignore_errors=True)
        return dirs

    # -- lifecycle ----------------------------------------------------------------------------

    def _watch_postmaster(self) -> None:
        while True:
            time.sleep(0.5)
            try:
                with open(self.postmaster_pid_file) as f:
                    pid = int(f.readline())
                os.kill(pid, 0)
            except (OSError, ValueError):
                self._exit("the postmaster has exited")

    def _exit(self, why: str) -> None:
        log.info("coordinator exiting: %s", why)
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass
        if self.spill is not None:
            self.spill.close()
        os._exit(0)

    # -- requests -----------------------------------------------------------------------------

    def _serve(self, conn) -> None:
        try:
            while True:
                header, arrays = protocol.recv(conn)
                kind = header["type"]
                if header.get("accepts_shared") is True:       # Note [Shared arrays]
                    protocol.accept_shared(conn)
                try:
                    if kind == "train":
                        self.training.train(conn, header, arrays)
                    elif kind == "search":
                        self.training.search(conn, header, arrays)
                    elif kind == "predict":
                        self._predict(conn, header, arrays)
                    elif kind == "ping":
                        protocol.send(conn, {"type": "pong", "pid": os.getpid(), "accepts_shared": True,
                                             "shared_files": protocol.MAX_SHARED_FILES, "rows": True, "devices": {
                            e.name: e.manager.budget_nbytes for e in self.executors}})
                    elif kind == "jobs":
                        protocol.send(conn, {"type": "jobs", "jobs": [reports.as_dict(j.describe(e.manager, e.name))
                                                                      for e in self.executors for j in e.jobs()]})
                    elif kind == "retire":
                        retired = sum(i.store.retire(int(header["database"]), str(header["name"]), header.get("keep"))
                                      for i in self.inference)
                        protocol.send(conn, {"type": "retired", "count": retired})
                    elif kind == "memory":
                        protocol.send(conn, {"type": "memory", "devices": [reports.as_dict(self.memory_report(e))
                                                                           for e in self.executors]})
                    elif kind == "shutdown":
                        protocol.send(conn, {"type": "ok", "pid": os.getpid()})
                        self._exit("asked to shut down")
                    else:
                        raise ProtocolError(f"unknown request type {kind!r}")
                except TensileError as exc:
                    protocol.send_error(conn, exc)
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("connection failed")
        finally:
            conn.close()

    def memory_report(self, executor: Executor) -> reports.MemoryRow:
        """The row of ``tensile.memory`` of ``executor``'s device: its manager's counters (per job
        too), its scheduler's figures (policy, bandwidths, plans) and its inference service's.
        Raises TypeError when a producer's figures no longer match the record's fields."""
        snap = executor.manager.snapshot()
        jobs = {j.id: j for j in executor.jobs()}
        per_job = {str(jid): dict(c, model_name=jobs[jid].info.model_name, role=jobs[jid].info.role)
                   for jid, c in snap.pop("jobs").items() if jid in jobs}
        inference = self.inference[self.executors.index(executor)].describe()
        return reports.MemoryRow(
            **dict(snap, device=executor.name), **executor.describe(), **inference, per_job=per_job,
            started_at=self.started_at, running_jobs=sum(j.state.value == "running" for j in jobs.values()),
            queued_jobs=sum(j.state.value == "queued" for j in jobs.values()),
            **dict(zip(("rss_nbytes", "peak_rss_nbytes"), resident_set())))

    def _predict(self, conn, header: dict, arrays: dict) -> None:
        """One ``predict`` call, run on this connection's thread (see the module docstring), on
        the device placement chooses for it."""
        call = _PredictCall.parse(header, arrays)
        self.limits.check(call.spec, call.name)
        service = self.inference[placement.choose_for_predict(self.executors, self.inference, call.model_id,
                                                              call.version)]
        with service.manager.device.using():       # the connection's thread works on that device
            self._run_predict(conn, service, call)

    def _run_predict(self, conn, service: InferenceService, call: "_PredictCall") -> None:
        model_id, version, name, spec, database = call.model_id, call.version, call.name, call.spec, call.database
        model = service.store.checkout(model_id, version, name, spec, database)
        if model is None:                   # neither open nor in a file: the backend sends the weights
            protocol.send(conn, {"type": "need_weights"})
            reply, weights = protocol.recv_stream(conn)
            with weights:                   # written to the model's file array by array as they arrive
                if reply["type"] != "weights":
                    raise ProtocolError(f"expected the model's weights, got a {reply['type']!r} message")
                model = service.store.add(model_id, version, name, spec, weights, database)

        def cancelled() -> bool:
            if not conn.poll(0):
                return False
            message, _ = protocol.recv(conn)
            if message["type"] != "cancel":
                raise ProtocolError(f"unexpected {message['type']!r} message during a predict call")
            return True

        def accepted(call_id: int, effective_window: int, batches: int) -> None:
            protocol.send(conn, {"type": "accepted", "call_id": call_id, "window": effective_window,
                                 "layers": len(model.layers), "batches": batches})

        try:
            outputs, stats = service.predict(model, call.x, call.window, call.batch_size, call.cache, cancelled, accepted)
        except JobCancelled:
            log.info("predict call on model %r cancelled by its backend", name)
            raise
        except CorruptModel as exc:
            if not model.corrupt:
                raise
            # Its file was deleted and the model forgotten; nothing was returned yet, so the
            # backend reads the weights from the registry again and repeats the call.
            protocol.send(conn, {"type": "reload", "message": str(exc)})
            return
        protocol.send(conn, {"type": "result", "stats": stats.to_json()}, {"outputs": outputs})


@dataclass(frozen=True)
class _PredictCall:
    """A ``predict`` request: features ``x`` ((N, F) float32), the model's registry id, version,
    name, spec and database, and the call's window, batch size and whether to cache its layers."""

    x: np.ndarray
    spec: models.ModelSpec
    model_id: int
    version: str
    name: str
    database: int
    window: object
    batch_size: int | None
    cache: bool

    @classmethod
    def parse(cls, header: dict, arrays: dict) -> "_PredictCall":
        """Raises ProtocolError for a request without a field or with features of another kind."""
        try:
            x = arrays["x"]
            if x.ndim != 2 or x.dtype != np.float32:
                raise ProtocolError(f"predict request with features {x.dtype} {x.shape}")
            spec = models.ModelSpec.parse(header["architecture"], x.shape[1], header["n_outputs"], header["task"])
            return cls(x, spec, int(header["model_id"]), str(header["model_version"]), str(header["model_name"]),
                       int(header.get("database", 0)), header["window"], header["batch_size"],
                       bool(header.get("cache", True)))
        except KeyError as exc:
            raise ProtocolError(f"predict request without {exc}") from None
