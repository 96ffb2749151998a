"""Command line: argument parsing and dispatch only. User errors print one line and exit 2."""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

from kiln.cli import checkpoints, evaluation, plan, prepare, run_views, training
from kiln.cli.common import HelpFormatter, docs, parse_overrides
from kiln.errors import ConfigError, KilnError, RelayedError

# How long a rank that leaves an error to rank 0 waits before it exits.
SILENT_RANK_GRACE_S = 2.0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = parse_overrides(extra, parser)
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


def _reports(error: KilnError) -> bool:
    """Under torchrun every rank fails on a bad config or on rank 0's error: rank 0 alone says
    so, once. An error of this rank's own (a failed collective) is reported by the rank."""
    rank = int(os.environ.get("RANK", "0"))
    return rank == 0 or not isinstance(error, ConfigError | RelayedError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="PyTorch-native LLM pretraining.",
        epilog="Every command's --help shows its defaults. " + docs("quickstart.md"),
    )
    parser.add_argument("--version", action="version", version=f"kiln {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subcommand = partial(sub.add_parser, formatter_class=HelpFormatter)

    for commands in (training, prepare, checkpoints, evaluation, run_views, plan):
        commands.add_parsers(subcommand)
    return parser
