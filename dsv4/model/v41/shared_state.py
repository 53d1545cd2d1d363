"""The CSA2 state one V4.1 forward shares across its compressed layers (an immutable value, rebuilt, never edited).

A Full layer (a ``kv_source_layer_ids`` entry) builds a new :class:`SharedState` from its own attention input: the
compressed K=V rows of its ratio, the indexer keys, and the top-k selection of its queries (and, on the
``candidate_source_layer_id`` layer, the candidate mask of the two-level top-k). A Reindex layer (an index source
only) returns a copy with a new selection (:func:`dataclasses.replace`); a Reuse layer reads it as it is. Later
layers consume tensors that belong to the autograd graph of the owner, so the consumers' gradients reach the
owner's compressor through ordinary autograd; nothing is written in place, so a recomputed block (activation
checkpointing) sees exactly what its first run saw.

Under context parallelism the Full layer gathers the earlier chunks' compressed rows and index keys of the document
each local row continues (once, :mod:`dsv4.model.v41.attention`) and the state holds them with this chunk's own, so
its consumers read them without another exchange; their gradients reach the owning rank through the exchange.

Shapes (``B`` rows, ``L`` local queries, ``P`` compressed key rows of ``key_windows`` of the ratio: under CP the
received earlier rows, left-padded, then the chunk's own):

* ``compressed [B, P, D]``: normalised, RoPE'd (and, with ``fake_quant``, FP4-rounded) compressed K=V rows;
* ``index_keys [B, P, D_I]``: the indexer keys (RoPE'd, FP4-rounded), no gradient (the indexer is frozen);
* ``topk [B, L, k]`` int64: the compressed rows each query attends to, -1 = none;
* ``candidates [B, L, P]`` bool or None: the rows a Reindex layer after the candidate source may choose from.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class SharedState:
    """What Full layers publish and Reindex / Reuse layers read (see the module docstring)."""

    ratio: int
    owner: int  # the Full layer that built the compressed rows
    compressed: Tensor
    index_keys: Tensor
    topk: Tensor
    candidates: Tensor | None = None

    def check_consumer(self, layer_idx: int, ratio: int) -> None:
        """ValueError unless a layer of ``ratio`` may read this state (its Full layer has the same ratio)."""
        if self.ratio != ratio:
            raise ValueError(f"V4.1 layer {layer_idx} (ratio {ratio}) reads the shared state of layer {self.owner} "
                             f"(ratio {self.ratio}); a compressed layer needs a preceding KV source of its ratio")
