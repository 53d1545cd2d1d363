"""The DSpark drafter's training loss and the acceptance estimates that come with it (NeMo Automodel 0.7.0's
objective, ``reference/dspark.md`` section 2).

For every slot (``[B, N, K]``, :mod:`dsv4.model.v41.draft_blocks`) with eval mask ``m`` (supervised slots) the
weight is ``w = m`` or, with ``gamma > 0``, ``w = m * exp(-k / gamma)`` (slot ``k`` of its block). Over the full
vocabulary, temperature 1:

* ``ce``: cross-entropy of the draft logits against the data token ``x[a + k + 1]`` (hard labels);
* ``l1``: ``sum_v |softmax(draft) - softmax(teacher)|`` (twice the total variation) in fp32, where the teacher is
  the target's own distribution at ``a + k``: its final-norm output through the drafter's frozen head, detached;
* ``confidence``: BCE-with-logits of the confidence logits against ``alpha = clamp(1 - l1 / 2, 0, 1)`` (detached).

Each term is ``sum(w * term) / (W + 1e-6)`` with ``W`` the sum of ``w`` over every rank of ``group`` (the
weights of the whole global batch), and ``loss = ce_alpha * ce + l1_alpha * l1 + confidence_alpha * confidence``
carries the gradient (``l1`` counts only when ``l1_alpha > 0``; an empty batch gives zeros). Gradients summed over
the ranks (dsv4's FSDP / data-parallel reduction) then give the global weighted mean; NeMo Automodel multiplies its
loss by the world size instead, because its reduction averages.

The vocabulary-sized work (teacher logits, both softmaxes) runs in chunks of ``chunk_rows`` slots, each recomputed
in backward, so no ``[B, N, K, V]`` temporary beyond the draft logits themselves is kept.

Estimates (no gradient; sums in ``terms["sums"]``, with each term's weighted sum, so micro-batches, steps and ranks
aggregate exactly):
``accept_rate`` ``[K]``: the mean of ``alpha`` over the supervised slots of each position; ``tau``: the expected
accepted length per block, ``1 + sum_k prod_{j <= k} alpha_j m_j``, averaged over blocks with a supervised slot;
``confidence_abs_error`` / ``confidence_bias``: ``sigmoid(confidence) - alpha`` (absolute / signed), weighted by
``w``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dsv4.model.upcast_linear import upcast_linear
from dsv4.model.v41.draft_blocks import DraftBlocks

CHUNK_ROWS = 128


def _l1_chunk(draft: Tensor, teacher_hidden: Tensor, head: Tensor) -> Tensor:
    teacher = upcast_linear(teacher_hidden, head)  # no fp32 copy of a bf16 head
    return (draft.float().softmax(-1) - teacher.softmax(-1)).abs().sum(-1)


def probability_l1(draft_logits: Tensor, teacher_hidden: Tensor, head_weight: Tensor,
                   chunk_rows: int = CHUNK_ROWS) -> Tensor:
    """``sum_v |softmax(draft) - softmax(head @ teacher_hidden)|`` per row: ``draft_logits [..., V]``,
    ``teacher_hidden [..., d]`` (detached) -> ``[...]`` fp32, by chunks of ``chunk_rows`` rows (recomputed in
    backward when the draft logits need a gradient)."""
    shape = draft_logits.shape[:-1]
    draft = draft_logits.reshape(-1, draft_logits.shape[-1])
    teacher = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    head = head_weight.detach()
    parts = []
    for start in range(0, draft.shape[0], chunk_rows):
        d, t = draft[start:start + chunk_rows], teacher[start:start + chunk_rows]
        if torch.is_grad_enabled() and d.requires_grad:
            parts.append(checkpoint(_l1_chunk, d, t, head, use_reentrant=False))
        else:
            parts.append(_l1_chunk(d, t, head))
    return (torch.cat(parts) if parts else draft.new_zeros(0)).view(shape)


def _global_sum(value: Tensor, group) -> Tensor:
    total = value.detach().clone()
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def dspark_loss(out, input_ids: Tensor, anchors: Tensor, target_last_hidden_state: Tensor, loss_mask: Tensor,
                gamma: float | None = None, ce_alpha: float = 0.1, l1_alpha: float = 0.9,
                confidence_alpha: float = 1.0, *, packed_seq_ids: Tensor | None = None, group="default",
                chunk_rows: int = CHUNK_ROWS) -> dict:
    """The loss terms and estimates of one drafter forward ``out`` (a
    :class:`~dsv4.model.v41.drafter.DSparkOutput`; see the module docstring).

    Args:
        input_ids: ``[B, S]`` int64, the tokens the drafter saw.
        anchors: ``[B, N]`` int64, the anchors the drafter ran (``-1`` = no block).
        target_last_hidden_state: ``[B, S, d]``, the target's final-norm output.
        loss_mask: ``[B, S]`` bool, which tokens are supervised.
        gamma: per-position decay ``exp(-k / gamma)`` when > 0; None or 0: none.
        packed_seq_ids: ``[B, S]`` document ids of packed rows: a slot's label must stay in its anchor's document.
        group: the process group whose ranks share the denominator: ``"default"`` (the world when
            ``torch.distributed`` is initialised, else this process), None (this process) or a group.
        chunk_rows: slots per vocabulary-sized chunk.
    Returns:
        ``{"loss", "ce", "l1", "confidence", "accept_rate" [K], "tau", "confidence_abs_error", "confidence_bias",
        "numerator", "weight", "sums": {...}}``; ``loss`` and ``numerator`` (``loss`` times the global weight sum:
        what a step accumulating several micro-batches backpropagates before dividing by the step's weight sum)
        carry the gradient; ``weight`` is this call's weight sum; the rest is detached.
    """
    if group == "default":
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    b, s = input_ids.shape
    draft = out.draft_logits
    k = draft.shape[2]
    if tuple(loss_mask.shape) != (b, s) or tuple(target_last_hidden_state.shape[:2]) != (b, s):
        raise ValueError(f"dspark_loss: loss_mask {list(loss_mask.shape)} and target_last_hidden_state "
                         f"{list(target_last_hidden_state.shape)} must cover input_ids [B, S] = {[b, s]}")
    blocks = DraftBlocks.from_anchors(anchors, k, s)
    if tuple(draft.shape[:3]) != (b, anchors.shape[1], k):
        raise ValueError(f"dspark_loss: draft_logits {list(draft.shape)} do not match anchors {list(anchors.shape)} "
                         f"with blocks of {k}")
    mask = blocks.eval_mask(loss_mask, packed_seq_ids).float()  # [B, N, K]
    weight = mask
    if gamma:
        weight = mask * torch.exp(-torch.arange(k, device=draft.device, dtype=torch.float32) / float(gamma))
    denominator = _global_sum(weight.sum(), group) + 1e-6

    ce = F.cross_entropy(draft.reshape(-1, draft.shape[-1]).float(), blocks.targets(input_ids).reshape(-1),
                         reduction="none").view_as(weight)
    teacher_hidden = _gather_positions(target_last_hidden_state, blocks.teacher_index())
    l1 = probability_l1(draft, teacher_hidden, out.head_weight, chunk_rows)  # [B, N, K]
    alpha = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    confidence = F.binary_cross_entropy_with_logits(out.confidence_logits.float(), alpha, reduction="none")

    ce_sum = (ce * weight).sum()
    l1_sum = (l1 * weight).sum() if l1_alpha > 0 else ce_sum.new_zeros(())
    confidence_sum = (confidence * weight).sum()
    numerator = ce_alpha * ce_sum + l1_alpha * l1_sum + confidence_alpha * confidence_sum
    sums = {**acceptance_sums(alpha, mask, weight, blocks.keep, out.confidence_logits.detach()),
            "ce_num": ce_sum.detach(), "l1_num": l1_sum.detach(), "confidence_num": confidence_sum.detach()}
    return {"loss": numerator / denominator, "ce": ce_sum.detach() / denominator, "l1": l1_sum.detach() / denominator,
            "confidence": confidence_sum.detach() / denominator, **estimates(sums), "numerator": numerator,
            "weight": weight.sum().detach(), "sums": sums}


def _gather_positions(values: Tensor, index: Tensor) -> Tensor:
    """``values [B, S, d]`` at ``index [B, N, K]`` -> ``[B, N, K, d]``."""
    b, n, k = index.shape
    return values.gather(1, index.reshape(b, n * k, 1).expand(-1, -1, values.shape[-1])).view(b, n, k, -1)


@torch.no_grad()
def acceptance_sums(alpha: Tensor, mask: Tensor, weight: Tensor, keep: Tensor, confidence_logits: Tensor) -> dict:
    """Numerators and denominators of the estimates (module docstring) for ``alpha``, ``mask``, ``weight``
    ``[B, N, K]``, ``keep [B, N]``."""
    accepted = alpha * mask
    blocks = (keep & mask.bool().any(-1)).float()
    error = confidence_logits.float().sigmoid() - alpha
    return {
        "accept_num": accepted.sum(dim=(0, 1)),
        "accept_den": mask.sum(dim=(0, 1)),
        "tau_num": ((accepted.cumprod(-1).sum(-1) + 1.0) * blocks).sum(),
        "tau_den": blocks.sum(),
        "confidence_abs_num": (error.abs() * weight).sum(),
        "confidence_bias_num": (error * weight).sum(),
        "confidence_den": weight.sum(),
    }


def estimates(sums: dict) -> dict:
    """The estimates of :func:`acceptance_sums`' sums (possibly added over steps and ranks); NaN where no slot
    counted."""
    def ratio(num: Tensor, den: Tensor) -> Tensor:
        return torch.where(den > 0, num / den.clamp(min=1e-30), torch.full_like(num, math.nan))

    return {
        "accept_rate": ratio(sums["accept_num"], sums["accept_den"]),
        "tau": ratio(sums["tau_num"], sums["tau_den"]),
        "confidence_abs_error": ratio(sums["confidence_abs_num"], sums["confidence_den"]),
        "confidence_bias": ratio(sums["confidence_bias_num"], sums["confidence_den"]),
    }
