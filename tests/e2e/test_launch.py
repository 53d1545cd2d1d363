"""End-to-end launches: preemption by a signal, the documented multi-node torchrun command (2 nodes x 2 processes
on one machine), and torchrun restarting a group after a rank was SIGKILLed. Subprocesses on gloo CPU ranks; the
signals are sent once a marker file appears (polled), and every comparison is with an uninterrupted run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dsv4.training.checkpointing import checkpoint_step, complete_checkpoints
from tests.e2e.helpers import FAST, REPO, losses, recipe_env, reserved_port, run_recipe

pytestmark = pytest.mark.e2e

SAFETY_NET_S = 1800  # against a hang, not a performance bound
PREEMPTION = [*FAST, "cp=2", "trainer.max_steps=6", "checkpoint.every_n_steps=2"]


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + SAFETY_NET_S
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert path.exists(), f"{path} never appeared (exit status {proc.poll()})"


def _rank_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """The recipe processes under ``proc`` (itself included: Lightning's launching process is rank 0)."""
    root = psutil.Process(proc.pid)
    return [p for p in [root, *root.children(recursive=True)] if "recipes/finetune.py" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("uninterrupted")
    run_recipe(PREEMPTION, run)
    return losses(run)


def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint_and_resumes(uninterrupted, tmp_path):
    """SIGTERM to rank 1 only (a child of Lightning's launcher) once the step-2 save started: both ranks agree on
    the step, save it, the job exits 143; the same command resumes from that step on the uninterrupted trajectory."""
    cmd = [sys.executable, str(REPO / "recipes/finetune.py"), *PREEMPTION, f"hydra.run.dir={tmp_path}"]
    with reserved_port() as port:
        proc = subprocess.Popen(cmd, cwd=REPO, env=recipe_env(port), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        _wait_for(tmp_path / "checkpoints" / "step2.ckpt.partial", proc)  # the step-2 save started
        ranks = _rank_processes(proc)
        assert len(ranks) == 2, ranks
        child = next(p for p in ranks if p.pid != proc.pid)
        child.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=SAFETY_NET_S)
        psutil.wait_procs(ranks, timeout=SAFETY_NET_S)
    assert proc.returncode == 143, out[-6000:]
    complete, incomplete = complete_checkpoints(tmp_path / "checkpoints")
    assert not incomplete, incomplete
    stopped = max(checkpoint_step(p) for p in complete)
    assert 2 <= stopped < 6, stopped
    assert (tmp_path / "checkpoints" / f"step{stopped}.ckpt" / "meta.pt").exists()
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == stopped
    assert f"stopped after step {stopped} with a complete checkpoint" in out

    resumed = run_recipe(PREEMPTION, tmp_path)
    assert f"resuming from {tmp_path / 'checkpoints' / 'last.ckpt'}" in resumed.stdout + resumed.stderr
    trajectory = losses(tmp_path)
    assert trajectory.keys() == uninterrupted.keys() == set(range(6))
    for step in trajectory:
        assert trajectory[step] == uninterrupted[step], (step, trajectory[step], uninterrupted[step])



MULTI_NODE = [*FAST, "cp=2", "dp=2", "trainer.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.async_save=false"]


def _torchrun(args: list[str], port: int, run_dir: Path, nnodes: int = 1, node_rank: int = 0,
              extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """One node of the documented torchrun command (2 processes per node, c10d rendezvous) on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", "2",
           "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *extra,
           str(REPO / "recipes/finetune.py"), *args, "trainer.devices=2", f"trainer.num_nodes={nnodes}",
           f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in recipe_env(port).items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _two_nodes(port: int, run_dir: Path) -> list[subprocess.Popen]:
    return [_torchrun(MULTI_NODE, port, run_dir, nnodes=2, node_rank=node) for node in (0, 1)]


def test_two_node_torchrun_matches_lightning_and_resumes_after_sigterm(tmp_path):
    """The README's torchrun command as 2 nodes x 2 processes on this machine (cp=2 dp=2, one run dir for all
    ranks): SIGTERM to both torchrun agents after the step-2 checkpoint (as a scheduler does) is forwarded to every
    worker, which stop with a checkpoint (status 143); the same two commands resume, and every loss is the Lightning
    launcher's for the same config."""
    run_recipe(MULTI_NODE, tmp_path / "lightning")
    reference = losses(tmp_path / "lightning")
    run = tmp_path / "torchrun"
    with reserved_port() as port:
        agents = _two_nodes(port, run)
        _wait_for(run / "checkpoints" / "step2.ckpt" / "meta.pt", agents[0])
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        outs = [agent.communicate(timeout=SAFETY_NET_S)[0] for agent in agents]
    for agent, out in zip(agents, outs):
        assert agent.returncode != 0 and "SignalException" in out, out[-6000:]  # torchrun re-raises the signal
    complete, incomplete = complete_checkpoints(run / "checkpoints")
    assert not incomplete, incomplete
    stopped = checkpoint_step(run / "checkpoints" / "last.ckpt")
    assert 2 <= stopped < 4 and (run / "checkpoints" / f"step{stopped}.ckpt" / "meta.pt").exists()
    # every one of the 4 workers left through the preemption exit (status 143), after the same step
    assert (run / "finetune.log").read_text().count(f"preempted: stopped after step {stopped} ") == 4
    with reserved_port() as port:
        agents = _two_nodes(port, run)
        outs = [agent.communicate(timeout=SAFETY_NET_S)[0] for agent in agents]
    for agent, out in zip(agents, outs):
        assert agent.returncode == 0, out[-6000:]
    assert f"resuming from {run / 'checkpoints' / 'last.ckpt'}" in (run / "finetune.log").read_text()
    trajectory = losses(run)
    assert trajectory.keys() == reference.keys() == set(range(4))
    for step in trajectory:
        assert trajectory[step] == reference[step], (step, trajectory[step], reference[step])
