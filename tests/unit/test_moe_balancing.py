"""Load balancing: the loss formulas, their gradient injected through the block's output, the
step normalization set from outside, and the auxiliary-loss-free bias updates."""

import copy
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from kiln.config import ModelConfig, MoEConfig
from kiln.model.moe import AUX_LOSSES, AuxLossScale, MoEFeedForward, update_expert_biases
from kiln.model.moe.balancing import load_balance_sum, router_z_sum, sequence_balance_sum

DIM, EXPERTS, TOP_K = 16, 4, 2
WEIGHTS = {"aux_loss_weight": 0.1, "seq_aux_loss_weight": 0.05, "router_z_loss_weight": 0.01}


def make_moe(**overrides) -> MoEFeedForward:
    """An MoE block with these [model.moe] keys changed."""
    cfg = ModelConfig(
        dim=DIM,
        n_heads=2,
        n_kv_heads=1,
        ffn_hidden_dim=32,
        moe=MoEConfig(num_experts=EXPERTS, top_k=TOP_K),
    )
    for key, value in overrides.items():
        setattr(cfg.moe, key, value)
    moe = MoEFeedForward(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return moe


def batch(sequences: int = 3, seq_len: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(sequences, seq_len, DIM, generator=torch.Generator().manual_seed(seed))


# The papers' formulas, written out independently of kiln's.
def switch_loss(probs, indices):
    tokens, experts = probs.shape
    f = torch.stack([(indices == e).sum() / (tokens * TOP_K) for e in range(experts)])
    return experts * (f * probs.mean(dim=0)).sum()


def deepseek_seq_loss(scores, indices, sequences):
    probs, indices = scores / scores.sum(-1, keepdim=True), indices.view(sequences, -1, TOP_K)
    probs = probs.view(sequences, -1, EXPERTS)
    losses = []
    for b in range(sequences):
        seq_len = probs.shape[1]
        f = torch.stack([EXPERTS / (TOP_K * seq_len) * (indices[b] == e).sum() for e in range(4)])
        losses.append((f * probs[b].mean(dim=0)).sum())
    return torch.stack(losses).mean()


def z_loss(logits):
    return (logits.exp().sum(-1).log() ** 2).mean()


def test_formulas_against_the_papers():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, EXPERTS, generator=generator)
    probs = logits.softmax(-1)
    indices = probs.topk(TOP_K, dim=-1).indices
    counts = torch.bincount(indices.flatten(), minlength=EXPERTS)
    assert torch.allclose(load_balance_sum(probs, counts) / 12, switch_loss(probs, indices))
    seq = sequence_balance_sum(probs.view(3, 4, EXPERTS), indices.view(3, 4, TOP_K)) / 3
    assert torch.allclose(seq, deepseek_seq_loss(probs, indices, 3))
    assert torch.allclose(router_z_sum(logits) / 12, z_loss(logits))
    uniform = torch.full((8, EXPERTS), 1 / EXPERTS)
    assert torch.allclose(
        load_balance_sum(uniform, torch.full((EXPERTS,), 4)) / 8, torch.tensor(1.0)
    )


def test_logged_losses_are_the_papers_values_of_the_forward():
    moe, x = make_moe(), batch()
    # Not recorded and no weight: no loss is computed, nothing is kept.
    moe(x)
    assert moe.aux_losses == {} and not moe.aux_loss_sums.any()
    moe(x, AuxLossScale(record=True))
    route = moe.router(x.flatten(0, 1))
    probs = route.scores / route.scores.sum(-1, keepdim=True)
    assert torch.allclose(moe.aux_losses["load_balance"], switch_loss(probs, route.indices))
    assert torch.allclose(
        moe.aux_losses["seq_balance"], deepseek_seq_loss(route.scores, route.indices, 3)
    )
    assert torch.allclose(moe.aux_losses["router_z"], z_loss(route.logits))
    assert all(not value.requires_grad for value in moe.aux_losses.values())
    # The step's sums: the recorded training forward's, unnormalized (15 tokens, 3 sequences).
    own = torch.tensor([15.0, 3.0, 15.0])
    papers = torch.stack([moe.aux_losses[name] for name in AUX_LOSSES])
    # fp32: the same sums scaled by the counts in another order; rounding only (1e-5 relative).
    assert torch.allclose(moe.aux_loss_sums, papers * own, rtol=1e-5, atol=0)


def grads(module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to fp32 rounding of sums taken in another order."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid"])
def test_injected_gradient_equals_the_naive_total_loss(router):
    moe, x = make_moe(router=router, **WEIGHTS), batch()
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    out = moe(x)
    (out * target).sum().backward()
    # Naive: the same block without injection, the losses added to the loss by hand.
    plain = copy.deepcopy(moe)
    plain.zero_grad(set_to_none=True)
    plain.aux_weights = dict.fromkeys(plain.aux_weights, 0.0)
    plain_out = plain(x)
    route = plain.router(x.flatten(0, 1))
    probs = route.scores / route.scores.sum(-1, keepdim=True)
    aux = 0.1 * switch_loss(probs, route.indices)
    aux = aux + 0.05 * deepseek_seq_loss(route.scores, route.indices, 3)
    aux = aux + 0.01 * z_loss(route.logits)
    ((plain_out * target).sum() + aux).backward()
    assert torch.equal(out, plain_out)
    expected = grads(plain)
    for name, grad in grads(moe).items():
        assert close(grad, expected[name]), name
    without = make_moe(router=router)
    (without(x) * target).sum().backward()
    gate = "router.gate.weight"
    assert not torch.allclose(grads(moe)[gate], grads(without)[gate], rtol=1e-3)


