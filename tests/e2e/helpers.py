"""Run the recipes in a subprocess (never an in-process multi-rank Trainer under pytest) and read their outputs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAST = ["seq_len=256", "logger=csv", "data.max_bytes=200000", "optim.warmup_steps=1"]


def run_recipe(args: list[str], run_dir: Path | None = None, timeout: float = 600, check: bool = True,
               script: str = "recipes/finetune.py") -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / script), *args]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    env.pop("DSV4_SWEEP_CHILD", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """``{step: train/loss}`` from the CSV logger (the last value logged for a step wins, e.g. after a resume)."""
    out: dict[int, float] = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                out[int(row["step"])] = float(row["train/loss"])
    return out
