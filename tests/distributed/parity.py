"""Helpers for parity runs (docs/architecture.md, "Parity"): `kiln train` jobs on CPU with gloo,
fp32, the debug model, 10 steps, the same global batch of 8 sequences of 64 tokens, compared with
one process step by step: the loss, the global gradient norm and every parameter's gradient norm.
Gradient clipping at 0.5 is active most steps, so the clipped update is compared too. The jobs run
on gangs (workers.py)."""

import json
import shutil

from tests.conftest import DEBUG_CONFIG

STEPS = 10
GLOBAL_BATCH = 8
TOLERANCE = 1e-5
# A parameter's gradient norm is compared within TOLERANCE of itself, or of FLOOR times the
# step's global gradient norm when it is smaller: a gradient that cancels to almost nothing keeps
# the rounding noise of the large terms it sums, which a relative bound would call a mismatch.
# Measured over every layout here: at most 2e-6 relative for any parameter (1e-7 for the norm
# weights, the smallest at about 1.3e-4 of the global norm). Under the floor those get 8e-5
# relative, still far tighter than a real mistake (an unreduced tp gradient: 20-45%).
FLOOR = 1e-3
# Checkpoints at steps 5 and 10, for the runs that another run resumes from.
SAVE = "--checkpoint.interval=5"


# Sliding-window attention on the first of the debug model's two blocks (24 of the runs' 64
# tokens, so windows cross context parallel's chunks) and attention sinks on both: carried by
# layouts of every kind (test_parity.py's tp=2 and full AC, test_context_parallel.py's
# cp=2 all-to-all x tp=2, test_pipeline.py's 1f1b with a document mask).
WINDOWED = (
    "--model.sliding_window=24",
    "--model.layer_types=['sliding_attention', 'full_attention']",
    "--model.attention_sinks=true",
)

# gpt-oss's block options (docs/models.md) on top of an MoE model: biases on the attention, the
# router and the experts, attention sinks, a sliding window on every layer, the clamped SwiGLU
# (its limit low enough to bind at the debug models' activations, about 0.2 at init) and YaRN
# without rounded ramp ends. Carried by test_moe_parity.py's tp=2, dp_shard=2 full AC, cp=2 x
# tp=2 compiled and pp=2 gpipe x dp_shard=2 layouts and test_expert_parallel.py's ep=2 x tp=2.
GPT_OSS_BLOCK = (
    "--model.attention_bias=true",
    "--model.attention_sinks=true",
    "--model.sliding_window=24",
    "--model.moe.bias=true",
    "--model.moe.activation=clamped_swiglu",
    "--model.moe.swiglu_limit=0.3",
    "--model.rope_scaling=yarn",
    "--model.rope_scaling_factor=4.0",
    "--model.rope_original_max_seq_len=32",
    "--model.rope_yarn_truncate=false",
)

# Every pipeline schedule, with the virtual stages per rank it runs at pp=2 and pp=4.
VIRTUAL_STAGES = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "interleaved_zero_bubble": 2,
    "zbv": 2,
}


def schedule(name):
    """Overrides selecting pipeline schedule `name`."""
    return [
        f"--distributed.pp_schedule={name}",
        f"--distributed.pp_virtual_stages={VIRTUAL_STAGES[name]}",
    ]


def train_args(run_dir, demo_data, *overrides, steps=STEPS):
    """`kiln train` arguments shared by every parity run."""
    args = [
        DEBUG_CONFIG,
        f"--data.path={demo_data}",
        f"--metrics.run_dir={run_dir}",
        f"--train.max_steps={steps}",
        "--metrics.log_interval=1",
        "--metrics.param_grad_norms=true",
        "--metrics.plot=false",
        "--train.grad_clip_norm=0.5",
        # Half the debug recipe's sequence: the layouts split heads, layers, batches and
        # parameters, none of which this shortens, and each step costs half as much.
        "--train.seq_len=64",
        # The loader's order does not depend on its worker process (tests/unit/test_loader.py);
        # each job starting and stopping one per rank costs more than its ten steps of reading.
        "--data.num_workers=0",
        # Saving costs a quarter of a job; the runs that are resumed from ask for it (SAVE).
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        # A rank that died or hung fails the others' next collective in 2 minutes, not 10.
        "--resilience.collective_timeout_s=120",
        *overrides,
    ]
    return [*map(str, args)]


def reference_args(*model_overrides):
    """`runs` arguments of the reference run of a model variant; it saves checkpoints, which
    resume tests continue in other layouts."""
    return 1, f"--train.batch_size={GLOBAL_BATCH}", SAVE, *model_overrides


def records(run_dir):
    return {
        r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


def mismatches(
    got, expected, *, tolerance=TOLERANCE, param_tolerance=TOLERANCE, norm_tolerance=None
):
    """What differs between two records of one step: {key: (got, expected)}, where a key is
    'loss', 'grad_norm' or 'param_grad_norms/<name>' (a name missing on one side: None).
    `tolerance`, `norm_tolerance`, `param_tolerance`: the relative bounds of the loss, of the
    global gradient norm (`tolerance` unless given) and of the per-parameter norms (TOLERANCE
    unless a test says why its runs are noisier)."""
    bounds = {
        "loss": tolerance,
        "grad_norm": tolerance if norm_tolerance is None else norm_tolerance,
    }
    found = {
        key: (got[key], expected[key])
        for key, bound in bounds.items()
        if abs(got[key] - expected[key]) > bound * abs(expected[key])
    }
    norms, reference = got["param_grad_norms"], expected["param_grad_norms"]
    floor = FLOOR * expected["grad_norm"]
    for name in sorted(norms.keys() | reference.keys()):
        a, b = norms.get(name), reference.get(name)
        if a is None or b is None or abs(a - b) > param_tolerance * max(abs(b), floor):
            found[f"param_grad_norms/{name}"] = (a, b)
    return found


def assert_parity(
    got,
    expected,
    steps=range(1, STEPS + 1),
    *,
    tolerance=TOLERANCE,
    param_tolerance=TOLERANCE,
    norm_tolerance=None,
):
    for step in steps:
        found = mismatches(
            got[step],
            expected[step],
            tolerance=tolerance,
            param_tolerance=param_tolerance,
            norm_tolerance=norm_tolerance,
        )
        listing = "\n".join(f"  {key}: {a} vs one process {b}" for key, (a, b) in found.items())
        assert not found, f"step {step}: {len(found)} values differ\n{listing}"


def copy_to_resume(run_dir, dest):
    """A copy of a finished run with only its step-5 checkpoint (the step-10 one dropped), for
    the next run in `dest` to resume at step 6; returns that checkpoint. The copy's log stops at
    step 5 too, so any later step in it is the resumed run's."""
    shutil.copytree(run_dir, dest)
    log = dest / "metrics.jsonl"
    kept = [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= 5]
    log.write_text("".join(f"{line}\n" for line in kept))
    checkpoints = dest / "checkpoints"
    shutil.rmtree(checkpoints / f"step_{STEPS:08d}")
    (checkpoints / "latest").unlink()
    return checkpoints / "step_00000005"
