"""`kiln prepare --part I --parts N`: N parts (in this process, and as real processes through
the CLI) write the dataset one process writes, token for token, with the same document offsets
and validation split; a killed part is redone by its re-run; what a part cannot do is refused."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.cli import main
from kiln.cli.prepare import part_and_parts
from kiln.data import TokenDataset, prepare_dataset, read_index
from kiln.data import units as units_module
from kiln.data.prepare_parts import PARTS_DIR, assemble_dataset, part_name
from kiln.data.tokenizer import train_bpe_tokenizer
from kiln.errors import KilnError

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [f"doc {i}: def f{i}(x):\n    return x * {i}  # ünï {i % 7}\n" for i in range(240)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(TEXTS[:20], vocab_size=300).save(str(path))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every input kind, the .jsonl and .parquet large enough to be cut into several units."""
    root = tmp_path_factory.mktemp("corpus")
    with (root / "a.jsonl").open("w") as f:
        for i, text in enumerate(TEXTS[:120]):
            f.write(json.dumps({"text": text}) + "\n" if i % 9 else "\n")  # blank lines too
    table = pa.table({"text": [t if i % 11 else None for i, t in enumerate(TEXTS[120:200])]})
    pq.write_table(table, root / "b.parquet", row_group_size=16)
    (root / "c.txt").write_text(TEXTS[200])
    datasets.Dataset.from_dict({"text": TEXTS[201:240]}).save_to_disk(root / "d")
    return root


def inputs(corpus: Path) -> list[str]:
    return [str(corpus / name) for name in ("a.jsonl", "b.parquet", "c.txt", "d")]


