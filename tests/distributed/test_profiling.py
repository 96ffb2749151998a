"""Profiler traces of a multi-rank job: every rank asked for writes its own, with the phases of
its layout named (the exchanges of expert parallel, the pipeline schedule's pass)."""

import json

import pytest

PROFILE = (
    "--profiling.enabled=true",
    "--profiling.start_step=2",
    "--profiling.end_step=2",
    "--profiling.ranks=[]",
)
LAYOUTS = {
    "ep=2": (("--model.preset=debug_moe", "--distributed.ep=2"), "all-to-all"),
    "pp=2": (("--distributed.pp=2",), "pipeline forward-backward"),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_every_rank_traces_its_layouts_phases(layout, train, tmp_path):
    overrides, phase = LAYOUTS[layout]
    run = tmp_path / "run"
    train(run, 2, *overrides, *PROFILE, "--scheduler.warmup_steps=1", steps=3)
    for rank in (0, 1):
        trace = run / "profile" / f"rank_{rank}" / "steps_2-2.pt.trace.json"
        names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
        assert {phase, "data", "optimizer"} <= names, (rank, sorted(n for n in names if n)[:50])
