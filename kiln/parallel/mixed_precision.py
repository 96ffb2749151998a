"""Mixed precision, one code path on every device (CPU and CUDA alike).

`train.mixed_precision = "bf16"` computes in bf16 over fp32 master weights, the parameters the
optimizer steps. Under FSDP, FSDP's MixedPrecisionPolicy does it: parameters are gathered in bf16
for compute and gradients are reduced in fp32 into the fp32 shards. Without FSDP (one process,
tensor or pipeline parallel alone) torch.autocast does it around the forward. Never both: autocast
over bf16-gathered parameters would only add casts. The loss is computed in fp32 from the logits.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from kiln.config.sections import JobConfig
from kiln.parallel.mesh import ParallelContext


def _bf16(cfg: JobConfig) -> bool:
    # FP8 runs its linear layers in float8 (float8.py) and the rest in fp8.high_precision.
    if cfg.train.mixed_precision == "fp8":
        return cfg.fp8.high_precision == "bf16"
    return cfg.train.mixed_precision == "bf16"


def fsdp_policy(cfg: JobConfig) -> MixedPrecisionPolicy:
    """The policy every FSDP unit gets: bf16 compute, fp32 gradient reduction; or all fp32."""
    if _bf16(cfg):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def training_autocast(
    cfg: JobConfig, parallel: ParallelContext
) -> contextlib.AbstractContextManager:
    """The context the forward runs in: bf16 autocast where no FSDP policy casts, else nothing.
    Reusable: the trainer enters the same object for every micro-batch."""
    if _bf16(cfg) and parallel.fsdp_mesh() is None:
        return torch.autocast(parallel.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
