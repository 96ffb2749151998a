"""`kiln plan`: the layouts it enumerates are the validator's, ranked by predicted tok/s; its
JSON, its recipe (which `kiln check` accepts and estimates the same), its messages, and
`--fault-tolerance`'s answer against docs/fault_tolerance.md's model."""

import json
import math
import re

import pytest

from kiln.cli import main
from kiln.cli.plan import base_config
from kiln.config import config_from_dict, load_config, validate
from kiln.config.validate import collect_problems
from kiln.model import count_params
from kiln.plan.fault_tolerance import FailureInputs, as_dict, fault_tolerance
from kiln.plan.hardware import find_gpu, make_cluster
from kiln.plan.report import why
from kiln.plan.search import (
    CP_MODES,
    PP_SCHEDULES,
    PlanResult,
    evaluate,
    factorizations,
    layout_config,
    search,
    with_batch,
)
from tests.conftest import REPO


def test_factorizations_are_every_ordered_split_of_the_gpus():
    # 8 = 2³ over five dims (dp_replicate, dp_shard, cp, tp, pp): C(3 + 4, 4) ways.
    layouts = factorizations(8)
    assert len(layouts) == 35
    assert all(
        d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"] * d["pp"] == 8 for d in layouts
    )
    assert {d["ep"] for d in layouts} == {1}
    # MoE: ep divides the experts too.
    assert {d["ep"] for d in factorizations(8, moe_experts=4)} == {1, 2, 4}


def test_every_ranked_candidate_is_valid_fits_and_is_in_order():
    base = config_from_dict({"model": {"preset": "llama3_1b"}, "train": {"seq_len": 2048}})
    cluster = make_cluster(find_gpu("a100"), 8, 4)
    result = search(base, cluster)
    # Each factorization once per pipeline schedule and context-parallel exchange at most.
    per_layout = len(PP_SCHEDULES) * len(CP_MODES)
    assert result.ranked and result.layouts <= len(factorizations(8)) * per_layout
    speeds = [c.step.tokens_per_sec for c in result.ranked]
    assert speeds == sorted(speeds, key=lambda s: -float(f"{s:.3g}"))
    for candidate in result.ranked[:20]:
        validate(candidate.cfg, 8)
        assert candidate.fits and candidate.memory.reserved < 80e9


