"""CSA2: the attention layer of DeepSeek-V4.1, in four roles chosen by the config (``attention_role``).

Per layer with compress ratio ``r`` (0, 1 or 2):

* Q: ``q_lat = q_norm(wq_a x)``, ``q = wq_b q_lat -> [B, L, H, D]``, RoPE. No per-head query norm (V4 has one).
* K = V: ``kv = kv_norm(wkv x) -> [B, L, D]``, RoPE, FP8-rounded (``fake_quant``: blocks of 32, power-of-two
  scales over the whole rotated vector).
* RoPE: the main table for ``r == 0``; the compress table (``compress_rope_theta`` + YaRN) for ``r > 0``.
* Keys: the sliding window over ``kv`` (document-local, ``sliding_window`` rows ending at the query), plus for
  ``r > 0`` the compressed rows of the shared state (:mod:`dsv4.model.v41.shared_state`) the state's top-k names.
  The sink, the softmax and the window/compressed masks are V4's kernel (:mod:`dsv4.model.attention_backend`).
* Output: inverse RoPE, grouped ``wo_a`` (``o_groups`` blocks), ``wo_b``.

Roles (what a layer owns and what it does to the shared state):

* ``window`` (``r == 0``): neither compressor nor indexer; window keys only; the state passes through.
* ``full`` (``kv_source_layer_ids``): a compressor (:class:`~dsv4.model.v41.compressor.CSA2Compressor`) and an
  indexer with keys: builds a new state from its own input (compressed rows RoPE'd at each window's first
  position and FP4-rounded: blocks of 16, E4M3 scales; index keys; its selection).
* ``reindex`` (``index_source_layer_ids`` only): an indexer without keys: the state with its own selection.
* ``reuse``: neither: attends to the state's rows with the state's selection.

The per-forward positions, document ids, RoPE tables and window metadata come from V4's
:func:`~dsv4.model.attention_metadata.build_attention_metadata` (ratios 1 and 2), shared by every layer. Everything
here is document-local arithmetic on those tables: nothing of size ``[L, L]`` is built.

Context parallelism (``cp``, the :class:`~dsv4.model.context_parallel.ContextParallel` view; each local row is one
chunk of a whole row) only adds exchanges, planned once per forward in ``meta.routes``:

* ``halo``: every layer's window keys, as in V4: the previous chunk's last ``sliding_window - 1`` K=V rows (RoPE'd
  and FP8-rounded by their owner), only to the rows whose document continues across the chunk boundary;
* ``compressed_gather`` / ``index_key_gather``: a Full layer's compressed rows and index keys of the earlier chunks
  of the document each local row's first token continues (``meta.routes.preceding[ratio]``), received point to
  point from their owners once, by the Full layer; the shared state carries the gathered rows, so Reindex and Reuse
  layers read them without another exchange. The compressed rows' gradients return to their owner (the index keys
  have none: the indexer is frozen).

The CSA2 compressor needs no boundary exchange: its windows (ratio 2: pairs; ratio 1: single tokens) do not overlap,
and documents and chunks start on multiples of the shard multiple (lcm of the ratios), so no window straddles a
chunk boundary. Each exchange starts as soon as its input exists and is waited for where its result is first
needed: the halo overlaps the queries and the compressor, the index keys the compressed rows' rounding, the
compressed rows the indexer.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from dsv4.model.attention import AttentionSink, BlockDiagonalLinear, start_preceding
from dsv4.model.attention_backend import attend
from dsv4.model.attention_metadata import AttentionMetadata
from dsv4.model.context_parallel import ContextParallel
from dsv4.model.fake_quant import fake_quant_fp4, fake_quant_fp8
from dsv4.model.norm import RMSNorm
from dsv4.model.rope import apply_rope
from dsv4.model.v41.compressor import CSA2Compressor
from dsv4.model.v41.indexer import CSA2Indexer
from dsv4.model.v41.shared_state import SharedState


class CSA2Attention(nn.Module):
    """One V4.1 attention layer: ``forward(x [B, L, d], meta, state) -> (out [B, L, d], state)``."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.ratio = config.ratio_for_layer(layer_idx)
        self.role = config.attention_role(layer_idx)
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.n_groups = config.o_groups
        self.fake_quant = config.fake_quant
        d_m, eps = config.hidden_size, config.rms_norm_eps
        self.wq_a = nn.Linear(d_m, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(d_m, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.sink = AttentionSink(self.n_heads)
        group_in = self.n_heads * self.head_dim // self.n_groups
        self.wo_a = BlockDiagonalLinear(group_in, self.n_groups * config.o_lora_rank, self.n_groups)
        self.wo_b = nn.Linear(self.n_groups * config.o_lora_rank, d_m, bias=False)
        self.compressor = CSA2Compressor(d_m, self.head_dim, self.ratio, eps) if self.role == "full" else None
        self.indexer = CSA2Indexer(config, layer_idx) if self.role in ("full", "reindex") else None

    def forward(self, x: Tensor, meta: AttentionMetadata, state: SharedState | None,
                cp: ContextParallel | None = None) -> tuple[Tensor, SharedState | None]:
        """Attention of this rank's tokens; returns the output and the shared state for the next layer.

        Args:
            x: ``[B, L, d]`` (input-layernormed).
            meta: the forward's :class:`~dsv4.model.attention_metadata.AttentionMetadata`.
            state: the shared state of the layers before (None before the first Full layer).
            cp: None or the context-parallel view the metadata was built with (its exchanges: module docstring).
        """
        b, length, _ = x.shape
        rope = meta.rope_compress if self.ratio else meta.rope_main
        kv = self.project_kv(x, rope)
        halo = cp.start_halo_exchange(kv, meta.halo, dim=1, kind="halo", route=meta.routes.halo) if meta.halo else None
        q_lat, q = self.project_queries(x, rope)

        compressed = topk = local_windows = None
        if self.ratio:
            windows, key_windows = meta.windows[self.ratio], meta.key_windows[self.ratio]
            if self.role == "full":
                pending, index_keys = self._compress(x, windows, meta, cp)
                candidates = None
            elif state is None:
                raise ValueError(f"V4.1 layer {self.layer_idx} ({self.role}) runs before any KV source layer")
            else:
                state.check_consumer(self.layer_idx, self.ratio)
                index_keys, candidates = state.index_keys, state.candidates
            if self.indexer is not None:  # overlaps the compressed rows' exchange
                selected, candidates = self.indexer(
                    x, q_lat, meta.rope_compress, meta.seq_ids, meta.position_ids, index_keys, key_windows,
                    self.ratio, candidates)
                if self.role == "full":
                    state = SharedState(ratio=self.ratio, owner=self.layer_idx, compressed=pending.wait(),
                                        index_keys=index_keys, topk=selected, candidates=candidates)
                else:
                    state = replace(state, topk=selected, candidates=candidates)
            compressed, topk = state.compressed, state.topk
            local_windows = windows.seq_ids.shape[1]
        if halo is not None:
            kv = torch.cat((halo.wait(), kv), dim=1)  # [B, halo + L, D]

        out = attend(self.config, q, kv, self.sink(), meta, ratio=self.ratio, compressed=compressed, topk=topk,
                     local_windows=local_windows)
        return self.project_output(out, rope), state

    def project_kv(self, x: Tensor, rope) -> Tensor:
        """The K = V rows of ``x [B, L, d]``: ``kv_norm(wkv x)``, RoPE'd by ``rope``, FP8-rounded when
        ``fake_quant`` -> ``[B, L, D]``."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), rope)
        return fake_quant_fp8(kv, 32) if self.fake_quant else kv

    def project_queries(self, x: Tensor, rope) -> tuple[Tensor, Tensor]:
        """``(q_lat [B, L, q_lora_rank], q [B, L, H, D])`` of ``x [B, L, d]`` (``q`` RoPE'd by ``rope``)."""
        q_lat = self.q_norm(self.wq_a(x))
        return q_lat, apply_rope(self.wq_b(q_lat).view(*x.shape[:2], self.n_heads, self.head_dim), rope)

    def project_output(self, out: Tensor, rope) -> Tensor:
        """The attention output ``[B, L, H, D]`` back to ``[B, L, d]``: inverse RoPE, grouped ``wo_a``, ``wo_b``."""
        b, length = out.shape[:2]
        out = apply_rope(out, rope, inverse=True)
        return self.wo_b(self.wo_a(out.reshape(b, length, self.n_groups, -1)).reshape(b, length, -1))

    def _compress(self, x: Tensor, windows, meta: AttentionMetadata, cp: ContextParallel | None):
        """A Full layer's compressed rows (started: ``.wait()`` gives them) and index keys over every key window of
        ``meta.key_windows`` (under CP: the earlier chunks' rows of the continued document, gathered here once,
        then this chunk's own)."""
        latent = self.compressor(x, windows)
        keys = start_preceding(self.indexer.keys(latent, windows), meta, self.ratio, cp, "index_key_gather")
        rows = apply_rope(latent, windows.rope)
        if self.fake_quant:
            rows = fake_quant_fp4(rows, 16, "e4m3")
        return start_preceding(rows, meta, self.ratio, cp, "compressed_gather"), keys.wait()
