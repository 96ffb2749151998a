"""The pipeline stage kiln runs: torch's `PipelineStage`, whose shape inference is kept out of
the training step. Imported when a pipeline is built, like `torch.distributed.pipelining` itself
(which imports torch._dynamo)."""

from __future__ import annotations

from torch.distributed.pipelining import PipelineStage

from kiln.model.moe import uncounted


class Stage(PipelineStage):
    def _forward_metadata_inference(self, *args, **kwargs):
        # torch 2.13 learns the shapes passed between stages by running each stage's forward on
        # the first micro-batch, with gradients on when the schedule trains, at its first pass
        # (one schedule per pass shape: kiln/parallel/forward_backward.py) and again after each
        # switch between eval and training. That forward belongs to no
        # optimizer step: MoE routers must not count its tokens into the expert loads.
        with uncounted():
            return super()._forward_metadata_inference(*args, **kwargs)
