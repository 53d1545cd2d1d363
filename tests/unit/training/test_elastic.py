"""Forming the default process group (:mod:`dsv4.training.elastic`): on torchrun's agent store, which keeps every
earlier round's keys, a restarted group forms on keys of its own; a group that cannot form fails within the
start-up timeout, naming the cause. Forked gloo ranks (:func:`dsv4.launch.run_on_ranks`); the test process hosts
the store, as torchrun's agent does, for both rounds."""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks
from dsv4.training import elastic
from dsv4.training.elastic import ROUNDS_PREFIX, ProcessGroupStartupError, form_process_group, uses_agent_store
from tests.e2e.helpers import free_port

HEAD_START_S = 2.0  # round 1's rank 1 reads the store this long before rank 0 starts: an ordering aid, not a bound


def _form(rank: int, world_size: int, port: int, started: str | None) -> dict:
    """One torchrun worker: the group formed by :func:`form_process_group` on the store at ``port``, then a sum.
    ``started`` (round 1): rank 1 sets this key as it starts forming; rank 0 starts ``HEAD_START_S`` after it, so
    rank 1 reads the store before any key of its round is there."""
    dist.destroy_process_group()  # run_on_ranks' own group: this rank forms the group a recipe worker forms
    if started is not None:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        if rank == 1:
            store.set(started, "1")
        else:
            store.wait([started])
            time.sleep(HEAD_START_S)
    try:
        prefix = form_process_group("gloo", "127.0.0.1", port, rank, world_size,
                                    startup_timeout=timedelta(seconds=60), timeout=timedelta(minutes=5))
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"prefix": prefix, "sum": total.item()}


@pytest.fixture()
def agent_store(monkeypatch):
    """A TCP store that outlives the ranks, and the environment torchrun gives workers that share it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    run_id = uuid.uuid4().hex[:8]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    yield store, run_id


def test_a_restarted_group_forms_on_an_agent_store_holding_the_dead_rounds_keys(agent_store):
    """Round 0 forms a group of 2 ranks and exits; round 1 forms again on the same store, rank 1 first: rank 1
    reads round 0's leader token (its answer under that token changes), yet both ranks agree on a new prefix and
    the all-reduce sums 1 + 2. (torch's own env:// init on this store lets rank 1 read rank 0's dead gloo address:
    ``Connection refused``.)"""
    store, run_id = agent_store
    first = run_on_ranks(_form, 2, args=(store.port, None), timeout=120)
    assert [r.get("sum") for r in first] == [3.0, 3.0], first
    leader = f"{ROUNDS_PREFIX}/{run_id}/leader"
    token0 = store.get(leader).decode() if store.check([leader]) else None
    hello = f"{ROUNDS_PREFIX}/{run_id}/{token0}/hello/1"  # where rank 1 answers round 0's leader
    answered = store.get(hello) if store.check([hello]) else None
    second = run_on_ranks(_form, 2, args=(store.port, f"test/{uuid.uuid4().hex}"), timeout=120)
    assert [r.get("sum") for r in second] == [3.0, 3.0], second
    assert first[0]["prefix"] == first[1]["prefix"] == f"{ROUNDS_PREFIX}/{run_id}/{token0}", first
    assert second[0]["prefix"] == second[1]["prefix"] != first[0]["prefix"], second
    assert store.get(hello) != answered  # round 1's rank 1 read the dead leader's token first


@pytest.mark.parametrize("agent, alone", [(True, 0), (True, 1), (False, 0)],
                         ids=["agent-store-leader-alone", "agent-store-follower-alone", "own-store-rank0-alone"])
def test_a_group_that_cannot_form_fails_within_the_startup_timeout_naming_the_cause(agent_store, monkeypatch,
                                                                                     agent, alone):
    """Only rank ``alone`` of 2 starts: it raises ProcessGroupStartupError naming its rank, the timeout, the
    store's address and the config key, instead of waiting for the training timeout (5 min here)."""
    store, _ = agent_store
    if not agent:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert uses_agent_store(dict(os.environ)) is agent
    port = store.port if agent else free_port()
    [out] = run_on_ranks(_form_alone, 1, args=(port, alone), timeout=120)
    assert out.startswith("ProcessGroupStartupError: "), out
    where = "torchrun's agent store" if agent else "the store rank 0 hosts"
    assert (f"rank {alone} of 2: the gloo process group did not form within 1 s ({where}, 127.0.0.1:{port})"
            in out), out
    assert "trainer.startup_timeout_s" in out and "Cause: " in out, out


def test_a_rank_blocked_inside_torch_distributed_past_the_timeout_is_ended_by_the_watchdog(monkeypatch):
    """gloo can block in connectFullMesh past its own timeout (a peer that gave up): an init that blocks until the
    watchdog fired stands for it. The watchdog, 0.1 s after a 0.2 s start-up timeout, ends the rank (here: records
    instead of exiting) with the start-up message naming the rank, the timeout and the blocked call."""
    fired, ended = threading.Event(), []

    def blocked_init(*args, **kwargs):
        fired.wait(30)
        raise RuntimeError("init returned")

    monkeypatch.setattr(elastic, "_abort", lambda message: (ended.append(message), fired.set()))
    monkeypatch.setattr(elastic, "WATCHDOG_GRACE_S", 0.1)
    monkeypatch.setattr(elastic.dist, "init_process_group", blocked_init)
    monkeypatch.setenv("MASTER_ADDR", "unset")
    monkeypatch.setenv("MASTER_PORT", "0")
    with pytest.raises(ProcessGroupStartupError, match="init returned"):
        form_process_group("gloo", "127.0.0.1", 1, 0, 2, startup_timeout=timedelta(seconds=0.2),
                           timeout=timedelta(minutes=5), env={})
    assert len(ended) == 1, ended
    assert ended[0].startswith("rank 0 of 2: the gloo process group did not form within 0.2 s"), ended
    assert ended[0].endswith("Cause: still waiting inside torch.distributed; the process exits"), ended


def _form_alone(rank: int, world_size: int, port: int, alone: int) -> str:
    dist.destroy_process_group()
    try:
        form_process_group("gloo", "127.0.0.1", port, alone, 2, startup_timeout=timedelta(seconds=1),
                           timeout=timedelta(minutes=5))
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "formed"
