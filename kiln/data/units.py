"""Work units: the resolved sources cut into contiguous pieces in document order (a whole .txt
file, byte ranges of a .jsonl file, row groups of a .parquet file, row ranges of a dataset), so
that `kiln prepare --parts N` can give each part a contiguous run of them, and the key each
document's validation-split hash is taken of."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kiln.data import tokenize
from kiln.data.inputs import Input, InputSource

# Target size of a work unit: small enough to balance parts, large enough that each part reads
# long runs of a file.
UNIT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class WorkUnit:
    """Documents of `source` from `start` to `end` (exclusive; None: to the end): bytes of a
    .jsonl file, row groups of a .parquet file, rows of a dataset; a .txt file is one unit."""

    input_index: int  # which Input (as the user named it) the source came from
    source_index: int  # the source's number in the resolved list, a part of its documents' key
    source: InputSource
    start: int
    end: int | None
    weight: int  # about how many bytes of text, to balance parts


def whole_sources(inputs: list[Input], sizes: list[int]) -> list[WorkUnit]:
    """One unit per source: what one process reads."""
    sources = [(i, source) for i, item in enumerate(inputs) for source in item.sources]
    return [
        WorkUnit(i, number, source, 0, None, size)
        for number, ((i, source), size) in enumerate(zip(sources, sizes, strict=True))
    ]


def plan_units(
    inputs: list[Input], sizes: list[int], split: str, unit_bytes: int | None = None
) -> list[WorkUnit]:
    """Every source cut into units of about `unit_bytes` (default UNIT_BYTES), in order."""
    unit_bytes = unit_bytes or UNIT_BYTES
    units: list[WorkUnit] = []
    for whole in whole_sources(inputs, sizes):
        cut = {"jsonl": byte_ranges, "parquet": row_groups, "hf": row_ranges}.get(whole.source.kind)
        units += cut(whole, split, unit_bytes) if cut else [whole]
    return units


def byte_ranges(whole: WorkUnit, split: str, unit_bytes: int) -> list[WorkUnit]:
    """Nominal byte ranges: the reader gives each line to the range its first byte is in."""
    starts = list(range(0, max(whole.weight, 1), unit_bytes))
    ends = [*starts[1:], None]
    return [
        replace(whole, start=start, end=end, weight=(end or whole.weight) - start)
        for start, end in zip(starts, ends, strict=True)
    ]


def row_groups(whole: WorkUnit, split: str, unit_bytes: int) -> list[WorkUnit]:
    """One unit per row group (the unit Parquet is read in), weighed by its uncompressed size."""
    from kiln.data.readers import parquet_file

    metadata = parquet_file(whole.source.location).metadata
    return [
        replace(whole, start=g, end=g + 1, weight=metadata.row_group(g).total_byte_size)
        for g in range(metadata.num_row_groups)
    ]


def row_ranges(whole: WorkUnit, split: str, unit_bytes: int) -> list[WorkUnit]:
    """Runs of rows of about `unit_bytes` of Arrow data each."""
    from kiln.data.hf_datasets import open_hf_dataset

    dataset = open_hf_dataset(whole.source.location, split)
    rows, size = len(dataset), max(int(dataset.data.nbytes), 1)
    step = max(1, rows * unit_bytes // size)
    return [
        replace(whole, start=start, end=min(start + step, rows), weight=size * step // rows)
        for start in range(0, rows, step)
    ]


def part_units(units: list[WorkUnit], part: int, parts: int) -> list[WorkUnit]:
    """Part `part`'s contiguous run of `units`, balanced by weight: a unit goes to the part its
    middle falls in. Neighbouring units of one source are merged, to be read in one go."""
    total = sum(unit.weight for unit in units)
    mine: list[WorkUnit] = []
    done = 0
    for unit in units:
        owner = min(parts - 1, parts * (2 * done + unit.weight) // max(2 * total, 1))
        done += unit.weight
        if owner != part:
            continue
        if mine and mine[-1].source_index == unit.source_index:
            last = mine.pop()
            unit = replace(last, end=unit.end, weight=last.weight + unit.weight)
        mine.append(unit)
    return mine


def document_keys(sources: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The validation-split hash of documents given by (source number, position in the source):
    known to whichever part reads a document, and the same in a one-process run."""
    return splitmix64(splitmix64(sources.astype(np.uint64)) ^ positions.astype(np.uint64))


def splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 numbers: consecutive numbers get unrelated, uniform hashes."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def keyed_batches(
    units: list[WorkUnit], text_key: str, split: str, counts: list[int]
) -> Iterator[tuple[np.ndarray, list[str]]]:
    """(keys, texts) of every non-empty document of `units`, in order, in batches that amortize
    each tokenizer call over many documents. counts[i] += the documents of input i."""
    from kiln.data.readers import read_unit

    sources: list[int] = []
    positions: list[int] = []
    texts: list[str] = []
    size = 0
    for unit in units:
        for position, text in read_unit(unit, text_key, split):
            sources.append(unit.source_index)
            positions.append(position)
            texts.append(text)
            counts[unit.input_index] += 1
            size += len(text)
            if len(texts) >= tokenize.BATCH_DOCUMENTS or size >= tokenize.BATCH_BYTES:
                yield batch_keys(sources, positions), texts
                sources, positions, texts, size = [], [], [], 0
    if texts:
        yield batch_keys(sources, positions), texts


def batch_keys(sources: list[int], positions: list[int]) -> np.ndarray:
    return document_keys(np.array(sources, dtype=np.uint64), np.array(positions, dtype=np.uint64))


def describe_units(units: list[WorkUnit]) -> list[dict[str, Any]]:
    """A part's units as its index records them (for a person reading it)."""
    return [
        {"source": unit.source.location, "start": unit.start, "end": unit.end} for unit in units
    ]
