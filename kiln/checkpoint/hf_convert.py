"""Convert between Hugging Face checkpoints (safetensors) and kiln checkpoints, through the
adapters of the model families (kiln/model/registry.py: Llama, Qwen3, Mixtral, Qwen3-MoE,
DeepSeek-V3).

Deliberately free of `transformers` (an optional extra): configs are read and written as JSON and
weights through safetensors, one tensor at a time, so converting a large model never holds two
copies of it in memory (an export holds the model plus one shard's converted tensors).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.checkpoint.checkpointer import (
    load_checkpoint,
    read_config,
    read_model_config,
    save_checkpoint,
)
from kiln.checkpoint.hf_tensors import check_keys, export_tensors, load_tensors
from kiln.checkpoint.layout import find_tokenizer, resolve_checkpoint
from kiln.config import JobConfig, ModelConfig
from kiln.errors import KilnError
from kiln.log import info
from kiln.model import count_params
from kiln.model.build import build_model, materialize
from kiln.model.family import NameMap
from kiln.model.registry import family_of, hf_adapter_for, model_config_from_hf
from kiln.tokens import BOS_CANDIDATES, EOS_CANDIDATES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The initialization of parameters a Hugging Face checkpoint lacks (see _init_unmapped).
UNMAPPED_INIT_SEED = 0
# transformers' save_pretrained default.
DEFAULT_MAX_SHARD_SIZE = "5GB"
_INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_SIZE_UNITS = {
    "B": 1,
    **{f"{p}B": 1000 ** (i + 1) for i, p in enumerate("KMGT")},
    **{f"{p}IB": 1024 ** (i + 1) for i, p in enumerate("KMGT")},
}


def hf_to_kiln(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a Hugging Face folder (config.json + safetensors) of an architecture a family
    converts into a kiln checkpoint at step 0 under `out_dir`; return the step folder. MoE
    routers start with zero expert_bias: the Hugging Face ones have none."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    _require_empty(out_dir)
    hf = _read_json(hf_dir / "config.json")
    cfg = model_config_from_hf(hf)
    tensor_files = _tensor_files(hf_dir)
    _, adapter = hf_adapter_for(hf)
    tensor_files = _leave_out(tensor_files, adapter.left_out, hf_dir)
    names = adapter.import_names(cfg, set(tensor_files))
    check_keys(hf_dir, names, tensor_files, cfg.tie_embeddings)
    info(
        f"converting {hf_dir} ({adapter.architecture}, {count_params(cfg).total:,} parameters, "
        f"model.family {cfg.family}) into a kiln checkpoint at step 0 in {out_dir}"
    )

    # No random init (seed=None): every parameter is overwritten below, buffers are zeroed.
    model = materialize(build_model(cfg), device="cpu", seed=None)
    _init_unmapped(model, names, hf_dir)
    load_tensors(model, names, tensor_files)

    tokenizer = hf_dir / "tokenizer.json"
    return save_checkpoint(
        out_dir,
        0,
        model=model,
        optimizer=None,
        config=JobConfig(model=cfg),
        train_state={},
        tokenizer_path=tokenizer if tokenizer.is_file() else None,
    )


def _leave_out(
    tensor_files: dict[str, Path], left_out: tuple[tuple[str, str], ...], hf_dir: Path
) -> dict[str, Path]:
    """The checkpoint's tensors but those under the adapter's left-out prefixes (parts of a
    release kiln does not build), saying once per prefix what is left out."""
    for prefix, what in left_out:
        dropped = [name for name in tensor_files if name.startswith(prefix)]
        if dropped:
            info(f"leaving out {len(dropped)} tensors of {hf_dir} under {prefix}* ({what})")
        tensor_files = {n: f for n, f in tensor_files.items() if not n.startswith(prefix)}
    return tensor_files


def _init_unmapped(model: torch.nn.Module, names: NameMap, hf_dir: Path) -> None:
    """Parameters the checkpoint does not hold (DeepSeek-V3's multi-token prediction modules,
    which transformers' save_pretrained leaves out) keep kiln's initialization, said once."""
    unmapped = [name for name, _ in model.named_parameters() if not names.get(name)]
    if unmapped:
        model.init_weights(UNMAPPED_INIT_SEED)
        info(
            f"{len(unmapped)} parameters have no tensor in {hf_dir} and start from kiln's "
            f"initialization (seed {UNMAPPED_INIT_SEED}; first: {unmapped[0]})"
        )


def kiln_to_hf(
    ckpt: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Export a kiln checkpoint as a Hugging Face folder loadable by `from_pretrained` of the
    architecture its family exports it as (Llama family: LlamaForCausalLM, Qwen3ForCausalLM
    with qk_norm, MixtralForCausalLM or Qwen3MoeForCausalLM with experts); return `out_dir`.

    The checkpoint may have been written by any layout (FSDP, TP, PP): DCP stores full tensors
    keyed by parameter name, so one process reads it whole. `dtype` defaults to the checkpoint's
    `checkpoint.export_dtype` (float32 for checkpoints older than that setting). Weights larger
    than `max_shard_size` (bytes, or a string such as "5GB" or "500MB") are split into
    `model-0000i-of-0000N.safetensors` files with a `model.safetensors.index.json`, as
    `save_pretrained` does; at most the model and one shard's converted tensors are in memory.
    """
    out_dir = Path(out_dir)
    if dtype is not None and dtype not in _DTYPES:
        raise KilnError(f"unknown export dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    shard_bytes = parse_size(max_shard_size)
    _require_empty(out_dir)
    step_dir = resolve_checkpoint(ckpt)
    cfg = read_model_config(step_dir)
    adapter = family_of(cfg).export_adapter(cfg)
    if dtype is None:
        dtype = _checkpoint_export_dtype(step_dir)
    step = int(step_dir.name.removeprefix("step_"))
    info(
        f"exporting step {step} of {step_dir.parent} ({count_params(cfg).total:,} parameters, "
        f"model.family {cfg.family}) as {adapter.architecture} in {dtype} to {out_dir}"
    )
    model = _load_kiln_model(cfg, step_dir)
    adapter.check_export_model(model)
    # Views of the model's own tensors: nothing is converted before its shard is written.
    weights = export_tensors(model, adapter.export_names(cfg))
    shards = _plan_shards(weights, _DTYPES[dtype], shard_bytes)

    tokenizer = find_tokenizer(step_dir)
    special = _special_tokens(tokenizer) if tokenizer is not None else {}
    hf_config = adapter.hf_config(cfg, dtype, special)
    # Written beside out_dir and renamed into place, so an interrupted export leaves nothing behind.
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    partial.mkdir(parents=True)
    try:
        for file, shard_names in shards.items():
            # A copy: safetensors refuses tensors that share memory, as the experts of one
            # stacked parameter do.
            converted = {name: weights[name].to(_DTYPES[dtype], copy=True) for name in shard_names}
            save_file(converted, partial / file, metadata={"format": "pt"})
            follow_umask(partial / file)
            del converted
        if len(shards) > 1:
            index = {
                "metadata": {
                    "total_parameters": sum(t.numel() for t in weights.values()),
                    "total_size": sum(_nbytes(t, _DTYPES[dtype]) for t in weights.values()),
                },
                "weight_map": {name: file for file, group in shards.items() for name in group},
            }
            (partial / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _write_json(partial / "config.json", hf_config)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, partial / "tokenizer.json")
            _write_json(partial / "tokenizer_config.json", _tokenizer_config(cfg, special))
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(partial, out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out_dir


def _name_map(cfg: ModelConfig) -> dict[str, str]:
    """kiln name -> Hugging Face name of a dense model, whose tensors map one to one
    (tests/distributed/test_hf_export.py compares exported tensors through it)."""
    names = family_of(cfg).export_adapter(cfg).export_names(cfg)
    return {name: parts[0].name for name, parts in names.items()}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" (10^9), "2GiB" (2^30), "500MB" or "1000"."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE.fullmatch(str(size).strip())
        if match is None:
            raise KilnError(
                f"invalid max shard size {size!r}; write a number of bytes or a size such as "
                "5GB, 500MB or 2GiB"
            )
        number, unit = match.groups()
        scale = _SIZE_UNITS[(unit or "B").upper()]
        value = int(float(number) * scale) if "." in number else int(number) * scale
    if value <= 0:
        raise KilnError(f"max shard size must be positive, got {size!r}")
    return value


def follow_umask(path: Path) -> None:
    """Give `path` the mode a plain open() would: safetensors writes through a private temporary
    file (0600), so the weights would be readable by their owner alone beside 0644 configs."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _plan_shards(
    weights: dict[str, torch.Tensor], dtype: torch.dtype, max_bytes: int
) -> dict[str, list[str]]:
    """File name -> tensor names, filled in order like huggingface_hub's
    `split_torch_state_dict_into_shards`: a tensor that would take a shard past `max_bytes`
    starts the next one, and a tensor bigger than `max_bytes` gets a shard of its own."""
    groups: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, tensor in weights.items():
        size = _nbytes(tensor, dtype)
        if size > max_bytes:
            groups.append([name])
            continue
        if current and current_bytes + size > max_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        groups.append(current)
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": group for i, group in enumerate(groups)}


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    return tensor.numel() * dtype.itemsize


def _checkpoint_export_dtype(step_dir: Path) -> str:
    """`checkpoint.export_dtype` of the run that wrote `step_dir`; float32 for checkpoints
    written before kiln had that setting."""
    config_file = step_dir / "config.toml"
    dtype = read_config(step_dir).get("checkpoint", {}).get("export_dtype", "float32")
    if dtype not in _DTYPES:
        raise KilnError(
            f"{config_file} sets checkpoint.export_dtype = {dtype!r}; pass --dtype with one of "
            f"{', '.join(_DTYPES)}"
        )
    return dtype


def _tensor_files(hf_dir: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file that holds it."""
    single, index = hf_dir / "model.safetensors", hf_dir / _INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        files = {name: hf_dir / file for name, file in weight_map.items()}
        absent = sorted({file.name for file in files.values() if not file.is_file()})
        if absent:
            raise KilnError(
                f"{index} lists shards that are not in {hf_dir}: {', '.join(absent)}; "
                "is the download complete?"
            )
        return files
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise KilnError(
        f"{hf_dir} has no model.safetensors or model.safetensors.index.json; only safetensors "
        "weights are supported (re-save the model with `save_pretrained(..., safe_serialization=True)`)"
    )


def _load_kiln_model(cfg: ModelConfig, step_dir: Path) -> torch.nn.Module:
    # No random init (seed=None): every parameter is overwritten by the checkpoint.
    model = materialize(build_model(cfg), device="cpu", seed=None)
    load_checkpoint(step_dir, model=model)
    return model


def _special_tokens(tokenizer: Path) -> dict[str, tuple[str, int]]:
    """{"bos"/"eos": (token, id)} for the first known bos/eos names the tokenizer defines."""
    data = json.loads(tokenizer.read_text())
    ids = {token["content"]: token["id"] for token in data.get("added_tokens", [])}
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        ids = {**vocab, **ids}
    found = {}
    for role, candidates in (("bos", BOS_CANDIDATES), ("eos", EOS_CANDIDATES)):
        token = next((name for name in candidates if name in ids), None)
        if token is not None:
            found[role] = (token, ids[token])
    return found


def _tokenizer_config(cfg: ModelConfig, special: dict[str, tuple[str, int]]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_seq_len,
    }
    for role, (token, _) in special.items():
        config[f"{role}_token"] = token
    return config


def _require_empty(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise KilnError(
            f"output directory {out_dir} already exists and is not empty; "
            "choose a new directory or remove this one"
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise KilnError(f"{path} not found; pass a Hugging Face model folder (with config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise KilnError(f"{path} is not valid JSON ({e}); is the download complete?") from None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
