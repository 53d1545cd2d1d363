"""Logger factories for ``conf/logger`` (``hydra.utils.instantiate(cfg.logger, save_dir=<run dir>)``)."""

from __future__ import annotations

import netrc
import os
from pathlib import Path

WANDB_HOST = "api.wandb.ai"


def wandb_credentials_configured() -> bool:
    """True when wandb could log in without a prompt: ``WANDB_API_KEY``, or a ``~/.netrc`` entry for
    ``api.wandb.ai`` (what ``wandb login`` writes). A ``.netrc`` holding other hosts' credentials does not count."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return netrc.netrc(str(path)).authenticators(WANDB_HOST) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_logger(save_dir: str, project: str = "dsv4", name: str | None = None, offline: bool | None = None):
    """A ``WandbLogger`` writing under ``save_dir``; ``offline=None`` means offline unless credentials for
    ``api.wandb.ai`` are configured (a run never prompts for a login or fails for lack of one)."""
    from lightning.pytorch.loggers import WandbLogger

    if offline is None:
        offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_credentials_configured()
    if offline:
        os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbLogger(project=project, name=name or Path(save_dir).name, save_dir=str(save_dir),
                       offline=bool(offline))
