"""Training: the Lightning strategy and module, one step's model call, the token-weighted loss, step statistics,
the config schema and the run function behind ``recipes/finetune.py``."""
