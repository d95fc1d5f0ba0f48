"""GPU profiles: the figures of named GPUs that the simulated device (:mod:`.simulated`) runs at.

Every figure from a datasheet names its source beside it. Figures that no datasheet gives (how
close kernels of each class come to the peak, the share of a PCIe link a pinned copy reaches, the
launch latency) are this project's assumptions, the same for every profile and marked as such;
they are the knobs to calibrate against a real GPU when one is lent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidArgument

#: Fraction of the peak FLOP/s each class of kernel reaches (assumption: cuDNN convolutions and
#: cuBLAS products at batch 16 run at roughly half to two thirds of peak; element-wise kernels,
#: the optimizer and the loss are bound by memory bandwidth, for which ``BANDWIDTH_EFFICIENCY``
#: applies).
FLOP_EFFICIENCY = {"conv": 0.5, "matmul": 0.65, "elementwise": 0.5, "optimizer": 0.5, "load": 1.0}
#: Fraction of the memory bandwidth a streaming kernel reaches (assumption; STREAM-like kernels
#: reach 80-90% of HBM peak).
BANDWIDTH_EFFICIENCY = 0.8
#: Fraction of a PCIe link's bandwidth per direction a copy from or to pinned host memory reaches
#: (assumption; ``bandwidthTest`` reaches about 80% on Gen3 to Gen5 links).
PCIE_EFFICIENCY = 0.8
#: Seconds to launch one kernel (assumption: a few microseconds per launch from Python).
LAUNCH_S = 5e-6
#: Seconds of fixed cost per host <-> device copy (assumption: DMA set-up, about 10 us).
COPY_LATENCY_S = 10e-6
#: While a copy and a kernel run at once, each progresses this much slower: both go through the
#: device's memory controllers and L2 (assumption: a few per cent; see :mod:`.simulated`).
CONTENTION = 0.05


@dataclass(frozen=True)
class GpuProfile:
    """One GPU as the roofline sees it.

    Attributes:
        name: the profile's name (:data:`PROFILES` key).
        description: the card and numeric mode, as printed with every simulated figure.
        flops_per_s: peak FLOP/s of convolutions and matrix products (TF32 tensor cores where
            the profile says so, else FP32 CUDA cores).
        vector_flops_per_s: peak FP32 FLOP/s of other kernels, FLOP/s.
        memory_bytes_per_s: device memory bandwidth, bytes per second.
        pcie_bytes_per_s: host <-> device link bandwidth per direction, bytes per second.
        memory_nbytes: device memory, bytes.
        sources: where each figure comes from.
    """

    name: str
    description: str
    flops_per_s: float
    vector_flops_per_s: float
    memory_bytes_per_s: float
    pcie_bytes_per_s: float
    memory_nbytes: int
    sources: tuple[str, ...] = field(default=(), compare=False)

    @property
    def copy_bytes_per_s(self) -> float:
        """Bandwidth of one pinned copy in one direction, bytes per second."""
        return self.pcie_bytes_per_s * PCIE_EFFICIENCY

    def peak_flops_per_s(self, unit: str) -> float:
        """Peak FLOP/s for a kernel of class ``unit`` (:data:`~.program.UNITS`)."""
        return self.flops_per_s if unit in ("conv", "matmul") else self.vector_flops_per_s


_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), SXM5: FP32 67 TFLOPS, "
         "TF32 Tensor Core 989 TFLOPS with sparsity (494.7 dense), GPU memory 80 GB at 3.35 TB/s, PCIe Gen5 "
         "128 GB/s (64 GB/s per direction)",)
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100), 80GB SXM: FP32 19.5 TFLOPS, "
         "TF32 Tensor Core 312 TFLOPS with sparsity (156 dense), 2,039 GB/s, PCIe Gen4 64 GB/s "
         "(32 GB/s per direction)",)
_V100 = ("NVIDIA Tesla V100 datasheet (nvidia.com/en-us/data-center/v100), SXM2: FP32 15.7 TFLOPS, "
         "HBM2 900 GB/s, 32 GB; PCIe Gen3 x16 32 GB/s (16 GB/s per direction). TENSILE (arXiv 2105.13336) "
         "assumes 12 GB/s host <-> device",)

PROFILES: dict[str, GpuProfile] = {p.name: p for p in (
    GpuProfile("h100", "NVIDIA H100 SXM5, FP32", 67e12, 67e12, 3.35e12, 64e9, 80 << 30, _H100),
    GpuProfile("h100-tf32", "NVIDIA H100 SXM5, TF32 tensor cores", 494.7e12, 67e12, 3.35e12, 64e9, 80 << 30, _H100),
    GpuProfile("a100", "NVIDIA A100 SXM4 80GB, FP32", 19.5e12, 19.5e12, 2.039e12, 32e9, 80 << 30, _A100),
    GpuProfile("a100-tf32", "NVIDIA A100 SXM4 80GB, TF32 tensor cores", 156e12, 19.5e12, 2.039e12, 32e9,
               80 << 30, _A100),
    GpuProfile("v100", "NVIDIA Tesla V100 SXM2 32GB, FP32", 15.7e12, 15.7e12, 0.9e12, 16e9, 32 << 30, _V100),
)}


def profile(name: str) -> GpuProfile:
    """The profile named ``name``. Raises InvalidArgument for an unknown one."""
    if name not in PROFILES:
        raise InvalidArgument(f"unknown GPU profile {name!r}; use one of {', '.join(PROFILES)}")
    return PROFILES[name]
