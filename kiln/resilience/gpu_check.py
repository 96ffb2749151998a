"""One GPU's start-up check for `resilience.preflight`: a timed bf16 matmul (its rate, and whether
its result is finite) and the driver's count of uncorrected ECC errors."""

from __future__ import annotations

import shutil
import subprocess
import time

import torch

from kiln.errors import first_line
from kiln.metrics.mfu import peak_flops

# 2 · 4096³ FLOPs a matmul: long enough (tens of microseconds on an H100, each) that launch
# overhead does not count, short enough that the check costs well under a second.
MATMUL_SIZE = 4096
MATMUL_ROUNDS = 20
# nvidia-smi answers in well under a second; a driver that hangs must not hang the start-up.
SMI_TIMEOUT_S = 10


def check_gpu(device: torch.device) -> dict:
    """This rank's GPU: `tflops` (the bf16 matmul rate), `peak_tflops` (the datasheet's, None if
    unlisted), `ecc` (uncorrected ECC errors, None where not reported); or `error` alone."""
    try:
        a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)
        b = torch.randn_like(a)
        product = a @ b  # the first call picks cuBLAS's kernel: not timed
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        for _ in range(MATMUL_ROUNDS):
            product = a @ b
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began
        finite = bool(torch.isfinite(product).all())
    except Exception as error:  # a failing GPU fails in many ways, each this rank's failure
        return {"error": f"the GPU check failed: {type(error).__name__}: {first_line(error)}"}
    if not finite:
        return {"error": "a bf16 matmul of finite inputs gave a non-finite result on this GPU"}
    peak = peak_flops(device)
    return {
        "tflops": 2 * MATMUL_SIZE**3 * MATMUL_ROUNDS / seconds / 1e12,
        "peak_tflops": peak / 1e12 if peak else None,
        "ecc": uncorrected_ecc_errors(device),
    }


def uncorrected_ecc_errors(device: torch.device) -> int | None:
    """Uncorrected ECC errors on this GPU since the driver loaded, from nvidia-smi; None where
    there is no nvidia-smi, ECC is off or the answer is not a number."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        props = torch.cuda.get_device_properties(device)
        # By PCI address: CUDA_VISIBLE_DEVICES renumbers the GPUs nvidia-smi numbers.
        address = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        answer = subprocess.run(
            [
                smi,
                f"--id={address}",
                "--query-gpu=ecc.errors.uncorrected.volatile.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=SMI_TIMEOUT_S,
            check=True,
        )
        return int(answer.stdout.strip())
    except (AttributeError, OSError, subprocess.SubprocessError, ValueError):
        return None  # "[N/A]" with ECC off, an older torch without PCI fields, a driver error
