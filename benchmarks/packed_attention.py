"""Packed rows cost what their documents cost: one attention layer (indexer + attention) on a row of many documents
against the same documents run one by one.

A row of ``--docs`` documents of ``--doc-len`` tokens (32K = 64 x 512 by default, packed back to back on the
shard multiple) runs one forward + backward of a ``DSV4Attention`` layer (the CPU benchmark's layer: hidden 256,
4 heads x 64, window 128, indexer top-k 64); the reference runs each document alone through the same layer and
sums the times. ``packed_attention.packed_over_documents`` = packed time / summed time: 1.0 is the work of the
documents themselves (the bound: a packed row holds exactly those tokens), above it is work spent on other
documents' keys. CSA (ratio 4: indexer scoring + top-k + attention) and HCA (ratio 128). fp32, torch backend,
medians of ``--repeats`` after one warm-up.

    python benchmarks/packed_attention.py                            # 64 x 512, ratios 4 and 128
    python benchmarks/packed_attention.py --docs 8 --doc-len 256 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attention_cpu import layer_config
from common import emit
from dsv4.model.attention import DSV4Attention
from dsv4.model.attention_metadata import build_attention_metadata


def _seconds(layer: DSV4Attention, x: torch.Tensor, meta) -> float:
    xi = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    layer(xi, meta).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--ratios", type=int, nargs="*", default=[4, 128])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for ratio in args.ratios:
        config = layer_config(ratio)
        if args.doc_len % config.shard_multiple:
            raise ValueError(f"--doc-len {args.doc_len} must be a multiple of the shard multiple {config.shard_multiple}")
        torch.manual_seed(0)
        layer = DSV4Attention(config, 0)
        length = args.docs * args.doc_len
        x = torch.randn(1, length, config.hidden_size, generator=torch.Generator().manual_seed(1))
        seq = torch.arange(1, args.docs + 1).repeat_interleave(args.doc_len)[None]
        pos = torch.arange(args.doc_len).repeat(args.docs)[None]
        packed_meta = build_attention_metadata(config, pos, seq)
        doc_meta = build_attention_metadata(config, torch.arange(args.doc_len)[None], torch.ones(1, args.doc_len,
                                                                                               dtype=torch.long))
        docs = [x[:, i * args.doc_len:(i + 1) * args.doc_len] for i in range(args.docs)]
        packed, alone = [], []
        for i in range(args.repeats + 1):
            p = _seconds(layer, x, packed_meta)
            a = sum(_seconds(layer, d, doc_meta) for d in docs)
            if i:  # the first is a warm-up
                packed.append(p)
                alone.append(a)
        shape = {"ratio": ratio, "docs": args.docs, "doc_len": args.doc_len, "tokens": length,
                 "step": "forward+backward", "threads": torch.get_num_threads()}
        emit("packed_attention.packed_s", shape, round(statistics.median(packed), 4), "s")
        emit("packed_attention.documents_s", shape, round(statistics.median(alone), 4), "s")
        emit("packed_attention.packed_over_documents", shape,
             round(statistics.median(packed) / statistics.median(alone), 3), "ratio")


if __name__ == "__main__":
    main()
