"""Run a function on N local gloo ranks (loopback) and collect each rank's return value.

For tests, benchmarks and CPU experiments; training runs use the Lightning strategy instead. Usage::

    from dsv4.launch import run_on_ranks

    def _body(rank: int, world_size: int, arg) -> dict:   # module-level, so it pickles
        ...
        return {"value": tensor}

    results = run_on_ranks(_body, world_size=2, args=(arg,))   # list indexed by rank

The ranks are forked from a fork server (``multiprocessing``'s ``forkserver``) that imported torch, Lightning and the
model once (``_PRELOAD``), so a rank starts in a fraction of a second instead of importing them again, without the
hazards of forking the caller (its threads, its CUDA state). Each rank runs with the caller's environment as it was
at the call, and its working directory and ``sys.path`` (what ``spawn`` would give it).

The process group (gloo, WORLD) is initialised before ``fn`` runs and destroyed afterwards; the ranks meet through
a file store in a fresh temporary directory (no TCP port is reserved, so concurrent runs on one machine cannot
race for one). Exceptions in a rank are re-raised in the parent with the rank's traceback. Tensors in the results travel through a
multiprocessing queue serialised with ``torch.save``, so they must be CPU tensors.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# Imported once by the fork server that starts the ranks (see :func:`run_on_ranks`), so a rank does not import them again.
_PRELOAD = ["torch", "torch.distributed", "lightning", "dsv4.model", "dsv4.config"]


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, queue,
            environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment at the call (a forked rank would see the fork server's)
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # (fn may have ended it, or replaced it with a group of its own)
                dist.destroy_process_group()
        buffer = io.BytesIO()  # serialise: shared-memory tensors would vanish when this process exits
        torch.save(out, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_on_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 1200.0) -> list:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; return results by rank. ``timeout``
    (seconds without a result) is a safety net against a hung rank, not a performance bound."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.Queue()
    store_dir = tempfile.TemporaryDirectory(prefix="dsv4-ranks-")
    store_path = os.path.join(store_dir.name, "store")
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue, dict(os.environ)),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(world_size):
        try:
            rank, status, payload = queue.get(timeout=timeout)
        except queue_module.Empty:  # a rank died without reporting, or hung
            dead = [f"rank {i} exit code {p.exitcode}" for i, p in enumerate(procs) if not p.is_alive()]
            errors.append(f"no result within {timeout}s; {', '.join(dead) or 'all ranks still running'}")
            break
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
            break
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    store_dir.cleanup()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
