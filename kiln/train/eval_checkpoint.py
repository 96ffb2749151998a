"""`kiln eval CKPT`: a checkpoint's loss and perplexity on held-out data, and its
lm-evaluation-harness scores, on any number of processes.

The model is built as the trainer builds it, in the layout [distributed] overrides give
(default: FSDP over every process), and DCP loads the checkpoint into that layout whatever layout
wrote it. The loss goes through the trainer's own evaluation (`TrainStep.evaluate`: batches
shaped like a training step, all-reduced over the data and pipeline ranks), so it is the
eval/loss a training run logs on the same data."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.checkpoint import find_tokenizer, load_checkpoint, read_train_state, resolve_checkpoint
from kiln.checkpoint.checkpointer import read_config
from kiln.checkpoint.store import Location, store_for
from kiln.config import JobConfig, ModelConfig, TrainConfig, config_from_dict
from kiln.data.dataset import TokenDataset
from kiln.data.loader import ShuffledSamples, Source
from kiln.data.sources import validation_split
from kiln.errors import ConfigError, KilnError
from kiln.model import build_model, materialize
from kiln.parallel.agree import decide_on_main
from kiln.parallel.apply import apply_parallelism
from kiln.parallel.device import pick_device
from kiln.parallel.mesh import ParallelContext, init_parallel
from kiln.remote import is_url
from kiln.train.step import TrainStep

# What the evaluation keeps of the checkpoint's config: how the model computes. The layout, the
# data and the rest start from the defaults, and the command line's overrides apply to them.
KEPT_SECTIONS = ("model", "train", "fp8")
HARNESS_REPORT = ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better")


@dataclass
class EvalRequest:
    checkpoint: str
    data: list[str] = field(default_factory=list)  # empty: the checkpoint's own held-out data
    steps: int = 0  # 0: every full batch the data holds
    batch_size: int = 0  # 0: the checkpoint's train.batch_size
    seq_len: int = 0  # 0: the checkpoint's train.seq_len
    tasks: list[str] = field(default_factory=list)
    limit: int = 0  # examples per task, 0: all
    num_fewshot: int | None = None  # None: each task's own
    include_path: str = ""
    bootstrap_iters: int = 0
    overrides: list[str] = field(default_factory=list)


def evaluate_checkpoint(request: EvalRequest) -> dict[str, Any]:
    """Every rank returns the same results: `eval/loss` and `eval/perplexity` (with data), the
    tasks' `scores` and the `harness`'s report (with tasks), and what was evaluated."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Where and in which layout comes from the command line alone; which checkpoint is rank 0's
    # choice: a run still training writes newer steps and its retention deletes older ones, and
    # ranks choosing on their own could load different steps into one sharded model.
    command_line = config_from_dict({}, request.overrides)
    parallel = init_parallel(
        command_line.distributed,
        pick_device(command_line.train.device),
        timeout_s=command_line.resilience.collective_timeout_s,
    )
    step_dir, step = decide_on_main(
        lambda: _choose_checkpoint(request.checkpoint), what="choose the checkpoint to evaluate"
    )
    cfg, raw = eval_config(step_dir, request, world_size=world_size)
    tokenizer = find_tokenizer(step_dir)
    manager = _task_manager(request, cfg, tokenizer) if request.tasks else None
    with tempfile.TemporaryDirectory(prefix="kiln-eval-") as scratch:
        dataset = None
        if request.data or not request.tasks:
            dataset = _open_data(request, cfg, raw, tokenizer=tokenizer, scratch=Path(scratch))
        model_parts = apply_parallelism(build_model(cfg.model), cfg, parallel)
        for part in model_parts:
            materialize(part, device=parallel.device, seed=None)
        _load(step_dir, model_parts)
        results: dict[str, Any] = {
            "checkpoint": str(step_dir),
            "step": step,
            "processes": parallel.world_size,
            "layout": {dim: n for dim, n in parallel.degrees.items() if n > 1},
        }
        if dataset is not None:
            results |= _held_out(cfg, parallel, model_parts, dataset, steps=request.steps)
            results["data"] = request.data or [str(dataset.path)]
        if manager is not None:
            results |= _harness(request, cfg, parallel, model_parts, manager, tokenizer)
    return results


def _choose_checkpoint(path: str) -> tuple[Location, int]:
    """The step folder `path` names (a run's newest intact one) and its step, said on stderr."""
    step_dir = resolve_checkpoint(path)
    step = read_train_state(step_dir).get("step", 0)
    print(f"kiln eval: evaluating {step_dir} (step {step})", file=sys.stderr, flush=True)
    return step_dir, step


def _load(step_dir: Location, model_parts: list) -> None:
    """Load the weights; a folder deleted while loading (the writing run's retention) is named
    as such, decided on rank 0."""
    try:
        load_checkpoint(step_dir, model=model_parts)
    except KilnError:
        exists = store_for(step_dir).exists
        if decide_on_main(lambda: exists(step_dir), what="look for the checkpoint"):
            raise
        raise KilnError(
            f"{step_dir} was deleted while it was being loaded: the run writing it keeps only "
            "its newest checkpoint.keep_last_n steps. Evaluate again (the newest step is chosen "
            "anew), or copy the step folder elsewhere first and evaluate the copy"
        ) from None


