"""The routed experts on `torch._grouped_mm` against the per-expert loop (kiln/model/moe/experts.py),
forward and backward, and one MoE training step on each. On the CPU `_grouped_mm` is a loop of
`mm` and the two agree bit for bit (tests/unit/test_moe_experts.py); on CUDA bf16 runs a grouped
kernel (sm90 and later) and other dtypes torch's own per-group path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.model.moe import GroupedExperts
from kiln.model.moe import experts as experts_module
from kiln.model.moe.experts import grouped_mm_applies
from tests.gpu.runs import MOE_RECIPE, make_trainer

EXPERTS, DIM, HIDDEN = 8, 256, 512
# Uneven groups: an expert without tokens, one with a single token, counts not aligned to tiles.
COUNTS = [37, 0, 1, 130, 64, 9, 200, 71]
# Normwise relative difference, ‖grouped − loop‖ / ‖loop‖, of the output and every gradient.
# bf16: both kernels accumulate in fp32 and round each product to bf16 once, so an element
# differs by at most one bf16 step (2^-8 relative); SwiGLU's three matmuls, its elementwise
# product and the backward's matmuls each add at most one more, so 2^-6 (4 steps) bounds it.
# fp32: the same sums in another order: over at most 512 terms the normwise difference is about
# sqrt(512) · 2^-24 ≈ 1.4e-6 (IEEE fp32 matmuls, torch's default: no TF32); 1e-5 leaves 7x.
TOLERANCE = {torch.bfloat16: 2**-6, torch.float32: 1e-5}


def make_experts(dtype: torch.dtype, device: torch.device) -> GroupedExperts:
    """Experts with seeded weights of unit-variance outputs, in `dtype` on `device`."""
    module = GroupedExperts(EXPERTS, DIM, HIDDEN)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in module.parameters():
            weight.copy_(torch.randn(weight.shape, generator=generator) * DIM**-0.5)
    return module.to(device=device, dtype=dtype)


def run(module: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, *, grouped: bool) -> dict:
    """Output and gradients (input and weights) of one forward and backward."""
    module.use_grouped_mm = grouped
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = module(x, counts)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(upstream.to(out))
    return {"out": out.detach(), "x": x.grad} | {n: p.grad for n, p in module.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative difference of `a` from `b`."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.bfloat16, marks=pytest.mark.needs_bf16), torch.float32],
    ids=["bf16", "fp32"],
)
def test_grouped_mm_matches_the_loop(dtype: torch.dtype, device: torch.device) -> None:
    module = make_experts(dtype, device)
    counts = torch.tensor(COUNTS, device=device)
    x = torch.randn(sum(COUNTS), DIM, generator=torch.Generator().manual_seed(1))
    x = x.to(device=device, dtype=dtype)
    assert grouped_mm_applies(x, module.w1, module.w2)
    grouped, looped = run(module, x, counts, grouped=True), run(module, x, counts, grouped=False)
    assert grouped.keys() == looped.keys()
    for name in looped:
        assert relative(grouped[name], looped[name]) <= TOLERANCE[dtype], name
    # The expert without tokens gets zero gradients on both paths.
    for name in ("w1", "w2", "w3"):
        assert not grouped[name][1].any() and not looped[name][1].any(), name


@pytest.mark.needs_bf16
def test_moe_training_step_on_grouped_mm_matches_the_loop(
    device: torch.device, demo_data: Path, tmp_path: Path
) -> None:
    """One optimizer step of the debug MoE model in bf16 (autocast), grouped against looped."""
    calls = []
    grouped_fn = experts_module._grouped

    def spy(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].dtype)
        return grouped_fn(*args)

    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(experts_module, "_grouped", spy)
        for grouped in (True, False):
            run_dir = tmp_path / ("grouped" if grouped else "looped")
            trainer = make_trainer(
                MOE_RECIPE, device, run_dir, demo_data, "--train.mixed_precision=bf16"
            )
            for module in trainer.model_parts[0].modules():
                if isinstance(module, GroupedExperts):
                    module.use_grouped_mm = grouped
            result = trainer.train_step()
            results[grouped] = (result.loss.item(), result.grad_norm.item())
            assert result.finite
    # The grouped path ran, in bf16 (autocast's dtype, which grouped_mm is handed explicitly),
    # once: the forward of the debug MoE model's one MoE block.
    assert calls == [torch.bfloat16]
    (loss, grad_norm), (loop_loss, loop_grad_norm) = results[True], results[False]
    # The loss is a mean over 512 tokens of the same forward up to the experts' rounding (at
    # most a bf16 step, 2^-8, per element, independent across tokens): far below 2^-8 of it.
    assert loss == pytest.approx(loop_loss, rel=2**-8)
    # The gradient norm: normwise within 2^-6, as the experts' gradients above.
    assert grad_norm == pytest.approx(loop_grad_norm, rel=2**-6)
