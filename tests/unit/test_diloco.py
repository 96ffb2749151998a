"""DiLoCo's outer step on one rank's shards (kiln/parallel/diloco.py), against torch's SGD and
a hand-written reference of the algorithm on the same pseudo-gradients; the sync schedule and
the fragments; the settings DiLoCo refuses."""

from __future__ import annotations

import torch

from kiln.parallel.diloco import OuterOptimizer, Schedule, SyncPhase, fragment_of

LR, MOMENTUM, ROUNDS = 0.7, 0.9, 5


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(8, 4, generator=generator) for name in ("a", "b")}


def inner_steps(local: dict[str, torch.Tensor], seed: int) -> None:
    """A group's inner steps, as far as the outer step sees them: its weights move."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in local.values():
        tensor.add_(1e-2 * torch.randn(tensor.shape, generator=generator))


def test_the_outer_step_is_torchs_nesterov_sgd_bit_for_bit():
    """Fed the mean pseudo-gradient as its gradient, torch.optim.SGD(nesterov) takes the same
    steps: the same operations in the same order (a zero buffer plus Δ is exactly Δ)."""
    start = weights(0)
    outer = OuterOptimizer(start, lr=LR, momentum=MOMENTUM)
    reference = {name: torch.nn.Parameter(w.clone()) for name, w in start.items()}
    sgd = torch.optim.SGD(reference.values(), lr=LR, momentum=MOMENTUM, nesterov=True)
    groups = [{n: w.clone() for n, w in start.items()} for _ in range(2)]
    for round_ in range(ROUNDS):
        for g, local in enumerate(groups):
            inner_steps(local, seed=10 * round_ + g)
        names = ["a", "b"]
        deltas = [outer.pseudo_gradients(local, names) for local in groups]
        mean = [(d0 + d1) / 2 for d0, d1 in zip(*deltas, strict=True)]
        outer.step(names, mean)
        for name, delta in zip(names, mean, strict=True):
            reference[name].grad = delta.clone()
        sgd.step()
        for local in groups:
            outer.assign(local, names)
        for name in names:
            assert torch.equal(outer.synced[name], reference[name].detach()), (round_, name)
            assert all(torch.equal(local[name], outer.synced[name]) for local in groups)


def test_the_outer_step_matches_the_papers_update_rule():
    """DiLoCo's rule written out with plain arithmetic: v ← μ·v + Δ; θ ← θ − η·(Δ + μ·v).
    torch's fused `add(alpha=)` rounds once where the plain form rounds twice: within 2 ulp of
    the values (|θ| < 8 here: 2 × 2⁻²⁰ ≈ 2e-6 absolute)."""
    start = weights(1)
    outer = OuterOptimizer(start, lr=LR, momentum=MOMENTUM)
    theta = {n: w.double() for n, w in start.items()}
    velocity = {n: torch.zeros_like(w) for n, w in theta.items()}
    local = {n: w.clone() for n, w in start.items()}
    for round_ in range(ROUNDS):
        inner_steps(local, seed=round_)
        (delta_a, delta_b) = outer.pseudo_gradients(local, ["a", "b"])
        outer.step(["a", "b"], [delta_a, delta_b])
        outer.assign(local, ["a", "b"])
        for name, delta in (("a", delta_a), ("b", delta_b)):
            velocity[name] = MOMENTUM * velocity[name] + delta.double()
            theta[name] = theta[name] - LR * (delta.double() + MOMENTUM * velocity[name])
            # Elementwise IEEE float32 operations: the same rounding on any x86 CPU, Intel or AMD.
            torch.testing.assert_close(outer.synced[name].double(), theta[name], rtol=0, atol=4e-6)


def test_sync_every_step_with_outer_sgd_of_lr_1_and_no_momentum_averages_the_weights():
    """H = 1, η = 1, μ = 0: θ' = θ − mean(θ − θ_g) = mean(θ_g), the groups' weights averaged
    after every inner step (their inner optimizer states stay their own: this is parameter
    averaging, not HSDP). The subtractions round: within 2 ulp (|θ| < 8: 4e-6 absolute). One
    group: θ' is its own weights."""
    start = weights(2)
    outer = OuterOptimizer(start, lr=1.0, momentum=0.0)
    groups = [{n: w.clone() for n, w in start.items()} for _ in range(3)]
    for g, local in enumerate(groups):
        inner_steps(local, seed=g)
    mean_weights = {n: sum(local[n] for local in groups) / 3 for n in start}
    deltas = [outer.pseudo_gradients(local, ["a", "b"]) for local in groups]
    outer.step(["a", "b"], [sum(d) / 3 for d in zip(*deltas, strict=True)])
    for name in ("a", "b"):
        # Elementwise IEEE float32 operations: the same rounding on any x86 CPU, Intel or AMD.
        torch.testing.assert_close(outer.synced[name], mean_weights[name], rtol=0, atol=4e-6)
    alone = OuterOptimizer(start, lr=1.0, momentum=0.0)
    (local,) = [{n: w.clone() for n, w in start.items()}]
    inner_steps(local, seed=7)
    alone.step(["a", "b"], alone.pseudo_gradients(local, ["a", "b"]))
    for name in ("a", "b"):
        torch.testing.assert_close(alone.synced[name], local[name], rtol=0, atol=4e-6)


