"""The seed CP batch API (NeMo Automodel's ``deepseek_v4/cp.py`` names, signatures and semantics), vectorised.

A thin layer for code written against the seed: it turns a packed batch *dict* into per-rank batch dicts that
``model(**batch)`` accepts. It sits on the same code as dsv4's own path (the aligned layout of
:mod:`dsv4.packing`, the collectives of :mod:`dsv4.parallel.cp.collectives`, :func:`dsv4.config.shard_multiple`) and is
re-exported by :mod:`dsv4.cp`. Deliberate differences from the seed: malformed batches raise ``ValueError`` /
``KeyError`` naming the key and the numbers before the batch is touched, and no real (label != -100) token is ever
dropped silently.
"""

from dsv4.cp.seed.contiguous import (
    contiguous_local_indices,
    convert_attention_mask_to_padding_mask,
    shard_batch_contiguous,
)
from dsv4.cp.seed.groups import (
    SimulatedMesh,
    dsv4_cp_all_gather,
    dsv4_cp_all_gather_metadata,
    dsv4_cp_enabled,
    dsv4_cp_rank,
    dsv4_cp_size,
)
from dsv4.cp.seed import model_inputs as _model_inputs  # noqa: F401 - model(**batch) accepts _dsv4_cp_group
from dsv4.cp.seed.layout import ShardLayout
from dsv4.cp.seed.masks import build_dsv4_cp_causal_padding_mask, build_dsv4_cp_packed_causal_padding_mask
from dsv4.cp.seed.repad import _repad_dsv4_packed_batch
from dsv4.cp.seed.seq_ids import (
    _SEQ_LENS_PADDING_VALUE,
    _lcm,
    _pad_1d,
    _pad_length,
    _valid_packed_lengths,
    build_packed_seq_ids,
    dsv4_cp_local_seq_multiple,
)
from dsv4.cp.seed.sharder import (
    ContextParallelSharder,
    PrePackedBatchError,
    dsv4_cp_sharder,
    make_dsv4_contiguous_shard_cp_batch_and_ctx,
)

__all__ = [
    "ContextParallelSharder",
    "PrePackedBatchError",
    "ShardLayout",
    "SimulatedMesh",
    "_SEQ_LENS_PADDING_VALUE",
    "_lcm",
    "_pad_1d",
    "_pad_length",
    "_repad_dsv4_packed_batch",
    "_valid_packed_lengths",
    "build_dsv4_cp_causal_padding_mask",
    "build_dsv4_cp_packed_causal_padding_mask",
    "build_packed_seq_ids",
    "contiguous_local_indices",
    "convert_attention_mask_to_padding_mask",
    "dsv4_cp_all_gather",
    "dsv4_cp_all_gather_metadata",
    "dsv4_cp_enabled",
    "dsv4_cp_local_seq_multiple",
    "dsv4_cp_rank",
    "dsv4_cp_sharder",
    "dsv4_cp_size",
    "make_dsv4_contiguous_shard_cp_batch_and_ctx",
    "shard_batch_contiguous",
]
