"""Command line: argument parsing and dispatch only. User errors print one line and exit 2."""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

from kiln.errors import ConfigError, KilnError, RelayedError

OVERRIDE_HELP = "config overrides as --section.key=value (value parsed as a TOML literal), e.g. --train.max_steps=200"


# How long a rank that leaves an error to rank 0 waits before it exits.
SILENT_RANK_GRACE_S = 2.0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = _overrides(extra, parser)
    try:
        return args.run(args) or 0
    except KilnError as e:
        if _reports(e):
            print(f"kiln {args.command}: error: {e}", file=sys.stderr, flush=True)
        else:
            # torchrun stops every rank once one exits: a silent rank leaves rank 0, which meets
            # the same error at about the same moment, the time to say it.
            time.sleep(SILENT_RANK_GRACE_S)
        return 2
    except OSError as e:  # a path that cannot be read or written: name it, no traceback
        where = f": {e.filename}" if e.filename else ""
        print(f"kiln {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kiln {args.command}: interrupted", file=sys.stderr)
        return 130


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kiln")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def _add_run_views(subcommand) -> None:
    plot = subcommand(
        "plot",
        help="redraw a run's loss curve (training and eval loss) into RUN_DIR/loss_curve.png",
        epilog=_docs("observability.md"),
    )
    plot.add_argument("run_dir", help="a run directory (metrics.run_dir)")
    plot.set_defaults(run=cmd_plot)
    compare = subcommand(
        "compare",
        help="plot several runs' loss (or another metric) against steps and tokens, and print "
        "their final values",
        epilog=_docs("observability.md"),
    )
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    compare.add_argument(
        "--metric", default="loss", help="a metrics.jsonl name, e.g. eval/loss, grad_norm"
    )
    compare.add_argument("--out", default="compare.png", help="where the PNG goes")
    compare.set_defaults(run=cmd_compare)


def cmd_plot(args) -> int:
    from pathlib import Path

    from kiln.metrics.logger import JSONL_NAME
    from kiln.metrics.plot import CURVE_NAME, plot_loss_curve

    run_dir = Path(args.run_dir)
    curve = plot_loss_curve(run_dir / JSONL_NAME, run_dir / CURVE_NAME)
    if curve is None:
        raise KilnError(f"{run_dir} has no {JSONL_NAME} with records: is it a kiln run directory?")
    print(f"kiln: loss curve {curve}")
    return 0


def cmd_compare(args) -> int:
    from pathlib import Path

    from kiln.metrics.compare import compare_runs

    print(compare_runs([Path(d) for d in args.run_dirs], metric=args.metric, out=Path(args.out)))
    print(f"kiln: plot {args.out}")
    return 0


