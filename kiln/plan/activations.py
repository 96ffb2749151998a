"""Activation memory per GPU: what kiln's blocks keep for backward, per layer, per token.

Counted from what the modules save (tests/unit/test_plan_memory.py measures a block and an MoE
feed-forward with saved-tensor hooks), in bf16 compute with flash attention (no seq² term) and
CUDA's fused RMSNorm, which keeps its bf16 input and an fp32 rstd per token:

  attention: its norm's input 2·d + rstd 4, the normalized input the q/k/v projections keep
             2·d, q 2·d, k and v 2·kv_dim each, attention's output 2·d (wo's input, the same
             storage), flash attention's log-sum-exp 4 per head; in general the widths the
             family's `AttentionTerms` gives (MLA: queries and keys of heads·(nope + rope),
             values and output of heads·v), and MLA's low-rank latents besides (each norm's
             input 2 and rstd 4, the normalized latent its up-projection keeps 2);
  feed-forward: its norm's input 2·d + rstd 4, the normalized input 2·d, and SwiGLU's w1 and w3
             outputs, silu(w1) and the product (w2's input), 2·hidden each.

Tensor parallel with sequence parallel (kiln's) divides all of it by tp but the two normalized
inputs: the projections keep them all-gathered, the whole sequence on every tp rank; MLA's
latents stay whole too (tp splits its heads after the up-projections). Without sequence
parallel the norms' inputs are not divided either. An MoE block keeps attention and the
norm and replaces SwiGLU's share by `moe_ffn_bytes_per_token` (each tp rank routes its own
sequence shard, so it divides by tp whole).

Activation checkpointing (kiln/parallel/activation_checkpoint.py): `full` keeps each block's
input (2·d, sequence-split under tp) and recomputes one block at a time in backward, which then
holds that block's activations and the largest gradients of its backward (`backward_transient`);
`selective` checkpoints every other block (even layer indices). Context parallel divides the
tokens by cp, but each layer's attention keeps what its exchange needs for the backward
(`cp_held_bytes`): the all-gather the keys and values of the whole sequence it gathered
(`gathered_kv_bytes`; MLA's expanded per head, not its latent), the all-to-all and the ring a
second copy of their own tokens' output; the ring's blocks in flight exist only inside the one
layer computing (`cp_transient_bytes`). Under pipeline
parallel a rank holds its layers for as many micro-batches as its schedule keeps in flight
(docs/pipeline.md); the busiest is the last, which also runs the multi-token prediction
modules: per depth one more block with the norms and projection around it
(`mtp_bytes_per_token`), checkpointed as a whole by the rule for blocks (its layer index follows
the model's), and one more set of logits (`logit_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config.sections import JobConfig, ModelConfig
from kiln.parallel.pipeline_split import in_flight_microbatches, microbatches
from kiln.plan import model_facts

# A fused norm's saved fp32 rstd per token, and flash attention's log-sum-exp per head.
RSTD_BYTES = 4
LSE_BYTES = 4
# bf16 block input kept by a checkpointed block.
CHECKPOINTED_LAYER_BYTES = 2
# The eager loss at its peak, per logit (kiln/train/loss.py): from the fp32 copy of the logits,
# the log-softmax cross entropy keeps its log-probabilities (4) and in backward their gradient (4)
# and the fp32 logits' gradient (4), before the cast back to the model's dtype. The z-loss's
# logsumexp also keeps the fp32 copy (4) and adds its gradient (4): measured 12 and 20 bytes per
# bf16 logit on CPU (tests/unit/test_loss.py).
LOGIT_BYTES = 12
Z_LOSS_LOGIT_BYTES = 8
# The compiled loss (train.compile, logits not vocabulary-sharded) computes in fp32 inside its
# kernels: the logits its backward keeps and their gradient, each in the model's dtype.
COMPILED_LOGIT_COPIES = 2


@dataclass(frozen=True)
class Implementation:
    """How the training code lays out activations; kiln's by default. The comparison with other
    frameworks' published runs states where they differ (benchmarks/planner.md)."""

    sequence_parallel: bool = True  # norms and residual stream split over tp
    loss_parallel: bool = True  # logits split over the vocabulary on tp ranks


KILN = Implementation()


