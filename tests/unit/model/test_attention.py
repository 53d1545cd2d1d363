"""DSV4Attention: per-document equivalence of packed rows, padding, gradients, grouped output, CP hook."""

import pytest
import torch


from dsv4.config import DSV4Config
from dsv4.model.attention import DSV4Attention
from dsv4.model.attention_metadata import build_attention_metadata

CONFIG = DSV4Config.preset("tiny", attention_chunk_size=48)  # ratios [0, 4, 128, 4] (+ MTP layer 4: ratio 0)


def make_layer(layer_idx: int, seed: int = 0, config: DSV4Config = CONFIG) -> DSV4Attention:
    torch.manual_seed(seed)
    layer = DSV4Attention(config, layer_idx)
    with torch.no_grad():  # move the zero-initialised parameters off their trivial values
        layer.sink.logits.normal_()
        for name, p in layer.named_parameters():
            if name.endswith("ape"):
                p.normal_()
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return layer


def arange_pos(length: int, batch: int = 1) -> torch.Tensor:
    return torch.arange(length).expand(batch, -1)


def attend(layer, x, pos, seq=None, pad=None, cp=None):
    """The layer on ``x`` with the metadata the model would build for these positions / documents / padding."""
    return layer(x, build_attention_metadata(layer.config, pos, seq, pad, cp), cp)


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_packed_row_equals_each_document_alone(layer_idx):
    """Documents aligned to the shard multiple 128: lengths 128 and 256, then 16 pack-padding tokens."""
    layer = make_layer(layer_idx)
    lengths, tail = [128, 256], 16
    x = torch.randn(1, sum(lengths) + tail, CONFIG.hidden_size)
    seq = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(tail, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(tail, dtype=torch.long)])
    with torch.no_grad():
        packed = attend(layer, x, pos[None], seq[None], None)
        start = 0
        for n in lengths:
            alone = attend(layer, x[:, start : start + n], arange_pos(n), None, None)
            assert torch.allclose(packed[:, start : start + n], alone, atol=1e-5)
            start += n
    assert torch.isfinite(packed).all()


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_in_document_padding_does_not_reach_real_tokens(layer_idx):
    """Doc 1 has 100 real tokens padded to 128 (padding_mask True, id kept); its real outputs equal the doc alone."""
    layer = make_layer(layer_idx, seed=1)
    x = torch.randn(1, 256, CONFIG.hidden_size)
    seq = torch.cat((torch.full((128,), 1), torch.full((128,), 2)))[None]
    pos = torch.cat((torch.arange(128), torch.arange(128)))[None]
    pad = torch.zeros(1, 256, dtype=torch.bool)
    pad[0, 100:128] = True
    with torch.no_grad():
        packed = attend(layer, x, pos, seq, pad)
        alone = attend(layer, x[:, :100], arange_pos(100), None, None)
        second = attend(layer, x[:, 128:], arange_pos(128), None, None)
    assert torch.allclose(packed[:, :100], alone, atol=1e-5)
    assert torch.allclose(packed[:, 128:], second, atol=1e-5)


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_position_shift_invariance(layer_idx):
    """RoPE on q/k and inverse RoPE on the output make the layer depend on relative positions only."""
    layer = make_layer(layer_idx, seed=2)
    x = torch.randn(2, 160, CONFIG.hidden_size)
    with torch.no_grad():
        base = attend(layer, x, arange_pos(160, 2), None, None)
        shifted = attend(layer, x, arange_pos(160, 2) + 256, None, None)  # shift by a multiple of every ratio
    assert torch.allclose(base, shifted, atol=1e-4)


def test_backward_reaches_every_trainable_param_but_not_the_indexer():
    for layer_idx in range(5):
        layer = make_layer(layer_idx)
        x = torch.randn(1, 136, CONFIG.hidden_size, requires_grad=True)
        out = attend(layer, x, arange_pos(136), None, None)
        assert out.shape == x.shape and torch.isfinite(out).all()
        out.square().sum().backward()
        assert torch.isfinite(x.grad).all()
        for name, p in layer.named_parameters():
            if name.startswith("indexer."):
                assert not p.requires_grad and p.grad is None, name
            else:
                assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_short_sequence_keeps_compressor_in_graph():
    """Fewer tokens than one HCA window: the compressor gets zero gradients (not None), as FSDP/DDP expect."""
    layer = make_layer(2)
    x = torch.randn(1, 40, CONFIG.hidden_size, requires_grad=True)
    attend(layer, x, arange_pos(40), None, None).sum().backward()
    assert all(p.grad is not None and torch.all(p.grad == 0) for p in layer.compressor.parameters())


