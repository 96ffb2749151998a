"""`kiln plan`: the layouts it enumerates are the validator's, ranked by predicted tok/s; its
JSON, its recipe (which `kiln check` accepts and estimates the same), and its messages."""

import json
import re

import pytest

from kiln.cli import main
from kiln.config import config_from_dict, load_config, validate
from kiln.plan.hardware import find_gpu, make_cluster
from kiln.plan.search import factorizations, search


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
    assert result.ranked and result.layouts <= len(factorizations(8)) * 2
    speeds = [c.step.tokens_per_sec for c in result.ranked]
    assert speeds == sorted(speeds, key=lambda s: -float(f"{s:.3g}"))
    for candidate in result.ranked[:20]:
        validate(candidate.cfg, 8)
        assert candidate.fits and candidate.memory.reserved < 80e9


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
    assert main([*args, "--gpus-per-node", "4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "llama3_1b on 4 × H100 SXM" in out and "why #1:" in out
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
    ],
)
def test_bad_input_gets_one_message(capsys, extra, message):
    args = ["plan", "--model", "llama3_1b", "--seq-len", "2048", "--gpus-per-node", "4"]
    if "--gpus" not in extra:
        args += ["--gpus", "8"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
