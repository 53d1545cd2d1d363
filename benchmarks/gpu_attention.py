"""The sparse attention core at V4 Flash dims on one GPU: forward and backward time per backend, achieved TFLOP/s.

Flash dims: 64 query heads sharing one K = V head of 512, window 128; CSA (ratio 4, indexer top-k 512: random
causal picks of the query's document, 3 % of them -1) and HCA (ratio 128, every causal compressed row); one
document of S tokens; bf16 inputs. Backends: ``torch`` (``dsv4.model.sparse_attention``, chunked, recomputing each
chunk in backward) and ``triton`` (``dsv4.kernels``; where Triton imports). FLOPs are the model's
(``dsv4.flops.attention_core_flops_per_token``: ``4 H D`` per allowed key, window and compressed; backward counted
as twice the forward), so TFLOP/s is useful work, not executed work. Times are medians of ``--repeats`` after a
warm-up, with the device synchronised.

    python benchmarks/gpu_attention.py                           # S = 8K 32K 64K, ratios 4 and 128
    python benchmarks/gpu_attention.py --smoke                   # tiny shapes on the CPU (what the test suite runs)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import emit
from dsv4.config import DSV4Config
from dsv4.flops import attention_core_flops_per_token
from dsv4.model.compressor import window_metadata
from dsv4.model.sparse_attention import sparse_attention


def _backends() -> dict:
    backends = {"torch": sparse_attention}
    try:
        from dsv4.kernels.triton_sparse_attention import triton_sparse_attention
    except ImportError:
        return backends
    backends["triton"] = triton_sparse_attention
    return backends


def make_inputs(config: DSV4Config, seq_len: int, ratio: int, dtype: torch.dtype, device: str) -> dict:
    """Random queries, K = V rows, compressed rows and (CSA) top-k picks for one document of ``seq_len``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    h, d = config.num_attention_heads, config.head_dim
    seq = torch.ones(1, seq_len, dtype=torch.long)
    pos = torch.arange(seq_len)[None]
    args = dict(q=torch.randn(1, seq_len, h, d, generator=g), kv=torch.randn(1, seq_len, d, generator=g),
                sink=torch.zeros(h), window=config.sliding_window, query_seq_ids=seq, query_positions=pos,
                kv_seq_ids=seq)
    comp_seq, comp_pos = window_metadata(seq, pos, ratio)
    p = comp_seq.shape[1]
    args.update(compressed=torch.randn(1, p, d, generator=g), compressed_seq_ids=comp_seq,
                compressed_positions=comp_pos, ratio=ratio)
    if ratio == 4:
        k = config.index_topk
        visible = torch.div(pos[0] + 1, ratio, rounding_mode="floor").clamp(min=1)  # causal windows per query
        picks = (torch.rand(seq_len, k, generator=g) * visible[:, None]).long()
        picks[torch.rand(seq_len, k, generator=g) < 0.03] = -1
        args["topk_indices"] = picks[None]
    out = {}
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device)
            if value.is_floating_point() and name != "sink":
                value = value.to(dtype)
        out[name] = value
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_backend(fn, inputs: dict, repeats: int, device: str) -> tuple[float, float]:
    """Median forward and backward seconds."""
    fwd, bwd = [], []
    extra = {}
    if fn is sparse_attention:  # as DSV4Attention calls it: one document, every compressed row is this block's
        extra["compressed_local_rows"] = inputs["compressed"].shape[1]
    for i in range(repeats + 1):
        leaves = {k: (v.detach().requires_grad_(True) if k in ("q", "kv", "sink", "compressed") else v)
                  for k, v in inputs.items()} | extra
        _sync(device)
        start = time.perf_counter()
        out = fn(**leaves)
        _sync(device)
        mid = time.perf_counter()
        out.backward(torch.ones_like(out))
        _sync(device)
        if i:
            fwd.append(mid - start)
            bwd.append(time.perf_counter() - mid)
    return statistics.median(fwd), statistics.median(bwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[8192, 32768, 65536])
    parser.add_argument("--ratios", type=int, nargs="*", default=[4, 128])
    parser.add_argument("--backends", nargs="*", default=None, help="default: every importable one")
    parser.add_argument("--torch-max-seq", type=int, default=32768, help="the torch path is skipped above this S")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny dims on the CPU, fp32, torch backend")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        config = DSV4Config.preset("tiny")
        seq_lens, dtype, repeats, names = [256], torch.float32, 1, args.backends or ["torch"]
    else:
        config = DSV4Config.preset("flash")
        seq_lens, dtype, repeats, names = args.seq_lens, torch.bfloat16, args.repeats, args.backends
    available = _backends()
    names = names or list(available)
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(f"--backends {missing}: not importable here (available: {sorted(available)})")
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    for ratio in args.ratios:
        for seq_len in seq_lens:
            inputs = make_inputs(config, seq_len, ratio, dtype, device)
            flops = attention_core_flops_per_token(config, seq_len, ratio) * seq_len
            times = {}
            for name in names:
                if name == "torch" and seq_len > args.torch_max_seq:
                    continue
                times[name] = time_backend(available[name], inputs, repeats, device)
                shape = {"backend": name, "ratio": ratio, "seq_len": seq_len, "heads": config.num_attention_heads,
                         "head_dim": config.head_dim, "window": config.sliding_window,
                         "topk": config.index_topk if ratio == 4 else None, "dtype": str(dtype).removeprefix("torch."),
                         "device": gpu}
                t_fwd, t_bwd = times[name]
                emit("gpu_attention.forward_ms", shape, round(t_fwd * 1e3, 3), "ms")
                emit("gpu_attention.backward_ms", shape, round(t_bwd * 1e3, 3), "ms")
                emit("gpu_attention.forward_tflops", shape, float(f"{flops / t_fwd / 1e12:.4g}"), "TFLOP/s")
                emit("gpu_attention.backward_tflops", shape, float(f"{2 * flops / t_bwd / 1e12:.4g}"), "TFLOP/s")
            if "torch" in times:
                for name, (t_fwd, t_bwd) in times.items():
                    if name != "torch":
                        shape = {"backend": name, "ratio": ratio, "seq_len": seq_len, "device": gpu}
                        emit("gpu_attention.speedup_over_torch", shape,
                             round(sum(times["torch"]) / (t_fwd + t_bwd), 2), "x")


if __name__ == "__main__":
    main()
