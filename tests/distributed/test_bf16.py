"""bf16 mixed precision, one code path on every device (kiln/parallel/mixed_precision.py): FSDP's
MixedPrecisionPolicy where FSDP shards, autocast where it does not, on CPU exactly as on CUDA.

The debug model trains 8 steps in bf16 in one process (autocast), at dp_shard=2 and at
tp=2 × dp_shard=2 (FSDP policy), each on the same global batch as one fp32 process. bf16 rounds
every matmul input to 8 bits of mantissa, so the losses are not equal, but each step's loss stays
within BAND of the fp32 loss. Measured on CPU (losses 8.33 -> 8.06): the largest difference over
the 8 steps was 3.8e-5 in one process (autocast keeps norms and softmax in fp32) and 3.5e-4 under
FSDP (everything but the loss in bf16); BAND = 5e-3 leaves a 14x margin for other CPUs' kernels.

The dtype check: the sharded parameters (the master weights the optimizer steps) and their
gradients are fp32, matmuls compute in bf16, and FSDP reduces gradients in fp32.
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from kiln.config import load_config
from kiln.model import build_model, materialize
from kiln.parallel.apply import apply_parallelism
from kiln.parallel.mesh import init_parallel
from kiln.parallel.mixed_precision import training_autocast
from kiln.train.loss import token_loss_sum
from tests.conftest import DEBUG_CONFIG
from tests.distributed.parity import GLOBAL_BATCH, records

STEPS = 8
BAND = 5e-3  # absolute, in nats
# fp32 layouts differ from one process by about 1e-6 (reduction order); bf16 by more.
NOT_FP32 = 5e-6

LAYOUTS = {
    "one process": (1, []),
    "dp_shard=2": (2, ["--distributed.dp_shard=2", "--train.batch_size=4"]),
    "tp=2 x dp_shard=2": (4, ["--distributed.tp=2", "--train.batch_size=4"]),
}


@pytest.fixture(scope="module")
def fp32_losses(train, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fp32") / "one"
    train(
        run_dir,
        1,
        f"--train.batch_size={GLOBAL_BATCH}",
        "--train.mixed_precision=fp32",
        steps=STEPS,
    )
    return {step: r["loss"] for step, r in records(run_dir).items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_tracks_the_fp32_losses(layout, fp32_losses, train, tmp_path):
    nproc, overrides = LAYOUTS[layout]
    batch = [] if nproc > 1 else [f"--train.batch_size={GLOBAL_BATCH}"]
    run_dir = tmp_path / "bf16"
    train(run_dir, nproc, *batch, *overrides, "--train.mixed_precision=bf16", steps=STEPS)
    bf16 = {step: r["loss"] for step, r in records(run_dir).items()}
    diffs = {step: abs(bf16[step] - fp32_losses[step]) for step in fp32_losses}
    assert max(diffs.values()) <= BAND, diffs
    # bf16 really ran: on CPU, too, the losses are not the fp32 ones.
    assert max(diffs.values()) > NOT_FP32, diffs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_master_weights_gradients_and_reduction_are_fp32(layout, gangs):
    nproc, overrides = LAYOUTS[layout]
    gangs.run(nproc, check_dtypes, overrides)


def check_dtypes(overrides: list[str]) -> None:
    """One forward and backward of the debug model in bf16 on this rank (a gang job)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(
        DEBUG_CONFIG, [*overrides, "--train.mixed_precision=bf16"], world_size=world_size
    )
    parallel = init_parallel(cfg.distributed, torch.device("cpu"))
    try:
        (model,) = apply_parallelism(build_model(cfg.model), cfg, parallel)
        materialize(model, device="cpu", seed=cfg.train.seed)
        computed = []
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda m, i, out: computed.append(out.dtype))
        tokens = torch.randint(cfg.model.vocab_size, (2, cfg.train.seq_len))
        sharded_loss = loss_parallel() if parallel.degrees["tp"] > 1 else contextlib.nullcontext()
        with sharded_loss:
            with training_autocast(cfg, parallel):
                logits = model(tokens)
            token_loss_sum(logits, tokens).backward()
        assert set(computed) == {torch.bfloat16}
        for name, param in model.named_parameters():
            assert param.dtype == torch.float32, name
            assert param.grad.dtype == torch.float32, name
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert bool(units) == (parallel.fsdp_mesh() is not None)
        for unit in units:
            # FSDP's own record of the dtypes it gathers parameters in and reduces gradients in.
            group = unit._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                assert fsdp_param.param_dtype == torch.bfloat16
                assert fsdp_param.reduce_dtype == torch.float32
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
