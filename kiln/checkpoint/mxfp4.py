"""Dequantizing MXFP4 expert weights, the form gpt-oss's released checkpoints store them in.

A packed weight is two uint8 tensors. `<base>_blocks` has shape (experts, rows, groups, 16):
each byte holds two FP4 E2M1 codes, the element with the even index in its low nibble and the
odd one in its high nibble, so one group of 16 bytes is 32 consecutive elements of a row.
`<base>_scales` has shape (experts, rows, groups): one E8M0 exponent e per group, scaling its
32 elements by 2^(e - 127). The packed rows are the bf16 parameter's columns: the dequantized
tensor of gate_up_proj_blocks (experts, 2 * intermediate, hidden / 32, 16) is transformers'
GptOssExperts.gate_up_proj, (experts, hidden, 2 * intermediate), and likewise down_proj.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from kiln.errors import KilnError

BLOCKS, SCALES = "_blocks", "_scales"
GROUP_BYTES = 16  # 32 FP4 values per E8M0 scale

# E2M1 by code: bit 3 is the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa.
_E2M1_POSITIVE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = _E2M1_POSITIVE + tuple(-v for v in _E2M1_POSITIVE)  # code 8 is -0.0

# E8M0 code 255 is NaN; every other code is the power of two 2^(e - 127). All of them, 2^-127
# (an fp32 subnormal) included, are exact in fp32 and bf16, so the products below are too.
_NAN_SCALE = 255

# Values decoded per chunk: bounds the temporaries (int64 indices, fp32 values) to a few hundred
# MB whatever the tensor's size, while one chunk still holds a whole expert of gpt-oss-120b.
CHUNK_VALUES = 1 << 24


def _byte_table() -> torch.Tensor:
    """(256, 2) fp32: the low-nibble and high-nibble values of every byte."""
    codes = torch.arange(256)
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    return torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=1)


def _scale_table() -> torch.Tensor:
    """(256,) fp32: 2^(e - 127) for every E8M0 code (255 never reaches it: it is refused)."""
    return torch.tensor([2.0 ** (e - 127) for e in range(256)], dtype=torch.float64).float()


def _check(name: str, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a pair that is not a packed expert weight, before anything is allocated."""
    for part, tensor in ((BLOCKS, blocks), (SCALES, scales)):
        if tensor.dtype != torch.uint8:
            raise KilnError(
                f"{name}{part} has dtype {tensor.dtype}, but MXFP4 stores uint8 "
                f"({'two FP4 codes per byte' if part == BLOCKS else 'E8M0 exponents'})"
            )
    if blocks.dim() != 4 or blocks.shape[-1] != GROUP_BYTES:
        raise KilnError(
            f"{name}{BLOCKS} has shape {tuple(blocks.shape)}, but an MXFP4 expert weight's blocks "
            f"are (experts, rows, groups, {GROUP_BYTES}): {GROUP_BYTES} bytes = 32 FP4 values "
            "per scale"
        )
    if scales.shape != blocks.shape[:-1]:
        raise KilnError(
            f"{name}{SCALES} has shape {tuple(scales.shape)}, but {name}{BLOCKS} of shape "
            f"{tuple(blocks.shape)} needs one scale per group of {GROUP_BYTES} bytes: "
            f"expected {tuple(blocks.shape[:-1])}"
        )
    if dtype not in (torch.bfloat16, torch.float32):
        raise KilnError(
            f"{name} cannot be dequantized to {dtype}: MXFP4's scales span 2^-127 to 2^127, "
            "which only bfloat16 and float32 hold; choose one of them"
        )
    if bool((scales == _NAN_SCALE).any()):
        raise KilnError(
            f"{name}{SCALES} holds the E8M0 code {_NAN_SCALE} (NaN): the checkpoint is corrupt"
        )


@torch.no_grad()
def dequantize_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "tensor",
) -> torch.Tensor:
    """The (experts, groups * 32, rows) weight that an MXFP4 (blocks, scales) pair packs."""
    _check(name, blocks, scales, dtype)
    experts, rows, groups, _ = blocks.shape
    columns = groups * 2 * GROUP_BYTES
    byte_table = _byte_table().to(blocks.device)
    scale_table = _scale_table().to(blocks.device)
    # Allocated in the final (transposed) layout and filled chunk by chunk, so the peak is the
    # output plus one chunk's temporaries, not the two full copies a later transpose would need.
    out = torch.empty(experts, columns, rows, dtype=dtype, device=blocks.device)
    step = max(1, CHUNK_VALUES // columns)
    for expert in range(experts):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            codes = blocks[expert, r0:r1].long()  # (chunk, groups, 16)
            values = byte_table[codes].reshape(r1 - r0, groups, 2 * GROUP_BYTES)
            # An FP4 value times a power of two is exact in fp32 (up to overflow to inf, which
            # only scales near 2^127 reach) and has at most 2 significant bits, so bf16 holds it.
            values *= scale_table[scales[expert, r0:r1].long()].unsqueeze(-1)
            out[expert, :, r0:r1] = values.reshape(r1 - r0, columns).T
    return out


def mxfp4_bases(names: Iterable[str]) -> list[str]:
    """The `<base>` of every `<base>_blocks`/`<base>_scales` pair among a checkpoint's names."""
    names = set(names)
    blocks = {n.removesuffix(BLOCKS) for n in names if n.endswith(BLOCKS)}
    scales = {n.removesuffix(SCALES) for n in names if n.endswith(SCALES)}
    if unpaired := sorted(blocks ^ scales):
        base = unpaired[0]
        have, lack = (BLOCKS, SCALES) if base in blocks else (SCALES, BLOCKS)
        raise KilnError(
            f"the checkpoint holds {base}{have} but not {base}{lack}: an MXFP4 weight needs "
            "both its blocks and its scales; is a shard missing?"
        )
    return sorted(blocks)


def dequantized_tensors(
    names: Iterable[str],
    read: Callable[[str], torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`<base>` and its dequantized weight for each packed pair in `names`, reading each pair
    with `read(name)` only when its turn comes (a caller that stores each weight before taking
    the next holds one packed pair and one dequantized weight at a time)."""
    for base in mxfp4_bases(names):
        yield base, dequantize_mxfp4(read(base + BLOCKS), read(base + SCALES), dtype, base)
