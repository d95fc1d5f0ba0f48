"""The cost model: how long a swap takes, measured on this machine when the coordinator starts.

TENSILE hard-codes a host/device bandwidth (12 MB/ms); here both directions are measured through
the same transfer engine that performs the swaps (a copy thread on ``cpu``, the copy stream with
pinned host buffers on ``cuda``). The cost of recomputing a tensor is the measured time of the
ops that produce it (:mod:`tensile_db.scheduler.trace`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Bandwidths in bytes per second, and a fixed latency per transfer in seconds. ``duplex``:
    swap-outs and swap-ins run on separate copy engines and overlap each other (a GPU's copy
    engines, the simulated device's); else they share one channel (``cpu``'s copy thread)."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    latency_s: float = 0.0
    duplex: bool = False

    def swap_in_s(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` host -> device."""
        return self.latency_s + nbytes / self.h2d_bytes_per_s

    def swap_out_s(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` device -> host."""
        return self.latency_s + nbytes / self.d2h_bytes_per_s


def measure_bandwidth(device, engine, nbytes: int = 16 << 20, repeats: int = 3) -> CostModel:
    """Measure host<->device bandwidth through ``engine`` (a
    :class:`~tensile_db.memory.transfer.TransferEngine`): the best of ``repeats`` copies of
    ``nbytes`` bytes each way, and the latency (best of a 512-byte copy each way); the bandwidth
    is the slope between the two sizes, or ``nbytes`` over the large copy's time when noise makes
    the slope meaningless. Returns a :class:`CostModel`.
    """
    host = device.host_empty((nbytes,), np.uint8)
    host[...] = 1
    dev = device.arena_buffer(nbytes)

    def best(copy) -> float:
        times = []
        for _ in range(repeats):
            start = device.now()
            copy().wait()
            times.append(device.now() - start)
        return min(times)

    h2d = best(lambda: engine.to_device(host, dev))
    d2h = best(lambda: engine.to_host(dev))
    small_host, small_dev = host[:512], dev[:512]
    latency = min(best(lambda: engine.to_device(small_host, small_dev)), best(lambda: engine.to_host(small_dev)))
    def bandwidth(seconds: float) -> float:
        if seconds > 2 * latency:
            return (nbytes - 512) / (seconds - latency)
        return nbytes / seconds

    return CostModel(h2d_bytes_per_s=bandwidth(h2d), d2h_bytes_per_s=bandwidth(d2h), latency_s=latency,
                     duplex=engine.duplex)
