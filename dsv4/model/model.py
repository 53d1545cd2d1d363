"""`DSV4Model` (embedding -> blocks -> hyper-head -> norm) and `DSV4ForCausalLM` (+ lm_head, MTP, loss).

Public contract (DESIGN.md section 4)::

    out = DSV4ForCausalLM(config)(input_ids [B, L], position_ids=None, packed_seq_ids=None,
                                  padding_mask=None, cp=None, labels=None)
    out.logits        [B, L, vocab] fp32, for this rank's L local tokens
    out.mtp_logits    list of [B, L, vocab] fp32, one per MTP depth
    out.loss          (labels given) loss_sum / label_count
    out.loss_sum      CE_sum + mtp_loss_weight * mean_d(MTP_CE_sum_d)   (one scalar: reduce it over ranks)
    out.label_count   number of labels != -100 (main head)

Packed rows (single rank): ``model(input_ids [B, S], seq_lens=[B, D], seq_lens_padded=None)`` without
``packed_seq_ids`` builds a :class:`dsv4.packing.PackedSequenceLayout` with ``aligned_packed_layout`` (alignment =
``config.cp_shard_multiple``, see :func:`packing_alignment`), runs the backbone on the aligned rows with the
layout's document ids, document-local positions and ``padding_mask = sequence_ids == 0``, and restores the
hidden states to caller coordinates before the head (caller padding columns give zero hidden, hence zero
logits). ``packed_layout=`` passes a prebuilt layout instead (e.g. one synchronised over ranks). When the batch
already carries ``packed_seq_ids`` (a CP-sharded batch) ``seq_lens`` / ``seq_lens_padded`` are global metadata
and are ignored, as before. ``logits_to_keep``: 0 = project every position, ``k > 0`` = the last ``k`` caller
positions, a 1-D index tensor = those positions (MTP logits follow the same selection); loss needs 0.

Defaults: ``position_ids = rank * L + arange(L)`` (rank 0 without CP), ``packed_seq_ids`` all 1 (one
document), ``padding_mask`` None (no pad keys). Labels are pre-shifted (``labels[i]`` is the target of
``logits[i]``; -100 = ignored). The MTP term is normalised by the *main* label count so that a distributed
trainer reduces exactly one (sum, count) pair: ``loss = (sum over ranks loss_sum) / (sum over ranks
label_count)``. The per-depth sums/counts are also returned for logging.

Weights: ``nn.Linear``/``nn.Embedding`` weights ~ N(0, initializer_range); other modules initialise themselves
(RMSNorm ones, hyper-connection fn ~ N(0, initializer_range), base 0, scale 1, expert weights ~ N(0, std)).
Embeddings are untied. Parameters are created in the default dtype; the model never imports torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.model.attention import AttentionMetadata, build_attention_metadata
from dsv4.model.block import DSV4Block
from dsv4.model.hyper_connections import HyperHead
from dsv4.model.moe import GroupedExperts
from dsv4.model.mtp import MultiTokenPrediction
from dsv4.model.norm import RMSNorm


@dataclass
class DSV4Output:
    """Output of :class:`DSV4ForCausalLM`. Loss fields are ``None`` without labels."""

    logits: torch.Tensor
    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    label_count: torch.Tensor | None = None
    ce_loss_sum: torch.Tensor | None = None
    mtp_loss_sums: list[torch.Tensor] = field(default_factory=list)
    mtp_label_counts: list[torch.Tensor] = field(default_factory=list)


@dataclass
class BackboneOutput:
    hidden: torch.Tensor  # [B, L, d]  final-normed, after the hyper-head
    streams: torch.Tensor  # [B, L, hc, d]  residual streams after the last block (MTP input)
    attn_metadata: AttentionMetadata  # built once per forward, reused by the MTP blocks


def default_position_ids(input_ids: torch.Tensor, cp=None) -> torch.Tensor:
    """``rank * L + arange(L)`` broadcast to ``[B, L]`` (rank 0 without CP)."""
    b, length = input_ids.shape
    rank = cp.rank if cp is not None else 0
    pos = torch.arange(rank * length, (rank + 1) * length, device=input_ids.device)
    return pos.unsqueeze(0).expand(b, length)


class DSV4Model(nn.Module):
    """Backbone: ``forward(input_ids [B, L], position_ids, packed_seq_ids, padding_mask, cp) -> BackboneOutput``.

    All arguments are already resolved (no defaults here, see :class:`DSV4ForCausalLM`)."""

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

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        packed_seq_ids: torch.Tensor,
        padding_mask: torch.Tensor | None,
        cp=None,
    ) -> BackboneOutput:
        meta = build_attention_metadata(self.config, position_ids, packed_seq_ids, padding_mask, cp)
        h = self.embed_tokens(input_ids)
        x = h.unsqueeze(-2).expand(*h.shape[:-1], self.config.hc_mult, h.shape[-1])
        for layer in self.layers:
            x = layer(x, input_ids, position_ids, packed_seq_ids, padding_mask, cp, meta)
        return BackboneOutput(hidden=self.norm(self.hc_head(x)), streams=x, attn_metadata=meta)


class DSV4ForCausalLM(nn.Module):
    """DSV4 backbone + fp32 lm_head + MTP depths + token-sum CE loss. See the module docstring."""

    def __init__(self, config) -> None:
        super().__init__()
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

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 lm_head: ``[B, L, d] -> [B, L, vocab]`` fp32."""
        return F.linear(hidden.float(), self.lm_head.weight.float())

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        packed_seq_ids: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        cp=None,
        labels: torch.Tensor | None = None,
        **batch_metadata,
    ) -> DSV4Output:
        """Forward this rank's tokens; ``model(**sharded_batch)`` works for a batch from the CP sharder.

        ``batch_metadata`` may hold the sharded batch's other keys: ``_dsv4_cp_group`` (turned into a
        ``CPContext`` when ``cp`` is None; a group whose size differs from ``cp``'s raises), and the global
        ``seq_lens`` / ``seq_lens_padded`` / ``qkv_format``, which the model does not need, and ``loss_mask``
        (0 = do not train on this token; applied to ``labels``). Unknown keys raise.
        """
        logits_to_keep = batch_metadata.pop("logits_to_keep", 0)
        layout = batch_metadata.pop("packed_layout", None)
        cp = _resolve_cp(cp, batch_metadata)
        seq_lens = batch_metadata.get("seq_lens")
        if packed_seq_ids is None and (seq_lens is not None or layout is not None):
            return self._packed_forward(input_ids, seq_lens, batch_metadata.get("seq_lens_padded"), layout,
                                        position_ids, padding_mask, cp, labels, batch_metadata.get("loss_mask"),
                                        logits_to_keep)
        loss_mask = batch_metadata.get("loss_mask")
        if loss_mask is not None:
            if labels is None or loss_mask.shape != labels.shape:
                raise ValueError(
                    f"loss_mask {tuple(loss_mask.shape)} needs labels of the same shape, got "
                    f"{None if labels is None else tuple(labels.shape)}"
                )
            labels = labels.masked_fill(loss_mask == 0, -100)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = default_position_ids(input_ids, cp)
        if packed_seq_ids is None:
            packed_seq_ids = torch.ones_like(input_ids)
        for name, t in (("position_ids", position_ids), ("packed_seq_ids", packed_seq_ids),
                        ("padding_mask", padding_mask), ("labels", labels)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(input_ids.shape)} (input_ids)")

        backbone = self.model(input_ids, position_ids, packed_seq_ids, padding_mask, cp)
        mtp_hiddens, mtp_labels = self.mtp(
            backbone.streams, self.model.embed_tokens, input_ids, position_ids, packed_seq_ids, padding_mask,
            labels=labels, cp=cp, attn_metadata=backbone.attn_metadata,
        )
        return self._head_and_loss(backbone.hidden, mtp_hiddens, labels, mtp_labels, logits_to_keep)

    def _head_and_loss(self, hidden, mtp_hiddens, labels, mtp_labels, logits_to_keep) -> DSV4Output:
        keep = _keep_positions(logits_to_keep, hidden.shape[1])
        if keep is not None and labels is not None:
            raise ValueError(f"logits_to_keep={logits_to_keep!r} drops logits the loss needs; pass "
                             "logits_to_keep=0 with labels")
        if keep is not None:
            hidden = hidden.index_select(1, keep.to(hidden.device))
            mtp_hiddens = [h.index_select(1, keep.to(h.device)) for h in mtp_hiddens]
        logits = self.logits_from_hidden(hidden)
        out = DSV4Output(logits=logits, mtp_logits=[self.logits_from_hidden(h) for h in mtp_hiddens])
        if labels is None:
            return out

        out.ce_loss_sum, out.label_count = token_ce_sum(logits, labels)
        loss_sum = out.ce_loss_sum
        if mtp_labels:
            for mtp_logit, mtp_label in zip(out.mtp_logits, mtp_labels):
                s, n = token_ce_sum(mtp_logit, mtp_label)
                out.mtp_loss_sums.append(s)
                out.mtp_label_counts.append(n)
            loss_sum = loss_sum + self.config.mtp_loss_weight * torch.stack(out.mtp_loss_sums).mean()
        out.loss_sum = loss_sum
        out.loss = loss_sum / out.label_count.clamp_min(1)
        return out

    def _packed_forward(self, input_ids, seq_lens, seq_lens_padded, layout, position_ids, padding_mask, cp,
                        labels, loss_mask, logits_to_keep) -> DSV4Output:
        """``seq_lens`` path (see the module docstring): pack -> backbone (+ MTP) on aligned rows -> restore."""
        from dsv4.packing import aligned_packed_layout

        if cp is not None and cp.size > 1:
            raise ValueError("seq_lens without packed_seq_ids is the single-rank packed path; under context "
                             "parallelism shard the batch with the CP sharder (it adds packed_seq_ids)")
        if position_ids is not None or padding_mask is not None:
            raise ValueError("with seq_lens (and no packed_seq_ids) the model builds position_ids and padding_mask "
                             "from the aligned packed layout; do not pass them")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        if layout is None:
            layout = aligned_packed_layout(seq_lens, input_ids.shape, packing_alignment(self.config),
                                           seq_lens_padded=seq_lens_padded)
        elif (layout.batch_size, layout.input_length) != tuple(input_ids.shape):
            raise ValueError(f"packed_layout maps caller rows {(layout.batch_size, layout.input_length)}, "
                             f"input_ids has shape {tuple(input_ids.shape)}")
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels has shape {tuple(labels.shape)}, expected {tuple(input_ids.shape)}")
            if loss_mask is not None:
                labels = labels.masked_fill(loss_mask == 0, -100)
            labels = layout.pack(labels, fill=-100)
        elif loss_mask is not None:
            raise ValueError("loss_mask needs labels")
        ids = layout.pack(input_ids, fill=0)
        seq_ids = layout.sequence_ids.to(ids.device)
        positions = layout.position_ids.to(ids.device)
        pad = seq_ids == 0
        backbone = self.model(ids, positions, seq_ids, pad, None)
        mtp_hiddens, mtp_labels = self.mtp(
            backbone.streams, self.model.embed_tokens, ids, positions, seq_ids, pad,
            labels=labels, cp=None, attn_metadata=backbone.attn_metadata,
        )
        if labels is not None:  # the loss is a sum over labelled tokens: compute it in aligned coordinates
            out = self._head_and_loss(backbone.hidden, mtp_hiddens, labels, mtp_labels, logits_to_keep)
            out.logits = layout.restore(out.logits)
            out.mtp_logits = [layout.restore(t) for t in out.mtp_logits]
            return out
        hidden = layout.restore(backbone.hidden)
        return self._head_and_loss(hidden, [layout.restore(h) for h in mtp_hiddens], None, None, logits_to_keep)

    def num_parameters(self, active_only: bool = False) -> int:
        """Total parameters, or the parameters active per token (see :func:`parameter_counts`)."""
        counts = parameter_counts(self)
        return counts["active"] if active_only else counts["total"]


