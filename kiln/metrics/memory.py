"""Back-of-the-envelope memory per GPU for `kiln check`: model state plus activations.

Model state: fp32 weights, gradients and two AdamW moments (16 bytes per parameter), divided
over every dimension that shards parameters (dp_shard, cp, tp, pp).
Activations, bf16, per transformer layer and micro-batch (Korthikanti et al. 2022, with flash
attention so no seq² term, sequence parallel dividing everything by tp): ~34·s·b·d bytes kept
for backward without checkpointing, 2·s·b·d (the block input) with it; a checkpointed run
also holds one layer's full activations while recomputing. Plus fp32 logits and their gradient.
Under pipeline parallel: the layers of one rank, for as many micro-batches as its schedule keeps
in flight (docs/pipeline.md).
It is an estimate for choosing a layout, not a promise: allocator slack is not included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.config.sections import JobConfig
from kiln.model.flops import count_params
from kiln.parallel.pipeline_split import in_flight_microbatches, microbatches


@dataclass(frozen=True)
class MemoryEstimate:
    model_state: float  # bytes
    activations: float

    @property
    def total(self) -> float:
        return self.model_state + self.activations


def estimate_memory(cfg: JobConfig, degrees: dict[str, int]) -> MemoryEstimate:
    m, t = cfg.model, cfg.train
    shards = degrees["dp_shard"] * degrees["cp"] * degrees["tp"] * degrees["pp"]
    model_state = 16 * count_params(m).total / shards
    # Under pipeline parallel a pass is split into micro-batches, several of them in flight.
    n_micro = microbatches(cfg.distributed, t.batch_size) if degrees["pp"] > 1 else 1
    in_flight = in_flight_microbatches(cfg.distributed, n_micro)
    tokens = t.seq_len * t.batch_size / n_micro / degrees["cp"]
    full_layer = 34 * tokens * m.dim / degrees["tp"]
    checkpointed_layer = 2 * tokens * m.dim / degrees["tp"]
    layers = math.ceil(m.n_layers / degrees["pp"])
    kept = {"none": 0, "full": layers, "selective": (layers + 1) // 2}[t.activation_checkpointing]
    activations = in_flight * (kept * checkpointed_layer + (layers - kept) * full_layer) + (
        full_layer if kept else 0
    )
    logits = 2 * 4 * tokens * m.vocab_size / degrees["tp"]  # fp32 logits and their gradient
    return MemoryEstimate(model_state=model_state, activations=activations + logits)
