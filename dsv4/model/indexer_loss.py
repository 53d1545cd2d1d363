"""The indexer's KL loss against the main attention (``model.indexer_loss_coeff > 0``): how the indexer learns.

Top-k selection is discrete, so the LM loss gives the indexer no gradient. Instead, per CSA layer and query ``s``
with a selection ``S_s`` (the indexer's top-k, invalid entries dropped):

* teacher: ``t[s, j]``, the main attention's probability of selected compressed row ``j`` averaged over the heads
  (detached; the softmax denominator also holds the sliding window and the sink, so ``m_s = sum_j t[s, j] < 1``
  is the share of the query's attention that the compressed rows get);
* student: ``softmax_j(I[s, j])`` over ``S_s``, ``I`` the indexer's scores of the selected rows;
* loss: ``sum_s m_s * KL(t[s] / m_s || softmax(I[s]))  =  sum_s sum_j t[s, j] (log(t[s, j] / m_s) - log
  softmax(I[s])_j)``. The teacher is the attention's distribution over the rows the indexer chose; each query
  weighs by the mass those rows take from the window and the sink (a query that mostly reads its window teaches
  the indexer little).

The layer feeds the indexer through :func:`zero_gradient` (identity forward, zero gradient backward), so this loss
reaches only the indexer's own parameters (its query projection, head weights and key compressor), never the main
model; and the LM loss never reaches the indexer. The edge is kept (not ``detach``) so that a block's backward still
waits for its indexer: FSDP2 reduces a block's gradients once backward has reached the block's inputs, and an
indexer gradient arriving later would be lost. The model returns ``indexer_loss_sum`` (the mean over CSA layers of these sums) beside
``loss_sum``; the trainer adds ``indexer_loss_coeff * indexer_loss_sum`` and divides by the global label count like
the LM loss, so CP ranks (each holding its own queries) reproduce the single-rank loss exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

_TINY = 1e-30


def indexer_kl_sum(teacher: Tensor, scores: Tensor) -> Tensor:
    """``sum_s sum_j t (log(t / m_s) - log_softmax(I_s)_j)`` over the entries with ``t > 0`` (see the module
    docstring). ``teacher [..., k]`` (>= 0, 0 = no selection), ``scores [..., k]`` (-inf = no selection); a fp32
    scalar, differentiable in ``scores`` only. Queries with no selection contribute 0 (and a zero gradient)."""
    t = teacher.detach().float()
    scores = scores.float()
    selected = torch.isfinite(scores)
    any_selected = selected.any(dim=-1, keepdim=True)
    safe = torch.where(any_selected, scores, torch.zeros_like(scores))  # a row of -inf would give NaN gradients
    log_student = torch.log_softmax(safe, dim=-1)
    valid = (t > 0) & selected
    mass = t.sum(dim=-1, keepdim=True)
    teacher_log = torch.log(t.clamp_min(_TINY)) - torch.log(mass.clamp_min(_TINY))
    term = torch.where(valid, t * (teacher_log - log_student), torch.zeros_like(t))
    return term.sum()


class _ZeroGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return torch.zeros_like(grad)


def zero_gradient(x: Tensor) -> Tensor:
    """``x`` in forward; a zero gradient in backward (unlike ``detach``, the autograd edge to ``x`` stays)."""
    return _ZeroGradient.apply(x) if x.requires_grad else x