def packing_alignment(config) -> int:
    """Where packed documents must start: ``config.cp_shard_multiple``.

    For compressors without overlap (V4.1 ratios 2 and 1) this is the lcm of the active compress ratios
    (V4.1: 2). A ratio-4 (overlapping) compressor pools the previous window too, so the multiple counts it
    as 8; the tiny V4 preset (ratios 4 and 128) therefore aligns documents to lcm(8, 128) = 128, the same
    multiple the CP repad uses. Alignment slots get document id 0 and ``padding_mask`` True: a compressor
    window holding one is invalid, exactly like the incomplete trailing window of a document run alone.
    """
    return int(config.cp_shard_multiple)


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


_IGNORED_BATCH_KEYS = frozenset({"seq_lens", "seq_lens_padded", "qkv_format", "cp_partition_mode"})


def _resolve_cp(cp, batch_metadata: dict):
    """The CP context of a forward: ``cp``, or one built from the batch's ``_dsv4_cp_group``."""
    unknown = set(batch_metadata) - _IGNORED_BATCH_KEYS - {"_dsv4_cp_group", "loss_mask"}
    if unknown:
        raise TypeError(f"DSV4ForCausalLM.forward got unexpected keyword arguments {sorted(unknown)}")
    if "_dsv4_cp_group" not in batch_metadata:
        return cp
    from dsv4.cp.context import CPContext  # the model touches CP only through CPContext

    from_batch = CPContext(batch_metadata["_dsv4_cp_group"])
    if cp is None:
        return from_batch if from_batch.size > 1 else None
    if cp.size != from_batch.size:
        raise ValueError(
            f"the batch was sharded for a CP group of {from_batch.size} ranks but the forward got a CPContext of "
            f"{cp.size} ranks; build the CPContext from the same group as the sharder's mesh"
        )
    return cp


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
