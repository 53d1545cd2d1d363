"""End-to-end: `recipes/finetune.py` in subprocesses on gloo CPU ranks (tiny model, bundled corpus)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

from pathlib import Path

import psutil
import pytest

from dsv4.training.checkpointing import checkpoint_step, complete_checkpoints
from dsv4.training.run import read_objective
from tests.e2e.helpers import FAST, REPO, kill_after, losses, recipe_env, reserved_port, run_recipe

pytestmark = pytest.mark.e2e

# the probe in tests/e2e/launch_probes.py is imported by the recipe processes (every process inherits this)
PROBES_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
WAIT_PROBE = ["+callbacks.wait._target_=tests.e2e.launch_probes.WaitForSignal"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs shared by several tests: cp=2 (local dispatcher) and cp=1 on the same data, 4 steps each."""
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for name, extra in (("cp2", ["cp=2"]), ("cp1", ["cp=1"])):
        run_recipe([*FAST, *extra, "trainer.max_steps=4", "checkpoint.every_n_steps=2"], base / name)
        out[name] = base / name
    return out


def test_cp2_trains_and_writes_its_outputs(runs):
    run = runs["cp2"]
    trajectory = losses(run)
    assert sorted(trajectory) == [0, 1, 2, 3]
    assert all(math.isfinite(v) for v in trajectory.values())
    assert (run / "checkpoints" / "last.ckpt" / "meta.pt").exists()
    assert (run / "checkpoints" / "step2.ckpt" / ".metadata").exists()  # a distributed checkpoint
    assert (run / "resolved_config.yaml").read_text().count("cp: 2") == 1
    assert (run / ".hydra" / "config.yaml").exists()


def test_cp1_and_cp2_follow_the_same_loss_trajectory(runs):
    one, two = losses(runs["cp1"]), losses(runs["cp2"])
    assert one.keys() == two.keys()
    for step in one:
        assert abs(one[step] - two[step]) <= 1e-5, (step, one[step], two[step])


def test_balanced_cp2_follows_the_cp1_trajectory(tmp_path):
    """cp_balance=full (rank r holds chunks r and 3 - r of 4) trains exactly as one rank (rows of 512: 4 x 128)."""
    common = [*FAST, "seq_len=512", "trainer.max_steps=3", "checkpoint.every_n_steps=0"]
    run_recipe([*common, "cp=1"], tmp_path / "cp1")
    run_recipe([*common, "cp=2", "cp_balance=full"], tmp_path / "balanced")
    one, balanced = losses(tmp_path / "cp1"), losses(tmp_path / "balanced")
    assert one.keys() == balanced.keys() == {0, 1, 2}
    for step in one:
        assert abs(one[step] - balanced[step]) <= 1e-5, (step, one[step], balanced[step])


def test_alltoall_expert_parallel_matches_local(runs, tmp_path):
    run_recipe([*FAST, "cp=2", "ep=2", "dispatcher=alltoall", "trainer.max_steps=4", "checkpoint.every_n_steps=0"],
               tmp_path)
    ep, local = losses(tmp_path), losses(runs["cp2"])
    assert ep.keys() == local.keys()
    for step in ep:
        assert abs(ep[step] - local[step]) <= 1e-5, (step, ep[step], local[step])


def test_kill_and_resume_continues_the_same_trajectory(runs, tmp_path):
    """SIGKILL the job after its step-2 checkpoint, rerun the same command: steps 3-4 match the uninterrupted run."""
    kill_after([*FAST, "cp=2", "trainer.max_steps=4", "checkpoint.every_n_steps=2"], tmp_path,
               tmp_path / "checkpoints" / "step2.ckpt" / "meta.pt")
    run_recipe([*FAST, "cp=2", "trainer.max_steps=4", "checkpoint.every_n_steps=2"], tmp_path)
    resumed, reference = losses(tmp_path), losses(runs["cp2"])
    for step in (2, 3):
        assert abs(resumed[step] - reference[step]) <= 1e-5, (step, resumed[step], reference[step])


def test_host_offload_follows_the_same_trajectory_and_resumes_from_its_checkpoint(runs, tmp_path):
    """trainer.offload=optimizer (shards, gradients, optimizer state in host memory; on CPU the host is the device):
    the cp=2 losses; a run resumed from its step-2 checkpoint (asynchronous saves, the default) repeats steps 2-3."""
    common = [*FAST, "cp=2", "trainer.offload=optimizer", "trainer.max_steps=4"]
    run_recipe([*common, "checkpoint.every_n_steps=2"], tmp_path / "offload")
    step2 = tmp_path / "offload" / "checkpoints" / "step2.ckpt"
    run_recipe([*common, "checkpoint.every_n_steps=0", f"checkpoint.resume={step2}"], tmp_path / "resumed")
    offload, reference, resumed = losses(tmp_path / "offload"), losses(runs["cp2"]), losses(tmp_path / "resumed")
    assert offload.keys() == reference.keys() == {0, 1, 2, 3} and resumed.keys() == {2, 3}
    for step in reference:
        assert abs(offload[step] - reference[step]) <= 1e-6 * abs(reference[step]), (step, offload, reference)
    for step in resumed:
        assert abs(resumed[step] - offload[step]) <= 1e-6 * abs(offload[step]), (step, resumed, offload)


