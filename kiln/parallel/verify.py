"""`kiln verify`: prove a layout computes what one process computes, on a small proxy of the model.

The proxy keeps everything a layout's rules depend on (head and KV-head counts, expert count and
top-k, the layout, the pipeline schedule, activation checkpointing, compile, gradient
accumulation) and shrinks the rest (two layers per pipeline stage, head dim 16, 32 hidden units
per expert, sequence 64, one sequence per data rank or per pipeline micro-batch), trains it in
fp32 on the CPU on the built-in corpus in the configured layout and in one process on the same
global batch, and compares loss and gradient norm step by step.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kiln.config import JobConfig, resolve_layout, to_toml, validate
from kiln.config.pipeline import num_stages
from kiln.config.sections import (
    BatchScheduleConfig,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    MLAConfig,
    ModelConfig,
)
from kiln.config.validate import LAYOUT_DIMS
from kiln.errors import KilnError

TOLERANCE = 1e-5


def default_world_size(dist: DistributedConfig) -> int:
    """The layout's product of degrees; `dp_shard = -1` (fill the rest) counts as 2, the smallest
    degree that still shards."""
    degrees = {d: getattr(dist, d) for d in LAYOUT_DIMS}
    if degrees["dp_shard"] == -1:
        degrees["dp_shard"] = 2
    return math.prod(degrees.values())


def proxy_config(
    cfg: JobConfig, world_size: int, *, steps: int, run_dir: Path, data_path: str
) -> JobConfig:
    proxy = copy.deepcopy(cfg)
    m = proxy.model
    m.preset = ""
    m.n_layers = 2 * num_stages(cfg.distributed)
    proxy.distributed.pp_layers_per_stage = []
    # A head width of its own (Qwen3) stays its own: the same ratio to dim / n_heads.
    ratio = m.resolved_head_dim * m.n_heads / m.dim
    m.dim, m.head_dim = 16 * m.n_heads, 0 if ratio == 1 else round(16 * ratio / 2) * 2
    m.ffn_hidden_dim = 4 * m.dim
    # 64 tokens, or as few as context parallel can split into 2·cp chunks and those over tp.
    d = cfg.distributed
    seq_len = max(64, math.lcm(2 * d.cp, d.cp * d.tp))
    m.vocab_size, m.max_seq_len = 4096, seq_len
    if m.sliding_window:
        # The window's pattern over the proxy's layers, a window that still cuts its sequences.
        types = m.layer_types
        m.layer_types = [types[i % len(types)] for i in range(m.n_layers)] if types else []
        m.sliding_window = min(m.sliding_window, seq_len // 4)
    if m.moe.num_experts > 0:
        _shrink_experts(m, pipelined=cfg.distributed.pp > 1)
    if m.family == "deepseek_v3":
        # Latent attention's widths with the model's: a query latent or none, as it had.
        m.mla = MLAConfig(
            q_lora_rank=8 if m.mla.q_lora_rank else 0,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
        )
    if m.family == "qwen3_next":
        # Each stage's two blocks one of each kind: a Gated DeltaNet and a full attention layer;
        # the heads (what tp splits) as the model's, narrower.
        m.layer_types = ["linear_attention", "full_attention"] * (m.n_layers // 2)
        a = m.linear_attention
        a.key_head_dim, a.value_head_dim, a.chunk_size = 8, 8, 16
    t = proxy.train
    # One sequence per data rank, or per pipeline micro-batch.
    pipelined = cfg.distributed.pp > 1
    t.seq_len, t.max_steps = seq_len, steps
    t.batch_size = (cfg.distributed.pp_microbatches or cfg.distributed.pp) if pipelined else 1
    t.grad_accum_steps = min(t.grad_accum_steps, 4)
    # Parity is proven in fp32 on the CPU (gloo), whatever device the recipe trains on.
    t.mixed_precision, t.device = "fp32", "cpu"
    proxy.scheduler.warmup_steps = 0
    # The built-in corpus as one dataset; document masking stays, as it changes the computation.
    proxy.data = DataConfig(
        source="demo", path=data_path, document_mask=cfg.data.document_mask, num_workers=0
    )
    set_aside(proxy)
    proxy.checkpoint.dir, proxy.checkpoint.interval, proxy.checkpoint.save_final = "", 0, False
    proxy.checkpoint.resume, proxy.checkpoint.load_path = "never", ""
    proxy.metrics.run_dir, proxy.metrics.log_interval, proxy.metrics.plot = str(run_dir), 1, False
    validate(proxy, world_size)
    return proxy


def set_aside(cfg: JobConfig) -> list[str]:
    """Turn off what does not apply to a short proxy run on the CPU and name each thing turned
    off. None of it changes what the layout computes, and a shipped recipe's settings for the
    real run (profiling at step 20, W&B online, held-out data) would otherwise refuse or stall
    a five-step run on the built-in corpus."""
    notes = []
    if cfg.profiling.enabled:
        p = cfg.profiling
        notes.append(f"profiling (steps {p.start_step}..{p.end_step})")
        p.enabled = False
    for flag, name in (("wandb", "W&B logging"), ("tensorboard", "TensorBoard logging")):
        if getattr(cfg.metrics, flag):
            notes.append(name)
            setattr(cfg.metrics, flag, False)
    if cfg.eval.interval > 0 or cfg.eval.tasks:
        notes.append("evaluation (held-out loss, tasks)")
        cfg.eval = EvalConfig()
    if cfg.train.stop_at_step or cfg.train.time_limit_minutes:
        notes.append("train.stop_at_step / train.time_limit_minutes")
        cfg.train.stop_at_step, cfg.train.time_limit_minutes = 0, 0.0
    if cfg.resilience.debug_nan_steps:
        notes.append(f"NaN injection at steps {cfg.resilience.debug_nan_steps}")
        cfg.resilience.debug_nan_steps = []
    if cfg.train.batch_schedule.tokens or cfg.train.seq_len_schedule:
        # Their batches and lengths are the recipe's, not the proxy's: the layout is proven on
        # the proxy's own steps (the schedules' parity is the test suite's).
        notes.append("train.batch_schedule / train.seq_len_schedule (the proxy's own shape)")
        cfg.train.batch_schedule = BatchScheduleConfig()
        cfg.train.seq_len_schedule = []
    if cfg.resilience.nan_action == "rollback":
        # Rollback needs a checkpoint to return to, and the proxy run writes none.
        notes.append("resilience.nan_action = 'rollback' (runs as 'stop')")
        cfg.resilience.nan_action = "stop"
    return notes


def _shrink_experts(m: ModelConfig, *, pipelined: bool) -> None:
    """Keep what routing and expert parallel depend on (expert count, top-k, groups, router,
    capacity factor, shared experts, balancing) and shrink the experts: 32 hidden units each, and
    an MoE layer in every proxy block but the first when the model has dense blocks."""
    m.moe.ffn_hidden_dim = 32
    m.moe.first_dense_layers = min(m.moe.first_dense_layers, 1)
    m.moe.frequency = 1
    if pipelined:
        # The Switch loss takes its expert fractions over one micro-batch on all data ranks; a
        # pipeline's micro-batches are no micro-batch of one process, which could not match.
        m.moe.aux_loss_weight = 0.0


def single_process_twin(proxy: JobConfig, world_size: int) -> JobConfig:
    """Same global batch in one process: every data rank's sequences in one micro-batch."""
    twin = copy.deepcopy(proxy)
    degrees = resolve_layout(proxy.distributed, world_size)
    twin.train.batch_size = (
        proxy.train.batch_size * degrees["dp_replicate"] * degrees["dp_shard"] * degrees["ep"]
    )
    twin.distributed.dp_replicate = twin.distributed.dp_shard = 1
    twin.distributed.tp = twin.distributed.pp = twin.distributed.cp = twin.distributed.ep = 1
    twin.metrics.run_dir = str(Path(proxy.metrics.run_dir).with_name("one_process"))
    return twin


