"""Speculative decoding with DSpark drafters: the packed frozen target forward and its feature capture, the V4.1
drafter's checkpoints and loss, and speculative decoding that measures real acceptance."""

from dsv4.model.v41.drafter import DSparkDrafter, DSparkOutput
from dsv4.speculative.capture import FeatureCapture, split_documents, validate_layer_ids
from dsv4.speculative.decoding import (
    AcceptanceStats,
    DSparkProposer,
    Proposal,
    TargetRunner,
    greedy_generate,
    speculative_generate,
)
from dsv4.speculative.drafter_checkpoint import export_dspark_drafter, load_dspark_drafter
from dsv4.speculative.dspark import (
    DSparkFeatures,
    capture_dspark_features,
    dspark_packed_forward,
    model_needs_uniform_tokens,
)
from dsv4.speculative.dspark_loss import dspark_loss
from dsv4.speculative.verify import verify_block

__all__ = [
    "AcceptanceStats",
    "DSparkDrafter",
    "DSparkFeatures",
    "DSparkOutput",
    "DSparkProposer",
    "FeatureCapture",
    "Proposal",
    "TargetRunner",
    "capture_dspark_features",
    "dspark_loss",
    "dspark_packed_forward",
    "export_dspark_drafter",
    "greedy_generate",
    "load_dspark_drafter",
    "model_needs_uniform_tokens",
    "speculative_generate",
    "split_documents",
    "validate_layer_ids",
    "verify_block",
]