def test_each_cp_mode_wins_where_its_exchange_is_the_cheaper():
    """Llama-3.1 8B at 128k on 32 H100s, one sequence per micro-batch: at cp = 2 the all-gather
    (it moves and keeps little); at cp = 8 the all-to-all (8 KV heads split over 8 ranks, fewer
    bytes); at cp = 16 (the heads do not divide) the ring, which keeps none of the 15/16 of
    every layer's keys and values the all-gather holds and hides its sends behind attention,
    despite recomputing each block's attention forward in its backward."""
    base = base_config("llama3_8b_128k_32gpu.toml", None)
    cluster = make_cluster(find_gpu("h100"), 32, 8)

    def estimates(cp: int, ac: str) -> dict:
        degrees = {"dp_replicate": 1, "dp_shard": 32 // cp, "cp": cp, "tp": 1, "pp": 1, "ep": 1}
        found = {}
        for mode in ("all_gather", "all_to_all", "ring"):
            layout = layout_config(base, degrees, ("1f1b", 1), mode)
            if not collect_problems(layout, 32):
                found[mode] = evaluate(with_batch(layout, (1, 1, 0), ac), degrees, cluster)
        return found

    def fastest(found: dict) -> str:
        return max(found, key=lambda mode: found[mode].step.tokens_per_sec)

    assert fastest(estimates(2, "full")) == "all_gather"
    assert fastest(estimates(8, "selective")) == "all_to_all"
    sixteen = estimates(16, "none")
    assert set(sixteen) == {"all_gather", "ring"} and fastest(sixteen) == "ring"
    assert sixteen["ring"].memory.total < sixteen["all_gather"].memory.total
    ring = sixteen["ring"]
    reason = why(PlanResult(cluster, [ring], considered=1, layouts=1))
    assert f"the ring's {ring.step.comm['cp']:.2f} s its attention, all but what a send" in reason


def test_plan_json_and_the_recipe_it_writes_pass_kiln_check(capsys, tmp_path):
    recipe = tmp_path / "plan.toml"
    args = ["plan", "--model", "llama3_7b", "--gpus", "8", "--gpu", "h200"]
    assert main([*args, "--gpus-per-node", "4", "--json", "--write", str(recipe)]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = plan["top"][0]
    assert plan["gpus"] == 8 and plan["fitting"] > 0 and "fastest" in plan["why"]
    for key in ("layout", "memory_gb", "tokens_per_sec", "mfu", "comm_seconds"):
        assert key in best
    assert best["memory_gb"] < 141 and 0 < best["mfu"] < 1
    cfg = load_config(recipe, world_size=8)
    assert {k: getattr(cfg.distributed, k) for k in best["layout"]} == best["layout"]
    assert cfg.train.activation_checkpointing == best["activation_checkpointing"]
    check = ["check", str(recipe), "--world-size", "8", "--config-only"]
    assert main([*check, "--gpu", "h200", "--gpus-per-node", "4", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["memory_gb"] == best["memory_gb"]
    assert estimate["tokens_per_sec"] == best["tokens_per_sec"] and estimate["mfu"] == best["mfu"]
    assert main([*check, "--gpu", "h200", "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "# planner memory per GPU" in out and "tok/s, MFU" in out and "# config OK" in out


def test_plan_table_names_the_winner_and_its_reason(capsys):
    args = ["plan", "--model", "llama3_1b", "--gpus", "4", "--gpu", "h100", "--seq-len", "2048"]
    ft = ["--fault-tolerance", "--checkpoint-interval", "100"]
    assert main([*args, "--gpus-per-node", "4", "--top", "3", *ft]) == 0
    out = capsys.readouterr().out
    assert "llama3_1b on 4 × H100 SXM" in out and "why #1:" in out
    # Its winner has no dp_replicate: one line says so, and no replica-group numbers.
    assert "fault tolerance: no replica groups: the layout dp_shard=4 has dp_replicate = 1" in out
    assert "break-even" not in out
    assert len([line for line in out.splitlines() if re.match(r"^ ?\d+  ", line)]) == 3


def test_plan_table_columns_stay_aligned_with_long_batch_cells(capsys):
    """A pipeline's batch cell ("32 × 1 seq, interleaved_1f1b") is wider than the others: its
    column widens, and every row keeps its columns under their headers."""
    args = ["plan", "--model", "llama3_70b", "--gpus", "32", "--gpu", "h200"]
    assert main([*args, "--gpus-per-node", "4", "--global-batch-tokens", "1048576"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  layout"))
    rows = lines[header : lines.index("", header)]
    assert len(rows) > 1 and any("interleaved_1f1b" in row for row in rows)
    # The last column is right-aligned: equal lengths mean every column lines up.
    assert len({len(row) for row in rows}) == 1, "\n".join(rows)
    start = rows[0].index("global tok")
    assert all(row[start - 2 : start] == "  " for row in rows)


def test_a_model_that_fits_nowhere_names_the_smallest_gpu_count(capsys):
    args = ["plan", "--model", "llama3_70b", "--gpus", "4", "--gpu", "h100", "--gpus-per-node", "4"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "llama3_70b fits no layout on 4 × H100 SXM" in err
    assert "the smallest count of H100 SXM that fits is 16 GPUs" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpu", "v100"], "unknown GPU 'v100': the planner knows h100, h200, a100, b200"),
        (["--gpu", "h100", "--gpus", "6"], "--gpus 6 is not a multiple of --gpus-per-node 4"),
        (["--gpu", "h100", "--global-batch-tokens", "1000"], "not a whole number of sequences"),
        (
            ["--gpu", "h100", "--seq-len", "262144"],
            "--seq-len 262144 is past the model's max_seq_len (4096): plan from a recipe",
        ),
        (["--gpu", "h100", "--restart-s", "60"], "--restart-s is an input of --fault-tolerance"),
        (
            ["--gpu", "h100", "--fault-tolerance"],
            "checkpoint.interval is 0 (no checkpoints); give --checkpoint-interval STEPS",
        ),
        (
            [
                "--gpu",
                "h100",
                "--fault-tolerance",
                "--checkpoint-interval",
                "9",
                "--restart-s",
                "0",
            ],
            "--restart-s 0 is out of range: it takes seconds > 0",
        ),
    ],
)
def test_bad_input_gets_one_message(capsys, extra, message):
    args = ["plan", "--model", "llama3_1b", "--seq-len", "2048", "--gpus-per-node", "4"]
    if "--gpus" not in extra:
        args += ["--gpus", "8"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def doc_model(step, after: float, one_sum: float, i: dict, gpus: int, n: int) -> dict:
    """docs/fault_tolerance.md's model ("When replica groups pay"), written out from the page:
    o = the sum's part after the backward + the quorum (every step), (one sum + quorum) / H
    (DiLoCo); GPU-hours lost a day; the break-even N* with groups of n added."""
    t, lam, q, h = step.seconds, i["failures_per_gpu_hour"], i["quorum_ms"] / 1000, i["sync_every"]
    r, r_g, s = i["restart_s"], i["group_restart_s"], i["stall_s"]
    interval = i["checkpoint_interval_steps"] * t
    out = {"checkpoint_restarts": 24 * gpus * lam * gpus * (r + interval / 2) / 3600}
    for mode, o, group_loss in (
        ("every_step", after + q, r_g),
        ("diloco", (one_sum + q) / h, r_g + h * t / 2),
    ):
        f = o / (t + o)
        out[mode] = f
        out[f"{mode} lost"] = 24 * (
            gpus * lam * (n * group_loss + (gpus - n) * s) / 3600 + gpus * f
        )
        even = (3600 * f / lam + n * (group_loss - s)) / (r + interval / 2 - s)
        out[f"{mode} break-even"] = math.ceil(even)
    return out


def test_fault_tolerance_is_the_doc_s_model_on_the_plan_s_own_figures(capsys):
    """`kiln plan --fault-tolerance` on the worked example of docs/fault_tolerance.md: its numbers
    are the page's formulas on the plan's own step and all-reduce, the page quotes them, and
    the options reach the model."""
    args = ["plan", "--model", "configs/train/7b.toml", "--gpu", "h100", "--fault-tolerance"]
    assert main([*args, "--gpus", "128", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    ft, best = plan["fault_tolerance"], plan["top"][0]
    assert ft["layout"] == "dp_replicate=16 × dp_shard=8" and ft["gpus_per_group"] == 8
    # The winner again, unrounded: the JSON is the function's on it.
    cluster = make_cluster(find_gpu("h100"), 128, 8)
    batch = (best["batch_size"], best["grad_accum_steps"], 0)
    layout = layout_config(base_config("configs/train/7b.toml", None), best["layout"], ("1f1b", 1))
    candidate = evaluate(
        with_batch(layout, batch, best["activation_checkpointing"]), best["layout"], cluster
    )
    assert round(candidate.step.seconds, 4) == best["step_seconds"] == ft["step_seconds"]
    defaults = FailureInputs(2.0e-5, 600.0, 500, 600.0, 10.0, 5.0, 100)
    assert as_dict(fault_tolerance(candidate, cluster, defaults)) == ft
    # Under FSDP the sum runs in the backward; what stays after it is the root unit's share
    # (untied embeddings and head, 2 × vocab × dim of the parameters; dp_shard splits both alike).
    m, step = candidate.cfg.model, candidate.step
    whole = step.comm["hsdp_all_reduce"]
    assert ft["sum_in_backward"] and sum(step.comm.values()) < step.compute  # all of it hidden
    after = whole * 2 * m.vocab_size * m.dim / count_params(m).total
    for inputs in (defaults, FailureInputs(3e-5, 1800.0, 250, 900.0, 20.0, 2.0, 50)):
        got = fault_tolerance(candidate, cluster, inputs)
        i = as_dict(got)["inputs"]
        want = doc_model(step, after, whole, i, 128, 8)
        # The same arithmetic in another order: a float's last digits.
        assert got.after_backward == pytest.approx(after, rel=1e-12)
        assert got.restarts_lost_per_day == pytest.approx(want["checkpoint_restarts"], rel=1e-12)
        for mode, cost in got.modes.items():
            assert cost.fraction == pytest.approx(want[mode], rel=1e-12)
            assert cost.lost_per_day == pytest.approx(want[f"{mode} lost"], rel=1e-12)
            assert cost.break_even_gpus == want[f"{mode} break-even"]
    # The page quotes the command's numbers.
    page = (REPO / "docs" / "fault_tolerance.md").read_text()
    quoted = [
        f'"every_step": {ft["every_step"]}',
        f'"diloco": {ft["diloco"]}',
        f'"after_backward_seconds": {ft["after_backward_seconds"]}',
        f"{ft['break_even_gpus']['every_step']:,}",
        f"{ft['break_even_gpus']['diloco']:,}",
    ]
    assert all(q in page for q in quoted), [q for q in quoted if q not in page]
    # The table says the same; options reach it.
    assert main([*args, "--gpus", "16", "--sync-every", "50", "--stall-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "2 replica groups of 8 GPUs" in out and "survivors' stall 0 s" in out
    assert "DiLoCo, H = 50" in out and "break-even GPUs" in out
    assert "runs in the backward (FSDP's all-reduce hook)" in out
