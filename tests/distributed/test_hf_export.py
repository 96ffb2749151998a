"""`kiln convert kiln-to-hf` exports checkpoints written by multi-process layouts:
DCP keys the state by parameter name, so one process reads a checkpoint of any layout whole. Each
layout trains the debug model 2 steps on a gang of 4 ranks on CPU (gloo) and checkpoints; the export
must hold exactly the checkpoint's weights and give the logits of kiln's model."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kiln.checkpoint import load_checkpoint, read_model_config, resolve_checkpoint
from kiln.checkpoint.hf_convert import _name_map, kiln_to_hf
from kiln.model import build_model, materialize

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
# Global batch of 2-4 short sequences, read in the training process: the runs are about the
# layout of the checkpoint, not the training.
SMALL = (
    "--train.seq_len=32",
    "--checkpoint.interval=2",
    "--scheduler.warmup_steps=1",
    "--data.num_workers=0",
)

LAYOUTS = {
    "fsdp=2 x tp=2": ("--distributed.tp=2", "--distributed.dp_shard=2", "--train.batch_size=1"),
    # The tied embedding lives on the first and the last pipeline stage.
    "pp=2 x fsdp=2, tied embeddings": (
        "--distributed.pp=2",
        "--distributed.dp_shard=2",
        "--train.batch_size=2",  # the 1f1b schedule needs pp = 2 micro-batches
        "--model.tie_embeddings=true",
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_of_a_multi_process_checkpoint(layout, tmp_path, train):
    run = tmp_path / "run"
    train(run, 4, *SMALL, *LAYOUTS[layout], steps=2)
    step_dir = resolve_checkpoint(run / "checkpoints")
    assert step_dir.name == "step_00000002"
    assert len(list(step_dir.glob("*.distcp"))) == 4  # one file per rank

    # 1 MB shards: the 2 MB embedding gets a file of its own, the layers share the others.
    out = kiln_to_hf(run / "checkpoints", tmp_path / "hf", max_shard_size="1MB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    exported = {name: t for file in files for name, t in load_file(out / file).items()}
    assert exported.keys() == index["weight_map"].keys()

    # The checkpoint's weights, read straight from the DCP files.
    dcp_to_torch_save(step_dir, tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=True)["model"]
    cfg = read_model_config(step_dir)
    names = _name_map(cfg)
    assert len(saved) == len(exported)
    for name, tensor in saved.items():
        hf_name = names[name]
        assert exported[hf_name].dtype == torch.float32, hf_name
        assert torch.equal(exported[hf_name], tensor), f"{hf_name} differs from {name}"

    kiln_model = materialize(build_model(cfg), device="cpu", seed=None)
    load_checkpoint(step_dir, model=kiln_model)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf_model.eval()(tokens).logits - kiln_model.eval()(tokens)).abs().max().item()
    assert diff <= TOLERANCE
