"""Back-of-the-envelope memory per GPU for `kiln check`: model state plus activations.

Model state: fp32 weights and gradients (8 bytes per parameter) and the optimizer's state
(`state_bytes_per_param`): AdamW's two moments and Schedule-Free AdamW's z and v 8 bytes, Lion's
momentum 4, Muon's momentum 4 for the matrices it takes (attention, feed-forwards, experts,
router, shared experts) and AdamW's 8 for the rest (embeddings, output head, norms). Divided
over every dimension that shards parameters: dp_shard, ep (its ranks read other batches, so FSDP
shards the dense parameters over dp_shard × ep), cp, tp, pp. With MoE every expert counts: a
token uses only its top-k, but every expert has weights, gradients and moments. The routed
experts are counted apart (`expert_shards`): ep gives each rank E/ep experts of every MoE layer,
and FSDP shards that slice over dp_shard × cp × tp (kiln/parallel/fsdp.py). It splits each
expert's rows (dim 1 of the stacked weights: hidden for w1 and w3, dim for w2) when they divide
by those ranks, else its columns (dim 2), so every rank holds (E/ep) / ranks of the experts'
weights, a fraction of each. A weight whose rows and columns (hidden and dim) both do not divide
keeps FSDP2's default, the expert dimension, cut into chunks of
ceil(E/ep / ranks) whole experts; every rank stores a whole chunk of that weight and its
gradient, padded where its chunk is short or empty (AdamW's moments cover only what it holds),
so with fewer experts than ranks the busiest rank holds one whole expert of it per layer, not a
fraction of one: the estimate counts that rank. The choice is made per weight.
Activations, bf16, per transformer layer and micro-batch (Korthikanti et al. 2022, with flash
attention so no seq² term, sequence parallel dividing everything by tp): ~34·s·b·d bytes kept
for backward without checkpointing, 2·s·b·d (the block input) with it; a checkpointed run
also holds one layer's full activations while recomputing. Plus fp32 logits and their gradient
(of one chunk of `train.loss_chunk_tokens` tokens with the chunked loss).
An MoE block keeps the dense estimate's attention and norms and replaces its feed-forward share
by what kiln's MoE feed-forward saves for backward (`moe_ffn_bytes_per_token`).
Context parallel divides the tokens by cp, but each layer's attention keeps the keys and values
of the whole sequence it gathered (`gathered_kv_bytes`) for its backward: that part does not
shrink with cp.
Under pipeline parallel: the layers of one rank, for as many micro-batches as its schedule keeps
in flight (docs/pipeline.md).
It is an estimate for choosing a layout, not a promise: allocator slack is not included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.config.sections import JobConfig, ModelConfig
from kiln.model.flops import count_params
from kiln.parallel.pipeline_split import in_flight_microbatches, microbatches

# Korthikanti et al.'s 34 bytes per token and dim of a layer: 19 of them are the feed-forward's,
# the other 15 attention and norms, which an MoE block has too.
DENSE_LAYER_BYTES = 34
DENSE_FFN_BYTES = 19
CHECKPOINTED_LAYER_BYTES = 2


@dataclass(frozen=True)
class MemoryEstimate:
    model_state: float  # bytes
    activations: float

    @property
    def total(self) -> float:
        return self.model_state + self.activations


def moe_ffn_bytes_per_token(m: ModelConfig) -> float:
    """Bytes one token's pass through an MoE feed-forward keeps for backward, bf16 compute.

    Counted from what kiln/model/moe saves (measured with saved-tensor hooks in
    tests/unit/test_memory.py): for each of the top-k copies of the token, its dispatched row,
    the expert's output and its slot in the combine buffer (3 rows of dim, bf16) and the expert's
    four hidden activations (w1 and w3 outputs, silu, their product: 4 rows of the expert width,
    bf16), plus its sort position, expert index (int64) and weight (fp32); per token the fp32
    copy of the input the router's gate runs on, and three fp32 score rows over all experts
    (logits, scores, normalized scores); the shared experts like a dense SwiGLU of their width.
    """
    d, k, experts = m.dim, m.moe_top_k, m.num_experts
    per_copy = 2 * (3 * d + 4 * m.expert_hidden_dim) + 8 + 8 + 4
    router = 4 * d + 3 * 4 * experts
    shared_width = m.moe_shared_experts * m.expert_hidden_dim
    shared = 2 * (2 * d + 4 * shared_width) if shared_width else 0
    return k * per_copy + router + shared


def layer_bytes_per_token(m: ModelConfig, *, moe: bool) -> float:
    """Activation bytes one token keeps in one layer without checkpointing."""
    if not moe:
        return DENSE_LAYER_BYTES * m.dim
    return (DENSE_LAYER_BYTES - DENSE_FFN_BYTES) * m.dim + moe_ffn_bytes_per_token(m)


def expert_weight_dims(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Dims 1 and 2 of each stacked expert weight, the ones FSDP splits (the first that divides
    by its ranks): w1, w3 are (experts, hidden, dim), w2 (experts, dim, hidden)."""
    hidden = m.expert_hidden_dim
    return {"w1": (hidden, m.dim), "w2": (m.dim, hidden), "w3": (hidden, m.dim)}


