"""Run the recipes in a subprocess (never an in-process multi-rank Trainer under pytest) and read their outputs.

Lightning's ranks meet on a TCP port (``MASTER_PORT``). Two test runs on one machine must not pick the same one:
:func:`reserved_port` holds an exclusive lock file per port for as long as the recipe runs, so a concurrent suite
that probes the same free port skips it.

:func:`run_recipe` starts the recipe's first process forked from a fork server that imported torch, Lightning,
Hydra and dsv4 once (:func:`_forked_recipe`), instead of a fresh ``python recipes/finetune.py`` that imports them
again (about 8 CPU-s each). The child is the command a user types in every other respect: its own session, the
given working directory, environment and ``sys.argv``, the script run as ``__main__``, stdout / stderr captured,
``atexit`` handlers run, the exit status of ``sys.exit``. The ranks Lightning starts from it are forked likewise, from
a copy of that process taken before the script ran (:mod:`tests.e2e.forked_ranks`), with the command line,
environment and working directory Lightning gives them. The tests that signal a process, and torchrun's, start the
real command line with ``Popen``: their ranks are fresh interpreters.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
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


# What the fork server of :func:`_forked_recipe` imports once (dsv4.launch's ranks use the same server).
_RECIPE_PRELOAD = ["torch", "torch.distributed", "lightning", "dsv4.model", "dsv4.config", "hydra", "omegaconf",
                   "lightning.pytorch", "dsv4.training.run", "dsv4.training.schema"]


def _recipe_child(script: str, args: list[str], cwd: str, env: dict[str, str], out_path: str, err_path: str) -> None:
    """In the forked child: become ``python <script> <args>`` run from ``cwd`` with ``env`` (see the module
    docstring), the ranks Lightning starts forked from a copy of it (:mod:`tests.e2e.forked_ranks`), and leave with
    the script's exit status."""
    from tests.e2e import forked_ranks

    os.setsid()  # a session of its own: a timeout kills the child and the ranks it started
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    forked_ranks.become(cwd, env, script)
    forked_ranks.install()
    sys.exit(forked_ranks.run_script(script, args))


def _forked_recipe(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)`` for ``cmd`` =
    ``[python, script, *args]``, the process forked from the recipe fork server (see the module docstring)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_RECIPE_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="dsv4-recipe-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        Path(out_path).touch()
        Path(err_path).touch()
        child = ctx.Process(target=_recipe_child, args=(cmd[1], cmd[2:], str(REPO), env, out_path, err_path))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.join()
            raise subprocess.TimeoutExpired(cmd, timeout, Path(out_path).read_text(), Path(err_path).read_text())
        with contextlib.suppress(ProcessLookupError):  # ranks the run left behind (it failed half-way)
            os.killpg(child.pid, signal.SIGKILL)
        return subprocess.CompletedProcess(cmd, child.exitcode, Path(out_path).read_text(errors="replace"),
                                           Path(err_path).read_text(errors="replace"))


def run_recipe(args: list[str], run_dir: Path | None = None, timeout: float = 1800, check: bool = True,
               script: str = "recipes/finetune.py", env: dict[str, str | None] | None = None,
               ) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args``; ``env`` entries override the test environment (None removes a variable).
    The first process is forked from the recipe fork server (module docstring).

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
        proc = _forked_recipe(cmd, full_env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def kill_after(args: list[str], run_dir: Path, marker: Path, script: str = "recipes/finetune.py") -> None:
    """Start ``script`` with ``args`` into ``run_dir`` (a fresh interpreter, its own session) and SIGKILL its whole
    process group as soon as ``marker`` exists (e.g. a checkpoint's ``meta.pt``); AssertionError if it never does."""
    cmd = [sys.executable, str(REPO / script), *args, f"hydra.run.dir={run_dir}"]
    with reserved_port() as port:
        proc = subprocess.Popen(cmd, cwd=REPO, env=recipe_env(port), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 1800  # a safety net against a hang, not a performance check
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert marker.exists(), f"{script} never wrote {marker}"


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