def attention_bytes_per_token(m: ModelConfig, tp: int = 1, *, sp: bool = True) -> float:
    """Bytes the attention half of a block (its norm included) keeps for one token."""
    a = model_facts.attention(m)
    norm_input = 2 * m.dim + RSTD_BYTES
    # Queries, keys and values, then the attention output that wo takes.
    split = 2 * (a.query_width + a.key_width + a.value_width + a.output_width)
    split += LSE_BYTES * a.heads
    # Low-rank latents (MLA), whole on every tp rank: each norm's input and the normalized
    # latent the up-projection keeps, bf16, and each norm's rstd.
    latents = 2 * 2 * a.latent_width + RSTD_BYTES * a.latent_norms
    return (norm_input / tp if sp else norm_input) + 2 * m.dim + latents + split / tp


def ffn_norm_bytes_per_token(
    m: ModelConfig, tp: int = 1, *, sp: bool = True, moe: bool = False
) -> float:
    """The feed-forward's norm: its input (split over tp under sequence parallel) and the
    normalized input a dense feed-forward keeps (gathered: whole). An MoE feed-forward keeps
    its own copies instead (`moe_ffn_bytes_per_token`)."""
    norm_input = 2 * m.dim + RSTD_BYTES
    return (norm_input / tp if sp else norm_input) + (0 if moe else 2 * m.dim)


def swiglu_bytes_per_token(m: ModelConfig, tp: int = 1) -> float:
    """w1 and w3 outputs, silu(w1), their product: four rows of the hidden width, split by tp."""
    return 4 * 2 * m.ffn_hidden_dim / tp


def moe_ffn_bytes_per_token(m: ModelConfig) -> float:
    """Bytes one token's pass through an MoE feed-forward keeps for backward, bf16 compute.

    Counted from what kiln/model/moe saves (measured with saved-tensor hooks in the tests): for
    each of the top-k copies of the token, its dispatched row, the expert's output and its slot
    in the combine buffer (3 rows of dim, bf16) and the expert's four hidden activations (w1 and
    w3 outputs, silu, their product: 4 rows of the expert width, bf16), plus its sort position,
    expert index (int64) and weight (fp32); per token the fp32 copy of the input the router's
    gate runs on, and three fp32 score rows over all experts (logits, scores, normalized
    scores); the shared experts like a dense SwiGLU of their width.
    """
    d, k, experts = m.dim, m.moe.top_k, m.moe.num_experts
    per_copy = 2 * (3 * d + 4 * m.expert_hidden_dim) + 8 + 8 + 4
    router = 4 * d + 3 * 4 * experts
    shared_width = m.moe.shared_experts * m.expert_hidden_dim
    shared = 2 * (2 * d + 4 * shared_width) if shared_width else 0
    return k * per_copy + router + shared


def mtp_bytes_per_token(
    m: ModelConfig, tp: int = 1, *, sp: bool = True, checkpointed: bool = False
) -> float:
    """What one multi-token prediction depth (kiln/model/deepseek/mtp.py) keeps in front of and
    behind its block, per token: the embedding of the token ahead its norm takes (2·d; the
    previous hidden state the other norm takes is kept already), the three norms' rstd (4
    each), the two normalized rows concatenated for proj (4·d), the block output its final norm
    takes (2·d) and the normalized output the head takes (2·d, gathered under tp). The norms'
    inputs split over tp under sequence parallel like the blocks'. `checkpointed`: the depth is
    recomputed in backward and keeps only its input embedding and what the head holds."""
    embedding, head_input = 2 * m.dim, 2 * m.dim
    if checkpointed:
        return (embedding / tp if sp else embedding) + head_input
    norm_inputs = embedding + 2 * m.dim + 3 * RSTD_BYTES
    return (norm_inputs / tp if sp else norm_inputs) + 4 * m.dim + head_input


def linear_mixer_bytes_per_token(m: ModelConfig, tp: int = 1, *, sp: bool = True) -> float:
    """Bytes a block's linear mixer (a Gated DeltaNet, `LinearMixerTerms`), its norm included,
    keeps for one token: the norm's input and the normalized input as attention's, and what the
    family counts, split over tp by heads."""
    terms = model_facts.linear_mixer(m)
    assert terms is not None, "a linear mixer's bytes asked of a model without one"
    norm_input = 2 * m.dim + RSTD_BYTES
    return (norm_input / tp if sp else norm_input) + 2 * m.dim + terms.kept_bytes_per_token / tp


