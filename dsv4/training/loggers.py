"""Logger factories for ``conf/logger`` (``hydra.utils.instantiate(cfg.logger, save_dir=<run dir>)``).

A resumed run continues its logs: the factories take ``resume_step`` (the optimizer step the run resumes from;
None for a fresh start). :func:`csv_logger` keeps the rows of the steps before it in ``metrics.csv`` and appends;
:func:`wandb_logger` continues the same wandb run (its id is kept in ``<run dir>/wandb/run_id``).
"""

from __future__ import annotations

import csv
import netrc
import os
import secrets
import string
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment

RUN_ID_FILE = "run_id"

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


def _is_rank_zero() -> bool:
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def wandb_run_id(save_dir: str | os.PathLike, resume: bool) -> str:
    """The wandb run id of the run in ``save_dir``: the one in ``wandb/run_id`` when resuming and present, else a
    new one (written there by rank 0)."""
    path = Path(save_dir) / "wandb" / RUN_ID_FILE
    if resume and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # wandb's id alphabet
    if _is_rank_zero():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id + "\n")
    return run_id


def wandb_logger(save_dir: str, project: str = "dsv4", name: str | None = None, offline: bool | None = None,
                 resume_step: int | None = None):
    """A ``WandbLogger`` writing under ``save_dir``; ``offline=None`` means offline unless credentials for
    ``api.wandb.ai`` are configured (a run never prompts for a login or fails for lack of one). Resuming
    (``resume_step`` not None) continues the run's wandb run (the same id, ``resume="allow"``)."""
    from lightning.pytorch.loggers import WandbLogger

    if offline is None:
        offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_credentials_configured()
    if offline:
        os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbLogger(project=project, name=name or Path(save_dir).name, save_dir=str(save_dir),
                       offline=bool(offline), version=wandb_run_id(save_dir, resume_step is not None),
                       resume="allow")


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` that, resuming at ``resume_step``, keeps the rows of the earlier steps in ``metrics.csv`` and
    appends (Lightning's deletes the file); rows of ``resume_step`` and later (an abandoned trajectory, when resuming
    from an earlier checkpoint) are dropped."""

    def __init__(self, save_dir: str, name: str = "csv", version: str | int | None = "",
                 resume_step: int | None = None, **kwargs) -> None:
        super().__init__(save_dir, name=name, version=version, **kwargs)
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self):
        if self._experiment is not None:
            return self._experiment
        path = Path(self.log_dir) / "metrics.csv"
        keys, kept = [], []
        if self.resume_step is not None and path.is_file():
            with path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                keys = list(reader.fieldnames or [])
                kept = [row for row in reader if (row.get("step") or "").isdigit() and int(row["step"]) < self.resume_step]
        experiment = super().experiment  # starts metrics.csv afresh
        if kept:
            with path.open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=keys)
                writer.writeheader()
                writer.writerows(kept)
            experiment.metrics_keys = keys
        return experiment


def csv_logger(save_dir: str, name: str = "csv", version: str | int | None = "", resume_step: int | None = None):
    """A :class:`ResumableCSVLogger` writing ``<save_dir>/<name>/metrics.csv``."""
    return ResumableCSVLogger(save_dir, name=name, version=version, resume_step=resume_step)
