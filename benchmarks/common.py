"""Shared helpers of the benchmark scripts: JSON output and host-memory measurement."""

from __future__ import annotations

import json
import os


def emit(name: str, shape: dict, value, unit: str) -> None:
    """Print one measurement as a JSON object on its own line."""
    print(json.dumps({"name": name, "shape": shape, "value": value, "unit": unit}), flush=True)


def current_rss_kib() -> int:
    """Resident set size of this process now, in KiB (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def reset_peak_rss() -> None:
    """Reset this process's resident-set high-water mark to the current RSS (Linux: ``5`` into
    ``/proc/self/clear_refs``), so :func:`peak_rss_kib` measures from here on, not since the process started."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_kib() -> int:
    """High-water resident set size of this process since it started or since :func:`reset_peak_rss`, in KiB
    (``VmHWM`` of ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmHWM line")


def cp_training_step(config, seq_len: int, world_size: int, before_step=None, balance: str = "none",
                     overlap: bool = True):
    """Inside a ``dsv4.launch.run_on_ranks`` rank: one forward+backward of ``config`` on one document of ``seq_len``
    tokens packed into a row (:class:`dsv4.batch.TokenBatch`), cut for this rank (``balance``: the CP layout,
    :class:`dsv4.parallel.cp.layout.CPLayout`; ``overlap``: ``CPContext.overlap``), through the training step's model call.
    ``before_step()`` runs just before the step; returns the ``CPContext`` (None on one rank) and ``before_step``'s
    result."""
    import torch
    import torch.distributed as dist

    from dsv4.parallel.cp import CPContext
    from dsv4.data import pack_documents
    from dsv4.model import DSV4ForCausalLM
    from dsv4.training.loss import reduce_token_loss
    from dsv4.training.step import forward_outputs

    torch.manual_seed(0)
    model = DSV4ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(1))
    rank = dist.get_rank()
    batch = pack_documents([ids.tolist()], seq_len, config.shard_multiple)[0].cut(rank, world_size,
                                                                                       config.shard_multiple, balance)
    group = dist.new_group(list(range(world_size)))
    cp = CPContext(group, balance=balance, overlap=overlap) if world_size > 1 else None
    marker = before_step() if before_step is not None else None
    out = forward_outputs(model, batch, cp)
    loss_sum, count = out.loss_sum, out.label_count
    reduce_token_loss(loss_sum, count, group).loss.backward()
    return cp, marker
