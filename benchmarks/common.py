"""Shared helpers of the benchmark scripts: JSON output and host-memory measurement."""

from __future__ import annotations

import json
import os
import resource


def emit(name: str, shape: dict, value, unit: str) -> None:
    """Print one measurement as a JSON object on its own line."""
    print(json.dumps({"name": name, "shape": shape, "value": value, "unit": unit}), flush=True)


def current_rss_kib() -> int:
    """Resident set size of this process now, in KiB (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def peak_rss_kib() -> int:
    """High-water resident set size of this process since it started, in KiB (``ru_maxrss`` on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def cp_training_step(config, seq_len: int, world_size: int, before_step=None):
    """Inside a ``dsv4.launch.run_on_ranks`` rank: one forward+backward of ``config`` on one unpacked document of
    ``seq_len`` tokens, sharded over all ranks. ``before_step()`` runs just before the step; returns the
    ``CPContext`` (None on one rank) and ``before_step``'s result."""
    import torch
    import torch.distributed as dist

    from dsv4.cp import CPContext, dsv4_cp_sharder
    from dsv4.model import DSV4ForCausalLM
    from dsv4.training.loss import reduce_token_loss

    torch.manual_seed(0)
    model = DSV4ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    group = dist.new_group(list(range(world_size)))
    _, local = dsv4_cp_sharder(config, group).shard({"input_ids": ids, "labels": labels})
    cp = CPContext(group) if world_size > 1 else None
    marker = before_step() if before_step is not None else None
    out = model(**local, cp=cp)
    reduce_token_loss(out.loss_sum, out.label_count, group).loss.backward()
    return cp, marker
