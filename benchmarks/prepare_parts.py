"""`kiln prepare` in 1 and 2 processes (`--parts`) against a plain tokenizer loop, side by side.

The corpus and tokenizer are those of benchmarks/prepare_throughput.py (the Python standard
library's sources as 8 JSONL files, `--megabytes` of text; a byte-level BPE trained on the first
8 MB). Times, `--repeats` rounds of each (round-robin, so that a change in machine load hits
every run alike):

- baseline: `tokenizer.encode_batch_fast` over the texts in memory, batches of 1024 documents,
  with the tokenizers library's threads (all cores) and with one thread;
- `kiln prepare` as a command (process start-up included): one process with its default
  tokenizer workers (one per CPU); 2 parts as 2 processes started together, with 1 tokenizer
  worker each and with none (each part tokenizing in its own process, one thread), from the
  start of the first to the end of the last, assembly included. Every run's dataset is checked
  to hold the same tokens as the one-process run's.

Usage:

    python benchmarks/prepare_parts.py [--megabytes 64] [--vocab-size 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_throughput import baseline, stdlib_texts, train_tokenizer, write_corpus

from kiln.data import TokenDataset, read_index


def kiln_command(
    corpus: Path, tokenizer: Path, output: Path, parts: int, workers: int | None
) -> int:
    """Run `kiln prepare` as `parts` processes at once; returns the tokens (eos left out)."""
    shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, "-m", "kiln", "prepare", "--input", str(corpus)]
    command += ["--tokenizer", str(tokenizer), "--output", str(output)]
    if workers is not None:
        command += ["--num-workers", str(workers)]
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if workers == 0 and parts > 1:
        env["TOKENIZERS_PARALLELISM"] = "false"  # one core per part
    extra = (
        [[]] if parts == 1 else [["--part", str(i), "--parts", str(parts)] for i in range(parts)]
    )
    processes = [
        subprocess.Popen(
            [*command, *more], env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        for more in extra
    ]
    if any(process.wait() for process in processes):
        raise RuntimeError(f"kiln prepare failed: {command}")
    index = read_index(output)
    return index["num_tokens"] - index["num_documents"]


def same_tokens(one: Path, other: Path) -> bool:
    a, b = TokenDataset(one, seq_len=1), TokenDataset(other, seq_len=1)
    return (
        a.num_tokens == b.num_tokens
        and np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
        and np.array_equal(a.document_starts(), b.document_starts())
    )


def runs_to_time(root: Path, tokenizer: Path, texts: list[str]) -> dict[str, Callable[[], int]]:
    corpus = root / "corpus"
    return {
        "baseline: encode_batch_fast, tokenizers threads": partial(
            baseline, tokenizer, texts, "true"
        ),
        "baseline: encode_batch_fast, 1 thread": partial(baseline, tokenizer, texts, "false"),
        "kiln prepare, 1 process, 2 workers (default)": partial(
            kiln_command, corpus, tokenizer, root / "one", 1, None
        ),
        "kiln prepare --parts 2, 1 worker each": partial(
            kiln_command, corpus, tokenizer, root / "p2w1", 2, 1
        ),
        "kiln prepare --parts 2, 0 workers each": partial(
            kiln_command, corpus, tokenizer, root / "p2w0", 2, 0
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=float, default=64)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    texts = stdlib_texts(int(args.megabytes * 2**20))
    megabytes = sum(len(t.encode("utf-8")) for t in texts) / 2**20
    print(f"corpus: {len(texts):,} documents, {megabytes:.1f} MB")
    print(f"tokenizers {tokenizers.__version__}, {os.cpu_count()} CPUs")
    print(f"load average before the runs: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_corpus(texts, root / "corpus")
        tokenizer = train_tokenizer(texts, args.vocab_size, root / "tokenizer.json")
        runs = runs_to_time(root, tokenizer, texts)
        seconds: dict[str, list[float]] = {label: [] for label in runs}
        tokens: dict[str, int] = {}
        for _ in range(args.repeats):
            for label, run in runs.items():
                start = time.perf_counter()
                tokens[label] = run()
                seconds[label].append(time.perf_counter() - start)
        for name in ("p2w1", "p2w0"):
            print(
                f"{name}: same tokens and offsets as one process: {same_tokens(root / 'one', root / name)}"
            )
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
