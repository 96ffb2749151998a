"""`kiln average`: the mean of a whole-model checkpoint and one saved as two pipeline stages,
exactly; the average generates, warm-starts a run and is not taken for a step by resume;
checkpoints of different models, or fewer than asked for, are one message with nothing written;
from and to S3. A multi-rank layout (pp=2 × dp_shard=2 against one process) is averaged in
tests/distributed/test_resharding.py, on the checkpoints that test already writes."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kiln.checkpoint import load_checkpoint, read_train_state, save_checkpoint
from kiln.checkpoint.layout import resume_candidates
from kiln.checkpoint.store import location, store_for
from kiln.cli import main
from kiln.config import JobConfig, load_config
from kiln.model import build_model, materialize
from kiln.model.generate import generate
from kiln.parallel.pipeline import split_into_stages
from kiln.train.optimizer import build_optimizer
from tests.conftest import DEBUG_CONFIG
from tests.support.servers import make_bucket
from tests.unit.test_trainer import make_trainer


def _trained(cfg: JobConfig, seed: int):
    """The debug model after one optimizer step from seed `seed`: weights and Adam moments."""
    model = materialize(build_model(cfg.model), device="cpu", seed=seed)
    (optimizer,) = build_optimizer(model, cfg.optimizer)
    model(torch.randint(0, cfg.model.vocab_size, (2, 8))).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(root, step: int, cfg: JobConfig, seed: int, *, stages: bool = False) -> None:
    """A checkpoint as one process writes it, or (`stages`) as the two stages of a pp=2 split
    write it: each stage's own layers and optimizer state, in one DCP save."""
    model, optimizer = _trained(cfg, seed)
    if stages:
        split = replace(cfg, distributed=replace(cfg.distributed, pp=2))
        parts = [materialize(p, device="cpu", seed=None) for p in split_into_stages(split, 0)]
        parts += [materialize(p, device="cpu", seed=None) for p in split_into_stages(split, 1)]
        optimizers = [build_optimizer(part, cfg.optimizer)[0] for part in parts]
        whole = location(root).parent / f"whole_{step}"  # beside the run's checkpoints
        save_checkpoint(whole, step, model=model, optimizer=optimizer, config=cfg, train_state={})
        load_checkpoint(whole, model=parts, optimizer=optimizers)
        model, optimizer = parts, optimizers
    save_checkpoint(
        root,
        step,
        model=model,
        optimizer=optimizer,
        config=cfg,
        train_state={"samples_seen": step, "tokens_seen": step * 64},
    )


def _weights(step_dir, scratch) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors read by DCP's own converter, not by kiln's loading."""
    out = scratch / f"{step_dir.parent.name}_{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=True)["model"]


def assert_exact_average(average, sources, scratch) -> None:
    """`average` holds the mean of the two checkpoints `sources` bit for bit, and says it holds
    no optimizer state. Exact: two fp32 values summed in float64 (exact), halved (exact),
    rounded once to fp32 is the correctly rounded mean, which averaging promises."""
    a, b = (_weights(path, scratch) for path in sources)
    mean = _weights(average, scratch)
    assert set(mean) == set(a) == set(b)
    for name, value in mean.items():
        expected = ((a[name].double() + b[name].double()) / 2).to(a[name].dtype)
        assert torch.equal(value, expected), name
    saved = dcp.FileSystemReader(average).read_metadata().state_dict_metadata
    assert not any(key.startswith("optim.") for key in saved)
    state = read_train_state(average)
    assert [s["path"] for s in state["averaged"]] == [str(path) for path in sources]
    assert state["optimizer"].startswith("none")


@pytest.fixture
def debug_cfg(demo_data, tmp_path) -> JobConfig:
    return load_config(
        DEBUG_CONFIG, [f"--data.path={demo_data}", f"--metrics.run_dir={tmp_path / 'run'}"]
    )


def test_average_of_two_layouts_is_the_exact_mean_and_warm_starts_a_run(
    debug_cfg, debug_overrides, tmp_path, capsys
):
    root = tmp_path / "run" / "checkpoints"
    _save(root, 2, debug_cfg, seed=0)
    _save(root, 4, debug_cfg, seed=1, stages=True)
    _save(root, 6, debug_cfg, seed=2)
    assert main(["average", str(tmp_path / "run"), "--steps", "2,4"]) == 0
    out = root / "average_2-4" / "step_00000004"
    printed = capsys.readouterr().out
    assert f"averaged {root / 'step_00000002'}" in printed and f"wrote {out}" in printed

    assert_exact_average(out, [root / "step_00000002", root / "step_00000004"], tmp_path)

    # The run still resumes from its own newest step, never from the average.
    assert resume_candidates(root)[0] == root / "step_00000006"

    # It generates (what `kiln generate` does once it has a tokenizer) and warm-starts a run.
    model = materialize(build_model(debug_cfg.model), device="cpu", seed=None)
    load_checkpoint(out.parent, model=model)
    assert len(generate(model.eval(), [1, 2, 3], max_new_tokens=2)) == 2
    trainer = make_trainer(
        debug_overrides,
        f"--metrics.run_dir={tmp_path / 'warm'}",
        f"--checkpoint.load_path={out.parent}",
        "--train.max_steps=1",
        "--scheduler.warmup_steps=0",
        "--train.seq_len=64",
    )
    trainer.train()
    assert "initial weights from" in capsys.readouterr().out


def test_bad_choices_are_one_message_and_write_nothing(debug_cfg, tmp_path, capsys):
    root = tmp_path / "ckpt"
    _save(root, 2, debug_cfg, seed=0)
    wider = replace(debug_cfg, model=replace(debug_cfg.model, rope_theta=10000.0))
    _save(root, 4, wider, seed=1)
    before = sorted(p.name for p in root.iterdir())

    assert main(["average", str(root), "--last", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "hold different models (model.rope_theta: 500000.0 in 2, 10000.0 in 4)" in err
    assert "Average checkpoints of one model" in err

    assert main(["average", str(root), "--last", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "--last 3 asks for more checkpoints than" in err and "pass --last 2 or fewer" in err

    assert main(["average", str(root), "--steps", "2,8"]) == 2
    assert "no committed checkpoint of step 8; it has steps 2, 4" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written


def test_average_from_and_to_s3(debug_cfg, tmp_path, s3_env, s3_endpoint):
    bucket = f"kiln-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    # A model of a few thousand weights: the requests to the server, not the tensors, are tested.
    small = dict(dim=32, n_layers=1, ffn_hidden_dim=64, vocab_size=64)
    tiny = replace(debug_cfg, model=replace(debug_cfg.model, **small))
    root = location(f"s3://{bucket}/run")
    _save(root, 1, tiny, seed=0)
    _save(root, 2, tiny, seed=1)
    assert main(["average", str(root), "--last", "2"]) == 0
    out = root / "average_1-2" / "step_00000002"
    assert store_for(out).is_file(out / "COMPLETE")
    model = materialize(build_model(tiny.model), device="cpu", seed=None)
    assert load_checkpoint(out, model=model)["averaged"][1]["path"] == str(root / "step_00000002")
