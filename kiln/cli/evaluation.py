"""`kiln eval`: a checkpoint's perplexity on held-out data and its lm-evaluation-harness scores."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kiln.cli.common import docs


def add_parsers(subcommand) -> None:
    evaluate = subcommand(
        "eval",
        help="score a checkpoint: loss and perplexity on held-out data, lm-evaluation-harness tasks",
        epilog="The layout and the rest of how the model computes take config overrides, "
        "--distributed.tp=2 or --train.mixed_precision=fp32 (default: FSDP over every process "
        f"torchrun starts, as the checkpoint computed). {docs('observability.md')}",
    )
    evaluate.add_argument(
        "checkpoint",
        help="a run directory or a checkpoint directory (their newest step), or a "
        "step_XXXXXXXX folder; a path or a URL (s3://bucket/run)",
    )
    evaluate.add_argument(
        "--data",
        nargs="+",
        default=[],
        help="a prepared dataset (a folder or a URL), or text/JSONL/Parquet files, folders or "
        "globs, tokenized with "
        "the checkpoint's tokenizer (default without --tasks: the run's own held-out data)",
    )
    evaluate.add_argument(
        "--steps", type=int, default=0, help="batches to evaluate (default: all the data holds)"
    )
    evaluate.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="sequences per process and batch (default: the checkpoint's train.batch_size)",
    )
    evaluate.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="tokens per sequence, the harness's context too (default: the checkpoint's "
        "train.seq_len)",
    )
    evaluate.add_argument(
        "--tasks",
        default=None,
        help="comma-separated lm-evaluation-harness tasks, groups or task YAML files, e.g. "
        "hellaswag,arc_easy (pip install 'kiln[eval]'; `lm-eval ls tasks` lists them)",
    )
    evaluate.add_argument("--limit", type=int, default=0, help="examples per task (0: all)")
    evaluate.add_argument(
        "--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's)"
    )
    evaluate.add_argument("--include-path", default=None, help="a folder of your own task YAMLs")
    evaluate.add_argument(
        "--bootstrap-iters",
        type=int,
        default=100000,
        help="bootstrap samples for the standard errors of metrics without a closed form, as in "
        "the harness (0: no standard errors)",
    )
    evaluate.add_argument("--json", help="also write the results to this JSON file")
    evaluate.set_defaults(run=cmd_eval, accepts_overrides=True)


def cmd_eval(args) -> int:
    from kiln.errors import KilnError
    from kiln.train.eval_checkpoint import EvalRequest, evaluate_checkpoint

    tasks = [name.strip() for name in (args.tasks or "").split(",") if name.strip()]
    for flag in ("steps", "batch_size", "seq_len", "limit", "bootstrap_iters"):
        if getattr(args, flag) < 0:
            raise KilnError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    request = EvalRequest(
        checkpoint=args.checkpoint,
        data=args.data,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        tasks=tasks,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        include_path=args.include_path or "",
        bootstrap_iters=args.bootstrap_iters,
        overrides=args.overrides,
    )
    results = evaluate_checkpoint(request)
    if int(os.environ.get("RANK", "0")) == 0:
        print(_report(results), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=_number) + "\n")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _report(results: dict) -> str:
    processes = results["processes"]
    layout = ", ".join(f"{dim}={n}" for dim, n in results["layout"].items())
    lines = [
        f"kiln eval: {results['checkpoint']} (step {results['step']}) on {processes} "
        f"process{'es' if processes > 1 else ''}" + (f" ({layout})" if layout else "")
    ]
    if "eval/loss" in results:
        lines.append(
            f"eval/loss {results['eval/loss']:.4f} | eval/perplexity "
            f"{results['eval/perplexity']:.3f} | {results['samples']} samples of "
            f"{results['seq_len']} tokens from {' '.join(results['data'])}"
        )
    if "harness" in results:
        from lm_eval.utils import make_table

        lines.append(make_table(results["harness"]).rstrip())
    return "\n".join(lines)


def _number(value):
    """numpy numbers in the harness's results."""
    return value.item() if hasattr(value, "item") else str(value)
