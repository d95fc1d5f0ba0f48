"""Pins: which threads' ops hold which tensors, and how an acquire waits for other threads' pins.

Several threads may run ops at once (the executor and the inference calls), each on the tensors
its acquire pinned. An acquire with ``wait=True`` that finds the free space held by tensors
another thread's op has pinned waits for those pins to go, instead of failing, and while it waits
it *drains*: other threads' new waiting acquires hold back, so the pins in the way cannot keep
coming back. Only callers that hold no pins and are inside no other manager operation may wait (an
op's own acquire, not a library temporary allocated during an op), so pins always go and no two
threads wait for each other.
"""

from __future__ import annotations

import threading
import time

from ..errors import DeviceOutOfMemory
from .tensors import Tensor

#: How long an acquire waits for other threads' ops to release the blocks it needs, seconds,
#: before it raises DeviceOutOfMemory.
PIN_WAIT_S = 60.0


class Pins:
    """The pins of one memory manager's tensors (each tensor's ``pins`` and ``pin_owners``) and the
    thread that drains (``drainer``). Every method is called with the manager's ``lock`` held; the
    condition :attr:`released`, on that lock, is notified when pins or blocks go."""

    def __init__(self, lock: threading.RLock):
        self.drainer: int | None = None
        self.released = threading.Condition(lock)

    def pin(self, tensors: list[Tensor]) -> None:
        """Pin ``tensors`` for the calling thread."""
        me = threading.get_ident()
        for t in tensors:
            t.pins += 1
            t.pin_owners.append(me)

    def unpin(self, tensors: list[Tensor]) -> None:
        """Take one of the calling thread's pins (another's, if it holds none) off each tensor.
        Raises AssertionError for an unpinned one."""
        me = threading.get_ident()
        for t in tensors:
            assert t.pins > 0, f"unpin of unpinned tensor {t.slot}"
            t.pins -= 1
            t.pin_owners.remove(me if me in t.pin_owners else t.pin_owners[0])
        self.released.notify_all()

    def held_elsewhere(self, tensors) -> bool:
        """Whether an op of another thread pins any of ``tensors`` now."""
        me = threading.get_ident()
        return any(owner != me for t in tensors if t.pins for owner in t.pin_owners)

    def others_drain(self) -> bool:
        """Whether another thread drains: a waiting acquire of this one holds back."""
        return self.drainer not in (None, threading.get_ident())

    def drain(self) -> None:
        """The calling thread drains until :meth:`stop_draining`."""
        self.drainer = threading.get_ident()

    def stop_draining(self) -> None:
        if self.drainer == threading.get_ident():
            self.drainer = None
            self.released.notify_all()

    def deadline(self) -> float:
        """When an acquire that starts waiting now gives up (``time.monotonic``)."""
        return time.monotonic() + PIN_WAIT_S

    def wait(self, deadline: float, need: int, in_use: int, budget: int, what: str) -> None:
        """Wait a little for pins or blocks to go. Raises DeviceOutOfMemory (``need`` bytes, with
        ``in_use`` of ``budget`` allocated) once ``deadline`` (``time.monotonic``) has passed."""
        if time.monotonic() > deadline:
            raise DeviceOutOfMemory(need, in_use, budget, f"{what}, after waiting {PIN_WAIT_S:.0f} s for other ops' "
                                                          "blocks")
        self.released.wait(0.05)
