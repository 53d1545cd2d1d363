"""RoPE: interleaved pairs on the last dims, inverse rotation, YaRN frequencies (Flash values)."""

import math

import pytest
import torch

from dsv4.config import FLASH_ROPE_SCALING
from dsv4.model.rope import apply_rope, rope_inv_freq, rope_table, yarn_correction_range


def test_interleaved_pairs_on_a_4_dim_example():
    theta = 100.0
    inv = rope_inv_freq(4, theta)  # pair 0: 100^0 = 1, pair 1: 100^(-2/4) = 0.1
    assert torch.allclose(inv, torch.tensor([1.0, 0.1]))
    pos = torch.tensor([[3]])
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [B=1, L=1, D=4]
    out = apply_rope(x, rope_table(pos, inv))
    a0, a1 = 3 * 1.0, 3 * 0.1
    expected = [
        1 * math.cos(a0) - 2 * math.sin(a0),
        1 * math.sin(a0) + 2 * math.cos(a0),
        3 * math.cos(a1) - 4 * math.sin(a1),
        3 * math.sin(a1) + 4 * math.cos(a1),
    ]
    assert torch.allclose(out[0, 0], torch.tensor(expected), atol=1e-6)


def test_only_last_rope_dims_rotate_and_heads_broadcast():
    inv = rope_inv_freq(4, 10000.0)
    pos = torch.tensor([[0, 5, 9]])
    x = torch.randn(1, 3, 2, 6)  # [B, L, H, D], rope on dims 2..5
    out = apply_rope(x, rope_table(pos, inv))
    assert torch.equal(out[..., :2], x[..., :2])
    for h in range(2):  # each head rotated like a head-less tensor
        assert torch.allclose(out[:, :, h], apply_rope(x[:, :, h], rope_table(pos, inv)))
    assert torch.allclose(out[:, 0], x[:, 0])  # position 0 is the identity


def test_inverse_undoes_rotation_and_preserves_norm():
    inv = rope_inv_freq(8, 160000.0, FLASH_ROPE_SCALING)
    pos = torch.randint(0, 10_000, (2, 5))
    x = torch.randn(2, 5, 3, 12)
    table = rope_table(pos, inv)
    y = apply_rope(x, table)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(apply_rope(y, table, inverse=True), x, atol=1e-5)


def test_dot_product_depends_on_relative_position_only():
    inv = rope_inv_freq(8, 10000.0)
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)

    def score(m, n):
        return (apply_rope(q, rope_table(torch.tensor([[m]]), inv)) * apply_rope(k, rope_table(torch.tensor([[n]]), inv))).sum()

    assert torch.allclose(score(7, 3), score(104, 100), atol=1e-5)


def test_tables_are_fp32_from_int_positions():
    cos, sin = rope_table(torch.arange(6).view(2, 3), rope_inv_freq(4, 10.0))
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (2, 3, 2)
    y = apply_rope(torch.randn(2, 3, 4, dtype=torch.bfloat16), (cos, sin))
    assert y.dtype == torch.bfloat16


def test_yarn_flash_frequencies():
    # correction_dim(32) = 64 ln(65536 / (2 pi 32)) / (2 ln 160000) = 15.45 -> floor 15
    # correction_dim(1)  = 64 ln(65536 / (2 pi))    / (2 ln 160000) = 24.71 -> ceil 25
    assert yarn_correction_range(64, 160000.0, FLASH_ROPE_SCALING) == (15, 25)
    plain = torch.tensor([160000.0 ** (-2 * k / 64) for k in range(32)], dtype=torch.float64)
    yarn = rope_inv_freq(64, 160000.0, FLASH_ROPE_SCALING).double()
    for k in range(32):
        if k <= 15:
            expected = plain[k]
        elif k >= 25:
            expected = plain[k] / 16
        else:
            ramp = (k - 15) / 10
            expected = plain[k] / 16 * ramp + plain[k] * (1 - ramp)
        assert yarn[k] == pytest.approx(float(expected), rel=1e-6), k
    assert torch.allclose(rope_inv_freq(64, 160000.0).double(), plain, rtol=1e-6)
