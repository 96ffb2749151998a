"""`kiln verify` passes a correct layout and fails a deliberately broken one.

Two cases run the command as users do (torchrun for the layout, a failed run's message); the
others hand verify's two runs to the shared gangs (workers.py), the same `kiln train` without
starting torchrun and its processes for each."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kiln.config import load_config, resolve_layout
from kiln.errors import KilnError
from kiln.parallel.verify import (
    _records,
    default_world_size,
    proxy_config,
    read_records,
    single_process_twin,
    write_recipe,
)
from kiln.parallel.verify import verify as verify_layout
from tests.conftest import DEBUG_CONFIG, REPO
from tests.distributed.workers import kiln_train
from tests.support.mutations import subprocess_env


def verify(demo_data, tmp_path, *extra, env=None, recipe=DEBUG_CONFIG, steps=4):
    command = [
        sys.executable,
        "-m",
        "kiln",
        "verify",
        str(recipe),
        "--data",
        str(demo_data),
        "--steps",
        str(steps),
        *extra,
    ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.fixture
def verify_on_gangs(gangs, demo_data, capsys):
    """verify_on_gangs(recipe, world_size, *overrides, mutation=None) -> (passed, printed
    report); `mutation` (tests/support/mutations.py) is installed in both runs' jobs."""

    def run(recipe, world_size, *overrides, mutation=None):
        def run_jobs(jobs, tmp):
            for cfg, nproc in jobs:
                args = [str(write_recipe(cfg, tmp))]
                gangs.run(nproc, kiln_train, args, mutation=mutation)
            return [read_records(cfg) for cfg, _ in jobs]

        cfg = load_config(recipe, list(overrides))
        capsys.readouterr()
        passed = verify_layout(
            cfg, world_size, steps=4, data_path=str(demo_data), run_jobs=run_jobs
        )
        return passed, capsys.readouterr().out

    return run


def test_verify_passes_hsdp_with_expert_parallel(verify_on_gangs):
    """The MoE recipe under HSDP × ep: the proxy keeps the 8 experts and top 2."""
    recipe = REPO / "configs" / "train" / "debug_moe.toml"
    layout = ["--distributed.dp_replicate=2", "--distributed.dp_shard=1", "--distributed.ep=2"]
    passed, report = verify_on_gangs(recipe, 4, *layout)
    assert passed, report
    assert "PASS" in report and "8 experts top-2" in report
    assert "dp_replicate=2" in report and "ep=2" in report


def test_the_proxy_of_a_large_moe_recipe_keeps_experts_and_top_k(tmp_path):
    cfg = load_config(REPO / "configs" / "train" / "moe_ep_32gpu.toml")
    proxy = proxy_config(cfg, 32, steps=2, run_dir=tmp_path, data_path="demo")
    m, full = proxy.model, cfg.model
    assert (m.moe.num_experts, m.moe.top_k) == (full.moe.num_experts, full.moe.top_k)
    assert m.moe.ffn_hidden_dim == 32 and (proxy.distributed.ep, proxy.distributed.tp) == (2, 4)


def test_averaged_instead_of_summed_gradients_are_caught(verify_on_gangs):
    passed, report = verify_on_gangs(
        DEBUG_CONFIG, 2, "--distributed.dp_shard=2", mutation="average_gradients"
    )
    assert not passed and "FAIL" in report and "<- differs" in report, report


def test_fsdp_before_tp_is_caught(demo_data, tmp_path):
    result = verify(
        demo_data,
        tmp_path,
        "--world-size",
        "4",
        "--distributed.tp=2",
        env=subprocess_env("fsdp_before_tp"),
    )
    assert result.returncode != 0, result.stdout + result.stderr
    assert "the layout run failed" in result.stderr
    # The mutation reached torchrun's ranks: tensor parallel met parameters FSDP had sharded.
    assert "Cannot distribute a DTensor with device mesh DeviceMesh((dp_shard" in result.stderr


