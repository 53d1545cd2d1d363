"""DSpark drafter training on the tiny V4.1: what training buys in real accepted length, and online against offline.

Runs the recipes as a user would, in one work directory:

1. ``recipes/finetune.py model=v41_tiny`` on the bundled corpus (``--target-steps``), exported in float32: a target
   whose next-token distributions are no longer near uniform;
2. ``recipes/eval_dspark.py`` with a fresh drafter (``drafter.checkpoint=null``: random init, the target's embedding
   and head): the baseline accepted length;
3. ``recipes/train_dspark.py`` online, fresh (``--drafter-steps``), exported beside a copy of the target, then
   evaluated the same way;
4. the same again warm-started from step 3's export (``drafter.init=release``), ``--drafter-steps`` more;
5. ``recipes/capture_dspark.py`` of the same target and ``recipes/train_dspark.py mode=offline`` for
   ``--throughput-steps``, against an online run of as many steps: training tokens/s (the step's tokens over its
   time, the runs' own ``perf/tokens_per_s``, median over the steps after the first).

Every accepted length is greedy speculative decoding (``temperature=0``) of the same held-out prompts
(``data.val_fraction``, split by the same seed as training's held-out documents), ``--prompts`` prompts of 64
tokens, ``--new-tokens`` new tokens each. Prints one JSON object per measurement; ``--out`` keeps the runs.

    python benchmarks/dspark_train.py                       # about 55 minutes on 2 CPU cores
    python benchmarks/dspark_train.py --target-steps 40 --drafter-steps 20 --throughput-steps 4 --prompts 2
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import emit

REPO = Path(__file__).resolve().parents[1]


def recipe(script: str, args: list[str], run_dir: Path) -> str:
    """Run ``recipes/<script>`` with ``args`` into ``run_dir``; its stdout (raises naming the command on failure)."""
    cmd = [sys.executable, str(REPO / "recipes" / script), *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def metric_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def tokens_per_s(run_dir: Path) -> float:
    values = [float(r["perf/tokens_per_s"]) for r in metric_rows(run_dir) if r.get("perf/tokens_per_s")]
    return statistics.median(values[1:] or values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    p.add_argument("--target-steps", type=int, default=300)
    p.add_argument("--drafter-steps", type=int, default=200)
    p.add_argument("--throughput-steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="dspark_train_"))
    out.mkdir(parents=True, exist_ok=True)
    data = ["model=v41_tiny", "data=stdlib", "data.tokenizer=byte", "data.max_bytes=1000000",
            "data.val_fraction=0.05"]
    rows = [f"seq_len={args.seq_len}"]
    shape = {"model": "v41_tiny", "seq_len": args.seq_len, "target_steps": args.target_steps,
             "drafter_steps": args.drafter_steps, "prompts": args.prompts, "new_tokens": args.new_tokens}
    target = out / "target"
    if not (target / "model.safetensors.index.json").exists():
        recipe("finetune.py", [*data, *rows, f"trainer.max_steps={args.target_steps}", "checkpoint.every_n_steps=100000",
                               "logger=csv", f"export.hf_dir={target}", "export.dtype=float32"], out / "finetune")
    final = [float(r["train/loss"]) for r in metric_rows(out / "finetune") if r.get("train/loss")]
    emit("target_train_loss", shape, final[-1], "nats/token")

    evaluate = [*data, f"model.checkpoint={target}", f"num_prompts={args.prompts}",
                f"max_new_tokens={args.new_tokens}", "logger=none"]

    def accepted(drafter: Path | None, name: str) -> float:
        stdout = recipe("eval_dspark.py", [*evaluate, f"drafter.checkpoint={drafter or 'null'}"], out / f"eval_{name}")
        summary = json.loads(stdout.strip().splitlines()[-1])
        emit("accepted_length", {**shape, "drafter": name}, summary["acceptance_length"], "tokens/target forward")
        emit("acceptance_per_position", {**shape, "drafter": name}, summary["acceptance_per_position"], "share")
        return summary["acceptance_length"]

    train = [*data, *rows, f"model.checkpoint={target}", "logger=csv", "drafter.eval_prompts=0",
             "checkpoint.every_n_steps=100000"]
    random_init = accepted(None, "random")
    for name, extra in (("fresh", ["drafter.init=random"]),
                        ("warm", ["drafter.init=release", f"drafter.checkpoint={out / 'hf_fresh'}"])):
        hf = out / f"hf_{name}"
        if not (hf / "model.safetensors.index.json").exists() or not any(hf.glob("dspark-*")):
            shutil.rmtree(hf, ignore_errors=True)
            shutil.copytree(target, hf)
            recipe("train_dspark.py", [*train, *extra, f"trainer.max_steps={args.drafter_steps}",
                                       f"export.hf_dir={hf}", "export.dtype=float32"], out / f"train_{name}")
        gained = accepted(hf, name) - random_init
        emit("accepted_length_gain_over_random", {**shape, "drafter": name}, gained, "tokens/target forward")

    features = out / "features"
    if not (features / "index.json").exists():
        recipe("capture_dspark.py", ["model=v41_tiny", "data=stdlib", "data.tokenizer=byte", "data.max_bytes=1000000",
                                     f"model.checkpoint={target}", f"seq_len={args.seq_len}",
                                     f"max_document_tokens={args.seq_len}", "max_documents=null", "progress=false",
                                     f"output_dir={features}"], out / "capture")
    for mode, extra in (("online", []), ("offline", ["mode=offline", f"features={features}"])):
        run = out / f"throughput_{mode}"
        recipe("train_dspark.py", [*train, *extra, f"trainer.max_steps={args.throughput_steps}"], run)
        emit("train_tokens_per_s", {**shape, "mode": mode, "steps": args.throughput_steps}, tokens_per_s(run),
             "tokens/s")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
