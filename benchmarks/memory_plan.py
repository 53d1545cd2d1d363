"""The memory plan (``dsv4.plan``) against measurement: predicted vs measured peak memory per rank of a training step.

For each model, CP size and variant, the plan's per-rank total is compared with a real run on gloo ranks (processes
started by ``dsv4.launch``, ``dp = 1``): the model is built and sharded with FSDP2 over the CP ranks (the recipe's
``apply_fsdp``), AdamW is created, one short step allocates the optimizer state (as every step after the first has it),
then a full step (forward, backward, AdamW, ``zero_grad``) runs on one document of ``--seq-len`` tokens cut for the
rank.
Two measurements of that step, each the max over ranks:

* ``measured_rss``: the peak resident set size during model construction and the steps, minus the resident size
  before the model was built (a throw-away model ran first, so one-time imports and allocations are not counted).
  Blocks of 64 KiB and more are ``mmap``-ed (``mallopt(M_MMAP_THRESHOLD)``) so that freed tensors leave the resident
  set instead of lingering in the heap. On CPU the resident set also holds what a GPU keeps in host memory: the
  autograd graph (about 1 KiB per recorded op) and the allocator's small-block heap.
* ``measured_tensors``: the bytes of every tensor storage alive at the step's peak: the parameter shards, buffers
  and optimizer state that exist between steps (summed from the real objects) plus the peak of what the step
  allocates (:class:`dsv4.plan.trace.AllocationTracer` on the real run: real data, collectives, FSDP and AdamW; a
  V4.1 Engram table's rows are state, so the lookup's view of them is not counted again).
  This is what a GPU's memory holds (less the caching allocator's fragmentation).

The plan (``predicted``) is built from the configuration alone: the model on the meta device, stand-ins for CP,
routing and metadata, per-segment traces composed, the state terms from the sharding rules.

Variants: ``none`` / ``block`` / ``selective`` (``model.activation_checkpointing``, chunked loss), ``logits``
(no recompute, the loss through full ``[L, vocab]`` logits held until backward is done), ``lora_fp8`` (no
recompute, LoRA r=8 on every target over the base kept in FP8 / FP4: ``peft=lora peft.base_dtype=fp8``),
``offload`` (no recompute, ``trainer.offload=optimizer``: FSDP2's CPU offload policy),
``adam_bf16`` / ``adam_8bit`` (block recompute, AdamW moments in bf16 / 8 bits: ``optim.state_dtype``; the optimizer
built by the recipe's factory, ``dsv4.training.optimizer.adamw``, and also reported term by term: the plan's
``optimizer`` against the real state's storage bytes), ``chunked`` (block recompute, routed experts in chunks of whole
experts of at most 1024 rows: ``model.moe_chunk_tokens``).

Host offload on CPU: the host is the device, so a measurement cannot tell the two apart; what it validates is the
plan of one shared memory (``MemoryPlan.shared_memory_total``: each phase's device bytes without FSDP's staging
copies, which are the shards themselves here, plus what the host holds in that phase: parameter shards, optimizer
state, the gradients reduced so far); ``memory_plan.predicted_device`` and ``memory_plan.predicted_host`` (the GPU
plan's device total and host term) are printed as well. How the bytes split between a GPU and its host is not
measured.

DeepSeek-V4.1 (``v41_tiny``, ``v41_mid``): the Engram tables row-sharded over the CP ranks (FSDP2's wrap does it) and
frozen, ``model.fake_quant`` on (the presets'), token ids below 256 (Engram hashes through the byte tokenizer).

    python benchmarks/memory_plan.py                                  # tiny and mid, S = 16384, CP 1 2 4
    python benchmarks/memory_plan.py --models tiny --cp 1 2 --seq-len 4096 --variants none
    python benchmarks/memory_plan.py --variants block adam_bf16 adam_8bit --seq-len 4096    # optimizer state dtypes
    python benchmarks/memory_plan.py --models v41_tiny v41_mid --cp 1 2 4 --seq-len 4096 --variants none block   # V4.1
"""

from __future__ import annotations

import argparse
import os

from common import current_rss_kib, emit, peak_rss_kib, reset_peak_rss
from dsv4.launch import run_on_ranks

