"""One run carried through four layouts: a Hugging Face model converted to kiln is the
warm start of a `dp_shard=4` job, whose checkpoints resume as `tp=2 × dp_shard=2`, then
`pp=2 × dp_shard=2`, then one process; every step matches one process that ran it all, and
`kiln average` of the last two (pp=2 × dp_shard=2 and one process) is their exact mean."""

from __future__ import annotations

import pytest
import torch

from kiln.checkpoint.hf_convert import hf_to_kiln
from kiln.cli import main
from tests.distributed.parity import GLOBAL_BATCH, assert_parity, records
from tests.unit.test_checkpoint_average import assert_exact_average

transformers = pytest.importorskip("transformers")

SEGMENT = 2
# Loss and global gradient norm keep the parity tolerance (1e-5) through all four layouts. The
# per-parameter norms get 1e-3: rounding noise passes through three optimizer-state reloads and
# Adam amplifies it on the rows and norm weights whose second moments are smallest (measured: 4e-6
# at step 7, 2e-4 on layers.0.ffn_norm.weight at step 8, with loss and global norm within 4e-7).
# A real mistake moves them by 10-45% (see test_mutations.py).
CHAIN_PARAM_TOLERANCE = 1e-3
LAYOUTS = [
    (4, ["--distributed.dp_shard=4"]),
    (4, ["--distributed.tp=2", "--distributed.dp_shard=2"]),
    (4, ["--distributed.pp=2", "--distributed.dp_shard=2"]),
    (1, []),
]


def _converted_debug_model(tmp_path):
    """A random HF Llama shaped like the debug preset, converted with `hf-to-kiln`."""
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
        vocab_size=4096,
        max_position_embeddings=1024,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    return hf_to_kiln(tmp_path / "hf", tmp_path / "converted")


def test_checkpoints_move_through_four_layouts(tmp_path, train):
    converted = _converted_debug_model(tmp_path)
    steps = SEGMENT * len(LAYOUTS)
    common = [
        f"--checkpoint.load_path={converted}",
        f"--checkpoint.interval={SEGMENT}",
        "--data.num_workers=0",
        # Each leg ends at its own max_steps: a schedule that does not depend on it.
        "--scheduler.name='constant'",
        "--scheduler.warmup_steps=1",
    ]
    one, moved = tmp_path / "one", tmp_path / "moved"
    train(one, 1, *common, f"--train.batch_size={GLOBAL_BATCH}", steps=steps)
    for index, (nproc, layout) in enumerate(LAYOUTS):
        data_ranks = nproc // (2 if len(layout) == 2 else 1)
        outputs = train(
            moved,
            nproc,
            *common,
            *layout,
            f"--train.batch_size={GLOBAL_BATCH // data_ranks}",
            steps=SEGMENT * (index + 1),
        )
        if index > 0:  # each leg continues the previous leg's newest checkpoint
            newest = moved / "checkpoints" / f"step_{SEGMENT * index:08d}"
            assert f"kiln: resumed from {newest} (step {SEGMENT * index})" in outputs[0]
    # The two checkpoints kept (keep_last_n = 2) were written by pp=2 × dp_shard=2 and by one
    # process: `kiln average` reads both into one process and writes their exact mean.
    kept = [moved / "checkpoints" / f"step_{step:08d}" for step in (steps - SEGMENT, steps)]
    assert main(["average", str(moved), "--last", "2", "--output", str(tmp_path / "avg")]) == 0
    assert_exact_average(tmp_path / "avg" / kept[-1].name, kept, tmp_path)
    moved_records = records(moved)
    assert sorted(moved_records) == list(range(1, steps + 1))
    assert_parity(
        moved_records,
        records(one),
        steps=range(1, steps + 1),
        param_tolerance=CHAIN_PARAM_TOLERANCE,
    )
