"""The coordinator wire protocol.

Transport: ``multiprocessing.connection`` over a Unix socket in a 0700 directory, using only
``send_bytes`` / ``recv_bytes`` (its ``send`` / ``recv`` would pickle; nothing here unpickles).
A message is one frame holding a UTF-8 JSON header, followed by one frame of raw bytes for each
array the header lists under ``"arrays"`` as ``{"name", "dtype", "shape"}``. Only boolean,
integer and floating dtypes are accepted. Errors travel as ``{"type": "error", "error": <class
name>, "message": ...}`` and are raised again on the other side as the same
:mod:`tensile_db.errors` class.
"""

from __future__ import annotations

import json

import numpy as np

from ..errors import WIRE_ERRORS, DeviceOutOfMemory, ProtocolError, TensileError

_ALLOWED_KINDS = "biuf"


def send(conn, header: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
    """Send a header and named arrays (C-contiguous copies are made where needed). Raises
    ProtocolError, before anything is written, for an array of an unsupported dtype."""
    arrays = {k: np.asarray(v, order="C") for k, v in (arrays or {}).items()}  # keeps 0-d shapes
    for name, a in arrays.items():
        if a.dtype.kind not in _ALLOWED_KINDS:
            raise ProtocolError(f"array {name!r} has unsupported dtype {a.dtype}")
    header = dict(header, arrays=[{"name": k, "dtype": v.dtype.str, "shape": list(v.shape)}
                                  for k, v in arrays.items()])
    conn.send_bytes(json.dumps(header).encode())
    for a in arrays.values():
        conn.send_bytes(a.reshape(-1).view(np.uint8) if a.size else b"")


def recv(conn) -> tuple[dict, dict[str, np.ndarray]]:
    """Receive one message: ``(header, arrays)``. Raises ProtocolError on a malformed message
    and EOFError when the peer has closed."""
    try:
        header = json.loads(conn.recv_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed message header: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("message header must be a JSON object with a string 'type'")
    arrays = {}
    for meta in header.pop("arrays", []):
        try:
            name, dtype, shape = str(meta["name"]), np.dtype(meta["dtype"]), tuple(int(d) for d in meta["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed array description {meta!r}: {exc}") from None
        if dtype.kind not in _ALLOWED_KINDS or any(d < 0 for d in shape):
            raise ProtocolError(f"array {name!r} has unsupported dtype {dtype} or shape {shape}")
        data = conn.recv_bytes()
        if len(data) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ProtocolError(f"array {meta['name']!r}: {len(data)} bytes do not match shape {shape} {dtype}")
        arrays[meta["name"]] = np.frombuffer(data, dtype=dtype).reshape(shape)
    return header, arrays


def send_error(conn, exc: BaseException) -> None:
    """Send ``exc`` as an error message (its class name if it is a wire error, else TensileError).
    An out-of-memory error carries its byte counts as ``fields``."""
    name = type(exc).__name__ if type(exc).__name__ in WIRE_ERRORS else "TensileError"
    message = str(exc) if isinstance(exc, TensileError) else f"internal error in the coordinator: {exc!r}"
    header = {"type": "error", "error": name, "message": message}
    if isinstance(exc, DeviceOutOfMemory):
        header["fields"] = [exc.requested_nbytes, exc.in_use_nbytes, exc.budget_nbytes, exc.what]
    send(conn, header)


def raise_if_error(header: dict) -> dict:
    """Raise the error a header carries, or return the header."""
    if header.get("type") == "error":
        cls = WIRE_ERRORS.get(header.get("error"), TensileError)
        if cls is DeviceOutOfMemory and header.get("fields"):
            raise DeviceOutOfMemory(*header["fields"])
        raise (cls if cls is not DeviceOutOfMemory else TensileError)(header.get("message", "unknown error"))
    return header
