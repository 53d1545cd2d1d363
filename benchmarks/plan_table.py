"""Memory plans (``dsv4.plan``) of fine-tuning V4 Flash, V4 Pro and V4.1-Flash: the "what fits" tables of
``docs/memory.md`` and ``docs/lora.md``.

``--peft none`` (default): full fine-tuning. ``--peft lora``: LoRA r=8 on attention + shared + routed experts
(``conf/peft/lora.yaml``) on a frozen base, ``--base-dtype bf16`` (frozen bf16 parameters, FSDP-sharded) or ``fp8``
(the release's FP8 / FP4 tensors kept as buffers, replicated over DP x CP, experts split by EP).

Layout per GPU count: CP 8 (the sequence split over 8 ranks), DP = GPUs / 8, EP 8 (all-to-all), FSDP2 over
DP x CP with bf16 compute and fp32 master weights / AdamW state (``conf/optim/adamw.yaml``), block recompute, the
chunked loss, one sequence per replica, the attention kernel a GPU run of this install uses (``auto``: Triton
where it imports). Prints one JSON object per plan (per-rank total in GiB, with the terms, the biggest term and the
peak phase in ``shape``); ``--markdown`` also prints the table (per-rank GiB and whether it fits 80 GiB and 141 GiB
devices; with ``--device-gib G``, whether it fits G GiB, the biggest term where it does not, and the host memory per
rank with host offload). ``--state-dtype``
(``optim.state_dtype``), ``--moe-chunk-tokens`` (``model.moe_chunk_tokens``) and ``--offload`` (``trainer.offload``;
the host term is in ``shape``) plan the memory options.

DeepSeek-V4.1 (``--models v41_flash``): the Engram tables are row-sharded over the ``dp x cp`` ranks and frozen, in
the form ``--engram-dtype`` names: ``fp8`` (default) as a run that loads the released checkpoint keeps them
(``model.checkpoint``), ``fp32`` as a run without one builds them; ``--engram-tables host`` holds them in host memory
(``trainer.engram_tables=host``: out of the device total, the cell adds them to the host memory per rank).
``model.fake_quant`` is on (the preset's).

The activations of a plan depend on the per-rank step, not on ``dp`` (:func:`dsv4.plan.suggest.activation_key`): the
plans of one model and sequence length share one trace across GPU counts (with ``--ep 0`` only where the EP size
is the same).

    python benchmarks/plan_table.py --markdown
    python benchmarks/plan_table.py --models flash --seq-lens 131072 --gpus 64
    python benchmarks/plan_table.py --peft lora --base-dtype fp8 --ep 0 --markdown   # LoRA: experts over every GPU
    python benchmarks/plan_table.py --state-dtype bfloat16 --moe-chunk-tokens 4096 --markdown   # bf16 moments, chunks
    python benchmarks/plan_table.py --models v41_flash --gpus 8 16 32 64 128 --device-gib 80 --markdown   # V4.1
    python benchmarks/plan_table.py --models v41_flash --peft lora --ep 0 --engram-tables host --device-gib 80 --markdown
"""

from __future__ import annotations

import argparse

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from common import emit
from dsv4.config import DSV4Config
from dsv4.model.attention_backend import resolve_attention_backend
from dsv4.peft.config import LoRAConfig
from dsv4.plan.plan import GIB, PlanSetup, memory_plan
from dsv4.plan.states import optimizer_profile
from dsv4.plan.suggest import activation_key

ADAMW = Path(__file__).resolve().parents[1] / "conf" / "optim" / "adamw.yaml"

