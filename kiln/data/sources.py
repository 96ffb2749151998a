"""Open the training data a [data] section names: one dataset or a mixture, each checked against
the model and the configured tokenizer before training starts."""

from __future__ import annotations

from pathlib import Path

from kiln.config.sections import DataConfig, DatasetSource, JobConfig
from kiln.data.dataset import TokenDataset
from kiln.data.demo_corpus import ensure_demo_corpus
from kiln.data.loader import ShuffledSamples, Source
from kiln.data.remote_shards import remote_dataset_exists
from kiln.data.tokenizer import tokenizer_hash
from kiln.errors import ConfigError
from kiln.remote import is_url, join


def dataset_entries(cfg: DataConfig) -> list[DatasetSource]:
    """The mixture's entries; a plain [data] section is a mixture of one named "data"."""
    if cfg.datasets:
        return cfg.datasets
    return [
        DatasetSource(
            name="data",
            source=cfg.source,
            path=cfg.path,
            text_key=cfg.text_key,
            split=cfg.split,
            streaming=cfg.streaming,
        )
    ]


def open_data(
    cfg: JobConfig, *, cache_dir: Path, data_rank: int = 0, data_ranks: int = 1
) -> tuple[list[Source], TokenDataset | None]:
    """The training sources and, when [eval] is on, the held-out dataset, each checked against
    the model's vocabulary and the training tokenizer. Nothing is built: a missing dataset is an
    error here (see `ensure_local_data` for what is built on first use)."""
    sources = open_training_data(
        cfg.data,
        seq_len=cfg.train.seq_len,
        model_vocab_size=cfg.model.vocab_size,
        seed=cfg.train.seed,
        cache_dir=cache_dir,
        data_rank=data_rank,
        data_ranks=data_ranks,
    )
    eval_data = None
    if cfg.eval.interval:
        eval_data = open_eval_data(
            cfg.eval.path,
            cfg.data,
            seq_len=cfg.train.seq_len,
            model_vocab_size=cfg.model.vocab_size,
            tokenizer_path=training_tokenizer(cfg.data, sources),
        )
    return sources, eval_data


def open_training_data(
    cfg: DataConfig,
    *,
    seq_len: int,
    model_vocab_size: int,
    seed: int,
    cache_dir: Path,
    data_rank: int = 0,
    data_ranks: int = 1,
) -> list[Source]:
    """Every dataset of the mixture, ready to sample. `cache_dir` holds Hugging Face datasets
    tokenized at start-up (built by the main rank first, see `ensure_local_data`); a streaming
    source reads data rank `data_rank`'s share of `data_ranks`."""
    if cfg.tokenizer and not Path(cfg.tokenizer).is_file():
        raise ConfigError(
            f"data.tokenizer: {cfg.tokenizer} not found; point it at a tokenizer.json or leave it empty"
        )
    configured = tokenizer_hash(cfg.tokenizer) if cfg.tokenizer else None
    sources, hashes = [], {}
    for index, entry in enumerate(dataset_entries(cfg)):
        if entry.source == "hf" and entry.streaming:
            from kiln.data.hf_source import StreamingSamples

            samples = StreamingSamples(
                entry,
                tokenizer_path=cfg.tokenizer,
                seq_len=seq_len,
                data_rank=data_rank,
                data_ranks=data_ranks,
            )
            _check_vocab(samples.vocab_size, model_vocab_size, where=cfg.tokenizer)
            sources.append(Source(entry.name, samples, samples.eos_id))
            hashes[entry.name] = (configured, cfg.tokenizer)
            continue
        dataset = TokenDataset(_prepared_path(entry, cfg, cache_dir), seq_len)
        _check_vocab(dataset.vocab_size, model_vocab_size, where=dataset.path)
        digest = tokenizer_hash(dataset.tokenizer_path)
        if configured is not None and digest != configured:
            raise ConfigError(
                f"data.tokenizer {cfg.tokenizer} is not the tokenizer {dataset.path} was prepared "
                "with; re-run `kiln prepare` with it or leave data.tokenizer empty"
            )
        hashes[entry.name] = (digest, dataset.path)
        samples = ShuffledSamples(dataset, seed=seed + 1000 * index)
        sources.append(Source(entry.name, samples, dataset.eos_id))
    if len({digest for digest, _ in hashes.values()}) > 1:
        listing = "; ".join(f"{name}: {where}" for name, (_, where) in hashes.items())
        raise ConfigError(
            f"the datasets of data.datasets were tokenized with different tokenizers ({listing}); "
            "prepare them all with one tokenizer"
        )
    return sources


