"""The restart loop: SIGKILL one worker of a ``cp=2`` run under ``torchrun --max-restarts``, N times, and count the
recoveries whose losses equal an uninterrupted run's.

    python benchmarks/restart_loop.py --runs 10

The command is the documented one (docs/scale.md#a-lost-rank): 1 node x 2 processes, c10d rendezvous, without
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` (``--disable-shared-store`` sets it, to measure that path). One uninterrupted
torchrun run first is the oracle. Each trial starts the same run (6 steps, a synchronous checkpoint every 2) under
``--max-restarts`` and SIGKILLs global rank 1 once the loss row of step ``k`` is in ``metrics.csv``, ``k`` cycling
through ``--kill-after``; then it waits for torchrun (``--trial-timeout`` is a safety net against a hang, which
counts as a failure). A trial recovered when torchrun exited 0 after exactly one restart, both restarted ranks
resumed from the same complete checkpoint, no later than the newest one committed before the kill could have been
passed, and every step's loss equals the oracle's exactly.

Prints one JSON object per trial (``restart_loop.trial``: value 1 recovered / 0 not, the reason in ``shape``) and
the count (``restart_loop.recovered``: recovered trials, unit ``of N``).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RECIPE = ["seq_len=256", "logger=csv", "data.max_bytes=200000", "scheduler.warmup_steps=1", "cp=2",
          "checkpoint.async_save=false", "trainer.devices=2", "trainer.num_nodes=1"]
RESUMED = re.compile(r"\] - resuming from (\S+) \(step (\d+)\)")


def losses(run_dir: Path) -> dict[int, float]:
    """``{step: train/loss}`` of the run's CSV log, the last row of a step winning (a resumed run logs the steps
    after its checkpoint again); {} while the file is absent or being written."""
    try:
        with open(run_dir / "csv" / "metrics.csv") as f:
            return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    except (OSError, ValueError, KeyError):
        return {}


def resumed_steps(log_text: str) -> list[int]:
    """The checkpoint step every rank resumed from, in the order of ``finetune.log``."""
    return [int(m.group(2)) for m in RESUMED.finditer(log_text)]


def newest_checkpoint_by(step_row: int, every: int) -> int:
    """The newest periodic checkpoint committed once the loss row ``step_row`` (0-based: optimizer step
    ``step_row + 1``) is logged: Lightning saves in a step's ``on_train_batch_end``, before that step's row."""
    return (step_row + 1) // every * every


def verdict(reference: dict[int, float], trajectory: dict[int, float], returncode: int | None, restarts: int,
            resumed: list[int], earliest_resume: int, world: int = 2) -> str:
    """``"recovered"`` or the first reason the trial did not: torchrun's status (None: killed after the trial
    timeout), the number of restarts (exactly 1), every restarted rank's resume step (the same on all ``world``
    ranks, at least ``earliest_resume``), the losses (the oracle's steps, each equal)."""
    if returncode is None:
        return "hung: torchrun still running at the trial timeout"
    if returncode != 0:
        return f"torchrun exited {returncode}"
    if restarts != 1:
        return f"{restarts} restarts, not 1"
    if len(resumed) != world or len(set(resumed)) != 1 or resumed[0] < earliest_resume:
        return f"resumed from steps {resumed}, expected {world} ranks at one step >= {earliest_resume}"
    if trajectory.keys() != reference.keys():
        return f"logged steps {sorted(trajectory)} != {sorted(reference)}"
    for step in sorted(reference):
        if trajectory[step] != reference[step]:
            return f"step {step}: loss {trajectory[step]!r} != {reference[step]!r}"
    return "recovered"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(run_dir: Path, args: argparse.Namespace, max_restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--max-restarts",
           str(max_restarts), str(REPO / "recipes/finetune.py"), *RECIPE, f"trainer.max_steps={args.steps}",
           f"checkpoint.every_n_steps={args.every}", f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in (SHARE_STORE_VAR, "MASTER_ADDR", "MASTER_PORT")}
    env.update(WANDB_MODE="offline", PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
    if args.disable_shared_store:
        env[SHARE_STORE_VAR] = "1"
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _rank_process(agent: subprocess.Popen, rank: int):
    """The live recipe worker of global ``rank`` under ``agent`` (None once torchrun has exited)."""
    import psutil

    while agent.poll() is None:
        for p in psutil.Process(agent.pid).children(recursive=True):
            try:
                if (p.status() != psutil.STATUS_ZOMBIE and p.environ().get("RANK") == str(rank)
                        and "recipes/finetune.py" in " ".join(p.cmdline())):
                    return p
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.1)
    return None


def _finish(agent: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    """torchrun's status and output; after ``timeout`` seconds its whole session is killed and the status is None."""
    try:
        out = agent.communicate(timeout=timeout)[0]
        return agent.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        return None, agent.communicate()[0]


def trial(run_dir: Path, kill_after: int, reference: dict[int, float], args: argparse.Namespace) -> dict:
    """One kill and recovery; the trial's record (``verdict`` and what it was judged on)."""
    agent = _torchrun(run_dir, args, args.max_restarts)
    deadline = time.monotonic() + args.trial_timeout
    while agent.poll() is None and kill_after not in losses(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    victim = _rank_process(agent, 1) if time.monotonic() < deadline else None
    killed_at = max(losses(run_dir), default=None)
    if victim is not None:
        victim.kill()
    returncode, out = _finish(agent, max(deadline - time.monotonic(), 1.0))
    log = run_dir / "finetune.log"
    resumed = resumed_steps(log.read_text()) if log.exists() else []
    restarts = out.count("will restart worker group")
    reason = ("rank 1 was not killed (torchrun ended first)" if victim is None else
              verdict(reference, losses(run_dir), returncode, restarts, resumed,
                      newest_checkpoint_by(kill_after, args.every)))
    return {"kill_after_step": kill_after, "killed_after_row": killed_at, "resumed_from": resumed,
            "restarts": restarts, "returncode": returncode, "verdict": reason, "tail": out[-3000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--kill-after", type=int, nargs="+", default=[1, 2, 3, 4],
                        help="loss rows (0-based steps) after which rank 1 is killed, cycled over the trials")
    parser.add_argument("--max-restarts", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2, help="checkpoint.every_n_steps")
    parser.add_argument("--trial-timeout", type=float, default=900.0, help="seconds; a safety net against a hang")
    parser.add_argument("--disable-shared-store", action="store_true", help=f"set {SHARE_STORE_VAR}=1")
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default: a temporary directory")
    args = parser.parse_args()
    if any(not 0 <= k < args.steps - 1 for k in args.kill_after) or args.runs < 1:
        raise ValueError(f"--kill-after {args.kill_after} must be steps in 0..{args.steps - 2} and --runs "
                         f"{args.runs} >= 1")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4-restart-loop-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = {"cp": 2, "processes": 2, "max_restarts": args.max_restarts, "steps": args.steps,
             "every_n_steps": args.every, "shared_store": not args.disable_shared_store}

    agent = _torchrun(work / "uninterrupted", args, 0)
    status, out = _finish(agent, args.trial_timeout)
    reference = losses(work / "uninterrupted")
    if status != 0 or len(reference) != args.steps:
        raise RuntimeError(f"the uninterrupted run failed ({status}): {out[-3000:]}")
    recovered = 0
    for i in range(args.runs):
        kill_after = args.kill_after[i % len(args.kill_after)]
        started = time.monotonic()
        record = trial(work / f"trial{i}", kill_after, reference, args)
        ok = record["verdict"] == "recovered"
        recovered += ok
        if not ok:
            print(f"trial {i}: {record['verdict']}\n{record['tail']}", file=sys.stderr, flush=True)
        emit("restart_loop.trial", {**shape, "trial": i, "kill_after_step": kill_after,
                                    "killed_after_row": record["killed_after_row"],
                                    "resumed_from": record["resumed_from"], "verdict": record["verdict"],
                                    "seconds": round(time.monotonic() - started, 1)}, int(ok), "recovered")
        if ok and args.workdir is None:
            shutil.rmtree(work / f"trial{i}", ignore_errors=True)
    emit("restart_loop.recovered", {**shape, "runs": args.runs, "kill_after": args.kill_after}, recovered,
         f"of {args.runs}")
    if args.workdir is None and recovered == args.runs:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
