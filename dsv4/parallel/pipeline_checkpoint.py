"""Distributed checkpoints of pipeline stages (:mod:`dsv4.parallel.pipeline`), keyed by the model's own names, so a
checkpoint written under one ``pp`` loads under any other (one process included) and exports like any model.

Layout (``torch.distributed.checkpoint``, one directory): ``model.<fqn>`` for every parameter and buffer of the
rank's stages, ``optimizer.<fqn>.<key>`` for each tensor of its optimizer state (AdamW: ``step``, ``exp_avg``,
``exp_avg_sq``). A tensor two stages hold (the MTP depths' embedding, on the first and the last stage) is saved
once (DCP's planner keeps one of equal keys). Loading reads the keys of the loading rank's stages, whatever stages
wrote them: the optimizer's state is created at the saved shapes and filled in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import nn

MODEL, OPTIMIZER = "model.", "optimizer."


def stage_tensors(model: nn.Module, stages: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """``{fqn: tensor}`` of the parameters and buffers of ``stages`` (views of ``model``), by ``model``'s names."""
    held = {id(t) for s in stages for t in [*s.parameters(), *s.buffers()]}
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: t for name, t in named if id(t) in held}


def save_pipeline_checkpoint(path: str | Path, model: nn.Module, stages: Iterable[nn.Module],
                             optimizer: torch.optim.Optimizer, process_group=None) -> None:
    """Write this rank's stages' tensors and optimizer state to ``path`` (every rank of the pipeline calls it)."""
    import torch.distributed.checkpoint as dcp

    tensors = stage_tensors(model, stages)
    state = {MODEL + name: t.detach() for name, t in tensors.items()}
    names = {id(t): name for name, t in tensors.items()}
    for p, entries in optimizer.state.items():
        if id(p) not in names:
            raise ValueError(f"save_pipeline_checkpoint: the optimizer holds a parameter of shape {tuple(p.shape)} "
                             "that none of this rank's stages holds")
        for key, value in entries.items():
            if torch.is_tensor(value):
                state[f"{OPTIMIZER}{names[id(p)]}.{key}"] = value
    dcp.save(state, checkpoint_id=str(path), process_group=process_group)


def load_pipeline_checkpoint(path: str | Path, model: nn.Module, stages: Iterable[nn.Module],
                             optimizer: torch.optim.Optimizer | None = None, process_group=None) -> None:
    """Fill this rank's stages' tensors (in place) and ``optimizer``'s state from ``path``, whatever ``pp`` wrote
    it. A tensor the checkpoint lacks, or holds at another shape, is a ``KeyError`` / ``ValueError`` naming it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = stage_tensors(model, stages)
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = MODEL + name
        if key not in saved:
            raise KeyError(f"{path}: no tensor {key!r} (the checkpoint holds {len(saved)} keys)")
        if tuple(saved[key].size) != tuple(t.shape):
            raise ValueError(f"{path}: {key!r} is {tuple(saved[key].size)} there, {tuple(t.shape)} here")
        state[key] = t.detach()
    slots: dict[str, tuple[nn.Parameter, str]] = {}
    if optimizer is not None:
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, t in tensors.items():
            if id(t) not in params:
                continue
            prefix = f"{OPTIMIZER}{name}."
            for key, meta in saved.items():
                if key.startswith(prefix) and "." not in key[len(prefix):]:
                    state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                    slots[key] = (t, key[len(prefix):])
    dcp.load(state, checkpoint_id=str(path), process_group=process_group)
    with torch.no_grad():
        for name, t in tensors.items():  # DCP fills in place; a copy keeps any tensor it replaced
            loaded = state[MODEL + name]
            if loaded.data_ptr() != t.data_ptr():
                t.copy_(loaded)
    for key, (p, slot) in slots.items():
        optimizer.state[p][slot] = state[key].to(p.device) if state[key].dim() else state[key]
