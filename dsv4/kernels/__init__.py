"""Fused GPU kernels (Triton) for the DeepSeek-V4 model; each has a pure-torch reference in dsv4.model."""
