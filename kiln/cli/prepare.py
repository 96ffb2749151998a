"""`kiln prepare`: text, JSONL, Parquet or Hugging Face datasets to token shards."""

from __future__ import annotations

import os
import sys

from kiln.cli.common import docs
from kiln.errors import KilnError


def add_parsers(subcommand) -> None:
    prepare = subcommand(
        "prepare",
        help="tokenize text/JSONL/Parquet/Hugging Face datasets into memory-mapped token shards",
        epilog=docs("data.md"),
    )
    prepare.add_argument(
        "--demo",
        action="store_true",
        help="build the built-in corpus (Python standard library source)",
    )
    prepare.add_argument(
        "--input",
        nargs="+",
        help="input files, folders, glob patterns (quoted, e.g. 'data/**/*.jsonl'), folders "
        "written by datasets' save_to_disk, hf:NAME[:CONFIG] from the local Hugging Face cache, "
        "or URLs: a file at https://, http://, s3:// or gs://, an object-store prefix "
        "(s3://bucket/crawl/) or glob ('s3://bucket/2026-*/*.jsonl'); .txt, .jsonl and .parquet",
    )
    tokenizer = prepare.add_mutually_exclusive_group()
    tokenizer.add_argument("--tokenizer", help="path to a Hugging Face tokenizer.json")
    tokenizer.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB_SIZE",
        help="train a byte-level BPE tokenizer of this vocabulary size on the inputs",
    )
    prepare.add_argument(
        "--output", help="output dataset directory (default data/demo with --demo)"
    )
    prepare.add_argument(
        "--text-key",
        default="text",
        help="JSONL field / Parquet or dataset column holding the text (default: text)",
    )
    prepare.add_argument(
        "--split", default="train", help="split of a Hugging Face dataset input (default: train)"
    )
    val = prepare.add_mutually_exclusive_group()
    val.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help="hold out this fraction of the documents as a validation split in OUTPUT/val",
    )
    val.add_argument(
        "--val-documents",
        type=int,
        metavar="N",
        help="hold out exactly N documents as a validation split in OUTPUT/val",
    )
    prepare.add_argument(
        "--num-workers",
        type=int,
        help="tokenizer processes (default: one per CPU; 0: tokenize in the main process)",
    )
    prepare.add_argument(
        "--shard-tokens", type=int, help="tokens per shard file (default: 67108864 = 64Mi)"
    )
    prepare.add_argument(
        "--overwrite", action="store_true", help="replace an existing output directory"
    )
    prepare.add_argument(
        "--part",
        type=int,
        metavar="I",
        help="this process's part, 0 .. N - 1, of a run split over --parts N processes "
        "(default: RANK under torchrun, the task's place in a SLURM array)",
    )
    prepare.add_argument(
        "--parts",
        type=int,
        metavar="N",
        help="split the run over N processes writing one dataset, identical to one process's "
        "(default: WORLD_SIZE under torchrun, SLURM_ARRAY_TASK_COUNT in a SLURM array, else 1)",
    )
    prepare.add_argument(
        "--assemble",
        action="store_true",
        help="assemble OUTPUT from its written parts (needed only if the last part was killed "
        "while assembling)",
    )
    prepare.set_defaults(run=cmd_prepare)


def part_and_parts(part: int | None, parts: int | None) -> tuple[int, int, str]:
    """(part, parts, where they came from): the flags, else torchrun's RANK / WORLD_SIZE, else
    a SLURM array's task id (counted from its first) and task count, else one process."""
    env = os.environ
    if parts is not None:
        if part is None and parts > 1:
            raise KilnError(f"--parts {parts} needs --part I (0 .. {parts - 1}) for this process")
        return part or 0, parts, "--part/--parts"
    if part is not None:
        raise KilnError("--part needs --parts N, the number of parts")
    if "WORLD_SIZE" in env and "RANK" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), "RANK/WORLD_SIZE"
    if "SLURM_ARRAY_TASK_COUNT" in env and "SLURM_ARRAY_TASK_ID" in env:
        first = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        return (
            int(env["SLURM_ARRAY_TASK_ID"]) - first,
            int(env["SLURM_ARRAY_TASK_COUNT"]),
            "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT",
        )
    return 0, 1, "one process"


def default_workers(parts: int) -> int | None:
    """Tokenizer processes per part: torchrun's processes on one machine share its CPUs."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if parts > 1 else 1
    return max(1, (os.cpu_count() or 1) // local) if local > 1 else None


def cmd_prepare(args) -> int:
    from kiln.data.demo_corpus import ensure_demo_corpus
    from kiln.data.prepare import prepare_dataset
    from kiln.data.shards import DEFAULT_SHARD_TOKENS

    tokenizer_given = args.tokenizer is not None or args.train_tokenizer is not None
    if args.assemble:
        return cmd_assemble(args)
    if args.demo:
        if args.input or tokenizer_given:
            raise KilnError(
                "--demo builds the built-in corpus with its own tokenizer; "
                "drop --input/--tokenizer/--train-tokenizer"
            )
        path = ensure_demo_corpus(args.output or "data/demo")
        print(f"built-in corpus ready at {path}")
        return 0
    missing = [
        flag
        for flag, value in (
            ("--input", args.input),
            ("--tokenizer or --train-tokenizer", tokenizer_given),
            ("--output", args.output),
        )
        if not value
    ]
    if missing:
        raise KilnError(
            f"kiln prepare needs {', '.join(missing)} (or --demo for the built-in corpus)"
        )
    part, parts, origin = part_and_parts(args.part, args.parts)
    if parts > 1:
        print(f"prepare: part {part} of {parts} (from {origin})", file=sys.stderr)
    workers = args.num_workers if args.num_workers is not None else default_workers(parts)
    path = prepare_dataset(
        args.input,
        args.tokenizer,
        args.output,
        text_key=args.text_key,
        split=args.split,
        train_tokenizer=args.train_tokenizer,
        val_fraction=args.val_fraction,
        val_documents=args.val_documents,
        num_workers=workers,
        overwrite=args.overwrite,
        shard_tokens=DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
        part=part,
        parts=parts,
    )
    if not (path / "index.json").is_file():
        print(f"part {part} of {parts} written; the last part to finish assembles {path}")
        return 0
    print(f"dataset ready at {path}")
    if args.val_fraction is not None or args.val_documents is not None:
        print(f"validation split at {path / 'val'}")
    return 0


def cmd_assemble(args) -> int:
    from kiln.data.prepare_parts import assemble_dataset

    if not args.output:
        raise KilnError("kiln prepare --assemble needs --output, the folder the parts wrote to")
    path = assemble_dataset(args.output)
    print(f"dataset ready at {path}")
    return 0
