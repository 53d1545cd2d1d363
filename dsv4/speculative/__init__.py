"""Speculative decoding support: packed frozen target forward and feature capture for DSpark drafts."""

from dsv4.speculative.capture import FeatureCapture, split_documents, validate_layer_ids
from dsv4.speculative.dspark import (
    DSparkFeatures,
    capture_dspark_features,
    dspark_packed_forward,
    model_needs_uniform_tokens,
)

__all__ = [
    "DSparkFeatures",
    "FeatureCapture",
    "capture_dspark_features",
    "dspark_packed_forward",
    "model_needs_uniform_tokens",
    "split_documents",
    "validate_layer_ids",
]
