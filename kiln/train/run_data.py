"""The data a training run reads, built where missing and opened on every rank."""

from __future__ import annotations

from pathlib import Path

from kiln.config import JobConfig
from kiln.data.dataset import TokenDataset
from kiln.data.loader import Source
from kiln.data.sources import ensure_local_data, open_data
from kiln.parallel.agree import decide_on_main
from kiln.parallel.mesh import ParallelContext


def open_run_data(
    cfg: JobConfig, parallel: ParallelContext
) -> tuple[list[Source], TokenDataset | None]:
    """The training sources and the held-out dataset of this rank's data share. Rank 0 builds
    what is missing first (the demo corpus, tokenized Hugging Face datasets)."""
    cache_dir = Path(cfg.metrics.run_dir) / "data_cache"
    decide_on_main(lambda: ensure_local_data(cfg.data, cache_dir), what="prepare the training data")
    ranks = {"data_rank": parallel.data_rank, "data_ranks": parallel.data_ranks}
    return open_data(cfg, cache_dir=cache_dir, **ranks)
