"""The seed DSV4 context-parallel API (NeMo Automodel ``deepseek_v4/cp.py`` names and semantics), vectorised.

Deliberate differences from the seed: malformed batches raise ``ValueError`` / ``KeyError`` naming the key and the
numbers before the batch is touched, and no real (label != -100) token is ever dropped silently.
"""

from dsv4.cp.collectives import (
    all_reduce_max,
    dsv4_cp_all_gather,
    dsv4_cp_all_gather_metadata,
    gather_preceding,
    halo_exchange,
)
from dsv4.cp.context import CPContext
from dsv4.cp.contiguous import (
    contiguous_local_indices,
    convert_attention_mask_to_padding_mask,
    shard_batch_contiguous,
)
from dsv4.cp.groups import SimulatedMesh, dsv4_cp_enabled, dsv4_cp_rank, dsv4_cp_size
from dsv4.cp.layout import ShardLayout
from dsv4.cp.masks import build_dsv4_cp_causal_padding_mask, build_dsv4_cp_packed_causal_padding_mask
from dsv4.cp.multiple import _lcm, _pad_length, dsv4_cp_local_seq_multiple
from dsv4.cp.repad import _repad_dsv4_packed_batch
from dsv4.cp.seq_ids import _SEQ_LENS_PADDING_VALUE, _pad_1d, _valid_packed_lengths, build_packed_seq_ids
from dsv4.cp.sharder import (
    ContextParallelSharder,
    PrePackedBatchError,
    dsv4_cp_sharder,
    make_dsv4_contiguous_shard_cp_batch_and_ctx,
)
from dsv4.cp.traffic import TrafficCounter

__all__ = [
    "CPContext",
    "ContextParallelSharder",
    "PrePackedBatchError",
    "ShardLayout",
    "SimulatedMesh",
    "TrafficCounter",
    "_SEQ_LENS_PADDING_VALUE",
    "_lcm",
    "_pad_1d",
    "_pad_length",
    "_repad_dsv4_packed_batch",
    "_valid_packed_lengths",
    "all_reduce_max",
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
    "gather_preceding",
    "halo_exchange",
    "make_dsv4_contiguous_shard_cp_batch_and_ctx",
    "shard_batch_contiguous",
]
