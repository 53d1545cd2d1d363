"""FP8 block / FP4 packed formats: hand-made bytes, scale block mapping, ragged shapes, re-quantisation."""

import math

import pytest
import torch

from dsv4.checkpoint.quant import (
    decode_e8m0,
    dequantize_fp4_packed,
    dequantize_fp8_block,
    pack_fp4_codes,
    quantize_fp4_packed,
    quantize_fp8_block,
    unpack_fp4_codes,
)
from tests.unit.checkpoint.helpers import E2M1, fp4_case, fp8_case


def _e8m0(values):
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_e8m0_decodes_bits_not_numbers():
    got = decode_e8m0(_e8m0([0, 120, 127, 128, 130, 254, 255]))
    assert got[0] == 0.0
    assert got[1:6].tolist() == [2.0**-7, 1.0, 2.0, 8.0, 2.0**127]
    assert math.isnan(got[6])
    assert torch.equal(decode_e8m0(torch.tensor([127, 130], dtype=torch.uint8)), torch.tensor([1.0, 8.0]))


def test_fp4_nibble_order_low_nibble_is_even_column():
    packed = torch.tensor([[0x21, 0xF8, 0x7A]], dtype=torch.uint8).view(torch.int8)
    assert unpack_fp4_codes(packed).tolist() == [[1, 2, 8, 15, 10, 7]]
    got = dequantize_fp4_packed(packed, _e8m0([[127]]), dtype=torch.float32)
    assert got.tolist() == [[0.5, 1.0, 0.0, -6.0, -1.0, 6.0]]
    assert pack_fp4_codes(torch.tensor([[1, 2, 8, 15]])).view(torch.uint8).tolist() == [[0x21, 0xF8]]


def test_fp4_every_code_on_the_grid():
    codes = torch.arange(16).repeat(2, 2)  # [2, 32]
    packed = pack_fp4_codes(codes)
    got = dequantize_fp4_packed(packed, _e8m0([[127], [129]]), dtype=torch.float32)
    table = torch.tensor(E2M1)
    assert torch.equal(got[0], table[codes[0]])
    assert torch.equal(got[1], table[codes[1]] * 4)


def test_fp4_scale_groups_of_32_columns_per_row():
    ones = pack_fp4_codes(torch.full((3, 96), 2))  # code 2 = 1.0 everywhere
    scale = _e8m0([[127, 128, 129], [126, 127, 128], [130, 131, 132]])
    got = dequantize_fp4_packed(ones, scale, dtype=torch.float32)
    for r in range(3):
        for g in range(3):
            assert torch.all(got[r, 32 * g : 32 * (g + 1)] == 2.0 ** (scale.view(torch.uint8)[r, g].item() - 127))


def test_fp4_ragged_last_group_and_bf16_exact():
    gen = torch.Generator().manual_seed(1)
    packed, scale, expected = fp4_case(5, 40, gen)  # 40 columns: groups of 32 + 8
    assert scale.shape == (5, 2)
    assert torch.equal(dequantize_fp4_packed(packed, scale, dtype=torch.float32), expected)
    assert torch.equal(dequantize_fp4_packed(packed, scale, dtype=torch.bfloat16).float(), expected)


def test_fp8_block_mapping_with_ragged_edges():
    q = torch.ones(130, 260).to(torch.float8_e4m3fn)
    scale = _e8m0([[127, 128, 129], [130, 126, 125]])
    got = dequantize_fp8_block(q, scale, dtype=torch.float32)
    s = decode_e8m0(scale)
    for i, rows in enumerate((slice(0, 128), slice(128, 130))):
        for j, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 260))):
            assert torch.all(got[rows, cols] == s[i, j])


def test_fp8_known_values():
    gen = torch.Generator().manual_seed(2)
    q, scale, expected = fp8_case(200, 130, gen)
    assert scale.shape == (2, 2)
    assert torch.equal(dequantize_fp8_block(q, scale, dtype=torch.float32), expected)
    assert torch.equal(dequantize_fp8_block(q, scale, dtype=torch.bfloat16).float(), expected)


def test_scale_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"\(1, 1\).*\(2, 2\)"):
        dequantize_fp8_block(torch.zeros(130, 130).to(torch.float8_e4m3fn), _e8m0([[127]]))
    with pytest.raises(ValueError, match="one scale per 32"):
        dequantize_fp4_packed(torch.zeros(2, 32, dtype=torch.int8), _e8m0([[127], [127]]))


