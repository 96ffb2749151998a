"""Layout of a checkpoint directory: step folders, the commit marker, `latest`, retention. The
same rules hold on a filesystem and in an object store (`kiln/checkpoint/store.py`); only how a
save is committed differs.

<root>/
  latest                    # text: name of the newest complete step folder
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
import re
import tempfile
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from kiln.checkpoint.store import (
    MARKER,
    CheckpointStore,
    Location,
    location,
    store_for,
    sync_path,
)
from kiln.errors import KilnError

__all__ = ["MARKER", "sync_path"]  # names other modules have always imported from here

LATEST = "latest"
TRAIN_STATE = "train_state.json"
_STEP_RE = re.compile(r"^step_(\d{8})$")


def step_dir(root: Location | str, step: int) -> Location:
    return location(root) / f"step_{step:08d}"


def partial_dir(root: Location | str, step: int) -> Location:
    """Where the save of `step` is written until its commit (a hidden folder on a filesystem)."""
    root = location(root)
    return store_for(root).staging(root, step)


def is_complete(path: Location) -> bool:
    return store_for(path).is_file(path / MARKER)


def complete_steps(root: Location | str) -> list[tuple[int, Location]]:
    """(step, folder) of every committed checkpoint under root, oldest first."""
    root = location(root)
    found = []
    for child in store_for(root).children(root):
        match = _STEP_RE.match(child.name)
        if match and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_complete(root: Location | str) -> Location | None:
    """The folder `latest` names if it is complete, else the highest complete step."""
    root = location(root)
    try:  # empty or unreadable after a hard stop: the folders still say which is newest
        named = store_for(root).read_bytes(root / LATEST).decode().strip()
    except (OSError, UnicodeDecodeError):
        named = ""
    if _STEP_RE.match(named) and is_complete(root / named):
        return root / named
    steps = complete_steps(root)
    return steps[-1][1] if steps else None


def commit(root: Location | str, step: int, *, written: Iterable[str]) -> Location:
    """Mark the staged save of `step` complete with the manifest of the files its writers
    reported (`written`, names relative to the step folder), make it the committed folder and
    point `latest` at it (durably and atomically on a filesystem: see LocalStore.publish; marker
    object last in an object store). The names come from the writers, not from a listing: an
    object store's listing may not show an object yet, and a manifest without it would pass the
    damage check and fail to load."""
    root = location(root)
    store = store_for(root)
    files = _sizes_once_visible(store, store.staging(root, step), set(written))
    marker = json.dumps({"step": step, "files": files}, indent=1) + "\n"
    return store.publish(root, step, marker, f"step_{step:08d}\n")


# How long a commit waits for written objects to appear in the store's listing (seconds, between
# tries): enough for an object store's listing to catch up, short enough to fail a save promptly.
_LISTING_WAITS = (0.2, 0.5, 1.0, 2.0, 4.0)


def _sizes_once_visible(
    store: CheckpointStore, staged: Location, names: set[str]
) -> dict[str, int]:
    """Each written file's size from the store's listing, once the listing shows them all."""
    waits = iter(_LISTING_WAITS)
    while True:
        present = store.files(staged)
        missing = sorted(names - present.keys())
        if not missing:
            return {name: present[name] for name in sorted(names)}
        wait = next(waits, None)
        if wait is None:
            raise FileNotFoundError(
                errno.ENOENT,
                f"{len(missing)} written file(s) never appeared in the store's listing",
                str(staged / missing[0]),
            )
        time.sleep(wait)


def read_manifest(path: Location) -> dict[str, int] | None:
    """The files a committed checkpoint's marker lists with their sizes (None: a marker of an
    older kiln version, which holds only the step)."""
    manifest = json.loads(store_for(path).read_bytes(path / MARKER).decode())
    return manifest.get("files") if isinstance(manifest, dict) else None


def damage(path: Location) -> str | None:
    """Why a committed checkpoint cannot be trusted, or None: a marker or train state that is
    empty or unreadable (a hard stop before they reached the disk), a file the marker lists that
    is missing or has another size (a truncated copy, a full disk). Markers of older kiln
    versions hold only the step and are taken as they are."""
    store = store_for(path)
    try:
        manifest = json.loads(store.read_bytes(path / MARKER).decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        if not store.is_file(path / MARKER):
            return f"no {MARKER} marker"
        return f"its {MARKER} marker is empty or unreadable"
    present = store.files(path)  # one listing: on an object store, one request for all sizes
    if isinstance(manifest, dict):
        for name, size in manifest.get("files", {}).items():
            if name not in present:
                return f"{name} is missing"
            if present[name] != size:
                return f"{name} has {present[name]} bytes, {size} were written"
    if TRAIN_STATE in present:
        try:
            if not isinstance(json.loads(store.read_bytes(path / TRAIN_STATE).decode()), dict):
                return f"{TRAIN_STATE} holds no train state"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return f"{TRAIN_STATE} is empty or unreadable"
    return None


@dataclass(frozen=True)
class Skipped:
    """A checkpoint that resuming passed over, and why."""

    path: Location
    reason: str

    def message(self) -> str:
        return f"skipping {self.path}: {self.reason}"


def resume_candidates(root: Location | str) -> tuple[Location | None, list[Skipped]]:
    """The checkpoint to resume from (the one `latest` names, else the highest step) that is
    intact, and each checkpoint newer than it that was passed over, with the reason."""
    root = location(root)
    skipped = [
        Skipped(child, f"an interrupted save (no {MARKER} marker)")
        for child in store_for(root).children(root)
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


def prune(
    root: Location | str, keep_last_n: int, *, keep: Location, busy: Collection[Location] = ()
) -> None:
    """Keep the newest `keep_last_n` intact checkpoints (0 keeps everything) and delete the
    complete ones older than them; `keep`, the one just written, always stays and counts. A
    damaged checkpoint newer than those kept is not counted (it cannot be resumed from) and stays
    for a person to look at; the run overwrites it when it saves that step again. A `busy` one
    (a Hugging Face export reads it) stays until a later prune."""
    if keep_last_n <= 0:
        return
    root = location(root)
    intact = 0
    for _, path in reversed(complete_steps(root)):
        if intact >= keep_last_n:
            if path != keep and path not in busy:
                store_for(root).remove(path)
        elif path == keep or damage(path) is None:
            intact += 1


def remove_partials(root: Location | str) -> None:
    """Leftovers of a save that died midway are never loaded; clear them before writing again."""
    root = location(root)
    store = store_for(root)
    for partial in store.partials(root):
        store.remove(partial)


def resolve_checkpoint(path: str | Location) -> Location:
    """A step folder, a checkpoint root or a run directory holding one in `checkpoints/` (their
    newest complete step); anything else is an error."""
    path = location(path)
    store = store_for(path)
    if not store.exists(path):
        raise KilnError(
            f"checkpoint not found: {path}. Pass a run directory, its checkpoints/ folder or a "
            "step_XXXXXXXX folder, and check the path (for a URL: the bucket, prefix and spelling)"
        )
    if not complete_steps(path) and store.exists(path / "checkpoints"):
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
    if newest is None and skipped:
        found = "; ".join(s.message() for s in skipped)
        raise KilnError(
            f"{path} holds no complete checkpoint yet ({found}): use it after a save commits, "
            "or pass an earlier checkpoint"
        )
    if newest is None:
        raise KilnError(
            f"{path} is not a kiln checkpoint: expected a step_XXXXXXXX/ folder with a {MARKER} marker, "
            "or a directory holding such folders (written by `kiln train` or `kiln convert hf-to-kiln`)"
        )
    return newest


def find_tokenizer(checkpoint: Location) -> Path | None:
    """The tokenizer saved with a checkpoint, as a local file (one in an object store is
    downloaded to a temporary folder, since tokenizers load from files)."""
    store = store_for(checkpoint)
    for candidate in (checkpoint / "tokenizer.json", checkpoint.parent / "tokenizer.json"):
        if store.is_file(candidate):
            if isinstance(candidate, Path):
                return candidate
            local = Path(tempfile.mkdtemp(prefix="kiln-tokenizer-")) / "tokenizer.json"
            local.write_bytes(store.read_bytes(candidate))
            return local
    return None
