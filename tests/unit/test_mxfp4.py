"""MXFP4 dequantization (kiln/checkpoint/mxfp4.py): a tiny packed expert tensor built here
dequantizes to exactly what transformers' own dequantization gives, every FP4 code and E8M0
exponent decodes to its defined value, and malformed pairs are refused."""

from __future__ import annotations

import pytest
import torch

from kiln.checkpoint import mxfp4
from kiln.checkpoint.mxfp4 import dequantize_mxfp4, dequantized_tensors, mxfp4_bases
from kiln.errors import KilnError

# The pure-torch path transformers uses to dequantize gpt-oss on load without a GPU kernel.
hf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # the format's positive values, codes 0-7


def _packed(experts=2, rows=6, groups=4, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes for the blocks; exponents within 2^±8 of 1, as trained weights' are."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 136, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_matches_transformers_in_fp32_and_bf16(monkeypatch):
    blocks, scales = _packed()
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    reference = hf_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == reference.shape == (2, 4 * 32, 6)  # GptOssExperts' (experts, in, out)
    # Exact: both are a table lookup times a power of two, no rounding anywhere.
    assert torch.equal(ours, reference)
    # bf16 holds every value exactly (at most 2 significant bits, fp32's exponent range).
    assert torch.equal(dequantize_mxfp4(blocks, scales), ours.to(torch.bfloat16))
    # Chunks of 4 rows (the last one short) fill the same tensor as one chunk per expert.
    monkeypatch.setattr(mxfp4, "CHUNK_VALUES", 4 * 4 * 32)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), reference)


def test_every_code_and_exponent_decodes_to_its_value():
    # One group: byte i holds code i in its low nibble (element 2i) and 15 - i in its high one.
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes | ((15 - codes) << 4)).reshape(1, 1, 1, 16)
    values = dequantize_mxfp4(blocks, torch.full((1, 1, 1), 127, dtype=torch.uint8), torch.float32)
    expected = torch.tensor(E2M1 + [-v for v in E2M1])
    assert torch.equal(values[0, 0::2, 0], expected)
    assert torch.equal(values[0, 1::2, 0], expected.flip(0))
    assert values[0, 16, 0].signbit()  # code 8 is -0

    exponents = [0, 1, 100, 126, 127, 128, 150, 254]
    ones = torch.full((1, len(exponents), 1, 16), 0x22, dtype=torch.uint8)  # code 2 = 1.0
    scales = torch.tensor(exponents, dtype=torch.uint8).reshape(1, -1, 1)
    decoded = dequantize_mxfp4(ones, scales, torch.float32)
    for row, e in enumerate(exponents):
        # 2^(e - 127) is exact in fp32 for every e, 2^-127 as a subnormal.
        assert (decoded[0, :, row] == 2.0 ** (e - 127)).all(), e


def test_reads_pairs_by_name():
    blocks, scales = _packed(experts=1, rows=2, groups=1, seed=1)
    base = "model.layers.0.mlp.experts.down_proj"
    tensors = {
        f"{base}_blocks": blocks,
        f"{base}_scales": scales,
        "model.layers.0.mlp.experts.down_proj_bias": torch.zeros(1, 2),
    }
    read = []
    out = dict(dequantized_tensors(tensors, lambda n: read.append(n) or tensors[n], torch.float32))
    assert list(out) == [base] and read == [f"{base}_blocks", f"{base}_scales"]
    assert torch.equal(out[base], dequantize_mxfp4(blocks, scales, torch.float32))


BLOCKS, SCALES = _packed(experts=2, rows=3, groups=2)


@pytest.mark.parametrize(
    ("blocks", "scales", "dtype", "message"),
    [
        (BLOCKS.int(), SCALES, torch.float32, r"w_blocks has dtype torch.int32, but MXFP4 stores"),
        (BLOCKS, SCALES.float(), torch.float32, r"w_scales has dtype torch.float32, but MXFP4"),
        (BLOCKS[..., :8], SCALES, torch.float32, r"\(2, 3, 2, 8\), but .* \(experts, rows, grou"),
        (BLOCKS[0], SCALES[0], torch.float32, r"w_blocks has shape \(3, 2, 16\), but an MXFP4"),
        (BLOCKS, SCALES[:, :2], torch.float32, r"w_scales has shape \(2, 2, 2\).*expected \(2, 3,"),
        (BLOCKS, SCALES, torch.float16, r"w cannot be dequantized to torch.float16"),
        (BLOCKS, torch.full_like(SCALES, 255), torch.float32, r"E8M0 code 255 \(NaN\)"),
    ],
)
def test_bad_pairs_are_refused(blocks, scales, dtype, message):
    with pytest.raises(KilnError, match=message):
        dequantize_mxfp4(blocks, scales, dtype, name="w")


@pytest.mark.parametrize(("present", "missing"), [("_blocks", "_scales"), ("_scales", "_blocks")])
def test_a_half_pair_is_refused(present, missing):
    names = ["a.gate_up_proj_blocks", "a.gate_up_proj_scales", f"b.down_proj{present}"]
    with pytest.raises(KilnError, match=f"holds b.down_proj{present} but not b.down_proj{missing}"):
        mxfp4_bases(names)
