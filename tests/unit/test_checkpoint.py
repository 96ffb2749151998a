import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from kiln.checkpoint import latest_complete, load_checkpoint, resolve_checkpoint, save_checkpoint
from kiln.checkpoint.layout import complete_steps, partial_dir
from kiln.config import JobConfig, ModelConfig
from kiln.errors import KilnError
from kiln.model import build_model, materialize
from kiln.train.optimizer import build_optimizer

TINY = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_hidden_dim=64, max_seq_len=32
)


def trained(seed=0):
    model = materialize(build_model(TINY), device="cpu", seed=seed)
    (optimizer,) = build_optimizer(model, JobConfig().optimizer)
    model(torch.randint(0, 50, (2, 8))).sum().backward()
    optimizer.step()
    return model, optimizer


def save(root, step, model, optimizer=None, keep=0):
    return save_checkpoint(
        root,
        step,
        model=model,
        optimizer=optimizer,
        config=JobConfig(model=TINY),
        train_state={"samples_seen": step},
        keep_last_n=keep,
    )


def test_round_trip_restores_model_and_optimizer(tmp_path):
    model, optimizer = trained()
    save(tmp_path, 7, model, optimizer)
    other, other_opt = trained(seed=1)
    state = load_checkpoint(tmp_path, model=other, optimizer=other_opt)
    assert state == {"step": 7, "samples_seen": 7}
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(optimizer.state.values(), other_opt.state.values(), strict=True):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and torch.equal(a["step"], b["step"])


def test_incomplete_checkpoints_are_never_loaded(tmp_path):
    model, _ = trained()
    save(tmp_path, 2, model)
    save(tmp_path, 4, model)
    (tmp_path / "step_00000004" / "COMPLETE").unlink()  # as if the save died before committing
    partial_dir(tmp_path, 6).mkdir()
    assert latest_complete(tmp_path).name == "step_00000002"
    with pytest.raises(KilnError, match="incomplete checkpoint"):
        resolve_checkpoint(tmp_path / "step_00000004")
    save(tmp_path, 8, model)
    assert not partial_dir(tmp_path, 6).exists()  # leftovers are cleared by the next save
    assert (tmp_path / "latest").read_text().strip() == "step_00000008"


def test_keep_last_n(tmp_path):
    model, _ = trained()
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model, keep=2)
    assert [s for s, _ in complete_steps(tmp_path)] == [3, 4]


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(KilnError, match="is not a kiln checkpoint"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(KilnError, match="checkpoint not found"):
        resolve_checkpoint(tmp_path / "missing")


def test_loading_into_a_different_model_says_so(tmp_path):
    model, _ = trained()
    save(tmp_path, 1, model)
    bigger = materialize(
        build_model(ModelConfig(**{**TINY.__dict__, "dim": 64})), device="cpu", seed=0
    )
    with pytest.raises(KilnError, match="Does the checkpoint match this model config") as info:
        load_checkpoint(tmp_path, model=bigger)
    assert "Size mismatch" in str(info.value) and "FrameSummary" not in str(info.value)


def test_optimizer_state_in_the_old_indexed_format_is_named(tmp_path):
    model, optimizer = trained()
    step_dir = save(tmp_path, 1, model, optimizer)
    old_format = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),  # indexed param groups
    }
    dcp.save(old_format, checkpoint_id=step_dir, no_dist=True)
    (step_dir / "COMPLETE").write_text("1\n")  # the marker of that version: the step only
    other, other_opt = trained(seed=1)
    with pytest.raises(KilnError, match=r"indexed format .* checkpoint\.load_path"):
        load_checkpoint(tmp_path, model=other, optimizer=other_opt)
    load_checkpoint(tmp_path, model=other)  # the weights still serve a warm start
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_latest_names_the_newest_write_not_the_highest_step(tmp_path):
    model, _ = trained()
    save(tmp_path, 100, model)
    save(tmp_path, 10, model, keep=1)
    assert latest_complete(tmp_path).name == "step_00000010"
    assert (
        tmp_path / "step_00000010" / "COMPLETE"
    ).is_file()  # retention never deletes the new one


@pytest.mark.parametrize("tied", [False, True])
def test_whole_model_checkpoint_loads_into_pipeline_stages(tmp_path, tied):
    """Stages 0 and 3 of a zbv split (one rank's two stages) take their layers, the optimizer
    state of those layers and, when tied, both copies of the embedding from one unsplit save."""
    from dataclasses import replace

    from kiln.parallel.pipeline import split_into_stages

    cfg = JobConfig(model=replace(TINY, n_layers=4, tie_embeddings=tied))
    cfg.distributed.pp, cfg.distributed.pp_schedule, cfg.distributed.pp_virtual_stages = 2, "zbv", 2
    whole = materialize(build_model(cfg.model), device="cpu", seed=0)
    (optimizer,) = build_optimizer(whole, cfg.optimizer)
    whole(torch.randint(0, 50, (2, 8))).sum().backward()
    optimizer.step()
    save(tmp_path, 3, whole, optimizer)

    parts = [materialize(part, device="cpu", seed=1) for part in split_into_stages(cfg, pp_rank=0)]
    optimizers = [build_optimizer(part, cfg.optimizer)[0] for part in parts]
    load_checkpoint(tmp_path, model=parts, optimizer=optimizers)
    expected = dict(whole.named_parameters())
    moments = {name: optimizer.state[p]["exp_avg"] for name, p in whole.named_parameters()}
    for part, part_optimizer in zip(parts, optimizers, strict=True):
        for name, param in part.named_parameters():
            assert torch.equal(param, expected[name]), name
            assert torch.equal(part_optimizer.state[param]["exp_avg"], moments[name]), name
    assert [sorted(p.layers) for p in parts] == [["0"], ["3"]]
    assert (parts[1].tok_embeddings is not None) == tied
    # Initial weights (no optimizer) load into several parts too.
    load_checkpoint(tmp_path, model=parts)