def stream(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """All tokens of a prepared dataset in order, and every document's start in them."""
    dataset = TokenDataset(path, seq_len=1)
    return dataset.read(0, dataset.num_tokens), dataset.document_starts()


def assert_same_dataset(one: Path, other: Path) -> None:
    index, other_index = read_index(one), read_index(other)
    for key in ("sources", "prepare", "num_tokens", "num_documents", "num_val_documents"):
        assert index.get(key) == other_index.get(key), key
    for split in ("", "val") if "val" in index else ("",):
        tokens, starts = stream(one / split)
        other_tokens, other_starts = stream(other / split)
        assert np.array_equal(tokens, other_tokens) and np.array_equal(starts, other_starts)


def run_parts(corpus: Path, tokenizer: Path, output: Path, parts: int, **options) -> None:
    for part in range(parts):
        prepare_dataset(
            inputs(corpus), tokenizer, output, num_workers=0, part=part, parts=parts, **options
        )


def test_parts_write_the_one_process_dataset(
    tmp_path: Path, corpus: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(units_module, "UNIT_BYTES", 700)  # .jsonl lines cut across units
    options = {"val_fraction": 0.2, "shard_tokens": 500}
    one = prepare_dataset(
        inputs(corpus), tokenizer_file, tmp_path / "one", num_workers=0, **options
    )
    for parts in (3, 7):
        run_parts(corpus, tokenizer_file, tmp_path / f"p{parts}", parts, **options)
        assert_same_dataset(one, tmp_path / f"p{parts}")
        assert not (tmp_path / f"p{parts}" / PARTS_DIR).exists()
    assert 20 < read_index(one)["num_val_documents"] < 80
    # More parts than units: some parts are empty, and still the same dataset.
    monkeypatch.setattr(units_module, "UNIT_BYTES", 2**30)
    run_parts(corpus, tokenizer_file, tmp_path / "p9", 9, **options)
    assert_same_dataset(one, tmp_path / "p9")


def file_times(path: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


def test_a_killed_part_is_redone_and_nothing_twice(
    tmp_path: Path, corpus: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = prepare_dataset(inputs(corpus), tokenizer_file, tmp_path / "one", num_workers=0)
    out = tmp_path / "parts"
    run = [inputs(corpus), tokenizer_file, out]
    for part in (0, 2, 0):  # part 0 twice: its second run does nothing
        prepare_dataset(*run, num_workers=0, part=part, parts=3)
    assert "part 0 of 3 is already written" in capsys.readouterr().err
    # What a kill -9 of part 1 leaves: its staging folder, half written, never renamed.
    stale = out / PARTS_DIR / f".{part_name(1, 3)}.tmp-4242-deadbeef"
    stale.mkdir()
    (stale / "shard_00000.bin").write_bytes(b"\x01\x00" * 10)
    with pytest.raises(KilnError, match=r"1 of 3 parts are not written yet \(1\)"):
        assemble_dataset(out)
    prepare_dataset(*run, num_workers=0, part=1, parts=3)
    assert_same_dataset(one, out)
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    before = file_times(out)
    prepare_dataset(*run, num_workers=0, part=1, parts=3)  # a finished dataset: a no-op
    prepare_dataset(*run, num_workers=0)  # one process: the same dataset, so a no-op too
    assert file_times(out) == before


def test_parts_as_processes_through_the_cli(
    tmp_path: Path, corpus: Path, tokenizer_file: Path
) -> None:
    """Three real processes at once: two told by flags, one by torchrun's variables; the last
    to finish assembles. Files only: importing `datasets` would take seconds in each."""
    files = inputs(corpus)[:3]
    one = prepare_dataset(files, tokenizer_file, tmp_path / "one", num_workers=0)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "kiln", "prepare", "--input", *files]
    command += ["--tokenizer", str(tokenizer_file), "--output", str(out), "--num-workers", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        env.pop(key, None)
    processes = [
        subprocess.Popen([*command, "--part", "0", "--parts", "3"], env=env),
        subprocess.Popen(command, env={**env, "RANK": "1", "WORLD_SIZE": "3"}),
        subprocess.Popen([*command, "--part", "2", "--parts", "3"], env=env),
    ]
    assert [process.wait(timeout=60) for process in processes] == [0, 0, 0]
    assert_same_dataset(one, out)


def test_two_finishers_assemble_once(
    tmp_path: Path, corpus: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    prepare_dataset(inputs(corpus), tokenizer_file, out, num_workers=0, part=0, parts=2)
    (out / PARTS_DIR / "assembling").mkdir()  # another finisher got there first, then died
    prepare_dataset(inputs(corpus), tokenizer_file, out, num_workers=0, part=1, parts=2)
    assert "another part is assembling" in capsys.readouterr().err
    assert not (out / "index.json").exists()
    assert main(["prepare", "--output", str(out), "--assemble"]) == 0
    one = prepare_dataset(inputs(corpus), tokenizer_file, tmp_path / "one", num_workers=0)
    assert_same_dataset(one, out)


def test_what_a_part_cannot_do_is_refused(
    tmp_path: Path, corpus: Path, tokenizer_file: Path
) -> None:
    out = tmp_path / "out"
    refused = {
        "train the tokenizer first \\(one process": {"train_tokenizer": 300},
        "cannot be exact with --parts > 1. Use --val-fraction": {"val_documents": 5},
        "--overwrite works with one process only": {"overwrite": True},
    }
    for message, options in refused.items():
        tokenizer = None if "train_tokenizer" in options else tokenizer_file
        with pytest.raises(KilnError, match=message):
            prepare_dataset(inputs(corpus), tokenizer, out, part=0, parts=2, **options)
    with pytest.raises(KilnError, match=r"--part must be in 0 \.\. --parts - 1"):
        prepare_dataset(inputs(corpus), tokenizer_file, out, part=2, parts=2)
    assert not out.exists()
    prepare_dataset(inputs(corpus)[2:], tokenizer_file, out, num_workers=0, part=0, parts=2)
    # Each refusal names what differs, with its value here and in the run.
    started = "in the parts already started"
    same = inputs(corpus)[2:]
    refused = [
        (f"--val-fraction 0.5 here, not given {started}", same, {"val_fraction": 0.5}),
        (f"--parts 3 here, 2 {started}", same, {"parts": 3}),
        (f"--text-key 'body' here, 'text' {started}", same, {"text_key": "body"}),
        (f"other inputs (only here: {(corpus / 'b.parquet').resolve()})", inputs(corpus)[1:], {}),
    ]
    for message, given, options in refused:
        with pytest.raises(KilnError) as raised:
            prepare_dataset(given, tokenizer_file, out, **{"part": 1, "parts": 2, **options})
        expected = f"{out / '.parts'} holds the parts of another run: {message}. Run every"
        assert expected in str(raised.value)


def test_part_and_parts_come_from_flags_torchrun_or_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        monkeypatch.delenv(key, raising=False)
    assert part_and_parts(None, None) == (0, 1, "one process")
    slurm = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_COUNT": "4"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert part_and_parts(None, None)[:2] == (2, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert part_and_parts(None, None)[:2] == (1, 8)  # torchrun's variables before SLURM's
    assert part_and_parts(3, 5)[:2] == (3, 5)  # the flags before both
    with pytest.raises(KilnError, match="--parts 5 needs --part I"):
        part_and_parts(None, 5)


def test_a_part_killed_mid_write_is_redone_by_its_rerun(tmp_path: Path) -> None:
    """A real `kill -9` of a part while it writes: its re-run redoes it, nothing twice."""
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=6)) for _ in range(900)]
    texts = [" ".join(rng.choices(words, k=300)) for _ in range(800)]  # 1.7 MB: about a second
    corpus = tmp_path / "big.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe_tokenizer(texts[:50], vocab_size=300).save(str(tokenizer))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "kiln", "prepare", "--input", str(corpus)]
    command += ["--tokenizer", str(tokenizer), "--output", str(out), "--num-workers", "0"]
    command += ["--shard-tokens", "2000", "--parts", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # One 64 MB unit holds the whole file: it is part 1's (parts are balanced by bytes).
    doomed = subprocess.Popen([*command, "--part", "1"], env=env)
    staging = out / PARTS_DIR
    deadline = time.monotonic() + 60
    while not any(staging.glob(f".{part_name(1, 2)}.tmp-*/shard_*.bin")):
        assert doomed.poll() is None and time.monotonic() < deadline, "part 1 ended first"
        time.sleep(0.005)
    doomed.send_signal(signal.SIGKILL)
    assert doomed.wait(timeout=30) == -signal.SIGKILL  # killed while writing, not finished
    assert not (staging / part_name(1, 2)).exists()
    for part in ("0", "1"):
        assert subprocess.run([*command, "--part", part], env=env, timeout=120).returncode == 0
    one = prepare_dataset([corpus], tokenizer, tmp_path / "one", num_workers=0, shard_tokens=2000)
    assert_same_dataset(one, out)
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
