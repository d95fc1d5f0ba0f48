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


def check_weights(spec: ModelSpec, weights: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    """The weights as float32 arrays, checked against ``spec``: exactly the arrays of
    :func:`weight_shapes`, each of that shape, of a floating dtype, with finite values. Raises
    CorruptModel naming the model and the first array that is missing, extra or wrong."""
    shapes = weight_shapes(spec, weights)
    extra = sorted(set(weights) - set(shapes))
    if extra:
        raise CorruptModel(f"model {name!r}: its weights hold arrays the architecture has no use for "
                           f"({', '.join(extra[:5])}); train the model again")
    out = {}
    for key, shape in shapes.items():
        a = weights.get(key)
        if a is None or tuple(a.shape) != shape or a.dtype.kind != "f":
            got = "nothing" if a is None else f"{a.dtype} {tuple(a.shape)}"
            raise CorruptModel(f"model {name!r}: weight {key} must be a float array of shape {shape}, got {got}; "
                               "train the model again")
        a = np.asarray(a, dtype=np.float32)
        if not np.isfinite(a).all():
            raise CorruptModel(f"model {name!r}: weight {key} has NaN or infinite values; train the model again")
        out[key] = a
    return out


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
