"""Moving tensors between safetensors files and a kiln model along a family's name map.

Reading goes one tensor (or one expert) at a time through safetensors' memory maps, so an
import holds the kiln model and one Hugging Face tensor at most.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.errors import KilnError
from kiln.model.family import HfPart, NameMap


def check_keys(hf_dir: Path, names: NameMap, tensor_files: dict[str, Path], tied: bool) -> None:
    """The checkpoint holds exactly the tensors the config implies: a missing or extra tensor
    means the config and the weights describe different models."""
    present = {name for name in tensor_files if not name.endswith("rotary_emb.inv_freq")}
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
    """Fill every parameter of `model` from the Hugging Face tensors `names` assigns it."""
    params = dict(model.named_parameters())
    with ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(file, framework="pt"))
            for file in sorted(set(tensor_files.values()))
        }
        for kiln_name, parts in names.items():
            if not parts:
                continue  # kept at its initial value (the router's expert_bias: zeros)
            param = params[kiln_name]
            for part in parts:
                tensor = _read(handles[tensor_files[part.name]], part)
                target = param[part.expert] if part.expert is not None else param
                if tensor.shape != target.shape:
                    half = "" if part.half is None else f"the {('gate', 'up')[part.half]} half of "
                    raise KilnError(
                        f"{half}{part.name} in {tensor_files[part.name]} has shape "
                        f"{tuple(tensor.shape)}, but config.json implies {tuple(target.shape)}; "
                        "the config and weights disagree"
                    )
                target.copy_(tensor.to(torch.float32))


def _read(handle, part: HfPart) -> torch.Tensor:
    """The HF tensor of `part`, or only its half (a fused gate_up_proj: gate rows, then up)."""
    if part.half is None:
        return handle.get_tensor(part.name)
    view = handle.get_slice(part.name)
    rows = view.get_shape()[1] // 2
    return view[:, part.half * rows : (part.half + 1) * rows]


def export_tensors(model: torch.nn.Module, names: NameMap) -> dict[str, torch.Tensor]:
    """Hugging Face name -> a view of the model's tensor (one expert's slice for stacked
    experts); nothing is copied until a shard converts it."""
    weights = {}
    for kiln_name, tensor in model.state_dict().items():
        for part in names[kiln_name]:
            if part.half is not None:
                raise ValueError(f"{part.name}: fused halves are read, never written")
            weights[part.name] = tensor[part.expert] if part.expert is not None else tensor
    return weights


def hf_tensor_names(names: NameMap) -> set[str]:
    """Every Hugging Face tensor a name map reads or writes."""
    return {part.name for parts in names.values() for part in parts}
