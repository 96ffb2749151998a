"""The chunked cross-entropy and the z-loss under sharding.

Parity: layouts running `train.loss = "chunked_cross_entropy"` reproduce one process running the
plain loss, under FSDP, tensor parallel (loss parallel inside each chunk) and pipeline parallel
(the last stage applies the head), and the z-loss reproduces one process under tensor parallel,
where its logsumexp spans the tp ranks' vocabulary shards, with the plain loss and the chunked.
Chunks of 48 tokens leave a ragged last chunk in every layout: 256 tokens per data rank (5 × 48
+ 16), 64 per pipeline micro-batch of one sequence (48 + 16).

At tp=2, on random tensors: the chunked loss's gradients equal one process's plain loss within
1e-6, and no tensor on a rank exceeds one chunk's logits on its vocabulary shard.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from kiln.tokens import IGNORE_INDEX
from kiln.train.loss import chunked_token_loss_sum, token_loss_sum
from tests.distributed.parity import GLOBAL_BATCH, assert_parity, records, schedule
from tests.largest_tensor import LargestTensor

CHUNKED = ("--train.loss=chunked_cross_entropy", "--train.loss_chunk_tokens=48")
Z_LOSS = ("--train.z_loss_weight=1e-3",)  # the reference runs it too

LAYOUTS = {
    "chunked, dp_shard=2": (2, ["--distributed.dp_shard=2", "--train.batch_size=4", *CHUNKED], ()),
    "chunked + z-loss, tp=2 x dp_shard=2": (
        4,
        ["--distributed.tp=2", "--train.batch_size=4", *CHUNKED],
        Z_LOSS,
    ),
    "z-loss, tp=2 x dp_shard=2": (4, ["--distributed.tp=2", "--train.batch_size=4"], Z_LOSS),
    "z-loss, tp=2": (2, ["--distributed.tp=2", f"--train.batch_size={GLOBAL_BATCH}"], Z_LOSS),
    "chunked, pp=2 1f1b": (
        2,
        [
            "--distributed.pp=2",
            *schedule("1f1b"),
            f"--train.batch_size={GLOBAL_BATCH}",
            *CHUNKED,
        ],
        (),
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_layout_matches_one_process_with_the_plain_loss(layout, references, runs):
    nproc, overrides, model = LAYOUTS[layout]
    assert_parity(records(runs(nproc, *overrides, *model)), references(*model))


def test_tensor_parallel_chunks_hold_one_shard_of_one_chunk(gangs):
    gangs.run(2, check_tensor_parallel_chunks)


ROWS, SEQ, DIM, VOCAB, CHUNK = 2, 40, 16, 600, 30  # 80 tokens: a ragged last chunk of 20


def check_tensor_parallel_chunks() -> None:
    """A gang job at tp=2: the final norm's output split by sequence, the head by vocabulary,
    as the model's plan leaves them."""
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(ROWS, SEQ, DIM, generator=generator)
        weight = torch.randn(VOCAB, DIM, generator=generator) * 0.5
        labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
        labels[0, :35] = IGNORE_INDEX
        for per_row in (False, True):
            kwargs = {"z_loss_weight": 1e-2, "per_row": per_row}
            # One process, plain loss.
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            expected = token_loss_sum(F.linear(h, w), labels, **kwargs)
            expected.sum().backward()
            # tp=2, chunked.
            h_tp = distribute_tensor(hidden, mesh, [Shard(1)]).requires_grad_()
            w_tp = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
            with loss_parallel(), LargestTensor() as largest:
                got = chunked_token_loss_sum(h_tp, w_tp, labels, chunk_tokens=CHUNK, **kwargs)
                got.sum().backward()
            assert largest.numel == CHUNK * VOCAB // 2, largest.numel
            pairs = [(got, expected), (h_tp.grad, h.grad), (w_tp.grad, w.grad)]
            for a, b in pairs:
                a = a.full_tensor()
                assert (a - b).abs().max() <= 1e-6 * b.abs().max(), (a - b).abs().max()
    finally:
        dist.destroy_process_group()
