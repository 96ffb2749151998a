"""`kiln prepare --part I --parts N`: one input set split over N processes (on one machine or
many, sharing the output's filesystem) that write one dataset, token for token the one a single
process writes.

The sources are cut into work units in document order (units.py); part I tokenizes a contiguous
run of them into OUTPUT/.parts/part-IIIII-of-NNNNN, written in a staging folder and renamed when
complete. The part that finds all N folders there when it finishes assembles the dataset: it
links every part's shards, in part order, into OUTPUT under their final numbers, and writes
index.json last. A killed part leaves only its staging folder, which its re-run removes before
doing the part again; a finished part is not redone.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from kiln.data.inputs import Input
from kiln.data.prepare import (
    VAL_DIR,
    check_inputs_have_documents,
    check_split_sizes,
    choose_val_split,
    is_prepared,
    resolve_and_describe,
    source_sizes,
    write_units,
)
from kiln.data.shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    TOKENIZER_FILE,
    DatasetExistsError,
    ShardWriter,
    check_output_free,
    read_index,
    shard_file_names,
)
from kiln.data.tokenizer import load_tokenizer, tokenizer_hash
from kiln.data.units import describe_units, part_units, plan_units
from kiln.errors import KilnError

PARTS_DIR = ".parts"
PLAN_FILE = "plan.json"
# Created (mkdir is atomic) by the one finisher that assembles, so that two never both do.
ASSEMBLY_CLAIM = "assembling"


def part_name(part: int, parts: int) -> str:
    return f"part-{part:05d}-of-{parts:05d}"


def prepare_part(
    inputs: list[str | Path],
    tokenizer_path: str | Path | None,
    output: Path,
    options: dict[str, Any],
    part: int,
    parts: int,
    num_workers: int | None,
    overwrite: bool,
) -> Path:
    """Write part `part` of `parts` of the dataset at `output`, and assemble the dataset if
    this part is the last to finish; returns `output`."""
    check_part_options(options, part, parts, overwrite)
    load_tokenizer(tokenizer_path)  # a bad tokenizer fails now, not after reading the inputs
    resolved, metadata = resolve_and_describe(inputs, options)
    if is_prepared(output, metadata, tokenizer_path):
        print(
            f"prepare: {output} is already prepared from these inputs and options", file=sys.stderr
        )
        return output
    parts_dir = parts_folder(output)
    plan = {"parts": parts, "tokenizer_sha256": tokenizer_hash(tokenizer_path), **metadata}
    record_plan(parts_dir, plan, [item.argument for item in resolved])
    folder = parts_dir / part_name(part, parts)
    if (folder / INDEX_FILE).is_file():
        print(f"prepare: part {part} of {parts} is already written", file=sys.stderr)
    else:
        workers = (os.cpu_count() or 1) if num_workers is None else num_workers
        write_part(resolved, metadata, Path(tokenizer_path), folder, part, parts, workers)
    return assemble_if_last(output, parts)


def check_part_options(options: dict[str, Any], part: int, parts: int, overwrite: bool) -> None:
    """Refuse what a part cannot do alone, saying what to do instead."""
    if parts < 1 or not 0 <= part < parts:
        raise KilnError(f"--part must be in 0 .. --parts - 1, got --part {part} --parts {parts}")
    if options["train_tokenizer"] is not None:
        raise KilnError(
            "--train-tokenizer runs in one process, on all the documents: train the tokenizer "
            "first (one process: kiln prepare --input ... --train-tokenizer VOCAB_SIZE --output "
            "DIR, or on a sample of the inputs), then pass DIR/tokenizer.json to every part with "
            "--tokenizer"
        )
    if options["val_documents"] is not None:
        raise KilnError(
            "--val-documents N holds out exactly N documents, which takes every document's key "
            "before the first is written: one process reading all the inputs, so it cannot be "
            "exact with --parts > 1. Use --val-fraction F (about F x the documents, chosen the "
            "same way in any number of parts), or run one process"
        )
    if overwrite:
        raise KilnError(
            "--overwrite works with one process only: parts cannot replace a dataset together; "
            "remove the old output (or choose another) and run the parts again"
        )


def parts_folder(output: Path) -> Path:
    """OUTPUT/.parts, created; the output must be new, empty or already a run in parts."""
    parts_dir = output / PARTS_DIR
    if not parts_dir.is_dir():
        try:
            check_output_free(output, overwrite=False)
        except DatasetExistsError:
            raise DatasetExistsError(
                f"output directory {output} already exists and is not empty; choose another "
                "output, or remove it and run the parts again"
            ) from None
    parts_dir.mkdir(parents=True, exist_ok=True)
    return parts_dir


def record_plan(parts_dir: Path, plan: dict[str, Any], arguments: list[str]) -> None:
    """Write what the run is (parts, tokenizer, sources, options) if no part has yet; refuse
    to add a part to the parts of another run."""
    path = parts_dir / PLAN_FILE
    if not path.is_file():
        staging = parts_dir / f".plan-{uuid.uuid4().hex}.json"
        staging.write_text(json.dumps({**plan, "inputs": arguments}, indent=2) + "\n")
        os.replace(staging, path)  # parts that start together write the same plan
    recorded = json.loads(path.read_text())
    differs = plan_differences(recorded, plan)
    if differs:
        raise KilnError(
            f"{parts_dir} holds the parts of another run: {'; '.join(differs)}. Run every part "
            f"with the same inputs, tokenizer, options and --parts, or remove {parts_dir} to "
            "start over"
        )


# The options of a run in parts, by their flags.
_OPTION_FLAGS = {
    "text_key": "--text-key",
    "split": "--split",
    "shard_tokens": "--shard-tokens",
    "train_tokenizer": "--train-tokenizer",
    "val_fraction": "--val-fraction",
    "val_documents": "--val-documents",
}
_THERE = "in the parts already started"


def plan_differences(recorded: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    """What this part was given that differs from the run whose plan is `recorded`, each said
    with both values."""
    found = []
    if recorded.get("parts") != plan["parts"]:
        found.append(f"--parts {plan['parts']} here, {recorded.get('parts')} {_THERE}")
    if recorded.get("tokenizer_sha256") != plan["tokenizer_sha256"]:
        here, there = plan["tokenizer_sha256"], str(recorded.get("tokenizer_sha256"))
        found.append(f"another tokenizer (sha256 {here[:12]} here, {there[:12]} {_THERE})")
    if recorded.get("sources") != plan["sources"]:
        found.append(_input_difference(recorded, plan))
    options, before = plan["prepare"], recorded.get("prepare", {})
    for key in sorted(set(options) | set(before)):
        if options.get(key) != before.get(key):
            flag = _OPTION_FLAGS.get(key, key)
            found.append(
                f"{flag} {_shown(options.get(key))} here, {_shown(before.get(key))} {_THERE}"
            )
    return found


def _input_difference(recorded: dict[str, Any], plan: dict[str, Any]) -> str:
    """Which inputs differ: files only one side reads, or files that changed in between."""
    now = {_source_name(source): source for source in plan["sources"]}
    then = {_source_name(source): source for source in recorded.get("sources", [])}
    said = [
        f"{what}: {', '.join(names)}"
        for what, names in (
            ("only here", [name for name in now if name not in then]),
            (f"only {_THERE}", [name for name in then if name not in now]),
            (
                "changed since the first part read them",
                [n for n in now if n in then and now[n] != then[n]],
            ),
        )
        if names
    ]
    return f"other inputs ({'; '.join(said) or 'the same, in another order'})"


def _source_name(source: dict[str, Any]) -> str:
    return str(source.get("path") or source.get("url") or source.get("dataset") or source)


def _shown(value: Any) -> str:
    return "not given" if value is None else repr(value) if isinstance(value, str) else str(value)


class PartWriter(ShardWriter):
    """A ShardWriter for one part, which unlike a dataset may hold no documents (more parts
    than work units, or none of a part's documents held out)."""

    def _finish(self) -> None:
        if self.num_documents:
            super()._finish()
            return
        shutil.copyfile(self.tokenizer_path, self.staging_dir / TOKENIZER_FILE)
        like = {
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer_sha256": tokenizer_hash(self.tokenizer_path),
        }
        write_index(self.staging_dir, dataset_index(like, [], self.metadata))
        self._publish()


def write_part(
    resolved: list[Input],
    metadata: dict[str, Any],
    tokenizer_path: Path,
    folder: Path,
    part: int,
    parts: int,
    workers: int,
) -> None:
    """Tokenize part `part`'s units into `folder`, all or nothing."""
    options = metadata["prepare"]
    # What a killed run of this part left: never published, so nothing else refers to it.
    for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    all_units = plan_units(resolved, source_sizes(metadata), options["split"])
    units = part_units(all_units, part, parts)
    print(f"prepare: part {part} of {parts}: {len(units)} run(s) of input", file=sys.stderr)
    val = choose_val_split(
        units, options["text_key"], options["split"], options["val_fraction"], None
    )
    part_metadata = {**metadata, "part": part, "parts": parts, "units": describe_units(units)}
    with PartWriter(
        folder, tokenizer_path, shard_tokens=options["shard_tokens"], metadata=part_metadata
    ) as writer:
        counts = write_units(
            units,
            len(resolved),
            writer,
            val,
            options["text_key"],
            options["split"],
            workers,
            val_writer_type=PartWriter,
        )
        writer.metadata["documents_per_input"] = counts


def assemble_if_last(output: Path, parts: int) -> Path:
    """Assemble the dataset if every part is written and no other part is assembling it."""
    parts_dir = output / PARTS_DIR
    if (output / INDEX_FILE).is_file() and not parts_dir.exists():
        print(f"prepare: another part has assembled {output}", file=sys.stderr)
        return output
    missing = missing_parts(parts_dir, parts)
    if missing:
        print(
            f"prepare: {parts - len(missing)} of {parts} parts written; the last part to finish "
            "assembles the dataset",
            file=sys.stderr,
        )
        return output
    try:
        (parts_dir / ASSEMBLY_CLAIM).mkdir()
    except FileExistsError:
        print(
            f"prepare: all {parts} parts are written and another part is assembling {output}; "
            f"if none is (it was killed), run `kiln prepare --output {output} --assemble`",
            file=sys.stderr,
        )
        return output
    return assemble_dataset(output)


def missing_parts(parts_dir: Path, parts: int) -> list[int]:
    return [i for i in range(parts) if not (parts_dir / part_name(i, parts) / INDEX_FILE).is_file()]


def assemble_dataset(output: str | Path) -> Path:
    """Make the dataset at `output` from its N written parts (`kiln prepare --assemble`)."""
    output = Path(output)
    parts_dir = output / PARTS_DIR
    plan_path = parts_dir / PLAN_FILE
    if not plan_path.is_file():
        if (output / INDEX_FILE).is_file():
            print(f"prepare: {output} is already assembled", file=sys.stderr)
            return output
        raise KilnError(
            f"{output} holds no parts to assemble (no {PARTS_DIR}/{PLAN_FILE}); run "
            "`kiln prepare ... --part I --parts N` first"
        )
    plan = json.loads(plan_path.read_text())
    indexes = read_parts(parts_dir, plan)
    counts = [
        sum(column) for column in zip(*(i["documents_per_input"] for i in indexes), strict=True)
    ]
    check_inputs_have_documents(plan["inputs"], counts)
    staging = parts_dir / f".assembly-{uuid.uuid4().hex[:8]}"
    folders = [parts_dir / part_name(i, plan["parts"]) for i in range(plan["parts"])]
    metadata = {"sources": plan["sources"], "prepare": plan["prepare"]}
    if plan["prepare"]["val_fraction"] is not None:
        val_indexes = [read_index(folder / VAL_DIR) for folder in folders]
        val = link_dataset([f / VAL_DIR for f in folders], val_indexes, staging / VAL_DIR, {})
        metadata.update(val=VAL_DIR, num_val_documents=val["num_documents"])
    index = link_dataset(folders, indexes, staging, metadata)
    check_split_sizes(index["num_documents"], metadata.get("num_val_documents"))
    publish_into(staging, output)
    shutil.rmtree(parts_dir, ignore_errors=True)
    print(f"prepare: assembled {output} from {plan['parts']} parts", file=sys.stderr)
    return output


def read_parts(parts_dir: Path, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The index of every part; an error names the parts not written or not of this run."""
    parts = plan["parts"]
    missing = missing_parts(parts_dir, parts)
    if missing:
        listed = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
        raise KilnError(
            f"{len(missing)} of {parts} parts are not written yet ({listed}): run them "
            f"(kiln prepare ... --part I --parts {parts}); the last to finish assembles the dataset"
        )
    indexes = [read_index(parts_dir / part_name(i, parts)) for i in range(parts)]
    for i, index in enumerate(indexes):
        if any(index.get(key) != plan[key] for key in ("sources", "prepare", "tokenizer_sha256")):
            raise KilnError(
                f"part {i} in {parts_dir} was written from other inputs, options or tokenizer "
                f"than {PLAN_FILE} records; remove {parts_dir} and run the parts again"
            )
    return indexes


def link_dataset(
    folders: list[Path], indexes: list[dict[str, Any]], target: Path, metadata: dict[str, Any]
) -> dict[str, Any]:
    """A dataset at `target` of the shards of `folders` in order, renumbered; returns its index."""
    target.mkdir(parents=True, exist_ok=True)  # a val folder may already be in it
    shards: list[dict[str, Any]] = []
    for folder, index in zip(folders, indexes, strict=True):
        for shard in index["shards"]:
            tokens_file, docs_file = shard_file_names(len(shards))
            link_or_copy(folder / shard["file"], target / tokens_file)
            link_or_copy(folder / shard["docs_file"], target / docs_file)
            shards.append({**shard, "file": tokens_file, "docs_file": docs_file})
    shutil.copyfile(folders[0] / TOKENIZER_FILE, target / TOKENIZER_FILE)
    index = dataset_index(indexes[0], shards, metadata)
    write_index(target, index)
    return index


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link (instant, and the part keeps its file, so an interrupted assembly can be
    redone); a copy where the filesystem has no hard links."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def dataset_index(
    like: dict[str, Any], shards: list[dict[str, Any]], metadata: dict[str, Any]
) -> dict[str, Any]:
    """The index.json of a dataset of `shards`, with the token format of index `like`."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        **{key: like[key] for key in ("dtype", "vocab_size", "eos_id", "tokenizer_sha256")},
        "num_tokens": sum(shard["num_tokens"] for shard in shards),
        "num_documents": sum(shard["num_documents"] for shard in shards),
        "shards": shards,
        **metadata,
    }


def write_index(folder: Path, index: dict[str, Any]) -> None:
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def publish_into(staging: Path, output: Path) -> None:
    """Move the assembled files into `output`, index.json last: until it is there, `output` is
    not a dataset, so nothing reads a half-assembled one; an interrupted move is redone whole."""
    for entry in sorted(staging.iterdir(), key=lambda path: path.name == INDEX_FILE):
        target = output / entry.name
        if entry.is_dir():
            shutil.rmtree(target, ignore_errors=True)  # left by an interrupted assembly
            os.rename(entry, target)
        else:
            os.replace(entry, target)
    staging.rmdir()
