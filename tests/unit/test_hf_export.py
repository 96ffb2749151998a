"""`checkpoint.export_hf`: the run writes the Hugging Face folder `kiln convert kiln-to-hf` writes
of the same checkpoint (kiln/checkpoint/hf_export.py). Convert's logits against transformers are
proven per family by test_hf_convert.py, test_hf_moe.py and test_hf_deepseek.py; here the Llama
export is also loaded in transformers once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.checkpoint.hf_convert import kiln_to_hf
from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.train.trainer import Trainer
from tests.conftest import DEBUG_CONFIG, REPO
from tests.unit.test_hf_convert import TOLERANCE, _load_kiln, _max_diff, transformers

# The Qwen3-MoE shape: debug_moe with q/k norms and no shared expert (what Qwen3-MoE has).
QWEN3_MOE = [REPO / "configs/train/debug_moe.toml", "--model.qk_norm=true"]
QWEN3_MOE += ["--model.moe.shared_experts=0"]
DEEPSEEK_V3 = [REPO / "configs/train/deepseek_v3_debug.toml"]


def _train(recipe: Path, overrides: list[str], *extra: str) -> Path:
    """Train a short run; its checkpoint folder."""
    cfg = load_config(
        recipe,
        [*overrides, "--train.max_steps=2", "--scheduler.warmup_steps=0", *extra],
        world_size=1,
    )
    Trainer(cfg).train()
    return Path(cfg.metrics.run_dir) / "checkpoints"


def _events(ckpts: Path, name: str) -> list[dict]:
    lines = (ckpts.parent / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def _same_files(exported: Path, converted: Path) -> None:
    names = sorted(p.name for p in exported.iterdir())
    assert names == sorted(p.name for p in converted.iterdir())
    for name in names:
        assert (exported / name).read_bytes() == (converted / name).read_bytes(), name


def test_final_export_is_what_kiln_convert_writes_and_loads_in_transformers(
    debug_overrides, tmp_path
):
    ckpts = _train(DEBUG_CONFIG, debug_overrides, "--checkpoint.export_hf=final")
    exported = ckpts / "hf" / "step_00000002"
    _same_files(exported, kiln_to_hf(ckpts / "step_00000002", tmp_path / "converted"))
    assert (exported / "tokenizer.json").is_file()
    (event,) = _events(ckpts, "export_hf")
    assert event["step"] == 2 and event["path"] == str(exported) and event["seconds"] > 0

    hf_model = transformers.LlamaForCausalLM.from_pretrained(exported, attn_implementation="eager")
    vocab = hf_model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf_logits = hf_model.eval()(tokens).logits
        # fp32 on both sides: the HF tolerance of test_hf_convert.py (same math, other kernels).
        assert _max_diff(hf_logits, _load_kiln(ckpts)(tokens)) <= TOLERANCE


# Qwen3-MoE also checks every_save and the exports' retention, DeepSeek-V3 only the final one:
# each export is a process of its own (seconds of start-up on CPU).
@pytest.mark.parametrize(
    ("recipe", "export", "exported"),
    [(QWEN3_MOE, "every_save", [1, 2]), (DEEPSEEK_V3, "final", [2])],
    ids=["qwen3_moe", "deepseek_v3"],
)
def test_the_run_exports_what_kiln_convert_writes(
    debug_overrides, tmp_path, recipe, export, exported
):
    extra = [f"--checkpoint.export_hf={export}", "--checkpoint.interval=1"]
    ckpts = _train(recipe[0], [*debug_overrides, *recipe[1:]], *extra, "--checkpoint.keep_last_n=1")
    # keep_last_n = 1 keeps one export too: step 1's went once step 2's was written.
    assert [p.name for p in (ckpts / "hf").iterdir()] == ["step_00000002"]
    assert [e["step"] for e in _events(ckpts, "export_hf")] == exported
    converted = kiln_to_hf(ckpts / "step_00000002", tmp_path / "converted")
    _same_files(ckpts / "hf" / "step_00000002", converted)


def test_a_failed_export_warns_and_keeps_the_checkpoint(debug_overrides, tmp_path, capsys):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "hf").write_text("in the way")  # the exports' folder cannot be made
    _train(DEBUG_CONFIG, debug_overrides, "--checkpoint.export_hf=final", "--train.max_steps=1")
    assert (ckpts / "step_00000001" / "COMPLETE").is_file()
    (event,) = _events(ckpts, "export_hf")
    assert event["step"] == 1 and "error" in event and "path" not in event
    err = capsys.readouterr().err
    assert "the Hugging Face export of" in err and "the checkpoint is intact" in err


def test_export_hf_of_a_model_kiln_cannot_export_is_one_message(debug_overrides, tmp_path):
    # debug_moe has a shared expert and a dense first block: no Hugging Face architecture fits.
    moe = REPO / "configs/train/debug_moe.toml"
    cfg = load_config(moe, [*debug_overrides, "--checkpoint.export_hf=final"], world_size=1)
    with pytest.raises(ConfigError, match=r'checkpoint.export_hf = "final", but cannot export'):
        Trainer(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()
    overrides = [*debug_overrides, "--checkpoint.export_hf=final", "--checkpoint.save_final=false"]
    with pytest.raises(ConfigError, match="set save_final = true"):
        load_config(DEBUG_CONFIG, overrides, world_size=1)
    s3 = load_config(DEBUG_CONFIG, [*overrides[:-1], "--checkpoint.dir=s3://b/run"], world_size=1)
    with pytest.raises(ConfigError, match="in an object store"):
        Trainer(s3)  # refused before any store is reached
