"""Tensor-parallel styles the families share: the vocabulary-split embedding and head around a
sequence-parallel final norm, the dense SwiGLU and the Mixture-of-Experts block; a family's plan
puts them beside its attention's."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from kiln.model.moe.block import MoEFeedForward


def embedding_and_head_tp() -> dict[str, ParallelStyle]:
    """The embedding split by vocabulary rows into the sequence-sharded residual stream, the
    final norm sequence-parallel, the head split by vocabulary with its logits left sharded for
    the loss (loss parallel)."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }


def is_moe_block(block: nn.Module) -> bool:
    """Whether `block`'s feed-forward is Mixture-of-Experts."""
    return isinstance(block.feed_forward, MoEFeedForward)


def dense_ffn_tp() -> dict[str, ParallelStyle]:
    """A SwiGLU on the gathered sequence: w1 and w3 column-split, w2 row-split."""
    return {
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def moe_ffn_tp() -> dict[str, ParallelStyle]:
    """An MoE feed-forward on this tp rank's sequence shard, weights whole."""
    # The MoE feed-forward works on plain tensors: it takes this tp rank's sequence shard of the
    # (sequence-parallel) norm's output as it is, nothing gathered, and returns the same tokens'
    # outputs, a plain tensor like the rest of the residual stream between sub-layers (the
    # embedding and the row-split outputs return their local sequence shards too).
    return {
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    }


class ShardByHeads(ParallelStyle):
    """A module of per-head parameters (attention sinks): each split along its first dim, as
    column-parallel query projections split the heads, so a rank holds its heads' values."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name: str, sub: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(sub.named_parameters(recurse=False)):
                sharded = distribute_tensor(param, mesh, [Shard(0)])
                sub.register_parameter(key, nn.Parameter(sharded, param.requires_grad))

        return distribute_module(module, device_mesh, partition_fn=shard)
