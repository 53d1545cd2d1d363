"""Ranks created by SLURM (``srun python recipes/finetune.py ...``, or ``hydra/launcher=slurm``: one SLURM task per
rank, docs/scale.md#slurm).

Every SLURM task is one rank: Lightning's ``SLURMEnvironment`` reads ``SLURM_PROCID`` (global rank),
``SLURM_LOCALID`` (local rank), ``SLURM_NODEID`` (node rank), ``SLURM_NTASKS`` (world size), the first host of
``SLURM_NODELIST`` (the rendezvous address) and ``SLURM_JOB_ID`` (the port, unless ``MASTER_PORT`` is set), and
starts no process itself. ``trainer.devices`` must equal the tasks per node and ``trainer.num_nodes`` the nodes, which
Lightning compares only when it starts the processes itself (never under SLURM; a mismatch would build the wrong
mesh or wait for ranks that never come): checked here before any work (:func:`check_slurm_layout`). Its own requeue on SIGUSR1 (an ``hpc_ckpt_*.ckpt`` that a later
start would load in place of ``checkpoint.resume``) is switched off: preemption and requeue go through dsv4's
handler (:mod:`dsv4.callbacks.preemption`, :mod:`dsv4.training.submitit_job`).
"""

from __future__ import annotations

from typing import Any, Mapping


_TORCHRUN_WORKER = frozenset({"RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"})


def slurm_tasks(environ: Mapping[str, str]) -> bool:
    """True when SLURM created this process as one of its ranks (Lightning's own test, in its order: not a torchrun
    worker, which ``srun torchrun ...`` also is and whose ranks torchrun gives; ``SLURM_NTASKS`` set; not an
    interactive ``bash`` / ``interactive`` allocation)."""
    if _TORCHRUN_WORKER <= environ.keys():
        return False
    return "SLURM_NTASKS" in environ and environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def cluster_plugins(environ: Mapping[str, str]) -> list[Any]:
    """The cluster environment to hand ``lightning.Trainer(plugins=...)``: under SLURM tasks Lightning's
    ``SLURMEnvironment`` with its automatic requeue off; elsewhere none (Lightning detects torchrun or starts the
    ranks itself)."""
    if not slurm_tasks(environ):
        return []
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)]


def check_slurm_layout(trainer: Mapping[str, Any], environ: Mapping[str, str]) -> None:
    """Under SLURM tasks: ``trainer.devices`` (when a number) must equal the tasks per node
    (``SLURM_NTASKS_PER_NODE``, ``hydra.launcher.tasks_per_node``) and ``trainer.num_nodes`` the nodes
    (``SLURM_NNODES``, ``hydra.launcher.nodes``); a ValueError names both numbers. Outside SLURM: nothing."""
    if not slurm_tasks(environ):
        return
    per_node, nodes = environ.get("SLURM_NTASKS_PER_NODE"), environ.get("SLURM_NNODES")
    devices = trainer.get("devices", 1)
    if per_node is not None and per_node.isdigit() and isinstance(devices, int) and devices != int(per_node):
        raise ValueError(f"`trainer.devices`={devices} but SLURM starts {per_node} tasks per node "
                         f"(hydra.launcher.tasks_per_node / --ntasks-per-node): every SLURM task is one rank, so "
                         "they must be equal")
    num_nodes = trainer.get("num_nodes", 1)
    if nodes is not None and nodes.isdigit() and num_nodes != int(nodes):
        raise ValueError(f"`trainer.num_nodes`={num_nodes} but the SLURM job has {nodes} nodes "
                         "(hydra.launcher.nodes / --nodes): they must be equal")