def eval_config(
    step_dir: Location, request: EvalRequest, *, world_size: int
) -> tuple[JobConfig, dict[str, Any]]:
    """The config the evaluation runs: the checkpoint's model and how it computes, forward
    only (no compile, no activation checkpointing), the request's batch and sequence length,
    then the command line's overrides; validated for `world_size`. Also the checkpoint's raw
    config, which names its held-out data."""
    raw = read_config(step_dir)  # from the filesystem or the object store holding it
    kept = {name: dict(raw[name]) for name in KEPT_SECTIONS if name in raw}
    kept.setdefault("model", {}).pop("preset", None)  # resolved into explicit keys on save
    train = kept.setdefault("train", {})
    train.update(grad_accum_steps=1, compile=False, activation_checkpointing="none")
    train.pop("device", None)  # where to evaluate is the command line's (init_parallel used it)
    if request.batch_size:
        train["batch_size"] = request.batch_size
    # A converted checkpoint carries the default seq_len, which may exceed its context.
    context = kept["model"].get("max_seq_len", ModelConfig.max_seq_len)
    train["seq_len"] = request.seq_len or min(train.get("seq_len", TrainConfig.seq_len), context)
    kept["data"] = {"document_mask": raw.get("data", {}).get("document_mask", False)}
    source = str(step_dir / "config.toml")
    cfg = config_from_dict(kept, request.overrides, source=source, world_size=world_size)
    return cfg, raw


def _task_manager(request: EvalRequest, cfg: JobConfig, tokenizer: Path | None) -> Any:
    """Checked before any model is built: the harness is there, the layout can run it, the
    checkpoint has a tokenizer and the harness knows every task."""
    from kiln.eval.tasks import require_harness, task_manager

    require_harness("kiln eval --tasks")
    split = [f"{d} = {n}" for d in ("pp", "cp") if (n := getattr(cfg.distributed, d)) > 1]
    if split:
        raise ConfigError(
            f"kiln eval --tasks runs the harness on the model as one piece per rank, not split "
            f"by {' and '.join(split)}: score the checkpoint in a layout without pipeline or "
            "context parallel (FSDP, tensor or expert parallel)"
        )
    if tokenizer is None:
        raise ConfigError(
            f"kiln eval --tasks encodes the tasks' text with the checkpoint's tokenizer.json, "
            f"and {request.checkpoint} has none: copy the tokenizer the model was trained with "
            "beside it"
        )
    return task_manager(request.tasks, include_path=request.include_path)


def _open_data(
    request: EvalRequest,
    cfg: JobConfig,
    raw: dict[str, Any],
    *,
    tokenizer: Path | None,
    scratch: Path,
) -> TokenDataset:
    from kiln.eval.data import open_checkpoint_data

    inputs = request.data or [_own_held_out_data(raw)]
    return open_checkpoint_data(
        inputs,
        seq_len=cfg.train.seq_len,
        model_vocab_size=cfg.model.vocab_size,
        tokenizer=tokenizer,
        scratch=scratch,
        quiet=int(os.environ.get("RANK", "0")) != 0,
    )


def _own_held_out_data(raw: dict[str, Any]) -> str:
    """The held-out data of the run that wrote the checkpoint: eval.path, else the validation
    split `kiln prepare` wrote beside its (single) prepared dataset."""
    path = raw.get("eval", {}).get("path") or ""
    data = raw.get("data", {})
    if not path and not data.get("datasets") and data.get("path"):
        path = str(validation_split(data["path"]) or "")
    if not path or not (is_url(path) or Path(path).is_dir()):  # a URL is checked on opening
        raise ConfigError(
            "nothing to evaluate: pass --data (a prepared dataset, or text files) or --tasks; "
            "the run that wrote the checkpoint has no held-out data here (eval.path, or the "
            "val split of its prepared data)"
        )
    return path


def _held_out(
    cfg: JobConfig,
    parallel: ParallelContext,
    model_parts: list,
    dataset: TokenDataset,
    *,
    steps: int,
) -> dict[str, Any]:
    global_batch = cfg.train.batch_size * parallel.data_ranks
    available = len(dataset) // global_batch
    what = (
        f"{dataset.path} holds {len(dataset)} samples of {cfg.train.seq_len} tokens, "
        f"and a batch is {cfg.train.batch_size} × {parallel.data_ranks} data ranks = "
        f"{global_batch} samples"
    )
    if available == 0 or steps > available:
        wanted = f"{steps} batches" if steps else "one batch"
        raise ConfigError(
            f"{what}: not enough for {wanted}; pass a smaller --batch-size, --seq-len or --steps"
        )
    cfg.eval.steps = steps or available
    source = Source("eval", ShuffledSamples(dataset, seed=0, shuffle=False), dataset.eos_id)
    # The trainer's step, with no optimizer: only its forward-only evaluation runs.
    step = TrainStep(
        cfg,
        parallel,
        model_parts=model_parts,
        optimizers=[[] for _ in model_parts],
        sources=[source],
    )
    return step.evaluate(dataset) | {
        "samples": cfg.eval.steps * global_batch,
        "seq_len": cfg.train.seq_len,
    }


def _harness(
    request: EvalRequest,
    cfg: JobConfig,
    parallel: ParallelContext,
    model_parts: list,
    manager: Any,
    tokenizer: Path,
) -> dict[str, Any]:
    from kiln.data.tokenizer import load_tokenizer
    from kiln.eval.harness import KilnLM
    from kiln.eval.runner import parallel_runner
    from kiln.eval.tasks import run_tasks, task_scores

    (model,) = model_parts
    lm = KilnLM(
        parallel_runner(model, cfg, parallel),
        load_tokenizer(tokenizer),
        batch_size=cfg.train.batch_size,
        progress=parallel.is_main,
    )
    results = run_tasks(
        lm,
        manager,
        request.tasks,
        limit=request.limit or None,
        num_fewshot=request.num_fewshot,
        bootstrap_iters=request.bootstrap_iters,
    )
    # The harness's report without the task configs (functions, not data).
    report = {key: results[key] for key in HARNESS_REPORT if key in results}
    return {"scores": task_scores(results), "harness": report}
