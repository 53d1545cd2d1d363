"""Launches through submitit and SLURM without a cluster: every SLURM task is the rank SLURM gave it (through the
sweep job's child environment into Lightning's ``SLURMEnvironment``), the layout and submitit checks refuse bad
settings before any work, the preemption signal reaches the training before submitit requeues, and
``hydra/launcher=slurm`` writes the sbatch script it should. The end-to-end sweep with a requeue through submitit's
local executor is ``tests/e2e/test_finetune.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.training.run import run_finetune, sweep_child_env
from dsv4.training.slurm import check_slurm_layout, cluster_plugins
from dsv4.training.submitit_job import (ForwardSignals, SubmititTask, check_submitit_task, hand_over,
                                        should_requeue, submitit_task)

CONF = Path(__file__).resolve().parents[3] / "conf"
USR2, TERM = signal.SIGUSR2, signal.SIGTERM


def _slurm_task(rank: int, nodes: int = 2, per_node: int = 2) -> dict[str, str]:
    """The variables SLURM gives task ``rank`` of ``sbatch --nodes=2 --ntasks-per-node=2`` + ``srun``."""
    return {"SLURM_NTASKS": str(nodes * per_node), "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node), "SLURM_JOB_ID": "734242",
            "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_NAME": "finetune"}


@pytest.mark.parametrize("rank", range(4))
def test_each_slurm_task_is_the_rank_slurm_gave_it_and_lightning_starts_no_process(rank, monkeypatch):
    """A task of a 2 nodes x 2 tasks job (the environment submitit's task leaves its training command, a previous
    job's RANK / MASTER_PORT removed): Lightning's SLURMEnvironment reads global, local and node rank and world
    size from SLURM, meets at the first node on the job's port, starts no process, and does not requeue itself."""
    import lightning as L
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from dsv4.training.strategy import DSV4Strategy

    left_over = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500", "MASTER_ADDR": "elsewhere"}
    env = sweep_child_env({"PATH": os.environ["PATH"], **left_over, **_slurm_task(rank)})
    for key in [*os.environ]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    trainer = L.Trainer(strategy=DSV4Strategy(cp=2), plugins=cluster_plugins(os.environ), accelerator="cpu",
                        devices=2, num_nodes=2, logger=False, enable_progress_bar=False)
    cluster = trainer.strategy.cluster_environment
    assert isinstance(cluster, SLURMEnvironment) and not cluster.auto_requeue
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == (rank, rank % 2,
                                                                                                 rank // 2, 4)
    assert (cluster.main_address, cluster.main_port) == ("gpu07", 15000 + 4242)  # Lightning: the job id's last 4
    assert trainer.strategy.launcher is None  # SLURM created the processes


def test_a_slurm_layout_that_disagrees_with_the_trainer_is_refused_before_anything_is_written(tmp_path,
                                                                                              monkeypatch):
    task = _slurm_task(0)
    with pytest.raises(ValueError, match=r"`trainer.devices`=4 but SLURM starts 2 tasks per node"):
        check_slurm_layout({"devices": 4, "num_nodes": 2}, task)
    with pytest.raises(ValueError, match=r"`trainer.num_nodes`=1 but the SLURM job has 2 nodes"):
        check_slurm_layout({"devices": 2, "num_nodes": 1}, task)
    check_slurm_layout({"devices": 2, "num_nodes": 2}, task)
    check_slurm_layout({"devices": "auto", "num_nodes": 2}, task)  # the GPUs a task sees: Lightning checks it
    check_slurm_layout({"devices": 4, "num_nodes": 1}, {**task, "SLURM_JOB_NAME": "bash"})  # an interactive shell
    check_slurm_layout({"devices": 4, "num_nodes": 1}, {})
    # srun torchrun ...: one task per node, torchrun's workers are the ranks (as Lightning decides: TorchElastic first)
    worker = {**_slurm_task(0, nodes=2, per_node=1), "RANK": "3", "GROUP_RANK": "0", "LOCAL_RANK": "3",
              "LOCAL_WORLD_SIZE": "4"}
    check_slurm_layout({"devices": 4, "num_nodes": 2}, worker)
    assert cluster_plugins(worker) == []
    # through the recipe's entry point, before the plan, the data or any file: a cp=2 run in a one-task SLURM job
    # (Lightning itself compares them only when it starts the processes, never under SLURM)
    from tests.unit.training.test_run import FAST, _compose

    for key, value in _slurm_task(0, nodes=1, per_node=1).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"`trainer.devices`=2 but SLURM starts 1 tasks per node"):
        run_finetune(_compose([*FAST, "cp=2"]), tmp_path)
    assert not any(tmp_path.iterdir())


def test_submitit_task_and_its_checks(monkeypatch):
    assert submitit_task({}) is None
    for key, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "77", "SUBMITIT_LOCAL_NTASKS": "1",
                       "SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_LOCALID": "0", "SUBMITIT_LOCAL_NODEID": "0",
                       "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"}.items():
        monkeypatch.setenv(key, value)
    assert submitit_task() == SubmititTask(executor="local", global_rank=0, num_tasks=1, signal=USR2)
    from dsv4.training.options.preemption import PreemptionSpec
    from tests.unit.training.test_run import _compose

    for defaults in (_compose([]).preemption.signals, PreemptionSpec().signals):  # conf/finetune.yaml, the schema
        check_submitit_task(SubmititTask("slurm", 0, 8, USR2), defaults)
    check_submitit_task(SubmititTask("local", 0, 1, USR2), ())  # preemption off
    check_submitit_task(SubmititTask("slurm", 5, 16, USR2), ("SIGUSR2",))  # SLURM: one task per rank
    with pytest.raises(ValueError, match=r"`hydra.launcher.tasks_per_node`=2: the local executor would run this "
                                         r"job 2 times"):
        check_submitit_task(SubmititTask("local", 0, 2, USR2), ("SIGUSR2",))
    with pytest.raises(ValueError, match=r"`preemption.signals`=\['SIGTERM'\] leaves out SIGUSR2"):
        check_submitit_task(SubmititTask("slurm", 0, 8, USR2), ("SIGTERM",))


