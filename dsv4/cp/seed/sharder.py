"""The DSV4 CP batch entry points: ``make_dsv4_contiguous_shard_cp_batch_and_ctx`` and ``ContextParallelSharder``.

Packed batches (``qkv_format == "thd"``, or ``seq_lens`` / ``cu_seqlens`` present) are repadded so every document
starts on a multiple of ``pad_multiple`` (see :mod:`dsv4.cp.seed.repad`), then cut contiguously: rank r owns
padded columns ``[r*L, (r+1)*L)``. ``seq_lens`` / ``seq_lens_padded`` stay global (every rank holds the whole row's
metadata). As in the seed, the CP process group travels to the forward as ``batch["_dsv4_cp_group"]``, so that
``model(**local_batch)`` works; dsv4's own training path does not use this module (it cuts a
:class:`dsv4.batch.TokenBatch`).

Typical use (the seed's DSV4 registration, :func:`dsv4_cp_sharder`)::

    shard = functools.partial(make_dsv4_contiguous_shard_cp_batch_and_ctx,
                              pad_multiple=dsv4_cp_local_seq_multiple(config), sync_packed_length=False)
    sharder = ContextParallelSharder(shard_batch=shard, device_mesh=mesh,
                                     local_token_global_indices=contiguous_local_indices)
    ctx, local_batch = sharder.shard(batch)
    logp = sharder.gather_token_tensor(local_logp, trim=True, fill=0.0)   # back to caller [B, S_in]
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any, Callable

import torch

from dsv4.cp.seed.contiguous import contiguous_local_indices, shard_batch_contiguous
from dsv4.cp.seed.groups import dsv4_cp_all_gather, dsv4_cp_all_gather_metadata, mesh_group, mesh_rank, mesh_size
from dsv4.cp.seed.layout import ShardLayout
from dsv4.cp.seed.seq_ids import dsv4_cp_local_seq_multiple
from dsv4.cp.seed.repad import _repad_dsv4_packed_shard
from dsv4.distributed import is_initialized


class PrePackedBatchError(KeyError, NotImplementedError):
    """A pre-flattened batch (``cu_seqlens`` without ``seq_lens``) reached the DSV4 CP path.

    A KeyError (the missing key) that is also the seed's NotImplementedError.
    """


def _is_packed(batch: dict) -> bool:
    return batch.get("qkv_format") == "thd" or "seq_lens" in batch or "cu_seqlens" in batch


def make_dsv4_contiguous_shard_cp_batch_and_ctx(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict,
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    pad_multiple: int | None = None,
    sync_packed_length: bool = False,
    sync_group=None,
) -> tuple[Callable, dict, ShardLayout | None]:
    """Shard one microbatch for DSV4 context parallelism; return ``(context factory, local batch, layout)``.

    CP size <= 1 keeps the native THD route: the batch is returned as is (``qkv_format="thd"`` when packed,
    ``labels`` taken from ``loss_mask`` when missing) with layout None. For CP > 1, packed rows are repadded to
    ``m = max(pad_multiple or 2, 2)`` per document and to ``cp_size * m`` per row; ``sync_packed_length`` MAX-reduces
    the row length over ``sync_group`` (WORLD when None) for dispatchers that need uniform token counts.
    The layout of a packed batch carries ``input_token_stream_positions`` (caller column -> padded column).
    """
    size = mesh_size(cp_mesh)
    packed = _is_packed(batch)
    if size <= 1:
        if packed:
            batch["qkv_format"] = "thd"
        if loss_mask is not None:
            if batch.get("labels") is None:
                batch["labels"] = loss_mask
            else:
                batch["loss_mask"] = loss_mask
        return nullcontext, batch, None

    multiple = max(int(pad_multiple or 2), 2)
    if "cu_seqlens" in batch and "seq_lens" not in batch:
        raise PrePackedBatchError(
            "`cu_seqlens` without `seq_lens` under CP: model-owned packed CP expects `seq_lens` "
            "(per-document lengths); pre-flattened `cu_seqlens` batches are not supported by the DSV4 CP path"
        )
    if packed:
        # the repad builds only this rank's columns of the repadded rows: the contiguous cut of the full repad
        # (whose width T is a multiple of size * multiple, so the cut adds no padding)
        _, loss_mask, input_positions, total = _repad_dsv4_packed_shard(
            batch,
            cp_size=size,
            cp_rank=mesh_rank(cp_mesh),
            pad_multiple=multiple,
            padding_token_id=padding_token_id,
            sync_packed_length=sync_packed_length,
            loss_mask=loss_mask,
            sync_group=sync_group,
        )
        batch.pop("attention_mask", None)  # the repad rebuilt padding_mask
        if loss_mask is not None:
            batch["loss_mask"] = loss_mask
        ctx, layout = nullcontext, ShardLayout(padded_seq_len=total, input_token_stream_positions=input_positions)
    else:
        ctx, batch, layout = shard_batch_contiguous(
            cp_mesh,
            tp_mesh,
            batch,
            loss_mask=loss_mask,
            padding_token_id=padding_token_id,
            pad_multiple=multiple,
        )
    batch["_dsv4_cp_group"] = mesh_group(cp_mesh)
    return ctx, batch, layout


def _cp_mesh_of(device_mesh: Any) -> Any:
    """The CP sub-mesh: ``device_mesh["cp"]`` for a named mesh; a group or 1-D duck-typed mesh is itself."""
    if device_mesh is None:
        return None
    names = getattr(device_mesh, "mesh_dim_names", None)
    if names is not None:
        return device_mesh["cp"] if "cp" in names else None
    return device_mesh


class ContextParallelSharder:
    """Shards batches for CP and maps per-token tensors between caller and local coordinates.

    Direct mode: ``ContextParallelSharder(shard_batch=fn, device_mesh=mesh, local_token_global_indices=...,
    loss_mask=..., padding_token_id=...)`` where ``fn(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id)``
    returns ``(ctx, batch, layout)``; bind extra options with ``functools.partial``. Resolution mode:
    ``ContextParallelSharder(model, device_mesh, batch)`` asks ``model.prepare_model_inputs_for_cp(batch)`` for a
    sharder (the model owns its CP layout) and falls back to the generic contiguous shard (CP > 1) or the identity.
    """

    def __init__(
        self,
        model: Any = None,
        device_mesh: Any = None,
        batch: dict | None = None,
        *,
        shard_batch: Callable | None = None,
        local_token_global_indices: Callable | None = None,
        shard_layout: ShardLayout | None = None,
        loss_mask: torch.Tensor | None = None,
        padding_token_id: int = 0,
        num_chunks: int = 1,
        invoke_pre_embed: bool = True,
        extra_seq_buffers: Any = None,
    ) -> None:
        if shard_batch is not None:
            clashing = [
                name
                for name, bad in (
                    ("model", model is not None),
                    ("batch", batch is not None),
                    ("num_chunks", num_chunks != 1),
                    ("invoke_pre_embed", invoke_pre_embed is False),
                    ("extra_seq_buffers", extra_seq_buffers is not None),
                )
                if bad
            ]
            if clashing:
                raise TypeError(f"`shard_batch` and {clashing} are mutually exclusive")
        else:
            if batch is None:
                raise TypeError("ContextParallelSharder needs `shard_batch=` (direct mode) or `batch` (resolution mode)")
            if local_token_global_indices is not None or shard_layout is not None:
                raise TypeError("`local_token_global_indices` / `shard_layout` require `shard_batch`")
            shard_batch, local_token_global_indices = self._resolve(model, device_mesh, batch, num_chunks)
        self.device_mesh = device_mesh
        self.cp_mesh = _cp_mesh_of(device_mesh)
        self.tp_mesh = device_mesh["tp"] if "tp" in (getattr(device_mesh, "mesh_dim_names", None) or ()) else None
        self.shard_batch_fn = shard_batch
        self.local_token_global_indices = local_token_global_indices
        self.shard_layout = shard_layout
        self.loss_mask = loss_mask
        self.padding_token_id = padding_token_id

    @staticmethod
    def _resolve(model: Any, device_mesh: Any, batch: dict, num_chunks: int):
        cp_size = mesh_size(_cp_mesh_of(device_mesh))
        hook = getattr(model, "prepare_model_inputs_for_cp", None)
        if hook is not None and (cp_size > 1 or _is_packed(batch)):
            extra = dict(hook(batch, num_chunks=num_chunks))
            owned = extra.pop("cp_sharder", None)
            batch.update(extra)
            if owned is not None:
                return owned.shard_batch_fn, owned.local_token_global_indices
        if cp_size > 1:
            return shard_batch_contiguous, contiguous_local_indices
        return _identity_shard, None

    @property
    def cp_size(self) -> int:
        return mesh_size(self.cp_mesh)

    def shard(self, batch: dict) -> tuple[Callable, dict]:
        """Shard ``batch`` for this rank; remember the layout; return ``(context factory, local batch)``."""
        ctx, batch, layout = self.shard_batch_fn(
            self.cp_mesh, self.tp_mesh, batch, loss_mask=self.loss_mask, padding_token_id=self.padding_token_id
        )
        self.shard_layout = layout
        return ctx, batch

    def _indices(self, padded_len: int, device) -> torch.Tensor:
        layout = self.shard_layout
        if layout is not None and layout.local_token_global_indices is not None:
            idx = layout.local_token_global_indices
            if padded_len != idx.numel() * self.cp_size:
                raise ValueError(
                    f"the tensor does not match the batch last sharded: length {padded_len} != "
                    f"{idx.numel()} local tokens x CP size {self.cp_size}"
                )
            return idx.reshape(-1).long().to(device)
        if self.local_token_global_indices is None:
            raise NotImplementedError("data-dependent layout; unavailable before the first shard")
        return self.local_token_global_indices(self.cp_mesh, padded_len, device)

    def shard_token_tensor(self, t: torch.Tensor, seq_dim: int = 1, fill=None) -> torch.Tensor:
        """Caller (or padded) coordinates -> this rank's local shard along ``seq_dim`` (differentiable)."""
        layout = self.shard_layout
        seq_dim = seq_dim % t.dim()
        if layout is not None and layout.is_caller_shaped(t, seq_dim):
            t, seq_dim = layout.to_padded(t, fill), 1
        elif layout is not None and layout.input_row_shape is not None:
            n = len(layout.input_row_shape)
            if tuple(t.shape[:n]) == tuple(layout.input_row_shape):
                t, seq_dim = t.reshape(-1, *t.shape[n:]), 0
        length = t.shape[seq_dim]
        if layout is not None and layout.padded_seq_len is not None and length != layout.padded_seq_len:
            if fill is not None and length == layout.original_seq_len:
                pad_shape = list(t.shape)
                pad_shape[seq_dim] = layout.padded_seq_len - length
                t = torch.cat([t, t.new_full(pad_shape, fill)], dim=seq_dim)
                length = layout.padded_seq_len
            else:
                raise ValueError(
                    f"cannot shard a tensor of length {length} on dim {seq_dim}: the batch last sharded has "
                    f"padded_seq_len={layout.padded_seq_len}, original_seq_len={layout.original_seq_len}"
                )
        return t.index_select(seq_dim, self._indices(length, t.device)).contiguous()

    def gather_token_tensor(self, t: torch.Tensor, seq_dim: int = 1, trim: bool = False, fill=None) -> torch.Tensor:
        """Local shard -> full padded tensor (differentiable all-gather); with ``trim`` back to caller coordinates.

        The backward of the gather sums every rank's gradient into the owner, so a replicated full-sequence loss
        computed identically on every rank yields ``C`` times the single-loss gradient: normalise by ``C``.
        """
        seq_dim = seq_dim % t.dim()
        size = self.cp_size
        indices = self._indices(t.shape[seq_dim] * size, t.device)
        if size > 1:
            group = mesh_group(self.cp_mesh)
            if group is None or not is_initialized():
                raise RuntimeError(
                    f"gather_token_tensor: the CP mesh has {size} ranks but torch.distributed is not initialised"
                )
            full = dsv4_cp_all_gather(t, seq_dim, group)
            all_idx = dsv4_cp_all_gather_metadata(indices, 0, group)
            full = full.index_select(seq_dim, torch.argsort(all_idx))
        else:
            full = t
        if not trim:
            return full
        if self.shard_layout is None:
            raise NotImplementedError("no shard layout to trim to")
        return self.shard_layout.restore(full, seq_dim, fill)


def _identity_shard(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0):
    """Seed ``shard_batch_identity``: nothing moves; layout (S, S) when a primary exists."""
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    layout = None
    if isinstance(primary, torch.Tensor) and primary.dim() >= 2:
        layout = ShardLayout(original_seq_len=primary.shape[1], padded_seq_len=primary.shape[1])
    return nullcontext, batch, layout


def dsv4_cp_sharder(config: Any, device_mesh: Any, *, sync_packed_length: bool = False, **kwargs) -> ContextParallelSharder:
    """The DSV4 registration: a direct-mode sharder bound with the config's LCM multiple."""
    shard = functools.partial(
        make_dsv4_contiguous_shard_cp_batch_and_ctx,
        pad_multiple=dsv4_cp_local_seq_multiple(config),
        sync_packed_length=sync_packed_length,
    )
    return ContextParallelSharder(
        shard_batch=shard, device_mesh=device_mesh, local_token_global_indices=contiguous_local_indices, **kwargs
    )
