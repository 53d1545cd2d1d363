"""Verification of a drafted block against the target: the acceptance rule of speculative decoding.

The target has scored the anchor followed by ``K`` drafted tokens ``d_1 .. d_K``: ``target_logits [B, K + 1, V]``,
row ``k`` its distribution over the token after ``d_k`` (row 0: after the anchor; row ``K``: the bonus position).

* Greedy (``temperature == 0``): ``d_k`` is accepted while it equals the target's argmax of row ``k - 1``; at the
  first mismatch the target's argmax is emitted instead; when all ``K`` are accepted the argmax of row ``K`` (the
  bonus token) follows. The output is the target's own greedy decoding, token for token.
* Sampled (``temperature > 0``; speculative rejection sampling, Leviathan et al. 2023 / Chen et al. 2023): with
  ``p_k = softmax(target row k - 1 / T)`` and ``q_k`` the distribution the drafter drew ``d_k`` from
  (``draft_probs``, at the same temperature), ``d_k`` is accepted with probability ``min(1, p_k(d_k) / q_k(d_k))``;
  at the first rejection a token is drawn from ``norm(max(p_k - q_k, 0))`` (from ``p_k`` where that is all zero,
  i.e. ``q_k = p_k``); after ``K`` acceptances one is drawn from ``p_{K+1}``. Each emitted token is then distributed
  as the target's own sampling would draw it.

Either way each step emits ``accepted + 1`` tokens (``1 <= n <= K + 1``): the accepted drafts, then one target
token (the correction or the bonus).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Verdict:
    """``accepted [B]`` (drafts accepted), ``tokens [B, K + 1]`` (the emitted tokens first, ``-1`` after them),
    ``emitted [B]`` (``accepted + 1``)."""

    accepted: Tensor
    tokens: Tensor
    emitted: Tensor


def _sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row of ``probs [B, V]`` (rows need not be normalised)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def target_probabilities(target_logits: Tensor, temperature: float) -> Tensor:
    """``softmax(logits / temperature)`` in fp32 (``temperature > 0``)."""
    return (target_logits.float() / temperature).softmax(-1)


def verify_block(target_logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None = None,
                 temperature: float = 0.0, generator: torch.Generator | None = None) -> Verdict:
    """Accept a prefix of each row's drafts (module docstring).

    Args:
        target_logits: ``[B, K + 1, V]``.
        draft_tokens: ``[B, K]`` int64.
        draft_probs: ``[B, K, V]``: the drafter's distributions the drafts were drawn from (sampled decoding only).
        temperature: 0 for greedy decoding.
        generator: the random source of sampled decoding.
    """
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long or target_logits.dim() != 3:
        raise ValueError(f"verify_block: draft_tokens must be int64 [B, K] and target_logits [B, K + 1, V], got "
                         f"{draft_tokens.dtype} {list(draft_tokens.shape)} and {list(target_logits.shape)}")
    if not temperature >= 0:
        raise ValueError(f"verify_block: temperature must be >= 0 (0 = greedy), got {temperature}")
    b, k = draft_tokens.shape
    if tuple(target_logits.shape[:2]) != (b, k + 1):
        raise ValueError(f"verify_block: target_logits {list(target_logits.shape)} must be [B, K + 1, V] for drafts "
                         f"{list(draft_tokens.shape)}")
    rows = torch.arange(b, device=draft_tokens.device)
    if temperature == 0:
        best = target_logits.argmax(-1)  # [B, K + 1]
        match = best[:, :k] == draft_tokens
        accepted = match.int().cumprod(-1).sum(-1)
        final = best[rows, accepted]
    else:
        if draft_probs is None or tuple(draft_probs.shape) != (b, k, target_logits.shape[-1]):
            raise ValueError("verify_block: sampled decoding needs draft_probs [B, K, V], the distributions the "
                             f"drafts were drawn from; got {None if draft_probs is None else list(draft_probs.shape)}")
        p = target_probabilities(target_logits, temperature)  # [B, K + 1, V]
        q = draft_probs.float()
        p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_draft = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
        # a draft its own distribution gives no probability cannot have been drawn from it: rejected
        ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=1e-30), torch.zeros_like(p_draft))
        u = torch.rand(b, k, generator=generator, device=draft_tokens.device)
        accepted = (u < ratio.clamp(max=1.0)).int().cumprod(-1).sum(-1)
        stopped = accepted < k
        at = accepted.clamp(max=k - 1) if k else accepted
        residual = (p[rows, at] - q[rows, at]).clamp(min=0) if k else p[rows, 0]
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, at])
        final = torch.where(stopped, _sample(residual, generator), _sample(p[rows, k], generator))
    tokens = torch.full((b, k + 1), -1, dtype=torch.long, device=draft_tokens.device)
    positions = torch.arange(k + 1, device=draft_tokens.device)
    tokens[:, :k] = torch.where(positions[:k] < accepted[:, None], draft_tokens, tokens[:, :k])
    tokens[rows, accepted] = final
    return Verdict(accepted.long(), tokens, accepted.long() + 1)
