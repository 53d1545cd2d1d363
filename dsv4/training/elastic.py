"""Forming the default process group: it forms within ``startup_timeout`` or the start-up fails with a message
naming the cause, also after torchrun (``torch.distributed.run``) restarted the workers.

Why a restart needs care. torchrun's c10d rendezvous by default shares one TCP store with its workers
(``TORCHELASTIC_USE_AGENT_STORE=True``; ``MASTER_ADDR:MASTER_PORT`` is that store): node rank 0's agent hosts it for
as long as the agent lives, across every restart of the worker group. ``torch.distributed.init_process_group``
(env://) writes the group's keys into it without a per-round prefix: ``default_pg/<group>//cpu/<rank>``, each rank's
gloo address, which its peers read (NCCL's unique id likewise). A restarted worker finds the dead round's keys: a
rank that reads a peer's key before that peer wrote its new one connects to the dead round's port (gloo:
``connectFullMesh ... Connection refused``, or a connection that never completes). Which rank is first is a race.

The scope. Every round's keys go under a prefix that no earlier round used: ``dsv4/rounds/<run id>/<token>/``,
``<token>`` a random id drawn by this round's rank 0 (:func:`agree_on_round`). A follower cannot tell a stale
leader key from a current one by reading it, so it proves it: it answers the token it read with a fresh id of its
own under that token, and only the leader that drew the token answers that id. ``TORCHELASTIC_RESTART_COUNT`` would
not do: each agent counts its own restarts, and an agent whose workers were restarted because another node's failed
(a membership change) does not count it, so nodes disagree.

With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment, and under Lightning's launcher or SLURM,
rank 0 hosts a fresh store each start (env://): no earlier key exists there and no scope is needed.

Bounded. The store's waits, the group's connections and a first all-reduce run under ``startup_timeout``; a group
that does not form raises :class:`ProcessGroupStartupError`. gloo does not always keep its own timeout (a rank
connected to a peer that gave up waits in ``connectFullMesh``), so a watchdog ends a rank still blocked
``WATCHDOG_GRACE_S`` after the deadline: it logs the same message and exits with status 1, which torchrun sees as a
failed worker. The group then gets the training ``timeout``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ROUNDS_PREFIX = "dsv4/rounds"
_MAX_POLL_S = 1.0
WATCHDOG_GRACE_S = 5.0  # past the start-up timeout, a rank still blocked inside torch.distributed exits


class ProcessGroupStartupError(RuntimeError):
    """The default process group did not form within the start-up timeout."""


def _abort(message: str) -> None:
    """The watchdog's end of a start-up still blocked past its timeout: log ``message``, exit with status 1."""
    log.error("%s", message)
    sys.stderr.write(f"ProcessGroupStartupError: {message}\n")
    sys.stderr.flush()
    os._exit(1)