def test_fp8_quantize_within_e4m3_rounding():
    w = torch.randn(130, 300, generator=torch.Generator().manual_seed(3))
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 3)
    back = dequantize_fp8_block(q, scale, dtype=torch.float32)
    s = decode_e8m0(scale).repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :300]
    # the scale is the smallest power of two with amax / s <= 448
    for i in range(2):
        for j in range(3):
            amax = w[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].abs().max()
            sc = decode_e8m0(scale)[i, j]
            assert amax / sc <= 448 < amax / (sc / 2)
    normal = (w / s).abs() >= 2.0**-6  # e4m3 normal range: relative error <= 2^-4 (3 mantissa bits, nearest)
    rel = ((back - w).abs() / w.abs())[normal]
    assert rel.max() <= 2.0**-4
    sub = ~normal  # subnormals: absolute error <= half the smallest step 2^-9, times the scale
    assert torch.all((back - w).abs()[sub] <= 2.0**-10 * s[sub] + 1e-30)


def test_fp4_quantize_round_to_nearest_ties_to_even():
    w = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 0.2, -0.3, 6.0, -0.0] + [0.0] * 20])
    packed, scale = quantize_fp4_packed(w)
    assert scale.view(torch.uint8).tolist() == [[127]]
    got = dequantize_fp4_packed(packed, scale, dtype=torch.float32)[0, :12].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.0, -0.5, 6.0, 0.0]


def test_fp4_quantize_one_float_either_side_of_each_midpoint_goes_to_the_nearer_value():
    """Only an exact tie goes to the even code: one float below a midpoint rounds down, one float above up."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    lower = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    upper = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    below, above = torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 6.0))
    w = torch.cat((below, above, -below, -above, torch.full((4,), 6.0))).view(1, 32)
    packed, scale = quantize_fp4_packed(w)
    got = dequantize_fp4_packed(packed, scale, dtype=torch.float32)[0, :28]
    assert torch.equal(got, torch.cat((lower, upper, -lower, -upper)))


def test_fp4_quantize_grid_values_round_trip_exactly():
    packed, scale, expected = fp4_case(4, 64, torch.Generator().manual_seed(4))
    q2, s2 = quantize_fp4_packed(expected)
    assert torch.equal(dequantize_fp4_packed(q2, s2, dtype=torch.float32), expected)


@pytest.mark.parametrize("scheme_name", ["V4_SCHEME", "V41_SCHEME"])
def test_kept_forms_are_the_familys_formats(scheme_name):
    """``quantize_kept`` / ``dequantize_kept`` in a family's scheme: FP8 in its tiles (V4.1: 32 x 32), E8M0 byte 0
    decoded as the family does (V4.1: 2^-127), stacked (expert) axes included; the values are exactly those
    ``dequantize`` gives the same bytes, the meta shapes are the real ones, and a scale of another family's tiles
    is refused."""
    from dsv4.checkpoint import quant as Q

    scheme = getattr(Q, scheme_name)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(2, 160, 96, generator=gen) * torch.exp2(torch.randint(-8, 8, (2, 160, 96), generator=gen).float())
    for fmt in ("fp8", "fp4"):
        q, s = Q.quantize_kept(w, fmt, scheme)
        assert tuple(s.shape) == (2, *Q.scale_shape(fmt, (160, 96), scheme))
        for e in range(2):
            assert torch.equal(q[e].view(torch.uint8), Q.quantize(w[e], fmt, scheme)[0].view(torch.uint8))
        meta_q, meta_s = Q.quantize_kept(w.to("meta"), fmt, scheme)
        assert (meta_q.shape, meta_q.dtype, meta_s.shape, meta_s.dtype) == (q.shape, q.dtype, s.shape, s.dtype)
        q, s = q.clone(), s.clone()
        q.view(torch.uint8)[0, 0, 0] = 0x38 if fmt == "fp8" else 0x22  # 1.0 (FP4: both nibbles)
        s.view(torch.uint8)[0, 0, 0] = 0  # its scale byte 0: 0.0 in V4, 2^-127 in V4.1
        got = Q.dequantize_kept(q, s, torch.float32, scheme)
        want = torch.stack([Q.dequantize(q[e], s[e], fmt, torch.float32, scheme) for e in range(2)])
        assert torch.equal(got, want) and torch.equal(Q.dequantize_kept(q[1], s[1], torch.float32, scheme), want[1])
        assert got[0, 0, 0].item() == (2.0**-127 if scheme is Q.V41_SCHEME else 0.0)
    q, s = Q.quantize_kept(w[0], "fp8", Q.V4_SCHEME if scheme is Q.V41_SCHEME else Q.V41_SCHEME)
    with pytest.raises(ValueError, match="does not match weight"):
        Q.dequantize_kept(q, s, torch.float32, scheme)
