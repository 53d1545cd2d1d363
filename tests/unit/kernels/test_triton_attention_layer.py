"""``model.attention_backend``: a DSV4Attention layer on the Triton kernels (sparse attention and, for CSA, the
indexer) equals the same layer on the torch path (same weights; under the Triton interpreter on CPU tensors, or
compiled on CUDA tensors: ``tests/unit/kernels/device.py``), and the backend choice fails clearly."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dsv4.config import DSV4Config  # noqa: E402
from dsv4.kernels.triton_sparse_attention import triton_sparse_attention  # noqa: E402
from dsv4.model import attention_backend  # noqa: E402
from dsv4.kernels.triton_indexer import triton_indexer_topk  # noqa: E402
from dsv4.model.attention_backend import attention_kernel, indexer_kernel, resolve_attention_backend  # noqa: E402
from dsv4.model.attention_metadata import build_attention_metadata  # noqa: E402
from dsv4.model.sparse_attention import sparse_attention  # noqa: E402
from tests.unit.kernels.device import DEVICE  # noqa: E402  (cpu under the interpreter; cuda: compiled)
from tests.unit.model.test_attention import make_layer  # noqa: E402
from tests.unit.model.test_sparse_attention import packed_meta  # noqa: E402

# tiny dims, short rows: ratios 0 / 4 / 128 need 128-aligned documents, so two documents of 128 and 96 tokens
CONFIG = DSV4Config.preset("tiny", attention_chunk_size=48)


def _layer_run(layer_idx: int, backend: str, x, meta):
    config = dataclasses.replace(CONFIG, attention_backend=backend)
    layer = make_layer(layer_idx, seed=layer_idx, config=config).to(DEVICE)
    xi = x.clone().requires_grad_(True)
    out = layer(xi, meta)
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape))
    grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), xi.grad, grads


@pytest.mark.parametrize("layer_idx", [0, 1, 2])  # window only, CSA (ratio 4), HCA (ratio 128)
def test_layer_on_triton_equals_torch(layer_idx):
    seq, pos = packed_meta([128, 96], 32)  # two documents, then 32 pack-padding tokens
    length = seq.numel()
    torch.manual_seed(1)
    x = torch.randn(1, length, CONFIG.hidden_size).to(DEVICE)
    seq, pos = seq.to(DEVICE), pos.to(DEVICE)
    pad = (seq == 0)[None]
    meta = build_attention_metadata(CONFIG, pos[None], seq[None], pad)
    out_t, dx_t, g_t = _layer_run(layer_idx, "torch", x, meta)
    out_k, dx_k, g_k = _layer_run(layer_idx, "triton", x, meta)
    torch.testing.assert_close(out_k, out_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_k, dx_t, rtol=1e-4, atol=1e-5)
    assert g_k.keys() == g_t.keys() and "sink.logits" in g_k
    for name in g_t:
        torch.testing.assert_close(g_k[name], g_t[name], rtol=1e-4, atol=1e-5, msg=name)


def test_backend_resolution(monkeypatch):
    assert resolve_attention_backend("torch", "cuda") == "torch"
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("auto", "meta") == "torch"
    assert resolve_attention_backend("auto", "cuda") == "triton"  # triton imports here
    assert attention_kernel("auto", torch.device("cpu")) is sparse_attention
    # on CPU tensors under TRITON_INTERPRET=1; on CUDA tensors compiled
    assert attention_kernel("triton", torch.device(DEVICE)) is triton_sparse_attention
    assert indexer_kernel("triton", torch.device(DEVICE)) is triton_indexer_topk  # the CSA layer's indexer too
    assert indexer_kernel("auto", torch.device("cpu")) is None
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "cpu")
    assert resolve_attention_backend("triton", "meta") == "triton"  # the plan traces the kernels' allocations
    monkeypatch.setattr(attention_backend, "triton_importable", lambda: False)
    assert resolve_attention_backend("auto", "cuda") == "torch"
    with pytest.raises(ValueError, match=r"pip install -e '\.\[triton\]'"):
        resolve_attention_backend("triton", "cuda")
    with pytest.raises(ValueError, match="attention_backend"):
        DSV4Config.preset("tiny", attention_backend="flash")


def test_meta_tensors_trace_the_kernels_allocations():
    """On the meta device the Triton path runs no kernel but allocates what it would: the output, the fp32
    log-sum-exp, and in backward the fp32 accumulation buffers."""
    b, length, h, d = 1, 64, 4, 32
    q = torch.empty(b, length, h, d, device="meta", requires_grad=True)
    kv = torch.empty(b, length, d, device="meta", requires_grad=True)
    sink = torch.empty(h, device="meta", requires_grad=True)
    ids = torch.ones(b, length, dtype=torch.long, device="meta")
    out = triton_sparse_attention(q, kv, sink, window=16, query_seq_ids=ids, query_positions=ids, kv_seq_ids=ids)
    assert out.shape == q.shape and out.device.type == "meta"
    out.backward(torch.empty_like(out))
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape and sink.grad.shape == (h,)


def test_indexer_loss_on_triton_equals_torch():
    """With the indexer loss on, a CSA layer on Triton gives the same teacher (from the kernel's log-normaliser),
    so the same indexer loss and indexer gradients, as on the torch path."""
    seq, pos = packed_meta([128, 96], 32)
    torch.manual_seed(1)
    x = torch.randn(1, seq.numel(), CONFIG.hidden_size).to(DEVICE)
    seq, pos = seq.to(DEVICE), pos.to(DEVICE)
    meta = build_attention_metadata(CONFIG, pos[None], seq[None], (seq == 0)[None])
    results = {}
    for backend in ("torch", "triton"):
        config = dataclasses.replace(CONFIG, attention_backend=backend, indexer_loss_coeff=0.5, index_topk=8)
        layer = make_layer(1, seed=1, config=config).to(DEVICE)
        layer(x.clone().requires_grad_(True), meta)
        loss = layer.indexer_loss
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad for n, p in layer.named_parameters() if ".indexer." in n
                                            or n.startswith("indexer.")})
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    assert loss_t > 0 and len(grads_t) == 6
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
    for name, grad in grads_t.items():
        torch.testing.assert_close(grads_k[name], grad, rtol=1e-4, atol=1e-6, msg=name)