DEVICES_GIB = (80, 141)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["flash", "pro"])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[32768, 65536, 131072])
    parser.add_argument("--gpus", type=int, nargs="*", default=[8, 16, 32, 64])
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=8, help="expert-parallel size; 0 = every GPU (ep = GPUs)")
    parser.add_argument("--peft", choices=["none", "lora"], default="none")
    parser.add_argument("--base-dtype", choices=["bf16", "fp8"], default="fp8")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--state-dtype", choices=["float32", "bfloat16", "8bit"], default="float32",
                        help="optim.state_dtype: what the AdamW moments are stored in")
    parser.add_argument("--moe-chunk-tokens", type=int, default=0, help="model.moe_chunk_tokens (0: unchunked)")
    parser.add_argument("--offload", choices=["none", "optimizer"], default="none", help="trainer.offload")
    parser.add_argument("--engram-dtype", choices=["fp8", "fp32"], default="fp8",
                        help="V4.1: the frozen Engram tables as the released checkpoint stores them (fp8) or built "
                             "without a checkpoint (fp32)")
    parser.add_argument("--engram-tables", choices=["device", "host"], default="device",
                        help="V4.1: trainer.engram_tables, where the frozen Engram tables are held")
    parser.add_argument("--device-gib", type=float, default=None,
                        help="--markdown: judge every cell against this device (GiB) and name the biggest term of a "
                             "plan that does not fit; default: 80 and 141")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    lora = LoRAConfig(rank=args.rank, base_dtype=args.base_dtype) if args.peft == "lora" else None
    optim = OmegaConf.load(ADAMW)
    optim.state_dtype = args.state_dtype
    optimizer = optimizer_profile(instantiate(optim, _convert_="all"))  # the recipe's AdamW
    backend = resolve_attention_backend("auto", "cuda")  # what a GPU run of this install uses
    rows, traces = {}, {}
    for model in args.models:
        config = DSV4Config.preset(model, activation_checkpointing="block", attention_backend=backend,
                                   moe_chunk_tokens=args.moe_chunk_tokens)
        v41 = bool(getattr(config, "engram_layer_ids", None))
        for seq_len in args.seq_lens:
            for gpus in args.gpus:
                ep = args.ep or gpus
                setup = PlanSetup(config, seq_len, cp=args.cp, dp=gpus // args.cp, ep=ep,
                                  compute_dtype=torch.bfloat16, optimizer=optimizer, lora=lora, offload=args.offload,
                                  engram_fp8=v41 and args.engram_dtype == "fp8",
                                  engram_on_host=v41 and args.engram_tables == "host")
                key = activation_key(setup)
                plan = memory_plan(setup, activations=traces.get(key))
                traces[key] = plan.traced
                terms = {k: round(v / GIB, 2) for k, v in plan.per_rank_bytes.items()}
                shape = {"model": model, "seq_len": seq_len, "gpus": gpus, "cp": args.cp, "dp": gpus // args.cp,
                         "ep": ep, "recompute": "block", "attention": backend, "per_rank_gib": terms,
                         "biggest_term": plan.biggest_term, "peak": plan.peak_phase,
                         "optim_state_dtype": args.state_dtype,
                         "moe_chunk_tokens": args.moe_chunk_tokens, "offload": args.offload,
                         "host_offload_gib": round(plan.host_offload_bytes / GIB, 2),
                         "peft": "none" if lora is None else f"lora r={lora.rank}, base {lora.base_dtype}"}
                if v41:
                    shape.update(engram_dtype=args.engram_dtype, fake_quant=config.fake_quant,
                                 engram_table_gib=round(plan.engram_table_bytes / GIB, 2),
                                 engram_tables=args.engram_tables,
                                 engram_host_gib=round(plan.engram_host_bytes / GIB, 2))
                emit("plan_table.per_rank_total", shape, terms["total"], "GiB")
                rows[(model, seq_len, gpus)] = terms, plan.biggest_term, round(plan.host_bytes / GIB, 2)
    if args.markdown:
        print("\n| model | sequence | " + " | ".join(f"{g} GPUs" for g in args.gpus) + " |")
        print("|---|---|" + "---|" * len(args.gpus))
        for model in args.models:
            for seq_len in args.seq_lens:
                print(f"| {model} | {seq_len // 1024}K | " + " | ".join(
                    _cell(*rows[(model, seq_len, gpus)], args.device_gib) for gpus in args.gpus) + " |")


def _cell(terms: dict[str, float], biggest: str, host_gib: float, device_gib: float | None) -> str:
    """A table cell: the per-rank total and whether it fits each device; against one device (``device_gib``) a plan
    that does not fit names its biggest term, and with host offload or Engram tables in host memory the cell adds the
    host memory per rank."""
    total = terms["total"]
    if device_gib is None:
        return f"{total:.0f} GiB (" + " / ".join(("fits" if total <= gib else "no") for gib in DEVICES_GIB) + ")"
    host = f" + host {host_gib:.0f} GiB" if host_gib else ""
    if total <= device_gib:
        return f"{total:.0f} GiB{host}"
    return f"{total:.0f} GiB{host}: does not fit ({biggest} {terms[biggest]:.0f} GiB)"


if __name__ == "__main__":
    main()
