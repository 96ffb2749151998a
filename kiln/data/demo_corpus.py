"""Built-in demo corpus: the Python standard library's own sources, present on every machine."""

from __future__ import annotations

import os
import sysconfig
import tempfile
from pathlib import Path

from kiln.data.shards import INDEX_FILE, DatasetExistsError, ShardWriter
from kiln.data.tokenizer import encode_ids, train_bpe_tokenizer
from kiln.log import info

DEMO_MAX_BYTES = 8 * 2**20
# Tests would bias the corpus towards assertion boilerplate; encodings and pydoc_data are tables
# of escaped code points and one giant string, not code; the rest are vendored or legacy trees.
SKIP_DIRS = {
    "encodings",
    "pydoc_data",
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "__pycache__",
}


def ensure_demo_corpus(
    path: str | Path, *, vocab_size: int = 4096, max_bytes: int = DEMO_MAX_BYTES
) -> Path:
    """Build the demo dataset at `path` unless it is already there; returns `path`.

    Safe to call from several processes at once: each builds into its own temporary
    directory and the first to finish wins; the others use its result.
    """
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        return path
    info(f"building the demo corpus (Python stdlib sources) in {path}")
    texts = stdlib_texts(max_bytes)
    tokenizer = train_bpe_tokenizer(texts, vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_path = Path(tmp) / "tokenizer.json"
        tokenizer.save(str(tokenizer_path))
        try:
            with ShardWriter(path, tokenizer_path) as writer:
                for ids in encode_ids(tokenizer, texts):
                    writer.add_document(ids)
        except DatasetExistsError:
            # Another process finished first; its corpus is as good as ours.
            if not (path / INDEX_FILE).is_file():
                raise
    return path


def stdlib_texts(max_bytes: int) -> list[str]:
    """Non-empty stdlib `.py` sources in sorted path order, at most `max_bytes` in total."""
    texts: list[str] = []
    total = 0
    for file in stdlib_files():
        size = file.stat().st_size
        # Skip rather than stop at a file that does not fit, so one big file cannot starve the rest.
        if size == 0 or total + size > max_bytes:
            continue
        # The stdlib is utf-8; `replace` keeps a stray odd file from breaking the build.
        texts.append(file.read_text(encoding="utf-8", errors="replace"))
        total += size
    return texts


def stdlib_files() -> list[Path]:
    """Every stdlib `.py` file outside SKIP_DIRS, sorted so the corpus is deterministic."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in SKIP_DIRS]
        files += [Path(directory) / name for name in names if name.endswith(".py")]
    return sorted(files)
