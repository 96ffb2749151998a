"""What `kiln check` says about a recipe on a world size, and `kiln train` prints as it starts:
the layout, the parameters, FLOPs per token, the global batch, the memory estimate and the
pipeline, context-parallel and FP8 specifics. From the config alone: nothing is allocated."""

from __future__ import annotations

from pathlib import Path

from kiln.config import JobConfig, resolve_layout
from kiln.config.training_schedule import TrainingSchedule
from kiln.metrics.layout_summary import context_parallel_summary, float8_summary
from kiln.model import count_params, flops_per_token
from kiln.model.registry import family_of
from kiln.parallel.pipeline_split import pipeline_summary
from kiln.plan.memory import estimate_memory
from kiln.plan.model_state import expert_shards


def startup_summary(
    cfg: JobConfig,
    world_size: int,
    start_path: Path | None,
    start_step: int,
    *,
    peer_start: str | None = None,
    device: object = "cpu",
) -> str:
    """What `kiln train` prints on rank 0 before the first step: the model, `layout_report`,
    where the run writes and where it starts from (`peer_start`: the state a live replica group
    sent this one under fault tolerance, in place of a checkpoint or scratch); `device`: the
    one the run trains on, which picks a family's own kernels."""
    m = cfg.model
    model = f"model {m.preset or 'custom'}: {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads"
    if m.family == "deepseek_v3":  # MLA: queries and keys are wider than values, head_dim unused
        a = m.mla
        model += (
            f" (queries/keys {a.qk_nope_head_dim} + {a.qk_rope_head_dim}, values {a.v_head_dim})"
        )
    else:
        model += f" of {m.resolved_head_dim}"
    if m.moe.num_experts > 0:
        model += f", {m.moe.num_experts} experts top-{m.moe.top_k}"
    kernels = family_of(m).kernels
    if kernels is not None:
        model += f"; {kernels(m, device)}"
    start = peer_start or (
        f"{start_path} (step {start_step})" if start_path is not None else "scratch"
    )
    lines = [
        model,
        *layout_report(cfg, world_size),
        f"run dir {cfg.metrics.run_dir}; starts from {start}; {cfg.train.max_steps} steps",
    ]
    return "\n".join(f"kiln: {line}" for line in lines)


def layout_report(cfg: JobConfig, world_size: int) -> list[str]:
    """One line per fact, without a prefix."""
    layout = resolve_layout(cfg.distributed, world_size)
    params = count_params(cfg.model)
    data_ranks = layout["dp_replicate"] * layout["dp_shard"] * layout["ep"]
    global_batch = cfg.train.batch_size * cfg.train.grad_accum_steps * data_ranks
    memory = estimate_memory(cfg, layout)
    seq_len = cfg.train.seq_len
    lines = [
        f"world size {world_size}: " + " × ".join(f"{k}={v}" for k, v in layout.items()),
        f"data-parallel ranks: {data_ranks}",
        f"parameters: {params.total:,} ({params.non_embedding:,} non-embedding)",
    ]
    if cfg.model.moe.num_experts > 0:
        lines.append(
            f"active parameters per token: {params.active:,} (top-{cfg.model.moe.top_k} experts)"
        )
    lines += [
        f"FLOPs per token (fwd+bwd, seq_len {seq_len}): {flops_per_token(cfg.model, seq_len):.4g}",
        f"global batch: {global_batch} sequences = {global_batch * seq_len:,} tokens per step",
    ]
    schedule = TrainingSchedule(cfg.train, data_ranks=data_ranks).describe(cfg.train.max_steps)
    if schedule:  # the batch ramp or the sequence-length phases: each phase of the run
        lines += ["batch and sequence-length schedule (memory below: the last, longest phase):"]
        lines += [f"  {line}" for line in schedule]
    # MoE: every expert has weights, gradients and moments; a token's activations are its top k's.
    experts = (
        (_expert_state_label(cfg.model, layout), f"top-{cfg.model.moe.top_k} experts, ")
        if cfg.model.moe.num_experts > 0
        else ("", "")
    )
    lines.append(
        f"memory per GPU (estimate): {_size(memory.total)} at the peak, of model state "
        f"{_size(memory.model_state)} (fp32 weights, grads, "
        f"{OPTIMIZER_STATE[cfg.optimizer.name]}{experts[0]}), activations "
        f"{_size(memory.activations + memory.recompute)} ({experts[1]}activation_checkpointing = "
        f"{cfg.train.activation_checkpointing!r}), logits {_size(memory.logits)}, gathered "
        f"weights {_size(memory.gathered)}"
        + (f", all-to-all buffers {_size(memory.dispatch)}" if memory.dispatch else "")
        + " (the gradients build up after the logits are freed)"
    )
    note = _expert_padding_note(cfg.model, layout) if cfg.model.moe.num_experts > 0 else None
    if note:
        lines.append(note)
    if layout["pp"] > 1:
        lines.append(f"pipeline: {pipeline_summary(cfg)}")
    if layout["cp"] > 1:
        lines.append(f"context parallel: {context_parallel_summary(cfg, layout)}")
    if cfg.train.mixed_precision == "fp8":
        lines.append(f"fp8: {float8_summary(cfg, layout)}")
    return lines


def _size(num_bytes: float) -> str:
    # GiB as the recipes' budgets are stated; MiB for the debug models, which would read 0.0 GiB.
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


# What the memory estimate's model state holds besides weights and gradients, per optimizer
# (kiln/plan/model_state.py): 8 bytes per parameter of AdamW moments or Schedule-Free z and v, 4 of
# Lion's momentum, Muon's momentum (4) for its matrices and AdamW's moments for the rest.
OPTIMIZER_STATE = {
    "adamw": "AdamW",
    "muon": "Muon/AdamW state",
    "lion": "Lion state",
    "schedule_free_adamw": "Schedule-Free AdamW state",
}


def _expert_state_label(model, layout: dict[str, int]) -> str:
    """What the model state counts of the routed experts: all of them, or an ep rank's share."""
    if layout["ep"] == 1:
        return f" of all {model.moe.num_experts} experts"
    local = model.moe.num_experts // layout["ep"]
    return f" of this ep rank's {local} of {model.moe.num_experts} experts"


def _expert_padding_note(model, layout: dict[str, int]) -> str | None:
    """FSDP splits each expert's rows (or columns) over its ranks where they divide; where
    neither does, the experts are cut into whole-expert chunks, padded where the ranks do not
    divide the experts: say so, it is where the estimate rounds up."""
    shards = expert_shards(model, layout)
    if not shards.padded:
        return None
    holding = -(-shards.local // shards.chunk)
    owner = f"each ep rank's {shards.local}" if layout["ep"] > 1 else f"the {shards.local}"
    plural = "s" if shards.chunk > 1 else ""
    return (
        f"experts: neither the expert hidden size ({model.expert_hidden_dim}) nor dim "
        f"({model.dim}) divides over the {shards.ranks} ranks (dp_shard × tp) that shard {owner} "
        f"experts of an MoE layer, so FSDP splits them in chunks of {shards.chunk} whole "
        f"expert{plural}: {holding} of those ranks hold experts, and every rank stores a whole "
        f"chunk of weights and gradients, padding where it holds fewer; the estimate counts the "
        f"busiest rank"
    )
