"""Model state per GPU: fp32 weights and gradients and the optimizer's state, as sharded.

fp32 weights and gradients are 8 bytes per parameter (mixed precision computes in bf16 from the
fp32 masters; FP8 too: torchao casts the masters in each forward), and the optimizer's state
(`state_bytes_per_param`): AdamW's two moments and Schedule-Free AdamW's z and v 8 bytes, Lion's
momentum 4, Muon's momentum 4 for the matrices it takes (attention, feed-forwards, experts,
router, shared experts) and AdamW's 8 for the rest (embeddings, output head, norms). Divided
over every dimension that shards parameters: dp_shard, ep (its ranks read other batches, so FSDP
shards the dense parameters over dp_shard × ep), cp, tp, pp; dp_replicate (HSDP) divides nothing.

With MoE every expert counts: a token uses only its top-k, but every expert has weights,
gradients and moments. The routed experts are counted apart (`expert_shards`): ep gives each
rank E/ep experts of every MoE layer, and FSDP shards that slice over dp_shard × cp × tp
(kiln/parallel/fsdp.py). It splits each expert's rows (dim 1 of the stacked weights: hidden for
w1 and w3, dim for w2) when they divide by those ranks, else its columns (dim 2), so every rank
holds (E/ep) / ranks of the experts' weights, a fraction of each. A weight whose rows and columns
both do not divide keeps FSDP2's default, the expert dimension, cut into chunks of
ceil(E/ep / ranks) whole experts; every rank stores a whole chunk of that weight and its
gradient, padded where its chunk is short or empty, so with fewer experts than ranks the
busiest rank holds one whole expert of it per layer: the estimate counts that rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.config.sections import ModelConfig
from kiln.plan import model_facts

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
    the output head, i.e. all but those and the norms' gains (the only vectors): each block's
    two, q/k norms, MLA's latent norms; the final norm and each MTP module's three."""
    params = model_facts.params(m)
    head = 0 if m.tie_embeddings else params.embedding
    per_block = 2 * m.dim + (2 * m.resolved_head_dim if m.qk_norm else 0)
    per_block += model_facts.attention(m).latent_width
    norms = model_facts.blocks(m) * per_block + m.dim + 3 * m.dim * model_facts.mtp_depth(m)
    return params.total - params.embedding - head - norms


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
    local = m.moe.num_experts // degrees["ep"]
    ranks = degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
    whole = tuple(
        name for name, dims in expert_weight_dims(m).items() if all(n % ranks for n in dims)
    )
    return ExpertShards(local, ranks, whole)


def routed_expert_params(m: ModelConfig) -> int:
    """Parameters of every routed expert of every MoE layer (w1, w2, w3 each)."""
    moe_layers = model_facts.moe_layers(m)
    return moe_layers * m.moe.num_experts * 3 * m.dim * m.expert_hidden_dim


@dataclass(frozen=True)
class ModelState:
    """Bytes one rank holds of each (the busiest rank, for the experts)."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def model_state(m: ModelConfig, degrees: dict[str, int], optimizer: str = "adamw") -> ModelState:
    """fp32 weights, fp32 gradients and `optimizer`'s state one rank holds: `params_per_rank`
    of each, at 4, 4 and the optimizer's bytes per parameter."""
    total = model_facts.params(m).total
    # Muon's AdamW half (embeddings, head, norms) is counted apart from its matrices; for the
    # other optimizers every parameter costs the same.
    adamw_half = total - muon_matrix_params(m) if optimizer == "muon" else 0
    matrices, rest = params_per_rank(m, degrees, adamw_half=adamw_half)
    state = state_bytes_per_param(optimizer, muon_matrix=True) * matrices
    state += state_bytes_per_param(optimizer, muon_matrix=False) * rest
    held = matrices + rest
    return ModelState(weights=4 * held, grads=4 * held, optimizer=state)


def params_per_rank(
    m: ModelConfig, degrees: dict[str, int], *, adamw_half: int = 0
) -> tuple[float, float]:
    """Parameters one rank holds: (matrices, the `adamw_half` rest), the routed experts among the
    matrices. Dense parameters (and an MoE layer's router and shared experts): TP splits them,
    FSDP shards them over dp_shard × ep × cp (and the tp ranks for what TP leaves whole),
    pipeline stages split the layers."""
    experts = routed_expert_params(m) if m.moe.num_experts > 0 else 0
    total = model_facts.params(m).total
    dense_shards = degrees["dp_shard"] * degrees["ep"] * degrees["cp"] * degrees["tp"]
    shards = dense_shards * degrees["pp"]
    matrices = (total - experts - adamw_half) / shards
    if experts:
        # Routed experts: each ep rank's slice, split by FSDP as `expert_shards` says.
        stored = expert_shards(m, degrees).stored
        matrices += experts * stored / m.moe.num_experts / degrees["pp"]
    return matrices, adamw_half / shards


def model_state_bytes(m: ModelConfig, degrees: dict[str, int], optimizer: str = "adamw") -> float:
    """fp32 weights, gradients and `optimizer`'s state one rank holds (the busiest, for the
    experts)."""
    return model_state(m, degrees, optimizer).total
