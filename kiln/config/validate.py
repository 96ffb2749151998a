"""Cross-field validation against the world size; every problem is reported at once."""

from __future__ import annotations

import math

from kiln.config.load import choice_problems
from kiln.config.pipeline import (
    MULTI_STAGE_SCHEDULES,
    PP_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    microbatch_problems,
    num_stages,
)
from kiln.config.sections import DistributedConfig, JobConfig, ModelConfig
from kiln.config.validate_attention import attention_problems
from kiln.config.validate_checkpoint import export_hf_problems
from kiln.config.validate_deepseek import deepseek_problems
from kiln.config.validate_eval import eval_task_problems
from kiln.config.validate_fault_tolerance import fault_tolerance_problems
from kiln.config.validate_float8 import float8_problems
from kiln.config.validate_linear_attention import linear_attention_problems
from kiln.config.validate_moe import expert_parallel_problems, moe_problems
from kiln.config.validate_observability import observability_problems
from kiln.config.validate_optimizer import optimizer_problems
from kiln.config.validate_schedules import schedule_problems
from kiln.config.validate_spikes import spike_problems
from kiln.errors import ConfigError

LAYOUT_DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


def validate(cfg: JobConfig, world_size: int = 1) -> None:
    """Raise ConfigError listing every problem with `cfg` for a job of `world_size` processes."""
    problems = collect_problems(cfg, world_size)
    if problems:
        raise ConfigError.listing(problems)


def collect_problems(cfg: JobConfig, world_size: int) -> list[str]:
    # The keys typed by a Literal of words (sections.py) first: built from TOML they were checked
    # already (an invalid word is left at its default), built in Python they were not.
    problems = choice_problems(cfg) + _model_problems(cfg) + deepseek_problems(cfg)
    problems += attention_problems(cfg) + linear_attention_problems(cfg)
    problems += _train_problems(cfg) + export_hf_problems(cfg)
    problems += optimizer_problems(cfg) + float8_problems(cfg)
    problems += _data_problems(cfg) + _eval_problems(cfg) + eval_task_problems(cfg)
    problems += observability_problems(cfg, world_size) + fault_tolerance_problems(cfg)
    problems += spike_problems(cfg)
    layout = _layout_problems(cfg, world_size)
    if not layout and min(cfg.train.batch_size, cfg.train.grad_accum_steps) > 0:
        degrees = resolve_layout(cfg.distributed, world_size)
        data_ranks = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["ep"]
        problems += schedule_problems(cfg, data_ranks=data_ranks)
    return problems + layout + _pipeline_problems(cfg)


def resolve_layout(dist: DistributedConfig, world_size: int) -> dict[str, int]:
    """Degrees of every mesh dim with `dp_shard = -1` filled in (validate first)."""
    degrees = {d: getattr(dist, d) for d in LAYOUT_DIMS}
    if degrees["dp_shard"] == -1:
        others = math.prod(v for k, v in degrees.items() if k != "dp_shard")
        degrees["dp_shard"] = world_size // others
    return degrees


def _model_problems(cfg: JobConfig) -> list[str]:
    m, p = cfg.model, []
    for name in (
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "vocab_size",
        "ffn_hidden_dim",
        "max_seq_len",
    ):
        if getattr(m, name) <= 0:
            p.append(f"model.{name} must be positive, got {getattr(m, name)}")
    if m.n_heads > 0 and m.n_kv_heads > 0 and m.n_heads % m.n_kv_heads:
        p.append(
            f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.n_kv_heads}): pick n_kv_heads among the divisors of n_heads"
        )
    if m.head_dim < 0:
        p.append(f"model.head_dim must be positive (or 0: dim / n_heads), got {m.head_dim}")
    elif m.head_dim == 0 and m.n_heads > 0 and m.dim % m.n_heads:
        p.append(
            f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads}), or set "
            "model.head_dim to the width of one head"
        )
    elif m.n_heads > 0 and m.resolved_head_dim % 2:
        p.append(
            f"model.head_dim ({m.resolved_head_dim}{'' if m.head_dim else ' = dim / n_heads'}) "
            "must be even for rotary embeddings"
        )
    for name in ("norm_eps", "rope_theta", "init_std"):
        if getattr(m, name) <= 0:
            p.append(f"model.{name} must be positive, got {getattr(m, name)}")
    if m.rope_scaling == "llama3":
        p += _llama3_rope_problems(m)
    return p + moe_problems(cfg)