@dataclass(frozen=True)
class ExpertShards:
    """How FSDP splits the routed experts of one MoE layer that an ep rank holds."""

    local: int  # experts on each ep rank (all of them without ep)
    ranks: int  # the ranks FSDP shards them over: dp_shard × cp × tp
    whole: tuple[str, ...]  # weights whose rows and columns do not divide: split in whole experts

    @property
    def chunk(self) -> int:
        """Whole experts per rank of the weights in `whole` (FSDP2's chunk, padded)."""
        return math.ceil(self.local / self.ranks)

    @property
    def padded(self) -> bool:
        """Whether some rank stores padding: a weight is split in whole experts that do not
        divide by the ranks."""
        return bool(self.whole) and self.local % self.ranks != 0

    @property
    def stored(self) -> float:
        """Experts' worth of weights (w1, w2 and w3 being the same size) the busiest rank
        stores: local / ranks of the weights split within experts, a chunk of the others."""
        split = (3 - len(self.whole)) * self.local / self.ranks
        return (split + len(self.whole) * self.chunk) / 3


def expert_shards(m: ModelConfig, degrees: dict[str, int]) -> ExpertShards:
    """How the routed experts of one MoE layer are split: by ep into each rank's slice, then by
    FSDP along each expert's rows or columns where they divide, in whole experts where not."""
    local = m.num_experts // degrees["ep"]
    ranks = degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
    whole = tuple(
        name for name, dims in expert_weight_dims(m).items() if all(n % ranks for n in dims)
    )
    return ExpertShards(local, ranks, whole)


def routed_expert_params(m: ModelConfig) -> int:
    """Parameters of every routed expert of every MoE layer (w1, w2, w3 each)."""
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    return moe_layers * m.num_experts * 3 * m.dim * m.expert_hidden_dim


# fp32 weights and gradients.
WEIGHT_AND_GRAD_BYTES = 8


def state_bytes_per_param(optimizer: str, *, muon_matrix: bool) -> int:
    """fp32 optimizer state per parameter: AdamW's two moments, Schedule-Free AdamW's z and v,
    Lion's momentum; Muon's momentum for the matrices it orthogonalizes (`muon_matrix`), AdamW's
    moments for the rest."""
    if optimizer == "lion" or (optimizer == "muon" and muon_matrix):
        return 4
    return 8


def muon_matrix_params(m: ModelConfig) -> int:
    """Parameters Muon takes (kiln/train/optimizer.py): every matrix but the token embeddings and
    the output head, i.e. all but those and the norms' gains (the only vectors)."""
    params = count_params(m)
    head = 0 if m.tie_embeddings else params.embedding
    norms = m.n_layers * (2 * m.dim + (2 * m.head_dim if m.qk_norm else 0)) + m.dim
    return params.total - params.embedding - head - norms


