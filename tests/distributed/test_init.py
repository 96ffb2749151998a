"""The initial full weights are identical in every layout (docs/architecture.md)."""

import pytest
import torch

from kiln.config import load_config
from kiln.model import build_model, materialize
from tests.conftest import DEBUG_CONFIG
from tests.distributed.init_weights_worker import gather_initial_weights


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ["--distributed.dp_shard=2"]),
        (4, ["--distributed.tp=2", "--model.tie_embeddings=false"]),
        (4, ["--distributed.dp_replicate=2"]),
        # Shards that do not divide evenly: vocab rows 4094 / tp 2 = 2047, then 1024 + 1023 under
        # FSDP; hidden units 390 / 2 = 195, then 98 + 97. The cuts fall inside the init's tiles.
        (4, ["--distributed.tp=2", "--model.vocab_size=4094", "--model.ffn_hidden_dim=390"]),
        (2, ["--distributed.pp=2"]),
        # Experts split over ep, then along their rows by FSDP.
        (4, ["--model.preset=debug_moe", "--distributed.ep=2", "--distributed.dp_shard=2"]),
        # dim 134 does not divide by 4, hidden 128 does: FSDP splits w1 and w3 along their rows
        # (hidden) and w2 along its columns (hidden).
        (
            4,
            [
                "--model.preset=debug_moe",
                "--model.dim=134",
                "--model.n_heads=1",
                "--model.n_kv_heads=1",
                "--distributed.dp_shard=4",
            ],
        ),
    ],
    ids=[
        "dp_shard=2",
        "tp=2 x dp_shard=2",
        "dp_replicate=2 x dp_shard=2",
        "tp=2 x dp_shard=2 uneven",
        "pp=2",
        "moe ep=2 x dp_shard=2",
        "moe dp_shard=4, experts split by rows and columns",
    ],
)
def test_initial_weights_do_not_depend_on_the_layout(nproc, layout, tmp_path, gangs):
    out = tmp_path / "weights.pt"
    gangs.run(nproc, gather_initial_weights, str(DEBUG_CONFIG), str(out), *layout)
    gathered = torch.load(out)
    cfg = load_config(DEBUG_CONFIG, [arg for arg in layout if arg.startswith("--model.")])
    single = materialize(build_model(cfg.model), device="cpu", seed=cfg.train.seed).state_dict()
    assert gathered.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(gathered[name], tensor), name
