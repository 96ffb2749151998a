"""Document masking under tensor and data parallelism reproduces one process.

A gloo job on a gang of two processes (workers.py) trains a few SGD steps on one fixed packed batch
in several layouts; the losses and full gradients of every step match a one-process run.
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from kiln.config import JobConfig, ModelConfig
from kiln.config.sections import DistributedConfig, TrainConfig
from kiln.model import build_model, materialize
from kiln.model.document_mask import document_ids
from kiln.model.names import canonical_name
from kiln.parallel.apply import apply_parallelism
from kiln.parallel.fsdp import gradient_average_compensation
from kiln.parallel.mesh import ParallelContext, init_parallel
from kiln.tokens import IGNORE_INDEX
from kiln.train.loss import count_valid, token_loss_sum

EOS = 0
STEPS = 3
BATCH, SEQ = 4, 64
MODEL = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden_dim=96, max_seq_len=64
)
LAYOUTS = {
    "tp=2": (DistributedConfig(tp=2), "none"),
    "tp=2, full AC": (DistributedConfig(tp=2), "full"),
    "dp_shard=2": (DistributedConfig(dp_shard=2), "none"),
}
TOLERANCE = 1e-5


def packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of 5 to 40 tokens, each ended by EOS, packed and cut into windows of SEQ + 1;
    as the loader does, the label after an EOS (the next document's first token) is ignored."""
    gen = torch.Generator().manual_seed(0)
    stream: list[torch.Tensor] = []
    while sum(map(len, stream)) < BATCH * (SEQ + 1):
        length = int(torch.randint(5, 41, (), generator=gen))
        stream += [torch.randint(1, MODEL.vocab_size, (length - 1,), generator=gen)]
        stream += [torch.tensor([EOS])]
    windows = torch.cat(stream)[: BATCH * (SEQ + 1)].view(BATCH, SEQ + 1)
    inputs, labels = windows[:, :-1], windows[:, 1:].clone()
    labels[inputs == EOS] = IGNORE_INDEX
    return inputs, labels


def train_steps(
    parallel: ParallelContext | None, activation_checkpointing: str, *, masked: bool = True
) -> list[dict]:
    """Losses and full gradients of STEPS SGD steps on the packed batch, in this layout."""
    degrees = parallel.degrees if parallel is not None else {"tp": 1}
    cfg = JobConfig(
        model=MODEL,
        train=TrainConfig(
            mixed_precision="fp32", activation_checkpointing=activation_checkpointing
        ),
        distributed=DistributedConfig(**{k: degrees[k] for k in ("tp", "dp_shard")})
        if parallel
        else DistributedConfig(dp_shard=1),
    )
    model = build_model(cfg.model)
    apply_parallelism(model, cfg, parallel)
    materialize(model, device="cpu", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    inputs, labels = packed_batch()
    valid = count_valid(labels)  # of the whole batch: the loss is over the global token count
    data_ranks, data_rank = (parallel.data_ranks, parallel.data_rank) if parallel else (1, 0)
    rows = slice(data_rank * BATCH // data_ranks, (data_rank + 1) * BATCH // data_ranks)
    inputs, labels = inputs[rows], labels[rows]
    compensation = gradient_average_compensation(parallel and parallel.fsdp_mesh())
    loss_context = loss_parallel if degrees["tp"] > 1 else contextlib.nullcontext
    records = []
    for _ in range(STEPS):
        kwargs = {"document_ids": document_ids(inputs, EOS)} if masked else {}
        with loss_context():
            loss = token_loss_sum(model(inputs, **kwargs), labels) / valid
            (loss * compensation).backward()
        loss = _full(loss.detach())
        if parallel is not None and parallel.data_group() is not None:
            dist.all_reduce(loss, group=parallel.data_group())
        grads = {canonical_name(n): _full(p.grad).clone() for n, p in model.named_parameters()}
        records.append({"loss": loss.item(), "grads": grads})
        optimizer.step()
        optimizer.zero_grad()
    return records


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _run_layouts(out_dir: str) -> None:
    """A job of a 2-process gang: every layout in turn in one process group; rank 0 saves."""
    for i, (dist_cfg, activation_checkpointing) in enumerate(LAYOUTS.values()):
        parallel = init_parallel(dist_cfg, torch.device("cpu"))
        records = train_steps(parallel, activation_checkpointing)
        if parallel.is_main:
            torch.save(records, os.path.join(out_dir, f"{i}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, gangs):
    out = tmp_path_factory.mktemp("document_mask")
    gangs.run(2, _run_layouts, str(out))
    return {name: torch.load(out / f"{i}.pt") for i, name in enumerate(LAYOUTS)}


@pytest.fixture(scope="module")
def reference():
    return train_steps(None, "none")


def test_the_mask_changes_the_gradients(reference):
    """The comparison has teeth: at init attention barely moves the loss, but its gradients
    change by most of their size when documents may see each other."""
    name = "layers.0.attention.wq.weight"
    unmasked = train_steps(None, "none", masked=False)[0]["grads"][name]
    masked = reference[0]["grads"][name]
    assert (unmasked - masked).norm() > 0.1 * masked.norm()


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_layout_matches_one_process(layout, layout_runs, reference):
    for step, (got, expected) in enumerate(zip(layout_runs[layout], reference, strict=True), 1):
        assert abs(got["loss"] - expected["loss"]) <= TOLERANCE * abs(expected["loss"]), step
        assert got["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            difference = (got["grads"][name] - grad).norm()
            assert difference <= TOLERANCE * grad.norm(), f"step {step} {name}: {difference}"
