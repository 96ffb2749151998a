"""Hugging Face `datasets` read locally only: a folder written by `save_to_disk`, or
`hf:NAME[:CONFIG]` already in the local Hugging Face cache. Never the network."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from kiln.errors import KilnError

HF_PREFIX = "hf:"
BATCH_ROWS = 1024


def import_datasets_offline(location: str) -> ModuleType:
    """The `datasets` library, switched to offline mode: the local cache or nothing."""
    # The libraries read these switches at import: set the environment for an import still to
    # come and the module values for one that already happened.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
        import huggingface_hub.constants
    except ImportError:
        raise KilnError(
            f"reading the Hugging Face dataset {location} needs `datasets`: pip install datasets"
        ) from None
    datasets.config.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    # Its "using the cached version" warnings would break up the progress line.
    datasets.logging.set_verbosity_error()
    return datasets


def open_hf_dataset(location: str, split: str) -> Any:
    """One split of a `save_to_disk` folder or of a dataset in the local Hugging Face cache."""
    datasets = import_datasets_offline(location)
    if location.startswith(HF_PREFIX):
        return load_cached_dataset(datasets, location, split)
    try:
        loaded = datasets.load_from_disk(location)
    except Exception as e:
        raise KilnError(f"cannot read the saved dataset {location}: {one_line(e)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise KilnError(
                f"{location} has no split {split!r} (splits: {', '.join(loaded)}); "
                "choose one with split (--split)"
            )
        loaded = loaded[split]
    return loaded


def load_cached_dataset(datasets: ModuleType, location: str, split: str) -> Any:
    name, _, config = location[len(HF_PREFIX) :].partition(":")
    try:
        return datasets.load_dataset(name, config or None, split=split)
    except ConnectionError:
        # Offline, the library reports a dataset missing from the cache as unreachable.
        raise KilnError(
            f"{location}: {name} is not in the local Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}); kiln prepare never downloads: load it once "
            "with `datasets.load_dataset` where there is network (same HF_HOME), or pass a "
            "folder written by save_to_disk"
        ) from None
    except Exception as e:
        raise KilnError(f"cannot load {location} from the local cache: {one_line(e)}") from None


def one_line(error: BaseException) -> str:
    return "; ".join(line for line in str(error).splitlines() if line.strip()) or repr(error)


def check_text_column(dataset: Any, text_key: str, location: str) -> None:
    """Raise unless `dataset` has a string column `text_key`."""
    if text_key not in dataset.column_names:
        raise KilnError(
            f"{location} has no column {text_key!r} (columns: {', '.join(dataset.column_names)}); "
            "set text_key (--text-key) to the column that holds the text"
        )
    kind = getattr(dataset.features[text_key], "dtype", None)
    if kind not in ("string", "large_string"):
        raise KilnError(
            f"{location}: column {text_key!r} holds {dataset.features[text_key]}, not text; "
            "set text_key (--text-key) to the column that holds the text"
        )


def dataset_texts(dataset: Any, text_key: str, *, start: int = 0) -> Iterator[str | None]:
    """The text of every row from row `start` on, in order, read in batches. Arrow datasets are
    memory-mapped, so starting late costs nothing."""
    rows = dataset.select_columns([text_key])
    if start:
        rows = rows.select(range(start, len(rows)))
    for batch in rows.iter(batch_size=BATCH_ROWS):
        yield from batch[text_key]
