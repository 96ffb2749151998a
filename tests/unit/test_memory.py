from kiln.config import JobConfig, ModelConfig
from kiln.metrics.memory import estimate_memory
from kiln.model import count_params

ONE = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}


def job(ac: str) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(
            dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=1000, ffn_hidden_dim=1024
        )
    )
    cfg.train.seq_len, cfg.train.batch_size, cfg.train.activation_checkpointing = 1024, 2, ac
    return cfg


def test_activation_checkpointing_trades_memory_in_order():
    none, selective, full = (
        estimate_memory(job(ac), ONE).activations for ac in ("none", "selective", "full")
    )
    assert full < selective < none
    tokens, dim = 2048, 512
    logits = 8 * tokens * 1000
    assert none == 8 * 34 * tokens * dim + logits
    assert full == 8 * 2 * tokens * dim + 34 * tokens * dim + logits


def test_model_state_is_sharded_over_every_parameter_splitting_dim():
    cfg = job("full")
    whole = estimate_memory(cfg, ONE).model_state
    assert whole == 16 * count_params(cfg.model).total
    split = estimate_memory(cfg, {**ONE, "dp_shard": 4, "tp": 2, "dp_replicate": 3}).model_state
    assert split == whole / 8
