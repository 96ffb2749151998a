"""The MoE keys of [model]: defaults keep a model dense, which blocks are MoE, and one clear
validation message per problem."""

import pytest

from kiln.config import JobConfig, ModelConfig, load_config
from kiln.config.validate import collect_problems
from tests.conftest import REPO

MOE = {"num_experts": 8, "moe_top_k": 2}


def problems(world_size: int = 1, **model) -> list[str]:
    cfg = JobConfig(model=ModelConfig(**model))
    return [p for p in collect_problems(cfg, world_size) if "moe" in p or "num_experts" in p]


def test_defaults_are_dense_and_valid():
    cfg = ModelConfig()
    assert cfg.num_experts == 0
    assert not any(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    assert problems() == []
    assert problems(**MOE) == []


@pytest.mark.parametrize(
    ("first_dense", "frequency", "moe_layers"),
    [(0, 1, [0, 1, 2, 3, 4, 5]), (1, 1, [1, 2, 3, 4, 5]), (0, 2, [0, 2, 4]), (1, 2, [1, 3, 5])],
)
def test_which_blocks_are_moe(first_dense, frequency, moe_layers):
    cfg = ModelConfig(
        n_layers=6, num_experts=4, moe_first_dense_layers=first_dense, moe_frequency=frequency
    )
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == moe_layers


def test_expert_width_defaults_to_the_dense_width():
    assert ModelConfig(ffn_hidden_dim=96, num_experts=4).expert_hidden_dim == 96
    assert ModelConfig(ffn_hidden_dim=96, moe_ffn_hidden_dim=32).expert_hidden_dim == 32


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"num_experts": 4, "moe_top_k": 5},
            "model.moe_top_k = 5 must be in [1, model.num_experts = 4]",
        ),
        ({**MOE, "moe_frequency": 0}, "model.moe_frequency must be >= 1"),
        (
            {**MOE, "n_layers": 2, "moe_first_dense_layers": 2},
            "model.moe_first_dense_layers = 2 leaves no MoE block among model.n_layers = 2",
        ),
        (
            {**MOE, "moe_n_groups": 3},
            "model.moe_n_groups = 3 must divide model.num_experts = 8 into equal groups; "
            "use one of [1, 2, 4, 8]",
        ),
        (
            {**MOE, "moe_n_groups": 2, "moe_topk_groups": 3},
            "model.moe_topk_groups = 3 exceeds model.moe_n_groups = 2",
        ),
        (
            {**MOE, "moe_top_k": 3, "moe_n_groups": 4, "moe_topk_groups": 1},
            "model.moe_top_k = 3 exceeds the 2 experts a token can reach "
            "(moe_topk_groups × experts per group = 1 × 2)",
        ),
        ({"moe_bias_update_rate": 0.001}, "model.moe_bias_update_rate = 0.001 needs a Mixture"),
        ({"moe_aux_loss_weight": 0.01}, "model.moe_aux_loss_weight = 0.01 needs a Mixture"),
        ({"moe_seq_aux_loss_weight": 1e-4}, "model.moe_seq_aux_loss_weight = 0.0001 needs"),
        ({"moe_router_z_loss_weight": 1e-3}, "model.moe_router_z_loss_weight = 0.001 needs"),
        ({"moe_shared_experts": 1}, "model.moe_shared_experts = 1 needs a Mixture-of-Experts"),
        ({"moe_shared_expert_gate": True}, "model.moe_shared_expert_gate = true needs a Mixture"),
        (
            {**MOE, "moe_shared_expert_gate": True},
            "model.moe_shared_expert_gate = true gates the shared experts, but "
            "model.moe_shared_experts = 0",
        ),
        ({**MOE, "moe_router": "noisy"}, "model.moe_router = 'noisy' is not one of"),
        ({**MOE, "moe_aux_loss_weight": -0.1}, "model.moe_aux_loss_weight must be >= 0"),
        ({**MOE, "moe_bias_update_rate": -1e-3}, "model.moe_bias_update_rate must be >= 0"),
        ({**MOE, "moe_capacity_factor": -1.0}, "model.moe_capacity_factor must be >= 0"),
        ({"num_experts": -2}, "model.num_experts must be >= 0"),
        ({**MOE, "moe_route_scale": 0.0}, "model.moe_route_scale must be positive"),
    ],
)
def test_each_problem_has_one_clear_message(model, message):
    found = problems(**model)
    assert len(found) == 1, found
    assert message in found[0]


def test_dense_message_names_the_fix():
    (message,) = problems(moe_bias_update_rate=0.001)
    assert "model.num_experts = 0 (dense): set num_experts > 0 or leave" in message


def test_every_layout_accepts_moe():
    # Tensor parallel included (each tp rank routes its part of the sequence), with every
    # balancing loss on: tests/distributed/test_moe_parity.py proves each layout.
    cfg = JobConfig(model=ModelConfig(**MOE, moe_seq_aux_loss_weight=0.01))
    cfg.distributed.tp, cfg.distributed.pp = 2, 2
    assert [p for p in collect_problems(cfg, 8) if "moe" in p or "num_experts" in p] == []


def test_debug_moe_recipe_loads():
    cfg = load_config(REPO / "configs" / "train" / "debug_moe.toml")
    assert cfg.model.preset == "debug_moe" and cfg.model.num_experts == 8
    assert [cfg.model.is_moe_layer(i) for i in range(cfg.model.n_layers)] == [False, True]
