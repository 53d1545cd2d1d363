"""A ``-m`` sweep job launched by submitit (``hydra/launcher=slurm`` / ``local``, or the plugin's bare
``submitit_slurm`` / ``submitit_local``): where it runs, the checks before it starts, and preemption -> checkpoint
-> requeue (docs/scale.md#slurm).

submitit runs each job as ``python -m submitit.core._submit <folder>`` (one such task process per SLURM task; one
on this machine with the local executor), which calls the Hydra job; :func:`dsv4.training.run.run_sweep_job` then
trains in a child process, the recipe's own single-run command. So:

* SLURM creates every rank: each task's child is the rank ``SLURM_PROCID`` (:mod:`dsv4.training.slurm`) and
  Lightning starts no process. A local job has one task, whose child starts its ``dp x cp`` ranks itself; more
  local tasks would be copies of one run writing one directory, and are refused (:func:`check_submitit_task`).
* Preemption: submitit asks for its signal (``SIGUSR2``, or ``SUBMITIT_PREEMPT_SIGNAL``) ``signal_delay_s`` before
  the time limit, and its handler in the task process checkpoints the job (the Hydra launcher resubmits the same
  job) and requeues it at once. While the child trains, :class:`ForwardSignals` holds that signal and SIGTERM in the
  task process and sends them on to the child, whose :class:`~dsv4.callbacks.preemption.Preemption` finishes the
  step, writes a complete checkpoint and exits with ``preemption.exit_code``; only then does :func:`hand_over` run
  submitit's handler, which requeues (SLURM: ``scontrol requeue``; local: the task exits with status 144 and the
  executor starts it again). The rerun is the same job in the same run dir and resumes from that checkpoint
  (``checkpoint.resume=auto``). Task 0 requeues; the other tasks' handler returns, and their job returns nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

log = logging.getLogger("dsv4")


@dataclass(frozen=True)
class SubmititTask:
    """This process's place in a submitit job: ``executor`` (``local`` | ``slurm``), ``global_rank`` and
    ``num_tasks`` (over all nodes), and ``signal``, the one submitit sends before the time limit."""

    executor: str
    global_rank: int
    num_tasks: int
    signal: signal.Signals


def submitit_task(environ: Mapping[str, str] = os.environ) -> SubmititTask | None:
    """The submitit task this process is (None outside one: ``SUBMITIT_EXECUTOR`` is unset)."""
    executor = environ.get("SUBMITIT_EXECUTOR")
    if not executor:
        return None
    import submitit

    from dsv4.callbacks.preemption import signal_of

    job = submitit.JobEnvironment()
    return SubmititTask(executor=executor, global_rank=job.global_rank, num_tasks=job.num_tasks,
                        signal=signal_of("SIG" + submitit.JobEnvironment.USR_SIG))


def check_submitit_task(task: SubmititTask, preemption_signals: Iterable[str]) -> None:
    """Refuse, before the job trains: more than one local task (each would run the whole job into the same run dir),
    and ``preemption.signals`` that leave out submitit's signal (it would kill the training without a checkpoint;
    ``[]`` turns preemption off and is accepted: the requeued job resumes from the newest periodic checkpoint)."""
    if task.executor == "local" and task.num_tasks > 1:
        raise ValueError(f"`hydra.launcher.tasks_per_node`={task.num_tasks}: the local executor would run this job "
                         f"{task.num_tasks} times into one run dir; keep 1 (the job starts its dp x cp ranks itself)")
    signals = tuple(preemption_signals)
    if signals and task.signal.name not in signals:
        raise ValueError(f"`preemption.signals`={list(signals)} leaves out {task.signal.name}, the signal submitit "
                         "sends before the time limit (SUBMITIT_PREEMPT_SIGNAL): add it, or set "
                         "preemption.signals=[] to let it end the training without a checkpoint")


@dataclass
class ForwardSignals:
    """Inside the ``with`` block ``signals`` received by this process are recorded in :attr:`received` and sent on to
    :attr:`child` (once it is set: a signal that came first is sent when it is); afterwards the handlers that were
    installed before (submitit's) are back, in :attr:`previous` as well."""

    signals: tuple[signal.Signals, ...]
    child: subprocess.Popen | None = None
    received: list[signal.Signals] = field(default_factory=list)
    previous: dict[signal.Signals, Any] = field(default_factory=dict)

    def __enter__(self) -> "ForwardSignals":
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self._forward)
        return self

    def attach(self, child: subprocess.Popen) -> None:
        self.child = child
        for sig in self.received:
            self._send(sig)

    def _forward(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        self.received.append(sig)
        self._send(sig)

    def _send(self, sig: signal.Signals) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(sig)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def should_requeue(task: SubmititTask, received: Iterable[signal.Signals], status: int) -> bool:
    """Requeue when submitit's signal came while the child trained and the child did not finish (any non-zero
    status: ``preemption.exit_code`` after its checkpoint, or killed by the signal before its handler was
    installed). A child that finished (0) is done; one stopped by SIGTERM alone (the cluster's preemption or a
    cancel) is not requeued here."""
    return status != 0 and task.signal in tuple(received)


def hand_over(task: SubmititTask, handler: Any, status: int) -> None:
    """Run submitit's handler for its signal, as submitit would have on the signal itself: on task 0 it checkpoints
    the job and requeues it (the process exits); on other tasks it returns."""
    if not callable(handler):
        raise RuntimeError(f"submitit task {task.global_rank}: no handler for {task.signal.name} to requeue with "
                           f"({handler!r}); the job is not requeued")
    log.warning("submitit %s task %d: %s during training, which stopped with status %d; submitit requeues the job "
                "(the rerun resumes from the newest complete checkpoint)", task.executor, task.global_rank,
                task.signal.name, status)
    handler(int(task.signal), None)
