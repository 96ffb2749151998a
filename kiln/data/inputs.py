"""What `kiln prepare` reads: inputs as the user names them (files, folders, globs, saved or
cached Hugging Face datasets, URLs) expanded into sources, and what each source is, precisely
enough to tell when it changes."""

from __future__ import annotations

import glob
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

from kiln.data.hf_datasets import HF_PREFIX, open_hf_dataset
from kiln.errors import KilnError
from kiln.remote import change_fields, filesystem, is_url, protocol, reach_error

SUFFIXES = (".txt", ".jsonl", ".parquet")
GLOB_CHARS = "*?["


@dataclass(frozen=True)
class InputSource:
    """One thing documents are read from: a file, or a Hugging Face dataset (a folder written
    by `save_to_disk`, or `hf:NAME[:CONFIG]` in the local cache)."""

    kind: str  # "txt", "jsonl", "parquet" or "hf"
    location: str  # a local path, a URL or hf:NAME[:CONFIG]


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
    if source.location.startswith(HF_PREFIX) or is_url(source.location):
        return source.location
    return str(Path(source.location).resolve())


def expand_input(item: str) -> list[InputSource]:
    if item.startswith(HF_PREFIX):
        return [InputSource("hf", item)]
    if is_url(item):
        return remote_sources(item)
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


def url_suffix(url: str) -> str:
    """ ".jsonl" of "https://host/a/b.jsonl?version=2": the file name's, query left out."""
    return PurePosixPath(urlparse(url).path).suffix


def remote_sources(url: str) -> list[InputSource]:
    """The files a URL names: itself, or for an object store, every input file under a prefix
    or matching a glob, in sorted order."""
    if protocol(url) in ("http", "https"):
        return [remote_file(url)]  # HTTP cannot list folders; describe_sources checks it is there
    fs = filesystem(url)
    try:
        fs.invalidate_cache()  # listings cached by an earlier call would hide a changed object
        if any(char in url for char in GLOB_CHARS):
            found = [fs.unstrip_protocol(path) for path in fs.glob(url)]
            if not found:
                raise FileNotFoundError(f"no object matches {url}")
        elif fs.info(url)["type"] == "directory":
            found = [fs.unstrip_protocol(path) for path in fs.find(url)]
        else:
            return [remote_file(url)]
    except KilnError:
        raise
    except Exception as e:
        raise reach_error(url, e) from None
    files = sorted(found)
    selected = [remote_file(file) for file in files if url_suffix(file) in SUFFIXES]
    if not selected:
        raise KilnError(f"no input files ({', '.join(SUFFIXES)}) found at {url}")
    return selected


def remote_file(url: str) -> InputSource:
    suffix = url_suffix(url)
    if suffix not in SUFFIXES:
        raise KilnError(
            f"unsupported input {url}: use {', '.join(SUFFIXES)} files (a URL is read as a file, "
            "or for an object store, a prefix or glob of such files)"
        )
    return InputSource(suffix[1:], url)


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
        elif is_url(source.location):
            described.append(describe_remote(source.location))
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


def describe_remote(url: str) -> dict[str, Any]:
    """Size and whatever the store reports that changes with the content (ETag, modification
    time, checksum), so that a re-run notices a replaced object."""
    try:
        info = filesystem(url).info(url)
    except Exception as e:
        raise reach_error(url, e) from None
    return {"url": url, "bytes": info["size"], **change_fields(info)}
