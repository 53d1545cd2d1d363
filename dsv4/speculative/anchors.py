"""Where a training step puts the drafter's blocks: anchors drawn per packed row, seeded by the row itself.

A position ``t`` of a packed row may anchor a block when the token after it is supervised and of the same
document: ``loss_mask[t + 1]`` (``loss_mask[t]`` a supervised token: the assistant's, under chat masks) and
``seq_ids[t + 1] == seq_ids[t] > 0``; the block's context then never crosses its document's start (the drafter
masks context rows of other documents) and its labels stay in the document (the loss's eval mask stops there).
NeMo Automodel 0.7.0 also asks ``loss_mask[t]``; so does this, so that a block starts inside the supervised part.

Each row draws ``num_anchors`` of its candidates without replacement (all of them when it has fewer; ``-1`` fills the
rest), ascending. The draw is a function of the run's seed, the optimizer step and the row's own tokens and
document ids (a 61-bit polynomial hash): the same row gets the same anchors on any data-parallel or
context-parallel layout and after a resume, and a row seen again at another step gets new ones.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MODULUS = (1 << 61) - 1
_BASE = 1_000_003


def supervised_tokens(labels: Tensor, seq_ids: Tensor) -> Tensor:
    """``loss_mask [B, S]``: token ``t`` is a supervised target, i.e. the (shifted) label of position ``t - 1`` is
    set and both positions are in one document (``labels[t - 1] == x[t]`` inside a document)."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, 1:] = (labels[:, :-1] != -100) & (seq_ids[:, 1:] == seq_ids[:, :-1]) & (seq_ids[:, 1:] > 0)
    return mask


def anchor_candidates(loss_mask: Tensor, seq_ids: Tensor) -> Tensor:
    """``[B, S]`` bool: the positions that may anchor a block (module docstring)."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, :-1] = (loss_mask[:, :-1] & loss_mask[:, 1:] & (seq_ids[:, 1:] == seq_ids[:, :-1])
                  & (seq_ids[:, :-1] > 0))
    return ok


def row_key(input_ids: Tensor, seq_ids: Tensor, seed: int, step: int) -> list[int]:
    """One 61-bit key per row of ``input_ids`` / ``seq_ids [B, S]``, from the run's ``seed``, the optimizer
    ``step`` and the row's contents (computed on the host in exact integer arithmetic)."""
    keys = []
    for ids, docs in zip(input_ids.tolist(), seq_ids.tolist()):
        h = (int(seed) * _BASE + int(step)) % _MODULUS
        for token, doc in zip(ids, docs):
            h = (h * _BASE + int(token) * 4099 + int(doc) + 1) % _MODULUS
        keys.append(h)
    return keys


def sample_anchors(loss_mask: Tensor, seq_ids: Tensor, input_ids: Tensor, num_anchors: int, *, seed: int,
                   step: int) -> Tensor:
    """``anchors [B, num_anchors]`` int64 (ascending, ``-1`` after a row's last one) for whole packed rows (see the
    module docstring)."""
    if num_anchors < 1:
        raise ValueError(f"dspark.num_anchors must be >= 1, got {num_anchors}")
    candidates = anchor_candidates(loss_mask, seq_ids).cpu()
    out = torch.full((candidates.shape[0], num_anchors), -1, dtype=torch.long)
    for row, key in enumerate(row_key(input_ids, seq_ids, seed, step)):
        where = candidates[row].nonzero().squeeze(-1)
        if where.numel() == 0:
            continue
        order = torch.rand(where.numel(), generator=torch.Generator().manual_seed(key)).argsort()
        picked = where[order[:num_anchors]].sort().values
        out[row, : picked.numel()] = picked
    return out.to(loss_mask.device)
