"""`kiln eval` on two processes (issue 20): a checkpoint's held-out loss is the one process's
under FSDP and under tensor parallel, and so are the harness's scores, which the ranks compute
in lockstep (the tensor-parallel logits gathered, each generated token's stop agreed)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

import kiln.checkpoint.checkpointer
from kiln.checkpoint import save_checkpoint
from kiln.cli import main
from kiln.config import config_from_dict, read_toml
from kiln.model import build_model, materialize
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


def _second_step(ckpt: Path) -> Path:
    """Step 2 beside step 1 of `ckpt`: the same model with other weights."""
    first = ckpt / "step_00000001"
    cfg = config_from_dict(read_toml(first / "config.toml"))
    model = materialize(build_model(cfg.model), device="cpu", seed=1)
    save_checkpoint(
        ckpt,
        2,
        model=model,
        optimizer=None,
        config=cfg,
        train_state={"step": 2},
        tokenizer_path=first / "tokenizer.json",
    )
    return ckpt / "step_00000002"


def eval_where_rank_1_lags(args: list[str], older: str) -> None:
    """`kiln eval ARGS` where rank 1's own look at the checkpoint folder would find `older`: a
    run still training has committed a newer step that rank 1's filesystem view does not show."""
    import kiln.train.eval_checkpoint as module

    real = module.resolve_checkpoint
    if os.environ["RANK"] == "1":
        module.resolve_checkpoint = lambda path: Path(older)
    try:
        kiln_eval(args)
    finally:
        module.resolve_checkpoint = real


def test_the_checkpoint_is_chosen_once_for_every_rank(gangs, tmp_path):
    """Every rank loads the step rank 0 chose, whatever its own look at the folder would find:
    the held-out loss under FSDP is one process's on that step (fp32, another reduction order)."""
    ckpt = write_checkpoint(tmp_path)
    newest = _second_step(ckpt)
    text = tmp_path / "held_out.txt"
    text.write_text(" ".join(TEXTS * 6))
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert (
        main(["eval", str(ckpt), "--data", str(text), "--batch-size", "4", "--json", str(one)]) == 0
    )
    args = [str(ckpt), "--data", str(text), "--batch-size", "2", "--json", str(two)]
    outputs = gangs.run(2, eval_where_rank_1_lags, args, str(ckpt / "step_00000001"))
    one, two = json.loads(one.read_text()), json.loads(two.read_text())
    assert one["step"] == two["step"] == 2 and two["checkpoint"] == str(newest)
    assert math.isclose(two["eval/loss"], one["eval/loss"], rel_tol=TOLERANCE)
    assert f"evaluating {newest} (step 2)" in outputs[0]


def test_a_checkpoint_deleted_while_loading_is_one_clear_message(tmp_path, monkeypatch, capsys):
    ckpt = write_checkpoint(tmp_path)
    text = tmp_path / "held_out.txt"
    text.write_text(" ".join(TEXTS * 6))
    real_load = kiln.checkpoint.checkpointer.dcp.load

    def load_after_retention(state, *, storage_reader, **kwargs):
        shutil.rmtree(storage_reader.path)  # the writing run's keep_last_n removes it meanwhile
        return real_load(state, storage_reader=storage_reader, **kwargs)

    monkeypatch.setattr(kiln.checkpoint.checkpointer.dcp, "load", load_after_retention)
    assert main(["eval", str(ckpt), "--data", str(text), "--batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "was deleted while it was being loaded" in err and "Traceback" not in err
    assert err.count("error:") == 1
