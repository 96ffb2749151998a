"""Step time of kiln's Mixture-of-Experts model against a dense model with the same active
parameters, and what inside the MoE costs it.

A step is forward, token cross entropy, backward, AdamW (foreach on CPU, fused on CUDA) and, for
the MoE, the expert-bias update when it is on; forward+backward and the optimizer are also timed
apart. Three comparisons per model size, each timed in one run, the variants alternating in
blocks of --steps steps, --repeats times, so that drift in machine load hits them alike; the
figure is the median block:

- MoE / dense: the MoE as configured (Switch load-balance loss and router z-loss) against a
  dense model whose SwiGLU is as wide as the MoE block's active weights (router, top-k experts,
  shared experts): the same active parameters and FLOPs per token. The optimizer's share of a
  step shrinks with the tokens per step: the ratio at larger batches is derived from the two
  parts (and --batch-scales measures it);
- grouped_mm / per-expert loop: `GroupedExperts.use_grouped_mm`;
- balancing: every balancing loss and the bias update off, against all on (Switch aux loss,
  z-loss, sequence-wise aux loss, aux-loss-free bias updates).

--profile prints where the MoE step's extra time goes: torch.profiler's self time per op of
the MoE and the dense step, the ops that differ most first.

    OMP_NUM_THREADS=2 python benchmarks/moe.py [--sizes debug 100m] [--profile]
    python benchmarks/moe.py --device cuda --sizes 100m 1b --tokens 8192   # bf16 autocast
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F

from kiln.config import ModelConfig, MoEConfig
from kiln.model import build_model, count_params, materialize
from kiln.model.feed_forward import FeedForward
from kiln.model.moe import (
    GroupedExperts,
    LocalDispatcher,
    MoEFeedForward,
    Router,
    update_expert_biases,
)

# debug: the debug_moe preset (configs/model/debug_moe.toml). 100m: 103M parameters, 37M active.
# 1b: for a GPU only.
SIZES = {
    "debug": ModelConfig(
        dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384, vocab_size=4096,
        moe=MoEConfig(
            num_experts=8, top_k=2, first_dense_layers=1, ffn_hidden_dim=128, shared_experts=1
        ),
    ),
    "100m": ModelConfig(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden_dim=1792, vocab_size=4096,
        moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_dim=896),
    ),
    "1b": ModelConfig(
        dim=1024, n_layers=16, n_heads=16, n_kv_heads=4, ffn_hidden_dim=3584, vocab_size=32768,
        moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_dim=1792),
    ),
}  # fmt: skip
# Sequences x tokens per step on each size (CPU defaults; --tokens changes the total).
SHAPES = {"debug": (4, 128), "100m": (2, 256), "1b": (4, 2048)}
# Balancing keys of [model.moe].
USUAL = {"aux_loss_weight": 0.01, "router_z_loss_weight": 0.001}
ALL_ON = {**USUAL, "seq_aux_loss_weight": 0.001, "bias_update_rate": 0.001}
ALL_OFF = dict.fromkeys(ALL_ON, 0.0)
COMPARISONS = ("dense", "kernels", "balancing")


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    """A dense model whose feed-forward has the weights one token uses in `cfg`'s MoE block."""
    active = cfg.dim * cfg.moe.num_experts + (cfg.moe.top_k + cfg.moe.shared_experts) * (
        3 * cfg.dim * cfg.expert_hidden_dim
    )
    width = round(active / (3 * cfg.dim))
    dense = replace(cfg.moe, num_experts=0, shared_experts=0, **ALL_OFF)
    return replace(cfg, ffn_hidden_dim=width, moe=dense)


def with_moe(cfg: ModelConfig, **keys) -> ModelConfig:
    """`cfg` with these [model.moe] keys changed."""
    return replace(cfg, moe=replace(cfg.moe, **keys))


