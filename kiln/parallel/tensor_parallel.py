"""Tensor parallel (Megatron-style) with sequence parallel and loss parallel, on DTensor.

Inside a block, q/k/v and w1/w3 are split by output columns (heads, hidden units) and wo/w2 by
input rows, so each block needs one all-gather in and one reduce-scatter out per sub-layer.
Between sub-layers the residual stream stays split along the sequence (sequence parallel): norms
and residual adds run on 1/tp of the tokens. The embedding is split by vocabulary rows, and the
output head by vocabulary columns; logits stay vocabulary-sharded into the cross entropy (loss
parallel), so the full (tokens × vocab) logits never exist on one rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    # A pipeline stage holds only some of these; its hidden states cross stages sequence-sharded.
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    present = {name: plan for name, plan in top.items() if getattr(model, name) is not None}
    if present:
        parallelize_module(model, mesh, present)
    for block in model.layers.values():
        # Attention and feed-forward take the sequence-sharded residual stream and need it whole.
        # The document mask comes as a keyword, which this passes through untouched: it covers
        # whole sequences and all heads, so it is the same on every tp rank.
        gather_attention = PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
            use_local_output=True,
        )
        gather_mlp = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": gather_attention,
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": gather_mlp,
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
