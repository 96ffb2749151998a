"""One training step of kiln, a hand-written loop and torchtitan's Llama 3 on CPU, op by op.

Times on a shared 2-core machine are noise; what a step does is not. For each side this counts,
over one step after warm-up (torch.profiler, CPU, profile_memory): the aten ops called (every
call, nested ones included), the bytes allocated (the sum of each op's own allocations), and the
ops whose call counts differ most between kiln and the others. The three sides train the same
shapes on the same batch: kiln's `Trainer.train_step` (a non-logging step, as `kiln train` runs
between log lines), benchmarks/overhead.py's hand loop (kiln's model), and torchtitan's Llama 3
model with its cross-entropy loss (`torchtitan.components.loss.cross_entropy_loss`), AdamW
(foreach) and clip_grad_norm_ (what its trainer runs in one process, without its trainer).

torchtitan is not a dependency of kiln; point PYTHONPATH at an installation of it (torchtitan
0.2.x with tyro, torchdata, docstring_parser and triton, `pip install --no-deps --target DIR`):

    PYTHONPATH=DIR python benchmarks/step_ops.py [--config RECIPE] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import torch
from overhead import baseline_step_fn
from torch.profiler import ProfilerActivity, profile

from kiln.config import load_config
from kiln.train.trainer import Trainer


def profile_step(step, warmup: int = 3) -> tuple[collections.Counter, collections.Counter, int]:
    """(aten op call counts, bytes allocated by op, allocations) of one call of `step`."""
    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    ops: collections.Counter = collections.Counter()
    allocated: collections.Counter = collections.Counter()
    allocations = 0
    for event in prof.events():
        if event.name.startswith("aten::"):
            ops[event.name] += 1
        if event.self_cpu_memory_usage > 0:
            allocated[event.name] += event.self_cpu_memory_usage
            allocations += 1
    return ops, allocated, allocations


def torchtitan_step_fn(cfg, batch: torch.Tensor):
    """torchtitan's Llama 3 at kiln's shapes, its loss, AdamW and clipping, one process."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer
    from torchtitan_launcher import model_args

    torch.manual_seed(cfg.train.seed)
    model = Transformer(model_args(cfg.model, cfg.train.seq_len))
    with torch.no_grad():  # as its trainer does, under a meta-device init
        model.init_weights()

    def mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(logits, labels) / labels.numel()  # its loss is a sum

    return baseline_step_fn(cfg, batch, model=model, loss_fn=mean_loss)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--top", type=int, default=12, help="ops listed by count difference")
    args, overrides = parser.parse_known_args()
    run_dir = tempfile.mkdtemp(prefix="kiln-step-ops-")
    cfg = load_config(
        args.config,
        [*overrides, f"--metrics.run_dir={run_dir}", "--checkpoint.interval=0"],
    )
    cfg.train.max_steps = 10**9
    cfg.metrics.log_interval = 10**9  # every profiled step is a non-logging one
    trainer = Trainer(cfg)
    (first,) = trainer.loader.next_step().micro_batches
    batch = torch.cat([first[0], first[1][:, -1:]], dim=1)

    sides = {"kiln": trainer.train_step, "hand": baseline_step_fn(cfg, batch)}
    if cfg.model.moe.num_experts:  # torchtitan's Llama 3 is dense: no like-for-like side
        print("an MoE model: kiln and the hand loop only")
    else:
        try:
            sides["torchtitan"] = torchtitan_step_fn(cfg, batch)
        except ImportError as error:
            print(f"torchtitan not importable ({error}): kiln and the hand loop only")
    results = {name: profile_step(step) for name, step in sides.items()}

    tokens = cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum_steps
    print(
        f"config {args.config} {' '.join(overrides)}: {tokens} tokens/step, one step after warm-up"
    )
    print("\n| side | aten op calls | bytes allocated | allocations |")
    print("|---|---|---|---|")
    for name, (ops, allocated, allocations) in results.items():
        total = sum(allocated.values()) / 2**20
        print(f"| {name} | {sum(ops.values()):,} | {total:,.1f} MiB | {allocations:,} |")
    kiln_ops, kiln_bytes, _ = results["kiln"]
    for other in (name for name in results if name != "kiln"):
        other_ops, other_bytes, _ = results[other]
        names = set(kiln_ops) | set(other_ops) | set(kiln_bytes) | set(other_bytes)

        def gap(n: str, other_bytes=other_bytes, other_ops=other_ops) -> float:
            return abs(kiln_bytes[n] - other_bytes[n]) / 2**20 + abs(kiln_ops[n] - other_ops[n])

        print(f"\n| op | calls: kiln | {other} | MiB allocated: kiln | {other} |")
        print("|---|---|---|---|---|")
        for n in sorted(names, key=lambda n: -gap(n))[: args.top]:
            if gap(n):
                mib = f"{kiln_bytes[n] / 2**20:.1f} | {other_bytes[n] / 2**20:.1f}"
                print(f"| `{n}` | {kiln_ops[n]} | {other_ops[n]} | {mib} |")


if __name__ == "__main__":
    main()
