"""FP8 training in one process on the CPU, where torchao emulates the float8 matmuls (same casts
and scales as on a GPU): which layers compute in float8, their numerics against bf16, and the
errors. Layouts are compared in tests/distributed/test_float8.py."""

import copy
import importlib.util

import pytest
import torch

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_utils import compute_error

from kiln.cli import main
from kiln.config import JobConfig, ModelConfig, MoEConfig, load_config
from kiln.config.sections import Float8Config, TrainConfig
from kiln.config.validate import collect_problems
from kiln.errors import ConfigError
from kiln.model import build_model
from kiln.model.feed_forward import FeedForward
from kiln.model.llama.attention import Attention
from kiln.model.llama.plan import llama_plan
from kiln.model.rope import rope_tables
from kiln.parallel.apply import apply_parallelism
from kiln.parallel.float8 import convert_to_float8, float8_layer_plan
from tests.conftest import REPO

MODEL = ModelConfig(
    dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=384, max_seq_len=64
)
# torchao's own bar for float8 training numerics against bf16 (its LLaMa feed-forward
# integration test): output and every weight gradient above 20 dB SQNR.
SQNR_DB = 20.0
EXCLUDED = llama_plan(MODEL).float8_excluded
# Except the query and key projections' gradients under tensorwise: their output gradient is
# rounded to e5m2 twice in a row (as wo's and then as their own, with the softmax backward in
# between). Measured 19.9-20.5 dB over three seeds (benchmarks/fp8.md); rowwise keeps
# gradients in e4m3 and measures 22.2 dB.
TWICE_ROUNDED_SQNR_DB = 19.0


def job(model: ModelConfig = MODEL, **fp8) -> JobConfig:
    return JobConfig(model=model, train=TrainConfig(mixed_precision="fp8"), fp8=Float8Config(**fp8))


def test_every_linear_layer_but_the_head_computes_in_float8():
    plan = float8_layer_plan(build_model(MODEL), job(), tp=1, excluded=EXCLUDED)
    assert plan["output"] == "kept out of float8 ('output')"
    chosen = sorted(name for name, reason in plan.items() if reason is None)
    assert len(chosen) == 2 * 7 and "layers.1.attention.wq" in chosen


def test_routers_misaligned_layers_and_named_layers_stay_in_bf16():
    cfg = job(MODEL, keep_high_precision=["wo", "layers.0"])
    plan = float8_layer_plan(build_model(MODEL), cfg, tp=1, excluded=EXCLUDED)
    assert plan["layers.1.attention.wo"] == "kept out of float8 ('wo')"
    assert plan["layers.0.feed_forward.w1"] == "kept out of float8 ('layers.0')"
    assert plan["layers.1.feed_forward.w1"] is None
    # ffn_hidden_dim 384 / tp 16 = 24: not a multiple of 16 on each rank.
    plan = float8_layer_plan(build_model(MODEL), job(), tp=16, excluded=EXCLUDED)
    assert "not multiples of 16" in plan["layers.0.feed_forward.w1"]


def test_moe_routers_and_routed_experts_stay_in_bf16():
    cfg = ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64,
        ffn_hidden_dim=128,
        moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_dim=64, first_dense_layers=1, shared_experts=1),
    )  # fmt: skip
    plan = float8_layer_plan(build_model(cfg), job(cfg), tp=1, excluded=EXCLUDED)
    assert plan["layers.1.feed_forward.router.gate"] == "kept out of float8 ('router')"
    assert plan["layers.1.feed_forward.shared_experts.w1"] is None
    # The routed experts are stacked weights, not linear layers: not converted, not listed.
    assert not any("experts.w" in name and "shared" not in name for name in plan)


def test_a_filter_that_leaves_nothing_in_float8_is_one_clear_error():
    model = build_model(MODEL)
    cfg = job(keep_high_precision=["layers"])
    with pytest.raises(ConfigError, match="no linear layer is left to compute in float8"):
        convert_to_float8(model, cfg, device=torch.device("cpu"), tp=1, excluded=EXCLUDED)


def attention(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_tables(MODEL.resolved_head_dim, x.shape[1], 10000.0, "cpu")
    return module(x, cos, sin)


LAYER_TYPES = {
    "attention": (lambda: Attention(MODEL), attention),
    "feed_forward": (lambda: FeedForward(MODEL.dim, MODEL.ffn_hidden_dim), lambda m, x: m(x)),
}


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_outputs_and_weight_gradients_match_bf16_within_torchaos_bar(recipe, layer_type):
    """Each kind of layer kiln converts, in bf16 and with float8 linear layers on the same weights
    and inputs: output and every weight's gradient above torchao's 20 dB SQNR."""
    build, forward = LAYER_TYPES[layer_type]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, MODEL.dim, generator=gen).bfloat16()
    grad_out = torch.randn(4, 64, MODEL.dim, generator=gen).bfloat16()
    torch.manual_seed(0)
    reference = build().bfloat16()
    fp8 = copy.deepcopy(reference)
    convert_to_float8(fp8, job(recipe=recipe), device=torch.device("cpu"), tp=1)
    assert any(isinstance(m, Float8Linear) for m in fp8.modules())
    outputs = {}
    for name, module in (("bf16", reference), ("fp8", fp8)):
        outputs[name] = forward(module, x)
        outputs[name].backward(grad_out)
    assert compute_error(outputs["bf16"].float(), outputs["fp8"].float()) > SQNR_DB
    # float8 did change the numbers: the comparison is not of bf16 with itself.
    assert not torch.equal(outputs["bf16"], outputs["fp8"])
    grads = dict(fp8.named_parameters())
    for name, param in reference.named_parameters():
        twice = recipe == "tensorwise" and name in ("wq.weight", "wk.weight")
        bar = TWICE_ROUNDED_SQNR_DB if twice else SQNR_DB
        assert compute_error(param.grad.float(), grads[name].grad.float()) > bar, name


