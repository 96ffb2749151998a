"""The MoE keys of [model.moe]: defaults keep a model dense, which blocks are MoE, one clear
validation message per problem, and the old flat spelling of the keys in [model] (moved, with a
note)."""

import pytest

import kiln.config.load as load
from kiln.config import (
    JobConfig,
    ModelConfig,
    MoEConfig,
    config_from_dict,
    load_config,
    to_toml,
    write_config,
)
from kiln.config.validate import collect_problems
from kiln.errors import ConfigError
from tests.conftest import REPO

MOE = {"num_experts": 8, "top_k": 2}


def problems(world_size: int = 1, n_layers: int = 4, **moe) -> list[str]:
    cfg = JobConfig(model=ModelConfig(n_layers=n_layers, moe=MoEConfig(**moe)))
    return [p for p in collect_problems(cfg, world_size) if "moe" in p or "num_experts" in p]


def test_defaults_are_dense_and_valid():
    cfg = ModelConfig()
    assert cfg.moe.num_experts == 0
    assert not any(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    assert problems() == []
    assert problems(**MOE) == []


@pytest.mark.parametrize(
    ("first_dense", "frequency", "moe_layers"),
    [(0, 1, [0, 1, 2, 3, 4, 5]), (1, 1, [1, 2, 3, 4, 5]), (0, 2, [0, 2, 4]), (1, 2, [1, 3, 5])],
)
def test_which_blocks_are_moe(first_dense, frequency, moe_layers):
    moe = MoEConfig(num_experts=4, first_dense_layers=first_dense, frequency=frequency)
    cfg = ModelConfig(n_layers=6, moe=moe)
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == moe_layers


def test_expert_width_defaults_to_the_dense_width():
    assert ModelConfig(ffn_hidden_dim=96, moe=MoEConfig(num_experts=4)).expert_hidden_dim == 96
    assert ModelConfig(ffn_hidden_dim=96, moe=MoEConfig(ffn_hidden_dim=32)).expert_hidden_dim == 32


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"num_experts": 4, "top_k": 5},
            "model.moe.top_k = 5 must be in [1, model.moe.num_experts = 4]",
        ),
        ({**MOE, "frequency": 0}, "model.moe.frequency must be >= 1"),
        (
            {**MOE, "n_layers": 2, "first_dense_layers": 2},
            "model.moe.first_dense_layers = 2 leaves no MoE block among model.n_layers = 2",
        ),
        (
            {**MOE, "n_groups": 3},
            "model.moe.n_groups = 3 must divide model.moe.num_experts = 8 into equal groups; "
            "use one of [1, 2, 4, 8]",
        ),
        (
            {**MOE, "n_groups": 2, "topk_groups": 3},
            "model.moe.topk_groups = 3 exceeds model.moe.n_groups = 2",
        ),
        (
            {**MOE, "top_k": 3, "n_groups": 4, "topk_groups": 1},
            "model.moe.top_k = 3 exceeds the 2 experts a token can reach "
            "(topk_groups × experts per group = 1 × 2)",
        ),
        ({"bias_update_rate": 0.001}, "model.moe.bias_update_rate = 0.001 needs a Mixture"),
        ({"aux_loss_weight": 0.01}, "model.moe.aux_loss_weight = 0.01 needs a Mixture"),
        ({"seq_aux_loss_weight": 1e-4}, "model.moe.seq_aux_loss_weight = 0.0001 needs"),
        ({"router_z_loss_weight": 1e-3}, "model.moe.router_z_loss_weight = 0.001 needs"),
        ({"shared_experts": 1}, "model.moe.shared_experts = 1 needs a Mixture-of-Experts"),
        ({"shared_expert_gate": True}, "model.moe.shared_expert_gate = true needs a Mixture"),
        (
            {**MOE, "shared_expert_gate": True},
            "model.moe.shared_expert_gate = true gates the shared experts, but "
            "model.moe.shared_experts = 0",
        ),
        ({**MOE, "router": "noisy"}, "model.moe.router = 'noisy' is not one of"),
        ({**MOE, "aux_loss_weight": -0.1}, "model.moe.aux_loss_weight must be >= 0"),
        ({**MOE, "bias_update_rate": -1e-3}, "model.moe.bias_update_rate must be >= 0"),
        ({**MOE, "capacity_factor": -1.0}, "model.moe.capacity_factor must be >= 0"),
        ({"num_experts": -2}, "model.moe.num_experts must be >= 0"),
        ({**MOE, "route_scale": 0.0}, "model.moe.route_scale must be positive"),
    ],
)
def test_each_problem_has_one_clear_message(model, message):
    found = problems(**model)
    assert len(found) == 1, found
    assert message in found[0]