def _llama3_rope_problems(m: ModelConfig) -> list[str]:
    p = []
    if m.rope_scaling_factor < 1:
        p.append(
            f"model.rope_scaling_factor must be >= 1 (how much slow rotations are stretched), got {m.rope_scaling_factor}"
        )
    if not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        p.append(
            f"model.rope_low_freq_factor ({m.rope_low_freq_factor}) and rope_high_freq_factor "
            f"({m.rope_high_freq_factor}) must satisfy 0 < low < high"
        )
    if m.rope_original_max_seq_len <= 0:
        p.append(
            f"model.rope_original_max_seq_len must be positive, got {m.rope_original_max_seq_len}"
        )
    return p


def _train_problems(cfg: JobConfig) -> list[str]:
    t, o, s, p = cfg.train, cfg.optimizer, cfg.scheduler, []
    for name in ("seq_len", "batch_size", "grad_accum_steps", "max_steps"):
        if getattr(t, name) <= 0:
            p.append(f"train.{name} must be positive, got {getattr(t, name)}")
    if t.seq_len > cfg.model.max_seq_len:
        p.append(
            f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({cfg.model.max_seq_len}): lower seq_len or raise max_seq_len"
        )
    if not 0 <= t.stop_at_step <= t.max_steps:
        p.append(
            f"train.stop_at_step ({t.stop_at_step}) must be in [0, train.max_steps = {t.max_steps}]: "
            "it ends this invocation early (0: off); to train longer, raise train.max_steps"
        )
    if t.time_limit_minutes < 0:
        p.append(f"train.time_limit_minutes must be >= 0 (0: no limit), got {t.time_limit_minutes}")
    if t.grad_clip_norm < 0:
        p.append(f"train.grad_clip_norm must be >= 0 (0 disables clipping), got {t.grad_clip_norm}")
    if t.z_loss_weight < 0:
        p.append(f"train.z_loss_weight must be >= 0, got {t.z_loss_weight}")
    if t.loss_chunk_tokens <= 0:
        p.append(
            f"train.loss_chunk_tokens must be positive (the tokens whose logits the chunked loss "
            f"holds at once), got {t.loss_chunk_tokens}"
        )
    if o.lr <= 0:
        p.append(f"optimizer.lr must be positive, got {o.lr}")
    if o.weight_decay < 0:
        p.append(f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        p.append(f"optimizer.betas must be two numbers in [0, 1), got {o.betas}")
    if o.eps <= 0:
        p.append(f"optimizer.eps must be positive, got {o.eps}")
    if s.warmup_steps < 0 or (t.max_steps > 0 and s.warmup_steps >= t.max_steps):
        p.append(
            f"scheduler.warmup_steps ({s.warmup_steps}) must be in [0, train.max_steps = {t.max_steps})"
        )
    if s.name == "none" and s.warmup_steps:
        p.append(
            "scheduler.name = 'none' keeps the learning rate fixed and has no warmup; use 'constant' for warmup then constant"
        )
    if s.name == "wsd" and s.warmup_steps > t.max_steps * (1 - s.decay_ratio):
        p.append(
            f"scheduler.warmup_steps ({s.warmup_steps}) runs into the wsd decay phase (the last "
            f"{s.decay_ratio:g} of {t.max_steps} steps); shorten the warmup or lower decay_ratio"
        )
    if not 0 <= s.min_lr_ratio <= 1:
        p.append(f"scheduler.min_lr_ratio must be in [0, 1], got {s.min_lr_ratio}")
    if not 0 < s.decay_ratio <= 1:
        p.append(f"scheduler.decay_ratio must be in (0, 1], got {s.decay_ratio}")
    c = cfg.checkpoint
    if c.interval < 0 or c.keep_last_n < 0:
        p.append("checkpoint.interval and checkpoint.keep_last_n must be >= 0 (0 disables)")
    if c.owner_wait_s < 0:
        p.append("checkpoint.owner_wait_s must be >= 0 seconds (0: refuse at once)")
    r = cfg.resilience
    if r.nan_max_consecutive < 1:
        p.append(
            f"resilience.nan_max_consecutive must be >= 1 (skipped steps in a row before "
            f"nan_action), got {r.nan_max_consecutive}"
        )
    if r.collective_timeout_s <= 0 or r.step_timeout_s < 0:
        p.append(
            "resilience.collective_timeout_s must be > 0 and resilience.step_timeout_s >= 0 "
            "(0 turns the step watchdog off)"
        )
    if r.preflight_timeout_s <= 0 or r.preflight_slow_s <= 0:
        p.append(
            "resilience.preflight_timeout_s and resilience.preflight_slow_s must be > 0 (seconds), "
            f"got {r.preflight_timeout_s} and {r.preflight_slow_s}"
        )
    if not 0 < r.preflight_slow_matmul <= 1:
        p.append(
            "resilience.preflight_slow_matmul must be in (0, 1] (a fraction of the ranks' median "
            f"matmul rate), got {r.preflight_slow_matmul}"
        )
    if r.nan_action == "rollback" and not c.interval:
        p.append(
            "resilience.nan_action = 'rollback' returns to the last checkpoint: set "
            "checkpoint.interval > 0 so there is one"
        )
    if cfg.metrics.plot and not cfg.metrics.jsonl:
        p.append(
            "metrics.plot = true draws from metrics.jsonl: set metrics.jsonl = true or plot = false"
        )
    if cfg.metrics.log_interval <= 0:
        p.append(f"metrics.log_interval must be positive, got {cfg.metrics.log_interval}")
    if cfg.metrics.idle_expert_warn_steps < 0:
        p.append(
            "metrics.idle_expert_warn_steps must be >= 0 (0 turns the warning off), got "
            f"{cfg.metrics.idle_expert_warn_steps}"
        )
    return p


def _layout_problems(cfg: JobConfig, world_size: int) -> list[str]:
    d, m, p = cfg.distributed, cfg.model, []
    if world_size <= 0:
        return [f"world size must be positive, got {world_size}"]
    for name in LAYOUT_DIMS:
        value = getattr(d, name)
        if value < 1 and not (name == "dp_shard" and value == -1):
            p.append(
                f"distributed.{name} must be >= 1{' or -1 (fill the rest)' if name == 'dp_shard' else ''}, got {value}"
            )
    if p:
        return p
    fixed = math.prod(getattr(d, n) for n in LAYOUT_DIMS if n != "dp_shard")
    product = " × ".join(f"{n}={getattr(d, n)}" for n in LAYOUT_DIMS if n != "dp_shard")
    if d.dp_shard == -1 and world_size % fixed:
        p.append(
            f"world size {world_size} is not divisible by {product} = {fixed}, so dp_shard = -1 cannot fill the rest; "
            f"use a multiple of {fixed} processes ({_nearest_multiples(world_size, fixed)}) or change the degrees"
        )
    elif d.dp_shard != -1 and fixed * d.dp_shard != world_size:
        fits = (
            f"dp_shard = {world_size // fixed}"
            if world_size % fixed == 0
            else f"a multiple of {fixed} processes: {_nearest_multiples(world_size, fixed)}"
        )
        p.append(
            f"layout {product} × dp_shard={d.dp_shard} = {fixed * d.dp_shard} processes, but the world size is {world_size}; "
            f"make the product equal the world size ({fits})"
        )
    heads = math.gcd(m.n_heads, m.n_kv_heads) if m.n_heads > 0 and m.n_kv_heads > 0 else 0
    if heads and heads % d.tp:
        valid = [t for t in range(1, heads + 1) if heads % t == 0]
        p.append(
            f"distributed.tp ({d.tp}) must divide model.n_heads ({m.n_heads}) and model.n_kv_heads ({m.n_kv_heads}): "
            f"each tp rank computes whole heads of {m.resolved_head_dim}; "
            f"valid tp: {', '.join(map(str, valid))}"
        )
    if d.tp > 1:
        # Sequence parallel splits the sequence, the head splits the vocabulary, the MLP its hidden units.
        for key, value in (
            ("train.seq_len", cfg.train.seq_len),
            ("model.vocab_size", m.vocab_size),
            ("model.ffn_hidden_dim", m.ffn_hidden_dim),
        ):
            if value > 0 and value % d.tp:
                p.append(
                    f"{key} ({value}) must be divisible by distributed.tp ({d.tp}) under tensor parallel; nearest: {_nearest_multiples(value, d.tp)}"
                )
    return p + _context_parallel_problems(cfg) + expert_parallel_problems(cfg)


def _context_parallel_problems(cfg: JobConfig) -> list[str]:
    """Each cp rank keeps 2 of 2·cp chunks of every sequence; under tp its part is split again."""
    cp, tp, seq_len, p = cfg.distributed.cp, cfg.distributed.tp, cfg.train.seq_len, []
    if cp <= 1 or seq_len <= 0:
        return p
    if seq_len % (2 * cp):
        p.append(
            f"train.seq_len ({seq_len}) must be divisible by 2 × distributed.cp = {2 * cp}: context "
            f"parallel cuts each sequence into 2·cp chunks (head-tail balancing); nearest: "
            f"{_nearest_multiples(seq_len, 2 * cp)}"
        )
    elif tp > 1 and (seq_len // cp) % tp:
        p.append(
            f"each cp rank's {seq_len // cp} tokens (train.seq_len / distributed.cp) must be divisible "
            f"by distributed.tp ({tp}) for sequence parallel; use a train.seq_len divisible by "
            f"{math.lcm(2 * cp, cp * tp)}"
        )
    m = cfg.model
    heads = {"model.n_heads": m.n_heads, "model.n_kv_heads": m.n_kv_heads}
    split = [f"{k} / tp = {v // tp}" for k, v in heads.items() if v % tp == 0 and (v // tp) % cp]
    if cfg.distributed.cp_mode == "all_to_all" and split:
        p.append(
            f"distributed.cp_mode = 'all_to_all' gives each of the {cp} cp ranks 1/cp of every "
            f"tp rank's heads, but {' and '.join(split)} do not divide by distributed.cp = {cp}; "
            f"use cp_mode = 'all_gather', or a cp that divides them"
        )
    return p


def _pipeline_problems(cfg: JobConfig) -> list[str]:
    """The pp_* keys apply only with distributed.pp > 1."""
    d, t, p = cfg.distributed, cfg.train, []
    for name in ("pp_virtual_stages", "pp_microbatches", "pp_embedding_layers", "pp_output_layers"):
        low = 1 if name == "pp_virtual_stages" else 0
        if getattr(d, name) < low:
            p.append(f"distributed.{name} must be >= {low}, got {getattr(d, name)}")
    if p or d.pp <= 1 or d.pp_schedule not in PP_SCHEDULES:
        return p
    schedule, v = d.pp_schedule, d.pp_virtual_stages
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        p.append(
            f"distributed.pp_schedule = '{schedule}' runs one stage per rank but pp_virtual_stages = {v}; "
            f"set pp_virtual_stages = 1, or pick one of {', '.join(MULTI_STAGE_SCHEDULES)} for virtual stages"
        )
    elif schedule == "zbv" and v != 2:
        p.append(
            f"distributed.pp_schedule = 'zbv' runs exactly two stages per rank (a V); set pp_virtual_stages = 2 (got {v})"
        )
    elif schedule in MULTI_STAGE_SCHEDULES and v < 2:
        p.append(
            f"distributed.pp_schedule = '{schedule}' interleaves several stages per rank; set "
            "distributed.pp_virtual_stages >= 2 (or use '1f1b' for one stage per rank)"
        )
    p += _stage_split_problems(cfg)
    p += microbatch_problems(d, t.batch_size) if t.batch_size > 0 else []
    if d.grad_reduce == "per_step" and t.grad_accum_steps > 1:
        p.append(
            "distributed.grad_reduce = 'per_step' with pp > 1 and grad_accum_steps > 1: a pipeline pass "
            "reduces gradients once per pass; grow train.batch_size (more micro-batches per pass) "
            "instead of grad_accum_steps, or use grad_reduce = 'per_micro_batch'"
        )
    if t.compile and schedule in ("interleaved_zero_bubble", "zbv"):
        p.append(
            f"train.compile = true with pp_schedule = '{schedule}': zero-bubble schedules split each "
            "backward into an input pass and a later weight pass over the same graph, while a compiled "
            "block's backward is one node that computes both; torch refuses to run it twice (donated "
            "buffers), and with those off the weight pass gives wrong gradients "
            "(https://github.com/pytorch/pytorch/issues/161904); use interleaved_1f1b, or compile = false"
        )
    return p


def _data_problems(cfg: JobConfig) -> list[str]:
    d, p = cfg.data, []
    if not d.datasets and not d.path:
        p.append("data.path is empty: point it at a prepared dataset directory")
    if d.streaming and d.source != "hf":
        p.append("data.streaming = true reads a Hugging Face dataset: set data.source = 'hf'")
    reads_hf = (d.source == "hf" and not d.datasets) or any(e.source == "hf" for e in d.datasets)
    if reads_hf and not d.tokenizer:
        p.append(
            "a Hugging Face dataset (source = 'hf') is tokenized at start-up: set data.tokenizer "
            "to a tokenizer.json"
        )
    names = [entry.name for entry in d.datasets]
    for i, entry in enumerate(d.datasets):
        where = f"data.datasets[{i}]"
        if not entry.name:
            p.append(f"{where} needs a name (it labels the per-dataset loss and phase weights)")
        if not entry.path:
            p.append(f"{where} ({entry.name}) needs a path")
        if entry.streaming and entry.source != "hf":
            p.append(f"{where}.streaming = true reads a Hugging Face dataset: set source = 'hf'")
        if entry.weight < 0:
            p.append(f"{where}.weight must be >= 0, got {entry.weight}")
    duplicates = sorted({name for name in names if name and names.count(name) > 1})
    if duplicates:
        p.append(f"data.datasets: names must be unique, {', '.join(duplicates)} repeat")
    if d.datasets and sum(entry.weight for entry in d.datasets) <= 0:
        p.append("data.datasets: at least one weight must be positive")
    if d.temperature <= 0:
        p.append(f"data.temperature must be positive, got {d.temperature}")
    p += _phase_problems(cfg, set(names))
    if d.num_workers < 0 or d.prefetch_steps < 1:
        p.append(
            f"data.num_workers must be >= 0 and data.prefetch_steps >= 1, got "
            f"{d.num_workers} and {d.prefetch_steps}"
        )
    return p


def _phase_problems(cfg: JobConfig, names: set[str]) -> list[str]:
    p, starts = [], [phase.start_step for phase in cfg.data.phases]
    if starts != sorted(set(starts)) or any(start < 0 for start in starts):
        p.append(f"data.phases: start_step values must be >= 0 and increasing, got {starts}")
    for i, phase in enumerate(cfg.data.phases):
        where = f"data.phases[{i}]"
        unknown = sorted(set(phase.weights) - names)
        if unknown:
            known = ", ".join(sorted(names)) or "none: [[data.datasets]] is empty"
            p.append(f"{where}.weights names unknown datasets {unknown} (datasets: {known})")
        if any(weight < 0 for weight in phase.weights.values()):
            p.append(f"{where}.weights must be >= 0")
        elif phase.weights and sum(phase.weights.values()) <= 0:
            p.append(f"{where}.weights: at least one weight must be positive")
        if phase.lr_scale <= 0:
            p.append(f"{where}.lr_scale must be positive, got {phase.lr_scale}")
    return p


def _eval_problems(cfg: JobConfig) -> list[str]:
    e = cfg.eval
    if e.interval < 0 or e.steps <= 0:
        return [
            f"eval.interval must be >= 0 (0: no eval) and eval.steps > 0, got {e.interval} and "
            f"{e.steps}"
        ]
    return []


def _stage_split_problems(cfg: JobConfig) -> list[str]:
    d, layers = cfg.distributed, cfg.model.n_layers
    stages = num_stages(d)
    what = f"pp × pp_virtual_stages = {d.pp} × {d.pp_virtual_stages} = {stages} stages"
    if d.pp_layers_per_stage:
        given = d.pp_layers_per_stage
        if len(given) != stages or sum(given) != layers or min(given) < 1:
            return [
                f"distributed.pp_layers_per_stage = {given} must list {stages} positive layer counts "
                f"({what}) that add up to model.n_layers = {layers}"
            ]
        return []
    if stages > layers:
        return [
            f"{what} but model.n_layers is {layers}: every stage needs at least one layer; "
            "lower pp or pp_virtual_stages"
        ]
    if d.pp_virtual_stages > 1 and layers % stages:
        return [
            f"model.n_layers = {layers} does not divide into {what}: interleaved stages run in "
            "lockstep, so they should be equal; change pp_virtual_stages or the layer count, or "
            "list the split in distributed.pp_layers_per_stage"
        ]
    return []


def _nearest_multiples(value: int, factor: int) -> str:
    below, above = value // factor * factor, (value // factor + 1) * factor
    return f"{below} or {above}" if below > 0 else str(above)
