"""Loader throughput from memory-mapped shards, in tokens per second, for one process.

Writes a synthetic prepared dataset (random documents, uint16 tokens), then times
`BatchLoader.next_step()` (what the trainer calls) for a single dataset and a two-dataset
mixture with document masking, in the training process and with worker processes. The first
pass reads from disk; the timed passes read pages the OS has cached, as a long run does once
its working set is warm. Usage:

    python benchmarks/data_loader.py [--tokens 200_000_000] [--seq-len 2048] [--batch 16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kiln.config.sections import DataConfig, DatasetSource
from kiln.data import ShardWriter, TokenDataset, train_bpe_tokenizer
from kiln.data.loader import BatchLoader, ShuffledSamples, Source


def write_dataset(root: Path, name: str, tokens: int, seed: int) -> Path:
    tokenizer = root / "tokenizer.json"
    if not tokenizer.exists():
        train_bpe_tokenizer(["benchmark text"] * 4, vocab_size=300).save(str(tokenizer))
    rng = np.random.default_rng(seed)
    with ShardWriter(root / name, tokenizer) as writer:
        written = 0
        while written < tokens:
            doc = rng.integers(3, 259, size=int(rng.integers(200, 4000)), dtype=np.uint16)
            writer.add_document(doc)
            written += doc.size + 1
    return root / name


def throughput(loader: BatchLoader, steps: int) -> float:
    loader.next_step()  # start the workers and fill their queues
    start = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        for inputs, _ in loader.next_step().micro_batches:
            tokens += inputs.numel()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=200_000_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = {n: write_dataset(root, n, args.tokens // 2, s) for s, n in enumerate("ab")}
        datasets = {n: TokenDataset(p, args.seq_len) for n, p in paths.items()}
        single = DataConfig()
        mixed = DataConfig(
            datasets=[DatasetSource(name=n, path=str(p)) for n, p in paths.items()],
            document_mask=True,
        )
        print("| loader | workers | tokens/s | tokens/s per core |")
        print("|---|---|---|---|")
        for label, cfg, names in (("one dataset", single, "a"), ("mixture + mask", mixed, "ab")):
            sources = [
                Source(n, ShuffledSamples(datasets[n], seed=i), datasets[n].eos_id)
                for i, n in enumerate(names)
            ]
            for workers in (0, 2):
                loader = BatchLoader(
                    sources,
                    cfg,
                    seed=0,
                    batch_size=args.batch,
                    grad_accum_steps=1,
                    num_workers=workers,
                    prefetch_steps=4,
                )
                rate = throughput(loader, args.steps)
                cores = max(workers, 1)
                print(
                    f"| {label} | {workers} | {rate / 1e6:,.1f} M | {rate / cores / 1e6:,.1f} M |"
                )


if __name__ == "__main__":
    main()