def _reports(error: KilnError) -> bool:
    """Under torchrun every rank fails on a bad config or on rank 0's error: rank 0 alone says
    so, once. An error of this rank's own (a failed collective) is reported by the rank."""
    rank = int(os.environ.get("RANK", "0"))
    return rank == 0 or not isinstance(error, ConfigError | RelayedError)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it says something (not None, not an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _docs(page: str) -> str:
    return f"Guide: docs/{page} in the kiln repository."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="PyTorch-native LLM pretraining.",
        epilog="Every command's --help shows its defaults. " + _docs("quickstart.md"),
    )
    parser.add_argument("--version", action="version", version=f"kiln {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subcommand = partial(sub.add_parser, formatter_class=_HelpFormatter)

    train = subcommand(
        "train",
        help="train a model from a TOML recipe",
        epilog=f"{OVERRIDE_HELP}. {_docs('configuration.md')}",
    )
    train.add_argument("config", help="path to a TOML recipe, e.g. configs/train/debug.toml")
    train.set_defaults(run=cmd_train, accepts_overrides=True)

    check = subcommand(
        "check",
        help="validate a recipe and print the resolved config, layout, size",
        epilog=f"{OVERRIDE_HELP}. {_docs('parallelism.md')}",
    )
    check.add_argument("config", help="path to a TOML recipe")
    check.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="number of processes to validate the layout against",
    )
    check.add_argument(
        "--config-only",
        action="store_true",
        help="validate the recipe and the layout only; skip the start-up checks of data and "
        "checkpoints (to size a layout before its data exists)",
    )
    check.set_defaults(run=cmd_check, accepts_overrides=True)

    prepare = subcommand(
        "prepare",
        help="tokenize text/JSONL/Parquet/Hugging Face datasets into memory-mapped token shards",
        epilog=_docs("data.md"),
    )
    prepare.add_argument(
        "--demo",
        action="store_true",
        help="build the built-in corpus (Python standard library source)",
    )
    prepare.add_argument(
        "--input",
        nargs="+",
        help="input files, folders, glob patterns (quoted, e.g. 'data/**/*.jsonl'), folders "
        "written by datasets' save_to_disk, or hf:NAME[:CONFIG] from the local Hugging Face cache",
    )
    tokenizer = prepare.add_mutually_exclusive_group()
    tokenizer.add_argument("--tokenizer", help="path to a Hugging Face tokenizer.json")
    tokenizer.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB_SIZE",
        help="train a byte-level BPE tokenizer of this vocabulary size on the inputs",
    )
    prepare.add_argument(
        "--output", help="output dataset directory (default data/demo with --demo)"
    )
    prepare.add_argument(
        "--text-key",
        default="text",
        help="JSONL field / Parquet or dataset column holding the text (default: text)",
    )
    prepare.add_argument(
        "--split", default="train", help="split of a Hugging Face dataset input (default: train)"
    )
    val = prepare.add_mutually_exclusive_group()
    val.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help="hold out this fraction of the documents as a validation split in OUTPUT/val",
    )
    val.add_argument(
        "--val-documents",
        type=int,
        metavar="N",
        help="hold out exactly N documents as a validation split in OUTPUT/val",
    )
    prepare.add_argument(
        "--num-workers",
        type=int,
        help="tokenizer processes (default: one per CPU; 0: tokenize in the main process)",
    )
    prepare.add_argument(
        "--shard-tokens", type=int, help="tokens per shard file (default: 67108864 = 64Mi)"
    )
    prepare.add_argument(
        "--overwrite", action="store_true", help="replace an existing output directory"
    )
    prepare.set_defaults(run=cmd_prepare)

    verify = subcommand(
        "verify",
        help="prove a layout matches one process, step by step, on a small proxy of the model",
        epilog=f"{OVERRIDE_HELP}. {_docs('parallelism.md')}",
    )
    verify.add_argument("config", help="path to a TOML recipe")
    verify.add_argument(
        "--world-size",
        type=int,
        help="processes for the layout (default: the layout's product, with dp_shard = -1 as 2)",
    )
    verify.add_argument("--steps", type=int, default=5, help="training steps to compare")
    verify.add_argument(
        "--data", default="data/demo", help="built-in corpus location (built if missing)"
    )
    verify.set_defaults(run=cmd_verify, accepts_overrides=True)

    generate = subcommand(
        "generate",
        help="continue a prompt with a trained checkpoint",
        epilog=_docs("quickstart.md"),
    )
    generate.add_argument(
        "checkpoint",
        help="a run directory or a checkpoint directory (their newest step), or a "
        "step_XXXXXXXX folder",
    )
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate after the prompt"
    )
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)"
    )
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
    generate.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run the model"
    )
    generate.set_defaults(run=cmd_generate)

    _add_run_views(subcommand)

    convert = subcommand(
        "convert",
        help="convert between Hugging Face (Llama, Mixtral, Qwen3-MoE) and kiln checkpoints",
    )
    direction = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    hf_to_kiln = direction.add_parser(
        "hf-to-kiln", help="HF safetensors + config.json -> kiln checkpoint"
    )
    hf_to_kiln.add_argument("source", help="Hugging Face model directory")
    hf_to_kiln.add_argument("output", help="new kiln checkpoint directory")
    kiln_to_hf = direction.add_parser(
        "kiln-to-hf",
        help="kiln checkpoint -> HF directory (Llama; MoE: Qwen3-MoE with qk_norm, else Mixtral)",
    )
    kiln_to_hf.add_argument("source", help="kiln checkpoint directory or step folder")
    kiln_to_hf.add_argument("output", help="new Hugging Face model directory")
    kiln_to_hf.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the exported weights (default: the checkpoint's checkpoint.export_dtype, "
        "float32 if it has none)",
    )
    kiln_to_hf.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file, in bytes or with a unit: 5GB (default), 500MB, 2GiB; "
        "a bigger model is split into model-0000i-of-0000N.safetensors plus an index",
    )
    convert.set_defaults(run=cmd_convert)
    return parser


