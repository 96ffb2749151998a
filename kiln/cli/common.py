"""What every subcommand's parser shares: the help formatter, pointers to the docs, overrides."""

from __future__ import annotations

import argparse

OVERRIDE_HELP = "config overrides as --section.key=value (value parsed as a TOML literal), e.g. --train.max_steps=200"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it says something (not None, not an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # `is`, not `in`: 0 == False, and a default of 0 or 0.0 says something.
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def docs(page: str) -> str:
    return f"Guide: docs/{page} in the kiln repository."


def parse_overrides(extra: list[str], parser: argparse.ArgumentParser) -> list[str]:
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
