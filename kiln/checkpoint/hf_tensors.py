"""Moving tensors between safetensors files and a kiln model along a family's name map.

Reading goes one tensor (or one expert) at a time through safetensors' memory maps, so an
import holds the kiln model and one Hugging Face tensor at most. A tensor stored packed in
MXFP4 (gpt-oss's experts: `<name>_blocks` and `<name>_scales`) is read as `<name>`, dequantized.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.checkpoint.mxfp4 import BLOCKS, SCALES, dequantize_mxfp4, mxfp4_bases
from kiln.errors import KilnError
from kiln.model.family import HfPart, NameMap


def check_keys(hf_dir: Path, names: NameMap, tensor_files: dict[str, Path], tied: bool) -> None:
    """The checkpoint holds exactly the tensors the config implies: a missing or extra tensor
    means the config and the weights describe different models."""
    present = {name for name in stored_names(tensor_files) if not name.endswith("inv_freq")}
    if tied:
        # Some tied checkpoints store lm_head anyway; transformers ignores it, and so does kiln.
        present.discard("lm_head.weight")
    expected = hf_tensor_names(names)
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise KilnError(
            f"the weights in {hf_dir} do not match its config.json: "
            f"missing {missing or 'none'}, unexpected {unexpected or 'none'}. "
            "Is the checkpoint complete, and of the family its config.json names?"
        )


@torch.no_grad()
def load_tensors(model: torch.nn.Module, names: NameMap, tensor_files: dict[str, Path]) -> None:
    """Fill every parameter (and persistent buffer, such as DeepSeek's routing biases) of
    `model` from the Hugging Face tensors `names` assigns it."""
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    row_counts = _row_counts(names)
    with ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(file, framework="pt"))
            for file in sorted(set(tensor_files.values()))
        }
        for kiln_name, parts in names.items():
            if not parts:
                continue  # kept at its initial value (the router's expert_bias: zeros)
            param = targets[kiln_name]
            for part in parts:
                tensor = _read(handles, tensor_files, part, row_counts.get(part.name))
                target = param[part.expert] if part.expert is not None else param
                if tensor.shape != target.shape:
                    half = "" if part.half is None else f"the {('gate', 'up')[part.half]} half of "
                    raise KilnError(
                        f"{half}{part.name} in {_file_of(tensor_files, part.name)} has shape "
                        f"{tuple(tensor.shape)}, but config.json implies {tuple(target.shape)}; "
                        "the config and weights disagree"
                    )
                if part.copy:
                    _check_copy(part.name, tensor, parts[0].name, target)
                else:
                    target.copy_(tensor.to(torch.float32))


def _check_copy(name: str, tensor: torch.Tensor, main: str, target: torch.Tensor) -> None:
    """A repeated tensor (read after its main copy) must hold the same values: kiln keeps one."""
    if not torch.equal(tensor.to(target.dtype), target):
        raise KilnError(
            f"{name} differs from {main}; kiln's model shares one tensor between them (as "
            "DeepSeek-V3's multi-token prediction shares the embedding and output head), so "
            "this checkpoint cannot be converted"
        )


def stored_names(tensor_files: dict[str, Path]) -> set[str]:
    """The tensors a checkpoint holds, an MXFP4 pair counted as the one tensor it packs."""
    bases = mxfp4_bases(tensor_files)
    packed = {base + suffix for base in bases for suffix in (BLOCKS, SCALES)}
    return (set(tensor_files) - packed) | set(bases)


def _read(
    handles: dict, tensor_files: dict[str, Path], part: HfPart, row_count: int | None
) -> torch.Tensor:
    """The HF tensor of `part` (dequantized where it is packed in MXFP4), or only its half (a
    fused gate_up_proj: gate rows, then up), every other unit or its rows, in kiln's order and
    layout. `row_count`: the rows the name map's parts of this tensor cover."""
    if part.name not in tensor_files:
        blocks, scales = (_whole(handles, tensor_files, part.name + s) for s in (BLOCKS, SCALES))
        tensor = dequantize_mxfp4(blocks, scales, torch.float32, part.name)
    elif part.half is None:
        tensor = _whole(handles, tensor_files, part.name)
    else:
        view = handles[tensor_files[part.name]].get_slice(part.name)
        rows = view.get_shape()[1] // 2
        tensor = view[:, part.half * rows : (part.half + 1) * rows]
    if part.interleave is not None:
        tensor = tensor[..., part.interleave :: 2]
    if part.transposed:
        tensor = tensor.transpose(-2, -1)
    if part.rows is not None:
        if tensor.shape[0] != row_count:
            # Checked here: selecting rows from a larger tensor would give kiln's shape.
            raise KilnError(
                f"{part.name} in {_file_of(tensor_files, part.name)} has {tensor.shape[0]} rows, "
                f"but config.json implies {row_count}; the config and weights disagree"
            )
        tensor = tensor[list(part.rows)]
    if part.singleton is not None:
        tensor = tensor.squeeze(part.singleton)
    return tensor


def _file_of(tensor_files: dict[str, Path], name: str) -> Path:
    return tensor_files.get(name) or tensor_files[name + BLOCKS]


def _whole(handles: dict, tensor_files: dict[str, Path], name: str) -> torch.Tensor:
    return handles[tensor_files[name]].get_tensor(name)


def export_tensors(model: torch.nn.Module, names: NameMap) -> dict[str, torch.Tensor]:
    """Hugging Face name -> a view of the model's tensor (one expert's slice for stacked
    experts); nothing is copied until a shard converts it, but for tensors whose rows are
    reordered or joined (DeepSeek's rotary rows of the query and key projections, Qwen3-Next's
    fused projections: a copy each)."""
    weights = {}
    row_counts = _row_counts(names)
    for kiln_name, tensor in model.state_dict().items():
        for part in names[kiln_name]:
            if part.half is not None:
                raise ValueError(f"{part.name}: fused halves are read, never written")
            view = tensor[part.expert] if part.expert is not None else tensor
            if part.transposed:  # a copy: safetensors writes contiguous tensors
                view = view.transpose(-2, -1).contiguous()
            if part.interleave is not None:  # one of the units a fused tensor alternates
                fused = weights.get(part.name)
                if fused is None:
                    shape = (*view.shape[:-1], 2 * view.shape[-1])
                    fused = weights[part.name] = torch.empty(shape, dtype=view.dtype)
                fused[..., part.interleave :: 2] = view
                continue
            if part.singleton is not None:
                view = view.unsqueeze(part.singleton)
            if part.rows is not None:
                # Back to the Hugging Face order: HF row rows[r] is kiln row r.
                whole = weights.get(part.name)
                if whole is None:
                    shape = (row_counts[part.name], *view.shape[1:])
                    whole = weights[part.name] = torch.empty(shape, dtype=view.dtype)
                whole[list(part.rows)] = view
                continue
            weights[part.name] = view
    return weights


def _row_counts(names: NameMap) -> dict[str, int]:
    """HF name -> its rows, for tensors whose kiln parts name rows (they cover each row once)."""
    rows: dict[str, list[int]] = {}
    for parts in names.values():
        for part in parts:
            if part.rows is not None:
                rows.setdefault(part.name, []).extend(part.rows)
    assert all(sorted(r) == list(range(len(r))) for r in rows.values()), "rows cover each once"
    return {name: len(r) for name, r in rows.items()}


def hf_tensor_names(names: NameMap) -> set[str]:
    """Every Hugging Face tensor a name map reads or writes."""
    return {part.name for parts in names.values() for part in parts}
