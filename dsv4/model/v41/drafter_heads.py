"""The DSpark drafter's two small heads, held by its last stage.

* :class:`MarkovHead` (``markov_head.embed [V, r]``, ``markov_head.head [V, r]``): a rank-``r`` first-order
  token-transition bias. For the previous token ``t`` of a slot it returns ``head(embed[t]) [V]``, added to the slot's
  base logits, and the embedding ``embed[t] [r]`` the confidence head reads. Training feeds the true previous token
  (teacher forcing); drafting feeds the token drafted for the slot before (serving engines' semantics: the block is
  sampled left to right, one cheap bias per slot after one parallel backbone pass).
* :class:`ConfidenceHead` (``confidence_head.proj [1, d + r]``, fp32, no bias): a logit of the probability that the
  slot's draft is accepted, from the slot's final-norm output and the previous token's Markov embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MarkovHead(nn.Module):
    """``forward(previous [...]) -> (bias [..., V], embedding [..., r])``."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"DSpark drafter: dspark_markov_rank must be >= 1, got {rank}")
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, previous: Tensor) -> tuple[Tensor, Tensor]:
        embedding = self.embed(previous)
        return self.head(embedding), embedding


class ConfidenceHead(nn.Module):
    """``forward(hidden [..., d], markov_embedding [..., r]) -> [...]`` fp32 acceptance logits."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1, bias=False, dtype=torch.float32)

    def forward(self, hidden: Tensor, markov_embedding: Tensor) -> Tensor:
        features = torch.cat((hidden.float(), markov_embedding.float()), dim=-1)
        return F.linear(features, self.proj.weight.float()).squeeze(-1)
