"""The served models: weights on the host, one read-only manager tensor per layer with weights.

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
into one flat float32 host buffer (page-locked on ``cuda``), registered with the memory manager as
one read-only tensor under :data:`~tensile_db.inference.INFERENCE_JOB`; :meth:`ServedModel.split`
gives them back by name as views of it, on the host or the device. A layer's device copy is the
*weight cache*: loaded by the calls that need it, kept while the budget allows, and evicted before
anything else when room is needed (:mod:`tensile_db.memory.cache`, Note [Eviction order] in
:mod:`tensile_db.memory.eviction`).

The store keeps the models no call is using up to :data:`HOST_LIMIT_NBYTES` of host memory, least
recently used going first. A backend sends only the deployed version of a name, so when a version
arrives, every other version of that name in its database is *retired* (a newer one, or an older
one deployed again by a rollback): it is forgotten (its host buffers and device copies freed) as
soon as no call uses it.
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..memory.manager import MemoryManager, Tensor
from ..runtime import model as models
from ..runtime.network import Node
from ..runtime.program import Kind
from ..runtime.weights import check_weights
from . import INFERENCE_JOB

#: Host bytes of served models kept while no call uses them.
HOST_LIMIT_NBYTES = 4 << 30


@dataclass(eq=False)
class ServedModel:
    """One version of a registry model, ready to serve. ``layers[i]`` is the read-only tensor of
    ``nodes[i]``, the ``i``-th node with weights (output layer last); ``scaling`` holds ``x_mean``
    / ``x_std`` (F,) and, for regression, ``y_mean`` / ``y_std`` (1,), float32."""

    id: int
    version: str
    name: str
    spec: models.ModelSpec
    scaling: dict[str, np.ndarray]
    layers: list[Tensor] = field(default_factory=list)
    database: int = 0                  # oid of the database whose registry holds it
    users: int = 0                     # calls holding it
    retired: bool = False              # another version of the name arrived since (the deployed one)

    @property
    def host_nbytes(self) -> int:
        return sum(t.nbytes for t in self.layers)

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
    """The served models of one coordinator, by (id, version). Thread-safe."""

    def __init__(self, manager: MemoryManager, host_limit_nbytes: int = HOST_LIMIT_NBYTES):
        self.manager = manager
        self.host_limit_nbytes = host_limit_nbytes
        # (id, version) -> model, least recently used first; guarded by _lock, and so is every model's users
        self._models: collections.OrderedDict[tuple[int, str], ServedModel] = collections.OrderedDict()
        self._lock = threading.Lock()

    def checkout(self, model_id: int, version: str) -> ServedModel | None:
        """The served model, held for a call until :meth:`checkin`; None if not held here (the
        caller then sends its weights to :meth:`add`)."""
        with self._lock:
            return self._hold((model_id, version))

    def get(self, model_id: int, version: str) -> ServedModel | None:
        """The served model if held here, without checking it out (to inspect ``users``)."""
        with self._lock:
            return self._models.get((model_id, version))

    def _hold(self, key: tuple[int, str]) -> ServedModel | None:
        m = self._models.get(key)
        if m is not None:
            m.users += 1
            self._models.move_to_end(key)
        return m

    def add(self, model_id: int, version: str, name: str, spec: models.ModelSpec,
            weights: dict[str, np.ndarray], database: int = 0) -> ServedModel:
        """Serve a model from its weight arrays (``runtime.model`` names) and hold it for a call.
        ``version`` must name the row's contents across the cluster (the backend puts the
        database, the owner and ``created_at`` in it). Raises CorruptModel if an array is missing,
        extra, misshapen or not finite (:func:`~tensile_db.runtime.weights.check_weights`)."""
        arrays = check_weights(spec, weights, name)
        device = self.manager.device
        m = ServedModel(model_id, version, name, spec, {k: v for k, v in arrays.items() if k[0] in "xy"},
                        database=database)
        for i, node in enumerate(m.nodes):
            packed = device.host_empty((m.packed_numel(i),), np.float32)
            for key, view in m.split(i, packed).items():
                view[...] = arrays[key]
            m.layers.append(self.manager.adopt(INFERENCE_JOB, f"{name}#{model_id}/layer{node.index}", Kind.WEIGHT,
                                               packed, readonly=True))
        with self._lock:
            held = self._hold((model_id, version))
            if held is not None:                  # another call added it meanwhile
                self._forget(m)
                return held
            m.users = 1
            for other in self._models.values():       # a backend sends only the deployed version, so
                if (other.database, other.name) == (database, name) and other.id != model_id:   # the newest sent wins
                    other.retired = True
            self._models[(model_id, version)] = m
            self._trim()
            return m

    def checkin(self, m: ServedModel) -> None:
        """A call is done with ``m``."""
        with self._lock:
            m.users -= 1
            self._trim()

    def describe(self) -> dict:
        with self._lock:
            return {"served_models": len(self._models),
                    "served_host_nbytes": sum(m.host_nbytes for m in self._models.values())}

    def _trim(self) -> None:
        for key, m in list(self._models.items()):
            if m.retired and not m.users:
                del self._models[key]
                self._forget(m)
        held = sum(m.host_nbytes for m in self._models.values())
        for key, m in list(self._models.items()):         # least recently used first
            if held <= self.host_limit_nbytes:
                break
            if not m.users:
                del self._models[key]
                self._forget(m)
                held -= m.host_nbytes

    def _forget(self, m: ServedModel) -> None:
        for t in m.layers:
            self.manager.free(t)