def test_step_normalization_makes_micro_batches_add_up_to_the_whole_batch():
    # Two micro-batches of two sequences, normalized by the step's 4 sequences and 20 tokens, with
    # the load-balance counts of the whole step plugged in, give the whole batch's gradient.
    x = batch(sequences=4)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    whole = make_moe(**WEIGHTS)
    (whole(x) * target).sum().backward()
    split = make_moe(**WEIGHTS)
    with torch.no_grad():
        step_counts = split.router(x.flatten(0, 1)).counts
    scale = AuxLossScale(per_token=1 / 20, per_sequence=1 / 4, reduce_counts=lambda _: step_counts)
    for half in (slice(0, 2), slice(2, 4)):
        (split(x[half], scale) * target[half]).sum().backward()
    expected = grads(whole)
    for name, grad in grads(split).items():
        assert close(grad, expected[name]), name
    # Recording the losses for a logged step leaves the output and the gradient as they are.
    recorded = make_moe(**WEIGHTS)
    recording = replace(scale, record=True)
    for half in (slice(0, 2), slice(2, 4)):
        (recorded(x[half], recording) * target[half]).sum().backward()
    assert all(torch.equal(grad, grads(split)[name]) for name, grad in grads(recorded).items())
    assert recorded.aux_loss_sums.all() and not split.aux_loss_sums.any()


def test_scale_multiplies_the_sums():
    x = batch()
    losses = {}
    for per_token, per_sequence in ((None, None), (3.0 / 15, 3.0 / 3)):
        moe = make_moe(router_z_loss_weight=1.0, seq_aux_loss_weight=1.0)
        moe(x, AuxLossScale(per_token=per_token, per_sequence=per_sequence)).sum().backward()
        losses[per_token] = moe.router.gate.weight.grad
    plain = make_moe()
    plain(x).sum().backward()
    default_aux = losses[None] - plain.router.gate.weight.grad
    tripled_aux = losses[3.0 / 15] - plain.router.gate.weight.grad
    assert close(tripled_aux, 3 * default_aux)


def test_training_forwards_count_tokens_eval_and_recompute_do_not():
    moe, x = make_moe(**WEIGHTS), batch()
    with torch.no_grad():
        expected = moe.router(x.flatten(0, 1)).counts
        moe(x)  # eval: not counted, and nothing attached
    assert moe.router.tokens_per_expert.sum() == 0
    calls = []
    moe.register_forward_pre_hook(lambda *_: calls.append(1))
    out = checkpoint(moe, x, use_reentrant=False)
    out.sum().backward()
    assert len(calls) == 2  # the forward ran again inside backward
    assert torch.equal(moe.router.tokens_per_expert, expected)
    checkpointed = grads(moe)
    moe.zero_grad(set_to_none=True)
    moe(x).sum().backward()
    assert torch.equal(moe.router.tokens_per_expert, 2 * expected)
    for name, grad in grads(moe).items():
        assert torch.allclose(grad, checkpointed[name], atol=1e-7), name


def test_bias_update_formula():
    model = torch.nn.ModuleList([make_moe(), make_moe()])
    counts = torch.tensor([[5, 1, 3, 3], [0, 4, 4, 4]])
    for layer, c in zip(model, counts, strict=True):
        layer.router.tokens_per_expert.copy_(c)
    seen = []

    def all_reduce(tensor):  # stands in for a sum over data ranks: another rank saw [1, 1, 1, 1]
        seen.append(tensor.clone())
        return tensor + 1

    update_expert_biases(model, 0.01, all_reduce=all_reduce)
    assert len(seen) == 1 and torch.equal(seen[0], counts)
    totals = (counts + 1).float()
    for layer, total in zip(model, totals, strict=True):
        expected = 0.01 * torch.sign(total.mean() - total)
        assert torch.equal(layer.router.expert_bias, expected)
        assert layer.router.tokens_per_expert.sum() == 0
    assert torch.allclose(model[0].router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    model[0].router.tokens_per_expert.fill_(3)
    update_expert_biases([model], 0.0)  # rate 0 (a skipped step): only restart the counts
    assert model[0].router.tokens_per_expert.sum() == 0
    assert torch.allclose(model[0].router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))


def test_trained_counts_drive_the_update():
    moe, x = make_moe(), batch()
    moe(x)
    counts = moe.router.tokens_per_expert.float()
    update_expert_biases(moe, 0.5)
    assert torch.equal(moe.router.expert_bias, 0.5 * torch.sign(counts.mean() - counts))
