"""Training throughput of a V4 Flash slice on one GPU: tokens/s, model TFLOP/s and MFU.

The slice: V4 Flash's dims (hidden 4096, 64 heads x 512, window 128, top-k 512, vocab 129,280) with
``--layers`` blocks (ratios 4 and 128 alternating; the first is a hash layer) and ``--experts`` routed experts, the
MTP layer and the chunked loss. It trains as the recipe does on one rank: FSDP2 with bf16 compute and fp32 master
weights / AdamW state (``dsv4.parallel.wrap.apply_fsdp``), block recompute, one packed document of ``--seq-len``
tokens per step. Time: the median step (forward, backward, AdamW) after ``--warmup`` steps, the device
synchronised. FLOPs: ``dsv4.flops.training_flops_per_token`` (sparse attention counted by allowed keys, MoE by
the active experts; backward = 2 x forward, recompute not counted), so MFU is model FLOPs over the device's bf16
dense peak (``dsv4.flops.peak_flops_per_device``).

    python benchmarks/gpu_train.py                              # 2 layers, 32 experts, S = 32768
    python benchmarks/gpu_train.py --layers 4 --seq-len 16384
    python benchmarks/gpu_train.py --smoke                      # the tiny model on the CPU (what the tests run)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from common import emit
from dsv4.config import DSV4Config
from dsv4.data import pack_documents
from dsv4.flops import peak_flops_per_device, training_flops_per_token
from dsv4.model import DSV4ForCausalLM
from dsv4.parallel.mesh import ParallelDims, build_meshes
from dsv4.parallel.wrap import apply_fsdp
from dsv4.training.loss import reduce_token_loss
from dsv4.training.step import forward_outputs


def slice_config(layers: int, experts: int) -> DSV4Config:
    ratios = [4 if i % 2 == 0 else 128 for i in range(layers)]
    return DSV4Config.preset("flash", num_hidden_layers=layers, compress_ratios=ratios, n_routed_experts=experts,
                             num_hash_layers=1, activation_checkpointing="block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="the tiny model on the CPU in fp32, 3 short steps")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        raise ValueError(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        config, seq_len, compute, steps, warmup = DSV4Config.preset("tiny"), 256, torch.float32, 3, 1
    else:
        config, seq_len, compute = slice_config(args.layers, args.experts), args.seq_len, torch.bfloat16
        steps, warmup = args.steps, args.warmup

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.FileStore(f"{tmp}/store", 1),
                                rank=0, world_size=1)
        try:
            meshes = build_meshes(ParallelDims(world_size=1), device)
            torch.manual_seed(0)
            with torch.device(device):
                model = apply_fsdp(DSV4ForCausalLM(config), meshes, compute_dtype=compute)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
            ids = torch.randint(0, config.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(1))
            batch = pack_documents([ids.tolist()], seq_len, config.shard_multiple)[0].to(device)
            times = []
            for step in range(steps):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = forward_outputs(model, batch)
                loss_sum, count = out.loss_sum, out.label_count
                reduce_token_loss(loss_sum, count, meshes.dp_cp.get_group()).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                if step >= warmup:
                    times.append(time.perf_counter() - start)
            peak_memory = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        finally:
            dist.destroy_process_group()

    step_s = statistics.median(times)
    tokens_per_s = seq_len / step_s
    tflops = training_flops_per_token(config, seq_len) * tokens_per_s / 1e12
    peak = peak_flops_per_device() if device == "cuda" else None
    shape = {"model": "tiny" if args.smoke else "flash-slice", "layers": config.num_hidden_layers,
             "experts": config.n_routed_experts, "seq_len": seq_len, "compute": str(compute).removeprefix("torch."),
             "recompute": config.activation_checkpointing, "steps_measured": len(times),
             "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    emit("gpu_train.step_s", shape, round(step_s, 4), "s")
    emit("gpu_train.tokens_per_s", shape, round(tokens_per_s, 1), "tokens/s")
    emit("gpu_train.model_tflops", shape, float(f"{tflops:.4g}"), "TFLOP/s")
    if peak is not None:
        emit("gpu_train.mfu", {**shape, "peak_tflops": peak / 1e12}, round(tflops * 1e12 / peak, 4), "fraction")
    if peak_memory is not None:
        emit("gpu_train.peak_memory", shape, round(peak_memory, 2), "GiB")


if __name__ == "__main__":
    main()
