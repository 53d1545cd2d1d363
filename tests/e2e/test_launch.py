"""End-to-end launches: preemption by a signal, the documented multi-node torchrun command (2 nodes x 2 processes
on one machine), and torchrun restarting a group after a rank was SIGKILLed. Subprocesses on gloo CPU ranks; the
signals are sent once a marker file appears (polled), written by a test callback (``tests/e2e/launch_probes.py``)
that holds the rank at a known point, so each signal lands on a known step. Every comparison is with an
uninterrupted run."""

from __future__ import annotations

import os
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
# the probes in tests/e2e/launch_probes.py are imported by the recipe processes (every rank inherits this)
PROBES_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _wait_for_signal(step: int, marker_dir: Path, rank: int | None) -> list[str]:
    """The overrides adding :class:`tests.e2e.launch_probes.WaitForSignal` (``rank`` None: every rank)."""
    probe = "tests.e2e.launch_probes.WaitForSignal"
    return [f"+callbacks.wait._target_={probe}", f"+callbacks.wait.step={step}",
            f"+callbacks.wait.marker_dir={marker_dir}", f"+callbacks.wait.rank={'null' if rank is None else rank}"]


def _assert_stopped_with_the_preemption_save(ckpts: Path, stop: int, every: int, final: int) -> None:
    """The run stopped after ``stop``, a step that neither the periodic schedule (every ``every`` steps) nor the
    final save (``final``) writes: ``step<stop>.ckpt`` is complete and holds that step, so the preemption wrote it;
    no later step was saved, nothing is incomplete and ``last.ckpt`` is that checkpoint."""
    assert stop % every and stop != final, (stop, every, final)
    complete, incomplete = complete_checkpoints(ckpts)
    assert not incomplete, incomplete
    assert checkpoint_step(ckpts / f"step{stop}.ckpt") == stop, sorted(p.name for p in ckpts.iterdir())
    assert max(checkpoint_step(p) for p in complete) == stop, [(p.name, checkpoint_step(p)) for p in complete]
    assert checkpoint_step(ckpts / "last.ckpt") == stop


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
    """SIGTERM to rank 1 only (a child of Lightning's launcher) while a test callback holds it at the end of step 3,
    before that step's preemption check: both ranks agree on step 3, which the periodic schedule (every 2 steps)
    does not save, so step3.ckpt is the preemption's save; the job exits 143; the same command resumes from step 3
    on the uninterrupted trajectory."""
    cmd = [sys.executable, str(REPO / "recipes/finetune.py"), *PREEMPTION,
           *_wait_for_signal(3, tmp_path / "waiting", rank=1), f"hydra.run.dir={tmp_path}"]
    with reserved_port() as port:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**recipe_env(port), **PROBES_ENV}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        _wait_for(tmp_path / "waiting" / "rank1.waiting", proc)  # rank 1 is held at the end of step 3
        ranks = _rank_processes(proc)
        assert len(ranks) == 2, ranks
        child = next(p for p in ranks if p.pid != proc.pid)
        child.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=SAFETY_NET_S)
        psutil.wait_procs(ranks, timeout=SAFETY_NET_S)
    assert proc.returncode == 143, out[-6000:]
    _assert_stopped_with_the_preemption_save(tmp_path / "checkpoints", stop=3, every=2, final=6)
    assert "stopped after step 3 with a complete checkpoint" in out

    resumed = run_recipe(PREEMPTION, tmp_path)
    assert f"resuming from {tmp_path / 'checkpoints' / 'last.ckpt'}" in resumed.stdout + resumed.stderr
    trajectory = losses(tmp_path)
    assert trajectory.keys() == uninterrupted.keys() == set(range(6))
    for step in trajectory:
        assert trajectory[step] == uninterrupted[step], (step, trajectory[step], uninterrupted[step])


MULTI_NODE = [*FAST, "cp=2", "dp=2", "trainer.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.async_save=false"]


