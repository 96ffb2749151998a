"""On-disk layout of a checkpoint directory: step folders, the commit marker, `latest`, retention.

<root>/
  latest                    # text: name of the newest complete step folder (replaced atomically)
  tokenizer.json            # copied once, so a checkpoint can generate text on its own
  step_00000200/
    .metadata, *.distcp     # torch.distributed.checkpoint: model (+ optimizer)
    config.toml             # the resolved job config that produced it
    train_state.json        # step, data position, tokens seen
    rng/rank_00000.pt       # per-rank RNG states
    COMPLETE                # written last, lists every file and its size: a folder without it,
                            # or whose files do not match it, is never loaded
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from kiln.errors import KilnError

MARKER = "COMPLETE"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return Path(root) / f".step_{step:08d}.partial"


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_complete(root: Path) -> Path | None:
    """The folder `latest` names if it is complete, else the highest complete step."""
    pointer = Path(root) / LATEST
    if pointer.is_file():
        named = Path(root) / pointer.read_text().strip()
        if _STEP_RE.match(named.name) and is_complete(named):
            return named
    steps = complete_steps(root)
    return steps[-1][1] if steps else None


def commit(root: Path, step: int) -> Path:
    """Mark the partial folder complete, move it into place and point `latest` at it."""
    partial, final = partial_dir(root, step), step_dir(root, step)
    files = {
        str(file.relative_to(partial)): file.stat().st_size
        for file in sorted(partial.rglob("*"))
        if file.is_file()
    }
    marker = partial / f".{MARKER}.tmp"
    marker.write_text(json.dumps({"step": step, "files": files}, indent=1) + "\n")
    os.replace(marker, partial / MARKER)
    if final.exists():
        shutil.rmtree(final)
    os.rename(partial, final)
    tmp = Path(root) / f".{LATEST}.tmp"
    tmp.write_text(final.name + "\n")
    os.replace(tmp, Path(root) / LATEST)
    return final


def damage(path: Path) -> str | None:
    """Why a committed checkpoint cannot be trusted (a file the marker lists is missing or has
    another size: a truncated copy, a full disk), or None. Markers of older kiln versions hold
    only the step and are taken as they are."""
    try:
        manifest = json.loads((Path(path) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None if (Path(path) / MARKER).is_file() else f"no {MARKER} marker"
    if not isinstance(manifest, dict):
        return None
    for name, size in manifest.get("files", {}).items():
        file = Path(path) / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def resume_candidates(root: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (the one `latest` names, else the highest step) that is
    intact, and a warning for each newer checkpoint skipped on the way and why."""
    root = Path(root)
    if not root.is_dir():
        return None, []
    warnings = [
        f"ignoring {child}: an interrupted save (no {MARKER} marker)"
        for child in sorted(root.iterdir())
        if (_STEP_RE.match(child.name) or child.name.startswith(".step_"))
        and not is_complete(child)
    ]
    ordered = [path for _, path in reversed(complete_steps(root))]
    newest = latest_complete(root)
    if newest is not None:
        ordered.remove(newest)
        ordered.insert(0, newest)
    for path in ordered:
        problem = damage(path)
        if problem is None:
            return path, warnings
        warnings.append(f"skipping {path}: {problem}; falling back to an earlier checkpoint")
    return None, warnings


def prune(root: Path, keep_last_n: int, *, keep: Path) -> None:
    """Delete all but the newest `keep_last_n` complete checkpoints (0 keeps everything);
    `keep`, the one just written, always stays."""
    if keep_last_n <= 0:
        return
    for _, path in complete_steps(root)[:-keep_last_n]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


def remove_partials(root: Path) -> None:
    """Leftovers of a save that died midway are never loaded; clear them before writing again."""
    root = Path(root)
    if root.is_dir():
        for child in root.glob(".step_*.partial"):
            shutil.rmtree(child, ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder, a checkpoint root or a run directory holding one in `checkpoints/` (their
    newest complete step); anything else is an error."""
    path = Path(path)
    if not path.exists():
        raise KilnError(f"checkpoint not found: {path}")
    if not complete_steps(path) and (path / "checkpoints").is_dir():
        path = path / "checkpoints"  # a run directory (metrics.run_dir)
    if _STEP_RE.match(path.name) and is_complete(path):
        problem = damage(path)
        if problem is not None:
            raise KilnError(f"{path} is damaged ({problem}); use an earlier step")
        return path
    if _STEP_RE.match(path.name):
        raise KilnError(
            f"{path} is an incomplete checkpoint (no {MARKER} marker): the save was interrupted; use an earlier step"
        )
    newest, skipped = resume_candidates(path)
    if newest is None and complete_steps(path):
        raise KilnError(f"{path} holds no intact checkpoint: {'; '.join(skipped)}")
    if newest is None:
        raise KilnError(
            f"{path} is not a kiln checkpoint: expected a step_XXXXXXXX/ folder with a {MARKER} marker, "
            "or a directory holding such folders (written by `kiln train` or `kiln convert hf-to-kiln`)"
        )
    return newest


def find_tokenizer(checkpoint: Path) -> Path | None:
    for candidate in (checkpoint / "tokenizer.json", checkpoint.parent / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    return None
