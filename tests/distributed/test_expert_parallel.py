"""Expert parallel: the all-to-all dispatcher (exact against the local one) and every layout with
`ep` against one process on the same global batch: loss, gradient norm, every
parameter's gradient norm and the MoE records (expert biases and loads equal, balancing losses
within the parity tolerance), for both routers, with and without full activation checkpointing
and with a capacity factor; then checkpoints saved at ep=2 × dp_shard=2 resumed at other expert
degrees and in one process.

Routers: softmax top-k with the Switch load-balance loss and the router z-loss (no shared
expert, as Mixtral), and sigmoid scores with auxiliary-loss-free bias balancing, the sequence-wise
loss and a shared expert (as DeepSeek-V3). The Switch loss takes its expert fractions from the
counts of a whole micro-batch, summed over the ranks that hold it; the ep ranks read different
sequences, so one process matches where its micro-batches are those unions: batch 8 against
ep × dp ranks reading 8 sequences together. Where they are not (a pipeline splits each rank's
batch into micro-batches; a capacity factor drops per rank, so its reference runs each rank's
sequences as a micro-batch of their own), the Switch loss is off and its logged value, taken
over other micro-batches than one process's, is not compared."""

import pytest
import torch

from kiln.checkpoint import load_checkpoint, read_model_config, resolve_checkpoint
from kiln.checkpoint.hf_convert import kiln_to_hf
from kiln.model import build_model, materialize
from tests.distributed.expert_dispatch_worker import check_dispatch
from tests.distributed.parity import (
    GPT_OSS_BLOCK,
    SAVE,
    STEPS,
    assert_parity,
    copy_to_resume,
    records,
)
from tests.distributed.test_moe_parity import moe_mismatches

SOFTMAX = (
    "--model.preset=debug_moe",
    "--model.moe.shared_experts=0",
    "--model.moe.aux_loss_weight=0.01",
    "--model.moe.router_z_loss_weight=0.001",
)
SIGMOID = (
    "--model.preset=debug_moe",
    "--model.moe.router=sigmoid",
    "--model.moe.shared_experts=1",
    "--model.moe.aux_loss_weight=0",
    "--model.moe.seq_aux_loss_weight=0.01",
    "--model.moe.router_z_loss_weight=0",
    "--model.moe.bias_update_rate=0.01",
)
NO_SWITCH_LOSS = ("--model.moe.aux_loss_weight=0",)
# Qwen3-MoE's attention (docs/models.md): 4 heads of 48 on dim 128, per-head q/k norms.
QWEN3_ATTENTION = ("--model.head_dim=48", "--model.qk_norm=true")
WHOLE_BATCH = ("--train.batch_size=8",)
L4 = ("--model.n_layers=4",)
PIPELINE = ("--distributed.pp=2", "--distributed.pp_microbatches=2", "--train.batch_size=4", *L4)

