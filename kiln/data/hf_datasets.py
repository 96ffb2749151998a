"""Hugging Face `datasets`: a folder written by `save_to_disk`, `hf:NAME[:CONFIG]` from the Hub
(downloaded into the local Hugging Face cache when online, read from it when HF_HUB_OFFLINE=1),
or JSONL / Parquet / text files at a URL (http(s)://, s3://, gs://)."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

from kiln.errors import KilnError
from kiln.remote import is_url, reach_error

HF_PREFIX = "hf:"
BATCH_ROWS = 1024


def import_datasets(location: str) -> ModuleType:
    """The `datasets` library, quiet: its "using the cached version" warnings would break up
    the progress line."""
    try:
        import datasets
    except ImportError:
        raise KilnError(
            f"reading the Hugging Face dataset {location} needs `datasets`: pip install datasets"
        ) from None
    datasets.logging.set_verbosity_error()
    return datasets


def hub_offline(datasets: ModuleType) -> bool:
    """Whether the user switched the Hub off (HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1)."""
    import huggingface_hub.constants

    return bool(huggingface_hub.constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE)


def open_hf_dataset(location: str, split: str) -> Any:
    """One split of a `save_to_disk` folder, of `hf:NAME[:CONFIG]` (downloaded into the
    Hugging Face cache when online, read from it offline), or of data files at a URL."""
    datasets = import_datasets(location)
    if location.startswith(HF_PREFIX):
        return load_hub_dataset(datasets, location, split)
    if is_url(location):
        return load_url_files(datasets, location, split)
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


def load_hub_dataset(datasets: ModuleType, location: str, split: str) -> Any:
    """`hf:NAME[:CONFIG]` as an Arrow dataset in the local cache, downloaded first when online.
    Every failure is one message: not on the Hub, not in the cache, no network."""
    name, _, config = location[len(HF_PREFIX) :].partition(":")
    offline = hub_offline(datasets)
    if not offline:
        check_hub_reachable(location)
    try:
        return datasets.load_dataset(name, config or None, split=split)
    except datasets.exceptions.DatasetNotFoundError as e:
        if offline:
            raise _not_cached(datasets, location, name) from None
        raise KilnError(
            f"{location}: there is no dataset {name!r} on the Hugging Face Hub you can read "
            f"({one_line(e)}); check the name, and for a private or gated one log in "
            "(`hf auth login` or HF_TOKEN)"
        ) from None
    except ConnectionError as e:
        if offline:  # offline, the library reports a dataset missing from the cache this way
            raise _not_cached(datasets, location, name) from None
        raise KilnError(
            f"{location}: cannot reach the Hugging Face Hub ({one_line(e)}); check the network "
            "(and HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to read the dataset from the local cache"
        ) from None
    except Exception as e:
        where = "the local cache" if offline else "the Hugging Face Hub"
        raise KilnError(f"cannot load {location} from {where}: {one_line(e)}") from None


def check_hub_reachable(location: str, *, timeout_s: float = 10.0) -> None:
    """One request to the Hub before `datasets` tries: its own retries would keep a machine
    without network waiting for half a minute before saying so. Any HTTP answer will do."""
    import urllib.error
    import urllib.request

    import huggingface_hub.constants

    endpoint = huggingface_hub.constants.ENDPOINT
    try:
        urllib.request.urlopen(f"{endpoint}/api/datasets", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        pass  # the Hub answered
    except (OSError, ValueError) as e:
        raise KilnError(
            f"{location}: cannot reach the Hugging Face Hub at {endpoint} ({one_line(e)}); check "
            "the network (and HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to read the dataset from the "
            "local cache"
        ) from None


def _not_cached(datasets: ModuleType, location: str, name: str) -> KilnError:
    return KilnError(
        f"{location}: {name} is not in the local Hugging Face cache "
        f"({datasets.config.HF_DATASETS_CACHE}) and HF_HUB_OFFLINE is set: load it once where "
        "there is network (same HF_HOME), unset HF_HUB_OFFLINE, or pass a folder written by "
        "save_to_disk"
    )


# The `datasets` builder for data files at a URL, by suffix.
URL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_url_files(datasets: ModuleType, location: str, split: str) -> Any:
    """JSONL, Parquet or text files at a URL (a glob for object stores), downloaded once into
    the `datasets` cache as one split."""
    suffix = "." + location.rsplit(".", 1)[-1].lower() if "." in location else ""
    builder = URL_BUILDERS.get(suffix)
    if builder is None:
        raise KilnError(f"cannot read {location} as a dataset: name .jsonl, .parquet or .txt files")
    try:
        return datasets.load_dataset(builder, data_files={split: location}, split=split)
    except Exception as e:
        raise reach_error(location, e) from None


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