MODELS: dict[str, dict] = {
    "tiny": {},
    # hidden 512, 8 layers (ratios 0/4/128), 16 experts, vocab 32768: activations dominate at S = 16K
    "mid": dict(hidden_size=512, num_hidden_layers=8, compress_ratios=[0, 4, 128, 4, 128, 4, 128, 4],
                num_attention_heads=8, head_dim=64, qk_rope_head_dim=32, q_lora_rank=128, o_lora_rank=128, o_groups=4,
                n_routed_experts=16, moe_intermediate_size=256, num_experts_per_tok=2, index_head_dim=64,
                index_n_heads=4, index_topk=32, vocab_size=32768, sliding_window=64, attention_chunk_size=256),
    # DeepSeek-V4.1 on CPU (the v41_tiny preset: CSA2 roles, Engram at layers 1 and 4 hashing through the byte
    # tokenizer, fake quantisation on)
    "v41_tiny": {},
    # V4.1 at the mid dims (v41_tiny's 12 layers and CSA2 roles, Full layers 2 / 4 / 6 with 6 the candidate source),
    # window 64, Engram tables of 600,766 and 602,024 rows of 64 (the primes' sums from engram_vocab_size 50000,
    # 4 heads: 294 MiB in fp32, row-sharded over the ranks), fake quantisation on
    "v41_mid": dict(hidden_size=512, num_attention_heads=8, head_dim=64, qk_rope_head_dim=32, q_lora_rank=128,
                    o_lora_rank=128, o_groups=4, n_routed_experts=16, moe_intermediate_size=256, num_experts_per_tok=2,
                    index_head_dim=64, index_n_heads=4, index_topk=32, candidate_topk_blocks=16,
                    candidate_block_size=8, vocab_size=32768, sliding_window=64, attention_chunk_size=256,
                    engram_vocab_size=50000, engram_n_heads=4, engram_head_dim=64,
                    engram_num_embeddings=[600766, 602024]),
}
PRESETS = {"v41_tiny": "v41_tiny", "v41_mid": "v41_tiny"}  # the preset of each model (the others: tiny)
VARIANTS = ("none", "block", "selective", "logits", "lora_fp8", "offload", "adam_bf16", "adam_8bit", "chunked")
CHUNK_TOKENS = 1024  # the chunked variant's model.moe_chunk_tokens (chunks of whole experts, at most this many rows)
# optim.state_dtype of each variant (the others: float32); the adam_* variants recompute blocks, so that the optimizer
# state is a large share of the step
STATE_DTYPES = {"adam_bf16": "bfloat16", "adam_8bit": "8bit"}


def _lora(variant: str):
    from dsv4.peft import LoRAConfig

    return LoRAConfig(base_dtype="fp8") if variant == "lora_fp8" else None


def _adamw(variant: str):
    """The optimizer factory of ``variant``: the recipe's (``dsv4.training.optimizer.adamw``, as
    conf/optim/adamw.yaml) with the variant's ``state_dtype``."""
    from functools import partial

    from dsv4.training.optimizer import adamw

    return partial(adamw, lr=1e-4, betas=[0.9, 0.999], weight_decay=0.01,
                   state_dtype=STATE_DTYPES.get(variant, "float32"))


def model_config(model: str, variant: str):
    from dsv4.config import DSV4Config

    recompute = ("none" if variant in ("logits", "lora_fp8", "offload") else
                 "block" if variant in STATE_DTYPES or variant == "chunked" else variant)
    return DSV4Config.preset(PRESETS.get(model, "tiny"), activation_checkpointing=recompute, **MODELS[model],
                             moe_chunk_tokens=CHUNK_TOKENS if variant == "chunked" else 0)


def predicted_plan(model: str, variant: str, seq_len: int, cp: int):
    from dsv4.plan.plan import PlanSetup, memory_plan
    from dsv4.plan.states import optimizer_profile

    setup = PlanSetup(model_config(model, variant), seq_len, cp=cp, dp=1, ep=1, chunked_loss=variant != "logits",
                      optimizer=optimizer_profile(_adamw(variant)), lora=_lora(variant),
                      offload="optimizer" if variant == "offload" else "none")
    return memory_plan(setup)


def _mmap_large_blocks() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def _build(config, meshes, variant: str):
    import torch

    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm
    from dsv4.parallel.wrap import apply_fsdp
    from dsv4.peft import apply_lora

    torch.manual_seed(0)
    model = build_causal_lm(config)
    if getattr(config, "engram_layer_ids", None):  # V4.1: Engram hashes through the byte tokenizer (227 classes)
        model.set_engram_tokenizer(ByteTokenizer())
    if _lora(variant) is not None:
        apply_lora(model, _lora(variant))
    model = apply_fsdp(model, meshes, offload=variant == "offload")
    return model, _adamw(variant)([p for p in model.parameters() if p.requires_grad])


def _step(model, optimizer, meshes, cp, batch, variant: str) -> None:
    """One training step: forward (the output held until backward is done), backward, AdamW, zero_grad."""
    from dsv4.training.loss import reduce_token_loss

    out = model(batch.input_ids, position_ids=batch.positions, packed_seq_ids=batch.seq_ids,
                padding_mask=batch.padding, labels=batch.labels, cp=cp, return_logits=variant == "logits")
    reduce_token_loss(out.loss_sum, out.label_count, meshes.dp_cp.get_group()).loss.backward()
    del out
    optimizer.step()
    optimizer.zero_grad()


def _document(config, seq_len: int, rank: int, world_size: int):
    import torch

    from dsv4.data import pack_documents

    high = 256 if getattr(config, "engram_layer_ids", None) else config.vocab_size  # V4.1: byte ids, no image token
    ids = torch.randint(0, high, (seq_len,), generator=torch.Generator().manual_seed(1))
    return pack_documents([ids.tolist()], seq_len, config.shard_multiple)[0].cut(rank, world_size,
                                                                                 config.shard_multiple)


