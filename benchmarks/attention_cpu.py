"""One attention layer, forward + backward in fp32 on the CPU: our torch reference kernel against the dense eager path.

The dense eager path is what a framework without a sparse kernel runs (the DSV4 reference's non-TileLang path):
scores ``[B, H, S, S + P]`` against every raw and compressed key, a dense boolean mask of the same rules (window
band, documents, causal compressed rows, the CSA top-k as a mask), the sink as an extra column, fp32 softmax. Both
paths share the layer's projections, compressor and indexer (the same ``DSV4Attention`` with the same weights):
only the attention core differs, and the dense core's output is checked against ours before timing.

Layer: hidden 256, 4 heads x 64, window 128, indexer top-k 64 (CSA, ratio 4); also HCA (ratio 128) and the
window alone (ratio 0). Time: the median of ``--repeats`` forward + backward steps after one warm-up.

    python benchmarks/attention_cpu.py                       # S = 1024 4096 8192
    python benchmarks/attention_cpu.py --seq-lens 256 --ratios 4 --repeats 1     # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from common import emit
from dsv4.config import DSV4Config
from dsv4.model import attention_backend as attention_module
from dsv4.model.attention import DSV4Attention
from dsv4.model.attention_metadata import build_attention_metadata


def dense_eager_attention(q, kv, sink, *, window, query_seq_ids, query_positions, kv_seq_ids, kv_padding=None,
                          query_offset=None, compressed=None, compressed_seq_ids=None, compressed_positions=None,
                          ratio=0, topk_indices=None, chunk_size=None, scale=None, checkpoint=None,
                          compressed_local_rows=None, key_floors=None):
    """``sparse_attention``'s contract through full ``[B, H, L, L_kv + P]`` scores and a dense mask (the sparse
    kernels' tuning, ``chunk_size`` / ``compressed_local_rows`` / ``key_floors``, is accepted and unused: the dense
    path scores every key)."""
    b, length, h, d = q.shape
    l_kv = kv.shape[1]
    offset = l_kv - length if query_offset is None else query_offset
    q_rows = offset + torch.arange(length)[:, None]
    k_rows = torch.arange(l_kv)[None, :]
    q_seq = query_seq_ids[:, :, None]
    allowed = ((k_rows <= q_rows) & (q_rows - k_rows < window))[None] & (kv_seq_ids[:, None, :] == q_seq) & (q_seq > 0)
    if kv_padding is not None:
        allowed &= ~kv_padding[:, None, :]
    keys = kv
    if compressed is not None:
        limit = torch.div(query_positions + 1, ratio, rounding_mode="floor")[:, :, None]
        rule = (q_seq > 0) & (compressed_seq_ids[:, None, :] == q_seq) & (compressed_positions[:, None, :] < limit)
        if topk_indices is not None:
            picked = torch.zeros(b, length, compressed.shape[1] + 1, dtype=torch.bool)
            picked.scatter_(2, torch.where(topk_indices < 0, compressed.shape[1], topk_indices), True)
            rule &= picked[..., :-1]
        allowed = torch.cat((allowed, rule), dim=-1)
        keys = torch.cat((kv, compressed), dim=1)
    scale = d**-0.5 if scale is None else scale
    scores = torch.einsum("blhd,bkd->bhlk", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    scores = torch.cat((scores, sink.float().view(1, h, 1, 1).expand(b, h, length, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :-1]
    return torch.einsum("bhlk,bkd->blhd", probs, keys.float()).to(q.dtype)


def dense_core():
    """Within it, every DSV4Attention layer runs :func:`dense_eager_attention` as its attention core."""
    return mock.patch.object(attention_module, "attention_kernel", lambda backend, device: dense_eager_attention)


def layer_config(ratio: int) -> DSV4Config:
    return DSV4Config.preset("tiny", hidden_size=256, num_attention_heads=4, head_dim=64, qk_rope_head_dim=32,
                             sliding_window=128, index_topk=64, compress_ratios=[ratio], num_hidden_layers=1,
                             attention_chunk_size=256, attention_backend="torch")


def step_seconds(layer, x, meta, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        start = time.perf_counter()
        layer(xi, meta).sum().backward()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[1024, 4096, 8192])
    parser.add_argument("--ratios", type=int, nargs="*", default=[4, 128, 0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    for ratio in args.ratios:
        config = layer_config(ratio)
        layer = DSV4Attention(config, 0)
        for seq_len in args.seq_lens:
            x = torch.randn(1, seq_len, config.hidden_size)
            positions = torch.arange(seq_len)[None]
            meta = build_attention_metadata(config, positions, None, None)
            with torch.no_grad():
                ours = layer(x, meta)
                with dense_core():
                    dense = layer(x, meta)
            torch.testing.assert_close(ours, dense, rtol=1e-4, atol=1e-5)
            shape = {"layer": {0: "window", 4: "csa"}.get(ratio, "hca"), "ratio": ratio, "seq_len": seq_len,
                     "hidden": 256, "heads": 4, "head_dim": 64, "window": 128, "topk": 64, "dtype": "float32",
                     "step": "forward+backward", "threads": torch.get_num_threads()}
            t_ours = step_seconds(layer, x, meta, args.repeats)
            with dense_core():
                t_dense = step_seconds(layer, x, meta, args.repeats)
            emit("attention_cpu.torch_reference", shape, round(t_ours * 1e3, 2), "ms")
            emit("attention_cpu.dense_eager", shape, round(t_dense * 1e3, 2), "ms")
            emit("attention_cpu.speedup_over_dense", shape, round(t_dense / t_ours, 2), "x")


if __name__ == "__main__":
    main()
