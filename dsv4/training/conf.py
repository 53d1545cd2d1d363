"""OmegaConf resolvers used by ``conf/`` (registered by the recipes before Hydra composes the config)."""

from __future__ import annotations

from omegaconf import OmegaConf


def cpu_world_size(dp: int, cp: int) -> int:
    """Processes to start on one machine: ``dp * cp``, or ``cp`` when ``dp`` is derived (-1)."""
    return cp if dp in (-1, 0, None) else dp * cp


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("dsv4.world", cpu_world_size, replace=True)
