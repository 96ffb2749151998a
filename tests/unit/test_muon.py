"""Muon in one process: torch.optim.Muon's update, expert by expert for stacked experts, and
the split of the model's parameters between Muon and AdamW."""

import pytest
import torch

from kiln.config import JobConfig, load_config, validate
from kiln.errors import ConfigError
from kiln.model import build_model, materialize
from kiln.train.muon import Muon, newton_schulz
from kiln.train.optimizer import build_optimizer
from tests.conftest import DEBUG_CONFIG

# What the Llama family's plan puts in the first and last pipeline stages: Muon leaves them to AdamW.
IO_MODULES = ("tok_embeddings", "norm", "output")


def _pairs(shapes, seed=0):
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_update_is_torch_muons_bit_for_bit(adjust_lr, nesterov):
    ours, theirs = _pairs([(64, 32), (32, 96), (48, 48)])
    kiln_muon = Muon(ours, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr=adjust_lr)
    torch_muon = torch.optim.Muon(
        theirs, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr
    )
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        kiln_muon.step()
        torch_muon.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


# The stack runs batched matmuls (baddbmm), a lone matrix plain ones (addmm): other kernels,
# which may sum in another order on another CPU (bitwise equal on AMD EPYC), and five
# iterations of the quintic amplify a last-bit difference. Simulated by moving the inputs one
# ulp (every element in fp32, 5% of them in bf16, 10 draws): the outputs (at most ~0.5) moved
# by up to 1.0e-6 in fp32 and 0.025 in bf16 (13 of its steps of 2^-9). The bounds are 10x and
# 2x that; orthogonalizing the stack as one matrix moves them by 0.26-0.33.
STACKED_ATOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


def test_stacked_experts_are_orthogonalized_one_by_one():
    stack = torch.randn(4, 24, 40, generator=torch.Generator().manual_seed(0))
    for dtype, atol in STACKED_ATOL.items():
        together = newton_schulz(stack, steps=5, dtype=dtype)
        for expert in range(4):
            alone = newton_schulz(stack[expert], steps=5, dtype=dtype)
            torch.testing.assert_close(together[expert], alone, rtol=0, atol=atol)
        # The bound is tight enough to tell: the stack orthogonalized as one (96, 40) matrix.
        as_one = newton_schulz(stack.reshape(96, 40), steps=5, dtype=dtype).reshape(stack.shape)
        assert (as_one - together).abs().max() > 4 * atol


def test_fp32_iterations_orthogonalize():
    ortho = newton_schulz(torch.randn(32, 64), steps=10, dtype=torch.float32)
    singular = torch.linalg.svdvals(ortho)
    # The quintic's fixed points lie in roughly [0.7, 1.2], not at exactly 1.
    assert singular.min() > 0.5 and singular.max() < 1.3


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    cfg = load_config(DEBUG_CONFIG, ["--optimizer.name=muon", "--optimizer.adamw.lr=0.001"])
    model = materialize(build_model(cfg.model), device="cpu", seed=0)
    muon, adamw = build_optimizer(model, cfg.optimizer, io_modules=IO_MODULES)
    names = {id(p): name for name, p in model.named_parameters()}
    in_muon = {names[id(p)] for group in muon.param_groups for p in group["params"]}
    in_adamw = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert in_muon | in_adamw == set(names.values()) and not in_muon & in_adamw
    assert (
        "layers.0.attention.wq.weight" in in_muon and "layers.1.feed_forward.w2.weight" in in_muon
    )
    assert {"tok_embeddings.weight", "norm.weight", "layers.0.ffn_norm.weight"} <= in_adamw
    assert all(p.ndim == 2 for group in muon.param_groups for p in group["params"])
    assert {group["lr"] for group in adamw.param_groups} == {0.001}
    assert {group["base_lr"] for group in muon.param_groups} == {cfg.optimizer.lr}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--optimizer.momentum=0.9"], "optimizer.momentum is a Muon setting"),
        (["--optimizer.adamw.lr=1e-3"], "optimizer.adamw.lr sets the AdamW half of Muon"),
        (["--optimizer.name=muon", "--optimizer.ns_steps=0"], "optimizer.ns_steps"),
        (["--optimizer.name=muon", "--optimizer.adjust_lr=rms"], "optimizer.adjust_lr = 'rms'"),
    ],
)
def test_keys_of_another_optimizer_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(DEBUG_CONFIG, overrides))


def test_unset_muon_keys_are_not_written_to_the_run_config():
    from kiln.config import to_toml

    text = to_toml(JobConfig())
    optimizer = text.split("[optimizer]", 1)[1].split("\n[", 1)[0]  # the section alone
    assert "momentum" not in optimizer and "[optimizer.adamw]\n\n" in text


def test_muon_with_no_hidden_matrix_is_one_clear_error():
    cfg = load_config(DEBUG_CONFIG, ["--optimizer.name=muon"])
    model = materialize(build_model(cfg.model), device="cpu", seed=0)
    model.layers = torch.nn.ModuleDict()  # embeddings, final norm and head only
    with pytest.raises(ConfigError, match="found no hidden matrix to orthogonalize"):
        build_optimizer(model, cfg.optimizer, io_modules=IO_MODULES)
