"""Bytes the token loss allocates per step and holds at its peak, eager against compiled.

The output head and the loss of one micro-batch on bf16 tensors (as under FSDP's bf16 policy):
logits = hidden @ weight.T, `kiln.train.loss.token_loss_sum` (eager, or `compiled=True` as under
`train.compile`), the model's output freed once the loss has it, then the backward to the hidden
states and the head. torch's memory profiler reads the CPU allocator's events of one profiled
step after a warm-up (which compiles): every byte allocated (compiled kernels' buffers too) and
the largest total live at once above what was live before the step. Counts, not times: they do
not depend on the machine's load. Per logit, and scaled to llama3_1b's micro-batch of 4 × 2048
tokens over 128,256 entries (issue 50's H100 run).

    python benchmarks/loss_memory.py [--tokens 2048] [--vocab 32768] [--dim 64]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action, MemoryProfileTimeline

from kiln.tokens import IGNORE_INDEX
from kiln.train.loss import token_loss_sum

LLAMA3_1B_LOGITS = 4 * 2048 * 128_256
GB = 1e9


def measure(args: argparse.Namespace, compiled: bool, z_loss_weight: float) -> tuple[int, int]:
    """(bytes allocated, peak bytes above the start) of one step of the head and the loss."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, generator=generator).bfloat16()
    weight = (torch.randn(args.vocab, args.dim, generator=generator) * 0.3).bfloat16()
    labels = torch.randint(args.vocab, (1, args.tokens), generator=generator)
    labels[0, : args.tokens // 20] = IGNORE_INDEX
    hidden.requires_grad_()
    weight.requires_grad_()

    def step() -> None:
        logits = F.linear(hidden, weight).unsqueeze(0)
        loss = token_loss_sum(logits, labels, z_loss_weight=z_loss_weight, compiled=compiled)
        del logits
        loss.backward()
        hidden.grad = weight.grad = None

    step()
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    memory = prof._memory_profile()
    allocated = sum(size for _, action, _, size in memory.timeline if action == Action.CREATE)
    _, sizes = MemoryProfileTimeline(memory)._coalesce_timeline(torch.device("cpu"))
    totals = [sum(s) for s in sizes]
    return allocated, max(totals) - totals[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    logits = args.tokens * args.vocab
    print(f"torch {torch.__version__}, {args.tokens} tokens x {args.vocab} vocab, bf16, CPU\n")
    print(
        "| loss | z-loss | allocated B/logit | peak B/logit | llama3_1b allocated GB | "
        "llama3_1b peak GB |"
    )
    print("|---|---|---|---|---|---|")
    for compiled in (False, True):
        for z in (0.0, 1e-3):
            allocated, peak = measure(args, compiled, z)
            a, p = allocated / logits, peak / logits
            print(
                f"| {'compiled' if compiled else 'eager'} | {z:g} | {a:.2f} | {p:.2f} | "
                f"{a * LLAMA3_1B_LOGITS / GB:.1f} | {p * LLAMA3_1B_LOGITS / GB:.1f} |"
            )


if __name__ == "__main__":
    main()
