"""`kiln prepare` throughput against a plain tokenizer loop, in MB of text and tokens per second.

Builds a JSONL corpus from the Python standard library's sources (one document per file,
`--megabytes` of text, no download), trains a byte-level BPE tokenizer on its first 8 MB, then
times, `--repeats` rounds of each (round-robin):

- baseline: `tokenizer.encode_batch_fast` over the texts already in memory, in batches of 1024
  documents, with the tokenizers library's own threads (all cores) and with one thread;
- `kiln prepare` (`prepare_dataset`: reads the JSONL, tokenizes, writes shards and the index)
  with 0 workers (in the main process, tokenizers' threads), 1 and 2 worker processes.

MB are 2**20 bytes of UTF-8 text (JSON quoting not counted); tokens exclude the end-of-document
tokens kiln adds. Usage:

    python benchmarks/prepare_throughput.py [--megabytes 64] [--vocab-size 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import tokenizers
import torch

from kiln.data import prepare_dataset, read_index, train_bpe_tokenizer
from kiln.data.tokenizer import load_tokenizer

PARTS = 8
BATCH = 1024
TOKENIZER_TRAINING_BYTES = 8 * 2**20


def stdlib_texts(max_bytes: int) -> list[str]:
    """Stdlib `.py` sources (tests included, installed packages not) in sorted path order,
    repeated from the start if they hold fewer than `max_bytes` (about 30 MB on Python 3.11)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "__pycache__")]
        files += [Path(directory) / name for name in names if name.endswith(".py")]
    sources = [file.read_text(encoding="utf-8", errors="replace") for file in sorted(files)]
    sources = [text for text in sources if text]
    texts, total = [], 0
    while total < max_bytes:
        text = sources[len(texts) % len(sources)]
        texts.append(text)
        total += len(text.encode("utf-8"))
    return texts


def write_corpus(texts: list[str], folder: Path) -> None:
    folder.mkdir()
    for part in range(PARTS):
        with (folder / f"part_{part}.jsonl").open("w") as f:
            for text in texts[part::PARTS]:
                f.write(json.dumps({"text": text}) + "\n")


def baseline(tokenizer_path: Path, texts: list[str], threads: str) -> int:
    """Encode every text, as a plain loop would; returns the number of tokens."""
    os.environ["TOKENIZERS_PARALLELISM"] = threads
    tokenizer = load_tokenizer(tokenizer_path)
    tokens = 0
    for start in range(0, len(texts), BATCH):
        encodings = tokenizer.encode_batch_fast(texts[start : start + BATCH])
        tokens += sum(len(e.ids) for e in encodings)
    return tokens


def kiln_prepare(corpus: Path, tokenizer_path: Path, output: Path, workers: int) -> int:
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    prepare_dataset(
        [corpus], tokenizer_path, output, num_workers=workers, overwrite=output.exists()
    )
    index = read_index(output)
    return index["num_tokens"] - index["num_documents"]


def train_tokenizer(texts: list[str], vocab_size: int, path: Path) -> Path:
    sample, size = [], 0
    for text in texts:
        if size >= TOKENIZER_TRAINING_BYTES:
            break
        sample.append(text)
        size += len(text)
    train_bpe_tokenizer(sample, vocab_size).save(str(path))
    return path


def runs_to_time(root: Path, tokenizer_path: Path, texts: list[str]) -> dict[str, Callable]:
    """label: a function that does the work once and returns the number of tokens."""
    runs = {
        "baseline: encode_batch_fast, tokenizers threads": partial(
            baseline, tokenizer_path, texts, "true"
        ),
        "baseline: encode_batch_fast, 1 thread": partial(baseline, tokenizer_path, texts, "false"),
    }
    for workers in (0, 1, 2):
        label = f"kiln prepare, {workers} worker{'' if workers == 1 else 's'}"
        runs[label] = partial(kiln_prepare, root / "corpus", tokenizer_path, root / "out", workers)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=float, default=64)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    texts = stdlib_texts(int(args.megabytes * 2**20))
    megabytes = sum(len(t.encode("utf-8")) for t in texts) / 2**20
    print(f"corpus: {len(texts):,} documents, {megabytes:.1f} MB")
    print(f"tokenizers {tokenizers.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"load average before the runs: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_corpus(texts, root / "corpus")
        tokenizer_path = train_tokenizer(texts, args.vocab_size, root / "tokenizer.json")
        runs = runs_to_time(root, tokenizer_path, texts)
        # Round-robin, so that a change in machine load affects every run alike.
        seconds: dict[str, list[float]] = {label: [] for label in runs}
        tokens: dict[str, int] = {}
        for _ in range(args.repeats):
            for label, run in runs.items():
                start = time.perf_counter()
                tokens[label] = run()
                seconds[label].append(time.perf_counter() - start)
    print(f"load average after the runs: {os.getloadavg()}")
    print("| run | MB/s (median) | MB/s (min-max) | tokens/s (median) | seconds (median) |")
    print("|---|---|---|---|---|")
    for label, times in seconds.items():
        median = statistics.median(times)
        low, high = megabytes / max(times), megabytes / min(times)
        print(
            f"| {label} | {megabytes / median:.2f} | {low:.2f}-{high:.2f} | "
            f"{tokens[label] / median / 1e6:.2f} M | {median:.1f} |"
        )


if __name__ == "__main__":
    main()
