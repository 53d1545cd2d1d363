"""Model step benchmark: tiny-model forward+backward speed and memory, per-layer-type tensor sizes, Flash sizes.

Prints one JSON object per line and measurement (keys ``name``, ``shape``, ``value``, ``unit``):

* ``model_step.tiny.fwd_bwd.throughput`` (tokens/s) and ``.peak_rss_delta`` (MiB) of the tiny preset at
  S = 4096 and 16384 (batch 1, fp32, CPU, labels on every token, MTP on).
* ``model_step.tiny.attn_max_numel.r{0,4,128}``: the largest tensor (elements) any aten op produced inside the
  attention modules of each compress ratio during one forward+backward at S = 4096.
* ``model_step.flash.params.total`` / ``.active``: parameter counts of the Flash preset built on the meta device
  (active = non-expert + ``num_experts_per_tok`` routed experts per MoE layer, MTP included).

Memory method: every sequence length runs in a fresh child process (``--child S``). The child builds the model
and inputs, reads its current resident set size (``/proc/self/statm``), runs one forward+backward and reports
``ru_maxrss`` (peak RSS, from ``resource.getrusage``) minus that baseline: the peak extra host memory of a step
(activations, gradients, allocator slack), not the parameters. ``tracemalloc`` would miss torch's C++ allocations
and the CPU has no allocator statistics, so the OS peak is the honest number. Throughput is the median of
``--repeats`` timed steps after that first (warm-up) step.

Tensor sizes: a ``TorchDispatchMode`` records each op's output numel into the scope of the attention module that
is running (forward hooks; backward pre/post hooks for the backward pass). Backward ops that autograd schedules
outside the module's backward window are attributed to no scope, so this is a lower bound for the backward part.

    python benchmarks/model_step.py            # S = 4096 and 16384
    python benchmarks/model_step.py --quick    # S = 4096 only
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

try:
    import dsv4  # noqa: F401
except ImportError:  # run as a plain script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import current_rss_kib, emit, peak_rss_kib, reset_peak_rss  # noqa: E402  (benchmarks/common.py)
from dsv4.config import DSV4Config  # noqa: E402
from dsv4.model import DSV4ForCausalLM, parameter_counts  # noqa: E402
from dsv4.model.attention import DSV4Attention  # noqa: E402


def _batch(cfg: DSV4Config, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return ids, labels


def _step(model: DSV4ForCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(ids, labels=labels).loss.backward()


def child(seq_len: int, repeats: int) -> None:
    """One sequence length in this (fresh) process: peak RSS delta of the first step, then timed steps."""
    cfg = DSV4Config.preset("tiny")
    torch.manual_seed(0)
    model = DSV4ForCausalLM(cfg).train()
    ids, labels = _batch(cfg, seq_len)
    shape = {"preset": "tiny", "batch": 1, "seq_len": seq_len, "threads": torch.get_num_threads()}

    base = current_rss_kib()
    reset_peak_rss()
    _step(model, ids, labels)
    peak = peak_rss_kib()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(model, ids, labels)
        times.append(time.perf_counter() - start)
    emit("model_step.tiny.fwd_bwd.throughput", shape, round(seq_len / statistics.median(times), 1), "tokens/s")
    emit("model_step.tiny.fwd_bwd.peak_rss_delta", shape, round(max(peak - base, 0) / 1024, 1), "MiB")


class ScopedNumelRecorder(TorchDispatchMode):
    """Max output numel per scope; the scope is set by module hooks (``None`` = outside any scope)."""

    def __init__(self) -> None:
        super().__init__()
        self.scope: list[str] = []
        self.max_numel: dict[str, tuple[int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.scope:
            key = self.scope[-1]
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.numel() > self.max_numel.get(key, (0, ""))[0]:
                    self.max_numel[key] = (t.numel(), f"{func} -> {tuple(t.shape)}")
        return out


def attention_tensor_sizes(seq_len: int) -> None:
    cfg = DSV4Config.preset("tiny")
    torch.manual_seed(0)
    model = DSV4ForCausalLM(cfg).train()
    ids, labels = _batch(cfg, seq_len)
    rec = ScopedNumelRecorder()

    def enter(key: str):
        def hook(*_) -> None:  # hooks must return None (a value would replace the module's output)
            rec.scope.append(key)

        return hook

    def leave(*_) -> None:
        rec.scope.pop()

    for module in model.modules():
        if isinstance(module, DSV4Attention):
            module.register_forward_pre_hook(enter(f"r{module.ratio}"))
            module.register_forward_hook(leave)
            module.register_full_backward_pre_hook(enter(f"r{module.ratio}"))
            module.register_full_backward_hook(leave)
    with rec:
        _step(model, ids, labels)
    for key in sorted(rec.max_numel, key=lambda k: int(k[1:])):
        numel, op = rec.max_numel[key]
        shape = {"preset": "tiny", "batch": 1, "seq_len": seq_len, "sliding_window": cfg.sliding_window,
                 "index_topk": cfg.index_topk, "largest_op": op}
        emit(f"model_step.tiny.attn_max_numel.{key}", shape, numel, "elements")


def flash_params() -> None:
    cfg = DSV4Config.preset("flash")
    with torch.device("meta"):
        model = DSV4ForCausalLM(cfg)
    counts = parameter_counts(model)
    shape = {"preset": "flash", "layers": cfg.num_hidden_layers, "mtp": cfg.num_nextn_predict_layers,
             "experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok}
    emit("model_step.flash.params.total", shape, counts["total"], "parameters")
    emit("model_step.flash.params.active", shape, counts["active"], "parameters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only S = 4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child is not None:
        child(args.child, args.repeats)
        return

    for seq_len in (4096,) if args.quick else (4096, 16384):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(seq_len), "--repeats", str(args.repeats)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        subprocess.run(cmd, check=True)
    attention_tensor_sizes(4096)
    flash_params()


if __name__ == "__main__":
    main()
