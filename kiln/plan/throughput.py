"""Step time, tokens per second and MFU of a layout: compute, each collective, and how they
overlap.

Compute: the honest FLOPs per token MFU uses (the family's counts, kiln/model/llama/counts.py and
kiln/model/deepseek/counts.py: 6 per matmul weight a token goes through, MoE's top-k experts
only, MLA's down- and up-projections, multi-token prediction's blocks and extra head passes,
plus causal attention), times the recompute activation checkpointing adds (a block's forward is
a third of its forward and backward; MTP's blocks by the blocks' rule), plus the attention
forward ring attention runs again in every layer's backward, over the GPU's dense peak times
`COMPUTE_EFFICIENCY`. A pipeline adds its schedule's idle share
(kiln/parallel/pipeline_split.py's bubble formulas).

Communication, bytes each GPU sends per step, per collective (a ring moves (n − 1)/n of the
tensor per GPU for an all-gather or reduce-scatter, twice that for an all-reduce):
  fsdp_all_gather      bf16 weights (float8 with fsdp_float8_all_gather), in the forward and
                       again in the backward (once per pass under a pipeline), each micro-batch;
  fsdp_reduce_scatter  fp32 gradients each micro-batch; with HSDP an all-reduce across replicas;
  tp                   sequence parallel's all-gather and reduce-scatter of the residual stream
                       around attention and the dense feed-forward, forward, backward and
                       recompute;
  cp                   each layer's exchange (`cp_exchange_bytes`): the keys and values it
                       all-gathers (reduce-scatters in backward), the all-to-alls of queries,
                       keys, values and output, or the ring's blocks of keys and values (and
                       their fp32 gradients in backward), forward, backward and recompute;
  ep                   the all-to-all of every routed token copy to its expert and back;
  pp                   activations to the next stage and gradients back, each micro-batch.
A collective whose ranks sit inside one node runs on NVLink, one that spans nodes at the
network's rate (hardware.py); mesh dims nest pp, dp_replicate, dp_shard, ep, cp, tp from the
outside in, so a dim's ranks span the product of its degree and the inner ones.

Overlap rule: FSDP's all-gathers and reduce-scatters are prefetched and run on their own
stream, so they hide behind the compute and only what exceeds it adds to the step; tensor,
context, expert and pipeline transfers sit between the operations that need them (kiln runs
them synchronously) and add in full, but for the ring's: each of its steps sends a block while
attending another, so only what a step's transfer takes beyond its block's attention adds
(`cp_exposed_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.config.sections import JobConfig, ModelConfig
from kiln.parallel.pipeline_split import bubble_fraction
from kiln.plan import model_facts
from kiln.plan.activations import (
    checkpointed_layers,
    cp_exchange_bytes,
    is_checkpointed,
    microbatch_tokens,
    own_kv_bytes,
    pipeline_microbatches,
)
from kiln.plan.hardware import COMPUTE_EFFICIENCY, Cluster
from kiln.plan.model_state import routed_expert_params


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one GPU, and what it trains."""

    compute: float  # recompute included
    bubble: float
    comm: dict[str, float]  # seconds each collective takes
    exposed: float  # communication seconds the overlap rule leaves on the step
    tokens: float  # global tokens per step
    flops_per_token: float
    gpus: int
    peak_flops: float

    @property
    def seconds(self) -> float:
        return self.compute + self.bubble + self.exposed

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds

    @property
    def mfu(self) -> float:
        return self.tokens_per_sec * self.flops_per_token / (self.gpus * self.peak_flops)


def data_ranks(degrees: dict[str, int]) -> int:
    return degrees["dp_replicate"] * degrees["dp_shard"] * degrees["ep"]


