"""`kiln generate`, `kiln convert` and `kiln average`: using, exporting and averaging trained
checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.cli.common import docs
from kiln.errors import KilnError

# What kiln/model/registry.py's families convert, both ways (tests/unit/test_model_families.py
# checks the list against the registry).
HF_ARCHITECTURES = (
    "Llama, Qwen3, Mixtral, Qwen3-MoE, GptOss, DeepSeek-V3 (Kimi K2), Qwen3-Next, Qwen3.5 "
    "(Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration or their text models)"
)


def add_parsers(subcommand) -> None:
    generate = subcommand(
        "generate",
        help="continue a prompt with a trained checkpoint",
        epilog=docs("quickstart.md"),
    )
    generate.add_argument(
        "checkpoint",
        help="a run directory or a checkpoint directory (their newest step), or a "
        "step_XXXXXXXX folder",
    )
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate after the prompt"
    )
    generate.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 = greedy, the likeliest token each time (a small model "
        "soon repeats itself: try 0.7)",
    )
    generate.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)"
    )
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
    generate.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run the model"
    )
    generate.set_defaults(run=cmd_generate)

    convert = subcommand(
        "convert",
        help=f"convert between Hugging Face ({HF_ARCHITECTURES}) and kiln checkpoints",
        description=f"Convert Hugging Face checkpoints ({HF_ARCHITECTURES}) to kiln "
        "checkpoints and back.",
        epilog=docs("checkpoints.md"),
    )
    direction = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    hf_to_kiln = direction.add_parser(
        "hf-to-kiln",
        help=f"HF safetensors + config.json ({HF_ARCHITECTURES}) -> kiln checkpoint at step 0",
    )
    hf_to_kiln.add_argument("source", help="Hugging Face model directory")
    hf_to_kiln.add_argument("output", help="new kiln checkpoint directory")
    kiln_to_hf = direction.add_parser(
        "kiln-to-hf",
        help="kiln checkpoint -> HF directory, as its model's architecture: Llama (Qwen3 with "
        "qk_norm), Mixtral for MoE (Qwen3-MoE with qk_norm), GptOss with attention sinks, "
        "DeepSeek-V3 for model.family deepseek_v3, Qwen3_5 (dense) or Qwen3Next (MoE) for "
        "qwen3_next",
    )
    kiln_to_hf.add_argument("source", help="kiln checkpoint directory or step folder")
    kiln_to_hf.add_argument("output", help="new Hugging Face model directory")
    kiln_to_hf.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the exported weights (default: the checkpoint's checkpoint.export_dtype, "
        "float32 if it has none)",
    )
    kiln_to_hf.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file, in bytes or with a unit: 5GB (default), 500MB, 2GiB; "
        "a bigger model is split into model-0000i-of-0000N.safetensors plus an index",
    )
    convert.set_defaults(run=cmd_convert)

    average = subcommand(
        "average",
        help="write a checkpoint holding the mean of several checkpoints' weights",
        description="Average the weights of checkpoints of one model (any layout wrote them) "
        "into a new checkpoint without optimizer state: it loads in kiln generate, eval and "
        "convert, and warm-starts a run as checkpoint.load_path.",
        epilog=docs("checkpoints.md"),
    )
    average.add_argument(
        "source", help="a run directory or its checkpoints folder (a path or an s3:// URL)"
    )
    chosen = average.add_mutually_exclusive_group(required=True)
    chosen.add_argument(
        "--last", type=int, metavar="K", help="the newest K intact checkpoints (K >= 2)"
    )
    chosen.add_argument(
        "--steps",
        type=_steps,
        metavar="A,B,...",
        help="the checkpoints of these steps, e.g. 400,450,500",
    )
    average.add_argument(
        "--output",
        default=None,
        help="new checkpoint folder (default: average_<first>-<last> in the checkpoints "
        "folder, which a resume never takes for one of the run's steps)",
    )
    average.set_defaults(run=cmd_average)


def cmd_generate(args) -> int:
    import torch

    from kiln.checkpoint import (
        find_tokenizer,
        load_checkpoint,
        read_model_config,
        resolve_checkpoint,
    )
    from kiln.data.tokenizer import find_eos_id, load_tokenizer
    from kiln.model import build_model, materialize
    from kiln.model.generate import generate
    from kiln.parallel.device import pick_device

    path = resolve_checkpoint(args.checkpoint)
    say_which_step(args.checkpoint, path)
    tokenizer_path = find_tokenizer(path)
    if tokenizer_path is None:
        raise KilnError(
            f"no tokenizer.json in {path} or its parent: copy the tokenizer the model was trained with there"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    device = pick_device(args.device)
    model = materialize(build_model(read_model_config(path)), device=device, seed=None)
    load_checkpoint(path, model=model)
    model.eval()
    prompt_ids = tokenizer.encode(args.prompt).ids
    eos = find_eos_id(tokenizer)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        new = generate(
            model,
            prompt_ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_id=eos,
            seed=args.seed,
        )
    print(args.prompt + tokenizer.decode(new))
    return 0


def say_which_step(given: str, path: Path) -> None:
    """On stderr, the step a run or checkpoint directory resolved to, and every newer one that
    was passed over (damaged, interrupted): the text that follows came from that step."""
    from kiln.checkpoint.layout import resume_candidates
    from kiln.checkpoint.store import location

    skipped, named, target = [], location(given), path
    if isinstance(named, Path):  # a folder may be named by a relative path or a link
        named, target = named.resolve(), Path(path).resolve()
    if named != target:
        _, skipped = resume_candidates(path.parent)
    for passed_over in skipped:
        print(f"kiln generate: {passed_over.message()}", file=sys.stderr)
    step = path.name.removeprefix("step_").lstrip("0") or "0"
    print(f"kiln generate: step {step} from {path}", file=sys.stderr)


def cmd_convert(args) -> int:
    from kiln.checkpoint.hf_convert import hf_to_kiln, kiln_to_hf

    if args.direction == "hf-to-kiln":
        out = hf_to_kiln(args.source, args.output)
    else:
        out = kiln_to_hf(
            args.source, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size
        )
    print(f"wrote {out}")
    return 0


def _steps(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected step numbers separated by commas, e.g. 400,450,500"
        ) from None


def cmd_average(args) -> int:
    from kiln.checkpoint.average import average_checkpoints

    averaged = average_checkpoints(
        args.source, last=args.last, steps=args.steps, output=args.output
    )
    for path in averaged.sources:
        print(f"averaged {path}")
    print(
        f"wrote {averaged.path}: the mean of {len(averaged.sources)} checkpoints' weights, no "
        "optimizer state (start a run from it with checkpoint.load_path)"
    )
    return 0
