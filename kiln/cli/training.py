"""`kiln train`, `kiln check` and `kiln verify`: the commands that take a recipe."""

from __future__ import annotations

import json
import os
import sys

from kiln.cli.common import OVERRIDE_HELP, docs
from kiln.cli.plan import add_gpu_arguments


def add_parsers(subcommand) -> None:
    train = subcommand(
        "train",
        help="train a model from a TOML recipe",
        epilog=f"{OVERRIDE_HELP}. {docs('configuration.md')}",
    )
    train.add_argument("config", help="path to a TOML recipe, e.g. configs/train/debug.toml")
    train.set_defaults(run=cmd_train, accepts_overrides=True)

    check = subcommand(
        "check",
        help="validate a recipe and print the resolved config, layout, size",
        epilog=f"{OVERRIDE_HELP}. {docs('parallelism.md')}",
    )
    check.add_argument("config", help="path to a TOML recipe")
    check.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="number of processes to validate the layout against (under fault tolerance: one replica group's)",
    )
    check.add_argument(
        "--config-only",
        action="store_true",
        help="validate the recipe and the layout only; skip the start-up checks of data and "
        "checkpoints (to size a layout before its data exists)",
    )
    check.add_argument(
        "--strict",
        action="store_true",
        help="fail (exit 2) on what `kiln train` would refuse at start-up (missing data, a run "
        "directory of other settings), not only warn",
    )
    check.add_argument(
        "--json",
        action="store_true",
        help="print the layout and the planner's estimates (memory_gb, tokens_per_sec, mfu) as "
        "JSON instead of the config",
    )
    add_gpu_arguments(check, required=False)
    check.set_defaults(run=cmd_check, accepts_overrides=True)

    verify = subcommand(
        "verify",
        help="prove a layout matches one process, step by step, on a small proxy of the model",
        epilog=f"{OVERRIDE_HELP}. {docs('parallelism.md')}",
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


def cmd_train(args) -> int:
    from kiln.config import load_config

    # The config is checked before torch is imported: a mistake in it is reported at once,
    # not after the seconds that importing the training stack takes.
    cfg = load_config(args.config, args.overrides, launched=int(os.environ.get("WORLD_SIZE", "1")))
    import torch.distributed as dist

    from kiln.checkpoint.lease import release_all
    from kiln.resilience.preemption import Preempted
    from kiln.train.trainer import Trainer

    try:
        Trainer(cfg).train()
    except Preempted as stop:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"kiln train: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    finally:  # however the run ended, its checkpoint location is free for the next one
        release_all()
    # Only a clean end tears the group down: after a failure a peer may be gone, and waiting
    # for it would turn an error into a hang.
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def cmd_check(args) -> int:
    from kiln.config import load_config, resolve_layout, to_toml
    from kiln.config.validate_fault_tolerance import job_world_size

    cfg = load_config(args.config, args.overrides, launched=args.world_size)
    # Under fault tolerance --world-size is one replica group's, as torchrun's WORLD_SIZE.
    args.world_size = job_world_size(cfg, args.world_size)
    cluster = None
    if args.gpu:
        from kiln.cli.plan import cluster_from_args

        cluster = cluster_from_args(args, args.world_size)
    # As in `kiln train`: a config mistake is reported before torch is imported.
    from kiln.metrics.layout_report import layout_report
    from kiln.plan.report import check_estimate, check_lines

    estimate = check_estimate(cfg, resolve_layout(cfg.distributed, args.world_size), cluster)
    notes, problems = _start_up(cfg, args)
    if args.json:
        report = {"config_ok": True, **estimate, "notes": notes, "warnings": problems}
        print(json.dumps(report, indent=2))
        return 0
    print(to_toml(cfg))
    for line in layout_report(cfg, args.world_size):
        print(f"# {line}")
    if cluster is not None:
        for line in check_lines(estimate, cluster):
            print(f"# {line}")
    for note in notes:
        print(f"# {note}")
    for problem in problems:
        print(f"kiln check: warning: {problem}", file=sys.stderr)
    refused = f" ({len(problems)} start-up warning{'s' if len(problems) > 1 else ''}"
    print(f"# config OK{refused + ': kiln train would refuse to start)' if problems else ''}")
    return 0


def _start_up(cfg, args) -> tuple[list[str], list[str]]:
    """`kiln train`'s start-up checks as (notes, warnings). The recipe and layout are what
    `kiln check` judges: data not prepared yet, or a run directory left by another run, is a
    warning, unless --strict makes it the error `kiln train` would give."""
    from kiln.train.preflight import preflight, start_up_checks

    if args.config_only:
        return [], []
    if args.strict:
        return preflight(cfg, args.world_size), []
    return start_up_checks(cfg, args.world_size)


def cmd_verify(args) -> int:
    from kiln.config import load_config, validate
    from kiln.parallel.verify import default_world_size, verify

    cfg = load_config(args.config, args.overrides)
    world_size = args.world_size or default_world_size(cfg.distributed)
    validate(cfg, world_size)
    return 0 if verify(cfg, world_size, steps=args.steps, data_path=args.data) else 1
