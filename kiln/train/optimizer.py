"""Optimizer construction: which parameters each optimizer updates, with which settings.

AdamW: weight decay on matrices only, fused kernels where they exist, each rank updating its
local shards (kiln/train/adamw.py). Muon: the hidden matrices (attention, feed-forward, routed
experts, router) are orthogonalized by Muon; the embeddings, the output head, the norms and any
vector go to AdamW with `[optimizer.adamw]`'s settings (each unset key taking `[optimizer]`'s),
since orthogonalizing a lookup table or a gain is meaningless.
Lion and Schedule-Free AdamW: every weight, decayed as under AdamW (see docs/optimizers.md).

Each param group keeps its own starting lr as `base_lr`: the schedule scales every group's,
so Muon's AdamW half may run at another lr than its matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.config.sections import JobConfig, OptimizerConfig
from kiln.errors import ConfigError
from kiln.model.registry import family_of
from kiln.train.adamw import ShardLocalAdamW
from kiln.train.lion import Lion
from kiln.train.muon import Muon
from kiln.train.schedule_free import ScheduleFreeAdamW


def build_optimizer(
    model: nn.Module,
    cfg: OptimizerConfig,
    *,
    ns_dtype: torch.dtype = torch.bfloat16,
    io_modules: tuple[str, ...] | None = None,
) -> list[torch.optim.Optimizer]:
    """The optimizers of one model part (one, or Muon and AdamW), their groups tagged with
    `base_lr`. `ns_dtype`: the dtype of Muon's Newton–Schulz iterations; `io_modules`: the
    top-level modules Muon leaves to AdamW (the family plan's first and last stage modules:
    embeddings, final norm, output head)."""
    groups = _decay_groups(_trainable(model), cfg.weight_decay)
    if cfg.name == "muon":
        assert io_modules is not None, "Muon needs the model's input and output modules"
        optimizers = _muon(model, cfg, ns_dtype, outside=set(io_modules))
    elif cfg.name == "lion":
        optimizers = [Lion(groups, lr=cfg.lr, betas=tuple(cfg.betas))]
    elif cfg.name == "schedule_free_adamw":
        optimizers = [ScheduleFreeAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)]
    else:
        optimizers = [_adamw(groups, cfg)]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["base_lr"] = group["lr"]
    return optimizers


def build_optimizers(
    model_parts: list[nn.Module], cfg: JobConfig, *, device: torch.device
) -> list[list[torch.optim.Optimizer]]:
    """The optimizers of each model part this rank runs."""
    plan = family_of(cfg.model).parallel_plan(cfg.model)
    ns_dtype = newton_schulz_dtype(cfg.train.mixed_precision, device)
    io_modules = plan.first_stage + plan.last_stage
    return [
        build_optimizer(part, cfg.optimizer, ns_dtype=ns_dtype, io_modules=io_modules)
        for part in model_parts
    ]


def newton_schulz_dtype(mixed_precision: str, device: torch.device) -> torch.dtype:
    """bf16 on GPUs, as torch.optim.Muon; fp32 in an fp32 run, where the parity tests compare at
    1e-5, and on CPUs, whose bf16 matmuls run 24-174x slower than fp32 (benchmarks/optimizers.md)."""
    return torch.bfloat16 if mixed_precision != "fp32" and device.type == "cuda" else torch.float32


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _is_matrix(name: str, param: nn.Parameter) -> bool:
    """A weight matrix (or a stack of the experts'); not a norm gain, a bias or the experts'
    stacked biases (experts.b1, b2, b3: one vector per expert)."""
    return param.ndim >= 2 and not name.endswith(("experts.b1", "experts.b2", "experts.b3"))


def _decay_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    # Norm gains and biases are not features: decaying them toward 0 only hurts.
    return [
        {"params": [p for n, p in named if _is_matrix(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not _is_matrix(n, p)], "weight_decay": 0.0},
    ]


def _adamw(groups: list[dict], cfg: OptimizerConfig, **overrides) -> torch.optim.Optimizer:
    params = [p for group in groups for p in group["params"]]
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    settings = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps) | overrides
    return ShardLocalAdamW(groups, **settings, fused=on_cuda)


def _muon(model: nn.Module, cfg: OptimizerConfig, ns_dtype: torch.dtype, *, outside: set) -> list:
    named = _trainable(model)
    matrices = [p for n, p in named if _is_matrix(n, p) and n.split(".")[0] not in outside]
    rest = [(name, p) for name, p in named if not any(p is m for m in matrices)]
    if not matrices and any(_is_matrix(n, p) for n, p in named):
        raise ConfigError(
            "optimizer.name = 'muon' found no hidden matrix to orthogonalize in this model part; "
            "use optimizer.name = 'adamw'"
        )
    a = cfg.adamw
    adamw_decay = a.weight_decay if a.weight_decay is not None else cfg.weight_decay
    adamw = _adamw(
        _decay_groups(rest, adamw_decay),
        cfg,
        lr=a.lr if a.lr is not None else cfg.lr,
        betas=tuple(a.betas if a.betas is not None else cfg.betas),
        eps=a.eps if a.eps is not None else cfg.eps,
    )
    muon = Muon(
        matrices,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=0.95 if cfg.momentum is None else cfg.momentum,
        nesterov=True if cfg.nesterov is None else cfg.nesterov,
        ns_steps=cfg.ns_steps or 5,
        adjust_lr=cfg.adjust_lr or "original",
        ns_dtype=ns_dtype,
        owner_compute=True if cfg.owner_compute is None else cfg.owner_compute,
    )
    return [muon, adamw] if matrices else [adamw]
