"""A failed collective is told from other errors by what torch raises: a real 2-process gloo group
on loopback in which rank 1 never joins rank 0's all_reduce, or dies before it."""

import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from kiln.parallel.collectives import is_collective_failure

RANK = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from kiln.parallel.collectives import is_collective_failure

rank, store, peer = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
dist.init_process_group(
    "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
    timeout=datetime.timedelta(seconds=2),
)
if rank == 1:
    if peer == "dies":
        os._exit(0)
    time.sleep(60)  # never joins; rank 0's test ends it
try:
    dist.all_reduce(torch.ones(4))
    print(json.dumps({"raised": None}), flush=True)
except Exception as error:
    print(json.dumps({"raised": type(error).__name__, "message": str(error),
                      "recognised": is_collective_failure(error)}), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("peer", ["never joins", "dies"])
def test_a_collective_whose_peer_is_gone_is_recognised(tmp_path, peer):
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(store), peer.split()[-1]],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        out, _ = ranks[0].communicate(timeout=60)
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    result = json.loads(out.strip().splitlines()[-1])
    # torch 2.13's gloo raises a bare RuntimeError for both (no DistError subclass), which
    # names gloo's transport source file: "Timed out waiting 2000ms for recv operation to
    # complete" and "Connection closed by peer".
    assert result["raised"] is not None and result["recognised"], result


def test_other_errors_are_not_collective_failures():
    assert not is_collective_failure(ValueError("timed out waiting for the socket"))
    assert not is_collective_failure(RuntimeError("CUDA out of memory; gloo socket timed out"))
    assert is_collective_failure(dist.DistStoreError("wait timeout after 2000ms"))
    assert is_collective_failure(dist.DistBackendError("NCCL error: unhandled system error"))
    assert is_collective_failure(dist.DistNetworkError("Failed to recv, got 0 bytes"))