def test_layer_kinds_and_init():
    kinds = []
    for i in range(5):
        layer = DSV4Attention(CONFIG, i)
        kinds.append((layer.ratio, layer.compressor is not None, layer.indexer is not None))
        assert torch.equal(layer.sink.logits, torch.zeros(CONFIG.num_attention_heads))
        assert layer.sink.logits.dtype == torch.float32
        assert layer.wo_a.weight.shape == (CONFIG.o_groups * CONFIG.o_lora_rank,
                                           CONFIG.num_attention_heads * CONFIG.head_dim // CONFIG.o_groups)
    assert kinds == [(0, False, False), (4, True, True), (128, True, False), (4, True, True), (0, False, False)]


def test_grouped_wo_a_is_block_diagonal():
    layer = make_layer(0)
    out = torch.randn(2, 3, CONFIG.num_attention_heads, CONFIG.head_dim)
    g, ol = CONFIG.o_groups, CONFIG.o_lora_rank
    gin = CONFIG.num_attention_heads * CONFIG.head_dim // g
    dense = torch.zeros(g * ol, g * gin)
    for i in range(g):
        dense[i * ol : (i + 1) * ol, i * gin : (i + 1) * gin] = layer.wo_a.weight[i * ol : (i + 1) * ol]
    expected = out.reshape(2, 3, -1) @ dense.T
    assert torch.allclose(layer._grouped_wo_a(out), expected, atol=1e-5)


def test_prebuilt_metadata_and_cp_hook():
    layer = make_layer(1)
    x = torch.randn(1, 64, CONFIG.hidden_size)
    pos, seq = arange_pos(64), torch.ones(1, 64, dtype=torch.long)
    meta = build_attention_metadata(CONFIG, pos, seq, None)
    assert set(meta.windows) == {4, 128} and meta.halo == 0
    with torch.no_grad():
        a = attend(layer, x, pos, seq, None)
        b = layer(x, meta)

    class FakeCP:  # no collective may run: every check below must fire before one
        def __init__(self, size, halo=None):
            self.size, self.rank, self.halo, self.balance = size, 0, halo, "none"
            self.chunks_per_rank, self.num_chunks = 1, size

        def __getattr__(self, name):
            raise AssertionError(f"collective {name} called")

    with torch.no_grad():
        c = attend(layer, x, pos, seq, None, cp=FakeCP(1))
    assert torch.equal(a, b) and torch.equal(a, c)
    # CP bad combinations raise before any collective, with the numbers
    with pytest.raises(ValueError, match=r"`global sequence length`=128 must be a positive multiple of cp x shard "
                                         r"multiple = 2 x 128 = 256"):
        attend(layer, x, pos, seq, None, cp=FakeCP(2))
    x128, pos128, seq128 = torch.randn(1, 128, CONFIG.hidden_size), arange_pos(128), torch.ones(1, 128, dtype=torch.long)
    with pytest.raises(ValueError, match=r"CPContext.halo=3 is smaller than the 15 rows"):
        attend(layer, x128, pos128, seq128, None, cp=FakeCP(2, halo=3))
    with pytest.raises(ValueError, match=r"each local chunk has L=128 tokens but needs a halo of 200 rows"):
        attend(layer, x128, pos128, seq128, None, cp=FakeCP(2, halo=200))


def test_pack_padding_queries_are_finite():
    layer = make_layer(3)
    x = torch.randn(1, 48, CONFIG.hidden_size, requires_grad=True)
    seq = torch.cat((torch.ones(32, dtype=torch.long), torch.zeros(16, dtype=torch.long)))[None]
    pos = torch.cat((torch.arange(32), torch.zeros(16, dtype=torch.long)))[None]
    out = attend(layer, x, pos, seq, seq == 0)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


def test_bfloat16_forward():
    layer = make_layer(1).to(torch.bfloat16)
    x = torch.randn(1, 40, CONFIG.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        out = attend(layer, x, arange_pos(40), None, None)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_misaligned_documents_are_rejected():
    """A document starting off a window boundary would make compressed keys leak future tokens: refuse it."""
    from dsv4.model.attention_metadata import build_attention_metadata

    cfg = DSV4Config.preset("tiny")
    seq = torch.tensor([[1] * 6 + [2] * 10])  # document 2 starts at column 6, not a multiple of 4
    pos = torch.tensor([list(range(6)) + list(range(10))])
    with pytest.raises(ValueError, match="not a multiple of its ratio"):
        build_attention_metadata(cfg, pos, seq)
    # positions that do not start at 0 misplace the windows the same way
    with pytest.raises(ValueError, match="not a multiple of its ratio"):
        build_attention_metadata(cfg, torch.arange(2, 18).unsqueeze(0))
    aligned = torch.tensor([[1] * 8 + [2] * 8])
    build_attention_metadata(cfg, torch.tensor([list(range(8)) * 2]), aligned)
