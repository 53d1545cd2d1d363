"""LoRA on a kept FP8 / FP4 base: resident bytes, what a re-quantised merge loses, and the step cost on the CPU.

* ``lora.kept_base_bytes``: resident bytes of the kept base tensors (FP8 weights, FP4 experts, e8m0 scales) of the
  model loaded from the quantised checkpoint, against the checkpoint's bytes for those tensors (the bound: the
  release's own encoding) and against the same tensors dequantised to bf16;
* ``lora.requantized_merge``: after ``--steps`` AdamW steps at each ``--lrs`` on one batch, the fraction of the
  adapters' update (relative L2 over the FP8 / FP4 weights) that re-quantising the merged weights rounds away
  (:func:`dsv4.peft.apply.requantization_loss`; above 1.0 when a tile's scale moves and re-rounds weights the
  update did not touch), and the logits: ``max |merged_q - adapter| / max |adapter - base|``
  (1.0 = the quantised merge is as far from the trained model as the untrained base is);
* ``lora.step``: forward + backward tokens/s of the tiny model at ``--seq-len``: full fine-tune, LoRA on a bf16
  base, LoRA on the kept FP8 / FP4 base (dequantised per layer in forward and again in backward).

    python benchmarks/lora.py                 # tiny preset, S = 1024
    python benchmarks/lora.py --quick         # one lr, fewer steps (the test suite's smoke run)
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from common import emit
from dsv4.checkpoint import CheckpointDir, export_hf_checkpoint, load_hf_checkpoint
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.peft import LoRAConfig, apply_lora, merged_tensors
from dsv4.peft.apply import requantization_loss

QUANTIZED = (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu)


def _batch(seq_len: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (1, seq_len), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return ids, labels


def _lora_model(ckpt: str, config: DSV4Config, base_dtype: str) -> DSV4ForCausalLM:
    model = DSV4ForCausalLM(config)
    apply_lora(model, LoRAConfig(base_dtype=base_dtype))
    load_hf_checkpoint(model, ckpt)
    return model


def kept_bytes(ckpt: str, config: DSV4Config) -> None:
    model = _lora_model(ckpt, config, "fp8")
    resident = sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype in QUANTIZED)
    on_disk = sum(t.nbytes for t in CheckpointDir.open(ckpt).tensors.values() if t.dtype in ("F8_E4M3", "I8", "F8_E8M0"))
    weights = [b for b in model.buffers() if b.dtype in (torch.float8_e4m3fn, torch.int8)]
    as_bf16 = sum(b.numel() * (4 if b.dtype == torch.int8 else 2) for b in weights)  # FP4 packs two a byte
    shape = {"model": "tiny", "tensors": len(weights)}
    emit("lora.kept_base_bytes.vs_checkpoint", shape, round(resident / on_disk, 4), "ratio")
    emit("lora.kept_base_bytes.vs_bf16", shape, round(resident / as_bf16, 4), "ratio")


def requantized_merge(ckpt: str, config: DSV4Config, lrs: list[float], steps: int, seq_len: int) -> None:
    ids, labels = _batch(seq_len)
    base = DSV4ForCausalLM(config)
    load_hf_checkpoint(base, ckpt)
    with torch.no_grad():
        base_logits = base(ids).logits
    for lr in lrs:
        torch.manual_seed(0)
        model = _lora_model(ckpt, config, "fp8")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        for _ in range(steps):
            optimizer.zero_grad()
            model(ids, labels=labels).loss.backward()
            optimizer.step()
        lost = requantization_loss(model)
        with tempfile.TemporaryDirectory() as out:
            export_hf_checkpoint(model, out, dtype="quantized", tensors=merged_tensors(model))
            merged = DSV4ForCausalLM(config)
            load_hf_checkpoint(merged, out)
        with torch.no_grad():
            adapted = model(ids).logits
            logit_ratio = ((merged(ids).logits - adapted).abs().max() / (adapted - base_logits).abs().max()).item()
        shape = {"model": "tiny", "lr": lr, "steps": steps, "seq_len": seq_len, "rank": 8, "alpha": 16}
        emit("lora.requantized_merge.update_lost", shape, round(lost, 4), "fraction")
        emit("lora.requantized_merge.logit_error_vs_update", shape, round(logit_ratio, 4), "ratio")


def step_speed(ckpt: str, config: DSV4Config, seq_len: int, repeats: int) -> None:
    ids, labels = _batch(seq_len)
    plain = DSV4ForCausalLM(config)
    load_hf_checkpoint(plain, ckpt)
    variants = {"full": plain, "lora_bf16": _lora_model(ckpt, config, "bf16"),
                "lora_fp8": _lora_model(ckpt, config, "fp8")}
    for name, model in variants.items():
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            model(ids, labels=labels).loss.backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        median = sorted(times[1:])[len(times[1:]) // 2]
        emit("lora.step.tokens_per_s", {"model": "tiny", "variant": name, "seq_len": seq_len, "threads":
                                        torch.get_num_threads()}, round(seq_len / median, 1), "tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lrs", type=float, nargs="*", default=[1e-4, 1e-3, 1e-2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.seq_len, args.steps, args.lrs, args.repeats = 256, 2, [1e-3], 1
    torch.manual_seed(11)
    config = DSV4Config.preset("tiny")
    with tempfile.TemporaryDirectory() as ckpt:
        export_hf_checkpoint(DSV4ForCausalLM(config), ckpt, dtype="quantized")  # the released formats
        kept_bytes(ckpt, config)
        requantized_merge(ckpt, config, args.lrs, args.steps, args.seq_len)
        step_speed(ckpt, config, args.seq_len, args.repeats)


if __name__ == "__main__":
    main()
