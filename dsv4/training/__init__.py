"""Training-side pieces: the token-weighted loss reduction (more to come: strategy, module, step)."""
