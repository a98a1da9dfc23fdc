"""Target devices: the figures the roofline cost model needs.

Peak figures are dense (no 2:4 sparsity), from the vendors' datasheets:
- H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU datasheet: BF16 tensor 989.4 TFLOPS dense
  (1,979 with sparsity), FP32 67 TFLOPS, HBM3 3.35 TB/s, 80 GB.
- H200 SXM 141 GB: NVIDIA H200 datasheet: same compute as H100 SXM (BF16 989 TFLOPS dense,
  FP32 67 TFLOPS), HBM3e 4.8 TB/s, 141 GB.
- A100 SXM 80 GB: NVIDIA A100 datasheet: BF16 tensor 312 TFLOPS dense, FP32 19.5 TFLOPS,
  HBM2e 2,039 GB/s, 80 GB.
- A100 SXM 40 GB: same datasheet: BF16 312 TFLOPS, FP32 19.5 TFLOPS, HBM2 1,555 GB/s, 40 GB.
- L4: NVIDIA L4 datasheet: BF16 tensor 121 TFLOPS dense (242 with sparsity), FP32 30.3 TFLOPS,
  GDDR6 300 GB/s, 24 GB.
- GeForce RTX 4090: NVIDIA Ada Lovelace architecture whitepaper: BF16 tensor with FP32
  accumulate 165.2 TFLOPS dense (330.3 with FP16 accumulate), FP32 82.6 TFLOPS, GDDR6X
  1,008 GB/s, 24 GB.
Host links (`host_link`, bytes/s one way, what an offloaded activation crosses twice): PCIe
Gen5 x16 for H100/H200 SXM (128 GB/s both ways in their datasheets: 64 GB/s each way), PCIe
Gen4 x16 for A100, L4 and RTX 4090 (64 GB/s both ways: 32 each way); GH200's NVLink-C2C is
900 GB/s both ways (450 each way; NVIDIA GH200 Grace Hopper Superchip datasheet).
Sustained rates are lower than these peaks; `efficiency` scales them (the roofline is a
lower bound on time, used to rank ops against each other, not to promise a step time).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "Device", "device"]


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float  # dense tensor-core peak, FLOP/s (also used for fp16)
    fp32_flops: float  # FLOP/s without TF32
    bandwidth: float  # memory bandwidth, bytes/s
    memory: int  # bytes
    launch_overhead: float = 4e-6  # seconds per kernel: launch and tail, measured order on CUDA
    host_link: float = 32e9  # bytes/s one way between device and host memory
    efficiency: float = 1.0  # fraction of peak that the roofline assumes

    def peak_flops(self, dtype: str) -> float:
        low = dtype.replace("torch.", "") in ("bfloat16", "float16", "half")
        return (self.bf16_flops if low else self.fp32_flops) * self.efficiency


_T = 1e12
_GB = 10**9

DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM", 989.4 * _T, 67 * _T, 3.35e12, 80 * _GB, host_link=64e9),
    "h200": Device("H200 SXM", 989.4 * _T, 67 * _T, 4.8e12, 141 * _GB, host_link=64e9),
    "gh200": Device("GH200 (H100 96GB)", 989.4 * _T, 67 * _T, 4.0e12, 96 * _GB,
                    host_link=450e9),
    "a100-80gb": Device("A100 SXM 80GB", 312 * _T, 19.5 * _T, 2.039e12, 80 * _GB),
    "a100-40gb": Device("A100 SXM 40GB", 312 * _T, 19.5 * _T, 1.555e12, 40 * _GB),
    "l4": Device("L4", 121 * _T, 30.3 * _T, 300e9, 24 * _GB),
    "rtx4090": Device("GeForce RTX 4090", 165.2 * _T, 82.6 * _T, 1.008e12, 24 * _GB),
}
_ALIASES = {"h100-sxm": "h100", "h200-sxm": "h200", "a100": "a100-80gb", "a100-80": "a100-80gb",
            "a100-40": "a100-40gb", "4090": "rtx4090", "rtx-4090": "rtx4090"}


def device(name: "str | Device") -> Device:
    """The device called `name` ("h100", "A100 80GB", "rtx-4090"...); raises KeyError listing
    the known ones."""
    if isinstance(name, Device):
        return name
    key = name.lower().replace(" ", "-").replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in DEVICES:
        key = key.replace("-sxm", "")
    if key not in DEVICES:
        raise KeyError(f"unknown target device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[key]
