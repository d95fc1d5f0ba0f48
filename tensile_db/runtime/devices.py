"""The devices by name: the one place that knows every device class (:mod:`.device`,
:mod:`.cuda`, :mod:`.simulated`)."""

from __future__ import annotations

from ..errors import InvalidArgument
from .cuda import CudaDevice
from .device import CpuDevice, Device
from .simulated import SimDevice

#: The names ``tensile.device`` accepts (``sim`` too, for benchmarks and tests).
DEVICE_NAMES = ("cpu", "cuda", "sim")


def make_device(name: str, index: int = 0, **sim_options) -> Device:
    """The device named ``name``: ``cpu`` (:class:`~.device.CpuDevice`), ``cuda``
    (:class:`~.cuda.CudaDevice` of GPU ``index``), or ``sim`` (:class:`~.simulated.SimDevice`,
    whose keyword arguments ``sim_options`` are: profile, seed, jitter, first_run_error,
    contention). ``index`` tells one ``cpu`` or ``sim`` device from another only by name.

    Raises:
        InvalidArgument: an unknown name, a simulator option for another device, or ``cuda``
            without CuPy or without a GPU of that index.
    """
    if name == "sim":
        return SimDevice(**sim_options)
    if sim_options:
        raise InvalidArgument(f"options {sorted(sim_options)} apply to the 'sim' device only, not {name!r}")
    if name == "cpu":
        return CpuDevice()
    if name == "cuda":
        return CudaDevice(index)
    raise InvalidArgument(f"unknown device {name!r}; use {', '.join(map(repr, DEVICE_NAMES))}")


def kind_and_index(name: str) -> tuple[str, int]:
    """(kind, index) of the device named ``name``, for :func:`make_device`: ``cpu`` or ``cuda``
    alone (``tensile.device``: index 0), or ``cuda:1`` (from
    :func:`tensile_db.settings.parse_devices`)."""
    kind, _, index = name.partition(":")
    return kind, int(index or 0)
