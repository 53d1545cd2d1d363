"""Linear + cross-entropy over the vocabulary without ever holding ``[N, vocab]`` logits.

``linear_cross_entropy(hidden [N, d], weight [V, d], labels [N], chunk_rows)`` returns ``(loss_sum, count)``: the
sum over labelled rows (label != -100) of ``logsumexp(z) - z[label]`` with ``z = hidden @ weight.T`` in fp32, and
how many rows were labelled. Forward and backward walk the rows in chunks of ``chunk_rows``: the largest
intermediate is one ``[chunk_rows, V]`` fp32 logits block (and its gradient, computed in place), and only the
inputs plus a ``[N]`` fp32 log-sum-exp are saved for backward. Backward recomputes each chunk's logits:
``d z = softmax(z) - onehot(label)`` (times the incoming gradient, 0 on unlabelled rows), ``d hidden = d z @ W`` and
``d W += d z^T @ hidden`` accumulated in fp32.

Numbers equal ``F.cross_entropy(hidden.float() @ weight.float().T, labels, reduction="sum")`` up to the order of
floating-point sums.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def _chunks(n: int, rows: int):
    return ((start, min(start + rows, n)) for start in range(0, n, rows))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows):  # type: ignore[override]
        w = weight.float()
        valid = labels != IGNORE_INDEX
        target = labels.clamp_min(0)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, stop in _chunks(hidden.shape[0], chunk_rows):
            logits = hidden[start:stop].float() @ w.t()  # [c, V]
            lse[start:stop] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[start:stop, None]).squeeze(1)
            total += torch.where(valid[start:stop], lse[start:stop] - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        hidden, weight, labels, lse = ctx.saved_tensors
        w = weight.float()
        valid = labels != IGNORE_INDEX
        target = labels.clamp_min(0)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        for start, stop in _chunks(hidden.shape[0], ctx.chunk_rows):
            h = hidden[start:stop].float()
            dz = (h @ w.t()).sub_(lse[start:stop, None]).exp_()  # softmax, in place: one [c, V] block
            rows = torch.arange(stop - start, device=dz.device)
            dz[rows, target[start:stop]] -= 1.0
            dz.mul_((grad_total * valid[start:stop]).unsqueeze(1))
            if grad_hidden is not None:
                grad_hidden[start:stop] = (dz @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(dz.t(), h)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of CE over labelled rows, labelled row count)`` of ``hidden [..., d] @ weight.T`` against ``labels
    [...]``, in chunks of ``chunk_rows`` rows (see the module docstring). Differentiable in ``hidden`` and
    ``weight``; ValueError for mismatched shapes or ``chunk_rows < 1``."""
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows must be >= 1, got {chunk_rows}")
    if hidden.shape[:-1] != labels.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and "
                         f"labels {tuple(labels.shape)} do not fit ([..., d], [V, d], [...])")
    flat_labels = labels.reshape(-1)
    loss = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, flat_labels, int(chunk_rows))
    return loss, (flat_labels != IGNORE_INDEX).sum()
