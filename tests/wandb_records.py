"""Reads an offline W&B run file (run-<id>.wandb) back, for tests: the LevelDB-style log of
protobuf records wandb writes (a 7-byte header, then 32 KiB blocks of chunks, each with a 7-byte
header: checksum, length, and whether it is a whole record or its first, middle or last part)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32 * 1024
WHOLE, LAST = 1, 4


def read_records(path: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        if left < 7:  # too short for a chunk header: padding
            position += left
            continue
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (WHOLE, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(path: Path) -> dict[int, dict[str, float]]:
    """{step: {name: value}} of every `run.log` in the file (W&B's own keys dropped)."""
    rows = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {
                "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                for item in record.history.item
            }
            rows[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def config(path: Path) -> dict:
    """The run's config as wandb.init received it."""
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run":
            return {item.key: json.loads(item.value_json) for item in record.run.config.update}
    raise AssertionError(f"{path} holds no run record")
