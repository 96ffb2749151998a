"""The chunked loss (train.loss = "chunked_cross_entropy") computes the plain loss of the head's
logits, with its gradients, without ever holding the logits of all tokens."""

import pytest
import torch
import torch.nn.functional as F

from kiln.checkpoint.fingerprint import run_fingerprint
from kiln.config import load_config
from kiln.config.validate import collect_problems
from kiln.plan.activations import LOGIT_BYTES
from kiln.plan.memory import estimate_memory
from kiln.tokens import IGNORE_INDEX
from kiln.train.loss import chunked_token_loss_sum, token_loss_sum
from tests.conftest import DEBUG_CONFIG
from tests.largest_tensor import LargestTensor
from tests.unit.test_trainer import make_trainer

ROWS, SEQ, DIM, VOCAB = 3, 37, 16, 500  # 111 tokens: chunks of 25 leave a ragged 11


def inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, SEQ, DIM, generator=generator)
    weight = torch.randn(VOCAB, DIM, generator=generator) * 0.5
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    labels[0, :30] = IGNORE_INDEX  # a whole chunk and part of the next
    labels[2, -5:] = IGNORE_INDEX  # in the ragged last chunk
    labels[1, ::7] = IGNORE_INDEX
    return hidden, weight, labels


def loss_and_grads(loss_fn, hidden, weight, labels):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    losses = loss_fn(hidden, weight, labels)
    # Normalized as the trainer does; per_row sums weighted differently so each row counts.
    scale = torch.arange(1, losses.numel() + 1, dtype=losses.dtype).view(losses.shape)
    (losses * scale).sum().div((labels != IGNORE_INDEX).sum()).backward()
    return losses.detach(), hidden.grad, weight.grad


def plain(hidden, weight, labels, **kwargs):
    return token_loss_sum(F.linear(hidden, weight), labels, **kwargs)


@pytest.mark.parametrize("per_row", [False, True], ids=["sum", "per_row"])
@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2], ids=["ce", "ce+z"])
@pytest.mark.parametrize("chunk", [25, 111, 1000])
def test_gradients_equal_the_unchunked_loss(per_row, z_loss_weight, chunk):
    kwargs = {"z_loss_weight": z_loss_weight, "per_row": per_row}
    data = inputs()
    expected = loss_and_grads(lambda h, w, y: plain(h, w, y, **kwargs), *data)
    got = loss_and_grads(
        lambda h, w, y: chunked_token_loss_sum(h, w, y, chunk_tokens=chunk, **kwargs), *data
    )
    assert got[0].shape == ((ROWS,) if per_row else ())
    for a, b in zip(got, expected, strict=True):
        # Measured: hidden states and per_row losses bitwise equal, the head weight within
        # 2.8e-7 relative and the summed loss 1e-7 (the order of additions).
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
    # Ignored tokens get no gradient.
    assert got[1][0, :30].abs().max() == 0


def test_no_grad_gives_the_same_loss():
    hidden, weight, labels = inputs(1)
    with torch.no_grad():
        got = chunked_token_loss_sum(hidden, weight, labels, chunk_tokens=25, z_loss_weight=1e-3)
    expected = plain(hidden, weight, labels, z_loss_weight=1e-3)
    assert torch.allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("per_row", [False, True], ids=["sum", "per_row"])
def test_the_logits_of_all_tokens_never_exist(per_row):
    """Every tensor created in forward and backward, the recomputed logits included, is at most
    one chunk's logits; the plain loss creates the full logits (tokens × vocab)."""
    hidden, weight, labels = inputs(2)
    tokens, chunk = ROWS * SEQ, 25
    kwargs = {"z_loss_weight": 1e-3, "per_row": per_row}

    def largest(loss_fn):
        with LargestTensor() as mode:
            loss_and_grads(loss_fn, hidden, weight, labels)
        return mode.numel

    chunked = largest(lambda h, w, y: chunked_token_loss_sum(h, w, y, chunk_tokens=chunk, **kwargs))
    assert chunked == chunk * VOCAB
    assert largest(lambda h, w, y: plain(h, w, y, **kwargs)) == tokens * VOCAB


