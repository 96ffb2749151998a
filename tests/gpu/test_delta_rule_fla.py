"""fla-core's chunked gated delta rule, what kiln runs on CUDA for Gated DeltaNet layers
(kernel "auto" or "fla", kiln/model/qwen3_next/delta_rule.py), against kiln's plain-torch
chunked kernel in fp32 on the same bf16 inputs: forward, final state and gradients, with an
initial state and packed documents (kiln hands them to fla as variable-length sequences).
tests/unit/test_delta_rule.py proves the torch kernel against the step-by-step reference.
Skipped where fla-core is not installed. Written without a GPU, not yet run on one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.model.qwen3_next.delta_rule import gated_delta_rule

# Not a multiple of the 64-token chunks: the last chunk is ragged; Qwen3-Next's head widths.
BATCH, SEQ, HEADS, KEY_DIM, VALUE_DIM = 2, 300, 4, 128, 128
# fla takes bf16 inputs and keeps some intermediates (the UT transform's products) in bf16,
# rounding each by up to 2^-8 relative; the fp32 reference does not. Normwise, 2^-5 leaves a
# few such roundings carried through a sequence of 300 tokens.
RELATIVE = 2**-5


def normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.cuda_only("fla-core runs on CUDA only")
@pytest.mark.parametrize("with_documents", [False, True])
def test_fla_matches_torch_chunked(with_documents: bool, device: torch.device) -> None:
    pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core)")
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k = (F.normalize(randn(BATCH, SEQ, HEADS, KEY_DIM), dim=-1) for _ in range(2))
    v = randn(BATCH, SEQ, HEADS, VALUE_DIM)
    g, beta = F.logsigmoid(randn(BATCH, SEQ, HEADS) + 3), torch.sigmoid(randn(BATCH, SEQ, HEADS))
    state = randn(BATCH, HEADS, KEY_DIM, VALUE_DIM) * 0.1
    # Documents about every 50 tokens, one starting at row 1's first token.
    starts = torch.rand(BATCH, SEQ, generator=gen) < 0.02
    starts[1, 0] = True
    inputs = [x.to(device) for x in (q, k, v)]
    inputs = [x.bfloat16() for x in inputs] + [g.to(device), beta.to(device).bfloat16()]
    options = {
        "scale": KEY_DIM**-0.5,
        "output_final_state": True,
        "document_starts": starts.to(device) if with_documents else None,
    }
    upstream = randn(BATCH, SEQ, HEADS, VALUE_DIM).to(device)
    results = []
    for kernel in ("fla", "torch"):
        leaves = [x.detach().clone().requires_grad_() for x in [*inputs, state.to(device)]]
        out, final = gated_delta_rule(
            *leaves[:5], initial_state=leaves[5], kernel=kernel, **options
        )
        loss = (out.float() * upstream).sum() + final.float().sum()
        results.append([out, final, *torch.autograd.grad(loss, leaves)])
    fla, torch_chunked = results
    names = ["out", "final state", "dq", "dk", "dv", "dg", "dbeta", "dstate"]
    for name, a, b in zip(names, fla, torch_chunked, strict=True):
        assert normwise(a, b) <= RELATIVE, name


@pytest.mark.cuda_only("the kernels kiln compiles around on CUDA")
@pytest.mark.parametrize("kernel", ["torch", "fla"])
def test_compiled_layer_matches_eager(kernel: str, device: torch.device) -> None:
    # A Gated DeltaNet layer in a compiled block (the chunked kernel's pass from chunk to chunk
    # and fla's kernel run eagerly inside it) gives the eager layer's output and gradients.
    if kernel == "fla":
        pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core)")
    from kiln.config.load import config_from_dict
    from kiln.model.qwen3_next.gated_deltanet import GatedDeltaNet

    model = {"preset": "qwen3_next_debug", "linear_attention": {"kernel": kernel}}
    cfg = config_from_dict({"model": model}).model
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg).to(device)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.05)
    x = torch.randn(BATCH, SEQ, cfg.dim, device=device)
    starts = torch.rand(BATCH, SEQ, device=device) < 0.02
    results = []
    for run in (layer, torch.compile(layer)):
        leaf = x.clone().requires_grad_()
        out = run(leaf, document_starts=starts)
        out.square().mean().backward()
        results.append([out, leaf.grad, *(p.grad for p in layer.parameters())])
        layer.zero_grad(set_to_none=True)
    # fp32 throughout with the torch kernel: compiled fusions reorder roundings only (~1e-6
    # normwise over a few hundred ops). fla rounds its inputs to bf16 inside, where a last-bit
    # difference of the compiled inputs can flip a bf16 rounding: the band above.
    band = 1e-5 if kernel == "torch" else RELATIVE
    for eager, compiled in zip(*results, strict=True):
        assert normwise(compiled, eager) <= band


@pytest.mark.cuda_only("fla-core runs on CUDA only")
def test_layer_on_fla_keeps_what_the_planner_counts(device: torch.device) -> None:
    # The planner's Gated DeltaNet (kiln/model/qwen3_next/counts.py): what the layer keeps
    # around its kernel (measured on CPU too, tests/unit/test_plan_memory_linear.py) and what
    # fla-core's kernel keeps besides, per token, bf16.
    pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core)")
    from kiln.config.load import config_from_dict
    from kiln.model.qwen3_next.counts import fla_kernel_bytes, gated_deltanet_bytes_around_kernel
    from kiln.model.qwen3_next.gated_deltanet import GatedDeltaNet
    from tests.support.saved_tensors import saved_bytes

    model = {"preset": "qwen3_next_debug", "linear_attention": {"kernel": "fla"}}
    cfg = config_from_dict({"model": model}).model
    layer = GatedDeltaNet(cfg).to(device, torch.bfloat16)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.05)

    def saved(batch: int) -> int:
        x = torch.randn(batch, 256, cfg.dim, device=device, dtype=torch.bfloat16)
        x.requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return saved_bytes(lambda: layer(x), skip=[*layer.parameters(), x])

    per_token = (saved(4) - saved(2)) / (2 * 256)
    assert per_token == gated_deltanet_bytes_around_kernel(cfg) + fla_kernel_bytes(cfg)


@pytest.mark.cuda_only("fla-core runs on CUDA only")
@pytest.mark.parametrize("with_documents", [False, True])
def test_fla_convolution_matches_torch(with_documents: bool, device: torch.device) -> None:
    # fla-core's causal convolution with SiLU (the causal-conv1d package's kernel when it is
    # installed, fla's Triton one otherwise) against kiln's torch function, output and
    # gradients, on the same bf16 inputs.
    pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core)")
    from kiln.model.qwen3_next.short_conv import conv_silu

    gen = torch.Generator().manual_seed(1)
    channels = 2 * HEADS * KEY_DIM + HEADS * VALUE_DIM
    x = torch.randn(BATCH, SEQ, channels, generator=gen).to(device, torch.bfloat16)
    weight = (torch.randn(channels, 4, generator=gen) * 0.5).to(device, torch.bfloat16)
    starts = (torch.rand(BATCH, SEQ, generator=gen) < 0.02).to(device)
    upstream = torch.randn(BATCH, SEQ, channels, generator=gen).to(device)
    results = []
    for kernel in ("fla", "torch"):
        leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
        out = conv_silu(*leaves, document_starts=starts if with_documents else None, kernel=kernel)
        results.append([out, *torch.autograd.grad((out.float() * upstream).sum(), leaves)])
    # Both round their bf16 results once (2^-8 relative each); the weight's gradient sums
    # over 600 tokens in another order.
    for name, fla, torch_conv in zip(["out", "dx", "dweight"], *results, strict=True):
        assert normwise(fla, torch_conv) <= 2**-7, name