def ffn_bytes_per_token(m: ModelConfig, *, moe: bool, tp: int = 1, sp: bool = True) -> float:
    """Bytes the feed-forward half of a block, its norm included, keeps for one token."""
    norm = ffn_norm_bytes_per_token(m, tp, sp=sp, moe=moe)
    return norm + (moe_ffn_bytes_per_token(m) / tp if moe else swiglu_bytes_per_token(m, tp))


def layer_bytes_per_token(
    m: ModelConfig, *, moe: bool, tp: int = 1, sp: bool = True, linear: bool = False
) -> float:
    """Activation bytes one token keeps in one layer without checkpointing, on one tp rank;
    `linear`: a block whose token mixer is a linear recurrence rather than attention."""
    mixer = linear_mixer_bytes_per_token if linear else attention_bytes_per_token
    return mixer(m, tp, sp=sp) + ffn_bytes_per_token(m, moe=moe, tp=tp, sp=sp)


def backward_transient_bytes_per_token(m: ModelConfig, tp: int = 1) -> float:
    """The largest gradients one block's backward holds at once besides its activations: the
    three hidden-width gradients of SwiGLU (of w2's input, then of w1's and w3's outputs) and
    the gradient of the gathered normalized input, bf16."""
    hidden = max(m.ffn_hidden_dim, m.moe.top_k * m.expert_hidden_dim if m.moe.num_experts else 0)
    return 3 * 2 * hidden / tp + 2 * m.dim


