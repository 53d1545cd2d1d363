"""Non-finite training steps: find the first bad gradient on every rank alike and say where to resume.

At the optimizer-step boundary :class:`~dsv4.training.module.DSV4LightningModule` checks the step's loss and global
gradient norm (both identical on every rank). A non-finite one stops the run with :class:`NonFiniteError`, whose
message names the step, the first parameter with a non-finite gradient (:func:`first_nonfinite_gradient`) and the
last good checkpoint (:func:`last_good_checkpoint`); ``trainer.skip_nonfinite_steps`` skips up to that many such
steps instead (docs/training.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class NonFiniteError(RuntimeError):
    """A training step produced a non-finite loss or gradient norm (the message names the step, the parameter and
    the last good checkpoint)."""


@torch.no_grad()
def first_nonfinite_gradient(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                             group=None) -> tuple[str, int] | None:
    """``(name, rank)`` of the first parameter (in ``named_parameters`` order, the same on every rank) whose gradient
    holds a non-finite value on some rank, and the lowest such rank; None when every gradient is finite.

    Each rank checks its local shards (a DTensor gradient's ``to_local()``); one all-reduce MIN over ``group``
    (WORLD when None) of ``index x world + rank`` makes every rank name the same parameter. Collective when a
    process group is initialized: every rank must call it."""
    names, bad = [], None
    for index, (name, param) in enumerate(named_parameters):
        names.append(name)
        grad = param.grad
        if bad is None and grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local.numel() and not bool(torch.isfinite(local).all()):
                bad = index
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    none = len(names) * world  # larger than any real code
    code = none if bad is None else bad * world + rank
    if distributed:
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        value = torch.tensor([code], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        code = int(value.item())
    if code >= none:
        return None
    return names[code // world], code % world


def last_good_checkpoint(ckpt_dir: str | Path | None) -> Path | None:
    """The newest complete checkpoint of ``ckpt_dir`` (the one ``checkpoint.resume=auto`` would take; ``last.ckpt``
    resolved to the directory it links), or None when there is none."""
    if ckpt_dir is None:
        return None
    from dsv4.training.checkpointing import complete_checkpoints, newest_complete

    newest = newest_complete(complete_checkpoints(ckpt_dir)[0])
    if newest is None:
        return None
    return newest.resolve() if newest.is_symlink() else newest
