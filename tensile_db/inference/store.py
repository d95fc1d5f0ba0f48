"""The served models: each version's weights in a file on disk, one read-only manager tensor per
layer with weights, whose values are read from the file when the layer is loaded.

A served model is the registry row ``tensile.models`` (id, created_at) a backend read in its own
snapshot; replacing a model gives the row a new id, so a call holds one :class:`ServedModel` from
start to end and sees the old model or the new one, whole. Layers of two versions never mix:
every layer tensor belongs to exactly one ServedModel.

The *layers* of a served model are the nodes of its network that hold weights
(:attr:`~tensile_db.runtime.network.Network.layered`: dense layers, convolutions, batch
normalisations; the output layer last); pooling, flatten, activation, add and concatenation
nodes have none. A layer's arrays (:attr:`~tensile_db.runtime.network.Node.weights`: a dense
layer's ``W{i}`` (I, O) and ``b{i}`` (O,), a convolution's ``W{i}`` and optional ``b{i}``, batch
normalisation's ``gamma{i}``, ``beta{i}``, ``mean{i}``, ``var{i}`` (C,)) are packed, in that order,
into one float32 region of the version's *model file* (:mod:`.files`), written once when the
first call sends the weights; :meth:`ServedModel.split` gives them back by name as views of the
packed array. Each layer is one read-only tensor of the memory manager under
:data:`~tensile_db.inference.INFERENCE_JOB` whose values live in its region
(:meth:`~tensile_db.memory.manager.MemoryManager.adopt_source`): loading it reads the region into
its arena block and verifies the region's checksum. The store holds none of a layer's bytes in
host memory; the manager may keep a host copy as a cache within its host budget. A layer's
device copy is the *weight cache*: loaded by the calls that need it, kept while the budget
allows, and evicted before anything else when room is needed (:mod:`tensile_db.memory.cache`,
Note [Eviction order] in :mod:`tensile_db.memory.eviction`).

A version is served from memory when a call has opened it, else from its file (a later call, or
a call after the coordinator restarted), else the caller sends its weights (:meth:`ModelStore.add`).
A file found corrupt on a read is deleted and its model forgotten (:meth:`ModelStore.discard`), so
the next call sends the weights again. A backend sends only the deployed version of a name, so
when a version arrives, every other version of that name in its database is *retired* (a newer
one, or an older one deployed again by a rollback): it is forgotten and its file deleted as soon
as no call uses it. The store keeps at most :data:`MAX_OPEN_MODELS` models open that no call uses
(least recently used closed first; their files stay), and at most :data:`FILES_LIMIT_NBYTES` of
model files (least recently used deleted first, never one a call uses).
"""

from __future__ import annotations

import collections
import math
import os
import threading
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..memory.manager import MemoryManager, Tensor
from ..runtime import model as models
from ..runtime.network import Node
from ..runtime.program import Kind
from . import INFERENCE_JOB
from .files import ModelFile, ModelFiles, bounce_nbytes

#: Bytes of model files kept in the models directory; beyond it the least recently used files no
#: call uses are deleted (a later call on such a version sends its weights again).
FILES_LIMIT_NBYTES = 16 << 30
#: Served models kept open (a file descriptor and one registered tensor per layer each) while no
#: call uses them; beyond it the least recently used are closed, their files kept.
MAX_OPEN_MODELS = 64


