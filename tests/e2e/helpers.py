"""Run the recipes in a subprocess (never an in-process multi-rank Trainer under pytest) and read their outputs.

Lightning's ranks meet on a TCP port (``MASTER_PORT``). Two test runs on one machine must not pick the same one:
:func:`reserved_port` holds an exclusive lock file per port for as long as the recipe runs, so a concurrent suite
that probes the same free port skips it.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[2]
FAST = ["seq_len=256", "logger=csv", "data.max_bytes=200000", "scheduler.warmup_steps=1"]
_PORT_LOCKS = Path(tempfile.gettempdir()) / "dsv4-test-ports"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def reserved_port(probe: Callable[[], int] = free_port) -> Iterator[int]:
    """A free TCP port that no other holder of this context manager (any process) gets until it exits."""
    _PORT_LOCKS.mkdir(exist_ok=True)
    while True:
        port = probe()
        lock = open(_PORT_LOCKS / f"{port}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another run holds this port: probe again
            lock.close()
            continue
        try:
            yield port
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
        return


def recipe_env(port: int) -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("DSV4_SWEEP_CHILD", None)
    return env


def check_output_dir(args: list[str], run_dir: Path | None) -> None:
    """ValueError unless the recipe command gets a directory of its own: ``run_dir`` or a ``hydra.run.dir=``
    argument, and for a sweep (``-m`` / ``--multirun``) a ``hydra.sweep.dir=`` argument."""
    sweep = "-m" in args or "--multirun" in args
    key = "hydra.sweep.dir=" if sweep else "hydra.run.dir="
    if any(str(a).startswith(key) for a in args) or (run_dir is not None and not sweep):
        return
    raise ValueError(f"run_recipe({args!r}): pass {'a ' + key + ' argument' if sweep else 'run_dir'} (under the "
                     f"test's tmp_path); the default {'multirun/' if sweep else 'outputs/'} is shared by concurrent "
                     "test runs")


def run_recipe(args: list[str], run_dir: Path | None = None, timeout: float = 1800, check: bool = True,
               script: str = "recipes/finetune.py", env: dict[str, str | None] | None = None,
               ) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args``; ``env`` entries override the test environment (None removes a variable).

    The run writes into ``run_dir`` (``hydra.run.dir``), or a sweep (``-m``) into the ``hydra.sweep.dir=`` of its
    ``args``: never into ``outputs/`` or ``multirun/`` of the repository, which two test runs at once would share
    (:func:`check_output_dir`)."""
    check_output_dir(args, run_dir)
    cmd = [sys.executable, str(REPO / script), *args]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    with reserved_port() as port:
        full_env = {**recipe_env(port), **(env or {})}
        full_env = {k: v for k, v in full_env.items() if v is not None}
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
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


def assert_export_holds_the_loaded_weights(source: dict, exported: dict) -> None:
    """A run with lr = 0 exports exactly the weights it loaded (state dicts, same keys): the load really happened on
    every rank; the routers' load-balancing biases moved by exactly one update (+-1e-3), which is not an optimizer
    step."""
    import torch

    assert exported.keys() == source.keys()
    for name, ours in source.items():
        if name.endswith("e_score_correction_bias"):
            torch.testing.assert_close((exported[name] - ours).abs(), torch.full_like(ours, 1e-3))
        else:
            assert torch.equal(ours, exported[name]), name
