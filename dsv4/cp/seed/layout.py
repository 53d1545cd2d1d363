"""`ShardLayout`: how a sharded batch relates to the caller's token coordinates.

Three coordinate systems: *caller* (the batch as the data loader produced it, ``[B, S_in]``), *padded* (the full
row after any repad/CP padding, ``[B, P]``) and *local* (this rank's contiguous slice ``[B, P / C]``). The layout
carries what is needed to map between caller and padded coordinates; the sharder's index function maps padded to
local.

Fields (all optional, as in the seed):

* ``local_token_global_indices``: the partition actually computed, for data-dependent layouts;
* ``original_seq_len``: the pre-pad length (None for packed rows, which have no single original length);
* ``padded_seq_len``: the post-pad global length P;
* ``input_row_shape``: the pre-flatten ``[B, S]`` of a THD stream;
* ``input_token_stream_positions``: ``[B, S_in]`` long, the padded column of every caller column, -1 = dropped
  (DSV4 packed rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.packing import take_tokens


@dataclass(frozen=True)
class ShardLayout:
    local_token_global_indices: torch.Tensor | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None

    def is_caller_shaped(self, t: torch.Tensor, seq_dim: int) -> bool:
        """True when ``t`` is in caller coordinates of a repositioned layout (``[B, S_in, ...]`` on dim 1)."""
        pos = self.input_token_stream_positions
        return pos is not None and seq_dim % t.dim() == 1 and tuple(t.shape[:2]) == tuple(pos.shape)

    def to_padded(self, t: torch.Tensor, fill) -> torch.Tensor:
        """Scatter a caller-coordinate ``[B, S_in, ...]`` tensor into ``[B, P, ...]`` padded rows filled with ``fill``."""
        if fill is None:
            raise ValueError("a repositioned layout requires `fill` to shard a caller-coordinate tensor")
        pos, padded = self.input_token_stream_positions.to(t.device), self.padded_seq_len
        source = torch.full((pos.shape[0], padded + 1), -1, dtype=torch.long, device=t.device)  # padded -> caller
        source.scatter_(1, torch.where(pos >= 0, pos, padded), torch.arange(pos.shape[1], device=t.device).expand_as(pos))
        return take_tokens(t, source[:, :padded], fill)

    def restore(self, full: torch.Tensor, seq_dim: int = 1, fill=None) -> torch.Tensor:
        """Map a padded-coordinate tensor (length P on ``seq_dim``) back to caller coordinates.

        Repositioned layouts need ``fill`` (value of dropped caller slots) and ``seq_dim == 1``; THD layouts
        reshape the stream back to rows; otherwise the padding is narrowed away.
        """
        seq_dim = seq_dim % full.dim()
        if self.padded_seq_len is not None and full.shape[seq_dim] != self.padded_seq_len:
            raise ValueError(
                f"gathered length {full.shape[seq_dim]} on dim {seq_dim} != reported padded_seq_len "
                f"{self.padded_seq_len}"
            )
        pos = self.input_token_stream_positions
        if pos is not None:
            if fill is None:
                raise ValueError("restoring to a repositioned layout requires `fill` for dropped caller slots")
            if seq_dim != 1:
                raise ValueError(f"a repositioned layout restores along dim 1, got seq_dim={seq_dim}")
            return take_tokens(full, pos, fill)
        if self.input_row_shape is not None:
            return full.reshape(*self.input_row_shape, *full.shape[seq_dim + 1 :])
        if self.original_seq_len is not None:
            return full.narrow(seq_dim, 0, self.original_seq_len)
        raise NotImplementedError("no shard layout to trim to")
