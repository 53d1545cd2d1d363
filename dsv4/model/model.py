"""`DSV4Model` (embedding -> blocks -> hyper-head -> norm) and `DSV4ForCausalLM` (+ lm_head, MTP, loss).

Public contract::

    out = DSV4ForCausalLM(config)(input_ids [B, L], position_ids=None, packed_seq_ids=None,
                                  padding_mask=None, cp=None, labels=None, return_logits=True)
    out.logits        [B, L, vocab] fp32, for this rank's L local tokens (None with return_logits=False)
    out.mtp_logits    list of [B, L, vocab] fp32, one per MTP depth
    out.loss          (labels given) loss_sum / label_count
    out.loss_sum      CE_sum + mtp_loss_weight * mean_d(MTP_CE_sum_d) + indexer_loss_coeff * indexer_loss_sum
                      (one scalar: reduce it over ranks)
    out.indexer_loss_sum  (training, indexer_loss_coeff > 0) the indexer's KL sum, mean over CSA layers
    out.label_count   number of labels != -100 (main head)

``packed_seq_ids`` are 1-based document ids (0 = a slot holding no real token), ``position_ids`` document-local,
``padding_mask`` True = pad. Defaults: ``position_ids = rank * L + arange(L)``, one document per row, no padding.
``model(**batch)`` also accepts the keys of a seed-sharded batch dict and ``seq_lens`` rows of back-to-back
documents (see :mod:`dsv4.model.inputs`, which resolves every call into one set of tensors). ``logits_to_keep``:
0 = project every position, ``k > 0`` = the last ``k`` (caller) positions, a 1-D index tensor = those positions
(MTP logits follow the same selection); loss needs 0.

Labels are pre-shifted (``labels[i]`` is the target of ``logits[i]``; -100 = ignored). The MTP term is normalised
by the *main* label count so that a distributed trainer reduces exactly one (sum, count) pair: ``loss = (sum over
ranks loss_sum) / (sum over ranks label_count)``. The per-depth sums/counts are also returned for logging.

Weights: ``nn.Linear``/``nn.Embedding`` weights ~ N(0, initializer_range); other modules initialise themselves
(RMSNorm ones, hyper-connection fn ~ N(0, initializer_range), base 0, scale 1, expert weights ~ N(0, std)).
Embeddings are untied. Parameters are created in the default dtype; the model never imports torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.model.attention import DSV4Attention
from dsv4.model.attention_metadata import AttentionMetadata, build_attention_metadata
from dsv4.model.block import DSV4Block
from dsv4.model.chunked_loss import linear_cross_entropy
from dsv4.model.context_parallel import ContextParallel
from dsv4.model.hyper_connections import HyperHead
from dsv4.model.inputs import ModelInputs, resolve_inputs
from dsv4.model.moe import GroupedExperts
from dsv4.model.mtp import MultiTokenPrediction
from dsv4.model.norm import RMSNorm


@dataclass
class DSV4Output:
    """Output of :class:`DSV4ForCausalLM`. Loss fields are ``None`` without labels; ``logits`` is None (and
    ``mtp_logits`` empty) with ``return_logits=False``."""

    logits: torch.Tensor | None
    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    label_count: torch.Tensor | None = None
    ce_loss_sum: torch.Tensor | None = None
    mtp_loss_sums: list[torch.Tensor] = field(default_factory=list)
    mtp_label_counts: list[torch.Tensor] = field(default_factory=list)
    indexer_loss_sum: torch.Tensor | None = None


@dataclass
class BackboneOutput:
    hidden: torch.Tensor  # [B, L, d]  final-normed, after the hyper-head
    streams: torch.Tensor  # [B, L, hc, d]  residual streams after the last block (MTP input)


class DSV4Model(nn.Module):
    """Backbone: ``forward(input_ids [B, L], meta, cp) -> BackboneOutput``; ``meta`` is the forward's
    :class:`~dsv4.model.attention_metadata.AttentionMetadata` (built once by :class:`DSV4ForCausalLM`)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DSV4Block(config, i) for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(
            config.hc_mult,
            config.hidden_size,
            hc_eps=config.hc_eps,
            norm_eps=config.rms_norm_eps,
            init_std=config.initializer_range,
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cp: ContextParallel | None = None) -> BackboneOutput:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, input_ids, meta, cp)
        return BackboneOutput(hidden=self.finish(x), streams=x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, L]`` -> the first block's input streams ``[B, L, hc, d]`` (the embedding, hc times)."""
        h = self.embed_tokens(input_ids)
        return h.unsqueeze(-2).expand(*h.shape[:-1], self.config.hc_mult, h.shape[-1])

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's streams ``[B, L, hc, d]`` -> the final-normed hidden ``[B, L, d]``."""
        return self.norm(self.hc_head(x))


