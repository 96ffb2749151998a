"""Multi-token prediction against the DeepSeek-V3 report's formulas (section 2.2, eqs. 21-25),
written out here on the model's own weights, and its place in the training loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.config.sections import MLAConfig, ModelConfig, MoEConfig, MTPConfig
from kiln.model import build_model
from kiln.model.document_mask import document_ids
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


EOS = 1
# Each row's end-of-document positions in its window of 17 tokens: row 0 holds a document of
# two tokens (depth 2 has no target in it), row 1 ends one at its last input.
ENDS = ([3, 5, 11], [7, 15])


def model_and_batch():
    """The model and a packed batch under data.document_mask: inputs, labels (the one after an
    end of document masked, as the loader masks it), document ids and the windows of tokens."""
    torch.manual_seed(0)
    model = build_model(CFG, device="cpu")
    model.init_buffers()
    model.init_weights(seed=3)
    # Neither EOS nor 0 (the id a masked token ahead is embedded as) in the documents.
    tokens = torch.randint(2, CFG.vocab_size, (2, 17))
    for row, ends in enumerate(ENDS):
        tokens[row, ends] = EOS
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[inputs == EOS] = IGNORE_INDEX
    return model, inputs, labels, document_ids(inputs, EOS), tokens


def report_mtp_losses(model, tokens):
    """Per depth k, Σ CE(P^k_{i+k+1}, t_{i+k+1}) and the number of terms, by the report's
    formulas run on each document alone: depth k combines RMSNorm(h^{k-1}_i) with
    RMSNorm(Emb(t_{i+k})) through M_k, runs its block, and predicts t_{i+k+1} with the shared
    output head, for every i whose t_{i+k+1} is in i's document. No labels, no masks: a
    document is its tokens up to and with its EOS (or the window's end), at its positions in
    the window, and the main blocks see only it."""
    cos, sin = model.rope_cos, model.rope_sin
    depths = CFG.mtp.depth
    sums, counts = [torch.zeros(()) for _ in range(depths)], [0] * depths
    for window in tokens:
        ends = (window == EOS).nonzero().flatten().tolist()
        starts = [0] + [end + 1 for end in ends]
        for start, end in zip(starts, [*ends, len(window) - 1], strict=True):
            doc = window[start : end + 1].unsqueeze(0)
            n = doc.shape[1]
            if n < 3:  # no target at any depth
                continue
            # The model's inputs stop one short of the window: t_{n-1} is no input.
            h = model.tok_embeddings(doc[:, :-1])
            for index, block in model.layers.items():
                h = block(h, cos[start:], sin[start:], None, int(index))
            for k in range(1, depths + 1):
                depth = model.mtp.depths[str(k)]
                m = n - 1 - k  # the positions i < m have t_{i+k+1} in the document
                if m <= 0:
                    break
                embedded = model.tok_embeddings(doc[:, k : k + m])
                combined = depth.proj(
                    torch.cat([depth.embed_norm(embedded), depth.hidden_norm(h[:, :m])], -1)
                )
                h = depth.block(combined, cos[start:], sin[start:], None, CFG.n_layers + k - 1)
                logits = depth.norm(h) @ model.output.weight.T
                sums[k - 1] = sums[k - 1] + F.cross_entropy(
                    logits.flatten(0, 1), doc[0, k + 1 : k + 1 + m], reduction="sum"
                )
                counts[k - 1] += m
    return sums, counts


def test_mtp_losses_and_gradients_follow_the_report():
    """Under the document mask every depth predicts only inside a document: a depth-2 target
    whose chain crosses a boundary (from an EOS position, through a placeholder token ahead)
    is not counted, and nothing it computes reaches the loss or the gradients."""
    model, inputs, labels, ids, tokens = model_and_batch()
    scale = 1.0 / 32
    logits = model(inputs, document_ids=ids, labels=labels, loss_scale=LossScale(scale))
    main = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    (main * scale).backward()
    taken = model.take_losses()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # Id 0 is in no document: its embedding, the placeholder for a masked token ahead, reaches
    # no counted target (the model's masked attention and ignored targets give exact zeros).
    assert not grads["tok_embeddings.weight"][0].any()

    expected, counts = report_mtp_losses(model, tokens)
    # Documents of 4, 2, 6, 5 tokens in row 0 and 8, 8, 1 in row 1: one of n tokens has n - 1 - k
    # depth-k targets (if any). Predicting across boundaries, depth 2 would count 3 more (from the EOS
    # positions 5, 11 of row 0 and 7 of row 1).
    assert counts == [9 + 12, 6 + 10]
    for k, loss in enumerate(expected, start=1):
        loss_sum, tokens_counted = taken[f"mtp_loss_{k}"]
        assert tokens_counted == counts[k - 1]
        # fp32, the same operations per token, but on each document alone here and on the
        # window under a mask in the model (other matmul and attention shapes, and the model
        # sums the depths' losses first): a few roundings at most (16 ulps of headroom, which
        # another x86 CPU's matmul blocking stays within).
        torch.testing.assert_close(loss_sum, loss.detach(), rtol=1e-6, atol=0)
    plain = model(inputs, document_ids=ids)  # the main loss again, on a graph of its own
    main = F.cross_entropy(
        plain.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    total = main + CFG.mtp.loss_weight / CFG.mtp.depth * torch.stack(expected).sum()
    (total * scale).backward()
    for name, param in model.named_parameters():
        if param.grad is None:
            assert name not in grads
            continue
        # The same rounding differences as the losses', carried through the backward.
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert any(n.startswith("mtp.depths.2.") for n in grads)


def test_mtp_runs_only_in_training_forwards_with_labels():
    model, inputs, labels, ids, _ = model_and_batch()
    with torch.no_grad():
        plain = model(inputs, document_ids=ids)
        assert all(pair[0] == 0 for pair in model.take_losses().values())
        # The main logits do not depend on whether the extra depths ran.
        with_labels = model(inputs, document_ids=ids, labels=labels, loss_scale=LossScale(1.0))
    assert torch.equal(plain, with_labels)
    assert all(pair[0] == 0 for pair in model.take_losses().values())  # eval: not counted


def test_mtp_depths_are_blocks_to_the_parallel_code():
    """The plan names each depth after the main blocks with its layer index, so activation
    checkpointing wraps it by the blocks' rule (selective: even layer indices) and the model
    computes the same losses and gradients wrapped; a stage without the depths names none."""
    plan = family_of(CFG).parallel_plan(CFG)
    model, inputs, labels, ids, _ = model_and_batch()
    blocks = [(b.path, b.layer) for b in blocks_of(model, plan)]
    assert blocks == [("layers.0", 0), ("layers.1", 1), ("mtp.depths.1", 2), ("mtp.depths.2", 3)]
    first_stage = family_of(CFG).build(CFG, StageRole((0,), first=True, last=False))
    assert [b.path for b in blocks_of(first_stage, plan)] == ["layers.0"]

    def loss_and_grads(model):
        logits = model(inputs, document_ids=ids, labels=labels, loss_scale=LossScale(1.0))
        F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
        ).backward()
        return model.take_losses(), {canonical_name(n): p.grad for n, p in model.named_parameters()}

    expected = loss_and_grads(model)
    wrapped, *_ = model_and_batch()
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
