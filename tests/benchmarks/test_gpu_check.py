"""``benchmarks/gpu_check.sh`` in its CPU mode (the GPU check's stages at smoke size, the kernels under Triton's
interpreter), so the script that runs on a GPU machine and the GPU benchmarks' ``--smoke`` modes it runs do not rot: one output file with the environment, one line
per stage, and the benchmarks' measurements; a failing stage is reported and the next one still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES = ["env", "install", "kernel_tests", "gpu_attention", "gpu_train"]


def _check(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "gpu_check.jsonl"
    run_env = {**os.environ, "PYTHON": sys.executable, "WANDB_MODE": "offline", **env}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--cpu", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=1800, env=run_env)  # a safety net only
    assert out.exists(), proc.stderr[-3000:]
    return proc, [json.loads(line) for line in out.read_text().splitlines()]


def _stages(records: list[dict]) -> dict[str, dict]:
    return {r["stage"]: r for r in records if r.get("record") == "stage"}


@pytest.mark.e2e
def test_cpu_mode_writes_every_stage_and_the_measurements_to_one_file(tmp_path):
    proc, records = _check(tmp_path)
    stages = _stages(records)
    assert list(stages) == STAGES, proc.stderr[-3000:]
    failed = {name: r.get("tail", "")[-2000:] for name, r in stages.items() if r["status"] != "ok"}
    assert not failed, failed
    assert all(r["exit_code"] == 0 and r["seconds"] >= 0 for r in stages.values())
    assert proc.returncode == 0, proc.stderr[-3000:]

    (env,) = [r for r in records if r.get("record") == "env"]
    assert env["mode"] == "cpu" and env["torch"] and "triton" in env and "gpu" not in env
    assert env["settings"] == {"TRITON_INTERPRET": "1", "DSV4_KERNEL_DEVICE": "cpu",
                               "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    kernels = stages["kernel_tests"]["pytest"]
    assert kernels["passed"] > 0 and not {"failed", "error", "errors"} & set(kernels)

    measurements = [r for r in records if "name" in r]
    assert all(set(r) == {"name", "shape", "value", "unit"} and r["value"] > 0 for r in measurements)
    names = {r["name"] for r in measurements}
    assert {"gpu_attention.forward_ms", "gpu_attention.backward_ms", "gpu_train.step_s",
            "gpu_train.tokens_per_s", "gpu_train.model_tflops"} <= names
    attention = {(r["name"], r["shape"]["ratio"]) for r in measurements if r["name"].startswith("gpu_attention.")}
    assert {(n, ratio) for n in ("gpu_attention.forward_ms", "gpu_attention.backward_tflops")
            for ratio in (4, 128)} <= attention
    train = [r for r in measurements if r["name"].startswith("gpu_train.")]
    assert all(r["shape"]["steps_measured"] == 2 for r in train)  # the warm-up step is not measured
    for stage in ("gpu_attention", "gpu_train"):  # each stage's measurements, counted, just before its stage line
        at = records.index(stages[stage])
        own = [i for i, r in enumerate(records) if r.get("name", "").startswith(stage + ".")]
        assert len(own) == stages[stage]["measurements"] > 0 and max(own) < at
    assert records[-1]["record"] == "summary" and records[-1]["ok"] is True
    assert records[-1]["stages"] == {name: "ok" for name in STAGES}
    assert (tmp_path / "gpu_check.logs" / "gpu_train.log").exists()


@pytest.mark.e2e
def test_a_failed_stage_is_reported_and_the_next_stages_still_run(tmp_path):
    proc, records = _check(tmp_path, GPU_CHECK_KERNEL_ARGS="-k no_such_kernel_test",  # pytest: no test ran
                           GPU_CHECK_ATTENTION_ARGS="--no-such-flag", GPU_CHECK_TRAIN_ARGS="--no-such-flag")
    stages = _stages(records)
    assert list(stages) == STAGES, proc.stderr[-3000:]
    assert stages["env"]["status"] == stages["install"]["status"] == "ok"
    for name in ("kernel_tests", "gpu_attention", "gpu_train"):
        assert stages[name]["status"] == "failed" and stages[name]["exit_code"] != 0
    assert "--no-such-flag" in stages["gpu_train"]["tail"]
    assert records[-1]["record"] == "summary" and records[-1]["ok"] is False
    assert proc.returncode == 1