def model_state_bytes(m: ModelConfig, degrees: dict[str, int], optimizer: str = "adamw") -> float:
    """fp32 weights, gradients and `optimizer`'s state one rank holds (the busiest, for the
    experts)."""
    experts = routed_expert_params(m) if m.num_experts > 0 else 0
    total = count_params(m).total
    # Muon's AdamW half (embeddings, head, norms) is counted apart from its matrices; for the
    # other optimizers every parameter costs the same.
    adamw_half = total - muon_matrix_params(m) if optimizer == "muon" else 0
    matrix = WEIGHT_AND_GRAD_BYTES + state_bytes_per_param(optimizer, muon_matrix=True)
    rest = WEIGHT_AND_GRAD_BYTES + state_bytes_per_param(optimizer, muon_matrix=False)
    # Dense parameters (and an MoE layer's router and shared experts): TP splits them (those it
    # applies to), FSDP shards them over dp_shard × ep (and the tp ranks for what TP leaves
    # whole), pipeline stages split the layers.
    dense_shards = degrees["dp_shard"] * degrees["ep"] * degrees["cp"] * degrees["tp"]
    dense_bytes = matrix * (total - experts - adamw_half) + rest * adamw_half
    dense = dense_bytes / (dense_shards * degrees["pp"])
    if not experts:
        return dense
    stored = expert_shards(m, degrees).stored
    # The routed experts are matrices: Muon's when it is the optimizer.
    return dense + matrix * experts * stored / m.num_experts / degrees["pp"]


def gathered_kv_bytes(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """Bytes of the keys and values one attention layer gathers under context parallel, for one
    micro-batch (bf16): the whole sequences' (batch, kv heads / tp, seq_len, head_dim) twice.
    This rank's own part is among the layer's activations already; the rest, (cp − 1) / cp of
    it, is what the all-gather brings in (and the reduce-scatter sends back in backward)."""
    if degrees["cp"] == 1:
        return 0.0
    m, t = cfg.model, cfg.train
    n_micro = microbatches(cfg.distributed, t.batch_size) if degrees["pp"] > 1 else 1
    sequences = t.batch_size / n_micro
    return 2 * 2 * sequences * t.seq_len * m.n_kv_heads / degrees["tp"] * m.head_dim


def estimate_memory(cfg: JobConfig, degrees: dict[str, int]) -> MemoryEstimate:
    m, t = cfg.model, cfg.train
    model_state = model_state_bytes(m, degrees, cfg.optimizer.name)
    # Under pipeline parallel a pass is split into micro-batches, several of them in flight.
    n_micro = microbatches(cfg.distributed, t.batch_size) if degrees["pp"] > 1 else 1
    in_flight = in_flight_microbatches(cfg.distributed, n_micro)
    tokens = t.seq_len * t.batch_size / n_micro / degrees["cp"]
    # Sequence parallel: each tp rank keeps its own seq_len / tp tokens (MoE blocks included:
    # a tp rank routes only its sequence shard).
    per_rank = tokens / degrees["tp"]
    # The other cp ranks' keys and values, kept for the backward.
    gathered = gathered_kv_bytes(cfg, degrees) * (degrees["cp"] - 1) / degrees["cp"]
    dense_layer = layer_bytes_per_token(m, moe=False) * per_rank + gathered
    moe_layer = layer_bytes_per_token(m, moe=True) * per_rank + gathered
    checkpointed_layer = CHECKPOINTED_LAYER_BYTES * m.dim * per_rank
    layers = math.ceil(m.n_layers / degrees["pp"])
    checkpointed = {"none": 0, "full": layers, "selective": (layers + 1) // 2}[
        t.activation_checkpointing
    ]
    # Which layers a rank holds and which of them are checkpointed is not worked out here: the
    # worst case is assumed, the rank holding as many MoE layers as there are and the biggest
    # layers being the ones that are not checkpointed.
    moe_layers = min(layers, sum(m.is_moe_layer(i) for i in range(m.n_layers)))
    sizes = sorted([moe_layer] * moe_layers + [dense_layer] * (layers - moe_layers), reverse=True)
    per_micro_batch = checkpointed * checkpointed_layer + sum(sizes[: layers - checkpointed])
    recompute = sizes[0] if checkpointed else 0
    activations = in_flight * per_micro_batch + recompute
    # fp32 logits and their gradient, of one chunk of tokens at a time with the chunked loss.
    logit_tokens = min(tokens, t.loss_chunk_tokens) if t.loss == "chunked_cross_entropy" else tokens
    logits = 2 * 4 * logit_tokens * m.vocab_size / degrees["tp"]
    return MemoryEstimate(model_state=model_state, activations=activations + logits)
