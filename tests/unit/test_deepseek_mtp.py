"""Multi-token prediction against the DeepSeek-V3 report's formulas (section 2.2, eqs. 21-25),
written out here on the model's own weights, and its place in the training loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.config.sections import MLAConfig, ModelConfig, MoEConfig, MTPConfig
from kiln.model import build_model
from kiln.model.forward_args import LossScale, StageRole
from kiln.model.names import canonical_name
from kiln.model.parallel_plan import blocks_of
from kiln.model.registry import family_of
from kiln.parallel.activation_checkpoint import apply_activation_checkpointing
from kiln.tokens import IGNORE_INDEX

CFG = ModelConfig(
    family="deepseek_v3",
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    vocab_size=96,
    ffn_hidden_dim=96,
    max_seq_len=64,
    norm_eps=1e-6,
    mla=MLAConfig(
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    ),
    mtp=MTPConfig(depth=2, loss_weight=0.3),
    moe=MoEConfig(
        num_experts=4,
        top_k=2,
        first_dense_layers=1,
        ffn_hidden_dim=32,
        shared_experts=1,
        router="sigmoid",
        route_scale=2.5,
    ),
)


def model_and_batch():
    torch.manual_seed(0)
    model = build_model(CFG, device="cpu")
    model.init_buffers()
    model.init_weights(seed=3)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[1, 5] = IGNORE_INDEX  # a masked label: no target there, nor one depth later
    return model, inputs, labels


def report_mtp_losses(model, inputs, labels):
    """Σ_i CE(P^k_{i+k+1}, t_{i+k+1}) for k = 1..D, by the report's formulas: depth k combines
    RMSNorm(h^{k-1}_i) with RMSNorm(Emb(t_{i+k})) through M_k, runs its block, and predicts
    t_{i+k+1} with the shared output head. Here t = (inputs[0], labels...): t_{i+1} = labels[i]."""
    cos, sin = model.rope_cos, model.rope_sin
    h = model.tok_embeddings(inputs)
    for index, block in model.layers.items():
        h = block(h, cos, sin, None, int(index))
    seq, losses = inputs.shape[1], []
    for k in range(1, CFG.mtp.depth + 1):
        depth = model.mtp.depths[str(k)]
        # Positions i whose token ahead t_{i+k} = labels[i+k-1] exists; the last k - 1 have none.
        ahead = torch.full_like(labels, IGNORE_INDEX)
        ahead[:, : seq - k + 1] = labels[:, k - 1 :]
        target = torch.full_like(labels, IGNORE_INDEX)
        target[:, : seq - k] = labels[:, k:]
        target[ahead == IGNORE_INDEX] = IGNORE_INDEX
        embedded = model.tok_embeddings(ahead.clamp(min=0))
        combined = depth.proj(torch.cat([depth.embed_norm(embedded), depth.hidden_norm(h)], -1))
        h = depth.block(combined, cos, sin, None, CFG.n_layers + k - 1)
        logits = depth.norm(h) @ model.output.weight.T
        losses.append(
            F.cross_entropy(
                logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        )
    return losses


def test_mtp_losses_and_gradients_follow_the_report():
    model, inputs, labels = model_and_batch()
    scale = 1.0 / 32
    logits = model(inputs, labels=labels, loss_scale=LossScale(scale))
    main = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    (main * scale).backward()
    taken = model.take_losses()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    expected = report_mtp_losses(model, inputs, labels)
    # Depth k has targets at the seq - k first positions of each row (16 - k in row 0); in row
    # 1 the masked label 5 removes two of them: the one it is the target of and the one whose
    # token ahead it is.
    counts = {1: 15 + 13, 2: 14 + 12}
    for k, loss in enumerate(expected, start=1):
        loss_sum, tokens = taken[f"mtp_loss_{k}"]
        # The same operations on the same weights in the same order: equal up to the fp32
        # rounding of one reduction (the model sums the depths' losses first).
        assert torch.allclose(loss_sum, loss.detach(), rtol=1e-6)
        assert tokens == counts[k]
    plain = model(inputs)  # the main loss again, on a graph of its own
    main = F.cross_entropy(
        plain.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    total = main + CFG.mtp.loss_weight / CFG.mtp.depth * torch.stack(expected).sum()
    (total * scale).backward()
    for name, param in model.named_parameters():
        if param.grad is None:
            assert name not in grads
            continue
        # Same graph, summed in another order: fp32 rounding of a few additions.
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert any(n.startswith("mtp.depths.2.") for n in grads)


def test_mtp_runs_only_in_training_forwards_with_labels():
    model, inputs, labels = model_and_batch()
    with torch.no_grad():
        plain = model(inputs)
        assert all(pair[0] == 0 for pair in model.take_losses().values())
        # The main logits do not depend on whether the extra depths ran.
        with_labels = model(inputs, labels=labels, loss_scale=LossScale(1.0))
    assert torch.equal(plain, with_labels)
    assert all(pair[0] == 0 for pair in model.take_losses().values())  # eval: not counted


def test_mtp_depths_are_blocks_to_the_parallel_code():
    """The plan names each depth after the main blocks with its layer index, so activation
    checkpointing wraps it by the blocks' rule (selective: even layer indices) and the model
    computes the same losses and gradients wrapped; a stage without the depths names none."""
    plan = family_of(CFG).parallel_plan(CFG)
    model, inputs, labels = model_and_batch()
    blocks = [(b.path, b.layer) for b in blocks_of(model, plan)]
    assert blocks == [("layers.0", 0), ("layers.1", 1), ("mtp.depths.1", 2), ("mtp.depths.2", 3)]
    first_stage = family_of(CFG).build(CFG, StageRole((0,), first=True, last=False))
    assert [b.path for b in blocks_of(first_stage, plan)] == ["layers.0"]

    def loss_and_grads(model):
        logits = model(inputs, labels=labels, loss_scale=LossScale(1.0))
        F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
        ).backward()
        return model.take_losses(), {canonical_name(n): p.grad for n, p in model.named_parameters()}

    expected = loss_and_grads(model)
    wrapped, _, _ = model_and_batch()
    apply_activation_checkpointing(wrapped, plan, "selective")
    assert [type(wrapped.mtp.depths[k]).__name__ for k in ("1", "2")] == [
        "CheckpointWrapper",
        "MTPDepth",
    ]
    losses, grads = loss_and_grads(wrapped)
    # The same operations in the same order, recomputed: exact.
    assert all(torch.equal(losses[k], expected[0][k]) for k in losses)
    assert grads.keys() == expected[1].keys()
    assert all(torch.equal(grads[n], expected[1][n]) for n in grads)