def test_float8_checkpoints_hold_the_same_weights_as_bf16_ones():
    cfg = job()
    (fp8,) = apply_parallelism(build_model(MODEL), cfg)
    assert fp8.state_dict().keys() == build_model(MODEL).state_dict().keys()


def test_validation_names_the_extra_and_the_recipe_rules(monkeypatch):
    problems = collect_problems(job(recipe="rowwise", fsdp_float8_all_gather=True), 1)
    assert any("needs fp8.recipe = 'tensorwise'" in p for p in problems), problems
    assert any("not one of 'tensorwise'" in p for p in collect_problems(job(recipe="blockwise"), 1))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "torchao" else real(name)
    )
    problems = collect_problems(job(), 1)
    assert any("pip install 'kiln[fp8]'" in p for p in problems), problems


def test_older_gpus_are_refused_with_the_capability_they_lack(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8\.9 or newer .* this one is 8\.0"):
        convert_to_float8(build_model(MODEL), job(), device=torch.device("cuda"), tp=1)


def test_kiln_check_says_what_stays_in_high_precision(capsys):
    recipe = str(REPO / "configs" / "train" / "debug_moe.toml")
    args = ["check", recipe, "--train.mixed_precision=fp8", "--config-only"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "# fp8: 14 of 16 linear layers in float8 (tensorwise), the rest in bf16" in out
    assert "1 kept out of float8 ('output'), 1 kept out of float8 ('router')" in out
    assert "the routed experts compute in bf16" in out and "MFU is against the bf16 peak" in out


def test_tensorwise_tensor_parallel_takes_torchaos_float8_styles():
    """Split layers that compute in float8 take the float8 styles; a prepared input is cast to
    float8 before its gather only when every column-split layer that reads it is float8."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        SequenceParallel,
    )
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from kiln.parallel.float8 import float8_tensor_parallel

    def styles(**fp8):
        model = build_model(MODEL)
        convert_to_float8(model, job(**fp8), device=torch.device("cpu"), tp=2, excluded=EXCLUDED)
        block = model.layers["0"]
        return float8_tensor_parallel(block, llama_plan(MODEL).block_tp(block))

    every = styles()
    assert type(every["attention"]) is PrepareFloat8ModuleInput
    assert every["attention"].fwd_config_submodule_fqn == "wq"
    assert type(every["feed_forward.w1"]) is Float8ColwiseParallel
    assert type(every["attention.wo"]) is Float8RowwiseParallel
    assert type(every["attention_norm"]) is SequenceParallel

    # wk kept in high precision: the attention's input is gathered as it is, and each float8
    # layer casts its own copy.
    partly = styles(keep_high_precision=["wk"])
    assert type(partly["attention"]) is PrepareModuleInput
    assert type(partly["attention.wk"]) is ColwiseParallel
    assert type(partly["attention.wq"]) is Float8ColwiseParallel
    assert type(partly["feed_forward"]) is PrepareFloat8ModuleInput


def test_kiln_check_says_how_tensor_parallel_gathers_float8_inputs(capsys):
    recipe = str(REPO / "configs" / "train" / "debug.toml")
    for recipe_name, gathered in (("tensorwise", "float8"), ("rowwise", "bf16")):
        args = ["check", recipe, "--train.mixed_precision=fp8", f"--fp8.recipe={recipe_name}"]
        assert main([*args, "--distributed.tp=2", "--world-size=2", "--config-only"]) == 0
        assert f"tensor parallel gathers their inputs in {gathered}" in capsys.readouterr().out


def test_deepseek_blocks_gather_float8_only_where_every_taker_is_split_float8():
    """Tensorwise float8 styles for a DeepSeek-V3 block under tp: MLA's input also reaches its
    whole down-projections (wq_a, wkv_a), so it is gathered in high precision (cast to float8
    for them, it crashed: "Expecting both Float8TrainingTensor for mm inputs"); a dense
    feed-forward's, taken by its split w1 and w3 only, is gathered in float8; the MTP
    projection, which runs on each tp rank's part of the sequence, stays out of float8."""
    from torch.distributed.tensor.parallel import PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

    from kiln.model.registry import family_of
    from kiln.parallel.float8 import float8_tensor_parallel

    cfg = load_config(str(REPO / "configs/train/debug.toml"), ["--model.preset=deepseek_v3_debug"])
    plan = family_of(cfg.model).parallel_plan(cfg.model)
    model = build_model(cfg.model)
    convert_to_float8(model, cfg, device=torch.device("cpu"), tp=2, excluded=plan.float8_excluded)
    dense = model.layers["0"]
    styles = float8_tensor_parallel(dense, plan.block_tp(dense))
    assert isinstance(dense.attention.wq_b, Float8Linear)
    assert type(styles["attention"]) is PrepareModuleInput
    assert type(styles["feed_forward"]) is PrepareFloat8ModuleInput
    assert not isinstance(model.mtp.depths["1"].proj, Float8Linear)
