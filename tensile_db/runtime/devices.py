"""The devices by name: the one place that knows every device class (:mod:`.device`,
:mod:`.cuda`, :mod:`.simulated`)."""

from __future__ import annotations

from ..errors import InvalidArgument
from .cuda import CudaDevice
from .device import CpuDevice, Device
from .simulated import SimDevice

#: The names ``tensile.device`` accepts (``sim`` too, for benchmarks and tests).
DEVICE_NAMES = ("cpu", "cuda", "sim")


def make_device(name: str, **sim_options) -> Device:
    """The device named ``name``: ``cpu`` (:class:`~.device.CpuDevice`), ``cuda``
    (:class:`~.cuda.CudaDevice`), or ``sim`` (:class:`~.simulated.SimDevice`, whose keyword
    arguments ``sim_options`` are: profile, seed, jitter, first_run_error, contention).

    Raises:
        InvalidArgument: an unknown name, a simulator option for another device, or ``cuda``
            without CuPy.
    """
    if name == "sim":
        return SimDevice(**sim_options)
    if sim_options:
        raise InvalidArgument(f"options {sorted(sim_options)} apply to the 'sim' device only, not {name!r}")
    if name == "cpu":
        return CpuDevice()
    if name == "cuda":
        return CudaDevice()
    raise InvalidArgument(f"unknown device {name!r}; use {', '.join(map(repr, DEVICE_NAMES))}")


def device_kind(name: str, count: int) -> str:
    """The kind (a name for :func:`make_device`) of the device named ``name`` (``cpu``, or
    ``cpu:1`` from :func:`tensile_db.settings.parse_devices`) among ``count`` devices of one
    coordinator.

    Raises:
        InvalidArgument: a CUDA device other than the one current device: each CuPy allocator
            and stream is bound to one GPU, and this coordinator routes CuPy into one arena.
    """
    kind, _, index = name.partition(":")
    if kind == "cuda" and (count > 1 or index not in ("", "0")):
        raise InvalidArgument(f"device {name!r}: one coordinator drives one CUDA device (cuda:0) so far; "
                              "list several cpu devices, or run one cuda device")
    return kind
