"""`kiln prepare`: text, JSONL, Parquet or Hugging Face datasets to token shards."""

from __future__ import annotations

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
        "written by datasets' save_to_disk, or hf:NAME[:CONFIG] from the local Hugging Face cache",
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
    prepare.set_defaults(run=cmd_prepare)


def cmd_prepare(args) -> int:
    from kiln.data.demo_corpus import ensure_demo_corpus
    from kiln.data.prepare import prepare_dataset
    from kiln.data.shards import DEFAULT_SHARD_TOKENS

    tokenizer_given = args.tokenizer is not None or args.train_tokenizer is not None
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
    path = prepare_dataset(
        args.input,
        args.tokenizer,
        args.output,
        text_key=args.text_key,
        split=args.split,
        train_tokenizer=args.train_tokenizer,
        val_fraction=args.val_fraction,
        val_documents=args.val_documents,
        num_workers=args.num_workers,
        overwrite=args.overwrite,
        shard_tokens=DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
    )
    print(f"dataset ready at {path}")
    if args.val_fraction is not None or args.val_documents is not None:
        print(f"validation split at {path / 'val'}")
    return 0
