"""What `kiln prepare` reads: inputs as the user names them (files, folders, globs, saved or
cached Hugging Face datasets) expanded into sources, and the documents of each source in order."""

from __future__ import annotations

import glob
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.data.hf_datasets import HF_PREFIX, check_text_column, dataset_texts, open_hf_dataset
from kiln.errors import KilnError

SUFFIXES = (".txt", ".jsonl", ".parquet")
GLOB_CHARS = "*?["


@dataclass(frozen=True)
class InputSource:
    """One thing documents are read from: a file, or a Hugging Face dataset (a folder written
    by `save_to_disk`, or `hf:NAME[:CONFIG]` in the local cache)."""

    kind: str  # "txt", "jsonl", "parquet" or "hf"
    location: str


@dataclass(frozen=True)
class Input:
    """One input as the user named it (file, folder, glob, dataset) and what it expands to."""

    argument: str
    sources: tuple[InputSource, ...]


def resolve_inputs(inputs: Iterable[str | Path]) -> list[Input]:
    """Expand each input into the files / datasets it names, in sorted order."""
    resolved = [Input(str(item), tuple(expand_input(str(item)))) for item in inputs]
    if not resolved:
        raise KilnError("no inputs given; pass files, folders, glob patterns or datasets")
    named_by: dict[str, str] = {}
    for item in resolved:
        for source in item.sources:
            identity = source_identity(source)
            if identity in named_by:
                raise KilnError(
                    f"input {source.location} is named twice (by {named_by[identity]} and "
                    f"{item.argument}); name every file once, or its documents would be in the "
                    "dataset twice"
                )
            named_by[identity] = item.argument
    return resolved


def source_identity(source: InputSource) -> str:
    """The same for two names of one file or dataset."""
    if source.location.startswith(HF_PREFIX):
        return source.location
    return str(Path(source.location).resolve())


def expand_input(item: str) -> list[InputSource]:
    if item.startswith(HF_PREFIX):
        return [InputSource("hf", item)]
    if not any(char in item for char in GLOB_CHARS):
        return path_sources(Path(item))
    matches = sorted(glob.glob(item, recursive=True))
    if not matches:
        raise KilnError(
            f"input pattern {item!r} matches nothing; check it (and quote it, so that the "
            "shell passes it to kiln unexpanded)"
        )
    # A pattern selects files and saved datasets; folders it happens to match are skipped.
    sources = [
        source
        for match in map(Path, matches)
        if is_saved_dataset(match) or (match.is_file() and match.suffix in SUFFIXES)
        for source in path_sources(match)
    ]
    if not sources:
        raise KilnError(
            f"input pattern {item!r} matches no {', '.join(SUFFIXES)} files or saved datasets"
        )
    return sources


def path_sources(path: Path) -> list[InputSource]:
    if is_saved_dataset(path):
        return [InputSource("hf", str(path))]
    if path.is_dir():
        found = [p for p in path.rglob("*") if p.is_file()]
        files = sorted(p for p in found if p.suffix in SUFFIXES)
        skipped = skipped_note(path, [p for p in found if p.suffix not in SUFFIXES])
        if not files:
            raise KilnError(f"no input files ({', '.join(SUFFIXES)}) found in {path}{skipped}")
        if skipped:
            print(f"prepare: {path}{skipped}", file=sys.stderr)
        return [InputSource(file.suffix[1:], str(file)) for file in files]
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise KilnError(f"unsupported input file {path}: use {', '.join(SUFFIXES)} files")
        return [InputSource(path.suffix[1:], str(path))]
    raise KilnError(
        f"input not found: {path}; pass existing files, folders, glob patterns or datasets"
    )


def skipped_note(folder: Path, skipped: list[Path]) -> str:
    """'' or how many files of a folder were left out and of which kinds: a folder of .md or .py
    files would otherwise be read as a much smaller corpus without a word."""
    if not skipped:
        return ""
    kinds = Counter(p.suffix or "(no extension)" for p in skipped)
    listed = ", ".join(f"{count} {kind}" for kind, count in kinds.most_common(6))
    more = ", ..." if len(kinds) > 6 else ""
    return (
        f": skipped {len(skipped)} file{'s' if len(skipped) > 1 else ''} of other types "
        f"({listed}{more}); kiln prepare reads {', '.join(SUFFIXES)}"
    )


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def describe_sources(inputs: list[Input], split: str) -> list[dict[str, Any]]:
    """What the dataset is made of, precisely enough to tell when an input has changed."""
    described = []
    for source in (source for item in inputs for source in item.sources):
        if source.kind == "hf":
            dataset = open_hf_dataset(source.location, split)
            # The fingerprint of a saved or cached dataset changes whenever its content does.
            described.append(
                {
                    "dataset": source_identity(source),
                    "split": split,
                    "fingerprint": dataset._fingerprint,
                }
            )
        else:
            stat = Path(source.location).stat()
            described.append(
                {
                    "path": source_identity(source),
                    "bytes": stat.st_size,
                    "mtime_ns": stat.st_mtime_ns,
                }
            )
    return described


def iter_texts(inputs: list[Input], text_key: str, split: str) -> Iterator[str]:
    """Every non-empty document of every input, in order; an input without any is an error."""
    for item in inputs:
        found = False
        for source in item.sources:
            for text in read_source(source, text_key, split):
                found = True
                yield text
        if not found:
            raise KilnError(
                f"input {item.argument} holds no documents (its files or texts are empty); "
                "remove it from the inputs"
            )


def read_source(source: InputSource, text_key: str, split: str) -> Iterator[str]:
    readers = {"txt": read_txt, "jsonl": read_jsonl, "parquet": read_parquet, "hf": read_hf}
    try:
        for text in readers[source.kind](source.location, text_key, split):
            if text:
                yield text
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read input {source.location}: {e}") from None


def read_txt(location: str, text_key: str, split: str) -> Iterator[str]:
    yield Path(location).read_text(encoding="utf-8")


def read_jsonl(location: str, text_key: str, split: str) -> Iterator[str]:
    with open(location, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{location}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise KilnError(f"{where}: invalid JSON ({e})") from None
            if not isinstance(record, dict):
                raise KilnError(f"{where}: expected a JSON object with a {text_key!r} field")
            if text_key not in record:
                raise KilnError(
                    f"{where}: no field {text_key!r} (fields: {', '.join(record)}); "
                    "set text_key (--text-key) to the field that holds the text"
                )
            text = record[text_key]
            if text is not None and not isinstance(text, str):
                raise KilnError(
                    f"{where}: field {text_key!r} is a {type(text).__name__}, not a string; "
                    "set text_key (--text-key) to the field that holds the text"
                )
            yield text or ""


def read_parquet(location: str, text_key: str, split: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise KilnError(
            f"reading {location} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    try:
        parquet = pq.ParquetFile(location)
    except Exception as e:
        raise KilnError(f"cannot read parquet file {location}: {e}") from None
    schema = parquet.schema_arrow
    if text_key not in schema.names:
        raise KilnError(
            f"{location} has no column {text_key!r} (columns: {', '.join(schema.names)}); "
            "set text_key (--text-key) to the column that holds the text"
        )
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise KilnError(
            f"{location}: column {text_key!r} holds {kind}, not text; "
            "set text_key (--text-key) to the column that holds the text"
        )
    for batch in parquet.iter_batches(columns=[text_key]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def read_hf(location: str, text_key: str, split: str) -> Iterator[str]:
    dataset = open_hf_dataset(location, split)
    check_text_column(dataset, text_key, location)
    yield from (text for text in dataset_texts(dataset, text_key) if text is not None)
