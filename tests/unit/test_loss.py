import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import MemoryProfileTimeline

from kiln.tokens import IGNORE_INDEX
from kiln.train.loss import count_valid, token_loss_sum


def test_sum_over_valid_tokens_with_z_loss():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    labels[0, :3] = IGNORE_INDEX
    valid = labels != IGNORE_INDEX
    expected_ce = sum(
        F.cross_entropy(logits[i, j], labels[i, j]) for i, j in valid.nonzero().tolist()
    )
    expected_z = sum(torch.logsumexp(logits[i, j], -1) ** 2 for i, j in valid.nonzero().tolist())
    assert count_valid(labels) == 7
    assert torch.allclose(token_loss_sum(logits, labels), expected_ce)
    assert torch.allclose(
        token_loss_sum(logits, labels, z_loss_weight=1e-2), expected_ce + 1e-2 * expected_z
    )


def peak_tensor_bytes(step) -> int:
    """The most bytes of tensors live at once while `step` runs, beyond those live before it:
    torch's memory profiler over the CPU allocator's events, a compiled kernel's buffers too."""
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    totals = [sum(s) for s in sizes]
    return max(totals) - totals[0]


def test_compiled_loss_keeps_no_fp32_copy_of_the_logits():
    """train.compile: the same bf16-logit loss and gradients as eager, at a third of the memory."""
    generator = torch.Generator().manual_seed(2)
    rows, seq, dim, vocab = 4, 64, 32, 2048
    hidden = torch.randn(rows * seq, dim, generator=generator).bfloat16()
    weight = (torch.randn(vocab, dim, generator=generator) * 0.3).bfloat16()
    labels = torch.randint(0, vocab, (rows, seq), generator=generator)
    labels[1, :20] = IGNORE_INDEX
    results = {}

    def step(compiled):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        # The model's output, freed once the loss has it, as in the trainer.
        logits = F.linear(h, w).view(rows, seq, vocab)
        losses = token_loss_sum(logits, labels, z_loss_weight=1e-3, per_row=True, compiled=compiled)
        del logits
        losses.sum().backward()
        results[compiled] = losses.detach(), h.grad, w.grad

    step(True)  # compiles outside the profiled step
    peaks = {compiled: peak_tensor_bytes(lambda c=compiled: step(c)) for compiled in (False, True)}
    for got, expected in zip(results[True], results[False], strict=True):
        # The same fp32 arithmetic per token, fused in another order, the gradients rounded to
        # bf16 (2^-8 relative) after it. Measured: losses within 1.0e-7 of the largest, the
        # hidden states' gradient bitwise, the head's 1.1e-5; 4e-3 is one bf16 rounding, a band
        # from the format, far above the last-bit differences of another x86 CPU's kernels.
        assert (got - expected).abs().max() <= 4e-3 * expected.abs().max()
    logits = rows * seq * vocab
    # Eager: the fp32 copy, its log-probabilities and logsumexp's saved input and output, and
    # their gradients (measured 20.3 bytes per logit with the z-loss); compiled: the bf16 logits
    # the backward keeps and their bf16 gradient (measured 4.3 with the small tensors around).
    assert peaks[False] >= 12 * logits
    assert peaks[True] <= 4.5 * logits