class Runner:
    """One model, its optimizer and a fixed batch; `step()` trains on it once."""

    def __init__(self, cfg: ModelConfig, shape: tuple[int, int], device: torch.device):
        self.cfg, self.device = cfg, device
        self.model = materialize(build_model(cfg), device=device, seed=0)
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, foreach=not fused, fused=fused
        )
        gen = torch.Generator().manual_seed(0)
        batch, seq = shape
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        self.inputs, self.labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        self.times: dict[str, list[float]] = {"step": [], "fwd+bwd": [], "optimizer": []}

    def step(self) -> tuple[float, float]:
        start = _now(self.device)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(self.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.labels.flatten())
        loss.backward()
        middle = _now(self.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.cfg.moe.num_experts:  # rate 0 only restarts the expert load counts
            update_expert_biases(self.model, self.cfg.moe.bias_update_rate)
        end = _now(self.device)
        return middle - start, end - middle

    def block(self, steps: int) -> None:
        """Time `steps` steps; record the mean of each part."""
        parts = [self.step() for _ in range(steps)]
        fwd_bwd = sum(p[0] for p in parts) / steps
        optim = sum(p[1] for p in parts) / steps
        self.times["fwd+bwd"].append(fwd_bwd)
        self.times["optimizer"].append(optim)
        self.times["step"].append(fwd_bwd + optim)

    def median_ms(self, part: str = "step") -> float:
        return 1e3 * statistics.median(self.times[part])


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def use_grouped_mm(runner: Runner, on: bool) -> Runner:
    for module in runner.model.modules():
        if isinstance(module, GroupedExperts):
            module.use_grouped_mm = on
    return runner


def alternate(runners: dict[str, Runner], steps: int, warmup: int, repeats: int) -> None:
    for runner in runners.values():
        for _ in range(warmup):
            runner.step()
    for _ in range(repeats):
        for runner in runners.values():
            runner.block(steps)


def table(title: str, runners: dict[str, Runner], tokens: int) -> None:
    print(f"\n{title}")
    print(
        "| variant | active / total params | step (ms) | min step (ms) | fwd+bwd (ms) | "
        "optimizer (ms) | tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in runners.items():
        counts = count_params(r.cfg)
        ms = r.median_ms()
        print(
            f"| {name} | {counts.active / 1e6:.2f}M / {counts.total / 1e6:.2f}M | {ms:.1f} | "
            f"{1e3 * min(r.times['step']):.1f} | {r.median_ms('fwd+bwd'):.1f} | {r.median_ms('optimizer'):.1f} | "
            f"{tokens / ms * 1e3:,.0f} |"
        )
    first, second = list(runners)[:2]
    for part in ("step", "fwd+bwd", "optimizer"):
        ratio = runners[first].median_ms(part) / runners[second].median_ms(part)
        print(f"{first} / {second}, {part}: {ratio:.3f}x")


def extrapolate(pair: dict[str, Runner], tokens: int) -> None:
    """The step ratio at larger batches, from this one's medians: forward+backward grows with
    the tokens, the optimizer step does not (derived, not measured)."""
    moe, dense = pair["moe"], pair["dense"]
    for scale in (4, 16, 64):
        ratio = (scale * moe.median_ms("fwd+bwd") + moe.median_ms("optimizer")) / (
            scale * dense.median_ms("fwd+bwd") + dense.median_ms("optimizer")
        )
        print(f"derived for {scale * tokens} tokens per step: moe / dense, step: {ratio:.3f}x")


# Pieces of the step timed under profiler labels of their own (their forward: backward runs in
# autograd nodes, which the profile reports by node).
PARTS = {
    "moe: router": (Router, "forward"),
    "moe: dispatch": (LocalDispatcher, "dispatch"),
    "moe: experts": (GroupedExperts, "forward"),
    "moe: combine": (LocalDispatcher, "combine"),
    "moe: balancing losses": (MoEFeedForward, "_aux_loss"),
    "moe: whole feed-forward": (MoEFeedForward, "forward"),
    "dense SwiGLU (and shared experts)": (FeedForward, "forward"),
}
BACKWARD = "autograd::engine::evaluate_function: "


@contextlib.contextmanager
def labelled_parts() -> Iterator[None]:
    originals = [(cls, name, getattr(cls, name)) for cls, name in PARTS.values()]
    for label, (cls, name, original) in zip(PARTS, originals, strict=True):

        def labelled(*args, _original=original, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _original(*args, **kwargs)

        setattr(cls, name, labelled)
    try:
        yield
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)


def profile_times(runner: Runner, steps: int) -> dict[str, dict[str, float]]:
    """ms per step over `steps` profiled steps (after one unprofiled): "self" time of each op,
    "total" (children included) of each labelled part and each backward node."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    runner.step()
    with labelled_parts(), profile(activities=activities) as prof:
        for _ in range(steps):
            runner.step()
    out: dict[str, dict[str, float]] = {"self": {}, "total": {}}
    for e in prof.key_averages():
        own = e.self_device_time_total if cuda else e.self_cpu_time_total
        total = e.device_time_total if cuda else e.cpu_time_total
        out["self"][e.key] = own / 1e3 / steps
        if e.key in PARTS or e.key.startswith(BACKWARD):
            out["total"][e.key.removeprefix(BACKWARD)] = total / 1e3 / steps
    return out


def profile_pair(moe: Runner, dense: Runner, steps: int = 3, top: int = 12) -> None:
    """Where the MoE step's extra time goes: the MoE pieces' forward, the backward nodes and the
    ops, MoE against dense, the largest differences first."""
    a, b = profile_times(moe, steps), profile_times(dense, steps)
    print(f"\nprofile: ms per step, mean of {steps} profiled steps")
    parts = [label for label in PARTS if label in a["total"] or label in b["total"]]
    nodes = [k for k in a["total"] | b["total"] if k not in PARTS]
    for title, kind, keys in (
        ("forward of the labelled pieces (children included)", "total", parts),
        ("backward by autograd node (children included)", "total", nodes),
        ("ops (self time)", "self", list(a["self"] | b["self"])),
    ):
        moe_ms, dense_ms = a[kind], b[kind]
        if keys is not parts:
            keys = sorted(keys, key=lambda k: -abs(moe_ms.get(k, 0) - dense_ms.get(k, 0)))[:top]
        print(f"\n{title}")
        print("| | MoE | dense | MoE - dense |")
        print("|---|---|---|---|")
        for key in keys:
            x, y = moe_ms.get(key, 0.0), dense_ms.get(key, 0.0)
            print(f"| {key} | {x:.2f} | {y:.2f} | {x - y:+.2f} |")
    x, y = sum(a["self"].values()), sum(b["self"].values())
    print(f"| all ops | {x:.2f} | {y:.2f} | {x - y:+.2f} |")


def run_size(name: str, args, device: torch.device) -> None:
    moe = with_moe(SIZES[name], **USUAL)
    batch, seq = SHAPES[name]
    if args.tokens:
        batch = max(1, args.tokens // seq)
    tokens = batch * seq
    print(f"\n## {name}: {batch} x {seq} = {tokens} tokens per step")
    timing = (args.steps, args.warmup, args.repeats)

    if "dense" in args.compare:
        # Larger batches too: the optimizer's cost per step (every expert's weights) does not
        # grow with the tokens, the rest does.
        for scale in args.batch_scales:
            shape = (batch * scale, seq)
            pair = {
                "moe": Runner(moe, shape, device),
                "dense": Runner(dense_twin(moe), shape, device),
            }
            steps = max(1, args.steps // scale)
            alternate(pair, steps, args.warmup if scale == 1 else 1, args.repeats)
            title = f"MoE against dense with the same active parameters, {tokens * scale} tokens"
            table(title, pair, tokens * scale)
            extrapolate(pair, tokens * scale)
            if args.profile and scale == 1:
                profile_pair(pair["moe"], pair["dense"])
    if "kernels" in args.compare:
        kernels = {
            "grouped_mm": use_grouped_mm(Runner(moe, (batch, seq), device), True),
            "loop": use_grouped_mm(Runner(moe, (batch, seq), device), False),
        }
        alternate(kernels, *timing)
        table("grouped_mm against the per-expert loop (MoE)", kernels, tokens)
    if "balancing" in args.compare:
        balancing = {
            "all on": Runner(with_moe(moe, **ALL_ON), (batch, seq), device),
            "all off": Runner(with_moe(moe, **ALL_OFF), (batch, seq), device),
        }
        alternate(balancing, *timing)
        table("balancing: aux + z + sequence aux + bias update, against none", balancing, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sizes", nargs="+", default=["debug", "100m"], choices=list(SIZES))
    parser.add_argument("--tokens", type=int, default=0, help="tokens per step (0: per size)")
    parser.add_argument("--steps", type=int, default=0, help="steps per block (0: per size)")
    parser.add_argument("--warmup", type=int, default=0, help="steps (0: per size)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--compare", nargs="+", default=list(COMPARISONS), choices=list(COMPARISONS)
    )
    parser.add_argument(
        "--batch-scales",
        nargs="+",
        type=int,
        default=[1],
        help="MoE/dense also with the batch this many times larger (fewer steps per block)",
    )
    parser.add_argument("--profile", action="store_true", help="profile the MoE and dense step")
    args = parser.parse_args()
    device = torch.device(args.device)
    precision = "bf16 autocast, fp32 weights" if device.type == "cuda" else "fp32"
    print(
        f"device {device}, {precision}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    for name in args.sizes:
        run = argparse.Namespace(**vars(args))
        run.steps = args.steps or (10 if name == "debug" else 1)
        run.warmup = args.warmup or (2 if name == "debug" else 1)
        run_size(name, run, device)


if __name__ == "__main__":
    main()
