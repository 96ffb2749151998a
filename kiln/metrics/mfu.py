"""Peak dense bf16 FLOP/s by accelerator and model FLOPs utilization."""

from __future__ import annotations

import torch

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, in FLOP/s.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A10G": 70e12,
    "L4": 121e12,
}


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of one device, or None where unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():  # most specific names first
        if key in name:
            return flops
    return None


def mfu(
    *, flops_per_token: float, tokens_per_sec: float, peak: float | None, num_devices: int = 1
) -> float | None:
    if peak is None or tokens_per_sec <= 0:
        return None
    return flops_per_token * tokens_per_sec / (peak * num_devices)
