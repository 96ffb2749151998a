"""The router: fp32 scores, top-k selection, group-limited routing, the bias only choosing."""

import pytest
import torch

from kiln.model.moe import Router

TOKENS, DIM, EXPERTS = 24, 16, 8


def make_router(**kwargs) -> Router:
    router = Router(DIM, EXPERTS, kwargs.pop("top_k", 2), **kwargs)
    with torch.no_grad():
        router.gate.weight.copy_(
            torch.randn(EXPERTS, DIM, generator=torch.Generator().manual_seed(1))
        )
    return router


def tokens(n: int = TOKENS, dim: int = DIM) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(2))


def logit_router(num_experts: int, **kwargs) -> Router:
    """A router whose logits are its input: gate = identity."""
    router = Router(num_experts, num_experts, kwargs.pop("top_k", 2), **kwargs)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(num_experts))
    return router


@pytest.mark.parametrize("score_func", ["softmax_topk", "sigmoid"])
def test_scores_selection_and_weights(score_func):
    router, x = make_router(score_func=score_func), tokens()
    route = router(x)
    logits = x @ router.gate.weight.T
    scores = logits.softmax(-1) if score_func == "softmax_topk" else logits.sigmoid()
    assert torch.allclose(route.logits, logits) and torch.allclose(route.scores, scores)
    top = scores.topk(2, dim=-1)
    assert torch.equal(route.indices, top.indices)
    assert torch.allclose(route.weights, top.values / top.values.sum(-1, keepdim=True))
    assert torch.equal(route.counts, torch.bincount(top.indices.flatten(), minlength=EXPERTS))


def test_route_norm_off_and_route_scale():
    x = tokens()
    plain = make_router(route_norm=False, route_scale=2.5)(x)
    assert torch.allclose(plain.weights, 2.5 * plain.scores.gather(-1, plain.indices))
    normed = make_router(route_scale=2.5)(x)
    assert torch.allclose(normed.weights.sum(-1), torch.full((TOKENS,), 2.5))


def test_gate_runs_in_fp32_under_autocast():
    router, x = make_router(), tokens()
    expected = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        route = router(x)
    assert route.logits.dtype == torch.float32 and route.weights.dtype == torch.float32
    assert torch.equal(route.logits, expected.logits)


def test_bias_chooses_experts_but_never_weighs_them():
    router, x = make_router(score_func="sigmoid"), tokens()
    unbiased = router(x)
    router.expert_bias[5] = 10.0  # expert 5 is now everyone's first choice
    route = router(x)
    assert (route.indices == 5).any(dim=-1).all()
    assert torch.equal(route.scores, unbiased.scores)
    chosen = unbiased.scores.gather(-1, route.indices)
    assert torch.allclose(route.weights, chosen / chosen.sum(-1, keepdim=True))
    assert not router.expert_bias.requires_grad
    assert "expert_bias" not in dict(router.named_parameters())


def test_group_limited_routing_by_hand():
    # 8 experts in 4 groups of 2, each token goes to its best 2 groups. Sigmoid groups score by
    # their top-2 sum: group 0 has the best expert (logit 3) but its sum loses to groups 1 and 2.
    logits = torch.tensor([[3.0, -3.0, 2.0, 1.9, 1.5, 1.5, 0.0, 0.0]])
    route = logit_router(8, score_func="sigmoid", n_groups=4, topk_groups=2)(logits)
    assert sorted(route.indices[0].tolist()) == [2, 3]
    # Softmax groups score by their best expert: group 0 (3) and group 1 (2) win.
    route = logit_router(8, n_groups=4, topk_groups=2)(logits)
    assert sorted(route.indices[0].tolist()) == [0, 2]


@pytest.mark.parametrize("score_func", ["softmax_topk", "sigmoid"])
def test_group_limited_routing_against_brute_force(score_func):
    groups, keep, top_k = 4, 2, 3
    router = make_router(score_func=score_func, n_groups=groups, topk_groups=keep, top_k=top_k)
    router.expert_bias.copy_(torch.linspace(-0.2, 0.2, EXPERTS))
    x = tokens(64)
    route = router(x)
    choice = route.scores + router.expert_bias
    for t in range(len(x)):
        per_group = choice[t].view(groups, -1)
        if score_func == "sigmoid":
            group_score = per_group.topk(2, dim=-1).values.sum(-1)
        else:
            group_score = per_group.max(dim=-1).values
        best_groups = group_score.topk(keep).indices.tolist()
        allowed = [e for e in range(EXPERTS) if e // (EXPERTS // groups) in best_groups]
        expected = sorted(allowed, key=lambda e: -choice[t, e].item())[:top_k]
        assert sorted(route.indices[t].tolist()) == sorted(expected)