def gathered_kv_bytes(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """Bytes of the keys and values one attention layer gathers under context parallel, for one
    micro-batch (bf16): the whole sequences' keys and values, split over tp by heads.
    This rank's own part is among the layer's activations already; the rest, (cp − 1) / cp of
    it, is what the all-gather brings in (and the reduce-scatter sends back in backward)."""
    if degrees["cp"] == 1:
        return 0.0
    m, t = cfg.model, cfg.train
    sequences = t.batch_size / pipeline_microbatches(cfg, degrees)
    width = model_facts.attention(m).gathered_width
    return 2 * sequences * t.seq_len * width / degrees["tp"]


def own_kv_bytes(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """Bytes of this cp rank's own keys and values in one attention layer, per micro-batch
    (bf16): one block of the ring, 1/cp of `gathered_kv_bytes`."""
    return gathered_kv_bytes(cfg, degrees) / degrees["cp"]


def cp_held_bytes(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """Bytes one attention layer keeps for its backward beyond its own tokens' activations, per
    micro-batch (bf16), for context parallel's exchange (distributed.cp_mode): `all_gather`
    keeps the other cp ranks' keys and values; `all_to_all` keeps the attention's output twice,
    over the heads (attention's own) and back over the sequence (the output projection's
    input, a new buffer where the all-gather's is a view): one more output of its own tokens
    (benchmarks/context_parallel.md measured both). Its re-split queries, keys and values stand
    in for the local ones attention would keep (as many numbers). `ring` keeps what attention
    over its own keys would (its queries, keys, values and log-sum-exp), and its output as it
    returns it, over the heads, besides the output projection's copy over the sequence
    (kiln/parallel/ring_attention.py): one more output too, nothing of the other ranks' keys and
    values."""
    cp = degrees["cp"]
    if cp == 1:
        return 0.0
    if cfg.distributed.cp_mode == "all_gather":
        return gathered_kv_bytes(cfg, degrees) * (cp - 1) / cp
    output = model_facts.attention(cfg.model).output_width / degrees["tp"]
    return 2 * microbatch_tokens(cfg, degrees) * output


def cp_transient_bytes(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """Bytes the exchange holds only inside the one layer computing, at the backward's peak, per
    micro-batch: `ring`'s block of keys and values in hand and the one arriving (bf16), with
    the gradient accumulators that travel with them (fp32: twice their bytes each), 6 blocks'
    worth; its forward holds only the 2 blocks. The other modes' are not counted."""
    if degrees["cp"] == 1 or cfg.distributed.cp_mode != "ring":
        return 0.0
    return (2 + 2 * 2) * own_kv_bytes(cfg, degrees)


def cp_exchange_bytes(cfg: JobConfig, degrees: dict[str, int], *, backward: bool = False) -> float:
    """Bytes one attention layer's context-parallel exchange sends from each rank, per
    micro-batch, in a forward pass or (`backward`) the backward: the all-gather of keys and
    values ((cp − 1)/cp of the whole sequences'; the reduce-scatter sends as many back), the
    all-to-alls of the queries, keys, values and output ((cp − 1)/cp of the rank's own, and
    as many back), or the ring's cp − 1 sends of a block of keys and values (as many bytes as
    the all-gather), whose backward passes the blocks around again and sends each block's
    fp32 gradient after every one of its cp steps."""
    cp = degrees["cp"]
    if cp == 1:
        return 0.0
    mode = cfg.distributed.cp_mode
    if mode == "all_gather":
        return gathered_kv_bytes(cfg, degrees) * (cp - 1) / cp
    if mode == "ring":
        kv = own_kv_bytes(cfg, degrees)
        return (cp - 1) * kv + (cp * 2 * kv if backward else 0)
    a = model_facts.attention(cfg.model)
    width = (a.query_width + a.key_width + a.value_width + a.output_width) / degrees["tp"]
    sequences = cfg.train.batch_size / pipeline_microbatches(cfg, degrees)
    return 2 * sequences * cfg.train.seq_len / cp * width * (cp - 1) / cp


def pipeline_microbatches(cfg: JobConfig, degrees: dict[str, int]) -> int:
    """Micro-batches one pass is split into: the pipeline's, or the whole batch at once."""
    return microbatches(cfg.distributed, cfg.train.batch_size) if degrees["pp"] > 1 else 1


def microbatch_tokens(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """Tokens of one micro-batch on one cp rank (all tp ranks of it see them)."""
    t = cfg.train
    return t.seq_len * t.batch_size / pipeline_microbatches(cfg, degrees) / degrees["cp"]


@dataclass(frozen=True)
class Activations:
    """Bytes one rank holds at its peak: the layers' kept activations over the micro-batches in
    flight, and the block being recomputed with its backward's gradients."""

    kept: float
    recompute: float

    @property
    def total(self) -> float:
        return self.kept + self.recompute


def is_checkpointed(mode: str, layer: int) -> bool:
    """Whether `mode` checkpoints the block of layer index `layer` (activation_checkpoint.py)."""
    return mode == "full" or (mode == "selective" and layer % 2 == 0)


def checkpointed_layers(mode: str, layers: int) -> int:
    """Of a rank's `layers`, how many `mode` checkpoints: all, every other one, none."""
    return {"none": 0, "full": layers, "selective": (layers + 1) // 2}[mode]


def activation_bytes(
    cfg: JobConfig, degrees: dict[str, int], impl: Implementation = KILN
) -> Activations:
    m, tp, sp = cfg.model, degrees["tp"], impl.sequence_parallel
    tokens = microbatch_tokens(cfg, degrees)
    in_flight = in_flight_microbatches(cfg.distributed, pipeline_microbatches(cfg, degrees))
    # What the cp exchange keeps beyond the layer's own tokens (all_gather: the other cp ranks'
    # keys and values).
    gathered = cp_held_bytes(cfg, degrees)
    dense = layer_bytes_per_token(m, moe=False, tp=tp, sp=sp) * tokens + gathered
    moe = layer_bytes_per_token(m, moe=True, tp=tp, sp=sp) * tokens + gathered
    checkpointed = CHECKPOINTED_LAYER_BYTES * m.dim * tokens / (tp if sp else 1)
    layers = model_facts.stage_layers(m, degrees["pp"])
    n_checkpointed = checkpointed_layers(cfg.train.activation_checkpointing, layers)
    sizes = stage_layer_sizes(cfg, degrees, tokens=tokens, gathered=gathered, sp=sp)
    # The biggest layers are the ones not checkpointed (the worst case).
    whole = layers - n_checkpointed
    per_micro_batch = n_checkpointed * checkpointed + sum(sizes[:whole])
    # The last stage's MTP depths, each checkpointed whole or kept: its block and what
    # surrounds it.
    for layer in model_facts.mtp_layers(m):
        wrapped = is_checkpointed(cfg.train.activation_checkpointing, layer)
        per_micro_batch += mtp_bytes_per_token(m, tp, sp=sp, checkpointed=wrapped) * tokens
        if not wrapped:
            per_micro_batch += moe if m.is_moe_layer(layer) else dense
    # The backward of the last micro-batch holds one block's gradients, the feed-forward's or,
    # after they are freed, its attention's ring blocks in flight; a checkpointed block's own
    # activations besides, recomputed.
    ffn = backward_transient_bytes_per_token(m, tp) * tokens
    transient = max(ffn, cp_transient_bytes(cfg, degrees))
    recompute = (sizes[0] if n_checkpointed else 0) + transient
    return Activations(kept=in_flight * per_micro_batch, recompute=recompute)


def stage_layer_sizes(
    cfg: JobConfig, degrees: dict[str, int], *, tokens: float, gathered: float, sp: bool
) -> list[float]:
    """Bytes each of the busiest stage's blocks keeps for one micro-batch, biggest first.

    Which blocks a rank holds is not worked out: the worst case is assumed, the rank holding
    the biggest token mixers (a linear mixer or attention, whichever keeps more, as many as
    the model has) paired with the biggest feed-forwards (MoE or dense). `gathered`: what
    attention keeps beyond its tokens for context parallel's exchange; `sp`: sequence parallel."""
    m, tp = cfg.model, degrees["tp"]
    layers = model_facts.stage_layers(m, degrees["pp"])
    n_linear = model_facts.linear_mixer_layers(m)
    attention = attention_bytes_per_token(m, tp, sp=sp) * tokens + gathered
    mixers = [attention] * (m.n_layers - n_linear)
    if n_linear:
        mixers += [linear_mixer_bytes_per_token(m, tp, sp=sp) * tokens] * n_linear
    n_moe = model_facts.moe_layers(m) - model_facts.mtp_moe_blocks(m)
    ffns = [ffn_bytes_per_token(m, moe=True, tp=tp, sp=sp) * tokens] * n_moe
    ffns += [ffn_bytes_per_token(m, moe=False, tp=tp, sp=sp) * tokens] * (m.n_layers - n_moe)
    pairs = zip(sorted(mixers, reverse=True)[:layers], sorted(ffns, reverse=True), strict=False)
    return [mixer + ffn for mixer, ffn in pairs]


def logit_bytes(cfg: JobConfig, degrees: dict[str, int], impl: Implementation = KILN) -> float:
    """The loss's logits at their peak: of every token of a micro-batch (loss parallel gathers
    the sequence) over the vocabulary split by tp, or of one chunk of `train.loss_chunk_tokens`
    tokens with the chunked loss; `loss_bytes_per_logit` each. Each multi-token prediction depth
    computes its loss in the forward over every token (kiln/model/deepseek/mtp.py) and keeps
    its fp32 log-probabilities (4 per logit) until the backward reaches it, whichever the main
    loss."""
    m, t = cfg.model, cfg.train
    tokens = microbatch_tokens(cfg, degrees)
    mtp = 4 * model_facts.mtp_depth(m) * tokens
    if t.loss == "chunked_cross_entropy":
        tokens = min(tokens, t.loss_chunk_tokens)
    vocab = m.vocab_size / degrees["tp"] if impl.loss_parallel else m.vocab_size
    return (loss_bytes_per_logit(cfg, degrees, impl) * tokens + mtp) * vocab


def loss_bytes_per_logit(
    cfg: JobConfig, degrees: dict[str, int], impl: Implementation = KILN
) -> float:
    """Bytes per logit at the loss's peak: compiled, two copies in the model's dtype; eager (the
    chunked loss, vocabulary-sharded logits under tp, or no `train.compile`), the fp32 ones."""
    t = cfg.train
    sharded = degrees["tp"] > 1 and impl.loss_parallel
    if t.compile and t.loss == "cross_entropy" and not sharded:
        fp32 = t.mixed_precision == "fp32" or (
            t.mixed_precision == "fp8" and cfg.fp8.high_precision == "fp32"
        )
        return COMPILED_LOGIT_COPIES * (4 if fp32 else 2)
    return LOGIT_BYTES + (Z_LOSS_LOGIT_BYTES if t.z_loss_weight > 0 else 0)
