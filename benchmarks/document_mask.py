"""Cost of document masking in one attention layer: plain causal SDPA against the masked kernels.

One kiln `Attention` layer of a model preset, on a packed batch of documents whose lengths are
drawn uniformly from 1..2·doc_len. Variants: causal SDPA (`is_causal`, what runs without
data.document_mask), SDPA with the dense (batch, 1, seq, seq) document mask, eager flex attention
and compiled flex attention with a block mask. Each is timed forward only and forward+backward
(flex attention has no backward on CPU in torch 2.13). Building the mask, done once per batch
and shared by all layers, is timed on its own.

    python benchmarks/document_mask.py [--preset llama3_125m] [--seq 1024 2048] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.config import ModelConfig
from kiln.model.document_mask import build_document_mask, document_ids
from kiln.model.llama.attention import Attention
from kiln.model.rope import rope_tables

EOS = 0
PRESETS = Path(__file__).resolve().parents[1] / "configs" / "model"


def packed_tokens(batch: int, seq: int, doc_len: int, gen: torch.Generator) -> torch.Tensor:
    tokens = torch.randint(1, 1000, (batch, seq), generator=gen)
    for row in tokens:
        end = int(torch.randint(1, 2 * doc_len + 1, (), generator=gen))
        while end <= seq:
            row[end - 1] = EOS
            end += int(torch.randint(1, 2 * doc_len + 1, (), generator=gen))
    return tokens


def interleaved_medians(
    fns: dict[str, Callable[[], None]], device: torch.device, warmup: int, repeats: int
) -> dict[str, float]:
    """Median ms of each function, timed round-robin so that drifting machine load (a shared
    2-core box) hits every variant alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_seq(cfg: ModelConfig, args: argparse.Namespace, seq: int) -> dict[str, float]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = Attention(cfg).to(device=device, dtype=dtype)
    cos, sin = rope_tables(cfg.resolved_head_dim, seq, cfg.rope_theta, device)
    gen = torch.Generator().manual_seed(0)
    ids = document_ids(packed_tokens(args.batch, seq, args.doc_len, gen), EOS).to(device)
    x = torch.randn(args.batch, seq, cfg.dim, generator=gen).to(device=device, dtype=dtype)
    x.requires_grad_()  # as inside a model: the layer's input needs its gradient too
    masks = {
        "causal SDPA (no document mask)": None,
        "SDPA + dense document mask": build_document_mask(ids, "sdpa"),
        # Eager on CPU; on CUDA masked_attention runs the compiled kernel.
        "flex attention": build_document_mask(ids, "flex"),
    }
    fns = {}
    for name, mask in masks.items():
        fns[f"{name} | forward"] = lambda m=mask: _forward(layer, x, cos, sin, m)
        # torch 2.13 has no flex attention backward on CPU.
        if not (name.startswith("flex") and device.type == "cpu"):
            fns[f"{name} | forward+backward"] = lambda m=mask: _forward_backward(
                layer, x, cos, sin, m
            )
    if device.type == "cpu" and args.compiled_flex:
        compiled = torch.compile(layer)
        fns["flex attention, compiled | forward"] = lambda m=masks["flex attention"]: _forward(
            compiled, x, cos, sin, m
        )
    for kernel in ("sdpa", "flex"):
        fns[f"build the {kernel} mask, once per batch | -"] = lambda k=kernel: build_document_mask(
            ids, k
        )
    return interleaved_medians(fns, device, args.warmup, args.repeats)


def _forward(layer, x, cos, sin, mask) -> None:
    with torch.no_grad():
        layer(x, cos, sin, mask=mask)


def _forward_backward(layer, x, cos, sin, mask) -> None:
    layer(x, cos, sin, mask=mask).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="llama3_125m")
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--doc-len", type=int, default=256, help="mean document length")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--compiled-flex", action="store_true", help="on CPU, also time compiled flex (forward)"
    )
    args = parser.parse_args()
    cfg = ModelConfig(**tomllib.loads((PRESETS / f"{args.preset}.toml").read_text()))
    # Eager flex warns that it is unfused; measuring that is the point here.
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    print(f"{args.preset} attention layer, batch {args.batch}, mean document {args.doc_len}")
    print("| seq | variant | pass | median (ms) |")
    print("|---|---|---|---|")
    for seq in args.seq:
        for name, ms in bench_seq(cfg, args, seq).items():
            print(f"| {seq} | {name} | {ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
