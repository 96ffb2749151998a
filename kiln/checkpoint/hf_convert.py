"""Convert between Hugging Face Llama checkpoints (safetensors) and kiln checkpoints.

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

from kiln.checkpoint.checkpointer import load_checkpoint, read_model_config, save_checkpoint
from kiln.checkpoint.layout import find_tokenizer, resolve_checkpoint
from kiln.config import JobConfig, ModelConfig, read_toml
from kiln.errors import KilnError
from kiln.model.transformer import Transformer, build_model, materialize
from kiln.tokens import BOS_CANDIDATES, EOS_CANDIDATES

# Per-layer tensors: kiln name -> Hugging Face Llama name. Rotary embeddings use the same
# half-split layout on both sides, so q/k weights need no permutation.
_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# transformers' save_pretrained default.
DEFAULT_MAX_SHARD_SIZE = "5GB"
_INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_SIZE_UNITS = {
    "B": 1,
    **{f"{p}B": 1000 ** (i + 1) for i, p in enumerate("KMGT")},
    **{f"{p}IB": 1024 ** (i + 1) for i, p in enumerate("KMGT")},
}

_REQUIRED_HF_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
)

# HF Llama's default when a config names no rope_theta.
_HF_DEFAULT_ROPE_THETA = 10000.0

# Llama 3.1's RoPE scaling (rope_type "llama3"): kiln ModelConfig field -> Hugging Face key.
_LLAMA3_ROPE_KEYS = {
    "rope_scaling_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_seq_len": "original_max_position_embeddings",
}


def hf_to_kiln(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert a Hugging Face Llama folder (config.json + safetensors) into a kiln checkpoint
    at step 0 under `out_dir`; return the step folder."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    _require_empty(out_dir)
    cfg = model_config_from_hf(_read_json(hf_dir / "config.json"))
    tensor_files = _tensor_files(hf_dir)
    names = _name_map(cfg)
    _check_keys(hf_dir, names, tensor_files, cfg.tie_embeddings)

    # No random init (seed=None): every parameter is overwritten below.
    model = materialize(build_model(cfg), device="cpu", seed=None)
    _load_tensors(model, names, tensor_files)

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


def kiln_to_hf(
    ckpt: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Export a kiln checkpoint as a Hugging Face Llama folder loadable by
    `LlamaForCausalLM.from_pretrained`; return `out_dir`.

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
    if cfg.qk_norm:
        raise KilnError(
            f"{step_dir} was trained with model.qk_norm = true, which Hugging Face Llama does not "
            "support; only models trained with qk_norm = false can be exported"
        )
    if dtype is None:
        dtype = _checkpoint_export_dtype(step_dir)
    model = _load_kiln_model(cfg, step_dir)
    names = _name_map(cfg)
    # References to the model's own tensors: nothing is converted before its shard is written.
    weights = {names[name]: tensor for name, tensor in model.state_dict().items()}
    shards = _plan_shards(weights, _DTYPES[dtype], shard_bytes)

    tokenizer = find_tokenizer(step_dir)
    special = _special_tokens(tokenizer) if tokenizer is not None else {}
    # Written beside out_dir and renamed into place, so an interrupted export leaves nothing behind.
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    partial.mkdir(parents=True)
    try:
        for file, shard_names in shards.items():
            converted = {
                name: weights[name].to(_DTYPES[dtype]).contiguous() for name in shard_names
            }
            save_file(converted, partial / file, metadata={"format": "pt"})
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
        _write_json(partial / "config.json", hf_config_from_model(cfg, dtype, special))
        if tokenizer is not None:
            shutil.copyfile(tokenizer, partial / "tokenizer.json")
            _write_json(partial / "tokenizer_config.json", _tokenizer_config(cfg, special))
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(partial, out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out_dir


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
    dtype = read_toml(config_file).get("checkpoint", {}).get("export_dtype", "float32")
    if dtype not in _DTYPES:
        raise KilnError(
            f"{config_file} sets checkpoint.export_dtype = {dtype!r}; pass --dtype with one of "
            f"{', '.join(_DTYPES)}"
        )
    return dtype


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face Llama config.json onto kiln's ModelConfig, refusing anything kiln's
    model would compute differently."""
    _check_supported(hf)
    rope = _rope_params(hf)
    scaling = {}
    if _rope_type(rope) == "llama3":
        scaling = {field: float(rope[key]) for field, key in _LLAMA3_ROPE_KEYS.items()}
        scaling["rope_original_max_seq_len"] = int(rope["original_max_position_embeddings"])
        scaling["rope_scaling"] = "llama3"
    return ModelConfig(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        vocab_size=hf["vocab_size"],
        ffn_hidden_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", _HF_DEFAULT_ROPE_THETA)),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        **scaling,
    )