def uses_agent_store(env: Mapping[str, str]) -> bool:
    """True for a worker whose ``MASTER_ADDR:MASTER_PORT`` is torchrun's agent store, which outlives the worker
    group and so holds the keys of every earlier round."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _remaining(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def agree_on_round(store: dist.Store, rank: int, world_size: int, deadline: float, run_id: str = "none") -> str:
    """The token of this start, the same on every rank, never one an earlier start of ``run_id`` used, though
    ``store`` may hold every earlier start's keys. Rank 0 draws it and publishes it under ``<prefix>/leader``; every
    other rank reads that key (perhaps an earlier leader's token), writes a fresh id of its own under
    ``<prefix>/<token read>/hello/<rank>`` and waits for ``<prefix>/welcome/<id>``, which only the leader that drew
    the token writes once it has read every rank's hello under it; a rank that read a stale token rereads the leader
    key until it changes. A ``DistStoreError`` when ``deadline`` (``time.monotonic()``) passes first."""
    prefix = f"{ROUNDS_PREFIX}/{run_id}"
    leader_key = f"{prefix}/leader"
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(leader_key, token)
        hellos = [f"{prefix}/{token}/hello/{r}" for r in range(1, world_size)]
        if hellos:
            store.wait(hellos, _remaining(deadline))
            for nonce in store.multi_get(hellos):
                store.set(f"{prefix}/welcome/{nonce.decode()}", token)
        return token
    nonce = uuid.uuid4().hex
    welcome = f"{prefix}/welcome/{nonce}"
    answered = None  # the token this rank wrote its hello under
    poll = 0.01
    while True:
        if store.check([welcome]):
            return store.get(welcome).decode()
        if time.monotonic() >= deadline:
            raise dist.DistStoreError(f"rank {rank}: no leader answered under {prefix} (the token read last: "
                                      f"{answered}; rank 0 did not start, or started and died)")
        store.set_timeout(_remaining(deadline))
        token = store.get(leader_key).decode()  # waits for the first leader of the run
        if token != answered:
            store.set(f"{prefix}/{token}/hello/{rank}", nonce)
            answered = token
            poll = 0.01
        time.sleep(poll)
        poll = min(2 * poll, _MAX_POLL_S)


def form_process_group(backend: str, address: str, port: int, rank: int, world_size: int, *,
                       startup_timeout: timedelta, timeout: timedelta, device: torch.device | None = None,
                       env: Mapping[str, str] = os.environ) -> str | None:
    """Initialise the default process group of ``world_size`` ranks meeting at ``address:port`` and check it with
    an all-reduce, all within ``startup_timeout``; then set the group's (and its store's) timeout to ``timeout``.

    Under torchrun's shared agent store (:func:`uses_agent_store`) the group's keys go under this start's own
    prefix (:func:`agree_on_round`); otherwise init is env:// on a store rank 0 hosts. ``device``: the
    accelerator the group is bound to (NCCL), None on the CPU. Raises :class:`ProcessGroupStartupError` naming the
    rank, the address, the timeout and the likely causes when the group does not form in time. Returns the key
    prefix of this start on the agent store, None on a store of its own."""
    deadline = time.monotonic() + startup_timeout.total_seconds()
    agent_store = uses_agent_store(env)
    where = "torchrun's agent store" if agent_store else "the store rank 0 hosts"

    def failure(cause: str) -> str:
        return (f"rank {rank} of {world_size}: the {backend} process group did not form within "
                f"{startup_timeout.total_seconds():g} s ({where}, {address}:{port}): a rank did not start, died while "
                f"starting, or cannot reach {address}:{port} or its peers' addresses; ranks that start further apart "
                f"need a longer trainer.startup_timeout_s. Cause: {cause}")

    watchdog = threading.Timer(startup_timeout.total_seconds() + WATCHDOG_GRACE_S, _abort,
                               args=(failure("still waiting inside torch.distributed; the process exits"),))
    watchdog.daemon = True
    watchdog.start()
    prefix = None
    try:
        if agent_store:
            store = dist.TCPStore(address, port, world_size=world_size, is_master=False, timeout=startup_timeout)
            run_id = env.get("TORCHELASTIC_RUN_ID", "none")
            token = agree_on_round(store, rank, world_size, deadline, run_id)
            store.set_timeout(_remaining(deadline))
            prefix = f"{ROUNDS_PREFIX}/{run_id}/{token}"
            log.info("process group keys under %s/ (torchrun restart count %s)", prefix,
                     env.get("TORCHELASTIC_RESTART_COUNT", "0"))
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store),
                                    rank=rank, world_size=world_size, timeout=_remaining(deadline), device_id=device)
        else:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                    timeout=_remaining(deadline), device_id=device)
        probe = torch.ones(1, device=device if device is not None else "cpu")
        dist.all_reduce(probe)
        if int(probe.item()) != world_size:
            raise RuntimeError(f"the first all-reduce summed {probe.item()} ones, not {world_size}")
    except (RuntimeError, TimeoutError) as exc:
        raise ProcessGroupStartupError(failure(f"{type(exc).__name__}: {exc}")) from exc
    finally:
        watchdog.cancel()
    dist.distributed_c10d._set_pg_timeout(timeout)
    dist.distributed_c10d._get_default_store().set_timeout(timeout)
    return prefix
