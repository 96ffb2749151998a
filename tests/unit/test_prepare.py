"""`kiln prepare`: every input kind, the tokenizer options, re-runs, the validation split, and a
clear message for every bad input. Real tokenizers, real files, real `datasets` folders."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import datasets
import huggingface_hub.constants
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.cli import main
from kiln.data import TokenDataset, load_tokenizer, prepare_dataset, read_index
from kiln.data import tokenize as tokenize_module
from kiln.data.shards import token_dtype
from kiln.data.tokenizer import train_bpe_tokenizer
from kiln.errors import KilnError

TEXTS = [f"def f{i}(x):\n    return x * {i}  # ünïcode {i}\n" for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(TEXTS, vocab_size=400).save(str(path))
    return path


def prepare(inputs: list, tokenizer: Path | None, output: Path, **kwargs) -> Path:
    return prepare_dataset(inputs, tokenizer, output, **{"num_workers": 0, **kwargs})


def documents(path: Path) -> list[str]:
    """The texts of a prepared dataset, decoded document by document."""
    dataset = TokenDataset(path, seq_len=1)
    tokenizer = load_tokenizer(dataset.tokenizer_path)
    tokens = dataset.read(0, dataset.num_tokens)
    starts = dataset.document_starts().astype(np.int64).tolist()
    ends = [*starts[1:], dataset.num_tokens]
    # Each document ends with the end-of-document token, which decodes to nothing useful.
    return [tokenizer.decode(tokens[s : e - 1].tolist()) for s, e in zip(starts, ends, strict=True)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_parquet(path: Path, texts: list[str]) -> Path:
    pq.write_table(pa.table({"content": texts, "id": list(range(len(texts)))}), path)
    return path


def no_leftovers(folder: Path) -> bool:
    """Nothing temporary (hidden staging or old folders) left next to the outputs."""
    return not [p for p in folder.iterdir() if p.name.startswith(".")]


# --- input kinds -------------------------------------------------------------------------


def test_every_file_kind_in_order(tmp_path: Path, tokenizer_file: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(TEXTS[0])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"text": TEXTS[1]}, {"text": ""}, {"text": None}])
    write_parquet(tmp_path / "c.parquet", TEXTS[2:4])
    out = prepare([tmp_path / "in"], tokenizer_file, tmp_path / "out")
    assert documents(out) == TEXTS[:2]
    out = prepare([tmp_path / "c.parquet"], tokenizer_file, tmp_path / "pq", text_key="content")
    assert documents(out) == TEXTS[2:4]


def test_saved_datasets(tmp_path: Path, tokenizer_file: Path) -> None:
    datasets.Dataset.from_dict({"text": TEXTS[:3]}).save_to_disk(tmp_path / "plain")
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"body": TEXTS[3:6]}),
            "test": datasets.Dataset.from_dict({"body": TEXTS[6:7]}),
        }
    )
    splits.save_to_disk(tmp_path / "dict")
    assert documents(prepare([tmp_path / "plain"], tokenizer_file, tmp_path / "a")) == TEXTS[:3]
    out = prepare([tmp_path / "dict"], tokenizer_file, tmp_path / "b", text_key="body")
    assert documents(out) == TEXTS[3:6]
    out = prepare(
        [tmp_path / "dict"], tokenizer_file, tmp_path / "c", text_key="body", split="test"
    )
    assert documents(out) == TEXTS[6:7]
    source = read_index(out)["sources"][0]
    assert source["split"] == "test" and source["fingerprint"]
    with pytest.raises(KilnError, match=r"dict has no split 'valid' \(splits: train, test\)"):
        prepare([tmp_path / "dict"], tokenizer_file, tmp_path / "d", split="valid")
    with pytest.raises(KilnError, match=r"no column 'text' \(columns: body\)"):
        prepare([tmp_path / "dict"], tokenizer_file, tmp_path / "d")


def cache_hub_dataset(cache: Path, name: str, texts: list[str]) -> None:
    """Lay `name` out in a `datasets` cache as a download would (the tests have no network):
    build it from a local parquet file, then move it under the hub name."""
    parquet = write_parquet(cache.parent / "hub.parquet", texts)
    datasets.load_dataset("parquet", data_files=str(parquet), cache_dir=str(cache / "build"))
    built = next((cache / "build" / "parquet").glob("*/0.0.0/*/"))
    namespace, short = name.split("/")
    target = cache / f"{namespace}___{short}" / "default" / "0.0.0" / built.name
    target.mkdir(parents=True)
    info = json.loads((built / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default"}))
    shutil.copy(built / "parquet-train.arrow", target / f"{short}-train.arrow")


def test_hub_dataset_from_the_local_cache(
    tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cache_hub_dataset(cache, "kiln-test/tiny", TEXTS[:4])
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    # HF_HUB_OFFLINE=1 as the user sets it (the library reads it at import): the cache only.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = prepare(["hf:kiln-test/tiny"], tokenizer_file, tmp_path / "out", text_key="content")
    assert documents(out) == TEXTS[:4]
    assert read_index(out)["sources"][0]["dataset"] == "hf:kiln-test/tiny"
    with pytest.raises(
        KilnError,
        match=r"kiln-test/absent is not in the local Hugging Face cache.*HF_HUB_OFFLINE is set",
    ):
        prepare(["hf:kiln-test/absent"], tokenizer_file, tmp_path / "absent")
    with pytest.raises(KilnError, match="cannot load hf:kiln-test/tiny:other from the local"):
        prepare(["hf:kiln-test/tiny:other"], tokenizer_file, tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


def test_globs_expand_sorted(tmp_path: Path, tokenizer_file: Path) -> None:
    write_jsonl(tmp_path / "in" / "z" / "b.jsonl", [{"text": TEXTS[2]}])
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": TEXTS[1]}])
    (tmp_path / "in" / "notes.csv").write_text("not an input")
    (tmp_path / "top.txt").write_text(TEXTS[0])
    pattern = str(tmp_path / "in" / "**" / "*")
    out = prepare([tmp_path / "top.txt", pattern], tokenizer_file, tmp_path / "out")
    assert documents(out) == TEXTS[:3]
    with pytest.raises(KilnError, match=r"input pattern '.*\*\.parquet' matches nothing"):
        prepare([str(tmp_path / "in" / "*.parquet")], tokenizer_file, tmp_path / "x")
    with pytest.raises(KilnError, match=r"matches no \.txt, \.jsonl, \.parquet files"):
        prepare([str(tmp_path / "in" / "*.csv")], tokenizer_file, tmp_path / "x")
    with pytest.raises(KilnError, match=r"a\.jsonl is named twice"):
        prepare([tmp_path / "in", pattern], tokenizer_file, tmp_path / "x")


# --- tokenizer ---------------------------------------------------------------------------


def test_train_tokenizer_on_the_inputs(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    out = prepare([tmp_path / "in.jsonl"], None, tmp_path / "out", train_tokenizer=300)
    # The trainer stops early when the text has no more pairs to merge.
    vocab_size = load_tokenizer(out / "tokenizer.json").get_vocab_size()
    assert 280 < vocab_size <= 300 and read_index(out)["vocab_size"] == vocab_size
    assert documents(out) == TEXTS
    with pytest.raises(KilnError, match=r"either a tokenizer\.json"):
        prepare(
            [tmp_path / "in.jsonl"], out / "tokenizer.json", tmp_path / "x", train_tokenizer=300
        )
    with pytest.raises(KilnError, match=r"either a tokenizer\.json"):
        prepare([tmp_path / "in.jsonl"], None, tmp_path / "x")


def test_a_vocabulary_smaller_than_asked_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    out = prepare([tmp_path / "in.jsonl"], None, tmp_path / "out", train_tokenizer=32000)
    learned = load_tokenizer(out / "tokenizer.json").get_vocab_size()
    err = capsys.readouterr().err
    assert "too small for a 32000-token vocabulary" in err and f"stopped at {learned} tokens" in err


def test_a_folder_says_which_files_it_skipped(
    tmp_path: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXTS[0])
    for name in ("b.md", "c.md", "d.py"):
        (folder / name).write_text(TEXTS[1])
    prepare([folder], tokenizer_file, tmp_path / "out")
    err = capsys.readouterr().err
    assert "skipped 3 files of other types (2 .md, 1 .py)" in err
    assert "kiln prepare reads .txt, .jsonl, .parquet" in err
    (folder / "a.txt").unlink()
    with pytest.raises(KilnError, match=r"no input files .* skipped 3 files"):
        prepare([folder], tokenizer_file, tmp_path / "none")


def test_token_dtype_follows_the_vocabulary(tmp_path: Path) -> None:
    assert token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32
    tokenizer = train_bpe_tokenizer(TEXTS, vocab_size=300)
    tokenizer.add_tokens([f"word{i}" for i in range(2**16)])  # ids up to 65835
    tokenizer.save(str(tmp_path / "big.json"))
    (tmp_path / "in.txt").write_text("word65535 and word0")
    out = prepare([tmp_path / "in.txt"], tmp_path / "big.json", tmp_path / "out")
    assert read_index(out)["dtype"] == "uint32"
    assert TokenDataset(out, seq_len=1).read(0, 1)[0] == tokenizer.token_to_id("word65535") > 2**16
    assert documents(out) == ["word65535 and word0"]


# --- re-runs -----------------------------------------------------------------------------


def file_times(path: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


def test_rerun_is_a_no_op_and_other_data_is_refused(
    tmp_path: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    args = ["prepare", "--input", str(source), "--tokenizer", str(tokenizer_file)]
    args += ["--output", str(tmp_path / "out"), "--val-fraction", "0.3", "--num-workers", "0"]
    assert main(args) == 0
    before = file_times(tmp_path / "out")
    assert main(args) == 0
    assert "already prepared" in capsys.readouterr().err
    assert file_times(tmp_path / "out") == before

    other_tokenizer = tmp_path / "other.json"
    train_bpe_tokenizer(TEXTS, vocab_size=280).save(str(other_tokenizer))
    assert main([*args[:4], str(other_tokenizer), *args[5:]]) == 2
    assert "holds a different dataset (other tokenizer)" in capsys.readouterr().err
    assert main([*args[:-4], "--num-workers", "0"]) == 2
    assert "(other options)" in capsys.readouterr().err
    write_jsonl(source, [{"text": t} for t in TEXTS[:6]])
    assert main(args) == 2
    assert "(other inputs); pass overwrite=True (--overwrite)" in capsys.readouterr().err
    assert file_times(tmp_path / "out") == before
    assert main([*args, "--overwrite"]) == 0
    index = read_index(tmp_path / "out")
    assert index["num_documents"] + index["num_val_documents"] == 6
    assert no_leftovers(tmp_path)


def test_rerun_on_a_damaged_dataset_says_so(tmp_path: Path, tokenizer_file: Path) -> None:
    (tmp_path / "in.txt").write_text(TEXTS[0])
    out = prepare([tmp_path / "in.txt"], tokenizer_file, tmp_path / "out")
    (out / "shard_00000.bin").write_bytes(b"")
    with pytest.raises(KilnError, match=r"shard_00000\.bin is missing or not .* --overwrite"):
        prepare([tmp_path / "in.txt"], tokenizer_file, out)


# --- validation split --------------------------------------------------------------------


def test_val_split_is_deterministic_and_complete(
    tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenize_module, "BATCH_DOCUMENTS", 32)  # several batches in flight
    texts = [f"document {i}: {TEXTS[i % len(TEXTS)]}" for i in range(300)]
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    outs = [
        prepare([source], tokenizer_file, tmp_path / f"w{n}", val_fraction=0.1, num_workers=n)
        for n in (0, 2)
    ]
    train, val = documents(outs[0]), documents(outs[0] / "val")
    assert (documents(outs[1]), documents(outs[1] / "val")) == (train, val)
    assert 10 < len(val) < 60 and sorted(train + val) == sorted(texts)
    assert [t for t in texts if t in set(val)] == val  # the input order is kept
    index = read_index(outs[0])
    assert (index["val"], index["num_val_documents"]) == ("val", len(val))
    assert (outs[0] / "val" / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()

    out = prepare([source], tokenizer_file, tmp_path / "n", val_documents=7)
    assert len(documents(out / "val")) == 7 and len(documents(out)) == 293
    with pytest.raises(KilnError, match="--val-documents 300 leaves nothing to train on"):
        prepare([source], tokenizer_file, tmp_path / "x", val_documents=300)
    with pytest.raises(KilnError, match="validation split is empty"):
        prepare([tmp_path / "in.jsonl"], tokenizer_file, tmp_path / "x", val_fraction=1e-9)
    with pytest.raises(KilnError, match="between 0 and 1"):
        prepare([source], tokenizer_file, tmp_path / "x", val_fraction=1.0)
    assert not (tmp_path / "x").exists() and no_leftovers(tmp_path)


# --- bad input ---------------------------------------------------------------------------


def bad_inputs(root: Path) -> dict[str, tuple[list, dict, str]]:
    """name: (inputs, options, pattern the message must match)."""
    (root / "empty.txt").write_text("")
    (root / "blank.jsonl").write_text("\n\n")
    write_jsonl(root / "fields.jsonl", [{"body": "x", "id": 1}])
    write_jsonl(root / "number.jsonl", [{"text": 5}])
    (root / "broken.jsonl").write_text('{"text": "x"}\n{"text": \n')
    write_parquet(root / "columns.parquet", ["x"])
    (root / "corrupt.parquet").write_bytes(b"PAR1 not really")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(root / "saved")
    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(root / "numbers")
    return {
        "missing path": ([root / "nope.txt"], {}, r"input not found: .*nope\.txt"),
        "empty file": ([root / "empty.txt"], {}, r"input .*empty\.txt holds no documents"),
        "only blank lines": ([root / "blank.jsonl"], {}, r"blank\.jsonl holds no documents"),
        "jsonl field": (
            [root / "fields.jsonl"],
            {},
            r"fields\.jsonl:1: no field 'text' \(fields: body, id\)",
        ),
        "jsonl number": ([root / "number.jsonl"], {}, r"number\.jsonl:1: field 'text' is a int"),
        "invalid json": ([root / "broken.jsonl"], {}, r"broken\.jsonl:2: invalid JSON"),
        "parquet column": (
            [root / "columns.parquet"],
            {},
            r"columns\.parquet has no column 'text' \(columns: content, id\)",
        ),
        "parquet not text": (
            [root / "columns.parquet"],
            {"text_key": "id"},
            r"columns\.parquet: column 'id' holds int64, not text",
        ),
        "corrupt parquet": ([root / "corrupt.parquet"], {}, r"cannot read parquet file .*corrupt"),
        "not utf-8": ([root / "latin1.txt"], {}, r"cannot read input .*latin1\.txt"),
        "dataset column": ([root / "saved"], {}, r"saved has no column 'text' \(columns: body\)"),
        "dataset not text": ([root / "numbers"], {}, r"numbers: column 'text' holds .*not text"),
        "unsupported file": ([root / "x.csv"], {}, r"unsupported input file .*x\.csv"),
        "bad shard size": ([root / "empty.txt"], {"shard_tokens": 0}, "--shard-tokens must be"),
        "bad val count": ([root / "empty.txt"], {"val_documents": 0}, "--val-documents must be"),
    }


def test_bad_inputs_name_the_file(tmp_path: Path, tokenizer_file: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.csv").write_text("a,b\n")
    cases = bad_inputs(tmp_path / "in")
    for name, (inputs, options, message) in cases.items():
        with pytest.raises(KilnError, match=message):
            prepare(inputs, tokenizer_file, tmp_path / "out", **options)
        assert not (tmp_path / "out").exists(), name
    assert no_leftovers(tmp_path)


def test_datasets_library_is_optional(
    tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(KilnError, match="hf:user/corpus needs `datasets`: pip install datasets"):
        prepare(["hf:user/corpus"], tokenizer_file, tmp_path / "out")


def test_cli_rejects_two_tokenizer_options(
    tmp_path: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["prepare", "--input", "x.txt", "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        main([*args, "--tokenizer", str(tokenizer_file), "--train-tokenizer", "300"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(args) == 2
    assert "needs --tokenizer or --train-tokenizer" in capsys.readouterr().err


# --- interrupted runs and damaged datasets -----------------------------------------------


@pytest.mark.parametrize("error", [KilnError, KeyboardInterrupt])
def test_interrupted_run_leaves_nothing_that_looks_complete(
    tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch, error: type
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS * 300])
    old = prepare([tmp_path / "in.jsonl"], tokenizer_file, tmp_path / "out", shard_tokens=500)
    before = file_times(old)
    encode = tokenize_module.encode_texts
    calls = []

    def fail_on_third_batch(*args):
        calls.append(1)
        if len(calls) == 3:
            raise error("stopped midway")
        return encode(*args)

    monkeypatch.setattr(tokenize_module, "encode_texts", fail_on_third_batch)
    monkeypatch.setattr(tokenize_module, "BATCH_DOCUMENTS", 100)
    for output, overwrite in ((tmp_path / "new", False), (old, True)):
        calls.clear()
        with pytest.raises(error):
            prepare([source], tokenizer_file, output, shard_tokens=500, overwrite=overwrite)
    assert not (tmp_path / "new").exists()
    assert file_times(old) == before  # a failed --overwrite keeps the old dataset
    assert no_leftovers(tmp_path)


def test_damaged_dataset_is_named_at_open(tmp_path: Path, tokenizer_file: Path) -> None:
    (tmp_path / "in.txt").write_text(TEXTS[0] * 3)
    pristine = prepare([tmp_path / "in.txt"], tokenizer_file, tmp_path / "pristine")
    damages = {
        "docs file missing": (
            lambda d: (d / "shard_00000.docs.npy").unlink(),
            r"shard_00000\.docs\.npy is missing, truncated",
        ),
        "docs file truncated": (
            lambda d: (d / "shard_00000.docs.npy").write_bytes(b"\x93NUMPY"),
            r"shard_00000\.docs\.npy is missing, truncated",
        ),
        "token out of range": (
            lambda d: (d / "shard_00000.bin").write_bytes(
                b"\xff\xff" + (d / "shard_00000.bin").read_bytes()[2:]
            ),
            r"shard_00000\.bin holds token id 65535, outside the vocabulary",
        ),
        "index truncated": (
            lambda d: (d / "index.json").write_text((d / "index.json").read_text()[:40]),
            r"index\.json is unreadable or corrupt",
        ),
    }
    for name, (damage, message) in damages.items():
        copy = shutil.copytree(pristine, tmp_path / name)
        damage(copy)
        with pytest.raises(KilnError, match=message):
            TokenDataset(copy, seq_len=4)