# name: (processes, overrides, router, reference overrides)
LAYOUTS = {
    "ep=2": (2, ["--distributed.ep=2", "--train.batch_size=4"], SOFTMAX, WHOLE_BATCH),
    "ep=2, sigmoid router": (
        2,
        ["--distributed.ep=2", "--train.batch_size=4"],
        SIGMOID,
        WHOLE_BATCH,
    ),
    "ep=4": (4, ["--distributed.ep=4", "--train.batch_size=2"], SIGMOID, WHOLE_BATCH),
    # Saves checkpoints, which other expert degrees resume from.
    "ep=2 x dp_shard=2": (
        4,
        ["--distributed.ep=2", "--distributed.dp_shard=2", "--train.batch_size=2", SAVE],
        SOFTMAX,
        WHOLE_BATCH,
    ),
    "ep=2 x dp_replicate=2": (
        4,
        ["--distributed.ep=2", "--distributed.dp_replicate=2", "--train.batch_size=2"],
        SIGMOID,
        WHOLE_BATCH,
    ),
    # Qwen3-MoE's attention with gpt-oss's block options on top (parity.py's GPT_OSS_BLOCK):
    # the experts' biases split over the ep ranks with their weights.
    "ep=2 x tp=2, Qwen3-MoE-shaped, gpt-oss block": (
        4,
        ["--distributed.ep=2", "--distributed.tp=2", "--train.batch_size=4"],
        (*SOFTMAX, *QWEN3_ATTENTION, *GPT_OSS_BLOCK),
        WHOLE_BATCH,
    ),
    "ep=2 x pp=2 1f1b": (
        4,
        ["--distributed.ep=2", *PIPELINE, "--distributed.pp_schedule=1f1b"],
        (*SOFTMAX, *NO_SWITCH_LOSS),
        (*WHOLE_BATCH, *L4),
    ),
    "ep=2 x pp=2 interleaved_1f1b": (
        4,
        [
            "--distributed.ep=2",
            *PIPELINE,
            "--distributed.pp_schedule=interleaved_1f1b",
            "--distributed.pp_virtual_stages=2",
        ],
        SIGMOID,
        (*WHOLE_BATCH, *L4),
    ),
    "ep=2 x tp=2 x dp_shard=2": (
        8,
        [
            "--distributed.ep=2",
            "--distributed.tp=2",
            "--distributed.dp_shard=2",
            "--train.batch_size=2",
        ],
        SIGMOID,
        WHOLE_BATCH,
    ),
    "ep=2, full AC": (
        2,
        ["--distributed.ep=2", "--train.batch_size=4", "--train.activation_checkpointing=full"],
        SOFTMAX,
        WHOLE_BATCH,
    ),
    "ep=2, full AC, sigmoid router": (
        2,
        ["--distributed.ep=2", "--train.batch_size=4", "--train.activation_checkpointing=full"],
        SIGMOID,
        WHOLE_BATCH,
    ),
    # Each rank's 4 sequences are the reference's micro-batch: the same tokens compete for the
    # same capacity (ceil(1.0 · 256 · 2 / 8) = 64 assignments per expert).
    "ep=2, capacity factor 1.0": (
        2,
        ["--distributed.ep=2", "--train.batch_size=4"],
        (*SOFTMAX, *NO_SWITCH_LOSS, "--model.moe.capacity_factor=1.0"),
        ("--train.batch_size=4", "--train.grad_accum_steps=2"),
    ),
}


# Layouts whose micro-batches are not one process's (see the module doc).
OTHER_MICRO_BATCHES = {
    "ep=2 x pp=2 1f1b",
    "ep=2 x pp=2 interleaved_1f1b",
    "ep=2, capacity factor 1.0",
}


def assert_expert_parallel_parity(
    got, expected, *, switch_loss_compared=True, steps=range(1, STEPS + 1)
):
    assert_parity(got, expected, steps=steps)
    not_compared = set() if switch_loss_compared else {"moe/load_balance_loss"}
    for step in steps:
        found = moe_mismatches(got[step], expected[step])
        assert not set(found) - not_compared, f"step {step}: MoE records differ: {found}"


@pytest.mark.parametrize("nproc", [2, 4])
def test_all_to_all_dispatch_equals_local_dispatch(nproc, gangs):
    """Without and with a capacity factor, in one job."""
    gangs.run(nproc, check_dispatch, 0.0, 1.0)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_expert_parallel_layout_matches_one_process(layout, runs):
    nproc, overrides, router, reference_overrides = LAYOUTS[layout]
    got = records(runs(nproc, *overrides, *router))
    expected = records(runs(1, *reference_overrides, *router))
    assert_expert_parallel_parity(
        got, expected, switch_loss_compared=layout not in OTHER_MICRO_BATCHES
    )
    ep = int(next(o for o in overrides if o.startswith("--distributed.ep=")).split("=")[1])
    # The exchanges moved something, and each rank received what the others sent it.
    last = got[max(got)]
    assert len(last["ep/sent_tokens"]) == ep and sum(last["ep/sent_tokens"]) > 0
    assert sum(last["ep/sent_tokens"]) == sum(last["ep/received_tokens"])
    assert sum(last["ep/sent_bytes"]) == sum(last["ep/received_bytes"])
    if "--model.moe.capacity_factor=1.0" in router:
        # Some expert got more than the mean, so more than its capacity: tokens were dropped.
        assert max(expected[step]["moe/imbalance_max"] for step in expected) > 1.0


