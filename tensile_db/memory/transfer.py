"""The swap engine: copies between the device arena, host memory and spill files, off the
compute path.

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
Reads and writes of the disk tier (:mod:`tensile_db.memory.spill`) run on the same copy thread on
``cpu``, so the cost model counts them on the one channel; on ``cuda`` a disk thread does the
file I/O from and to page-locked buffers that the copy streams fill and drain.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np

from ..runtime.device import is_pinned, pinned_empty


class Transfer:
    """A copy in flight. ``host`` is the destination host array of a device -> host copy;
    ``spill`` the destination slot of a device -> disk copy."""

    def __init__(self, done, wait, host: np.ndarray | None = None):
        self._done, self._wait, self.host = done, wait, host
        self.spill: tuple | None = None     # (SpillFile, offset) of a swap-out to the disk tier

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
            self._disk = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensile-disk")
            self._gpu = cupy.cuda.Device()     # the disk thread works on this one
            self._stage = None                 # the disk thread's staging buffer

    def to_host(self, array) -> Transfer:
        """Start copying the device array ``array`` into a new host array (``Transfer.host``)."""
        if self.device.simulated:
            return self._sim_copy("d2h", array, self.device.host_empty(array.shape, array.dtype))
        if self.device.name == "cpu":
            host = np.empty(array.shape, array.dtype)
            future = self._pool.submit(np.copyto, host, array)
            return Transfer(future.done, future.result, host)
        return self._cuda_copy(array, None)  # pragma: no cover - cuda only

    def to_device(self, host: np.ndarray, array) -> Transfer:
        """Start copying ``host`` into the device array ``array`` (same shape and dtype). On
        ``cuda``, a ``host`` in page-locked memory (from
        :meth:`~tensile_db.runtime.device.Device.host_empty` or a swap-out) is copied from
        directly and must not change until the copy completes; any other is staged first."""
        if self.device.simulated:
            return self._sim_copy("h2d", array)
        if self.device.name == "cpu":
            future = self._pool.submit(np.copyto, array, host)
            return Transfer(future.done, future.result)
        return self._cuda_copy(array, host)  # pragma: no cover - cuda only

    def to_disk(self, array, file, offset: int) -> Transfer:
        """Start writing the device array ``array`` (uint8, 1-D) to the spill file ``file`` (a
        :class:`~tensile_db.memory.spill.SpillFile`) at ``offset``. On ``cpu`` the arena block
        itself is written on the copy thread (Note [Spill I/O]); on ``cuda`` the disk thread
        copies it into its page-locked staging buffer, then writes that."""
        if self.device.name == "cpu":
            future = self._pool.submit(file.write_from, offset, array)
            return Transfer(future.done, future.result)
        queued = self._cupy.cuda.get_current_stream().record()  # pragma: no cover - cuda only
        future = self._disk.submit(self._cuda_to_disk, array, file, offset, queued)  # pragma: no cover
        return Transfer(future.done, future.result)  # pragma: no cover - cuda only

    def from_disk(self, read, array) -> Transfer:
        """Start filling the device array ``array`` (uint8, 1-D) by ``read(out)``, which fills a
        host uint8 array of the same length (a spill file's or a model file's read). On ``cpu``
        ``read`` fills the arena block itself on the copy thread; on ``cuda`` the disk thread
        reads into its page-locked staging buffer and copies that in, and the transfer is done
        only once the copy is (the block must not move before)."""
        if self.device.name == "cpu":
            future = self._pool.submit(read, array)
            return Transfer(future.done, future.result)
        future = self._disk.submit(self._cuda_from_disk, read, array)  # pragma: no cover - cuda only
        return Transfer(future.done, future.result)  # pragma: no cover - cuda only

    def _staging(self, nbytes: int):  # pragma: no cover - cuda only
        """The disk thread's page-locked buffer, grown to the largest tensor it has moved: the
        disk tier's pinned memory is one tensor's, whatever the number of copies queued."""
        if self._stage is None or self._stage.size < nbytes:
            self._stage = pinned_empty(self._cupy, (nbytes,), np.uint8)
        return self._stage[:nbytes]

    def _cuda_to_disk(self, array, file, offset: int, queued) -> None:  # pragma: no cover - cuda only
        with self._gpu:
            stream = self._streams["d2h"]
            stream.wait_event(queued)
            stage = self._staging(array.nbytes)
            array.get(stream=stream, out=stage)
            stream.synchronize()
            file.write_from(offset, stage)

    def _cuda_from_disk(self, read, array) -> None:  # pragma: no cover - cuda only
        with self._gpu:
            stage = self._staging(array.nbytes)
            read(stage)
            stream = self._streams["h2d"]
            array.set(stage, stream=stream)
            stream.synchronize()

    def close(self) -> None:
        if self.device.name == "cpu":
            self._pool.shutdown(wait=True)
        elif self.device.name == "cuda":  # pragma: no cover - cuda only
            self._disk.shutdown(wait=True)

    def _sim_copy(self, direction: str, array, host=None) -> Transfer:
        copy, clock = self.device.start_copy(direction, array.nbytes), self.device.clock
        return Transfer(lambda: copy.done, lambda: clock.wait(copy), host)

    def _cuda_copy(self, array, host):  # pragma: no cover - cuda only
        cupy = self._cupy
        stream = self._streams["d2h" if host is None else "h2d"]
        queued = cupy.cuda.get_current_stream().record()
        stream.wait_event(queued)
        if host is None:
            pinned = pinned_empty(cupy, array.shape, array.dtype)
            array.get(stream=stream, out=pinned)
        elif is_pinned(host):
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

