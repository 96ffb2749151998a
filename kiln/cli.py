"""Command line: argument parsing and dispatch only. User errors print one line and exit 2."""

from __future__ import annotations

import argparse
import os
import sys
import time

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


def _reports(error: KilnError) -> bool:
    """Under torchrun every rank fails on a bad config or on rank 0's error: rank 0 alone says
    so, once. An error of this rank's own (a failed collective) is reported by the rank."""
    rank = int(os.environ.get("RANK", "0"))
    return rank == 0 or not isinstance(error, ConfigError | RelayedError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="PyTorch-native LLM pretraining.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a model from a TOML recipe", epilog=OVERRIDE_HELP)
    train.add_argument("config", help="path to a TOML recipe, e.g. configs/train/debug.toml")
    train.set_defaults(run=cmd_train, accepts_overrides=True)

    check = sub.add_parser(
        "check",
        help="validate a recipe and print the resolved config, layout, size",
        epilog=OVERRIDE_HELP,
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

    prepare = sub.add_parser(
        "prepare",
        help="tokenize text/JSONL/Parquet/Hugging Face datasets into memory-mapped token shards",
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

    verify = sub.add_parser(
        "verify",
        help="prove a layout matches one process, step by step, on a small proxy of the model",
        epilog=OVERRIDE_HELP,
    )
    verify.add_argument("config", help="path to a TOML recipe")
    verify.add_argument(
        "--world-size",
        type=int,
        help="processes for the layout (default: the layout's product, with dp_shard = -1 as 2)",
    )
    verify.add_argument("--steps", type=int, default=5)
    verify.add_argument(
        "--data", default="data/demo", help="built-in corpus location (built if missing)"
    )
    verify.set_defaults(run=cmd_verify, accepts_overrides=True)

    generate = sub.add_parser("generate", help="continue a prompt with a trained checkpoint")
    generate.add_argument(
        "checkpoint", help="a checkpoint directory (its newest step) or a step_XXXXXXXX folder"
    )
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)"
    )
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    generate.set_defaults(run=cmd_generate)

    convert = sub.add_parser(
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
    from kiln.config import load_config, resolve_layout, to_toml

    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    # As in `kiln train`: a config mistake is reported before torch is imported.
    from kiln.metrics.layout_summary import context_parallel_summary, float8_summary
    from kiln.metrics.memory import estimate_memory
    from kiln.model import count_params, flops_per_token
    from kiln.parallel.pipeline_split import pipeline_summary
    from kiln.train.preflight import preflight

    layout = resolve_layout(cfg.distributed, args.world_size)
    params = count_params(cfg.model)
    data_ranks = layout["dp_replicate"] * layout["dp_shard"] * layout["ep"]
    global_batch = cfg.train.batch_size * cfg.train.grad_accum_steps * data_ranks
    memory = estimate_memory(cfg, layout)
    print(to_toml(cfg))
    print(f"# world size {args.world_size}: " + " × ".join(f"{k}={v}" for k, v in layout.items()))
    print(f"# data-parallel ranks: {data_ranks}")
    print(f"# parameters: {params.total:,} ({params.non_embedding:,} non-embedding)")
    if cfg.model.num_experts > 0:
        print(
            f"# active parameters per token: {params.active:,} (top-{cfg.model.moe_top_k} experts)"
        )
    print(
        f"# FLOPs per token (fwd+bwd, seq_len {cfg.train.seq_len}): {flops_per_token(cfg.model, cfg.train.seq_len):.4g}"
    )
    print(
        f"# global batch: {global_batch} sequences = {global_batch * cfg.train.seq_len:,} tokens per step"
    )
    # MoE: every expert has weights, gradients and moments; a token's activations are its top k's.
    experts = (
        (_expert_state_label(cfg.model, layout), f"top-{cfg.model.moe_top_k} experts, ")
        if cfg.model.num_experts > 0
        else ("", "")
    )
    print(
        f"# memory per GPU (estimate): {memory.total / 2**30:.1f} GiB = model state {memory.model_state / 2**30:.1f} GiB"
        f" (fp32 weights, grads, {OPTIMIZER_STATE[cfg.optimizer.name]}{experts[0]}) + activations {memory.activations / 2**30:.1f} GiB"
        f" ({experts[1]}activation_checkpointing = {cfg.train.activation_checkpointing!r})"
    )
    if cfg.model.num_experts > 0:
        note = _expert_padding_note(cfg.model, layout)
        if note:
            print(f"# {note}")
    if layout["pp"] > 1:
        print(f"# pipeline: {pipeline_summary(cfg)}")
    if layout["cp"] > 1:
        print(f"# context parallel: {context_parallel_summary(cfg, layout)}")
    if cfg.train.mixed_precision == "fp8":
        print(f"# fp8: {float8_summary(cfg, layout)}")
    if not args.config_only:
        for note in preflight(cfg, args.world_size):
            print(f"# {note}")
    print("# config OK")
    return 0


# What the memory estimate's model state holds besides weights and gradients, per optimizer
# (kiln/metrics/memory.py): 8 bytes per parameter of AdamW moments or Schedule-Free z and v, 4 of
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
        return f" of all {model.num_experts} experts"
    local = model.num_experts // layout["ep"]
    return f" of this ep rank's {local} of {model.num_experts} experts"


def _expert_padding_note(model, layout: dict[str, int]) -> str | None:
    """FSDP splits each expert's rows (or columns) over its ranks where they divide; where
    neither does, the experts are cut into whole-expert chunks, padded where the ranks do not
    divide the experts: say so, it is where the estimate rounds up."""
    from kiln.metrics.memory import expert_shards

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