def _state_bytes(model, optimizer) -> int:
    """Bytes of the parameter shards, buffers and optimizer state that exist between steps."""
    from torch.distributed.tensor import DTensor

    def nbytes(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.untyped_storage().nbytes()

    from dsv4.training.optimizer import optimizer_state_bytes

    # the optimizer state through its real storage (torchao's 8-bit moments are tensor subclasses)
    return sum(nbytes(t) for t in (*model.parameters(), *model.buffers())) + optimizer_state_bytes(optimizer)


def _rank_body(rank: int, world_size: int, model_name: str, variant: str, seq_len: int) -> tuple[float, float, float]:
    """``(resident-set peak MiB, tensor peak MiB, optimizer state MiB)`` of this rank: see the module docstring."""
    import ctypes
    import gc

    import torch

    from torch.distributed.tensor import DTensor

    from dsv4.parallel.cp import CPContext
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.plan.states import table_tensors
    from dsv4.plan.trace import AllocationTracer

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: blocks of 64 KiB and more are mmap-ed, unmapped when freed
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, 2 // world_size)))
    config = model_config(model_name, variant)
    meshes = build_meshes(ParallelDims(world_size=world_size, cp=world_size), "cpu")
    cp = CPContext(meshes.cp.get_group()) if world_size > 1 else None
    # the short step's rows: two shard multiples per rank, at least the sliding window (a CP halo comes from one rank)
    unit = config.shard_multiple * -(-config.sliding_window // config.shard_multiple)
    short = _document(config, unit * world_size * 2, rank, world_size)
    batch = _document(config, seq_len, rank, world_size)
    # a throw-away model first: what the first step imports and allocates once (autograd engine, FSDP hooks, ...)
    _step(*_build(config, meshes, variant), meshes, cp, short, variant)
    gc.collect()
    libc.malloc_trim(0)
    base = current_rss_kib()
    reset_peak_rss()
    model, optimizer = _build(config, meshes, variant)
    _step(model, optimizer, meshes, cp, short, variant)  # allocates the optimizer state, as every later step has it
    _step(model, optimizer, meshes, cp, batch, variant)
    rss = max(peak_rss_kib() - base, 0) / 1024
    # V4.1's Engram tables are in the state bytes; their lookup's view of the rank's rows is not a new tensor
    tables = [t.to_local() if isinstance(t, DTensor) else t for t in table_tensors(model)]
    with AllocationTracer(untracked=tables) as tracer:
        _step(model, optimizer, meshes, cp, batch, variant)
    from dsv4.training.optimizer import optimizer_state_bytes

    return rss, (_state_bytes(model, optimizer) + tracer.peak) / 2**20, optimizer_state_bytes(optimizer) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["tiny", "mid"], choices=list(MODELS))
    parser.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--variants", nargs="*", default=["none", "block", "logits"], choices=VARIANTS)
    args = parser.parse_args()
    for model in args.models:
        for variant in args.variants:
            for cp in args.cp:
                plan = predicted_plan(model, variant, args.seq_len, cp)
                device, host = plan.total, plan.host_offload_bytes
                predicted = plan.shared_memory_total / 2**20  # host and device one memory: total unless offloaded
                per_rank = run_on_ranks(_rank_body, cp, args=(model, variant, args.seq_len), timeout=7200)
                rss, tensors = max(r[0] for r in per_rank), max(r[1] for r in per_rank)
                shape = {"model": model, "seq_len": args.seq_len, "cp": cp, "tokens_per_rank": args.seq_len // cp,
                         "variant": variant, "step": "forward+backward+AdamW", "dtype": "float32",
                         "optim_state_dtype": STATE_DTYPES.get(variant, "float32")}
                emit("memory_plan.predicted", shape, round(predicted, 1), "MiB")
                if variant == "offload":
                    emit("memory_plan.predicted_device", shape, round(device / 2**20, 1), "MiB")
                    emit("memory_plan.predicted_host", shape, round(host / 2**20, 1), "MiB")
                emit("memory_plan.measured_tensors", shape, round(tensors, 1), "MiB")
                emit("memory_plan.measured_rss", shape, round(rss, 1), "MiB")
                emit("memory_plan.tensors_over_predicted", shape, round(tensors / predicted, 3), "ratio")
                emit("memory_plan.rss_over_predicted", shape, round(rss / predicted, 3), "ratio")
                if variant in STATE_DTYPES:  # the optimizer term alone: rank 0 holds the largest shards
                    emit("memory_plan.optimizer_predicted", shape, round(plan.per_rank_bytes["optimizer"] / 2**20, 3),
                         "MiB")
                    emit("memory_plan.optimizer_measured", shape, round(max(r[2] for r in per_rank), 3), "MiB")


if __name__ == "__main__":
    main()
