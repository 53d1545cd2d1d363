"""dsv4: fine-tuning DeepSeek-V4-family MoE models on long sequences with context parallelism."""

__version__ = "0.1.0"
