"""Routed experts (grouped_mm and the loop agree bit for bit) and the local dispatcher."""

import pytest
import torch
import torch.nn.functional as F

from kiln.model.moe import GroupedExperts, LocalDispatcher
from kiln.model.moe.experts import grouped_mm_applies


def make_experts(experts: int = 6, dim: int = 16, hidden: int = 32) -> GroupedExperts:
    module = GroupedExperts(experts, dim, hidden)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in module.parameters():
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    return module


def run(module: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, *, grouped: bool):
    module.use_grouped_mm = grouped
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = module(x, counts)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    return out.detach(), x.grad, {name: p.grad for name, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_the_loop_bit_for_bit(dtype):
    # On CPU torch._grouped_mm is a C++ loop of mm over each group's rows: the same kernels on
    # the same rows as the Python loop, forward and backward (expert 2 gets no tokens).
    module = make_experts().to(dtype)
    counts = torch.tensor([5, 9, 0, 1, 13, 3])
    x = torch.randn(int(counts.sum()), 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert grouped_mm_applies(x, module.w1, module.w2)
    grouped, looped = run(module, x, counts, grouped=True), run(module, x, counts, grouped=False)
    assert torch.equal(grouped[0], looped[0])
    assert torch.equal(grouped[1], looped[1])
    for name in ("w1", "w2", "w3"):
        assert torch.equal(grouped[2][name], looped[2][name]), name


def test_the_loop_is_a_swiglu_per_expert():
    module = make_experts()
    counts = torch.tensor([2, 0, 3, 1, 0, 4])
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    out = module(x, counts)
    expert_of_row = torch.repeat_interleave(torch.arange(6), counts)
    for row, e in enumerate(expert_of_row.tolist()):
        w1, w3, w2 = module.w1[e], module.w3[e], module.w2[e]
        expected = w2 @ (F.silu(w1 @ x[row]) * (w3 @ x[row]))
        assert torch.allclose(out[row], expected, atol=1e-6)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("counts", [[4, 0, 2, 0, 0, 1], [0, 0, 0, 0, 0, 0]])
def test_experts_without_tokens_get_zero_gradients(grouped, counts):
    module, counts = make_experts(), torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 16)
    _, _, grads = run(module, x, counts, grouped=grouped)
    for name, grad in grads.items():
        assert grad is not None, name
        assert torch.equal(grad[counts == 0], torch.zeros_like(grad[counts == 0])), name
        assert all((grad[e] != 0).any() for e in range(len(counts)) if counts[e] > 0), name


def test_unaligned_shapes_take_the_loop():
    module = make_experts(dim=6, hidden=10)  # rows of 24 and 40 bytes: not 16-byte multiples
    counts = torch.tensor([3, 1, 0, 2, 0, 1])
    x = torch.randn(7, 6)
    assert not grouped_mm_applies(x, module.w1, module.w2)
    module.use_grouped_mm = True
    auto = module(x, counts)
    module.use_grouped_mm = False
    assert torch.equal(auto, module(x, counts))


def test_dispatch_sorts_stably_by_expert_and_combine_undoes_it():
    dispatcher = LocalDispatcher(num_experts=4, top_k=2)
    x = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    indices = torch.tensor([[2, 0], [0, 3], [2, 1], [0, 2], [3, 0]])
    rows, counts, state = dispatcher.dispatch(x, indices)
    assert counts.tolist() == [4, 1, 3, 2]
    # Expert 0 takes tokens 0, 1, 3, 4 in token order, expert 1 token 2, and so on.
    assert rows[:, 0].div(3).long().tolist() == [0, 1, 3, 4, 2, 0, 2, 3, 1, 4]
    weights = torch.tensor([[0.25, 0.75]]).expand(5, 2)
    assert torch.equal(dispatcher.combine(rows, weights, state), x)


def test_combine_weighs_each_slot():
    dispatcher = LocalDispatcher(num_experts=3, top_k=2)
    x = torch.randn(6, 4)
    indices = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]])
    weights = torch.rand(6, 2)
    rows, counts, state = dispatcher.dispatch(x, indices)
    scale = torch.tensor([1.0, 2.0, 3.0])  # a stand-in expert: expert e multiplies by e + 1
    expert_of_row = torch.repeat_interleave(torch.arange(3), counts)
    out = dispatcher.combine(rows * scale[expert_of_row, None], weights, state)
    expected = sum(weights[:, k, None] * scale[indices[:, k], None] * x for k in range(2))
    assert torch.allclose(out, expected)


