"""The README's tour works when pasted in order: no two commands that train (or check) share a
run directory with settings a checkpoint there would refuse (docs/architecture.md, "Checkpoints
and exact resume": a run directory belongs to one run, and `max_steps` is part of it under a
decaying schedule). Every kiln command of the README and docs/ parses, names real keys, and its
recipe validates in its layout."""

from __future__ import annotations

import dataclasses
import re
import shlex

from kiln.checkpoint.fingerprint import fingerprint_changes, run_fingerprint
from kiln.cli import build_parser, main
from kiln.cli.common import parse_overrides
from kiln.config import JobConfig, load_config, resolve_layout
from kiln.config.load import find_recipe, parse_override
from kiln.parallel.verify import default_world_size, proxy_config
from tests.conftest import REPO


def _commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if "kiln" in words and ("train" in words or "check" in words):
                commands.append(words)
    return commands


def _run(words: list[str]) -> tuple[str, dict] | None:
    """(run dir, fingerprint) of a `kiln train|check` command, None for a placeholder recipe."""
    verb = next(i for i, w in enumerate(words) if w in ("train", "check"))
    recipe, rest = words[verb + 1], words[verb + 2 :]
    if not (REPO / recipe).is_file():
        return None
    nproc = 1
    for flag in ("--nproc-per-node", "--world-size"):
        if flag in words:
            nproc = int(words[words.index(flag) + 1])
    overrides = [w for w in rest if w.startswith("--") and "." in w.split("=")[0]]
    cfg = load_config(REPO / recipe, overrides, world_size=nproc)
    layout = resolve_layout(cfg.distributed, nproc)
    data_ranks = layout["dp_replicate"] * layout["dp_shard"] * layout["ep"]
    batch = cfg.train.batch_size * cfg.train.grad_accum_steps * data_ranks
    return cfg.metrics.run_dir, run_fingerprint(cfg, global_batch=batch)


def test_tour_commands_sharing_a_run_dir_are_the_same_run():
    commands = _commands()
    assert len(commands) >= 8  # the tour's train, torchrun and check lines
    seen: dict[str, tuple[dict, list[str]]] = {}
    for words in commands:
        run = _run(words)
        if run is None:
            continue
        run_dir, fingerprint = run
        if run_dir in seen:
            earlier, first = seen[run_dir]
            changes = fingerprint_changes(earlier, fingerprint)
            assert not changes, (
                f"{' '.join(words)} reuses {run_dir} of {' '.join(first)}: {changes}"
            )
        else:
            seen[run_dir] = (fingerprint, words)


# --- every kiln command of the README and docs/ ----------------------------------------------

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What the docs write in place of a value; a recipe placeholder stands for any recipe.
PLACEHOLDERS = {"RECIPE": "configs/train/debug.toml", "N": "8"}
# A line that runs kiln: `kiln`, `.venv/bin/kiln`, or `-m kiln` under torchrun / python.
_RUNS_KILN = re.compile(r"^(\$ )?((\S*/)?kiln|torchrun|python3?) ")


