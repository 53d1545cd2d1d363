"""`plan.only=true` for V4 Flash at 128K tokens on 64 ranks of 80 GiB (`experiment=flash_128k_80g`): the full per-rank
plan on a CPU in under 2 GiB (no model is built), at most 76 GiB per rank, so that at least 4 GiB stay for what the
plan does not count. Its time is not asserted (a shared machine is noisy); the subprocess timeout is only a safety
net."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO, recipe_env, reserved_port

pytestmark = pytest.mark.e2e

# The child's peak RSS, measured by a parent that runs nothing else (RUSAGE_CHILDREN: the children it waited for).
_MEASURE = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
            "print('MAXRSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)")


def test_flash_128k_on_64_gpus_of_80_gib_plans_at_most_76_gib(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", _MEASURE, sys.executable, "recipes/finetune.py", "experiment=flash_128k_80g",
           "plan.only=true", "plan.device_memory_gib=80", f"hydra.run.dir={run}"]
    with reserved_port() as port:
        proc = subprocess.run(cmd, cwd=REPO, env=recipe_env(port), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss_gib = int(proc.stdout.split("MAXRSS_KIB")[1].split()[0]) / 2**20
    assert rss_gib < 2, rss_gib
    plan = json.loads((run / "memory_plan.json").read_text())
    assert plan["setup"] == {**plan["setup"], "world": 64, "cp": 16, "ep": 8, "seq_len": 131072,
                             "activation_checkpointing": "block", "compute_dtype": "bfloat16",
                             "optimizer_state_dtype": "bfloat16"}
    per_rank = plan["per_rank_bytes"]
    assert per_rank["total"] > per_rank["parameters"] + per_rank["optimizer"] + per_rank["activations"]
    assert per_rank["total"] <= 76 * 2**30, per_rank["total"] / 2**30
    assert plan["fits"] and plan["device_memory_bytes"] == 80 * 2**30
    assert "fits" in proc.stdout and "DOES NOT FIT" not in proc.stdout
    for line in ("parameters", "optimizer", "activations", "communication", "total", "block ratio 128"):
        assert line in proc.stdout