@dataclass(eq=False)
class ServedModel:
    """One version of a registry model, ready to serve. ``layers[i]`` is the read-only tensor of
    ``nodes[i]``, the ``i``-th node with weights (output layer last), read from ``file``;
    ``scaling`` holds ``x_mean`` / ``x_std`` (F,) and, for regression, ``y_mean`` / ``y_std``
    (1,), float32."""

    id: int
    version: str
    name: str
    spec: models.ModelSpec
    scaling: dict[str, np.ndarray]
    file: ModelFile
    layers: list[Tensor] = field(default_factory=list)
    database: int = 0                  # oid of the database whose registry holds it
    users: int = 0                     # calls holding it
    retired: bool = False              # another version of the name arrived since (the deployed one)

    @property
    def key(self) -> tuple[int, str]:
        return self.id, self.version

    @property
    def corrupt(self) -> bool:
        """Whether a read found the model's file corrupt (the file is then deleted)."""
        return self.file.corrupt

    @property
    def host_nbytes(self) -> int:
        """Bytes the model holds in host memory: its scaling arrays (its layers are in its file)."""
        return sum(a.nbytes for a in self.scaling.values())

    @cached_property
    def nodes(self) -> list[Node]:
        """The network's nodes that hold weights, in execution order, output layer last."""
        return self.spec.network.layered

    def split(self, i: int, packed) -> dict:
        """Layer ``i``'s arrays by name (``nodes[i].weights``: name -> shape, float32) as views of
        its packed 1-D array of :meth:`packed_numel` elements (host or device)."""
        arrays, start = {}, 0
        for name, shape in self.nodes[i].weights.items():
            numel = math.prod(shape)
            arrays[name] = packed[start:start + numel].reshape(shape)
            start += numel
        return arrays

    def packed_numel(self, i: int) -> int:
        """Elements of layer ``i``'s packed array: all of its arrays."""
        return sum(math.prod(shape) for shape in self.nodes[i].weights.values())