# Trains each (config, number of processes) and returns each run's metrics records by step.
RunJobs = Callable[[list[tuple[JobConfig, int]], Path], list[dict[int, dict]]]


def verify(
    cfg: JobConfig,
    world_size: int,
    *,
    steps: int,
    data_path: str,
    run_jobs: RunJobs | None = None,
) -> bool:
    """Run both, print a per-step table, return whether every step agrees within tolerance.
    `run_jobs` trains the layout and its one-process twin; by default each is its own command
    (torchrun for the layout), both at once."""
    notes = set_aside(copy.deepcopy(cfg))
    if notes:
        print("not part of the proxy run: " + "; ".join(notes))
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        proxy = proxy_config(
            cfg, world_size, steps=steps, run_dir=Path(tmp) / "layout", data_path=data_path
        )
        twin = single_process_twin(proxy, world_size)
        layout, reference = (run_jobs or launch_jobs)([(proxy, world_size), (twin, 1)], Path(tmp))
    return _report(layout, reference, proxy, world_size)


def launch_jobs(jobs: list[tuple[JobConfig, int]], tmp: Path) -> list[dict[int, dict]]:
    """Each job as `kiln train` (under torchrun with more than one process), all at once: the
    one-process run needs no GPU and no peer, and its start-up (importing torch) overlaps the
    layout's."""
    started = [_start(cfg, nproc, tmp) for cfg, nproc in jobs]
    finished = [(*run, *run[2].communicate()) for run in started]
    return [_records(*run) for run in finished]


