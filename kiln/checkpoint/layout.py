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

import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

MARKER = "COMPLETE"
LATEST = "latest"
TRAIN_STATE = "train_state.json"
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
    try:  # empty or unreadable after a hard stop: the folders still say which is newest
        named = Path(root) / (Path(root) / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = None
    if named is not None and _STEP_RE.match(named.name) and is_complete(named):
        return named
    steps = complete_steps(root)
    return steps[-1][1] if steps else None


def commit(root: Path, step: int) -> Path:
    """Mark the partial folder complete, move it into place and point `latest` at it.

    Durable: every file and folder the checkpoint depends on reaches the disk before the rename
    publishes it, and the rename and `latest` before this returns. Without the fsyncs a power cut
    or a spot VM's hard stop right after a commit can leave the small files empty behind names
    that were already renamed into place."""
    partial, final = partial_dir(root, step), step_dir(root, step)
    files = {
        str(file.relative_to(partial)): file.stat().st_size
        for file in sorted(partial.rglob("*"))
        if file.is_file()
    }
    for name in files:
        sync_path(partial / name)
    for folder in sorted((p for p in partial.rglob("*") if p.is_dir()), reverse=True):
        sync_path(folder)
    marker = partial / f".{MARKER}.tmp"
    _write_synced(marker, json.dumps({"step": step, "files": files}, indent=1) + "\n")
    os.replace(marker, partial / MARKER)
    sync_path(partial)
    if final.exists():
        shutil.rmtree(final)
    os.rename(partial, final)
    sync_path(Path(root))
    tmp = Path(root) / f".{LATEST}.tmp"
    _write_synced(tmp, final.name + "\n")
    os.replace(tmp, Path(root) / LATEST)
    sync_path(Path(root))
    return final


def sync_path(path: Path) -> None:
    """fsync a file, or a folder (its entries: names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        # Some network filesystems refuse fsync on a folder; their renames are synchronous.
        if not (Path(path).is_dir() and error.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def damage(path: Path) -> str | None:
    """Why a committed checkpoint cannot be trusted, or None: a marker or train state that is
    empty or unreadable (a hard stop before they reached the disk), a file the marker lists that
    is missing or has another size (a truncated copy, a full disk). Markers of older kiln
    versions hold only the step and are taken as they are."""
    marker = Path(path) / MARKER
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        if not marker.is_file():
            return f"no {MARKER} marker"
        return f"its {MARKER} marker is empty or unreadable"
    if isinstance(manifest, dict):
        for name, size in manifest.get("files", {}).items():
            file = Path(path) / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != size:
                return f"{name} has {file.stat().st_size} bytes, {size} were written"
    state = Path(path) / TRAIN_STATE
    if state.exists():
        try:
            if not isinstance(json.loads(state.read_text()), dict):
                return f"{TRAIN_STATE} holds no train state"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return f"{TRAIN_STATE} is empty or unreadable"
    return None


@dataclass(frozen=True)
class Skipped:
    """A checkpoint that resuming passed over, and why."""

    path: Path
    reason: str

    def message(self) -> str:
        return f"skipping {self.path}: {self.reason}"


def resume_candidates(root: Path) -> tuple[Path | None, list[Skipped]]:
    """The checkpoint to resume from (the one `latest` names, else the highest step) that is
    intact, and each checkpoint newer than it that was passed over, with the reason."""
    root = Path(root)
    if not root.is_dir():
        return None, []
    skipped = [
        Skipped(child, f"an interrupted save (no {MARKER} marker)")
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
            return path, skipped
        skipped.append(Skipped(path, f"{problem}; falling back to an earlier checkpoint"))
    return None, skipped


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
        found = "; ".join(s.message() for s in skipped)
        raise KilnError(f"{path} holds no intact checkpoint: {found}")
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
