"""`plan.only=true` for V4 Flash and V4.1-Flash at 128K tokens on 64 ranks of 80 GiB (`experiment=flash_128k_80g`,
`experiment=v41_flash_128k_80g`): the full per-rank plan (V4: the recipe on a CPU in under 2 GiB, no model is built),
at most 76 GiB per rank, so that at least 4 GiB stay for what the plan does not count; for V4 at CP 8 x DP 8,
which does not fit, what would (the printed overrides planned again); and V4.1-Flash drafter training on one node of
8 x 80 GiB at 4096 tokens per row.
Times are not asserted (a shared machine is noisy); the subprocess timeout is only a safety net."""

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


def test_v41_flash_128k_on_64_gpus_of_80_gib_plans_at_most_76_gib(tmp_path, capsys):
    """`experiment=v41_flash_128k_80g plan.only=true plan.device_memory_gib=80` through the recipe's planning step
    (`check_memory` on the composed config, in this process: the recipe's start-up costs a process of its own).
    CP 16 x DP 4 with host offload: on the device the rank's rows of the two Engram tables (384006168 and 384016682
    rows of 256, fp32 without a checkpoint: ceil(rows / 64) rows each), the activations and FSDP's buffers; the
    shards, gradients and bf16 moments in host memory."""
    from hydra import compose, initialize_config_dir

    from dsv4.training.planning import PLAN_FILE, check_memory
    from dsv4.training.schema import register_schema
    from dsv4.training.spec import build_run_spec

    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=["experiment=v41_flash_128k_80g", "plan.only=true",
                                                         "plan.device_memory_gib=80"])
    assert check_memory(build_run_spec(cfg), tmp_path, cfg) is True  # plan only: the recipe stops here
    report = capsys.readouterr().out
    assert "fits" in report and "DOES NOT FIT" not in report
    for line in ("of which Engram tables", "activations", "communication", "total", "host offload"):
        assert line in report
    plan = json.loads((tmp_path / PLAN_FILE).read_text())
    assert plan["setup"] == {**plan["setup"], "world": 64, "cp": 16, "dp": 4, "ep": 8, "seq_len": 131072,
                             "activation_checkpointing": "block", "compute_dtype": "bfloat16",
                             "optimizer_state_dtype": "bfloat16", "offload": "optimizer"}
    tables = (-(-384006168 // 64) + -(-384016682 // 64)) * 256 * 4
    per_rank = plan["per_rank_bytes"]
    assert plan["engram_table_bytes"] == tables and tables <= per_rank["parameters"] < tables + 2**30
    assert per_rank["gradients"] == per_rank["optimizer"] == 0
    assert per_rank["total"] == per_rank["parameters"] + per_rank["activations"] + per_rank["communication"]
    assert per_rank["total"] <= 76 * 2**30, per_rank["total"] / 2**30
    assert plan["fits"] and plan["device_memory_bytes"] == 80 * 2**30
    host = plan["host_offload_bytes"]  # fp32 shards, fp32 gradients, two bf16 moments (+ a step counter per tensor)
    assert host["parameters"] >= host["gradients"] > 30 * 2**30
    assert 0 <= host["optimizer"] - host["gradients"] < 2**20


def test_flash_cp8_at_128k_prints_what_would_fit_and_the_plan_confirms_it(tmp_path):
    """The acceptance command of the what-would-fit search: `model=flash cp=8 dp=8 ep=8 seq_len=131072 plan=true`
    (104.68 GiB against 80) prints a line of overrides; the config Hydra composes from the command plus those
    overrides, planned afresh through the planning API (one plan, its own trace), fits with the printed total. Asked
    for one suggestion (`plan.suggest=1`: the first line of the default 3, found by the same walk, without the traces
    the next two need)."""
    import re

    from hydra import compose, initialize_config_dir

    from dsv4.plan.plan import memory_plan
    from dsv4.training.planning import plan_setup
    from dsv4.training.schema import register_schema
    from dsv4.training.spec import build_run_spec

    run = tmp_path / "run"
    command = ["model=flash", "cp=8", "dp=8", "ep=8", "seq_len=131072", "plan.only=true"]
    cmd = [sys.executable, "-c", _MEASURE, sys.executable, "recipes/finetune.py", *command, "plan.suggest=1",
           f"hydra.run.dir={run}"]
    with reserved_port() as port:
        proc = subprocess.run(cmd, cwd=REPO, env=recipe_env(port), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split("MAXRSS_KIB")[1].split()[0]) / 2**20 < 2
    assert "total            104.68 GiB" in proc.stdout and "DOES NOT FIT" in proc.stdout
    lines = re.findall(r"fits with: (.+?)  -> ([\d.]+) GiB", proc.stdout)
    assert len(lines) == 1, proc.stdout[-2000:]
    overrides, printed = lines[0][0].split(), float(lines[0][1])
    record = json.loads((run / "memory_plan.json").read_text())["suggestions"]["fits_with"]
    assert [s["overrides"] for s in record] == [overrides] and round(record[0]["per_rank_total_bytes"] / 2**30, 2) == printed

    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=[*command, *overrides])
    plan = memory_plan(plan_setup(build_run_spec(cfg), 80 * 2**30))
    assert plan.fits and plan.total == record[0]["per_rank_total_bytes"] < 80 * 2**30


def test_v41_flash_drafter_training_on_one_node_of_8_gpus_of_80_gib(tmp_path, capsys):
    """`recipes/train_dspark.py model=v41_flash trainer.devices=8 ep=8 seq_len=4096 trainer.engram_tables=host
    optim.state_dtype=bfloat16 plan.checkpoint_form=release plan.only=true plan.device_memory_gib=80` through the
    recipe's planning step: the target kept as the release stores it, its Engram rows (FP8, 1/8 of the two tables:
    ceil(rows / 8) x 264 bytes) in host memory, at most 76 GiB per rank on the device; the same run with the rows on
    the device does not fit (the target is its biggest term), and what would fit names the host tables.""" 
    from hydra import compose, initialize_config_dir

    from dsv4.training.dspark_run import TRAIN_DSPARK
    from dsv4.training.planning import PLAN_FILE
    from dsv4.training.schema import register_schema
    from dsv4.training.spec import build_dspark_run_spec

    def plan(tables: str, out, suggest: int = 0):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="train_dspark", overrides=[
                "model=v41_flash", "trainer=gpu", "trainer.devices=8", "ep=8", "dispatcher=alltoall", "seq_len=4096",
                f"trainer.engram_tables={tables}", "optim.state_dtype=bfloat16", "plan.checkpoint_form=release",
                "plan.only=true", "plan.device_memory_gib=80", f"plan.suggest={suggest}"])
        assert TRAIN_DSPARK.check_memory(build_dspark_run_spec(cfg), out, cfg) is True
        return json.loads((out / PLAN_FILE).read_text()), capsys.readouterr().out

    register_schema()
    host, report = plan("host", tmp_path / "host")
    assert "fits" in report and "DOES NOT FIT" not in report and "host copies" in report
    rows = (-(-384006168 // 8) + -(-384016682 // 8)) * (256 + 256 // 32)
    assert host["host_bytes"] == host["engram_table_bytes"] == rows
    assert host["setup"] == {**host["setup"], "world": 8, "dp": 8, "ep": 8, "seq_len": 4096, "target_kept": True,
                             "engram_fp8": True, "engram_on_host": True, "optimizer_state_dtype": "bfloat16"}
    assert host["fits"] and host["per_rank_bytes"]["total"] <= 76 * 2**30, host["per_rank_bytes"]["total"] / 2**30
    device, report = plan("device", tmp_path / "device", suggest=1)
    assert not device["fits"] and device["biggest_term"] == "target" and "DOES NOT FIT" in report
    assert device["per_rank_bytes"]["total"] == host["per_rank_bytes"]["total"] + rows
    # what would fit plans each candidate as the run (the release's form kept): the tables in host memory
    fits = device["suggestions"]["fits_with"]
    assert fits and fits[0]["overrides"] == ["trainer.engram_tables=host"], fits
    assert fits[0]["per_rank_total_bytes"] == host["per_rank_bytes"]["total"], fits


def test_pro_32k_in_pipeline_stages_on_512_gpus_plans_at_most_76_gib_and_a_quarter_of_fsdp_bytes():
    """`experiment=pro_32k_80g plan.only=true` (V4 Pro, 32K, pp 8 x CP 32 x DP 2, EP 64, 1F1B, 128 sequences per
    step) through `benchmarks/layout_plan.py`'s recipe planning: at most 76 GiB on its largest pipeline rank, and
    its busiest rank sends at most a quarter of the bytes per step that FSDP alone (CP 8 x DP 64, EP 64: two
    micro-batches of 64 sequences) sends on the same 512 GPUs for the same 128 sequences."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from layout_plan import LAYOUTS, measure, plan_layout

    layouts = {name: overrides for model, name, overrides in LAYOUTS if model == "pro"}
    stages = plan_layout(layouts["pipeline (experiment=pro_32k_80g), 512 GPUs"])
    fsdp = plan_layout(layouts["FSDP, 512 GPUs"])
    assert (stages.setup.pp, stages.setup.cp, stages.setup.dp, stages.setup.ep, stages.setup.microbatches) == \
        (8, 32, 2, 64, 64)
    assert len(stages.ranks) == 8 and stages.total == max(p.total for p in stages.ranks)
    assert stages.fits and stages.total <= 76 * 2**30, stages.total / 2**30
    piped, alone = measure(stages), measure(fsdp)
    assert piped["gpus"] == alone["gpus"] == 512 and piped["sequences_per_step"] == alone["sequences_per_step"] == 128
    assert piped["sent_gib_per_step"] <= alone["sent_gib_per_step"] / 4, (piped, alone)
    assert piped["step_seconds"] < alone["step_seconds"]  # the plan's modelled estimate, not a measured time
