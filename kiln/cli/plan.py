"""`kiln plan`: the layout, batch and activation checkpointing to train a model on given GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

from kiln.cli.common import docs


def add_gpu_arguments(parser, *, required: bool) -> None:
    """The hardware flags `kiln plan` and `kiln check` share."""
    parser.add_argument(
        "--gpu",
        required=required,
        help="GPU type: h100, h200, a100, b200 (or any name with --peak-tflops, --memory-gb, "
        "--nvlink-gbps)",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs in one node")
    parser.add_argument(
        "--network", help="between nodes: ndr, hdr or ethernet (default: the GPU's usual one)"
    )
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one GPU, TFLOP/s")
    parser.add_argument("--memory-gb", type=float, help="memory of one GPU, GB")
    parser.add_argument(
        "--nvlink-gbps", type=float, help="GB/s per direction from a GPU to the rest of its node"
    )


def add_parsers(subcommand) -> None:
    plan = subcommand(
        "plan",
        help="recommend a parallel layout, batch and AC mode for a model on given GPUs",
        epilog=f"{docs('scaling.md')} It gives every estimate's terms and its error against "
        "published runs.",
    )
    plan.add_argument(
        "--model",
        required=True,
        help="a model preset (llama3_70b), a model TOML, or a training recipe (its optimizer, "
        "precision, loss and data come along)",
    )
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    add_gpu_arguments(plan, required=True)
    plan.add_argument("--seq-len", type=int, help="default: the recipe's, else model.max_seq_len")
    plan.add_argument(
        "--global-batch-tokens",
        type=int,
        help="tokens per optimizer step to hold fixed (default: one micro-batch per data rank)",
    )
    plan.add_argument("--top", type=int, default=5, help="layouts to print")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("--write", type=Path, help="write the best layout as a recipe TOML")
    add_fault_tolerance_arguments(plan)
    plan.set_defaults(run=cmd_plan)


def add_fault_tolerance_arguments(plan) -> None:
    """`--fault-tolerance` and the inputs of its model (docs/fault_tolerance.md)."""
    from kiln.plan import fault_tolerance as model

    ft = plan.add_argument_group(
        "fault tolerance",
        "whether replica groups (the best layout's dp_replicate groups) lose fewer GPU-hours "
        "than checkpoint restarts: docs/fault_tolerance.md, 'When replica groups pay'",
    )
    ft.add_argument(
        "--fault-tolerance",
        action="store_true",
        help="add the per-step cost of replica groups (every-step sync, DiLoCo), the GPU-hours "
        "lost a day with checkpoint restarts and with replica groups, and the break-even GPU count",
    )
    ft.add_argument(
        "--failure-rate",
        metavar="RATE",
        type=float,
        help="failures per GPU-hour, λ (default: "
        f"{model.LLAMA3_FAILURES_PER_GPU_HOUR:g}, The Llama 3 Herd of Models 2024 §3.3.4: "
        "419 unexpected interruptions in 54 days on 16,384 H100s)",
    )
    ft.add_argument(
        "--restart-s",
        metavar="SECONDS",
        type=float,
        help="with checkpoint restarts, seconds from a failure to training again, R "
        f"(default: {model.RESTART_S:g})",
    )
    ft.add_argument(
        "--checkpoint-interval",
        metavar="STEPS",
        type=int,
        help="steps between checkpoints (default: the recipe's checkpoint.interval)",
    )
    ft.add_argument(
        "--group-restart-s",
        metavar="SECONDS",
        type=float,
        help="with replica groups, seconds from a failure to the failed group training again, "
        "healed from a peer, R_g (default: --restart-s)",
    )
    ft.add_argument(
        "--stall-s",
        metavar="SECONDS",
        type=float,
        help=f"seconds the surviving groups stall per failure, S (default: {model.STALL_S:g})",
    )
    ft.add_argument(
        "--quorum-ms",
        metavar="MS",
        type=float,
        help="fixed time replica groups add to a step besides the gradient sum: the quorum's "
        "round trip to the lighthouse, the commit vote, the small sums (default: "
        f"{model.QUORUM_MS:g}, an assumption: measure yours)",
    )
    ft.add_argument(
        "--sync-every",
        metavar="H",
        type=int,
        help=f"DiLoCo's inner steps between syncs, H (default: {model.SYNC_EVERY}, Streaming "
        "DiLoCo's; DiLoCo ran 500)",
    )


# The fault-tolerance model's options, as argparse names them (None: not given).
FT_OPTIONS = (
    "failure_rate",
    "restart_s",
    "checkpoint_interval",
    "group_restart_s",
    "stall_s",
    "quorum_ms",
    "sync_every",
)


def failure_inputs(args, base):
    """The fault-tolerance model's inputs from the options, their defaults and the recipe; None
    without --fault-tolerance."""
    from kiln.errors import ConfigError
    from kiln.plan import fault_tolerance as ft

    if not args.fault_tolerance:
        given = [name for name in FT_OPTIONS if getattr(args, name) is not None]
        if given:
            option = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{option} is an input of --fault-tolerance: add --fault-tolerance")
        return None

    def pick(name: str, default):
        value = getattr(args, name)
        return default if value is None else value

    interval = pick("checkpoint_interval", base.checkpoint.interval)
    if args.checkpoint_interval is None and interval <= 0:
        raise ConfigError(
            "--fault-tolerance needs the steps between checkpoints: --model's "
            f"checkpoint.interval is {interval} (no checkpoints); give --checkpoint-interval STEPS"
        )
    restart = pick("restart_s", ft.RESTART_S)
    inputs = ft.FailureInputs(
        failures_per_gpu_hour=pick("failure_rate", ft.LLAMA3_FAILURES_PER_GPU_HOUR),
        restart_s=restart,
        checkpoint_interval=interval,
        group_restart_s=pick("group_restart_s", restart),
        stall_s=pick("stall_s", ft.STALL_S),
        quorum_ms=pick("quorum_ms", ft.QUORUM_MS),
        sync_every=pick("sync_every", ft.SYNC_EVERY),
    )
    inputs.check()
    return inputs


def cluster_from_args(args, gpus: int):
    from kiln.plan.hardware import find_gpu, make_cluster

    gpu = find_gpu(
        args.gpu,
        peak_tflops=args.peak_tflops,
        memory_gb=args.memory_gb,
        nvlink_gbps=args.nvlink_gbps,
    )
    return make_cluster(gpu, gpus, args.gpus_per_node, args.network)


def base_config(model: str, seq_len: int | None):
    """A recipe as it is, or a preset / model TOML under kiln's defaults (bf16, AdamW)."""
    from kiln.config import config_from_dict, read_toml
    from kiln.config.load import MODEL_PRESET_DIR, find_recipe
    from kiln.errors import ConfigError

    if model.endswith(".toml"):
        raw = read_toml(find_recipe(model))
        if "model" not in raw:  # a model file: its keys are the model section
            raw = {"model": raw}
    elif (MODEL_PRESET_DIR / f"{model}.toml").is_file():
        raw = {"model": {"preset": model}}
    else:
        known = ", ".join(sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.toml")))
        raise ConfigError(
            f"--model {model!r} is neither a preset nor a .toml file; presets: {known}"
        )
    train = raw.setdefault("train", {})
    if seq_len is not None:
        train["seq_len"] = seq_len
    elif "seq_len" not in train:
        train["seq_len"] = config_from_dict({"model": dict(raw["model"])}).model.max_seq_len
    cfg = config_from_dict(raw)
    # Else every layout fails validation alike, and the search would report "fits no layout".
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"--seq-len {cfg.train.seq_len} is past the model's max_seq_len "
            f"({cfg.model.max_seq_len}): plan from a recipe whose [model] max_seq_len (and RoPE "
            f"scaling) reaches it, e.g. configs/train/llama3_8b_512k_64gpu.toml"
        )
    return cfg