def _submitit_task_of(root: psutil.Process, run_dir: Path) -> psutil.Process:
    """The submitit task process (``python -m submitit.core._submit``) whose child trains into ``run_dir``."""
    for proc in root.children(recursive=True):
        try:
            cmd, parent = proc.cmdline(), proc.parent()
            if f"hydra.run.dir={run_dir}" in cmd and "submitit.core._submit" in " ".join(parent.cmdline()):
                return parent
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no submitit task trains into {run_dir}")


def test_submitit_sweep_trains_both_jobs_and_requeues_a_preempted_one_on_the_same_trajectory(runs, tmp_path):
    """``-m hydra/launcher=local cp=1,2`` (submitit's local executor, the launcher path of SLURM without a
    cluster): each job runs in a submitit task process, whose argv is submitit's, not the recipe's. Job 0 (cp=1) is
    held by a test callback at the end of step 3 and its task gets submitit's preemption signal (SIGUSR2, what the
    executor sends before the time limit): the training stops after step 3 with ``step3.ckpt`` (the periodic
    schedule saves 2 and 4), submitit requeues the job, and the rerun resumes from step 3. Job 1 (cp=2: Lightning
    starts its second rank) runs through. Both jobs' losses equal the uninterrupted single runs' (``runs``) exactly,
    each in its own run dir with its metrics and objective, and no rank re-ran the sweep."""
    sweep, marker = tmp_path / "sweep", tmp_path / "waiting"
    cmd = [sys.executable, str(REPO / "recipes/finetune.py"), "-m", "hydra/launcher=local", *FAST, "cp=1,2",
           "trainer.max_steps=4", "checkpoint.every_n_steps=2", *WAIT_PROBE, "+callbacks.wait.step=3",
           "+callbacks.wait.rank=0", "+callbacks.wait.world_size=1", f"+callbacks.wait.marker_dir={marker}",
           f"hydra.sweep.dir={sweep}"]
    with reserved_port() as port:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**recipe_env(port), **PROBES_ENV}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            deadline = time.time() + 1800  # a safety net against a hang, not a performance check
            while not (marker / "rank0.waiting").exists() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.2)
            assert (marker / "rank0.waiting").exists(), proc.communicate()[0][-6000:]
            _submitit_task_of(psutil.Process(proc.pid), sweep / "0").send_signal(signal.SIGUSR2)
            out, _ = proc.communicate(timeout=1800)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-6000:]
    # exactly the two jobs: no child rank re-ran the sweep into a directory of its own
    assert sorted(p.name for p in sweep.iterdir()) == [".submitit", "0", "1", "multirun.yaml"]
    for job, reference in (("0", runs["cp1"]), ("1", runs["cp2"])):
        run, expected = sweep / job, losses(reference)
        trajectory = losses(run)
        assert trajectory.keys() == expected.keys() == {0, 1, 2, 3}, job
        for step in expected:
            assert trajectory[step] == expected[step], (job, step, trajectory[step], expected[step])
        assert read_objective(run) == trajectory[3], job
        assert f"cp: {int(job) + 1}" in (run / "resolved_config.yaml").read_text()
    ckpts = sweep / "0" / "checkpoints"
    complete, incomplete = complete_checkpoints(ckpts)
    assert not incomplete and [p.name for p in complete] == ["last.ckpt", "step2.ckpt", "step3.ckpt", "step4.ckpt"]
    assert [checkpoint_step(p) for p in complete] == [4, 2, 3, 4]
    log = (sweep / "0" / "finetune.log").read_text()
    assert "preempted: stopped after step 3 with a complete checkpoint" in log, log[-4000:]
    assert f"resuming from {ckpts / 'last.ckpt'} (step 3)" in log, log[-4000:]
    assert not (sweep / "1" / "checkpoints" / "step3.ckpt").exists()
    task_log = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_log.*"))
    assert "Caught signal SIGUSR2" in task_log and "Requeued job" in task_log, task_log[-4000:]


def test_a_nan_gradient_on_one_rank_stops_both_naming_the_parameter_and_the_last_good_checkpoint(tmp_path):
    """cp=2: rank 1 alone holds a NaN in its FSDP2 shard of one gradient at step 2; the job exits non-zero and
    the message names step 2, that parameter on rank 1 and step1.ckpt; nothing of step 2 is saved."""
    name = "model.layers.1.self_attn.wq_a.weight"
    proc = run_recipe([*FAST, "cp=2", "trainer.max_steps=3", "checkpoint.every_n_steps=1",
                       "+callbacks.nan._target_=tests.e2e.nan_probe.NaNGradient", "+callbacks.nan.step=2",
                       f"+callbacks.nan.parameter={name}", "+callbacks.nan.rank=1"], tmp_path, check=False,
                      env={"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "NonFiniteError: non-finite values at optimizer step 2:" in out, out[-3000:]
    assert f"first non-finite gradient: {name} (rank 1)" in out, out[-3000:]
    assert f"last good checkpoint: {tmp_path / 'checkpoints' / 'step1.ckpt'}." in out, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt", "step1.ckpt"]
