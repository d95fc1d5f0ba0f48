"""A model's weights as stored in ``tensile.models.weights``: a NumPy ``.npz`` archive of float32
arrays (the network's weights, :meth:`.network.Network.weight_shapes`; ``x_mean`` / ``x_std`` (F,),
for regression ``y_mean`` / ``y_std`` (1,); see :mod:`.model`), written with ``numpy.savez`` and read back without pickle.

A row may have been written by anyone who could write the table, so reading checks it against
the architecture before anything is read into memory (:func:`load_weights`), and the arrays
themselves before they are used (:func:`check_weights`); a bad row is :class:`CorruptModel`
naming the model.
"""

from __future__ import annotations

import io
import math
import zipfile

import numpy as np

from ..errors import CorruptModel
from .model import ModelSpec


def serialize_weights(weights: dict[str, np.ndarray]) -> bytes:
    """``numpy.savez`` bytes of the named arrays (loadable with ``allow_pickle=False``)."""
    buf = io.BytesIO()
    np.savez(buf, **weights)
    return buf.getvalue()


#: Bytes an ``.npy`` member may hold beyond its array's data: the format's header.
NPY_HEADER_NBYTES = 4096
#: Optional arrays that come in pairs: the feature scaling (F,) and, for regression, the target's (1,).
_SCALING = (("x_mean", "x_std"), ("y_mean", "y_std"))


def weight_shapes(spec: ModelSpec, names) -> dict[str, tuple[int, ...]]:
    """The arrays a model of ``spec`` consists of and their shapes: every node's weights
    (:meth:`.network.Network.weight_shapes`), and each scaling pair that ``names`` holds part of."""
    shapes = dict(spec.network.weight_shapes())
    names = set(names)
    for pair, shape in zip(_SCALING, ((spec.n_features,), (1,))):
        if names & set(pair) and (pair[0] != "y_mean" or spec.task == "regression"):
            shapes.update({n: shape for n in pair})
    return shapes


def check_declared(spec: ModelSpec, declared, name: str) -> dict[str, tuple[int, ...]]:
    """Check arrays by what they declare, before their values are read: ``declared`` is
    ``(name, dtype, shape)`` for each array, in any order. They must be exactly the arrays of
    :func:`weight_shapes`, each once, of that shape and a floating dtype. Returns
    :func:`weight_shapes`. Raises CorruptModel naming the model and the first array that is
    missing, extra, repeated or wrong (as :func:`check_weights` does)."""
    declared = list(declared)
    names = [key for key, _, _ in declared]
    shapes = weight_shapes(spec, names)
    extra = sorted(set(names) - set(shapes))
    if extra:
        raise CorruptModel(f"model {name!r}: its weights hold arrays the architecture has no use for "
                           f"({', '.join(extra[:5])}); train the model again")
    repeated = sorted({key for key in names if names.count(key) > 1})
    if repeated:
        raise CorruptModel(f"model {name!r}: its weights hold {repeated[0]} more than once; train the model again")
    got = {key: (np.dtype(dtype), tuple(shape)) for key, dtype, shape in declared}
    for key, shape in shapes.items():
        dtype, have = got.get(key, (None, None))
        if dtype is None or have != shape or dtype.kind != "f":
            what = "nothing" if dtype is None else f"{dtype} {have}"
            raise CorruptModel(f"model {name!r}: weight {key} must be a float array of shape {shape}, got {what}; "
                               "train the model again")
    return shapes


def check_array(key: str, a: np.ndarray, name: str) -> np.ndarray:
    """Array ``key`` of model ``name`` as float32 (no copy if it is one), checked for finite
    values (its shape and dtype were checked by :func:`check_declared`). Raises CorruptModel."""
    a = np.asarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise CorruptModel(f"model {name!r}: weight {key} has NaN or infinite values; train the model again")
    return a


def check_weights(spec: ModelSpec, weights: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    """The weights as float32 arrays, checked against ``spec``: exactly the arrays of
    :func:`weight_shapes`, each of that shape, of a floating dtype (:func:`check_declared`), with
    finite values (:func:`check_array`). Raises CorruptModel naming the model and the first array
    that is missing, extra or wrong."""
    shapes = check_declared(spec, ((k, np.asarray(a).dtype, np.shape(a)) for k, a in weights.items()), name)
    return {key: check_array(key, weights[key], name) for key in shapes}


def load_weights(data: bytes, spec: ModelSpec, name: str) -> dict[str, np.ndarray]:
    """Inverse of :func:`serialize_weights`, checked against ``spec`` before anything is read:
    every member of the archive must be one of the spec's arrays, hold no more bytes than that
    array's shape allows, and declare in its ``.npy`` header exactly that shape and a floating
    dtype of at most 8 bytes, so neither a compressed member nor a forged header can make a
    small row allocate gigabytes. Never unpickles. Raises CorruptModel naming the model (see
    also :func:`check_weights`)."""
    def corrupt(what: str) -> CorruptModel:
        return CorruptModel(f"model {name!r}: {what}; train the model again")

    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise corrupt(f"its weights are not a NumPy .npz archive ({exc})") from None
    weights = {}
    with archive:
        arrays = {m.filename.removesuffix(".npy"): m for m in members}
        shapes = weight_shapes(spec, arrays)
        for key, member in arrays.items():
            shape = shapes.get(key)
            if shape is None or not member.filename.endswith(".npy"):
                raise corrupt(f"its weights hold arrays the architecture has no use for ({member.filename})")
            limit = math.prod(shape) * 8 + NPY_HEADER_NBYTES       # float64 at most
            if member.file_size > limit:
                raise corrupt(f"weight {key} holds {member.file_size:,} bytes, more than its shape {shape} "
                              f"allows ({limit:,})")
            try:
                with archive.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                              else np.lib.format.read_array_header_2_0)
                    declared, _, dtype = header(f)
                    if tuple(declared) != shape or dtype.kind != "f" or dtype.itemsize > 8:
                        raise corrupt(f"weight {key} must be a float array of shape {shape}, its header declares "
                                      f"{dtype} {tuple(declared)}")
                with archive.open(member) as f:
                    weights[key] = np.lib.format.read_array(f, allow_pickle=False)
            except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
                raise corrupt(f"weight {key} cannot be read ({exc})") from None
    return check_weights(spec, weights, name)