def open_eval_data(
    path: str,
    data: DataConfig,
    *,
    seq_len: int,
    model_vocab_size: int,
    tokenizer_path: Path | None,
) -> TokenDataset:
    """The held-out dataset [eval] reads: `path` (eval.path), else the validation split
    `kiln prepare` wrote next to a single prepared dataset. It must be tokenized like the
    training data (`tokenizer_path`), or its loss would mean nothing."""
    entries = dataset_entries(data)
    val = _val_split(entries[0]) if len(entries) == 1 else None
    if path:
        dataset = TokenDataset(path, seq_len)
    elif val is not None:
        dataset = TokenDataset(val, seq_len)
    else:
        raise ConfigError(
            "eval.interval is set but there is no held-out data: set eval.path to a prepared "
            "dataset, or prepare the training data with --val-fraction"
        )
    _check_vocab(dataset.vocab_size, model_vocab_size, where=dataset.path)
    if tokenizer_path is not None and tokenizer_hash(dataset.tokenizer_path) != tokenizer_hash(
        tokenizer_path
    ):
        raise ConfigError(
            f"eval data {dataset.path} was tokenized with another tokenizer than the training "
            f"data ({tokenizer_path}); prepare it with that tokenizer"
        )
    return dataset


def training_tokenizer(cfg: DataConfig, sources: list[Source]) -> Path | None:
    """The tokenizer of the training data: data.tokenizer, else the one the (first) prepared
    dataset was made with; all datasets of a mixture share it (checked on opening)."""
    if cfg.tokenizer:
        return Path(cfg.tokenizer)
    dataset = getattr(sources[0].samples, "dataset", None)
    return dataset.tokenizer_path if dataset is not None else None


def ensure_local_data(cfg: DataConfig, cache_dir: Path) -> None:
    """Build what training reads and is missing: the built-in corpus, Hugging Face datasets
    downloaded into their cache and (eager ones) tokenized into `cache_dir`. Run by one rank
    while the others wait."""
    for entry in dataset_entries(cfg):
        if entry.source == "demo":
            ensure_demo_corpus(Path(entry.path))
        elif entry.source == "hf" and not entry.streaming:
            from kiln.data.hf_source import prepare_hf_cache

            prepare_hf_cache(entry, tokenizer_path=cfg.tokenizer, cache_dir=cache_dir)
        elif entry.source == "hf":
            from kiln.data.hf_datasets import open_hf_dataset

            # A Hub dataset or files at a URL are downloaded once, here, before every rank
            # opens them from the cache.
            open_hf_dataset(entry.path, entry.split)


def _prepared_path(entry: DatasetSource, cfg: DataConfig, cache_dir: Path) -> Path | str:
    if entry.source == "hf":
        from kiln.data.hf_source import hf_cache_path

        return hf_cache_path(entry, tokenizer_path=cfg.tokenizer, cache_dir=cache_dir)
    # A URL stays a string: Path("s3://b/x") would fold the "//" into "s3:/b/x".
    return entry.path if is_url(entry.path) else Path(entry.path)


def _val_split(entry: DatasetSource) -> Path | str | None:
    return validation_split(entry.path) if entry.source in ("prepared", "demo") else None


def validation_split(path: str) -> Path | str | None:
    """The validation split `kiln prepare` wrote beside the prepared dataset at `path` (a
    folder or a URL), if there is one."""
    if is_url(path):
        val = join(path, "val")
        return val if remote_dataset_exists(val) else None
    local = Path(path) / "val"
    return local if local.is_dir() else None


def _check_vocab(vocab_size: int, model_vocab_size: int, *, where: str | Path) -> None:
    if vocab_size > model_vocab_size:
        raise ConfigError(
            f"model.vocab_size ({model_vocab_size}) is smaller than the vocabulary of the "
            f"tokenizer of {where} ({vocab_size}): set model.vocab_size >= {vocab_size}"
        )