def test_capacity_keeps_the_first_tokens_of_each_expert():
    # 6 tokens · top-2 / 3 experts · factor 0.5 = capacity 2.
    dispatcher = LocalDispatcher(num_experts=3, top_k=2, capacity_factor=0.5)
    x = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 2).contiguous()
    indices = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1], [2, 1], [2, 0]])
    assert dispatcher.capacity(6) == 2
    rows, counts, state = dispatcher.dispatch(x, indices)
    assert counts.tolist() == [2, 2, 2]
    # Expert 0 wanted tokens 0, 1, 2, 3, 5 and keeps 0, 1; expert 1: 0, 2 of 0, 2, 3, 4;
    # expert 2: 1, 4 of 1, 4, 5.
    assert rows[:, 0].tolist() == [0, 1, 0, 2, 1, 4]
    out = dispatcher.combine(rows, torch.ones(6, 2), state)
    kept_slots = torch.tensor([2, 2, 1, 0, 1, 0])  # slots of each token that survived
    assert torch.equal(out[:, 0], torch.arange(6.0) * kept_slots)
    again = dispatcher.dispatch(x, indices)
    assert torch.equal(again[0], rows) and torch.equal(again[2].order, state.order)


def test_dispatch_and_combine_gradients():
    dispatcher = LocalDispatcher(num_experts=4, top_k=2)
    x = torch.randn(7, 3, requires_grad=True)
    weights = torch.rand(7, 2, requires_grad=True)
    first = torch.randint(0, 4, (7,), generator=torch.Generator().manual_seed(0))
    indices = torch.stack([first, (first + 1) % 4], dim=1)  # two different experts per token
    rows, _, state = dispatcher.dispatch(x, indices)
    dispatcher.combine(rows * 2, weights, state).sum().backward()
    assert torch.allclose(x.grad, 2 * weights.detach().sum(-1, keepdim=True).expand(7, 3))
    assert torch.allclose(weights.grad, 2 * x.detach().sum(-1, keepdim=True).expand(7, 2))


@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
def test_dispatch_and_combine_equal_the_per_slot_formulation_bit_for_bit(capacity_factor):
    # The per-slot formulation: a copy of every token per slot, gathered by the sorted order,
    # and the outputs weighed slot by slot. The dispatcher gathers from the tokens and combines
    # all slots at once; the values and both gradients must not move by a bit.
    dispatcher = LocalDispatcher(num_experts=5, top_k=3, capacity_factor=capacity_factor)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 8, generator=generator)
    weights = torch.rand(2, 9, 3, generator=generator)
    indices = torch.rand(18, 5, generator=generator).topk(3, dim=-1).indices
    target = torch.randn(2, 9, 8, generator=generator)

    def run(per_slot: bool):
        tokens, w = x.clone().requires_grad_(), weights.clone().requires_grad_()
        flat = tokens.flatten(0, 1)
        rows, _, state = dispatcher.dispatch(flat, indices)
        if per_slot:
            rows = flat.unsqueeze(1).expand(18, 3, 8).reshape(-1, 8)[state.order]
        out_rows = rows * 1.5 + rows.square()  # a stand-in expert, nonlinear in its rows
        if per_slot:
            slots = out_rows.new_zeros(54, 8).index_copy(0, state.order, out_rows).view(2, 9, 3, 8)
            out = slots[..., 0, :] * w[..., :1]
            for k in range(1, 3):
                out = out + slots[..., k, :] * w[..., k : k + 1]
        else:
            out = dispatcher.combine(out_rows, w, state)
        (out * target).sum().backward()
        return out, tokens.grad, w.grad

    for new, reference in zip(run(per_slot=False), run(per_slot=True), strict=True):
        assert torch.equal(new, reference)