def test_autocast_runs_the_head_in_bf16_like_the_model():
    hidden, weight, labels = inputs(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(
            lambda h, w, y: chunked_token_loss_sum(h, w, y, chunk_tokens=25), hidden, weight, labels
        )
        expected = loss_and_grads(plain, hidden, weight, labels)
    for a, b in zip(got, expected, strict=True):
        # bf16 keeps 8 bits (a rounding moves a value by up to 2^-9 = 2e-3 of it): the chunked
        # head weight's gradient is rounded once per chunk (5) and as the chunks are summed,
        # the plain one once. Measured: loss and hidden gradient bitwise equal, the weight
        # gradient within 3.0e-3 of its largest element (3.0-4.9e-3 over seeds 3-6), about 2
        # roundings; 1e-2 allows 5. Another CPU's kernels only flip a rare last bf16 bit.
        assert (a - b).abs().max() <= 1e-2 * b.abs().max()
    fp32 = loss_and_grads(plain, hidden, weight, labels)
    assert not torch.equal(got[0], fp32[0])  # bf16 logits, not fp32


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_training_steps_match_the_plain_loss(debug_overrides, tmp_path, tied):
    """Through the trainer: the model ends at the final norm, the loss applies the head (the
    embedding when tied); losses and gradient norms step by step as with the plain loss."""
    model = [f"--model.tie_embeddings={str(tied).lower()}", "--train.z_loss_weight=1e-3"]
    plain_run = make_trainer(debug_overrides, *model)
    chunked_run = make_trainer(
        debug_overrides,
        *model,
        f"--metrics.run_dir={tmp_path / 'chunked'}",
        "--train.loss=chunked_cross_entropy",
        "--train.loss_chunk_tokens=100",  # 512 tokens: 6 chunks, the last of 12
    )
    assert not chunked_run.step_fn.forward_options["apply_head"]
    for _ in range(4):
        loss_a, norm_a, *_ = plain_run.train_step()
        loss_b, norm_b, *_ = chunked_run.train_step()
        assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-6)
        assert norm_b.item() == pytest.approx(norm_a.item(), rel=1e-5)


def test_chunk_size_must_be_positive():
    cfg = load_config(DEBUG_CONFIG, ["--train.loss=chunked_cross_entropy"])
    cfg.train.loss_chunk_tokens = 0
    problems = collect_problems(cfg, 1)
    assert problems == [
        "train.loss_chunk_tokens must be positive (the tokens whose logits the chunked loss "
        "holds at once), got 0"
    ]


def test_switching_to_the_chunked_loss_resumes_the_same_run():
    plain_cfg = load_config(DEBUG_CONFIG, [])
    chunked_cfg = load_config(
        DEBUG_CONFIG, ["--train.loss=chunked_cross_entropy", "--train.loss_chunk_tokens=64"]
    )
    assert run_fingerprint(plain_cfg, global_batch=8) == run_fingerprint(
        chunked_cfg, global_batch=8
    )


def test_memory_estimate_counts_one_chunk_of_logits():
    """`kiln check`: the fp32 logits and their gradients of one chunk, not of all tokens."""
    degrees = {"pp": 1, "tp": 1, "cp": 1, "ep": 1, "dp_shard": 1, "dp_replicate": 1}
    plain_cfg = load_config(DEBUG_CONFIG, [])  # 4 x 128 tokens per micro-batch
    chunked_cfg = load_config(
        DEBUG_CONFIG, ["--train.loss=chunked_cross_entropy", "--train.loss_chunk_tokens=64"]
    )
    saved = (
        estimate_memory(plain_cfg, degrees).logits - estimate_memory(chunked_cfg, degrees).logits
    )
    assert saved == LOGIT_BYTES * (512 - 64) * plain_cfg.model.vocab_size
