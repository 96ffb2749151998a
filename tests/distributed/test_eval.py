"""`kiln eval` on two processes (issue 20): a checkpoint's held-out loss is the one process's
under FSDP and under tensor parallel, and so are the harness's scores, which the ranks compute
in lockstep (the tensor-parallel logits gathered, each generated token's stop agreed)."""

from __future__ import annotations

import json
import math

import pytest

from kiln.cli import main
from tests.eval_tasks import TASKS, TEXTS, write_checkpoint, write_tasks

pytest.importorskip("lm_eval")

# fp32 on CPU: the layouts differ from one process by the order of their reductions only.
TOLERANCE = 1e-5
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def kiln_eval(args: list[str]) -> None:
    """`kiln eval ARGS` on this rank, as the command line runs it."""
    code = main(["eval", *args])
    if code != 0:
        raise RuntimeError(f"kiln eval exited with code {code} (see its output)")


def test_two_ranks_evaluate_like_one_process(gangs, tmp_path, monkeypatch):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    ckpt, tasks = write_checkpoint(tmp_path), write_tasks(tmp_path / "tasks")
    text = tmp_path / "held_out.txt"
    text.write_text(" ".join(TEXTS * 6))
    data = [str(ckpt), "--data", str(text)]
    harness = ["--tasks", ",".join(TASKS), "--include-path", str(tasks), "--bootstrap-iters", "0"]
    runs = {name: tmp_path / f"{name}.json" for name in ("one", "fsdp", "tp")}

    assert main(["eval", *data, *harness, "--batch-size", "4", "--json", str(runs["one"])]) == 0
    # The same 4 sequences per batch: 2 per data rank under FSDP, 4 on both tp ranks.
    gangs.run(2, kiln_eval, [*data, "--batch-size", "2", "--json", str(runs["fsdp"])], env=OFFLINE)
    tp = [*data, *harness, "--batch-size", "4", "--distributed.tp=2", "--json", str(runs["tp"])]
    gangs.run(2, kiln_eval, tp, env=OFFLINE)

    one, fsdp, tp = (json.loads(path.read_text()) for path in runs.values())
    assert fsdp["layout"] == {"dp_shard": 2} and tp["layout"] == {"tp": 2}
    for other in (fsdp, tp):
        assert other["samples"] == one["samples"] == 8
        assert math.isclose(other["eval/loss"], one["eval/loss"], rel_tol=TOLERANCE)
    assert tp["scores"].keys() == one["scores"].keys()
    for name, value in one["scores"].items():
        assert math.isclose(tp["scores"][name], value, rel_tol=TOLERANCE), name
