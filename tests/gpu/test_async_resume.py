"""An async checkpoint (staged into pinned host memory on CUDA, written by a background thread
while training goes on, kiln/checkpoint/saver.py) resumes bit for bit: `kiln train` saves in the
background at one step and runs on to the end; a copy of its checkpoint folder alone, resumed by
the same command, must log the same records for every later step, exactly."""

from __future__ import annotations

from kiln.events import read_events
from tests.gpu.runs import TrainRuns

# Exact: both runs execute the same operations in the same order on the same state (the
# weights, AdamW's moments and step, the data position and the RNG, all restored), and both
# run with torch's deterministic kernels (tests/gpu/runs.py), so every record is the same bits.
COMPARED = ("loss", "grad_norm", "lr", "tokens_seen")


def test_async_checkpoint_resumes_bit_for_bit(train_runs: TrainRuns) -> None:
    whole, resumed = train_runs.get("bf16_eager"), train_runs.resumed("bf16_eager")
    saved_at, steps = train_runs.save_step, train_runs.size.steps
    saves = [e for e in read_events(whole.run_dir) if e["event"] == "checkpoint"]
    assert [(e["step"], e["mode"]) for e in saves] == [(saved_at, "async")], saves
    # Committed at a later step's boundary: training went on while it was written.
    assert saves[0]["committed_after_step"] >= saved_at
    resumes = [e for e in read_events(resumed.run_dir) if e["event"] == "resume"]
    assert [e["step"] for e in resumes] == [saved_at], resumes
    assert sorted(resumed.records) == list(range(saved_at + 1, steps + 1))
    for step, record in resumed.records.items():
        for key in COMPARED:
            assert record[key] == whole.records[step][key], (step, key)
