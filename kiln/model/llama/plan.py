"""The Llama family's parallel plan (kiln/model/parallel_plan.py says what a plan holds).

Mixture-of-Experts blocks have no expert tensor parallel: the MoE feed-forward (router, routed
and shared experts) takes the residual stream's local sequence shard and keeps its weights whole,
so each tp rank routes and computes its own tokens. Those weights therefore see different tokens
on each tp rank, like on each data rank, and their gradients must be summed over both: the plan
names them (`block_sequence_units`) and FSDP shards them over the data and tp ranks together.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from kiln.config.sections import ModelConfig
from kiln.model.parallel_plan import ParallelPlan
from kiln.model.tp_styles import (
    ShardByHeads,
    dense_ffn_tp,
    embedding_and_head_tp,
    is_moe_block,
    moe_ffn_tp,
)


def llama_plan(cfg: ModelConfig) -> ParallelPlan:
    """Llama: sequence-parallel norms, column/row-split attention and SwiGLU, vocabulary-split
    embedding and head with the logits left vocabulary-sharded for the loss (loss parallel)."""
    tied = cfg.tie_embeddings
    return ParallelPlan(
        blocks="layers",
        tp=embedding_and_head_tp(),
        block_tp=_llama_block_tp,
        block_fsdp_units=_llama_fsdp_units,
        first_stage=("tok_embeddings",),
        # Tied: the last stage keeps its own copy of the embedding as output head.
        last_stage=("norm", "output", "tok_embeddings") if tied else ("norm", "output"),
        tied_weight="tok_embeddings.weight" if tied else None,
        block_sequence_units=_moe_sequence_units,
        block_moe=lambda block: ("feed_forward",) if is_moe_block(block) else (),
        block_attention=lambda block: ("attention",),
        # The head's logits feed the loss, where float8's rounding costs the most; a router's
        # top-k choice flips on small differences.
        float8_excluded=("output", "router"),
    )


def _llama_fsdp_units(block: nn.Module) -> tuple[str, ...]:
    # In an MoE block the routed experts (most of its weights) are a unit of their own, and the
    # rest of the MoE feed-forward (router gate, shared experts) another, inside it.
    if is_moe_block(block):
        return ("attention", "feed_forward.experts", "feed_forward")
    return ("attention", "feed_forward")


def _moe_sequence_units(block: nn.Module) -> tuple[str, ...]:
    return ("feed_forward.experts", "feed_forward") if is_moe_block(block) else ()


def _llama_block_tp(block: nn.Module) -> dict[str, ParallelStyle]:
    # Attention and feed-forward take the sequence-sharded residual stream and need it whole.
    # The document mask comes as a keyword, which this passes through untouched: it covers whole
    # sequences and all heads, so it is the same on every tp rank.
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
            use_local_output=True,
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        **(moe_ffn_tp() if is_moe_block(block) else dense_ffn_tp()),
    }
    if block.attention.sinks is not None:
        plan["attention.sinks"] = ShardByHeads()
    if block.attention.q_norm is not None:
        # q and k are (batch, heads, seq, head_dim) with this rank's heads: the norm weight, shared
        # by all heads, is replicated and its input marked as split along dim 1, so the weight's
        # gradient is summed over the tp ranks' heads like a sequence-parallel norm's over tokens.
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=1, use_local_output=True)
    return plan
