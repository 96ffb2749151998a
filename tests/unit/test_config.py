import ast
import dataclasses
from pathlib import Path

import pytest

import kiln.config
from kiln.cli import main
from kiln.config import JobConfig, config_from_dict, load_config, resolve_layout, to_toml, validate
from kiln.config.load import parse_override
from kiln.errors import ConfigError
from tests.conftest import DEBUG_CONFIG


def test_debug_recipe_loads_with_preset():
    cfg = load_config(DEBUG_CONFIG, world_size=1)
    assert cfg.model.preset == "debug"
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.vocab_size) == (128, 2, 4096)


def test_explicit_model_keys_override_the_preset():
    cfg = config_from_dict({"model": {"preset": "llama3_70b", "n_layers": 2}})
    assert cfg.model.n_layers == 2
    assert cfg.model.dim == 8192 and cfg.model.n_kv_heads == 8


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("llama3_7b", (4096, 32, 32, 8, 14336, 128256, 4096, 500000.0)),
        ("llama3_13b", (5120, 40, 40, 8, 17920, 128256, 4096, 500000.0)),
        ("llama3_70b", (8192, 80, 64, 8, 28672, 128256, 4096, 500000.0)),
    ],
)
def test_seed_presets(name, shape):
    m = config_from_dict({"model": {"preset": name}}).model
    assert (
        m.dim,
        m.n_layers,
        m.n_heads,
        m.n_kv_heads,
        m.ffn_hidden_dim,
        m.vocab_size,
        m.max_seq_len,
        m.rope_theta,
    ) == shape


def test_cli_overrides_are_toml_literals():
    assert parse_override("--train.max_steps=200") == (["train", "max_steps"], 200)
    assert parse_override("--optimizer.lr=1e-4") == (["optimizer", "lr"], 1e-4)
    assert parse_override("--train.compile=true") == (["train", "compile"], True)
    assert parse_override("--optimizer.betas=[0.9, 0.99]") == (["optimizer", "betas"], [0.9, 0.99])
    assert parse_override("--data.path=data/my corpus") == (["data", "path"], "data/my corpus")
    cfg = load_config(DEBUG_CONFIG, ["--metrics.run_dir=2024-01-01", "--data.path=1234"])
    assert (cfg.metrics.run_dir, cfg.data.path) == ("2024-01-01", "1234")  # text keys keep the text
    cfg = load_config(DEBUG_CONFIG, ["--train.max_steps=7", "--optimizer.lr=1"])
    assert (
        cfg.train.max_steps == 7 and cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    )


def test_every_problem_is_reported_at_once():
    raw = {
        "trian": {},
        "train": {"batch_sze": 3, "max_steps": "many"},
        "model": {"n_heads": 8, "n_kv_heads": 3},
        "optimizer": {"lr": -1.0},
    }
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, world_size=1)
    message = str(info.value)
    assert "5 problems" in message
    assert "unknown section 'trian' (did you mean 'train'?)" in message
    assert "unknown key 'train.batch_sze' (did you mean 'batch_size'?)" in message
    assert "train.max_steps: expected an integer, got 'many'" in message
    assert "model.n_heads (8) must be divisible by model.n_kv_heads (3)" in message
    assert "optimizer.lr must be positive" in message


def test_unknown_preset_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'llama3_70b'"):
        config_from_dict({"model": {"preset": "llama3_70"}})