def test_dense_message_names_the_fix():
    (message,) = problems(bias_update_rate=0.001)
    assert "model.moe.num_experts = 0 (dense): set num_experts > 0 or leave" in message


def test_every_layout_accepts_moe():
    # Tensor parallel included (each tp rank routes its part of the sequence), with every
    # balancing loss on: tests/distributed/test_moe_parity.py proves each layout.
    cfg = JobConfig(model=ModelConfig(moe=MoEConfig(**MOE, seq_aux_loss_weight=0.01)))
    cfg.distributed.tp, cfg.distributed.pp = 2, 2
    assert [p for p in collect_problems(cfg, 8) if "moe" in p or "num_experts" in p] == []


def test_debug_moe_recipe_loads():
    cfg = load_config(REPO / "configs" / "train" / "debug_moe.toml")
    assert cfg.model.preset == "debug_moe" and cfg.model.moe.num_experts == 8
    assert [cfg.model.is_moe_layer(i) for i in range(cfg.model.n_layers)] == [False, True]


# The old flat spelling of every key, in [model], and the same values in [model.moe].
FLAT = {
    "num_experts": 8,
    "moe_top_k": 2,
    "moe_first_dense_layers": 1,
    "moe_ffn_hidden_dim": 64,
    "moe_shared_experts": 1,
    "moe_router": "sigmoid",
    "moe_aux_loss_weight": 0.01,
}
NESTED = {
    "num_experts": 8,
    "top_k": 2,
    "first_dense_layers": 1,
    "ffn_hidden_dim": 64,
    "shared_experts": 1,
    "router": "sigmoid",
    "aux_loss_weight": 0.01,
}


@pytest.fixture
def notes(monkeypatch):
    """The deprecation notes printed, as a list; each process starts with none noted."""
    said: list[str] = []
    monkeypatch.setattr(load, "_noted", set())
    monkeypatch.setattr(load, "warn", said.append)
    return said


def test_old_flat_keys_are_moved_to_model_moe_with_one_note_each(notes):
    old = config_from_dict({"model": {"n_layers": 2, **FLAT}}, world_size=1)
    new = config_from_dict({"model": {"n_layers": 2, "moe": dict(NESTED)}}, world_size=1)
    assert old == new and old.model.moe == MoEConfig(**NESTED)
    assert len(notes) == len(FLAT)
    assert notes[1].startswith("note: model.moe_top_k was moved to [model.moe]")
    assert "Rewrite it as top_k under [model.moe] in the recipe" in notes[1]
    # Once per process: a second config with the old keys says nothing more.
    config_from_dict({"model": {"n_layers": 2, **FLAT}})
    assert len(notes) == len(FLAT)


def test_old_and_new_override_spellings(notes):
    old = config_from_dict({}, ["--model.num_experts=4", "--model.moe_top_k=1"])
    new = config_from_dict({}, ["--model.moe.num_experts=4", "--model.moe.top_k=1"])
    assert old == new and old.model.moe.top_k == 1
    assert len(notes) == 2
    # An override in either spelling wins over the recipe's key in either spelling.
    raw = {"model": {"num_experts": 4, "moe": {"top_k": 2}}}
    assert config_from_dict(raw, ["--model.moe_top_k=3"]).model.moe.top_k == 3
    raw = {"model": {"num_experts": 4, "moe_top_k": 2}}
    assert config_from_dict(raw, ["--model.moe.top_k=3"]).model.moe.top_k == 3


