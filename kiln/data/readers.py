"""The documents of one work unit (a source, or a contiguous part of one), each with its
position inside its source: the byte offset of its line in a .jsonl file, its row in a .parquet
file or a dataset, 0 for a .txt file. Local files, URLs and Hugging Face datasets alike."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kiln.data.hf_datasets import check_text_column, dataset_texts, open_hf_dataset
from kiln.data.units import WorkUnit
from kiln.errors import KilnError
from kiln.remote import filesystem, is_url, open_at, open_seekable, reach_error

# Bytes read at a time when splitting a .jsonl file into lines.
READ_CHUNK = 2**22


def read_unit(unit: WorkUnit, text_key: str, split: str) -> Iterator[tuple[int, str]]:
    """(position in the source, text) of every non-empty document of `unit`, in order."""
    readers = {"txt": read_txt, "jsonl": read_jsonl, "parquet": read_parquet, "hf": read_hf}
    location = unit.source.location
    try:
        for position, text in readers[unit.source.kind](unit, text_key, split):
            if text:
                yield position, text
    except KilnError:
        raise
    except UnicodeDecodeError as e:
        raise KilnError(f"cannot read input {location}: {e}") from None
    except Exception as e:
        if is_url(location):
            raise reach_error(location, e) from None
        if isinstance(e, OSError):
            raise KilnError(f"cannot read input {location}: {e}") from None
        raise


def read_txt(unit: WorkUnit, text_key: str, split: str) -> Iterator[tuple[int, str | None]]:
    location = unit.source.location
    if not is_url(location):
        yield 0, Path(location).read_text(encoding="utf-8")
        return
    text = filesystem(location).cat_file(location).decode("utf-8")
    # The newlines a local file read in text mode gets, so that both give the same tokens.
    yield 0, text.replace("\r\n", "\n").replace("\r", "\n")


def open_bytes(location: str, offset: int) -> IO[bytes]:
    """A local file or a URL, opened for reading bytes from `offset`."""
    if is_url(location):
        return open_at(location, offset)
    file = open(location, "rb")  # noqa: SIM115 - the caller closes it
    file.seek(offset)
    return file


def read_jsonl(unit: WorkUnit, text_key: str, split: str) -> Iterator[tuple[int, str | None]]:
    location = unit.source.location
    end = unit.end if unit.end is not None else float("inf")
    with open_bytes(location, max(unit.start - 1, 0)) as file:
        lines = iter_lines(file, unit.start, end)
        for number, (offset, line) in enumerate(lines, start=1):
            if line.strip():
                yield offset, json_text(line, text_key, location, unit.start, number, offset)


def iter_lines(file: IO[bytes], first: int, end: float) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of every line of `file` that starts in [first, end), for `file`
    positioned at first - 1 (or 0): the line holding byte first - 1 belongs to the unit before,
    so units split at any byte still give every line to exactly one of them."""
    position = max(first - 1, 0)
    skip = first > 0
    pending = bytearray()
    while position < end:
        chunk = file.read(READ_CHUNK)
        cut = chunk.rfind(b"\n") + 1
        if chunk and not cut:
            pending += chunk  # a line longer than a chunk
            continue
        complete = bytes(pending) + chunk[:cut] if chunk else bytes(pending)
        pending = bytearray(chunk[cut:])
        lines = complete.split(b"\n")
        if chunk:
            lines.pop()  # the empty string after the last newline
        for line in lines:
            if skip:
                skip = False
            elif position < end:
                yield position, line
            else:
                return
            position += len(line) + 1
        if not chunk:
            return


def json_text(
    line: bytes, text_key: str, location: str, first: int, number: int, offset: int
) -> str | None:
    """The text field of one JSON line; a KilnError names the line if it has none."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise KilnError(f"{where(location, first, number, offset)}: invalid JSON ({e})") from None
    if not isinstance(record, dict):
        raise KilnError(
            f"{where(location, first, number, offset)}: expected a JSON object with a "
            f"{text_key!r} field"
        )
    if text_key not in record:
        raise KilnError(
            f"{where(location, first, number, offset)}: no field {text_key!r} (fields: "
            f"{', '.join(record)}); set text_key (--text-key) to the field that holds the text"
        )
    text = record[text_key]
    if text is not None and not isinstance(text, str):
        raise KilnError(
            f"{where(location, first, number, offset)}: field {text_key!r} is a "
            f"{type(text).__name__}, not a string; set text_key (--text-key) to the field that "
            "holds the text"
        )
    return text


def where(location: str, first: int, number: int, offset: int) -> str:
    """ "file:LINE", or where a unit starting mid-file cannot count lines, the line's byte."""
    return f"{location}:{number}" if first == 0 else f"{location} (line at byte {offset})"


def parquet_file(location: str) -> Any:
    """A pyarrow ParquetFile of a local file or URL; KilnError if pyarrow is missing or the
    file is not Parquet."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise KilnError(
            f"reading {location} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    try:
        return pq.ParquetFile(open_seekable(location) if is_url(location) else location)
    except Exception as e:
        if is_url(location) and not type(e).__module__.startswith("pyarrow"):
            raise reach_error(location, e) from None
        raise KilnError(f"cannot read parquet file {location}: {e}") from None


def check_parquet_column(parquet: Any, text_key: str, location: str) -> None:
    import pyarrow as pa

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


def read_parquet(unit: WorkUnit, text_key: str, split: str) -> Iterator[tuple[int, str | None]]:
    """Rows of row groups unit.start .. unit.end - 1; positions count every row of the file."""
    location = unit.source.location
    parquet = parquet_file(location)
    check_parquet_column(parquet, text_key, location)
    metadata = parquet.metadata
    end = metadata.num_row_groups if unit.end is None else unit.end
    groups = list(range(unit.start, end))
    if not groups:
        return
    row = sum(metadata.row_group(group).num_rows for group in range(unit.start))
    for batch in parquet.iter_batches(row_groups=groups, columns=[text_key]):
        for text in batch.column(0).to_pylist():
            yield row, text
            row += 1


def read_hf(unit: WorkUnit, text_key: str, split: str) -> Iterator[tuple[int, str | None]]:
    """Rows unit.start .. unit.end - 1 of a dataset; positions are row numbers."""
    location = unit.source.location
    dataset = open_hf_dataset(location, split)
    check_text_column(dataset, text_key, location)
    end = len(dataset) if unit.end is None else unit.end
    texts = itertools.islice(dataset_texts(dataset, text_key, start=unit.start), end - unit.start)
    yield from enumerate(texts, start=unit.start)
