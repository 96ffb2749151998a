"""The qwen3_next family's parallel plan (kiln/model/parallel_plan.py says what a plan holds).

Tensor parallel splits both token mixers by heads. The gated full attention is Llama's (wq's rows
per head are [query | gate], so a column split by heads keeps each head's gate with it). The
Gated DeltaNet splits wq, wk, wv, wz, wb and wa by columns, its convolution taps, A_log and dt_bias
by rows (channels and value heads, in head order), and wo by rows into the sequence-sharded
residual stream; a tp rank holds whole key heads and the value heads they serve (tp divides
num_key_heads, validation), so the delta rule runs on each rank's heads with nothing exchanged.
The gated norm's weight, shared by the heads, is replicated and its input marked as split by
heads, so its gradient is summed over the tp ranks (as Llama's q/k norms'). The feed-forwards
are the Llama family's: dense ones column/row-split, MoE ones on each tp rank's sequence shard.
Context parallel is refused (no attention layer takes `context_parallel` in this family's
forward); the plan still names the full-attention layers as its attention layers.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from kiln.config.sections import ModelConfig
from kiln.model.parallel_plan import ParallelPlan
from kiln.model.tp_styles import dense_ffn_tp, embedding_and_head_tp, is_moe_block, moe_ffn_tp

# The Gated DeltaNet's own parameters (not its projections'), split along dim 0 by heads.
HEAD_PARAMS = ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias")


def qwen3_next_plan(cfg: ModelConfig) -> ParallelPlan:
    """Sequence-parallel norms, head-split mixers and feed-forwards as Llama's, vocabulary-split
    embedding and head with the logits left vocabulary-sharded for the loss."""
    tied = cfg.tie_embeddings
    return ParallelPlan(
        blocks="layers",
        tp=embedding_and_head_tp(),
        block_tp=_block_tp,
        block_fsdp_units=_fsdp_units,
        first_stage=("tok_embeddings",),
        # Tied: the last stage keeps its own copy of the embedding as output head.
        last_stage=("norm", "output", "tok_embeddings") if tied else ("norm", "output"),
        tied_weight="tok_embeddings.weight" if tied else None,
        block_sequence_units=_sequence_units,
        block_moe=lambda block: ("feed_forward",) if is_moe_block(block) else (),
        block_attention=lambda block: () if block.linear else ("attention",),
        # The head's logits feed the loss and a router's top-k flips on small differences; wb
        # and wa make each token's write strength and decay, which multiply into the state
        # over the whole sequence, so float8's rounding of them would compound.
        float8_excluded=("output", "router", "wb", "wa"),
    )


def _mixer(block: nn.Module) -> str:
    return "linear_attention" if block.linear else "attention"


def _fsdp_units(block: nn.Module) -> tuple[str, ...]:
    if is_moe_block(block):
        return (_mixer(block), "feed_forward.experts", "feed_forward")
    return (_mixer(block), "feed_forward")


def _sequence_units(block: nn.Module) -> tuple[str, ...]:
    return ("feed_forward.experts", "feed_forward") if is_moe_block(block) else ()


def _block_tp(block: nn.Module) -> dict[str, ParallelStyle]:
    plan = {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        **(moe_ffn_tp() if is_moe_block(block) else dense_ffn_tp()),
    }
    if block.linear:
        return plan | _linear_attention_tp()
    plan |= {
        # The layer takes (x, cos, sin, cache, layer): x gathered, the rest as they are.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
            use_local_output=True,
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if block.attention.q_norm is not None:
        # (batch, heads, seq, head_dim) of this rank's heads: the replicated weight's gradient
        # is summed over the tp ranks like a sequence-parallel norm's over tokens.
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=1, use_local_output=True)
    return plan


def _linear_attention_tp() -> dict[str, ParallelStyle]:
    return {
        "linear_attention": GatheredInputHeadParams(HEAD_PARAMS),
        **{
            f"linear_attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv", "wz", "wb", "wa")
        },
        "linear_attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        # (batch, seq, heads, value_dim) of this rank's heads: the shared weight's gradient is
        # summed over the tp ranks' heads.
        "linear_attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


class GatheredInputHeadParams(ParallelStyle):
    """The Gated DeltaNet layer itself: its input (x, the one positional argument) gathered from
    the sequence-sharded residual stream, and its own per-channel and per-head parameters (not
    its children's) split along dim 0 like the projections' heads. One style, as a module takes
    one; float8 therefore gathers this input in high precision (it converts only a plain
    PrepareModuleInput)."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__()
        self.names = names
        self.gather = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            param = getattr(module, name)
            sharded = distribute_tensor(param, device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        return self.gather._apply(module, device_mesh)