def test_only_submitits_signal_during_an_unfinished_training_requeues():
    task = SubmititTask("slurm", 0, 8, USR2)
    assert should_requeue(task, [USR2], 143)  # stopped with its checkpoint
    assert should_requeue(task, [USR2], -12)  # killed by the signal before its handler was installed
    assert not should_requeue(task, [USR2], 0)  # it finished first
    assert not should_requeue(task, [TERM], 143)  # the cluster's SIGTERM (a cancel or its own preemption)
    assert not should_requeue(task, [], 1)  # an error


_CHILD = ("import signal, sys, time\n"
          "signal.signal(signal.SIGUSR2, lambda *a: sys.exit(143))\n"
          "print('ready', flush=True)\n"
          "time.sleep(60)\n")


def test_the_preemption_signal_goes_to_the_training_and_submitits_handler_runs_after_it():
    """submitit's handler (here a recorder) is replaced while the child runs: the signal reaches the child (exit
    143, its own handler), not the handler; afterwards the handler is back and ``hand_over`` runs it with the
    signal, as submitit would have."""
    calls = []
    previous = signal.signal(USR2, lambda signum, frame: calls.append(signum))
    try:
        with ForwardSignals((USR2, TERM)) as forward:
            os.kill(os.getpid(), USR2)  # before the child exists: sent once it is attached
            child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
            assert child.stdout.readline() == "ready\n"
            forward.attach(child)
            status = child.wait(timeout=60)
        assert (status, forward.received, calls) == (143, [USR2], [])
        handler = signal.getsignal(USR2)
        assert handler is forward.previous[USR2] and handler is not forward._forward
        hand_over(SubmititTask("local", 0, 1, USR2), handler, status)
        assert calls == [int(USR2)]
        with pytest.raises(RuntimeError, match="no handler for SIGUSR2"):
            hand_over(SubmititTask("local", 0, 1, USR2), signal.SIG_DFL, status)
    finally:
        signal.signal(USR2, previous)


def test_slurm_launcher_config_writes_the_sbatch_script(tmp_path, monkeypatch):
    """``-m hydra/launcher=slurm trainer.num_nodes=2 hydra.launcher.partition=gpu`` through the plugin's own
    launch (sbatch is not called: the script it would submit is kept): nodes from ``trainer.num_nodes``, one task
    per GPU, submitit's signal 120 s before the 4-hour limit, requeueable, one array task per job."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from submitit.slurm.slurm import SlurmExecutor

    from dsv4.training.schema import register_schema

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit's executor looks for srun on PATH
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    scripts = []

    class Submitted(Exception):
        pass

    def submit(self, command):
        scripts.append(self._make_submission_file_text(command, "uid"))
        raise Submitted

    monkeypatch.setattr(SlurmExecutor, "_submit_command", submit)
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="finetune"):
        cfg = compose(config_name="finetune", return_hydra_config=True,
                      overrides=["hydra/launcher=slurm", "trainer.num_nodes=2", "hydra.launcher.partition=gpu",
                                 f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=lambda c: None, config=cfg)
    with pytest.raises(Submitted):
        launcher.launch([["optim.lr=0.001"], ["optim.lr=0.002"]], initial_job_idx=0)
    lines = scripts[0].splitlines()
    for flag in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--signal=USR2@120", "--time=240",
                 "--requeue", "--partition=gpu", "--array=0-1%2", "--job-name=finetune"):
        assert f"#SBATCH {flag}" in lines, (flag, lines)
    assert any(line.startswith("srun ") and "-m submitit.core._submit" in line for line in lines), lines
