"""The swap engine: copies between the device arena and host memory, off the compute path.

On ``cpu`` a single copy thread performs the copies (NumPy releases the GIL while copying, so they
overlap the executor's arithmetic on another core). On ``cuda`` copies go to a copy stream per
direction (a GPU has a copy engine for each, so a swap-out and a swap-in run at once) from and to
pinned host buffers; a swap-out first waits (on its copy stream) for the work already queued on
the compute stream, and a :class:`Transfer` completes when its event has. On ``sim`` a copy is
queued on the simulated device's copy engine of its direction
(:mod:`tensile_db.runtime.simulated`) and completes on its virtual clock.

Copies in one direction are issued in order and run one at a time; :attr:`TransferEngine.duplex`
says whether the two directions overlap (``cuda``, ``sim``) or share one channel (``cpu``), which
is how the scheduler's cost model sees the channels (:mod:`tensile_db.scheduler.timeline`).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np

from ..runtime.device import pinned_empty


class Transfer:
    """A copy in flight. ``host`` is the destination host array of a device -> host copy."""

    def __init__(self, done, wait, host: np.ndarray | None = None):
        self._done, self._wait, self.host = done, wait, host

    def done(self) -> bool:
        return self._done()

    def wait(self) -> "Transfer":
        """Block until the copy has completed; returns self."""
        self._wait()
        return self


class TransferEngine:
    """Asynchronous copies for ``device`` (a :class:`~tensile_db.runtime.device.Device`)."""

    def __init__(self, device):
        self.device = device
        self.duplex = device.name != "cpu"     # copies device -> host and host -> device overlap
        if device.name == "cpu":
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensile-copy")
        elif device.name == "cuda":  # pragma: no cover - cuda only
            import cupy
            self._cupy = cupy
            self._streams = {"d2h": cupy.cuda.Stream(non_blocking=True), "h2d": cupy.cuda.Stream(non_blocking=True)}

    def to_host(self, array) -> Transfer:
        """Start copying the device array ``array`` into a new host array (``Transfer.host``)."""
        if self.device.simulated:
            return self._sim_copy("d2h", array, self.device.host_empty(array.shape, array.dtype))
        if self.device.name == "cpu":
            host = np.empty(array.shape, array.dtype)
            future = self._pool.submit(np.copyto, host, array)
            return Transfer(future.done, future.result, host)
        return self._cuda_copy(array, None)  # pragma: no cover - cuda only

    def to_device(self, host: np.ndarray, array, pinned: bool = False) -> Transfer:
        """Start copying ``host`` into the device array ``array`` (same shape and dtype). On
        ``cuda``, ``pinned`` says ``host`` is already page-locked (from
        :meth:`~tensile_db.runtime.device.Device.host_empty`), so it is copied from directly,
        not staged; it must not change until the copy completes."""
        if self.device.simulated:
            return self._sim_copy("h2d", array)
        if self.device.name == "cpu":
            future = self._pool.submit(np.copyto, array, host)
            return Transfer(future.done, future.result)
        return self._cuda_copy(array, host, pinned)  # pragma: no cover - cuda only

    def close(self) -> None:
        if self.device.name == "cpu":
            self._pool.shutdown(wait=True)

    def _sim_copy(self, direction: str, array, host=None) -> Transfer:
        copy, clock = self.device.start_copy(direction, array.nbytes), self.device.clock
        return Transfer(lambda: copy.done, lambda: clock.wait(copy), host)

    def _cuda_copy(self, array, host, host_pinned=False):  # pragma: no cover - cuda only
        cupy = self._cupy
        stream = self._streams["d2h" if host is None else "h2d"]
        queued = cupy.cuda.get_current_stream().record()
        stream.wait_event(queued)
        if host is None:
            pinned = pinned_empty(cupy, array.shape, array.dtype)
            array.get(stream=stream, out=pinned)
        elif host_pinned:
            array.set(host, stream=stream)
        else:
            pinned = pinned_empty(cupy, host.shape, host.dtype)
            pinned[...] = host
            array.set(pinned, stream=stream)
        done = stream.record()

        def wait():
            done.synchronize()
            cupy.cuda.get_current_stream().wait_event(done)

        return Transfer(lambda: done.done, wait, pinned if host is None else None)