def test_the_proxies_of_tp_and_zero_bubble_layouts_keep_their_structure(tmp_path):
    """What `kiln verify` runs for tensor parallel with FSDP and for a zero-bubble pipeline (the
    layouts themselves are proven against one process in test_parity.py and test_pipeline.py;
    the proxy's run and report are exercised end to end by the cases here that start
    torchrun): the layout's degrees, one micro-batch per stage, two blocks per virtual stage."""
    cfg = load_config(DEBUG_CONFIG, ["--distributed.tp=2"])
    tp = proxy_config(cfg, 4, steps=4, run_dir=tmp_path, data_path="demo")
    assert (tp.distributed.tp, resolve_layout(tp.distributed, 4)["dp_shard"]) == (2, 2)
    assert tp.model.dim % tp.distributed.tp == 0 and tp.train.mixed_precision == "fp32"
    zbv = [
        "--distributed.pp=2",
        "--distributed.pp_schedule=zbv",
        "--distributed.pp_virtual_stages=2",
    ]
    pipelined = proxy_config(
        load_config(DEBUG_CONFIG, [*zbv, "--model.n_layers=8"]),
        4,
        steps=4,
        run_dir=tmp_path,
        data_path="demo",
    )
    assert pipelined.model.n_layers == 8 and pipelined.train.batch_size == 2
    twin = single_process_twin(pipelined, 4)
    assert twin.train.batch_size == 4 and twin.distributed.pp == 1


def test_pipeline_gradients_scaled_twice_are_caught(verify_on_gangs):
    passed, report = verify_on_gangs(
        DEBUG_CONFIG, 2, "--distributed.pp=2", mutation="pp_scale_grads"
    )
    assert not passed and "FAIL" in report and "<- differs" in report, report


def test_verify_runs_a_shipped_recipe_as_it_is(demo_data, tmp_path):
    """A GPU recipe with dp_shard = -1 and no --world-size: dp_shard counts as 2, the proxy
    trains on the CPU in fp32."""
    recipe = REPO / "configs" / "train" / "7b.toml"
    result = verify(demo_data, tmp_path, recipe=recipe, steps=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout and "dp_shard=2" in result.stdout
    proxy = proxy_config(load_config(recipe), 2, steps=2, run_dir=tmp_path, data_path="demo")
    assert (proxy.train.device, proxy.train.mixed_precision) == ("cpu", "fp32")


@pytest.mark.parametrize(
    "recipe", sorted((REPO / "configs" / "train").glob("*.toml")), ids=lambda p: p.stem
)
def test_every_shipped_recipe_has_a_valid_proxy(recipe, tmp_path):
    """The docs say any shipped recipe can be verified: its proxy validates at the recipe's
    own layout, with what a short CPU run cannot do (profiling at step 20, W&B, evaluation,
    NaN rollback) set aside."""
    cfg = load_config(recipe)
    world_size = default_world_size(cfg.distributed)
    proxy = proxy_config(cfg, world_size, steps=5, run_dir=tmp_path, data_path="demo")
    assert not proxy.profiling.enabled and not proxy.metrics.wandb


def test_verify_says_what_it_set_aside(tmp_path, capsys):
    """The tour's command: the 13B validation recipe on 8 processes (profiling at steps 20..22,
    W&B online, held-out eval) runs its proxy and names what the proxy leaves out."""
    recipe = REPO / "configs" / "train" / "13b_24gpu_validation.toml"
    cfg = load_config(recipe, ["--distributed.dp_shard=2"])
    records = {step: {"step": step, "loss": 5.0, "grad_norm": 1.0} for step in range(1, 6)}
    passed = verify_layout(
        cfg, 8, steps=5, data_path="demo", run_jobs=lambda jobs, tmp: [records, records]
    )
    out = capsys.readouterr().out
    assert passed and "PASS" in out
    assert "not part of the proxy run: profiling (steps 20..22); W&B logging" in out


def test_a_failed_run_keeps_the_lines_that_say_what_is_wrong(tmp_path):
    stderr = (
        "kiln train: error: invalid config (1 problem):\n"
        "  - data.path 'x' not found: run kiln prepare\n"
        "E0101 torch.distributed.elastic: failed\n"
    )
    process = SimpleNamespace(returncode=2)
    cfg = load_config(DEBUG_CONFIG)
    with pytest.raises(KilnError) as failed:
        _records("one-process", cfg, process, "", stderr)
    message = str(failed.value)
    assert "the one-process run failed" in message and "invalid config (1 problem)" in message
    assert "  - data.path 'x' not found: run kiln prepare" in message
    assert "elastic" not in message