class CausalLM(nn.Module):
    """What every model family's causal LM shares: the public forward (inputs resolved by
    :func:`~dsv4.model.inputs.resolve_inputs`, the packed layout restored, ``logits_to_keep``), the fp32
    ``lm_head``, the token-sum CE loss (chunked without logits). A family provides ``self.config``,
    ``self.lm_head`` and ``_hidden_states(inputs) -> (hidden [B, L, d], MTP hiddens, MTP labels or None, indexer KL
    sums)``."""

    config: object
    lm_head: nn.Linear

    def _hidden_states(self, inputs: ModelInputs) -> tuple[torch.Tensor, list[torch.Tensor], list | None, list]:
        raise NotImplementedError

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 lm_head: ``[B, L, d] -> [B, L, vocab]`` fp32."""
        return F.linear(hidden.float(), self.lm_head.weight.float())

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        packed_seq_ids: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        cp: ContextParallel | None = None,
        labels: torch.Tensor | None = None,
        *,
        logits_to_keep: int | torch.Tensor = 0,
        return_logits: bool = True,
        **batch_keys,
    ) -> DSV4Output:
        """Forward this rank's tokens (see the module docstring); ``batch_keys``: see :mod:`dsv4.model.inputs`.

        ``return_logits=False`` (needs ``labels``) computes the loss with the chunked linear + cross-entropy of
        :mod:`dsv4.model.chunked_loss` and returns no logits: no ``[L, vocab]`` tensor exists in forward or backward.
        """
        if not return_logits and labels is None:
            raise ValueError("return_logits=False computes only the loss: pass labels")
        inputs = resolve_inputs(self.config, input_ids, position_ids, packed_seq_ids, padding_mask, cp, labels,
                                batch_keys)
        hidden, mtp_hiddens, mtp_labels, indexer_losses = self._hidden_states(inputs)
        layout = inputs.layout
        if layout is not None and inputs.labels is None:  # logits in caller coordinates (logits_to_keep selects there)
            hidden, mtp_hiddens = layout.restore(hidden), [layout.restore(h) for h in mtp_hiddens]
        out = self._head_and_loss(hidden, mtp_hiddens, inputs.labels, mtp_labels, logits_to_keep, return_logits)
        if indexer_losses and out.loss_sum is not None:  # the indexer's KL (dsv4.model.indexer_loss)
            out.indexer_loss_sum = torch.stack(indexer_losses).mean()
            out.loss_sum = out.loss_sum + self.config.indexer_loss_coeff * out.indexer_loss_sum
            out.loss = out.loss_sum / out.label_count.clamp_min(1)
        if layout is not None and out.logits is not None and inputs.labels is not None:  # loss on the aligned rows
            out.logits = layout.restore(out.logits)
            out.mtp_logits = [layout.restore(t) for t in out.mtp_logits]
        return out

    def _head_and_loss(self, hidden, mtp_hiddens, labels, mtp_labels, logits_to_keep, return_logits) -> DSV4Output:
        keep = _keep_positions(logits_to_keep, hidden.shape[1])
        if keep is not None and labels is not None:
            raise ValueError(f"logits_to_keep={logits_to_keep!r} drops logits the loss needs; pass "
                             "logits_to_keep=0 with labels")
        if keep is not None:
            hidden = hidden.index_select(1, keep.to(hidden.device))
            mtp_hiddens = [h.index_select(1, keep.to(h.device)) for h in mtp_hiddens]
        out = DSV4Output(logits=None)
        if return_logits:
            out.logits = self.logits_from_hidden(hidden)
            out.mtp_logits = [self.logits_from_hidden(h) for h in mtp_hiddens]
        if labels is None:
            return out

        def ce(h, logits, y):
            if logits is not None:
                return token_ce_sum(logits, y)
            return linear_cross_entropy(h, self.lm_head.weight, y, self.config.loss_chunk_size)

        out.ce_loss_sum, out.label_count = ce(hidden, out.logits, labels)
        loss_sum = out.ce_loss_sum
        if mtp_labels:
            mtp_logits = out.mtp_logits or [None] * len(mtp_hiddens)
            for h, mtp_logit, mtp_label in zip(mtp_hiddens, mtp_logits, mtp_labels):
                s, n = ce(h, mtp_logit, mtp_label)
                out.mtp_loss_sums.append(s)
                out.mtp_label_counts.append(n)
            loss_sum = loss_sum + self.config.mtp_loss_weight * torch.stack(out.mtp_loss_sums).mean()
        out.loss_sum = loss_sum
        out.loss = loss_sum / out.label_count.clamp_min(1)
        return out

    def num_parameters(self, active_only: bool = False) -> int:
        """Total parameters, or the parameters active per token (see :func:`parameter_counts`)."""
        counts = parameter_counts(self)
        return counts["active"] if active_only else counts["total"]



class DSV4ForCausalLM(CausalLM):
    """DSV4 backbone + fp32 lm_head + MTP depths + token-sum CE loss. See the module docstring."""

    def __init__(self, config) -> None:
        super().__init__()
        family = getattr(config, "model_type", "deepseek_v4")
        if family != "deepseek_v4":
            raise ValueError(f"DSV4ForCausalLM: config.model_type is {family!r}, not 'deepseek_v4'; build the model "
                             "of the config's family with dsv4.model.build_causal_lm(config)")
        self.config = config
        self.model = DSV4Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = MultiTokenPrediction(config)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)

    def _hidden_states(self, inputs: ModelInputs) -> tuple[torch.Tensor, list[torch.Tensor], list | None, list]:
        """Backbone + MTP depths: ``(hidden [B, L, d], MTP hiddens, MTP labels or None, the CSA layers' indexer KL
        sums)``."""
        meta = build_attention_metadata(self.config, inputs.position_ids, inputs.seq_ids, inputs.padding, inputs.cp)
        layers = [m for m in self.modules() if isinstance(m, DSV4Attention) and m.indexer is not None]
        for layer in layers:
            layer.indexer_loss = None
        backbone = self.model(inputs.input_ids, meta, inputs.cp)
        mtp_hiddens, mtp_labels = self.mtp(backbone.streams, self.model.embed_tokens, inputs.input_ids, meta,
                                           labels=inputs.labels, cp=inputs.cp)
        losses = [layer.indexer_loss for layer in layers if layer.indexer_loss is not None]
        for layer in layers:  # the output holds them now; the layers keep no graph past this forward
            layer.indexer_loss = None
        return backbone.hidden, mtp_hiddens, mtp_labels, losses

def _keep_positions(logits_to_keep, length: int) -> torch.Tensor | None:
    """``None`` (keep all) or the 1-D index of the positions whose logits are projected."""
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() == 0 and not logits_to_keep.is_floating_point():
            logits_to_keep = int(logits_to_keep)
        else:
            if logits_to_keep.dim() != 1 or logits_to_keep.is_floating_point():
                raise ValueError(f"logits_to_keep as a tensor must be a 1-D integer index, got "
                                 f"{logits_to_keep.dtype} {tuple(logits_to_keep.shape)}")
            return logits_to_keep.long() % max(length, 1)
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be 0 (all), a positive int (last k) or an index tensor, got "
                         f"{logits_to_keep!r}")
    if logits_to_keep == 0:
        return None
    return torch.arange(max(length - logits_to_keep, 0), length)


def token_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of fp32 CE over labels != -100, count of those labels)``."""
    flat_labels = labels.reshape(-1)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), flat_labels, ignore_index=-100, reduction="sum"
    )
    return ce, (flat_labels != -100).sum()


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """``{"total", "active", "routed_experts"}`` parameter counts of ``model`` (works on the meta device).

    ``active`` = every parameter except routed experts, plus ``num_experts_per_tok`` routed experts per MoE
    layer (MTP layers included; shared experts, embedding and lm_head are counted in full).
    """
    total = sum(p.numel() for p in model.parameters())
    routed = 0
    active_routed = 0
    top_k = model.config.num_experts_per_tok
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            n = sum(p.numel() for p in m.parameters(recurse=False))
            routed += n
            active_routed += n // m.num_local_experts * min(top_k, m.num_local_experts)
    return {"total": total, "active": total - routed + active_routed, "routed_experts": routed}