def documented_commands() -> list[tuple[str, list[str], int]]:
    """(where, kiln's arguments, processes) of each kiln command in the README and docs: every
    line of a shell block, and each inline `kiln ...` span that is a whole command (a recipe or
    argument after the subcommand, no [optional] or ... syntax)."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
            if lang in ("", "bash", "sh", "console"):
                for line in block.replace("\\\n", " ").splitlines():
                    found += _command(path.name, line.strip())
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`((?:\S*/)?kiln [^`]+)`", prose):
            words = span.split()
            if len(words) > 2 and not words[2].startswith("-") and not _fragment(span):
                found += _command(path.name, span)
    return found


def _fragment(span: str) -> bool:
    """An inline mention rather than a command: optional parts, elisions, a flag without its
    value, a placeholder other than a recipe or a count (`kiln generate OUT`), or only verbs."""
    words = span.split()
    placeholder = any(re.fullmatch(r"[A-Z][A-Z_]*", w) and w not in PLACEHOLDERS for w in words)
    dangling = words[-1].startswith("--") and "=" not in words[-1]
    # A command names a path, a recipe file or a flag; `kiln convert hf-to-kiln` names a verb.
    bare = not any("/" in w or "." in w or w.startswith("--") for w in words[2:])
    elided = any(mark in span for mark in ("[", "...", "<", "|"))
    return placeholder or dangling or bare or elided


def _command(where: str, line: str) -> list[tuple[str, list[str], int]]:
    if not _RUNS_KILN.match(line):
        return []
    words = shlex.split(line.removeprefix("$ "), comments=True)
    words = words[:-1] if words[-1:] == ["&"] else words  # run in the background by the shell
    at = [
        i
        for i, w in enumerate(words)
        if w.split("/")[-1] == "kiln" and (i == 0 or words[i - 1] == "-m")
    ]
    if not at or len(words) <= at[0] + 1 or words[at[0] + 1].endswith(":"):
        return []  # output (`kiln train: error: ...`), not a command
    launcher, args = words[: at[0]], [PLACEHOLDERS.get(w, w) for w in words[at[0] + 1 :]]
    nproc = 1
    for flag in ("--nproc-per-node", "--nnodes"):
        if flag in launcher:
            nproc *= int(launcher[launcher.index(flag) + 1])
    return [(f"{where}: {line}", args, nproc)]


def _is_recipe(name: str) -> bool:
    return (REPO / name).is_file() or (REPO / "configs" / "train" / f"{name}.toml").is_file()


def _check_override_keys(where: str, overrides: list[str]) -> None:
    fields = {f.name: f for f in dataclasses.fields(JobConfig)}
    for item in overrides:
        parts, _ = parse_override(item)
        assert parts[0] in fields, f"{where}: no section [{parts[0]}] ({item})"
        section = fields[parts[0]].default_factory()
        assert hasattr(section, parts[1]), f"{where}: no key {parts[0]}.{parts[1]} ({item})"


def test_every_documented_command_parses_and_its_recipe_validates(tmp_path, monkeypatch, capsys):
    """Every `kiln` command the README and docs show: its subcommand and flags exist, its
    overrides name real keys, and a recipe it names validates in its layout. `kiln check` runs
    as written (from an empty directory, so shipped recipes come from the package and nothing
    a user has is read); `kiln train` and `kiln verify` as `kiln check --config-only` at their
    number of processes, and verify's proxy is built too. Runs in this process."""
    commands = documented_commands()
    assert len(commands) > 60
    wheres = " ".join(where for where, _, _ in commands)
    for expected in ("configs/train/7b.toml --world-size 4", "--model.preset=llama3_1b"):
        assert expected in wheres
    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    checked = 0
    for where, args, nproc in commands:
        try:
            parsed, extra = parser.parse_known_args(args)
        except SystemExit:
            raise AssertionError(f"{where}: kiln cannot parse it") from None
        assert not extra or getattr(parsed, "accepts_overrides", False), f"{where}: {extra}"
        overrides = parse_overrides(extra, parser)
        _check_override_keys(where, overrides)
        config = getattr(parsed, "config", None)
        if config is None or not _is_recipe(config):
            continue  # no recipe, or one the reader writes (my.toml)
        if parsed.command == "check":
            run = args
        else:
            world = parsed.world_size if parsed.command == "verify" else nproc
            if parsed.command == "verify" and not world:
                world = default_world_size(load_config(find_recipe(config), overrides).distributed)
            run = ["check", config, "--world-size", str(world), *overrides, "--config-only"]
        code = main(run)
        output = capsys.readouterr()
        assert code == 0, f"{where}: kiln {' '.join(run)} exited {code}:\n{output.err}"
        if parsed.command == "verify":
            cfg = load_config(find_recipe(config), overrides)
            proxy_config(cfg, world, steps=5, run_dir=tmp_path / "verify", data_path="demo")
        checked += 1
    assert checked > 25
