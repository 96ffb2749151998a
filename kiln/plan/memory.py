"""Peak memory per GPU during a training step, term by term, for `kiln check` and `kiln plan`.

  model state     fp32 weights, gradients, optimizer state, sharded (kiln/plan/model_state.py)
  activations     what the blocks keep for backward under the AC mode, the micro-batches in
                  flight, and the block being recomputed (kiln/plan/activations.py)
  logits          the loss's logits at their peak, fp32 or fused by compile (activations.py)
  gathered        FSDP's units in flight in bf16 (`gathered_unit_bytes`), the root unit
                  (embeddings and head, gathered for the whole step), or without FSDP the bf16
                  weight copies autocast makes
  dispatch        expert parallel's all-to-all send and receive buffers of one MoE layer

They do not all peak together. Gradients are set to None after each optimizer step and build
up during the backward, after the loss has freed the logits; so the peak is the larger of the
loss's moment (logits, no gradients yet but those of earlier micro-batches under gradient
accumulation) and the backward's (every gradient, the block being recomputed), on top of the
weights, optimizer state, gathered weights and kept activations (`peak_bytes`). That is what
`torch.cuda.max_memory_allocated` would read. PyTorch's caching allocator
reserves more than that (freed blocks it keeps, fragmentation) and CUDA's context and NCCL's
buffers sit outside it: `reserved_bytes` adds `ALLOCATOR_OVERHEAD`, and a layout fits when that
plus `CONTEXT_BYTES` is within the GPU's memory. It is an estimate for choosing a layout, not a
promise; docs/scaling.md says how to correct it from one short run.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config.sections import JobConfig, ModelConfig
from kiln.plan import model_facts
from kiln.plan.activations import (
    KILN,
    Implementation,
    activation_bytes,
    logit_bytes,
    microbatch_tokens,
)
from kiln.plan.model_state import model_state, params_per_rank

# The caching allocator's reserve over the allocated peak (blocks freed but kept, split blocks
# that a larger request cannot use); stated, not measured: PyTorch's own guidance for a
# steady training loop is a few percent, more with expandable_segments off and MoE's ragged
# sizes.
ALLOCATOR_OVERHEAD = 0.05
# CUDA context, cuBLAS workspaces and NCCL's buffers: outside PyTorch's allocator.
CONTEXT_BYTES = 2e9
# Under FSDP, in one unit's backward: its gathered bf16 weights (2), the next unit's prefetched
# (2), its unsharded bf16 gradient (2) and that gradient's fp32 copy for the reduce-scatter (4).
GATHERED_UNIT_BYTES = 2 + 2 + 2 + 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU holds at its peak, by term (the busiest rank where ranks differ)."""

    weights: float
    grads: float
    optimizer: float
    activations: float  # kept for backward, all micro-batches in flight
    recompute: float = 0.0  # the block recomputed in backward and its gradients
    logits: float = 0.0
    gathered: float = 0.0
    dispatch: float = 0.0
    accumulating: bool = False  # gradient accumulation: earlier micro-batches' gradients exist

    @property
    def model_state(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return peak_bytes(self)

    @property
    def reserved(self) -> float:
        """What the caching allocator holds for that peak."""
        return self.total * (1 + ALLOCATOR_OVERHEAD)

    def terms(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "recompute": self.recompute,
            "logits": self.logits,
            "gathered": self.gathered,
            "dispatch": self.dispatch,
        }


def peak_bytes(e: MemoryEstimate) -> float:
    """The larger of the two moments a step peaks at, on top of what is always there: the
    loss's (logits; gradients only of earlier micro-batches) and the backward's (all gradients,
    the block being recomputed)."""
    always = e.weights + e.optimizer + e.gathered + e.dispatch + e.activations
    at_loss = e.logits + (e.grads if e.accumulating else 0.0)
    in_backward = e.grads + e.recompute
    return always + max(at_loss, in_backward)


def fits(estimate: MemoryEstimate, memory_bytes: float) -> bool:
    return estimate.reserved + CONTEXT_BYTES <= memory_bytes


def fsdp_sharded(degrees: dict[str, int]) -> bool:
    """Whether FSDP shards the model: more than one rank holds different tokens."""
    return degrees["dp_replicate"] * degrees["dp_shard"] * degrees["ep"] * degrees["cp"] > 1


def largest_unit_params(m: ModelConfig, degrees: dict[str, int]) -> float:
    """Parameters of the largest FSDP unit inside a block on one tp rank: attention (split by tp
    but what tp leaves whole: MLA's down-projections and latent norms), a linear mixer (split by
    tp; the Gated DeltaNet's gated norm, replicated, is a few hundred), the dense feed-forward
    (split by tp), or one ep rank's routed experts (whole, all of them)."""
    a = model_facts.attention(m)
    attention = (a.params - a.replicated_params) / degrees["tp"] + a.replicated_params
    units = [attention]
    linear_mixer = model_facts.linear_mixer(m)
    if linear_mixer is not None:
        units.append(linear_mixer.params / degrees["tp"])
    if model_facts.moe_layers(m) < model_facts.blocks(m):
        units.append(3 * m.dim * m.ffn_hidden_dim / degrees["tp"])
    if m.moe.num_experts > 0:
        units.append(m.moe.num_experts // degrees["ep"] * 3 * m.dim * m.expert_hidden_dim)
    return max(units)


def root_unit_params(m: ModelConfig, degrees: dict[str, int]) -> float:
    """Parameters of the root unit on the busiest (last) pipeline rank and one tp rank: the
    output head (vocabulary-split by tp) and the token embeddings when one stage holds both or
    the last stage's multi-token prediction modules embed the tokens ahead (those modules' depths
    are FSDP units of their own, like blocks)."""
    head = m.vocab_size * m.dim
    last_embeds = degrees["pp"] == 1 or model_facts.mtp_depth(m) > 0
    embeddings = head if last_embeds and not m.tie_embeddings else 0
    return (head + embeddings) / degrees["tp"]


def gathered_unit_bytes(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """bf16 weights gathered beyond the shards. Under FSDP: the largest block unit in its
    backward (`GATHERED_UNIT_BYTES` per parameter, float8 all-gather halving the gathered
    weights), and the root unit, gathered for the whole step (2 per parameter) whose head's bf16
    gradient (2) waits for the end of backward. Without FSDP: autocast's bf16 copy of every
    weight, kept through the forward."""
    m = cfg.model
    if not fsdp_sharded(degrees):
        if cfg.train.mixed_precision == "fp32":
            return 0.0
        return 2 * sum(params_per_rank(m, degrees))
    float8 = cfg.train.mixed_precision == "fp8" and cfg.fp8.fsdp_float8_all_gather
    per_param = GATHERED_UNIT_BYTES - (2 if float8 else 0)
    head = m.vocab_size * m.dim / degrees["tp"]
    root = 2 * root_unit_params(m, degrees) + 2 * head
    return per_param * largest_unit_params(m, degrees) + root


def dispatch_bytes(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """Expert parallel's all-to-all buffers for one MoE layer: every routed copy of this tp
    rank's tokens sent and received, bf16 rows of dim."""
    m = cfg.model
    if m.moe.num_experts <= 0 or degrees["ep"] == 1:
        return 0.0
    copies = microbatch_tokens(cfg, degrees) / degrees["tp"] * m.moe.top_k
    return 2 * 2 * copies * m.dim


def estimate_memory(
    cfg: JobConfig, degrees: dict[str, int], impl: Implementation = KILN
) -> MemoryEstimate:
    """Every term for `cfg` on the layout `degrees` (resolved: no -1)."""
    state = model_state(cfg.model, degrees, cfg.optimizer.name)
    activations = activation_bytes(cfg, degrees, impl)
    return MemoryEstimate(
        weights=state.weights,
        grads=state.grads,
        optimizer=state.optimizer,
        activations=activations.kept,
        recompute=activations.recompute,
        logits=logit_bytes(cfg, degrees, impl),
        gathered=gathered_unit_bytes(cfg, degrees),
        dispatch=dispatch_bytes(cfg, degrees),
        accumulating=cfg.train.grad_accum_steps > 1,
    )
