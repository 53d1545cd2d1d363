"""One micro-batch of DSpark drafter training on packed rows: the target's features, the anchors, the drafter's
loss terms.

* Online (:func:`target_features`): the frozen target runs on the rows (no gradient, eval mode, the last position's
  logits only) and :class:`~dsv4.speculative.capture.FeatureCapture` records the streams entering each of
  ``dspark_target_layer_ids`` (hyper-connection streams averaged, concatenated) and the final-norm output.
* Offline: the same two tensors come with the rows (:class:`FeatureBatch`, from a capture directory).
* :func:`drafter_terms`: anchors drawn per row (:mod:`dsv4.speculative.anchors`: seeded by the run's seed, the step
  and the row), the drafter's teacher-forced forward on the rows' document-local positions and document ids (a
  block's context stays in its document) and :func:`~dsv4.speculative.dspark_loss.dspark_loss` with this call's
  weights (the caller divides by the weight sum of the whole step: its ``numerator`` / ``weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dsv4.batch import TokenBatch
from dsv4.speculative.anchors import sample_anchors, supervised_tokens
from dsv4.speculative.capture import FeatureCapture
from dsv4.speculative.dspark_loss import dspark_loss


@dataclass(frozen=True)
class LossOptions:
    """The drafter objective's knobs (:func:`~dsv4.speculative.dspark_loss.dspark_loss`) and ``num_anchors``, the
    blocks drawn per row."""

    num_anchors: int = 64
    gamma: float | None = 4.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0


@dataclass
class FeatureBatch:
    """Packed rows with the target's captured features: ``tokens`` (a whole-row :class:`~dsv4.batch.TokenBatch`),
    ``features [B, L, n * d]`` and ``last_hidden [B, L, d]`` (zeros on padding)."""

    tokens: TokenBatch
    features: Tensor
    last_hidden: Tensor

    def to(self, device, non_blocking: bool = False) -> "FeatureBatch":
        return FeatureBatch(self.tokens.to(device, non_blocking), self.features.to(device, non_blocking=non_blocking),
                            self.last_hidden.to(device, non_blocking=non_blocking))

    def without_labels(self) -> "FeatureBatch":
        return FeatureBatch(self.tokens.without_labels(), self.features, self.last_hidden)

    @classmethod
    def stack(cls, rows: Sequence["FeatureBatch"]) -> "FeatureBatch":
        return cls(TokenBatch.stack([r.tokens for r in rows]), torch.cat([r.features for r in rows]),
                   torch.cat([r.last_hidden for r in rows]))


@torch.no_grad()
def target_features(target: torch.nn.Module, batch: TokenBatch, layer_ids: Sequence[int], cp=None
                    ) -> tuple[Tensor, Tensor]:
    """``(features [B, L, n * d], last_hidden [B, L, d])`` of the frozen ``target`` on ``batch`` (this rank's rows;
    ``cp`` its context-parallel view)."""
    with FeatureCapture(target, layer_ids) as capture:
        target(batch.input_ids, position_ids=batch.positions, packed_seq_ids=batch.seq_ids,
               padding_mask=batch.padding, logits_to_keep=1, cp=cp)
    return capture.hidden_states(), capture.last_hidden_state()


def drafter_terms(drafter: torch.nn.Module, batch: TokenBatch, features: Tensor, last_hidden: Tensor,
                  options: LossOptions, *, seed: int, step: int, group=None) -> dict:
    """The loss terms of ``drafter`` on the whole rows ``batch`` (see the module docstring); ``group``: the ranks
    sharing the loss terms' denominator (None: this rank)."""
    loss_mask = supervised_tokens(batch.labels, batch.seq_ids)
    anchors = sample_anchors(loss_mask, batch.seq_ids, batch.input_ids, options.num_anchors, seed=seed, step=step)
    out = drafter(batch.input_ids, features, anchors, position_ids=batch.positions, packed_seq_ids=batch.seq_ids)
    return dspark_loss(out, batch.input_ids, anchors, last_hidden, loss_mask, gamma=options.gamma,
                       ce_alpha=options.ce_alpha, l1_alpha=options.l1_alpha, confidence_alpha=options.confidence_alpha,
                       packed_seq_ids=batch.seq_ids, group=group)


def drafter_terms_cp(drafter: torch.nn.Module, batch: TokenBatch, features: Tensor, last_hidden: Tensor,
                     options: LossOptions, cp, *, seed: int, step: int, group=None) -> dict:
    """:func:`drafter_terms` of this CP rank (the target's ``features`` / ``last_hidden`` of its chunk of the whole
    rows ``batch``): the same anchors, the blocks of its chunk, their context and teachers across the chunk edges
    received (:func:`dsv4.parallel.dspark_cp.draft_chunk`)."""
    from dsv4.parallel.dspark_cp import draft_chunk

    loss_mask = supervised_tokens(batch.labels, batch.seq_ids)
    anchors = sample_anchors(loss_mask, batch.seq_ids, batch.input_ids, options.num_anchors, seed=seed, step=step)
    config = drafter.config
    chunk = draft_chunk(batch.input_ids, batch.seq_ids, batch.positions, loss_mask, anchors, features, last_hidden, cp,
                        config.sliding_window, config.dspark_block_size)
    out = drafter(chunk.input_ids, chunk.features, chunk.anchors, position_ids=chunk.positions,
                  packed_seq_ids=chunk.seq_ids, context_halo=chunk.halo)
    return dspark_loss(out, chunk.input_ids, chunk.anchors, chunk.last_hidden, chunk.loss_mask, gamma=options.gamma,
                       ce_alpha=options.ce_alpha, l1_alpha=options.l1_alpha, confidence_alpha=options.confidence_alpha,
                       packed_seq_ids=chunk.seq_ids, group=group)


TERM_SUMS = ("ce_num", "l1_num", "confidence_num", "tau_num", "tau_den", "confidence_abs_num", "confidence_den")


def term_vector(terms: dict) -> Tensor:
    """The additive sums of one call's terms as one float64 vector ``[weight, *TERM_SUMS, accept_num [K],
    accept_den [K]]`` (added over micro-batches and all-reduced over ranks in one collective)."""
    sums = terms["sums"]
    parts = [terms["weight"].reshape(1)] + [sums[k].reshape(1) for k in TERM_SUMS]
    return torch.cat(parts + [sums["accept_num"], sums["accept_den"]]).to(torch.float64)


def term_metrics(vector: Tensor, options: LossOptions, prefix: str) -> dict[str, float]:
    """The logged numbers of a (summed) :func:`term_vector`: ``{prefix}/loss``, ``ce``, ``l1``, ``confidence``,
    ``tau``, ``confidence_abs_error`` and ``accept_rate/k``."""
    v = vector.tolist()
    weight = v[0] + 1e-6
    ce, l1, conf, tau_num, tau_den, abs_num, conf_den = v[1:8]
    k = (len(v) - 8) // 2
    accept_num, accept_den = v[8:8 + k], v[8 + k:]
    out = {f"{prefix}/ce": ce / weight, f"{prefix}/l1": l1 / weight, f"{prefix}/confidence": conf / weight,
           f"{prefix}/loss": (options.ce_alpha * ce + options.l1_alpha * l1 + options.confidence_alpha * conf) / weight,
           f"{prefix}/tau": tau_num / tau_den if tau_den else float("nan"),
           f"{prefix}/confidence_abs_error": abs_num / conf_den if conf_den else float("nan")}
    out.update({f"{prefix}/accept_rate/{i}": n / d if d else float("nan")
                for i, (n, d) in enumerate(zip(accept_num, accept_den))})
    return out