def test_toml_syntax_error_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nmax_steps = = 3\n")
    with pytest.raises(ConfigError, match="TOML syntax error"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(DEBUG_CONFIG, ["--optimizer.betas=[0.8, 0.9]", '--data.path=a "quoted" path'])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert dataclasses.asdict(load_config(path)) == dataclasses.asdict(cfg)


def test_layout_arithmetic():
    cfg = JobConfig()
    cfg.distributed.tp, cfg.distributed.pp = 2, 2
    assert resolve_layout(cfg.distributed, 32)["dp_shard"] == 8
    validate(cfg, 32)
    with pytest.raises(ConfigError, match="not divisible"):
        validate(cfg, 6)
    cfg.distributed.dp_shard = 4
    with pytest.raises(ConfigError, match="= 16 processes, but the world size is 32"):
        validate(cfg, 32)


def test_tp_must_divide_heads():
    cfg = JobConfig()
    cfg.model.n_heads, cfg.model.n_kv_heads = 8, 2
    cfg.distributed.tp = 4
    with pytest.raises(ConfigError, match=r"distributed.tp \(4\) must divide"):
        validate(cfg, 4)


def test_choices_are_checked():
    cfg = JobConfig()
    cfg.train.activation_checkpointing = "some"
    cfg.scheduler.name = "cosin"
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert "train.activation_checkpointing = 'some'" in str(info.value)
    assert "scheduler.name = 'cosin'" in str(info.value)


def test_llama3_rope_scaling_values_are_checked():
    bad = {
        "rope_scaling": "llama3",
        "rope_scaling_factor": 0.5,
        "rope_low_freq_factor": 4.0,
        "rope_high_freq_factor": 1.0,
        "rope_original_max_seq_len": 0,
    }
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": bad}, world_size=1)
    message = str(info.value)
    assert "3 problems" in message
    assert "model.rope_scaling_factor must be >= 1" in message
    assert "must satisfy 0 < low < high" in message
    assert "model.rope_original_max_seq_len must be positive" in message
    with pytest.raises(ConfigError, match=r"model\.rope_scaling = 'ntk' is not one of"):
        config_from_dict({"model": {"rope_scaling": "ntk"}}, world_size=1)
    # The factors are Llama 3.1's by default and ignored without rope_scaling = "llama3".
    assert (
        config_from_dict(
            {"model": {"rope_scaling": "llama3"}}, world_size=1
        ).model.rope_scaling_factor
        == 8.0
    )
    config_from_dict({"model": {"rope_scaling_factor": 0.5}}, world_size=1)


def test_kiln_check_refuses_a_seq_len_that_cp_cannot_split(capsys):
    # The rest of context parallel's validation is in test_context_parallel.py.
    args = ["check", str(DEBUG_CONFIG), "--world-size", "4", "--distributed.cp=4"]
    assert main([*args, "--train.seq_len=100"]) == 2
    assert "must be divisible by 2 × distributed.cp = 8" in capsys.readouterr().err


def test_config_imports_nothing_of_kiln_but_errors():
    """The foundation layer: config must not reach up into model, parallel or train (the
    errors and the logger are the bottom layer, below it)."""
    for path in Path(kiln.config.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kiln."):
                allowed = ("kiln.config", "kiln.errors", "kiln.log")
                assert node.module.startswith(allowed), (path, node.module)


def test_a_removed_key_is_ignored_with_a_note(capsys):
    """The resolved config.toml of every older run and checkpoint sets
    distributed.shared_memory_collectives: it still loads, and kiln says the key is gone."""
    from kiln.config import load as config_load

    config_load._noted.clear()
    raw = {"distributed": {"shared_memory_collectives": True, "tp": 2}}
    cfg = config_from_dict(raw, ["--distributed.shared_memory_collectives=false"], world_size=2)
    assert cfg.distributed.tp == 2
    assert not hasattr(cfg.distributed, "shared_memory_collectives")
    err = capsys.readouterr().err
    assert err.count("distributed.shared_memory_collectives was removed and is ignored") == 1
    assert "Delete it from the recipe" in err


def test_a_word_outside_a_literal_key_is_one_problem_with_a_suggestion():
    with pytest.raises(ConfigError) as error:
        config_from_dict({"resilience": {"nan_action": "rollbak"}}, world_size=1)
    assert "(1 problem)" in str(error.value)
    assert (
        "resilience.nan_action = 'rollbak' is not one of 'stop', 'rollback' "
        "(did you mean 'rollback'?)"
    ) in str(error.value)
    # Overrides keep the text as written, and a config built in Python is checked by validate.
    cfg = config_from_dict({}, ["--train.mixed_precision=fp32", "--checkpoint.resume=never"])
    assert (cfg.train.mixed_precision, cfg.checkpoint.resume) == ("fp32", "never")
    cfg.train.mixed_precision = "fp16"
    with pytest.raises(ConfigError, match=r"train\.mixed_precision = 'fp16' is not one of 'bf16'"):
        validate(cfg, 1)