def test_a_checkpointed_outer_state_resumes_bit_for_bit():
    start = weights(3)
    a = OuterOptimizer(start, lr=LR, momentum=MOMENTUM)
    local = {n: w.clone() for n, w in start.items()}
    inner_steps(local, seed=0)
    a.step(["a", "b"], a.pseudo_gradients(local, ["a", "b"]))
    b = OuterOptimizer(weights(4), lr=LR, momentum=MOMENTUM)
    b.load_state_dict({k: {n: t.clone() for n, t in v.items()} for k, v in a.state_dict().items()})
    inner_steps(local, seed=1)
    for outer in (a, b):
        outer.step(["a", "b"], outer.pseudo_gradients(local, ["a", "b"]))
    assert all(torch.equal(a.synced[n], b.synced[n]) for n in ("a", "b"))


def test_the_schedule_of_four_steps_in_two_fragments_a_step_early():
    """H = 4, F = 2, τ = 1: a sync every 2 steps, each prepared a step before it performs."""
    schedule = Schedule(sync_every=4, fragments=2, delay=1)
    phases = {step: schedule.phases(step) for step in range(1, 9)}
    assert phases == {
        1: [SyncPhase.PREPARE],
        2: [SyncPhase.PERFORM],
        3: [SyncPhase.PREPARE],
        4: [SyncPhase.PERFORM],
        5: [SyncPhase.PREPARE],
        6: [SyncPhase.PERFORM],
        7: [SyncPhase.PREPARE],
        8: [SyncPhase.PERFORM],
    }
    assert [schedule.fragment(syncs) for syncs in range(4)] == [0, 1, 0, 1]
    plain = Schedule(sync_every=3)
    assert [plain.phases(step) for step in (1, 2, 3)] == [
        [],
        [],
        [SyncPhase.PREPARE, SyncPhase.PERFORM],
    ]


def test_fragments_are_contiguous_blocks_with_the_embedding_first_and_the_head_last():
    names = [
        "tok_embeddings.weight",
        *(f"layers.{i}.attention.wq.weight" for i in range(5)),
        "norm.weight",
        "output.weight",
    ]
    block_of = {name: int(name.split(".")[1]) for name in names if name.startswith("layers.")}
    fragments = fragment_of(names, block_of=block_of, blocks=5, fragments=2)
    assert fragments == {
        "tok_embeddings.weight": 0,
        "layers.0.attention.wq.weight": 0,
        "layers.1.attention.wq.weight": 0,
        "layers.2.attention.wq.weight": 0,
        "layers.3.attention.wq.weight": 1,
        "layers.4.attention.wq.weight": 1,
        "norm.weight": 1,
        "output.weight": 1,
    }


def _problems(*overrides: str) -> list[str]:
    from kiln.config import load_config
    from kiln.config.validate_fault_tolerance import fault_tolerance_problems
    from tests.conftest import DEBUG_CONFIG

    cfg = load_config(DEBUG_CONFIG, list(overrides))  # not validated: the checks are called
    return fault_tolerance_problems(cfg)


def test_diloco_settings_that_cannot_work_are_refused_with_their_reason():
    enabled = ["--fault_tolerance.enabled=true", "--distributed.dp_replicate=2"]
    diloco = [*enabled, "--fault_tolerance.sync=diloco"]
    cases = {
        ("--fault_tolerance.sync=diloco",): "needs fault_tolerance.enabled = true",
        (*diloco, "--fault_tolerance.sync_every=2", "--fault_tolerance.fragments=4"): (
            "sync_every = 2 is below fault_tolerance.fragments = 4"
        ),
        (*diloco, "--fault_tolerance.sync_every=10", "--fault_tolerance.fragments=4"): (
            "Use e.g. sync_every = 12"
        ),
        (
            *diloco,
            "--fault_tolerance.sync_every=12",
            "--fault_tolerance.fragments=2",
            "--fault_tolerance.fragment_sync_delay=6",
        ): "must be in 0 .. sync_every / fragments - 1 = 5",
        (*diloco, "--fault_tolerance.fragments=40", "--fault_tolerance.sync_every=40"): (
            "exceeds the model's"
        ),
        (*diloco, "--fault_tolerance.outer_lr=0"): "outer_lr must be > 0",
        (*diloco, "--optimizer.name=schedule_free_adamw"): "cannot run under",
        (*diloco, "--checkpoint.interval=50"): "checkpoint.interval = 50 is not a multiple",
    }
    for overrides, message in cases.items():
        problems = _problems(*overrides)
        assert any(message in problem for problem in problems), (overrides, problems)