def test_both_spellings_of_one_key_are_one_clear_error(notes):
    raw = {"model": {"moe_top_k": 4, "moe": {"num_experts": 8, "top_k": 2}}}
    with pytest.raises(ConfigError) as error:
        config_from_dict(raw)
    text = str(error.value)
    assert "(1 problem)" in text
    assert "model.moe_top_k and model.moe.top_k are one key in two spellings" in text
    assert "keep [model.moe] top_k and delete moe_top_k" in text


def test_an_unknown_flat_moe_key_stays_unknown(notes):
    with pytest.raises(ConfigError, match=r"unknown key 'model\.moe_topk'"):
        config_from_dict({"model": {"moe_topk": 2}})


def test_an_old_checkpoint_config_with_flat_keys_loads(tmp_path, notes):
    from kiln.checkpoint import read_model_config

    new = config_from_dict({"model": {"n_layers": 2, "moe": dict(NESTED)}})
    text = to_toml(new)
    assert "\n[model.moe]\nnum_experts = 8\ntop_k = 2\n" in text
    # What an older kiln wrote: the MoE keys flat in [model].
    flat = "".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in FLAT.items())
    head, rest = text.split("\n[model.moe]\n", 1)
    old_text = head + "\n" + flat + "\n" + rest.split("\n\n", 1)[1]
    assert "[model.moe]" not in old_text and "moe_top_k = 2" in old_text
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.toml").write_text(old_text)
    assert read_model_config(tmp_path / "old") == new.model
    # A new checkpoint's config.toml reads back the same.
    write_config(new, tmp_path / "new" / "config.toml")
    assert read_model_config(tmp_path / "new") == new.model


def test_a_preset_moe_table_merges_key_by_key_with_the_recipe(notes):
    preset = config_from_dict({"model": {"preset": "debug_moe"}}).model
    assert preset.moe.num_experts == 8 and preset.moe.top_k == 2
    raw = {"model": {"preset": "debug_moe", "moe": {"top_k": 1, "aux_loss_weight": 0.0}}}
    cfg = config_from_dict(raw, world_size=1).model
    # The recipe's keys win; the preset's others stay.
    assert cfg.moe.top_k == 1 and cfg.moe.aux_loss_weight == 0.0
    assert cfg.moe.num_experts == 8 and cfg.moe.ffn_hidden_dim == 128
    assert cfg.moe.shared_experts == 1 and cfg.moe.first_dense_layers == 1
    # The old flat spelling of a recipe key merges the same way.
    old = {"model": {"preset": "debug_moe", "moe_top_k": 1, "moe_aux_loss_weight": 0.0}}
    assert config_from_dict(old).model == cfg
    assert notes == [n for n in notes if "moe_top_k" in n or "moe_aux_loss_weight" in n]


def test_fingerprints_of_old_and_new_spellings_are_the_same_run():
    from kiln.checkpoint.fingerprint import fingerprint_changes, run_fingerprint

    cfg = JobConfig(model=ModelConfig(moe=MoEConfig(**NESTED)))
    current = run_fingerprint(cfg, global_batch=8)
    assert current["model.moe.top_k"] == 2
    # What an older kiln recorded: the same settings under the flat names.
    old = {k.replace("model.moe.", "model.moe_"): v for k, v in current.items()}
    old["model.num_experts"] = old.pop("model.moe_num_experts")
    assert "model.moe_top_k" in old and "model.num_experts" in old
    assert fingerprint_changes(old, current) == []
    old["model.moe_top_k"] = 4
    assert fingerprint_changes(old, current) == ["model.moe.top_k: 4 -> 2"]
