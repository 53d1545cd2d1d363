"""Multi-token prediction (spec section 5.3): ``num_nextn_predict_layers`` chained depths.

Depth ``d`` (0-based, shift ``s = d + 1``) predicts, at position ``i``, the token ``s + 1`` places ahead, i.e.
the (pre-shifted) label of position ``i + s``. With ``X`` the residual streams ``[B, L, hc, d_m]`` of the main
model's last block (depth 0) or of the previous depth:

    e = e_proj(enorm(embed(ids shifted left by s inside each document)))      [B, L, d_m]
    X = e (broadcast over the hc streams) + h_proj(hnorm(X))                   [B, L, hc, d_m]
    X = DSV4Block(layer num_hidden_layers + d)(X)                               (full HC + attention + MoE)
    hidden_d = norm(hc_head(X))  -> the shared lm_head gives mtp_logits[d]

Documents (packed rows): the shift never crosses a document. Position ``i`` is *valid* at shift ``s`` when
``i + s`` is inside the row, has the same ``packed_seq_ids`` (> 0) and is not a pad slot (``padding_mask``).
Invalid positions get input id ``0`` and target ``-100`` (ignored). They form a suffix of every document (its
last ``s`` real tokens and its pad slots), so no valid position attends to them and the fill value cannot leak
into any loss or gradient; a packed row therefore gives the same MTP numbers as running each document alone.

Under context parallelism the shift needs the next rank's first ``s`` tokens; the model all-gathers the integer
metadata (ids, labels, seq ids, padding; O(S) integers, no activations) through ``cp.all_gather_metadata``.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.block import DSV4Block
from dsv4.model.hyper_connections import HyperHead
from dsv4.model.norm import RMSNorm


class DocumentShift:
    """Shift per-token integer tensors left inside documents, for this rank's rows ``[rank*L, (rank+1)*L)``.

    Built once per forward from the local ``packed_seq_ids [B, L]`` and ``padding_mask [B, L] | None``; calling
    it with a local tensor ``[B, L]`` gathers it over CP (identity without CP) and returns ``[B, L]``.
    """

    def __init__(self, packed_seq_ids: torch.Tensor, padding_mask: torch.Tensor | None, cp=None,
                 attn_metadata=None) -> None:
        self.cp = cp if cp is not None and getattr(cp, "enabled", False) else None
        self.local_len = packed_seq_ids.shape[1]
        self.start = self.cp.rank * self.local_len if self.cp is not None else 0
        full_seq = getattr(attn_metadata, "full_seq_ids", None)
        if full_seq is not None:  # the attention metadata already gathered the whole row's ids and padding
            self.seq_ids = full_seq
            self.pad = None if padding_mask is None else attn_metadata.full_padding
        else:
            self.seq_ids = self._gather(packed_seq_ids)
            self.pad = None if padding_mask is None else self._gather(padding_mask)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.cp is None else self.cp.all_gather_metadata(t, dim=1, kind="mtp_metadata")

    def valid(self, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(valid [B, L] bool, src [L] long)``: whether local token ``i`` has a same-document source ``i+s``."""
        total = self.seq_ids.shape[1]
        g = torch.arange(self.start, self.start + self.local_len, device=self.seq_ids.device)
        src = (g + shift).clamp(max=total - 1)
        here = self.seq_ids[:, g]
        ok = (g + shift < total) & (self.seq_ids[:, src] == here) & (here > 0)
        if self.pad is not None:
            ok = ok & ~self.pad[:, src]
        return ok, src

    def __call__(self, local_values: torch.Tensor, shift: int, fill: int) -> torch.Tensor:
        full = self._gather(local_values)
        ok, src = self.valid(shift)
        return torch.where(ok, full[:, src], torch.full_like(full[:, src], fill))


class MTPLayer(DSV4Block):
    """One MTP depth: a full DSV4 block (layer ``num_hidden_layers + depth``) plus its input projections and
    its own hyper-head and final norm. The embedding and lm_head are the main model's (passed in)."""

    def __init__(self, config, depth: int) -> None:
        super().__init__(config, config.num_hidden_layers + depth)
        self.depth = depth
        d = config.hidden_size
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.hc_head = HyperHead(
            config.hc_mult, d, hc_eps=config.hc_eps, norm_eps=config.rms_norm_eps, init_std=config.initializer_range
        )
        self.norm = RMSNorm(d, config.rms_norm_eps)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        shifted_embeds: torch.Tensor,
        shifted_ids: torch.Tensor,
        position_ids: torch.Tensor,
        packed_seq_ids: torch.Tensor,
        padding_mask: torch.Tensor | None,
        cp=None,
        attn_metadata=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, L, hc, d]``, ``shifted_embeds [B, L, d]`` -> ``(X' [B, L, hc, d], hidden [B, L, d])``."""
        e = self.e_proj(self.enorm(shifted_embeds))
        x = e.unsqueeze(-2) + self.h_proj(self.hnorm(x))
        x = super().forward(x, shifted_ids, position_ids, packed_seq_ids, padding_mask, cp, attn_metadata)
        return x, self.norm(self.hc_head(x))


class MultiTokenPrediction(nn.Module):
    """The chain of MTP depths. ``forward`` returns one normalised hidden ``[B, L, d]`` per depth, plus the
    shifted MTP labels when ``labels`` is given (``-100`` where the target would leave the document)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(config, d) for d in range(config.num_nextn_predict_layers))

    def forward(
        self,
        x: torch.Tensor,
        embed_tokens: nn.Embedding,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        packed_seq_ids: torch.Tensor,
        padding_mask: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        cp=None,
        attn_metadata=None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        hiddens: list[torch.Tensor] = []
        mtp_labels: list[torch.Tensor] | None = None if labels is None else []
        if not len(self.layers):
            return hiddens, mtp_labels
        shift = DocumentShift(packed_seq_ids, padding_mask, cp, attn_metadata)
        for d, layer in enumerate(self.layers):
            ids = shift(input_ids, d + 1, fill=0)
            x, hidden = layer(
                x, embed_tokens(ids), ids, position_ids, packed_seq_ids, padding_mask, cp, attn_metadata
            )
            hiddens.append(hidden)
            if mtp_labels is not None:
                mtp_labels.append(shift(labels, d + 1, fill=-100))
        return hiddens, mtp_labels
