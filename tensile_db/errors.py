"""The error hierarchy: one root, :class:`TensileError`, and specific subclasses.

Every error carries only plain attributes so that it stays picklable and can cross the
coordinator protocol by class name and message (see ``coordinator/protocol.py``). Messages say
what was wrong, with what value, and what to do.
"""

from __future__ import annotations


class TensileError(Exception):
    """Root of every error raised by tensile_db."""


class InvalidArgument(TensileError):
    """A caller-supplied value (architecture, options, data, name) is not acceptable."""


class ModelNotFound(TensileError):
    """No model of the given name exists in ``tensile.models``."""


class CorruptModel(TensileError):
    """A stored model's weights do not match its architecture (missing, extra, misshapen or
    non-finite arrays, or an archive larger than its shapes allow)."""


class DeviceOutOfMemory(TensileError):
    """A request for device memory cannot be met even after evicting every other tensor.

    Attributes:
        requested_nbytes: bytes asked for (rounded to the arena unit).
        in_use_nbytes: bytes held in the arena at the time of the request.
        budget_nbytes: the arena size.
    """

    def __init__(self, requested_nbytes: int, in_use_nbytes: int, budget_nbytes: int, what: str = ""):
        self.requested_nbytes = requested_nbytes
        self.in_use_nbytes = in_use_nbytes
        self.budget_nbytes = budget_nbytes
        self.what = what
        super().__init__(
            f"device out of memory{' for ' + what if what else ''}: requested {requested_nbytes:,} bytes, "
            f"{in_use_nbytes:,} bytes in use, budget {budget_nbytes:,} bytes; "
            f"raise tensile.device_budget or lower the batch size / layer widths"
        )

    def __reduce__(self):
        return (type(self), (self.requested_nbytes, self.in_use_nbytes, self.budget_nbytes, self.what))


class JobCancelled(TensileError):
    """The job was cancelled by its caller (query cancel, statement timeout, disconnect)."""


class CoordinatorUnavailable(TensileError):
    """The coordinator process could not be reached or started, or did not answer in time.
    ``detail``: more for the SQL error's DETAIL (where to look), or None."""

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = detail


class ConnectionClosed(CoordinatorUnavailable):
    """The coordinator closed a connection before it answered: it exited, or was exiting when the
    connection was made (a killed process whose last thread has not yet ended still queues new
    connections on its socket, and resets them when it ends)."""


class CoordinatorNotRunning(CoordinatorUnavailable):
    """No coordinator listens (and none was to be started)."""


class DiskFull(TensileError):
    """The disk tier has no room: a spill file could not be created or grow (no space left, or a
    quota)."""


class DiskError(TensileError):
    """The disk tier failed otherwise: the spill directory cannot be used, or a spill file's read
    or write failed."""


class ProtocolError(TensileError):
    """A message on the coordinator socket did not follow the protocol."""


#: Errors that may be sent across the coordinator socket by class name.
WIRE_ERRORS = {cls.__name__: cls for cls in (
    TensileError, InvalidArgument, ModelNotFound, CorruptModel, DeviceOutOfMemory, JobCancelled, CoordinatorUnavailable,
    ProtocolError, DiskFull, DiskError,
)}
