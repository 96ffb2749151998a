"""The README's tour works when pasted in order: no two commands that train (or check) share a
run directory with settings a checkpoint there would refuse (DESIGN §3: a run directory belongs
to one run, and `max_steps` is part of it under a decaying schedule)."""

from __future__ import annotations

import re
import shlex

from kiln.checkpoint.fingerprint import fingerprint_changes, run_fingerprint
from kiln.config import load_config, resolve_layout
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
