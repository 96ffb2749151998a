"""A checkpoint written to S3 (moto's server on the loopback interface) by two ranks at
`dp_shard=2` holds both ranks' shards and RNG states, loads bit for bit in one process and
continues there."""

from __future__ import annotations

import json
import uuid

import torch

from kiln.checkpoint import load_checkpoint
from kiln.checkpoint.store import location, store_for
from kiln.config import load_config
from kiln.train.trainer import Trainer
from tests.conftest import DEBUG_CONFIG
from tests.distributed.launch import kiln_args, log, losses, start_ranks, wait_all
from tests.distributed.parity import TOLERANCE
from tests.support.servers import make_bucket

SHORT = ["--train.max_steps=4", "--scheduler.warmup_steps=1", "--checkpoint.interval=2"]


def test_a_dp_shard_2_save_in_s3_continues_in_one_process(demo_data, tmp_path, s3_env, s3_endpoint):
    bucket = f"kiln-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    url = f"s3://{bucket}/run"
    two = tmp_path / "two"
    args = kiln_args(
        two, demo_data, *SHORT, "--distributed.dp_shard=2", "--train.batch_size=2",
        f"--checkpoint.dir={url}",
    )  # fmt: skip
    procs = start_ranks(2, args, tmp_path / "logs")
    assert wait_all(procs, timeout=180) == [0, 0], log(tmp_path / "logs")

    root = location(url)
    store = store_for(root)
    step = root / "step_00000004"
    manifest = json.loads(store.read_bytes(step / "COMPLETE"))["files"]
    for name in ("__0_0.distcp", "__1_0.distcp", "rng/rank_00000.pt", "rng/rank_00001.pt"):
        assert name in manifest, sorted(manifest)
    assert store.read_bytes(root / "latest") == b"step_00000004\n"

    # The one-process run restores step 2 from S3; bitwise the state a plain copy of the same
    # objects on local disk loads (DCP's filesystem reader, the path kiln has always used).
    local = tmp_path / "copy" / "step_00000002"
    store.fs.get(str(root / "step_00000002") + "/", str(local) + "/", recursive=True)
    one = tmp_path / "one"
    continued = Trainer(
        load_config(
            DEBUG_CONFIG,
            [
                *kiln_args(one, demo_data, *SHORT)[1:],  # [0] is the recipe, given above
                f"--checkpoint.load_path={url}/step_00000002",
                "--checkpoint.model_only=false",
                "--checkpoint.interval=0",
            ],
            world_size=1,
        )
    )
    assert continued.step == 2
    restored = {k: v.clone() for k, v in continued.model_parts[0].state_dict().items()}
    load_checkpoint(local, model=continued.model_parts)
    assert all(
        torch.equal(v, continued.model_parts[0].state_dict()[k]) for k, v in restored.items()
    )

    continued.train()
    got, expected = losses(one), losses(two)
    for s in (3, 4):
        # Within the parity tolerance, not bitwise: two ranks reduce the gradients in another
        # order than one process sums them.
        assert abs(got[s] - expected[s]) <= TOLERANCE * abs(expected[s]), (s, got, expected)