def cmd_plan(args) -> int:
    from kiln.errors import ConfigError
    from kiln.plan.report import json_report, text_report, write_recipe
    from kiln.plan.search import require_fit, search

    if args.gpus < 1 or args.top < 1:
        raise ConfigError(f"--gpus and --top must be positive, got {args.gpus} and {args.top}")
    cluster = cluster_from_args(args, args.gpus)
    base = base_config(args.model, args.seq_len)
    tokens = args.global_batch_tokens
    if tokens is not None and tokens % base.train.seq_len:
        raise ConfigError(
            f"--global-batch-tokens {tokens} is not a whole number of sequences of "
            f"{base.train.seq_len} tokens"
        )
    inputs = failure_inputs(args, base)
    result = search(base, cluster, global_tokens=tokens)
    require_fit(base, result, global_tokens=tokens)
    ft = None
    if inputs is not None:
        from kiln.plan.fault_tolerance import fault_tolerance

        ft = fault_tolerance(result.ranked[0], cluster, inputs)
    if args.json:
        from kiln.plan.fault_tolerance import as_dict

        extra = {"fault_tolerance": as_dict(ft)} if ft else {}
        print(json_report(result, base, top=args.top, extra=extra))
    else:
        from kiln.plan.fault_tolerance import text_lines

        print(text_report(result, base, top=args.top))
        if ft:
            print("\n" + "\n".join(text_lines(ft)))
    if args.write:
        command = " ".join(["kiln", *sys.argv[1:]]) if sys.argv[0].endswith("kiln") else "kiln plan"
        write_recipe(result.ranked[0], args.write, command=command)
        if not args.json:
            print(f"wrote {args.write} (kiln check {args.write} --world-size {args.gpus})")
    return 0