def hf_config_from_model(
    cfg: ModelConfig, dtype: str, special: dict[str, tuple[str, int]]
) -> dict[str, Any]:
    """A complete LlamaForCausalLM config.json for kiln's ModelConfig."""
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = {key: getattr(cfg, field) for field, key in _LLAMA3_ROPE_KEYS.items()}
        scaling["rope_type"] = "llama3"
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {
            "rope_type": "default",
            **(scaling or {}),
            "rope_theta": cfg.rope_theta,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": special["bos"][1] if "bos" in special else None,
        "eos_token_id": special["eos"][1] if "eos" in special else None,
    }


def _check_supported(hf: dict[str, Any]) -> None:
    """Converting an architecture variant kiln does not implement would give a model that loads
    but computes something else, so every such variant is refused."""
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type") != "llama" or "LlamaForCausalLM" not in architectures:
        raise KilnError(
            f"unsupported model: model_type {hf.get('model_type')!r}, architectures {architectures}; "
            "only Llama checkpoints (model_type 'llama', LlamaForCausalLM) can be converted"
        )
    missing = [key for key in _REQUIRED_HF_KEYS if key not in hf]
    if missing:
        raise KilnError(f"config.json lacks {', '.join(missing)}; is it a complete Llama config?")
    problems = []
    rope = _rope_params(hf)
    rope_type = _rope_type(rope)
    if rope_type not in ("default", "llama3"):
        problems.append(
            f"RoPE scaling {rope_type!r} (kiln implements plain RoPE and Llama 3.1's 'llama3')"
        )
    absent = [key for key in _LLAMA3_ROPE_KEYS.values() if rope.get(key) is None]
    if rope_type == "llama3" and absent:
        problems.append(f"'llama3' RoPE scaling without {', '.join(absent)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial rotary embeddings (partial_rotary_factor != 1)")
    if hf.get("attention_bias"):
        problems.append("attention_bias = true (kiln's attention has no biases)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias = true (kiln's feed-forward has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (kiln uses silu)")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, head_dim):
        problems.append(
            f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads = {head_dim}"
        )
    if problems:
        raise KilnError(
            "cannot convert this Llama variant: "
            + "; ".join(problems)
            + ". kiln would load it but compute different outputs"
        )


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5.x keeps rope_theta inside `rope_parameters`; 4.x keeps it at the top level
    next to an optional `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if "rope_theta" in hf:
        params = {"rope_theta": hf["rope_theta"], **params}
    return params


def _rope_type(rope: dict[str, Any]) -> str:
    # transformers 4.x configs of some Llama releases spell it `type`.
    return rope.get("rope_type", rope.get("type", "default"))


def _name_map(cfg: ModelConfig) -> dict[str, str]:
    """kiln parameter name -> Hugging Face tensor name, for every parameter of the model."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
    }
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        for kiln_name, hf_name in _LAYER_NAMES.items():
            names[f"layers.{i}.{kiln_name}"] = f"model.layers.{i}.{hf_name}"
    return names


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


def _check_keys(
    hf_dir: Path, names: dict[str, str], tensor_files: dict[str, Path], tied: bool
) -> None:
    present = {name for name in tensor_files if not name.endswith("rotary_emb.inv_freq")}
    if tied:
        # Some tied checkpoints store lm_head anyway; transformers ignores it, and so does kiln.
        present.discard("lm_head.weight")
    expected = set(names.values())
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise KilnError(
            f"the weights in {hf_dir} do not match its config.json: "
            f"missing {missing or 'none'}, unexpected {unexpected or 'none'}. "
            "Is the checkpoint complete, and a plain Llama?"
        )


@torch.no_grad()
def _load_tensors(model: Transformer, names: dict[str, str], tensor_files: dict[str, Path]) -> None:
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for kiln_name, hf_name in names.items():
        by_file.setdefault(tensor_files[hf_name], []).append(kiln_name)
    for file, kiln_names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for kiln_name in kiln_names:
                tensor = f.get_tensor(names[kiln_name])
                param = params[kiln_name]
                if tensor.shape != param.shape:
                    raise KilnError(
                        f"{names[kiln_name]} in {file} has shape {tuple(tensor.shape)}, but "
                        f"config.json implies {tuple(param.shape)}; the config and weights disagree"
                    )
                param.copy_(tensor.to(torch.float32))


def _load_kiln_model(cfg: ModelConfig, step_dir: Path) -> Transformer:
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
