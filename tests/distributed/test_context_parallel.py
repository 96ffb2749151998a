"""Context parallel parity: every cp layout trains like one process on the whole batch,
with plain causal attention and with document masking.

Each cp rank keeps 2 of 2·cp chunks of every sequence (head-tail), applies RoPE at the global
positions and attends over the whole sequences' keys and values, all-gathered (the default),
passed around the ring or re-split over heads (distributed.cp_mode), under a mask by global
positions (and document ids). The cp ranks read the same batches, so each layout runs the
reference's global batch of 8 with batch_size = 8 / (data ranks). Each mode meets the other
dimensions somewhere: FSDP over cp (all), pp (all three), tp (all-to-all; all-gather in
test_moe_parity.py), ep and MoE (ring, all-to-all), full AC (ring), compile (all three), MLA
(test_deepseek_parity.py: all three)."""

import pytest

from tests.distributed.parity import (
    GLOBAL_BATCH,
    SAVE,
    STEPS,
    WINDOWED,
    assert_parity,
    copy_to_resume,
    records,
)
from tests.distributed.test_moe_parity import MOE, assert_moe_parity
from tests.distributed.test_parity import QWEN3

LAYOUTS = {
    # Saves checkpoints: test_checkpoint_from_cp_resumes_in_one_process continues them.
    "cp=2": (2, ["--distributed.cp=2", "--train.batch_size=8", SAVE]),
    # Ring attention over four ranks: each rank's keys and values travel three steps in
    # forward and again in backward, recomputed (with the ring) under full activation
    # checkpointing.
    "cp=4 ring, full AC": (
        4,
        [
            "--distributed.cp=4",
            "--distributed.cp_mode=ring",
            "--train.batch_size=8",
            "--train.activation_checkpointing=full",
        ],
    ),
    # All-to-all over heads (DeepSpeed-Ulysses): 2 of the 4 query heads and 1 of the 2 KV heads
    # per rank, over the whole sequence.
    "cp=2 all-to-all x dp_shard=2, Qwen3-shaped": (
        4,
        ["--distributed.cp=2", "--distributed.cp_mode=all_to_all", "--train.batch_size=4"],
    ),
    "cp=2 all-to-all x tp=2, sliding window and sinks": (
        4,
        [
            "--distributed.cp=2",
            "--distributed.cp_mode=all_to_all",
            "--distributed.tp=2",
            "--train.batch_size=8",
        ],
    ),
    "cp=2 x pp=2": (4, ["--distributed.cp=2", "--distributed.pp=2", "--train.batch_size=8"]),
    # The other two modes under a pipeline, one per mask (each mode meets both masks above).
    "cp=2 x pp=2, ring (causal) and all-to-all (document mask)": (
        4,
        [
            "--distributed.cp=2",
            "--distributed.cp_mode=ring",
            "--distributed.pp=2",
            "--train.batch_size=8",
        ],
    ),
}
MASKS = {"causal": (), "document mask": ("--data.document_mask=true",)}
# A layout's overrides under one of the masks, after its own (they win).
MASK_OVERRIDES = {
    ("cp=2 x pp=2, ring (causal) and all-to-all (document mask)", "document mask"): (
        "--distributed.cp_mode=all_to_all",
    ),
}
# The model of a layout where it is not the debug one: Qwen3-shaped (test_parity.py's QWEN3).
MODELS = {
    "cp=2 all-to-all x dp_shard=2, Qwen3-shaped": QWEN3,
    # Each tp rank's 2 query and 2 KV heads (4 KV heads: as many as query heads) split over
    # cp; a window over the whole sequence; sinks split over tp, then over cp with their heads.
    "cp=2 all-to-all x tp=2, sliding window and sinks": (*WINDOWED, "--model.n_kv_heads=4"),
}


def masked(mask, demo_data):
    """The overrides of `mask`; the masked runs also evaluate at steps 5 and 10 (eval batches
    are split over the cp ranks like training ones)."""
    if mask == "causal":
        return ()
    return (*MASKS[mask], "--eval.interval=5", "--eval.steps=1", f"--eval.path={demo_data}")


@pytest.mark.parametrize("mask", MASKS, ids=list(MASKS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_context_parallel_layout_matches_one_process(layout, mask, runs, references, demo_data):
    nproc, overrides = LAYOUTS[layout]
    model = MODELS.get(layout, ())
    mode = MASK_OVERRIDES.get((layout, mask), ())
    got = records(runs(nproc, *overrides, *mode, *model, *masked(mask, demo_data)))
    expected = references(*model, *masked(mask, demo_data))
    assert_parity(got, expected)
    for step in (5, 10) if mask != "causal" else ():
        assert got[step]["eval/loss"] == pytest.approx(expected[step]["eval/loss"], rel=1e-5)


def test_the_document_mask_changes_the_run(references, demo_data):
    """The masked comparisons have teeth: by step 5 masking moves the gradient norms of the
    first attention layer by ~1% of themselves, a hundred times the tolerance."""
    plain, with_mask = references(), references(*masked("document mask", demo_data))
    name = "layers.0.attention.wk.weight"
    a, b = plain[5]["param_grad_norms"][name], with_mask[5]["param_grad_norms"][name]
    assert abs(a - b) > 100 * 1e-5 * abs(b)


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_moe_with_expert_parallel_matches_one_process(mode, runs):
    """debug_moe at cp=2 × ep=2: each cp rank routes its chunks of the sequences; the Switch
    loss's expert counts are summed over the cp ranks too, the sequence-wise loss's over the
    parts of each sequence. (MoE blocks under the all-gather: test_moe_parity.py's compiled
    cp=2 × tp=2 layout.)"""
    cp = ("--distributed.cp=2", f"--distributed.cp_mode={mode}", "--distributed.ep=2")
    got = records(runs(4, *cp, "--train.batch_size=4", *MOE))
    expected = records(runs(1, f"--train.batch_size={GLOBAL_BATCH}", *MOE))
    assert_moe_parity(got, expected)


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_compiled_blocks_match_one_process(mode, runs, references):
    """Blocks compiled around the exchange: the ring's sends and receives run eagerly inside
    the compiled block (a graph break), the all-to-alls are traced (functional collectives);
    the all-gather's compiled layout is test_moe_parity.py's."""
    cp = ("--distributed.cp=2", f"--distributed.cp_mode={mode}", "--train.batch_size=8")
    got = records(runs(2, *cp, "--train.compile=true"))
    assert_parity(got, references())


def test_checkpoint_from_cp_resumes_in_one_process(reference, runs, train, tmp_path):
    """Saved at cp=2 (FSDP shards over the two cp ranks), resumed in one process at step 6."""
    nproc, overrides = LAYOUTS["cp=2"]
    run = tmp_path / "run"
    step_5 = copy_to_resume(runs(nproc, *overrides), run)
    assert len(list(step_5.glob("*.distcp"))) == 2
    (output,) = train(run, 1, f"--train.batch_size={GLOBAL_BATCH}")
    assert f"kiln: resumed from {step_5} (step 5)" in output
    assert_parity(records(run), reference, steps=range(6, STEPS + 1))