class ModelStore:
    """The served models of one coordinator, by (id, version), and their files in ``models_dir``
    (None: a private temporary directory, removed with the store). Thread-safe."""

    def __init__(self, manager: MemoryManager, models_dir: str | None = None,
                 files_limit_nbytes: int = FILES_LIMIT_NBYTES, max_open_models: int = MAX_OPEN_MODELS):
        self.manager = manager
        self.files = ModelFiles(models_dir)
        self.files_limit_nbytes = files_limit_nbytes
        self.max_open_models = max_open_models
        # (id, version) -> model, least recently used first; guarded by _lock, and so is every model's users
        self._models: collections.OrderedDict[tuple[int, str], ServedModel] = collections.OrderedDict()
        # path -> bytes of the model files no served model holds open, least recently used first; guarded by _lock
        self._closed: collections.OrderedDict[str, int] = collections.OrderedDict(self.files.listing())
        self._lock = threading.Lock()

    def checkout(self, model_id: int, version: str, name: str | None = None, spec: models.ModelSpec | None = None,
                 database: int = 0) -> ServedModel | None:
        """The served model, held for a call until :meth:`checkin`: open already, or (given its
        ``name`` and ``spec``) opened from its file. None when neither holds it: the caller then
        sends its weights to :meth:`add`. A file that does not match ``spec`` is deleted."""
        with self._lock:
            m = self._hold((model_id, version))
            if m is not None or spec is None:
                return m
            file = self.files.open(model_id, version, name, spec)
            self._closed.pop(self.files.path(model_id, version), None)
            return self._serve(model_id, version, name, spec, file, database) if file is not None else None

    def get(self, model_id: int, version: str) -> ServedModel | None:
        """The served model if held here, without checking it out (to inspect ``users``)."""
        with self._lock:
            return self._models.get((model_id, version))

    def has_file(self, model_id: int, version: str) -> bool:
        """Whether the models directory has a file of the version (open or not)."""
        return os.path.exists(self.files.path(model_id, version))

    def _hold(self, key: tuple[int, str]) -> ServedModel | None:
        m = self._models.get(key)
        if m is not None:
            m.users += 1
            self._models.move_to_end(key)
        return m

    def add(self, model_id: int, version: str, name: str, spec: models.ModelSpec, weights,
            database: int = 0) -> ServedModel:
        """Serve a model from its weight arrays (``runtime.model`` names) and hold it for a call:
        its file is written (:meth:`ModelFiles.write <.files.ModelFiles.write>`: ``weights`` is a
        mapping of name -> array, or a stream of them received one at a time) and opened.
        ``version`` must name the row's contents across the cluster (the backend puts the
        database, the owner and ``created_at`` in it). Raises CorruptModel if an array is missing,
        extra, misshapen or not finite; no file is left behind then."""
        pending = self.files.write(model_id, version, name, spec, weights)
        with self._lock:
            held = self._hold((model_id, version))
            if held is not None:                  # another call added it meanwhile
                self.files.discard(pending)
                return held
            file = self.files.commit(pending, spec)
            self._closed.pop(file.path, None)
            return self._serve(model_id, version, name, spec, file, database)

    def _serve(self, model_id: int, version: str, name: str, spec: models.ModelSpec, file: ModelFile,
               database: int) -> ServedModel:
        """Register ``file``'s layers with the manager and hold the model for a call (the lock is held)."""
        m = ServedModel(model_id, version, name, spec, file.scaling, file, database=database, users=1)
        for i, node in enumerate(m.nodes):
            m.layers.append(self.manager.adopt_source(INFERENCE_JOB, f"{name}#{model_id}/layer{node.index}",
                                                      Kind.WEIGHT, (m.packed_numel(i),), np.float32, file.source(i)))
        for other in self._models.values():       # a backend sends only the deployed version, so
            if (other.database, other.name) == (database, name) and other.id != model_id:   # the newest sent wins
                other.retired = True
        self._models[m.key] = m
        self._trim()
        return m

    def checkin(self, m: ServedModel) -> None:
        """A call is done with ``m``."""
        if m.corrupt:                   # its file went under a call that did not fail: never serve it again
            self.discard(m)
        with self._lock:
            m.users -= 1
            if not m.users and self._models.get(m.key) is not m:      # discarded while in use
                self._forget(m)
            self._trim()

    def discard(self, m: ServedModel) -> None:
        """A read found ``m``'s file corrupt: no call checks it out again (the next one sends
        the weights), its file is deleted, and it is forgotten once no call uses it."""
        with self._lock:
            if self._models.get(m.key) is m:
                del self._models[m.key]
            self.files.remove(m.file)
            if not m.users:
                self._forget(m)

    def retire(self, database: int, name: str, keep: int | None = None) -> int:
        """Retire every served version of model ``name`` of ``database`` but the one of registry id
        ``keep`` (after a drop: all of them; after a deployment or a replacement: all but the one
        deployed now): each is forgotten, its layers leaving the device weight cache and the host
        cache and its file deleted, at once or, for one a call uses, when that call ends. Returns
        how many were retired."""
        with self._lock:
            retired = [m for m in self._models.values() if (m.database, m.name) == (database, name) and m.id != keep]
            for m in retired:
                m.retired = True
            self._trim()
            return len(retired)

    def describe(self) -> dict:
        """Figures for ``tensile.memory``: the models served (open), the host bytes the store
        holds (their scaling arrays and the read buffers; the layers are in their files) and the
        bytes of the model files in the models directory."""
        with self._lock:
            return {"served_models": len(self._models),
                    "served_host_nbytes": sum(m.host_nbytes for m in self._models.values()) + bounce_nbytes(),
                    "served_file_nbytes": sum(m.file.nbytes for m in self._models.values())
                    + sum(self._closed.values())}

    def _trim(self) -> None:
        for key, m in list(self._models.items()):
            if m.retired and not m.users:
                del self._models[key]
                self._forget(m, delete=True)
        unused = [key for key, m in self._models.items() if not m.users]       # least recently used first
        for key in unused[:max(0, len(self._models) - self.max_open_models)]:
            m = self._models.pop(key)
            self._forget(m)
            self._closed[m.file.path] = m.file.nbytes
        on_disk = sum(self._closed.values()) + sum(m.file.nbytes for m in self._models.values())
        while on_disk > self.files_limit_nbytes and self._closed:
            path, nbytes = self._closed.popitem(last=False)
            self.files.remove_path(path)
            on_disk -= nbytes
        for key, m in list(self._models.items()):
            if on_disk <= self.files_limit_nbytes:
                break
            if not m.users:
                del self._models[key]
                self._forget(m, delete=True)
                on_disk -= m.file.nbytes

    def _forget(self, m: ServedModel, delete: bool = False) -> None:
        """Free ``m``'s tensors and close its file (deleting it with ``delete``)."""
        for t in m.layers:
            self.manager.free(t)
        m.file.close()
        if delete:
            self.files.remove(m.file)
