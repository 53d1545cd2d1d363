"""dsv4: fine-tuning DeepSeek-V4-family MoE models on long sequences with context parallelism."""

__version__ = "0.1.0"

# Every model family's config class registers itself in dsv4.config.CONFIG_CLASSES when its module is imported.
import dsv4.config_v41  # noqa: E402,F401
