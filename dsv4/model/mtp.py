"""Multi-token prediction: ``num_nextn_predict_layers`` chained depths.

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

Under context parallelism the shift needs the first ``s`` tokens after each local row, which belong to the next chunk:
that chunk sends their ids (or labels), already set to the fill value where they leave the document or are padding
(``s`` int32 per row and call, ``mtp_metadata``; no activations, nothing when the document does not continue).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.attention_metadata import AttentionMetadata
from dsv4.model.block import DSV4Block
from dsv4.model.context_parallel import ContextParallel, is_parallel
from dsv4.model.hyper_connections import HyperHead
from dsv4.model.norm import RMSNorm
from dsv4.model.recompute import recomputed


class DocumentShift:
    """Shift per-token integer tensors left inside documents, for this rank's local rows ``[R, L]`` (each a chunk of
    a whole row under CP).

    Built once per forward from the attention metadata; calling it with a local tensor ``[R, L]`` returns ``[R, L]``.
    Under CP the last ``s`` tokens of a row whose document continues into the next chunk read that chunk's first
    ``s`` values, which it sends already checked (``fill`` where they leave the document or are padding).
    """

    def __init__(self, meta: AttentionMetadata, cp: ContextParallel | None = None) -> None:
        self.cp = cp if is_parallel(cp) and meta.routes is not None else None
        self.meta = meta
        seq = meta.seq_ids
        self.pad = meta.padding if meta.padding is not None else torch.zeros_like(seq, dtype=torch.bool)

    def _ahead(self, local_values: torch.Tensor, shift: int, fill: int) -> torch.Tensor:
        """``[R, shift]``: the values of the ``shift`` tokens after each local row, ``fill`` where none counts."""
        seq = self.meta.seq_ids
        none = torch.full((seq.shape[0], shift), fill, dtype=local_values.dtype, device=local_values.device)
        if self.cp is None:
            return none
        # what this row's predecessor reads: my first tokens while they stay in my first document, unpadded
        head = seq[:, :shift]
        keep = (head == seq[:, :1]) & (head > 0) & ~self.pad[:, :shift]
        sent = torch.where(keep, local_values[:, :shift], torch.full_like(local_values[:, :shift], fill))
        received = self.cp.halo_exchange(sent.to(torch.int32), shift, dim=1, kind="mtp_metadata",
                                         route=self.meta.routes.next).to(local_values.dtype)  # ids and labels fit
        return torch.where(self.meta.next_rows[:, None], received, none)

    def __call__(self, local_values: torch.Tensor, shift: int, fill: int) -> torch.Tensor:
        seq, length = self.meta.seq_ids, self.meta.seq_ids.shape[1]
        if shift > length:
            raise ValueError(f"DocumentShift: shift {shift} is longer than the local rows ({length} tokens)")
        src = torch.arange(length, device=seq.device) + shift
        inside = src < length
        shifted = torch.cat((local_values, self._ahead(local_values, shift, fill)), dim=1)[:, shift:]
        src_seq = seq[:, src.clamp(max=length - 1)]
        src_pad = self.pad[:, src.clamp(max=length - 1)]
        # inside the row: the same document and no padding; beyond it: the row's last document, checked by the sender
        ok = torch.where(inside, (src_seq == seq) & ~src_pad, seq == seq[:, -1:]) & (seq > 0)
        return torch.where(ok, shifted, torch.full_like(shifted, fill))


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
        self, x: torch.Tensor, shifted_embeds: torch.Tensor, shifted_ids: torch.Tensor, meta: AttentionMetadata,
        cp: ContextParallel | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, L, hc, d]``, ``shifted_embeds [B, L, d]`` -> ``(X' [B, L, hc, d], hidden [B, L, d])``.

        Under ``activation_checkpointing=block`` (while autograd records) the depth saves only its inputs: the
        projections, norms, the block, the hyper-head and the final norm are recomputed in backward. The
        :class:`DocumentShift` (a CP exchange) runs in :class:`MultiTokenPrediction`, outside the recomputed region;
        inside it only the block's attention exchanges, as a recomputed decoder block does."""
        if self.activation_checkpointing == "block" and torch.is_grad_enabled():
            return recomputed(self._depth, x, shifted_embeds, shifted_ids, meta, cp)
        return self._depth(x, shifted_embeds, shifted_ids, meta, cp)

    def _depth(self, x: torch.Tensor, shifted_embeds: torch.Tensor, shifted_ids: torch.Tensor, meta: AttentionMetadata,
               cp: ContextParallel | None) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.e_proj(self.enorm(shifted_embeds))
        x = e.unsqueeze(-2) + self.h_proj(self.hnorm(x))
        x = self._forward(x, shifted_ids, meta, cp)
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
        meta: AttentionMetadata,
        labels: torch.Tensor | None = None,
        cp: ContextParallel | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """``x [B, L, hc, d]`` (the backbone's streams) -> per depth ``hidden [B, L, d]`` (+ shifted labels)."""
        hiddens: list[torch.Tensor] = []
        mtp_labels: list[torch.Tensor] | None = None if labels is None else []
        if not len(self.layers):
            return hiddens, mtp_labels
        shift = DocumentShift(meta, cp)
        for d, layer in enumerate(self.layers):
            ids = shift(input_ids, d + 1, fill=0)
            x, hidden = layer(x, embed_tokens(ids), ids, meta, cp)
            hiddens.append(hidden)
            if mtp_labels is not None:
                mtp_labels.append(shift(labels, d + 1, fill=-100))
        return hiddens, mtp_labels