def write_recipe(cfg: JobConfig, tmp: Path) -> Path:
    recipe = tmp / f"{Path(cfg.metrics.run_dir).name}.toml"
    recipe.write_text(to_toml(cfg))
    return recipe


def read_records(cfg: JobConfig) -> dict[int, dict]:
    lines = (Path(cfg.metrics.run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _start(cfg: JobConfig, nproc: int, tmp: Path) -> tuple[str, JobConfig, subprocess.Popen]:
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else []
    )
    command = [sys.executable, *launcher, "-m", "kiln", "train", str(write_recipe(cfg, tmp))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return ("layout" if nproc > 1 else "one-process"), cfg, process


def _records(
    which: str, cfg: JobConfig, process: subprocess.Popen, stdout: str, stderr: str
) -> dict[int, dict]:
    if process.returncode != 0:
        raise KilnError(f"the {which} run failed:\n{_tail(stdout, stderr)}")
    return read_records(cfg)


def _report(
    layout: dict[int, dict], reference: dict[int, dict], proxy: JobConfig, world_size: int
) -> bool:
    degrees = resolve_layout(proxy.distributed, world_size)
    m = proxy.model
    experts = f", {m.moe.num_experts} experts top-{m.moe.top_k}" if m.moe.num_experts > 0 else ""
    print(
        f"proxy: {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads / {m.n_kv_heads} KV heads{experts}, seq {proxy.train.seq_len}"
    )
    print(
        "layout: "
        + " × ".join(f"{k}={v}" for k, v in degrees.items())
        + f" on {world_size} processes vs one process"
    )
    print(
        f"{'step':>4} | {'loss (layout)':>14} | {'loss (one)':>14} | {'rel diff':>9} | {'grad norm rel diff':>18}"
    )
    ok = True
    for step in sorted(reference):
        a, b = layout[step], reference[step]
        loss_diff = abs(a["loss"] - b["loss"]) / abs(b["loss"])
        norm_diff = abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"])
        good = loss_diff <= TOLERANCE and norm_diff <= TOLERANCE
        ok &= good
        mark = "" if good else "  <- differs"
        print(
            f"{step:>4} | {a['loss']:>14.8f} | {b['loss']:>14.8f} | {loss_diff:>9.2e} | {norm_diff:>18.2e}{mark}"
        )
    print(f"{'PASS' if ok else 'FAIL'}: relative tolerance {TOLERANCE:g}")
    return ok


def _tail(stdout: str, stderr: str) -> str:
    """The lines that say what went wrong: kiln's own error with its indented lines (the bullets
    that name each problem), else the exception, else the end. Every rank may print the same
    error, so repeated lines are kept once."""
    lines = (stdout + stderr).strip().splitlines()
    for marker in ("error:", "Error:"):
        found = [i for i, line in enumerate(lines) if marker in line and "elastic" not in line]
        if found:
            kept = [line for i in found[:3] for line in [lines[i], *_indented_after(lines, i)]]
            return "\n".join(dict.fromkeys(kept))
    return "\n".join(lines[-5:])


def _indented_after(lines: list[str], i: int) -> list[str]:
    """The indented lines that follow line i: the rest of a multi-line error message."""
    block = []
    for line in lines[i + 1 :]:
        if not line.startswith((" ", "\t")):
            break
        block.append(line)
    return block
