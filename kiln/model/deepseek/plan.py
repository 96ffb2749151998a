"""The DeepSeek-V3 family's parallel plan (kiln/model/parallel_plan.py says what a plan holds).

Tensor parallel splits multi-head latent attention by heads after the up-projections (wq or wq_b,
wkv_b column-split, wo row-split), as torchtitan's DeepSeek-V3 plan does. The down-projections
and the norms of the latents (wq_a, q_norm, wkv_a, kv_norm) stay whole: every tp rank computes
them on the whole sequence, and the column-split up-projections all-reduce the gradient of
their input over the tp ranks, so each rank's gradient of them is already the whole one. The
feed-forwards are the Llama family's: dense ones column/row-split, MoE ones on each tp rank's part
of the sequence. Multi-token prediction sits on the last stage; its depths are extra blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from kiln.config.sections import ModelConfig
from kiln.model.deepseek.mtp import MTPDepth
from kiln.model.parallel_plan import ParallelPlan
from kiln.model.tp_styles import dense_ffn_tp, embedding_and_head_tp, is_moe_block, moe_ffn_tp


def deepseek_plan(cfg: ModelConfig) -> ParallelPlan:
    """DeepSeek-V3: the Llama plan's embedding, norms, head and feed-forwards, with MLA's. The
    multi-token prediction modules embed with the main embedding: with them, the last pipeline
    stage holds a copy of it, kept in step with the first stage's like tied embeddings. Each
    depth is a block to every parallelism (its block split like a main one, under `block.`)."""
    mtp = cfg.mtp.depth > 0
    return ParallelPlan(
        blocks="layers",
        tp=embedding_and_head_tp(),
        block_tp=_block_tp,
        block_fsdp_units=_in_depths(_fsdp_units),
        first_stage=("tok_embeddings",),
        last_stage=("norm", "output", "mtp", *(("tok_embeddings",) if mtp else ())),
        tied_weight="tok_embeddings.weight" if mtp else None,
        block_sequence_units=_in_depths(_sequence_units),
        block_moe=_in_depths(lambda block: ("feed_forward",) if is_moe_block(block) else ()),
        block_attention=_in_depths(lambda block: ("attention",)),
        # The MTP projection runs on each tp rank's part of the sequence: a tensorwise float8
        # scale there would be that part's, not the whole tensor's as in one process.
        float8_excluded=("output", "router", "proj"),
        extra_blocks=_mtp_depths,
    )


def _mtp_depths(model: nn.Module) -> dict[str, int]:
    if getattr(model, "mtp", None) is None:
        return {}
    return {f"mtp.depths.{key}": depth.layer for key, depth in model.mtp.depths.items()}


def _in_depths(per_block: Callable[[nn.Module], tuple[str, ...]]) -> Callable:
    """`per_block` for a main block; for a multi-token prediction depth, its block's paths."""

    def paths(block: nn.Module) -> tuple[str, ...]:
        if isinstance(block, MTPDepth):
            return tuple(f"block.{path}" for path in per_block(block.block))
        return per_block(block)

    return paths


def _sequence_units(block: nn.Module) -> tuple[str, ...]:
    return ("feed_forward.experts", "feed_forward") if is_moe_block(block) else ()


def _fsdp_units(block: nn.Module) -> tuple[str, ...]:
    ffn = ("feed_forward.experts", "feed_forward") if is_moe_block(block) else ("feed_forward",)
    return ("attention", *ffn)


def _block_tp(block: nn.Module) -> dict[str, ParallelStyle]:
    if isinstance(block, MTPDepth):
        # The depth's norms and projection run on each tp rank's part of the sequence with
        # their weights whole (the projection's gradient summed over the ranks, like a norm's);
        # the final norm hands the head a sequence-split DTensor, as the main final norm does.
        local = SequenceParallel(use_local_output=True)
        inner = {f"block.{path}": style for path, style in _block_tp(block.block).items()}
        return {
            "embed_norm": local,
            "hidden_norm": local,
            "proj": local,
            "norm": SequenceParallel(),
            **inner,
        }
    query = ("attention.wq_b",) if block.attention.low_rank_query else ("attention.wq",)
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
            use_local_output=True,
        ),
        **{name: ColwiseParallel() for name in (*query, "attention.wkv_b")},
        "attention.shared_rope_key": SumGradientOverRanks(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        **(moe_ffn_tp() if is_moe_block(block) else dense_ffn_tp()),
    }


class SumGradientOverRanks(ParallelStyle):
    """The identity on a tensor every tp rank holds whole, whose gradient each rank computes
    from its own heads only: the backward sums it over the ranks (Megatron's "f" operator)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partial_in_backward(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            (x,) = inputs
            whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (whole.to_local(grad_placements=[Partial()]),)

        return distribute_module(module, device_mesh, input_fn=partial_in_backward)
