"""Pipeline stage split, rank assignment and validation: pure config arithmetic, no processes."""

import ast
from pathlib import Path

import pytest

import kiln.parallel
from kiln.config import JobConfig, ModelConfig, validate
from kiln.config.sections import DistributedConfig
from kiln.errors import ConfigError
from kiln.model import build_model
from kiln.parallel.pipeline import split_into_stages
from kiln.parallel.pipeline_split import (
    bubble_fraction,
    layers_per_stage,
    stage_layers,
    stage_rank,
    stages_of_rank,
)


def dist(**kwargs) -> DistributedConfig:
    return DistributedConfig(**kwargs)


def test_balanced_split_counts_embedding_and_head_as_layers():
    assert layers_per_stage(dist(pp=2), 40) == [20, 20]  # the 13B recipe: 20 layers per stage
    assert layers_per_stage(dist(pp=4), 80) == [20, 21, 20, 19]
    even = dist(pp=4, pp_embedding_layers=0, pp_output_layers=0)
    assert layers_per_stage(even, 80) == [20] * 4
    # A heavy head pushes layers toward the front; every stage keeps at least one layer.
    assert layers_per_stage(dist(pp=2, pp_output_layers=3), 8) == [5, 3]
    assert layers_per_stage(dist(pp=4, pp_virtual_stages=2), 8) == [1] * 8


def test_explicit_split_and_layer_ranges():
    d = dist(pp=2, pp_layers_per_stage=[3, 5])
    assert layers_per_stage(d, 8) == [3, 5]
    assert list(stage_layers(d, 8, 0)) == [0, 1, 2]
    assert list(stage_layers(d, 8, 1)) == [3, 4, 5, 6, 7]


def test_stage_to_rank_loop_and_v():
    loop = dist(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    assert [stages_of_rank(loop, r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    v = dist(pp=4, pp_schedule="zbv", pp_virtual_stages=2)
    assert [stages_of_rank(v, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stage_rank(v, 7) == 0 and stage_rank(loop, 7) == 3


def test_bubble_shrinks_with_micro_batches_and_virtual_stages():
    one = bubble_fraction(dist(pp=4), 8)
    assert one == pytest.approx(3 / 11)
    assert bubble_fraction(dist(pp=4), 32) < one
    interleaved = dist(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    assert bubble_fraction(interleaved, 8) == pytest.approx(3 / 19)
    zbv = dist(pp=4, pp_schedule="zbv", pp_virtual_stages=2)
    assert bubble_fraction(zbv, 8) == 0
    assert 0 < bubble_fraction(zbv, 4) < bubble_fraction(dist(pp=4), 4)  # m < 2p - 1


@pytest.mark.parametrize("tied", [False, True])
def test_stages_keep_the_unsplit_parameter_names(tied):
    cfg = JobConfig(
        model=ModelConfig(
            dim=32, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=64, tie_embeddings=tied
        )
    )
    cfg.distributed = dist(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    whole = dict(build_model(cfg.model).named_parameters())
    names = [
        name
        for rank in range(2)
        for part in split_into_stages(cfg, rank)
        for name, _ in part.named_parameters()
    ]
    assert set(names) == set(whole)
    # Tied: the last stage holds a second copy of the embedding, as its output head.
    assert len(names) == len(whole) + tied
    first = split_into_stages(cfg, 0)[0]  # stage 0 of 4
    last = split_into_stages(cfg, 1)[-1]  # stage 3
    assert first.stage.first and not first.stage.last
    assert first.norm is None and first.output is None
    assert not last.stage.first and last.stage.last and last.norm is not None
    assert (last.tok_embeddings is not None) == tied


def problems(world_size=2, **overrides) -> str:
    cfg = JobConfig(model=ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2))
    cfg.train.batch_size = 8
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size)
    return str(error.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"distributed__pp_schedule": "1f1b_interleaved"},
            "distributed.pp_schedule = '1f1b_interleaved' is not one of",
        ),
        ({"distributed__pp_microbatches": 1}, "needs at least pp = 2 micro-batches"),
        (
            {"distributed__pp_microbatches": 3},
            "divisible by distributed.pp_microbatches = 3; use one of [2, 4, 8]",
        ),
        ({"train__batch_size": 1}, "set distributed.pp_microbatches >= 2"),
        ({"model__n_layers": 1}, "every stage needs at least one layer"),
        (
            {
                "model__n_layers": 6,
                "distributed__pp_schedule": "interleaved_1f1b",
                "distributed__pp_virtual_stages": 2,
            },
            "model.n_layers = 6 does not divide into",
        ),
        ({"distributed__pp_schedule": "zbv"}, "set pp_virtual_stages = 2"),
        (
            {"distributed__pp_schedule": "interleaved_1f1b"},
            "set distributed.pp_virtual_stages >= 2",
        ),
        ({"distributed__pp_virtual_stages": 2}, "runs one stage per rank"),
        ({"distributed__pp_layers_per_stage": [4, 3]}, "add up to model.n_layers = 8"),
        (
            {
                "train__compile": True,
                "distributed__pp_schedule": "zbv",
                "distributed__pp_virtual_stages": 2,
            },
            "zero-bubble schedules split each backward",
        ),
        (
            {"train__grad_accum_steps": 2, "distributed__grad_reduce": "per_step"},
            "a pipeline pass reduces gradients once per pass",
        ),
    ],
)
def test_bad_pipeline_settings_get_one_clear_message(overrides, expected):
    message = problems(distributed__pp=2, distributed__dp_shard=1, **overrides)
    assert expected in message


def test_pipeline_keys_are_inert_without_pp():
    cfg = JobConfig(model=ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2))
    cfg.distributed.pp_microbatches = 3
    validate(cfg, 1)


def test_parallel_recipes_name_no_module_of_the_model():
    """Blocks, TP styles, FSDP units and stage boundaries come from the model's plan
    (`Transformer.parallel_plan()`): kiln/parallel/ names none of the model's modules."""
    modules = {"layers", "tok_embeddings", "attention", "feed_forward", "norm", "output"}
    for path in Path(kiln.parallel.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            named = node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)
            assert named not in modules, f"{path.name}:{node.lineno} names {named!r}"