def test_recomputed_forwards_count_no_tokens_but_move_bytes(runs):
    """Full activation checkpointing repeats each block's forward, exchanges included, in the
    backward: the same routing, so the same token counts as without it, and half as many bytes
    again (the forward's two exchanges of the four). Rows of 128 fp32 numbers."""
    plain, recomputed = (layout_records(runs, name) for name in ("ep=2", "ep=2, full AC"))
    for step in plain:
        sent, received = plain[step]["ep/sent_tokens"], plain[step]["ep/received_tokens"]
        assert recomputed[step]["ep/sent_tokens"] == sent
        moved = [(s + r) * 128 * 4 for s, r in zip(sent, received, strict=True)]
        assert plain[step]["ep/sent_bytes"] == [2 * m for m in moved]
        assert recomputed[step]["ep/sent_bytes"] == [3 * m for m in moved]


def layout_records(runs, name):
    nproc, overrides, router, _ = LAYOUTS[name]
    return records(runs(nproc, *overrides, *router))


# Saved by the ep=2 x dp_shard=2 run (its checkpoint at step 5), resumed at step 6.
RESUMED_IN = {
    "ep=4": (4, ["--distributed.ep=4", "--train.batch_size=2"]),
    "ep=1 x dp_shard=4": (4, ["--distributed.dp_shard=4", "--train.batch_size=2"]),
    "one process": (1, ["--train.batch_size=8"]),
}


@pytest.mark.parametrize("layout", RESUMED_IN, ids=list(RESUMED_IN))
def test_checkpoint_resumes_at_another_expert_degree(layout, runs, train, tmp_path):
    nproc, overrides, router, reference_overrides = LAYOUTS["ep=2 x dp_shard=2"]
    run = tmp_path / "run"
    step_5 = copy_to_resume(runs(nproc, *overrides, *router), run)
    assert len(list(step_5.glob("*.distcp"))) == 4
    nproc, overrides = RESUMED_IN[layout]
    (output, *_) = train(run, nproc, *overrides, *router)
    assert f"kiln: resumed from {step_5} (step 5)" in output
    expected = records(runs(1, *reference_overrides, *router))
    assert_expert_parallel_parity(records(run), expected, steps=range(6, STEPS + 1))


# debug_moe shaped as each family can express it (Mixtral: every block MoE; Qwen3-MoE: q/k norms).
EXPORTS = {
    "MixtralForCausalLM": ("--model.moe.first_dense_layers=0", "--model.moe.shared_experts=0"),
    "Qwen3MoeForCausalLM": ("--model.qk_norm=true", "--model.moe.shared_experts=0"),
}


@pytest.mark.parametrize("hf_class", EXPORTS)
def test_hf_export_of_an_expert_parallel_checkpoint(hf_class, train, tmp_path):
    """Trained 2 steps at ep=2 × dp_shard=2 (each rank holding half the experts, sharded again
    by FSDP), exported with `kiln convert kiln-to-hf`: transformers gives kiln's logits."""
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    layout = ("--distributed.ep=2", "--distributed.dp_shard=2", "--train.batch_size=1")
    short = ("--train.seq_len=32", "--checkpoint.interval=2", "--scheduler.warmup_steps=1")
    train(run, 4, "--model.preset=debug_moe", *EXPORTS[hf_class], *layout, *short, steps=2)
    step_dir = resolve_checkpoint(run / "checkpoints")
    out = kiln_to_hf(run / "checkpoints", tmp_path / "hf")
    cfg = read_model_config(step_dir)
    kiln_model = materialize(build_model(cfg), device="cpu", seed=None)
    load_checkpoint(step_dir, model=kiln_model)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(hf_model).__name__ == hf_class
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf_model.eval()(tokens).logits - kiln_model.eval()(tokens)).abs().max().item()
    assert diff <= 1e-4
