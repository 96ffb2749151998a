"""What a logged step says about a Mixture-of-Experts model, the same numbers in every layout:
the expert biases of auxiliary-loss-free balancing (their range and a checksum), each MoE layer's
load imbalance, and the balancing losses of the step.

Every rank calls `moe_records` at the same steps: the balancing-loss sums are summed over the
ranks holding the step's other tokens, and under pipeline parallel each stage's layers are
gathered, so that every rank returns the whole model's records."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from kiln.model.moe import MoEFeedForward
from kiln.model.names import canonical_name
from kiln.parallel.collectives import sum_over

# Per layer: bias min, max, Σ|bias|, imbalance and the three losses; the expert loads follow.
STATS = 7


class MoEStep(NamedTuple):
    """What one step leaves for its records (this pipeline rank's MoE layers)."""

    loads: torch.Tensor | None  # (layers, experts) assignments, summed over the token group
    aux_loss_sums: torch.Tensor | None  # (layers, 3) this rank's sums, see MoEFeedForward
    tokens: int  # the step's tokens on all data ranks (the losses' normalization)
    sequences: int


def moe_records(
    model_parts: list[nn.Module],
    step: MoEStep,
    *,
    token_group: dist.ProcessGroup | None,
    pipeline_group: dist.ProcessGroup | None,
) -> dict[str, float]:
    """{"moe/<what>": value}: bias_min, bias_max, bias_abs_sum (Σ |bias| over all layers);
    imbalance_max and imbalance_mean over the layers and imbalance/<layer> (a layer's most
    loaded expert's assignments over the mean); load/<layer>, the fraction of the layer's
    assignments each expert received (a list, by expert); load_balance_loss, seq_balance_loss and
    router_z_loss (unweighted, mean over the layers)."""
    layers = _layer_values(model_parts, step, token_group)
    if pipeline_group is not None:
        gathered: list[dict[str, list[float]]] = [{}] * dist.get_world_size(pipeline_group)
        dist.all_gather_object(gathered, layers, group=pipeline_group)
        layers = {name: v for stage in gathered for name, v in stage.items()}
    if not layers:
        return {}
    names = sorted(layers, key=_natural)
    columns = list(zip(*(layers[name][:STATS] for name in names), strict=True))
    bias_min, bias_max, bias_abs, imbalance, load_balance, seq_balance, router_z = columns
    return {
        "moe/bias_min": min(bias_min),
        "moe/bias_max": max(bias_max),
        "moe/bias_abs_sum": sum(bias_abs),
        "moe/imbalance_max": max(imbalance),
        "moe/imbalance_mean": sum(imbalance) / len(names),
        "moe/load_balance_loss": sum(load_balance) / len(names),
        "moe/seq_balance_loss": sum(seq_balance) / len(names),
        "moe/router_z_loss": sum(router_z) / len(names),
        **{f"moe/imbalance/{name}": layers[name][3] for name in names},
        **{f"moe/load/{name}": layers[name][STATS:] for name in names},
    }


def moe_layer_names(model_parts: list[nn.Module]) -> list[str]:
    """This rank's MoE layers (e.g. 'layers.3.feed_forward'), in the order of `modules()`, the
    order of the routers' stacked loads."""
    return [name for name, _ in _moe_blocks(model_parts)]


def _moe_blocks(model_parts: list[nn.Module]) -> list[tuple[str, MoEFeedForward]]:
    return [
        (canonical_name(name), module)
        for part in model_parts
        for name, module in part.named_modules()
        if isinstance(module, MoEFeedForward)
    ]


def _layer_values(
    model_parts: list[nn.Module], step: MoEStep, token_group: dist.ProcessGroup | None
) -> dict[str, list[float]]:
    """{MoE layer name: [bias min, max, Σ|bias|, imbalance, three losses, then the fraction of
    the assignments each expert received]} of this rank."""
    blocks = _moe_blocks(model_parts)
    if not blocks:
        return {}
    # Each rank summed the losses over its own tokens (see balancing.AuxLossScale).
    sums = sum_over(step.aux_loss_sums, token_group)
    norm = torch.tensor([step.tokens, step.sequences, step.tokens], dtype=sums.dtype)
    losses = sums / norm.to(sums.device)
    loads = step.loads.float()
    imbalance = loads.amax(dim=1) / loads.mean(dim=1).clamp(min=1e-12)
    fractions = loads / loads.sum(dim=1, keepdim=True).clamp(min=1)
    values = {}
    for index, (name, block) in enumerate(blocks):
        bias = block.router.expert_bias
        stats = torch.stack([bias.min(), bias.max(), bias.abs().sum(), imbalance[index]])
        values[name] = [*stats.tolist(), *losses[index].tolist(), *fractions[index].tolist()]
    return values


def _natural(name: str) -> list:
    """Sort key: layer 10 after layer 9."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]