def _overrides(extra: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Accept `--a.b=v` and `--a.b v`."""
    out, i = [], 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            parser.error(f"unrecognized argument {item!r}; overrides look like --section.key=value")
        if "=" not in item and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            item, i = f"{item}={extra[i + 1]}", i + 1
        out.append(item)
        i += 1
    return out


def cmd_train(args) -> int:
    from kiln.config import load_config

    # The config is checked before torch is imported: a mistake in it is reported at once,
    # not after the seconds that importing the training stack takes.
    cfg = load_config(
        args.config, args.overrides, world_size=int(os.environ.get("WORLD_SIZE", "1"))
    )
    import torch.distributed as dist

    from kiln.resilience.preemption import Preempted
    from kiln.train.trainer import Trainer

    try:
        Trainer(cfg).train()
    except Preempted as stop:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"kiln train: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    # Only a clean end tears the group down: after a failure a peer may be gone, and waiting
    # for it would turn an error into a hang.
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def cmd_check(args) -> int:
    from kiln.config import load_config, to_toml

    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    # As in `kiln train`: a config mistake is reported before torch is imported.
    from kiln.metrics.layout_report import layout_report
    from kiln.train.preflight import preflight

    print(to_toml(cfg))
    for line in layout_report(cfg, args.world_size):
        print(f"# {line}")
    if not args.config_only:
        for note in preflight(cfg, args.world_size):
            print(f"# {note}")
    print("# config OK")
    return 0


def cmd_verify(args) -> int:
    from kiln.config import load_config, validate
    from kiln.parallel.verify import default_world_size, verify

    cfg = load_config(args.config, args.overrides)
    world_size = args.world_size or default_world_size(cfg.distributed)
    validate(cfg, world_size)
    return 0 if verify(cfg, world_size, steps=args.steps, data_path=args.data) else 1


def cmd_prepare(args) -> int:
    from kiln.data.demo_corpus import ensure_demo_corpus
    from kiln.data.prepare import prepare_dataset
    from kiln.data.shards import DEFAULT_SHARD_TOKENS

    tokenizer_given = args.tokenizer is not None or args.train_tokenizer is not None
    if args.demo:
        if args.input or tokenizer_given:
            raise KilnError(
                "--demo builds the built-in corpus with its own tokenizer; "
                "drop --input/--tokenizer/--train-tokenizer"
            )
        path = ensure_demo_corpus(args.output or "data/demo")
        print(f"built-in corpus ready at {path}")
        return 0
    missing = [
        flag
        for flag, value in (
            ("--input", args.input),
            ("--tokenizer or --train-tokenizer", tokenizer_given),
            ("--output", args.output),
        )
        if not value
    ]
    if missing:
        raise KilnError(
            f"kiln prepare needs {', '.join(missing)} (or --demo for the built-in corpus)"
        )
    path = prepare_dataset(
        args.input,
        args.tokenizer,
        args.output,
        text_key=args.text_key,
        split=args.split,
        train_tokenizer=args.train_tokenizer,
        val_fraction=args.val_fraction,
        val_documents=args.val_documents,
        num_workers=args.num_workers,
        overwrite=args.overwrite,
        shard_tokens=DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
    )
    print(f"dataset ready at {path}")
    if args.val_fraction is not None or args.val_documents is not None:
        print(f"validation split at {path / 'val'}")
    return 0


def cmd_generate(args) -> int:
    import torch

    from kiln.checkpoint import (
        find_tokenizer,
        load_checkpoint,
        read_model_config,
        resolve_checkpoint,
    )
    from kiln.data.tokenizer import find_eos_id, load_tokenizer
    from kiln.model import build_model, materialize
    from kiln.model.generate import generate
    from kiln.parallel.device import pick_device

    path = resolve_checkpoint(args.checkpoint)
    tokenizer_path = find_tokenizer(path)
    if tokenizer_path is None:
        raise KilnError(
            f"no tokenizer.json in {path} or its parent: copy the tokenizer the model was trained with there"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    device = pick_device(args.device)
    model = materialize(build_model(read_model_config(path)), device=device, seed=None)
    load_checkpoint(path, model=model)
    model.eval()
    prompt_ids = tokenizer.encode(args.prompt).ids
    eos = find_eos_id(tokenizer)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        new = generate(
            model,
            prompt_ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_id=eos,
            seed=args.seed,
        )
    print(args.prompt + tokenizer.decode(new))
    return 0


def cmd_convert(args) -> int:
    from kiln.checkpoint.hf_convert import hf_to_kiln, kiln_to_hf

    if args.direction == "hf-to-kiln":
        out = hf_to_kiln(args.source, args.output)
    else:
        out = kiln_to_hf(
            args.source, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size
        )
    print(f"wrote {out}")
    return 0