def recompute_factor(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """Work over model FLOPs: checkpointed blocks run their forward twice, and a forward is a
    third of a block's forward and backward."""
    mode, m = cfg.train.activation_checkpointing, cfg.model
    layers = model_facts.stage_layers(m, degrees["pp"])
    # The last stage also runs MTP's blocks, checkpointed by their layer index.
    mtp = sum(is_checkpointed(mode, layer) for layer in model_facts.mtp_layers(m))
    blocks = model_facts.stage_blocks(m, degrees["pp"])
    share = (checkpointed_layers(mode, layers) + mtp) / blocks
    return 1 + share / 3


def ring_recompute_flops(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """FLOPs per token the ring adds: each step of its backward recomputes its block's attention
    forward (a third of attention's forward and backward) before back-propagating through it."""
    if degrees["cp"] == 1 or cfg.distributed.cp_mode != "ring":
        return 0.0
    return model_facts.attention_flops(cfg.model, cfg.train.seq_len) / 3


def compute_seconds(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster) -> float:
    """One GPU's share of its data rank's tokens per step, at the achievable rate."""
    t = cfg.train
    tokens = t.batch_size * t.grad_accum_steps * t.seq_len
    per_token = model_facts.flops(cfg.model, t.seq_len) * recompute_factor(cfg, degrees)
    flops = tokens * (per_token + ring_recompute_flops(cfg, degrees))
    per_gpu = flops / (degrees["tp"] * degrees["cp"] * degrees["pp"])
    return per_gpu / achievable_flops(cluster)


def achievable_flops(cluster: Cluster) -> float:
    """What one GPU computes per second: its dense peak at `COMPUTE_EFFICIENCY`."""
    return cluster.gpu.peak_flops * COMPUTE_EFFICIENCY


def ring_share(n: int) -> float:
    """Share of a gathered (or reduced) tensor each of `n` ranks sends in a ring."""
    return (n - 1) / n


def span(degrees: dict[str, int], dim: str) -> int:
    """Consecutive ranks one group of mesh dim `dim` spans (dims nest, tp innermost)."""
    order = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
    return math.prod(degrees[d] for d in order[order.index(dim) :])


def fsdp_seconds(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster) -> dict[str, float]:
    """FSDP's all-gathers and reduce-scatters per step (and HSDP's all-reduce)."""
    m, t, d = cfg.model, cfg.train, cfg.distributed
    shard = degrees["dp_shard"] * degrees["ep"] * degrees["cp"]
    if shard * degrees["dp_replicate"] == 1:
        return {}
    dense, local_experts = sharded_params(m, degrees)
    expert_ranks = degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
    gathered = dense * ring_share(shard) + local_experts * ring_share(expert_ranks)
    float8 = t.mixed_precision == "fp8" and cfg.fp8.fsdp_float8_all_gather
    gathers = 1 if degrees["pp"] > 1 or not d.reshard_after_forward else 2
    bandwidth = cluster.bandwidth(span(degrees, "dp_shard"))
    out = {
        "fsdp_all_gather": gathers * t.grad_accum_steps * (1 if float8 else 2) * gathered,
        "fsdp_reduce_scatter": gradient_reductions(cfg) * 4 * gathered,
    }
    out = {name: size / bandwidth for name, size in out.items()}
    if degrees["dp_replicate"] > 1:
        out["hsdp_all_reduce"] = gradient_reductions(cfg) * replica_sum_seconds(
            cfg, degrees, cluster
        )
    return out


def sharded_params(m: ModelConfig, degrees: dict[str, int]) -> tuple[float, float]:
    """Parameters one rank holds before FSDP shards them: the dense ones (split by tp and pp)
    and its ep rank's routed experts."""
    experts = routed_expert_params(m) if m.moe.num_experts > 0 else 0
    dense = (model_facts.params(m).total - experts) / (degrees["tp"] * degrees["pp"])
    return dense, experts / (degrees["ep"] * degrees["pp"])


def gradient_shard_params(m: ModelConfig, degrees: dict[str, int]) -> float:
    """Parameters in one rank's gradient shard: the dense ones over the FSDP ranks (dp_shard ×
    ep × cp), its experts over theirs (dp_shard × cp × tp)."""
    dense, local_experts = sharded_params(m, degrees)
    shard = degrees["dp_shard"] * degrees["ep"] * degrees["cp"]
    return dense / shard + local_experts / (degrees["dp_shard"] * degrees["cp"] * degrees["tp"])


def gradient_reductions(cfg: JobConfig) -> int:
    """Gradient reductions per step: every micro-batch (grad_reduce = per_micro_batch) or once."""
    t = cfg.train
    return t.grad_accum_steps if cfg.distributed.grad_reduce == "per_micro_batch" else 1


def replica_sum_seconds(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster) -> float:
    """One all-reduce of every rank's fp32 gradient shard across dp_replicate: HSDP's per
    reduction, replica groups' per step, DiLoCo's pseudo-gradient per sync."""
    size = 2 * 4 * gradient_shard_params(cfg.model, degrees) * ring_share(degrees["dp_replicate"])
    return size / cluster.bandwidth(span(degrees, "dp_replicate"))


def layer_passes(cfg: JobConfig, degrees: dict[str, int]) -> float:
    """Passes over a rank's layers per micro-batch that communicate: forward, backward and the
    recompute's forward."""
    return 2 + (recompute_factor(cfg, degrees) - 1) * 3


def tp_seconds(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster) -> float:
    """Sequence parallel: an all-gather before attention and before a dense feed-forward, a
    reduce-scatter after each (an MoE feed-forward runs on the sequence shard), of the
    micro-batch's residual stream in bf16, each pass; and the embeddings' and head's."""
    if degrees["tp"] == 1:
        return 0.0
    m = cfg.model
    layers = model_facts.stage_blocks(m, degrees["pp"])
    moe = min(layers, model_facts.moe_layers(m))
    collectives = (4 * (layers - moe) + 2 * moe) * layer_passes(cfg, degrees) + 4
    size = 2 * microbatch_tokens(cfg, degrees) * m.dim * ring_share(degrees["tp"])
    per_step = collectives * size * micro_batches_per_step(cfg, degrees)
    return per_step / cluster.bandwidth(span(degrees, "tp"))


def micro_batches_per_step(cfg: JobConfig, degrees: dict[str, int]) -> int:
    return pipeline_microbatches(cfg, degrees) * cfg.train.grad_accum_steps


def cp_seconds(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster) -> float:
    """Each layer's exchange over cp (`cp_exchange_bytes`), in every forward (the recompute's
    included) and backward: the keys and values (bf16; MLA's expanded per head) of its
    micro-batch's sequences (all_gather), its queries, keys, values and output re-split
    between the sequence and the heads (all_to_all), or its blocks of keys and values passed
    around the ring, with their fp32 gradients in the backward (ring)."""
    if degrees["cp"] == 1:
        return 0.0
    forwards = layer_passes(cfg, degrees) - 1
    per_layer = forwards * cp_exchange_bytes(cfg, degrees)
    per_layer += cp_exchange_bytes(cfg, degrees, backward=True)
    size = per_layer * model_facts.stage_blocks(cfg.model, degrees["pp"])
    return size * micro_batches_per_step(cfg, degrees) / cluster.bandwidth(span(degrees, "cp"))


def cp_exposed_seconds(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster) -> float:
    """What of `cp_seconds` the step waits for: all of it, but for the ring's. Of its cp steps
    a pass, the first cp − 1 each send one block (forward: its keys and values; backward: those
    and the fp32 gradient of the block before, 3 blocks' bytes) while attending another, so a
    step's transfer hides behind that block's attention (1/cp of the layer's; in the backward
    its recompute and backward, 3 times the forward) and only what exceeds it adds; the
    backward's last gradient, sent home after the last step, adds in full. Every layer is taken
    to do the average layer's attention (a sliding window's layer does less: it hides less)."""
    if degrees["cp"] == 1:
        return 0.0
    if cfg.distributed.cp_mode != "ring":
        return cp_seconds(cfg, degrees, cluster)
    cp, m = degrees["cp"], cfg.model
    block = own_kv_bytes(cfg, degrees) / cluster.bandwidth(span(degrees, "cp"))
    forward_flops = model_facts.attention_flops(m, cfg.train.seq_len) / model_facts.blocks(m) / 3
    # One block's share of a layer's attention forward for this rank's tokens (heads over tp).
    attend = microbatch_tokens(cfg, degrees) * forward_flops / degrees["tp"] / cp
    attend /= achievable_flops(cluster)
    forward = (cp - 1) * max(0.0, block - attend)
    backward = (cp - 1) * max(0.0, 3 * block - 3 * attend) + 2 * block
    per_layer = forward * (layer_passes(cfg, degrees) - 1) + backward
    layers = model_facts.stage_blocks(m, degrees["pp"])
    return per_layer * layers * micro_batches_per_step(cfg, degrees)


def ep_seconds(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster) -> float:
    """Every MoE layer sends each routed copy of this tp rank's tokens to its expert and back
    (dispatch and combine), each pass; (ep − 1)/ep of them leave the rank."""
    m = cfg.model
    if m.moe.num_experts <= 0 or degrees["ep"] == 1:
        return 0.0
    layers = model_facts.stage_blocks(m, degrees["pp"])
    moe = min(layers, model_facts.moe_layers(m))
    copies = microbatch_tokens(cfg, degrees) / degrees["tp"] * m.moe.top_k
    size = 2 * 2 * copies * m.dim * ring_share(degrees["ep"]) * moe * layer_passes(cfg, degrees)
    return size * micro_batches_per_step(cfg, degrees) / cluster.bandwidth(span(degrees, "ep"))


def pp_seconds(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster) -> float:
    """Each micro-batch's activations go to the next stage and their gradients come back, once
    per virtual stage (bf16, the tp rank's sequence shard)."""
    if degrees["pp"] == 1:
        return 0.0
    size = 2 * microbatch_tokens(cfg, degrees) * cfg.model.dim / degrees["tp"]
    sends = 2 * cfg.distributed.pp_virtual_stages * micro_batches_per_step(cfg, degrees)
    return sends * size / cluster.bandwidth(2 * span(degrees, "dp_replicate"))


def exposed_seconds(compute: float, overlapped: float, serial: float) -> float:
    """The overlap rule: what of the transfers that run beside the compute exceeds it, and the
    serial transfers in full."""
    return max(0.0, overlapped - compute) + serial


def step_time(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster) -> StepTime:
    """Everything above for `cfg` on `degrees` (resolved) on `cluster`."""
    t = cfg.train
    compute = compute_seconds(cfg, degrees, cluster)
    bubble = 0.0
    if degrees["pp"] > 1:
        idle = bubble_fraction(cfg.distributed, pipeline_microbatches(cfg, degrees))
        bubble = compute * idle / (1 - idle)
    comm = fsdp_seconds(cfg, degrees, cluster)
    serial = {
        "tp": tp_seconds(cfg, degrees, cluster),
        "cp": cp_seconds(cfg, degrees, cluster),
        "ep": ep_seconds(cfg, degrees, cluster),
        "pp": pp_seconds(cfg, degrees, cluster),
    }
    # The ring's transfers are serial only where they outlast their block's attention.
    waited = {**serial, "cp": cp_exposed_seconds(cfg, degrees, cluster)}
    exposed = exposed_seconds(compute, sum(comm.values()), sum(waited.values()))
    comm.update({name: s for name, s in serial.items() if s})
    return StepTime(
        compute=compute,
        bubble=bubble,
        comm=comm,
        exposed=exposed,
        tokens=data_ranks(degrees) * t.batch_size * t.grad_accum_steps * t.seq_len,
        flops_per_token=model_facts.flops(cfg.model, t.seq_len),
        gpus=math.prod(degrees.values()),
        peak_flops=cluster.gpu.peak_flops,
    )
