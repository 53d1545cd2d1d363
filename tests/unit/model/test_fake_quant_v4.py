"""DeepSeek-V4's served numerics in training (``config.fake_quant`` on the V4 model).

Oracles: the Sylvester Hadamard matrix built by Kronecker products; the FP8 / FP4 grids computed here from the
scale rule (power-of-two block scales, ``2^ceil(log2(amax / max))``, checked per block in Python floats); and, in
the model, each attention layer re-run on its own recorded input with the switch off (the exact values), whose
rounding must equal what the switched-on layer handed to the attention kernel and to the indexer's selection.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.model.attention import DSV4Attention
from dsv4.model.fake_quant import fake_quant_v4_index, fake_quant_v4_kv, hadamard
from dsv4.model.indexer import Indexer

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    return h


def _pow2_scale(block: list[float], top: float, floor: float) -> float:
    amax = max(max(abs(v) for v in block), floor)
    return 2.0 ** math.ceil(math.log2(amax / top))


def _on_fp8_grid(x: torch.Tensor, block: int) -> bool:
    """Every block of ``block`` channels of fp32 ``x [N, C]`` is ``e4m3 * 2^ceil(log2(max(amax, 1e-4) / 448))``."""
    for row in x.double().tolist():
        for start in range(0, len(row), block):
            values = row[start:start + block]
            scale = _pow2_scale(values, 448.0, 1e-4)
            q = torch.tensor([v / scale for v in values], dtype=torch.float64)
            if not torch.equal(q.to(torch.float8_e4m3fn).double(), q):
                return False
    return True


def _on_fp4_grid(x: torch.Tensor, block: int) -> bool:
    """Every block of ``block`` channels of ``x [N, C]`` is ``e2m1 * 2^ceil(log2(amax / 6))``."""
    for row in x.double().tolist():
        for start in range(0, len(row), block):
            values = row[start:start + block]
            scale = _pow2_scale(values, 6.0, 6 * 2.0**-126)
            if any(abs(v / scale) not in E2M1 for v in values):
                return False
    return True


def test_hadamard_is_the_orthonormal_sylvester_transform():
    x = torch.randn(3, 5, 32)  # the transform runs in fp32: fp32 rounding of a sum of 32 terms
    expect = (x.double() @ _sylvester(32) / math.sqrt(32)).float()
    torch.testing.assert_close(hadamard(x), expect, rtol=0, atol=1e-5)
    torch.testing.assert_close(hadamard(hadamard(x)), x, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="power of two, got 24"):
        hadamard(torch.zeros(2, 24))


def test_v4_kv_rounds_the_non_rope_channels_to_fp8_in_blocks_of_64_straight_through():
    torch.manual_seed(0)
    nope, rope = 3 * 64, 16
    # blocks of different magnitudes, each with a small second half: a block of 32 gives that half a finer scale
    # (off the block-64 grid), a block of 128 gives the small block a coarser one
    halves = [0.01, 0.0005, 1.0, 0.05, 40.0, 2.0]
    x = torch.randn(6, nope + rope) * torch.tensor([h for h in halves for _ in range(32)] + [1.0] * rope)
    x.requires_grad_(True)
    y = fake_quant_v4_kv(x, rope)
    assert torch.equal(y[:, nope:], x[:, nope:])  # RoPE channels exact
    assert _on_fp8_grid(y[:, :nope].detach(), 64)
    assert not _on_fp8_grid(x[:, :nope].detach(), 64)
    blocks = x.detach()[:, :nope].unflatten(-1, (-1, 64))
    normal = (blocks.abs() >= blocks.abs().amax(-1, keepdim=True) / 16).flatten(-2)  # far from e4m3's subnormals
    err = ((y - x).abs()[:, :nope] / x[:, :nope].abs())[normal]
    assert 0 < err.max() <= 2.0**-4  # e4m3 keeps 3 mantissa bits: round to nearest, half an ulp
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g)  # straight through


def test_v4_index_rotates_then_rounds_to_fp4_in_blocks_of_32_straight_through():
    torch.manual_seed(1)
    # the rotated vector has blocks of different magnitudes with a small second half (a block of 16 leaves the grid)
    rotated = torch.randn(5, 64) * torch.tensor([h for h in (0.1, 0.004, 8.0, 0.3) for _ in range(16)])
    x = hadamard(rotated).requires_grad_(True)
    y = fake_quant_v4_index(x)
    rotated = hadamard(x.detach())
    assert _on_fp4_grid(y.detach(), 32) and not _on_fp4_grid(rotated, 32)
    assert (y.detach() - rotated).abs().max() <= rotated.abs().max() / 6  # within a quarter of the top scale
    g = torch.randn_like(x)
    y.backward(g)
    torch.testing.assert_close(x.grad, hadamard(g), rtol=0, atol=1e-6)  # the rotation's gradient; rounding: identity


@pytest.fixture(scope="module")
def recorded():
    """The tiny V4 (ratios 0, 4, 128, 4; MTP) with ``fake_quant`` on, one forward; each attention layer's kernel
    inputs and indexer inputs, and the same layer re-run with the switch off on the input it got."""
    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny", fake_quant=True)).eval()
    calls, inputs = [], []
    kernel_module = __import__("dsv4.model.attention_backend", fromlist=["attention_kernel"])
    real_kernel, real_select = kernel_module.attention_kernel, Indexer._select

    def kernel(backend, device):
        inner = real_kernel(backend, device)

        def spy(q, kv, *args, **kwargs):
            calls[-1]["kv"], calls[-1]["compressed"] = kv, kwargs.get("compressed")
            return inner(q, kv, *args, **kwargs)
        return spy

    def select(self, q, w, keys, *args):
        calls[-1]["q_index"], calls[-1]["keys"] = q, keys
        return real_select(self, q, w, keys, *args)

    hooks = [m.register_forward_pre_hook(lambda m, args: (inputs.append((m, args)), calls.append({}))[0] and None)
             for m in model.modules() if isinstance(m, DSV4Attention)]
    kernel_module.attention_kernel, Indexer._select = kernel, select
    try:
        with torch.no_grad():
            out = model(torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(2)))
            for h in hooks:
                h.remove()
            on = list(calls)
            calls.clear()
            for module, args in inputs:
                switched = [m for m in module.modules() if isinstance(m, (DSV4Attention, Indexer))]
                for m in switched:
                    m.fake_quant = False
                calls.append({})
                module(*args)
                for m in switched:
                    m.fake_quant = True
            off = list(calls)
    finally:
        kernel_module.attention_kernel, Indexer._select = real_kernel, real_select
    return {"model": model, "on": on, "off": off, "modules": [m for m, _ in inputs], "logits": out.logits}


def test_v4_attention_rounds_window_and_compressed_kv_non_rope_channels(recorded):
    rope = recorded["model"].config.qk_rope_head_dim
    ratios = [m.ratio for m in recorded["modules"]]
    assert sorted(set(ratios)) == [0, 4, 128] and len(ratios) == 5  # 4 layers and the MTP depth
    for on, off, ratio in zip(recorded["on"], recorded["off"], ratios):
        names = ["kv"] + (["compressed"] if ratio else [])
        for name in names:
            got, exact = on[name], off[name]
            assert got.shape == exact.shape and got.shape[1] > 0
            assert torch.equal(got[..., -rope:], exact[..., -rope:]), f"ratio {ratio} {name}: RoPE channels changed"
            assert torch.equal(got, fake_quant_v4_kv(exact, rope)), f"ratio {ratio} {name}: not the V4 rounding"
            assert not torch.equal(got, exact)
            assert _on_fp8_grid(got[0, :, :-rope].float(), 64)


def test_v4_indexer_rounds_its_rotated_queries_and_keys(recorded):
    csa = [(on, off) for on, off, m in zip(recorded["on"], recorded["off"], recorded["modules"]) if m.ratio == 4]
    assert len(csa) == 2
    for on, off in csa:
        for name in ("q_index", "keys"):
            assert torch.equal(on[name], fake_quant_v4_index(off[name])), name
            assert _on_fp4_grid(on[name].reshape(-1, on[name].shape[-1])[:64].float(), 32)


def test_v4_fake_quant_changes_the_logits_and_trains_every_parameter_it_did_without():
    """Off and on from the same weights: the logits move (by the rounding) and the same parameters receive finite,
    non-zero gradients (the rounding passes them through)."""
    torch.manual_seed(3)
    off = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    on = DSV4ForCausalLM(DSV4Config.preset("tiny", fake_quant=True))
    on.load_state_dict(off.state_dict())
    ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(4))
    grads = []
    for model in (off, on):
        out = model(ids, labels=ids.roll(-1, 1))
        out.loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        grads[-1]["logits"] = out.logits.detach()
    assert not torch.equal(grads[0].pop("logits"), grads[1].pop("logits"))
    assert set(grads[0]) == set(grads[1])
    for name, g in grads[1].items():
        assert torch.isfinite(g).all() and (g.abs().sum() > 0) == (grads[0][name].abs().sum() > 0), name
    assert not torch.equal(grads[0]["model.layers.0.self_attn.wkv.weight"],
                           grads[1]["model.layers.0.self_attn.wkv.weight"])


def test_fake_quant_config_refuses_a_non_power_of_two_index_head_dim():
    with pytest.raises(ValueError, match=r"index_head_dim: must be a power of two with fake_quant .* got 48"):
        DSV4Config.preset("tiny", fake_quant=True, index_head_dim=48)
    assert DSV4Config.preset("tiny", index_head_dim=48).fake_quant is False  # only the rotation needs it