def _torchrun(args: list[str], port: int, run_dir: Path, nnodes: int = 1, node_rank: int = 0,
              extra: tuple[str, ...] = (), env: dict[str, str | None] | None = None) -> subprocess.Popen:
    """One node of the documented torchrun command (2 processes per node, c10d rendezvous) on this machine;
    ``env`` is added to torchrun's environment (its workers inherit it; None removes a variable)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", "2",
           "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *extra,
           str(REPO / "recipes/finetune.py"), *args, "trainer.devices=2", f"trainer.num_nodes={nnodes}",
           f"hydra.run.dir={run_dir}"]
    env = {**{k: v for k, v in recipe_env(port).items() if k not in ("MASTER_ADDR", "MASTER_PORT")}, **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _rank_process(agent: subprocess.Popen, rank: int, not_pid: int | None = None) -> psutil.Process:
    """The worker of global ``rank`` (its RANK variable) under the torchrun ``agent``, other than ``not_pid``."""
    deadline = time.time() + SAFETY_NET_S
    while time.time() < deadline and agent.poll() is None:
        for p in psutil.Process(agent.pid).children(recursive=True):
            try:
                if (p.pid != not_pid and p.status() != psutil.STATUS_ZOMBIE and p.environ().get("RANK") == str(rank)
                        and "recipes/finetune.py" in " ".join(p.cmdline())):
                    return p
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under torchrun {agent.pid} (exit status {agent.poll()})")


def _two_nodes(port: int, run_dir: Path, extra_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    return [_torchrun([*MULTI_NODE, *extra_args], port, run_dir, nnodes=2, node_rank=node, env=env)
            for node in (0, 1)]


def test_two_node_torchrun_matches_lightning_and_its_sigterm_checkpoint_resumes(tmp_path):
    """The README's torchrun command as 2 nodes x 2 processes on this machine (cp=2 dp=2, one run dir for all
    ranks): every worker is held by a test callback at the end of step 3 until it got a signal; SIGTERM to both
    torchrun agents (as a scheduler does) is forwarded to every worker, which stop after step 3 with a checkpoint
    (status 143). Step 3 is neither periodic (every 2 steps) nor the last (4), so step3.ckpt is the preemption's
    save. Every loss is the Lightning launcher's for the same config, and the Lightning launcher on one node resumes
    the 2-node job's checkpoint on the same trajectory (torchrun resuming its own checkpoints:
    test_torchrun_max_restarts_...)."""
    run_recipe(MULTI_NODE, tmp_path / "lightning")
    reference = losses(tmp_path / "lightning")
    run = tmp_path / "torchrun"
    with reserved_port() as port:
        agents = _two_nodes(port, run, extra_args=tuple(_wait_for_signal(3, tmp_path / "waiting", rank=None)),
                            env=PROBES_ENV)
        _wait_for(tmp_path / "waiting" / "rank0.waiting", agents[0])  # rank 0 is held at the end of step 3
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        outs = [agent.communicate(timeout=SAFETY_NET_S)[0] for agent in agents]
    for agent, out in zip(agents, outs):
        assert agent.returncode != 0 and "SignalException" in out, out[-6000:]  # torchrun re-raises the signal
    _assert_stopped_with_the_preemption_save(run / "checkpoints", stop=3, every=2, final=4)
    # every one of the 4 workers left through the preemption exit (status 143), after step 3
    assert (run / "finetune.log").read_text().count("preempted: stopped after step 3 ") == 4
    run_recipe(MULTI_NODE, run)
    assert f"resuming from {run / 'checkpoints' / 'last.ckpt'}" in (run / "finetune.log").read_text()
    trajectory = losses(run)
    assert trajectory.keys() == reference.keys() == set(range(4))
    for step in trajectory:
        assert trajectory[step] == reference[step], (step, trajectory[step], reference[step])


def _logged_losses(run_dir: Path) -> dict[int, float]:
    """The losses in ``metrics.csv`` so far ({} while it is absent or being rewritten)."""
    try:
        return losses(run_dir)
    except (OSError, ValueError, KeyError):
        return {}


RESTARTS = [*PREEMPTION, "checkpoint.async_save=false"]  # synchronous: step4.ckpt is committed before step 5 starts


def test_torchrun_max_restarts_resumes_from_the_newest_complete_checkpoint_after_sigkills(uninterrupted, tmp_path):
    """torchrun --max-restarts=2 (1 node x 2 processes, cp=2), the documented command as written (no
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE): the workers share torchrun's TCP store, which keeps every round's keys, and
    each round forms its group under keys of its own (docs/scale.md#a-lost-rank). Rank 1 is SIGKILLed twice. First
    inside the step-4 save (held there by the test callback :class:`tests.e2e.launch_probes.StallInsideSave` after
    step4.ckpt.partial was created): the restarted group skips the partial and resumes from step 2.
    Then during step 5 (step 4 committed and its loss logged): the next restart resumes from step 4. The run
    finishes with exactly the uninterrupted run's losses."""
    with reserved_port() as port:
        stall = ["+callbacks.stall._target_=tests.e2e.launch_probes.StallInsideSave",
                 "+callbacks.stall.name=step4.ckpt", "+callbacks.stall.rank=1"]
        agent = _torchrun([*RESTARTS, *stall], port, tmp_path, extra=("--max-restarts", "2"),
                          env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": None, "LOGLEVEL": "INFO", **PROBES_ENV})
        ckpts = tmp_path / "checkpoints"
        _wait_for(ckpts / "step4.ckpt.stalled", agent)  # rank 1 stopped inside the step-4 save
        killed = _rank_process(agent, 1)
        assert (ckpts / "step4.ckpt.partial").is_dir() and not (ckpts / "step4.ckpt").exists()
        killed.kill()
        _wait_for(ckpts / "step4.ckpt" / "meta.pt", agent)  # the restarted group committed step 4
        while agent.poll() is None and 3 not in _logged_losses(tmp_path):  # step 4's loss row: step 5 is under way
            time.sleep(0.1)
        _rank_process(agent, 1, not_pid=killed.pid).kill()
        out = agent.communicate(timeout=SAFETY_NET_S)[0]
    assert agent.returncode == 0, out[-6000:]
    assert out.count("will restart worker group") == 2 and "exitcode: -9" in out, out[-6000:]
    log = (tmp_path / "finetune.log").read_text()
    resumed = [line.rpartition("resuming from ")[2] for line in log.splitlines() if "] - resuming from " in line]
    # every rank logs its choice: both ranks of the first restart took step 2, both of the second step 4; no partial
    assert resumed == [f"{ckpts / 'last.ckpt'} (step 2)"] * 2 + [f"{ckpts / 'last.ckpt'} (step 4)"] * 2, resumed
    assert f"not resuming from {ckpts / 'step4.ckpt.partial'}: incomplete" in log
    # each of the 3 rounds formed its group under keys of its own on the shared store, both ranks under the same
    scopes = [line.rpartition("process group keys under ")[2].split()[0] for line in log.splitlines()
              if "process group keys under " in line]
    assert len(scopes) == 6 and len(set(scopes)) == 3 and all(scopes.count(s) == 2 for s in scopes), scopes
    complete, incomplete = complete_checkpoints(ckpts)
    assert not incomplete and checkpoint_step(ckpts / "last.ckpt") == 6, (complete, incomplete)
    trajectory = losses(tmp_path)
    assert trajectory.keys() == uninterrupted.keys() == set(range(6))
    for step in trajectory:
        assert trajectory[step] == uninterrupted[step], (step, trajectory[step], uninterrupted[step])
