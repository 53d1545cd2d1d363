"""Layouts side by side, as the recipe plans them: per-rank device and host memory, the bytes the busiest rank sends
per optimizer step, and the estimated step time, for the same sequences per step. The tables of docs/scale.md
("Which layout: pipeline stages, CP, EP or FSDP").

Each layout is the recipe's composed config (``conf/finetune.yaml`` with the layout's overrides), resolved and
planned as ``plan.only=true`` does (:func:`dsv4.training.spec.build_run_spec`, :func:`dsv4.training.planning.
plan_setup`, :func:`dsv4.plan.plan.memory_plan`; the optimizer's state measured on the configured AdamW), judged
against 80 GiB GPUs less the default 4 GiB reserve. Without pipeline stages the plan's communication table is one
micro-batch; a step accumulates ``global_batch_size / (micro_batch_size x dp)`` of them, each moving the same bytes
(FSDP gathers and reduces every micro-batch), so bytes and time are multiplied by that. With pipeline stages the
table is the step (its microbatches, FSDP once), the busiest and slowest pipeline rank's.

Prints one JSON object per layout and quantity (``gpus``, ``device_gib``, ``host_gib``, ``sent_gib_per_step``,
``step_seconds``, ``fits``); ``--markdown`` also prints the table.

    python benchmarks/layout_plan.py --markdown                 # V4 Pro at 32K and V4 Flash at 128K
    python benchmarks/layout_plan.py --models pro --markdown
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import emit

CONF = Path(__file__).resolve().parents[1] / "conf"
GPU = ["trainer=gpu", "dispatcher=alltoall", "plan.only=true", "plan.device_memory_gib=80", "plan.suggest=0"]
PRO = ["model=pro", "seq_len=32768", "optim.state_dtype=bfloat16", "model.moe_chunk_tokens=4096",
       "global_batch_size=128"]
FLASH = ["experiment=flash_128k_80g"]
# (model, name, overrides): the same sequences per optimizer step within a model
LAYOUTS = [
    ("pro", "FSDP, host offload, 128 GPUs", [*PRO, "cp=8", "ep=16", "trainer.offload=optimizer",
                                            "trainer.devices=8", "trainer.num_nodes=16"]),
    ("pro", "FSDP, 512 GPUs", [*PRO, "cp=8", "ep=64", "trainer.devices=8", "trainer.num_nodes=64"]),
    ("pro", "pipeline (experiment=pro_32k_80g), 512 GPUs", ["experiment=pro_32k_80g"]),
    ("flash", "FSDP (experiment=flash_128k_80g), 64 GPUs", FLASH),
    ("flash", "FSDP, host offload, 16 GPUs", [*FLASH, "cp=8", "dp=2", "ep=8", "trainer.offload=optimizer",
                                             "model.moe_chunk_tokens=4096", "trainer.num_nodes=2",
                                             "global_batch_size=4"]),
    ("flash", "FSDP, host offload, 32 GPUs", [*FLASH, "cp=16", "dp=2", "ep=8", "trainer.offload=optimizer",
                                             "model.moe_chunk_tokens=4096", "trainer.num_nodes=4",
                                             "global_batch_size=4"]),
]


def plan_layout(overrides: list[str]):
    """The recipe's plan of ``conf/finetune.yaml`` with ``overrides`` (plan only)."""
    from hydra import compose, initialize_config_dir

    from dsv4.plan.plan import memory_plan
    from dsv4.training.planning import _device_memory, plan_setup
    from dsv4.training.schema import register_schema
    from dsv4.training.spec import build_run_spec

    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=[*overrides, *GPU])
    spec = build_run_spec(cfg)
    return memory_plan(plan_setup(spec, _device_memory(spec)))


def measure(plan) -> dict:
    """The compared quantities of ``plan`` per optimizer step (module docstring)."""
    setup = plan.setup
    steps = 1 if setup.pp > 1 else setup.microbatches  # micro-batches a plan's table is one of
    ranks = plan.ranks or [plan]
    return {"gpus": setup.gpus, "device_gib": plan.total / 2**30, "host_gib": plan.host_bytes / 2**30,
            "sent_gib_per_step": steps * max(p.comm.total_sent for p in ranks) / 2**30,
            "step_seconds": steps * plan.step_seconds, "fits": plan.fits,
            "sequences_per_step": setup.microbatches * setup.micro_batch_size * setup.dp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["pro", "flash"], choices=["pro", "flash"])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = []
    for model, name, overrides in LAYOUTS:
        if model not in args.models:
            continue
        values = measure(plan_layout(overrides))
        shape = {"model": model, "layout": name, "overrides": overrides,
                 "sequences_per_step": values.pop("sequences_per_step")}
        for key, value in values.items():
            emit(key, shape, value, {"gpus": "count", "fits": "bool", "step_seconds": "s"}.get(key, "GiB"))
        rows.append((model, name, shape["sequences_per_step"], values))
    if args.markdown:
        print("| model | layout | sequences / step | per rank | host per rank | sent per rank and step | step estimate |")
        print("|---|---|---|---|---|---|---|")
        for model, name, sequences, v in rows:
            fits = "" if v["fits"] else " (does not fit)"
            print(f"| {model} | {name} | {sequences} | {v['device_gib']:.2f} GiB{fits} | {v['host_gib']:.1f} GiB | "
                  f"{v['sent_gib_per_step']:.0f} GiB | {v['step_seconds']:.1f} s |")


if __name__ == "__main__":
    main()
