"""Streaming work per data rank: each rank reads and tokenizes only its share of the rows, so
the time a rank spends on one step's samples should fall as 1/ranks.

Builds a Hugging Face dataset (`save_to_disk`) from the Python standard library's sources (one
row per file, `--megabytes` of text, no download) and trains a byte-level BPE tokenizer on its
first 8 MB. Then, for 1, 2 and 4 data ranks, it times each rank in turn (in this one process,
tokenizers on one thread, so the number is the rank's own work) taking its share of `--steps`
steps of a global batch of `--global-batch` windows of `--seq-len` tokens, `--repeats` rounds
round-robin. Usage:

    python benchmarks/streaming_ranks.py [--megabytes 32] [--steps 360] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: a rank's own work, before import

import datasets

from benchmarks.prepare_throughput import stdlib_texts, train_tokenizer
from kiln.config.sections import DatasetSource
from kiln.data.hf_source import STREAM_ROWS, StreamingSamples
from kiln.data.tokenizer import load_tokenizer


def rank_seconds(entry: DatasetSource, tokenizer: Path, *, rank: int, ranks: int, args) -> float:
    """Seconds data rank `rank` of `ranks` takes to read its windows of `args.steps` steps."""
    start = time.perf_counter()  # opening reads and tokenizes the first rows
    samples = StreamingSamples(
        entry, tokenizer_path=str(tokenizer), seq_len=args.seq_len, data_rank=rank, data_ranks=ranks
    )
    for _ in range(args.steps * args.global_batch // ranks):
        samples.take()
    return time.perf_counter() - start


def bare_tokens_per_second(texts: list[str], tokenizer: Path, tokens: int) -> float:
    """A plain `encode_batch_fast` loop over texts in memory, until it has `tokens` tokens."""
    encoder = load_tokenizer(tokenizer)
    start, done = time.perf_counter(), 0
    for first in range(0, len(texts), STREAM_ROWS):
        done += sum(
            len(e.ids) for e in encoder.encode_batch_fast(texts[first : first + STREAM_ROWS])
        )
        if done >= tokens:
            break
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=360)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    texts = stdlib_texts(args.megabytes * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(root / "rows")
        tokenizer = train_tokenizer(texts, args.vocab_size, root / "tokenizer.json")
        entry = DatasetSource(name="data", source="hf", path=str(root / "rows"), streaming=True)
        times: dict[int, list[list[float]]] = {1: [], 2: [], 4: []}
        tokens = args.steps * args.global_batch * args.seq_len
        bare = [bare_tokens_per_second(texts, tokenizer, tokens) for _ in range(args.repeats)]
        for repeat in range(args.repeats):
            order = list(times)[repeat % 3 :] + list(times)[: repeat % 3]  # who goes first rotates
            for ranks in order:
                times[ranks].append(
                    [
                        rank_seconds(entry, tokenizer, rank=r, ranks=ranks, args=args)
                        for r in range(ranks)
                    ]
                )
    one = statistics.median(statistics.mean(r) for r in times[1])
    print(f"bare encode_batch_fast, one thread: {statistics.median(bare) / 1e6:.2f} M tokens/s")
    print(
        f"{args.steps} steps x {args.global_batch} windows x {args.seq_len} tokens = {tokens:,} tokens"
    )
    print(
        "| data ranks | seconds per rank (median of the mean over ranks) | slowest rank | tokens/s per rank | work per rank vs 1 rank |"
    )
    print("|---|---|---|---|---|")
    for ranks, rounds in times.items():
        mean = statistics.median(statistics.mean(r) for r in rounds)
        slowest = statistics.median(max(r) for r in rounds)
        rate = tokens / ranks / mean
        print(
            f"| {ranks} | {mean:.2f} | {slowest:.2f} | {rate / 1e6:.2f} M | {mean / one:.3f} (ideal {1 / ranks:.3f}) |"
        )


if __name__ == "__main__":
    main()
