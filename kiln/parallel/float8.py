"""FP8 training (train.mixed_precision = "fp8"): linear layers compute in float8 through torchao.

torchao's `Float8Linear` casts a linear layer's input, weight and output gradient to float8 with
dynamic scales ("tensorwise": one per tensor; "rowwise": one per row) and runs the three matmuls
of forward and backward on them. The weights stay fp32 masters (FSDP gathers them in bf16, or in
float8 with `fp8.fsdp_float8_all_gather`) and so does the optimizer state; everything that is not
a float8 linear layer computes in `fp8.high_precision` (bf16, as under mixed_precision = "bf16",
or fp32 for numerics checks).

Kept in high precision: the layers the model's plan excludes (Llama: the output head, whose
logits feed the loss, and MoE routers, whose top-k choice flips on small differences), the routed
experts (grouped GEMMs, which torchao's float8 training does not cover here), layers whose
dimensions on a rank are not multiples of 16 (float8 matmuls need them), and any layer
`fp8.keep_high_precision` names.

Conversion swaps modules, so it runs before tensor parallel (the apply order in docs/architecture.md lists FP8 after CP: a
module swap cannot follow TP, whose styles hold onto the modules they wrap). Under tensorwise
scaling TP then uses torchao's float8 styles (`float8_tensor_parallel`): activations are cast to
float8 before TP gathers them, half the bytes of a bf16 gather, with one scale for the whole
(sharded) tensor, as one process computes it. Rowwise scaling has no float8 styles: its layers
are split like plain linear ones and gather their inputs in high precision. On a CPU, torchao emulates the float8 matmuls (same casts
and scales, matmul in high precision): the numerics of a GPU run, for tests, not for speed.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from kiln.config.sections import JobConfig
from kiln.errors import ConfigError

# float8 matmuls need both dimensions of the weight on each rank divisible by this.
FLOAT8_ALIGNMENT = 16
# The least compute capability whose tensor cores multiply float8, per recipe.
CUDA_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}


def float8_layer_plan(
    model: nn.Module, cfg: JobConfig, *, tp: int, excluded: tuple[str, ...]
) -> dict[str, str | None]:
    """Every linear layer of `model` by name: None if it will compute in float8, else why not.
    Kept out: `excluded` (the model plan's `float8_excluded`: Llama's output head and MoE
    routers) and what fp8.keep_high_precision names."""
    keep = excluded + tuple(cfg.fp8.keep_high_precision)
    return {
        name: _kept_because(name, module, keep, tp)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    }


def convert_to_float8(
    model: nn.Module,
    cfg: JobConfig,
    *,
    device: torch.device,
    tp: int,
    excluded: tuple[str, ...] = (),
) -> int:
    """Swap the linear layers `float8_layer_plan` selects for torchao's Float8Linear (on the
    meta device, before any other parallelism); returns how many."""
    _check_device(cfg.fp8.recipe, device)
    plan = float8_layer_plan(model, cfg, tp=tp, excluded=excluded)
    chosen = {name for name, reason in plan.items() if reason is None}
    if plan and not chosen:
        raise ConfigError(
            "train.mixed_precision = 'fp8' but no linear layer is left to compute in float8 "
            f"(fp8.keep_high_precision = {cfg.fp8.keep_high_precision}, and layers need "
            f"dimensions divisible by {FLOAT8_ALIGNMENT} on each rank); shorten the list or use "
            "mixed_precision = 'bf16'"
        )
    float8 = _torchao_float8(device)
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(cfg.fp8.recipe),
        enable_fsdp_float8_all_gather=cfg.fp8.fsdp_float8_all_gather,
        emulate=device.type != "cuda",
    )
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, name: name in chosen
    )
    return len(chosen)


def precompute_float8_scales(model_parts: list[nn.Module], cfg: JobConfig) -> None:
    """After each optimizer step under float8 all-gather: every weight's scale in one
    all-reduce, instead of one per weight in the next forward."""
    if cfg.train.mixed_precision == "fp8" and cfg.fp8.fsdp_float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)


def float8_tensor_parallel(
    module: nn.Module, styles: dict[str, ParallelStyle]
) -> dict[str, ParallelStyle]:
    """`styles` (a plan's TP styles for `module`) with torchao's float8 styles where they apply:
    column- and row-split layers that are Float8Linear, and a prepared input whose every
    column-split consumer is one and which no unsplit linear layer under it may take (it is then
    cast once, before the all-gather, instead of once per consumer after it). Everything else
    keeps its style. Tensorwise scaling only."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def float8(path: str) -> bool:
        return isinstance(module.get_submodule(path), Float8Linear)

    def column_split_under(path: str) -> list[str]:
        return [
            p for p, s in styles.items() if p.startswith(f"{path}.") and _is(s, ColwiseParallel)
        ]

    def unsplit_under(path: str) -> list[str]:
        # Linear layers that may take the prepared input whole (MLA's down-projections): a
        # float8 input would reach them as float8 data they cannot multiply.
        split = {p for p, s in styles.items() if _is(s, ColwiseParallel) or _is(s, RowwiseParallel)}
        return [
            f"{path}.{name}"
            for name, sub in module.get_submodule(path).named_modules()
            if name and isinstance(sub, nn.Linear) and f"{path}.{name}" not in split
        ]

    converted = dict(styles)
    for path, style in styles.items():
        if _is(style, ColwiseParallel) and float8(path):
            converted[path] = Float8ColwiseParallel(**_linear_layouts(style))
        elif _is(style, RowwiseParallel) and float8(path):
            converted[path] = Float8RowwiseParallel(**_linear_layouts(style))
        elif _is(style, PrepareModuleInput) and style.input_layouts is not None:
            consumers = column_split_under(path)
            if consumers and all(map(float8, consumers)) and not unsplit_under(path):
                converted[path] = PrepareFloat8ModuleInput(
                    input_layouts=style.input_layouts,
                    desired_input_layouts=style.desired_input_layouts,
                    input_kwarg_layouts=style.input_kwarg_layouts,
                    desired_input_kwarg_layouts=style.desired_input_kwarg_layouts,
                    use_local_output=style.use_local_output,
                    fwd_config_submodule_fqn=consumers[0].removeprefix(f"{path}."),
                )
    return converted


def _is(style: ParallelStyle, kind: type) -> bool:
    # Exact type: a subclass (a test mutation, another float8 style) changes what it does.
    return type(style) is kind


def _linear_layouts(style: ColwiseParallel | RowwiseParallel) -> dict:
    return {
        "input_layouts": style.input_layouts[0],
        "output_layouts": style.output_layouts[0],
        "use_local_output": style.use_local_output,
    }


def _kept_because(name: str, module: nn.Linear, keep: tuple[str, ...], tp: int) -> str | None:
    named = next((pattern for pattern in keep if f".{pattern}." in f".{name}."), None)
    if named is not None:
        return f"kept out of float8 ({named!r})"
    dims = (module.in_features, module.out_features)
    # Under tensor parallel a rank holds 1/tp of one of them; both must still align.
    if any(d % FLOAT8_ALIGNMENT or (d // tp) % FLOAT8_ALIGNMENT for d in dims):
        return f"dimensions {dims[0]} × {dims[1]} (/ tp = {tp}) not multiples of {FLOAT8_ALIGNMENT}"
    return None


def _check_device(recipe: str, device: torch.device) -> None:
    if device.type != "cuda":
        return
    need = CUDA_CAPABILITY[recipe]
    have = torch.cuda.get_device_capability(device)
    if have < need:
        raise ConfigError(
            f"fp8.recipe = {recipe!r} needs a GPU of compute capability {need[0]}.{need[1]} or "
            f"newer (H100, or L40/4090 for tensorwise); this one is {have[0]}.{have[1]}: use "
            "mixed_precision = 'bf16'"
        )


def _torchao_float8(device: torch.device):
    """torchao.float8; on a CPU without its CUDA kernels, which it warns about at import."""
    if device.type != "cuda":
        logging.getLogger("torchao").setLevel(logging.ERROR)
    import torchao.float8

    return torchao.float8
