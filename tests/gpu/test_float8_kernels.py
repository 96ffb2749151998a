"""FP8 on the GPU (kiln/parallel/float8.py, torchao): the real float8 matmuls against kiln's CPU
emulation of them on the same layer and inputs, and their SQNR against bf16, tensorwise and
rowwise. The CPU side is tests/unit/test_float8.py (emulated, as CI runs it)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from kiln.config import JobConfig, ModelConfig
from kiln.config.sections import Float8Config, TrainConfig
from kiln.model.feed_forward import FeedForward
from kiln.model.llama.attention import Attention
from kiln.model.rope import rope_tables
from kiln.parallel.float8 import CUDA_CAPABILITY, convert_to_float8

RECIPES = ("tensorwise", "rowwise")
# float8 matmuls need every dimension a multiple of 16 (FLOAT8_ALIGNMENT).
LAYER = ModelConfig(
    dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=384, max_seq_len=64
)
BATCH, SEQ, IN, OUT = 4, 64, 512, 1024
# Real kernels against the emulation, one linear layer: the same float8 operands and scales
# (casts of the same bf16 input, weight and output gradient are the same on both devices), so
# only the accumulation and the final rounding to bf16 differ: an element differs by at most
# one bf16 step (2^-8 relative, 48 dB), a little more where H100's fast float8 accumulation
# (the forward's) drops low bits. 40 dB (1% normwise) bounds it with room.
REAL_VS_EMULATED_DB = 40.0
# Against bf16, torchao's own bar for float8 training (tests/unit/test_float8.py), and the
# tensorwise query/key gradients' lower one: their output gradient is rounded to e5m2 twice.
SQNR_DB = 20.0
TWICE_ROUNDED_SQNR_DB = 19.0


@pytest.fixture(scope="module")
def compute_error() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """torchao's SQNR (dB); the module skips, naming the package, where torchao is missing."""
    pytest.importorskip("torchao", reason="torchao is not installed (float8 needs torchao 0.18)")
    from torchao.float8.float8_utils import compute_error

    return compute_error


def require_float8(recipe: str, device: torch.device) -> None:
    """Skip, naming the capability, on a GPU without float8 matmuls for `recipe`."""
    if device.type != "cuda":
        return
    need, have = CUDA_CAPABILITY[recipe], torch.cuda.get_device_capability(device)
    if have < need:
        pytest.skip(
            f"float8 {recipe} needs compute capability >= {need[0]}.{need[1]}; "
            f"{torch.cuda.get_device_name(device)} has {have[0]}.{have[1]}"
        )


def to_float8(module: nn.Module, recipe: str, device: torch.device) -> nn.Module:
    """A float8 copy of `module` by kiln's conversion for `device` (CPU: the emulation)."""
    # Converted first, moved after, as training converts on the meta device.
    job = JobConfig(train=TrainConfig(mixed_precision="fp8"), fp8=Float8Config(recipe=recipe))
    converted = copy.deepcopy(module)
    assert convert_to_float8(converted, job, device=device, tp=1) > 0
    return converted.to(device)


def pass_of(module: nn.Module, forward: Callable, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    """Output and every 2-D weight's gradient of one forward and backward."""
    x = x.detach().clone()
    out = forward(module, x)
    out.backward(upstream.to(out))
    grads = {name: p.grad for name, p in module.named_parameters() if p.ndim == 2}
    return {"output": out.detach()} | grads


@pytest.mark.cuda_only("the real float8 kernels run on CUDA (compute capability 8.9 or newer)")
@pytest.mark.parametrize("recipe", RECIPES)
def test_real_float8_kernels_match_the_cpu_emulation(
    recipe: str, device: torch.device, compute_error: Callable
) -> None:
    require_float8(recipe, device)
    generator = torch.Generator().manual_seed(0)
    layer = nn.Sequential(nn.Linear(IN, OUT, bias=False)).bfloat16()
    x = torch.randn(BATCH * SEQ, IN, generator=generator).bfloat16()
    upstream = torch.randn(BATCH * SEQ, OUT, generator=generator).bfloat16()
    real = pass_of(to_float8(layer, recipe, device), lambda m, x: m(x), x.to(device), upstream)
    cpu = torch.device("cpu")
    emulated = pass_of(to_float8(layer, recipe, cpu), lambda m, x: m(x), x, upstream)
    assert real.keys() == emulated.keys()
    for name, reference in emulated.items():
        db = compute_error(reference.float(), real[name].float().cpu()).item()
        assert db >= REAL_VS_EMULATED_DB, (name, db)


def layer_case(name: str, seed: int) -> tuple[nn.Module, Callable, torch.Tensor]:
    """(bf16 module, forward(module, x), input) for kiln's attention or feed-forward."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    x = torch.randn(BATCH, SEQ, LAYER.dim, generator=generator).bfloat16()
    if name == "attention":
        cos, sin = rope_tables(LAYER.resolved_head_dim, SEQ, 10000.0, "cpu")
        module = Attention(LAYER).bfloat16()
        return module, lambda m, x: m(x, cos.to(x.device), sin.to(x.device)), x
    return FeedForward(LAYER.dim, LAYER.ffn_hidden_dim).bfloat16(), lambda m, x: m(x), x


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["attention", "feed_forward"])
def test_float8_sqnr_against_bf16(
    name: str, recipe: str, device: torch.device, compute_error: Callable
) -> None:
    """Output and weight gradients of float8 against bf16 on the same weights and inputs."""
    # On CUDA the real kernels; in the dry run, the CPU emulation.
    require_float8(recipe, device)
    module, forward, x = layer_case(name, seed=0)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    fp8 = pass_of(to_float8(module, recipe, device), forward, x.to(device), upstream)
    bf16 = pass_of(module.to(device), forward, x.to(device), upstream)
    for key, reference in bf16.items():
        db = compute_error(reference.float(), fp8[key].float()).item()
        twice = recipe == "tensorwise" and key in ("wq.weight", "wk.weight")
        assert db >= (TWICE_ROUNDED_SQNR_DB if twice else SQNR_DB), (key, db)
