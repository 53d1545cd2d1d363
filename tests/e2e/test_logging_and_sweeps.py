"""End-to-end: the default wandb logger stays offline and records the metrics; an Optuna sweep gets every job's
objective."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.helpers import run_recipe

pytestmark = pytest.mark.e2e

QUICK = ["seq_len=256", "data.max_bytes=100000", "scheduler.warmup_steps=1", "trainer.max_steps=2",
         "checkpoint.every_n_steps=0"]


def _offline_summary(run_dir):
    """The logged metrics of the offline wandb run in ``run_dir`` (read back with wandb's own reader)."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json",
                           str(run_dir / "wandb")], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_default_logger_is_offline_wandb_and_a_foreign_netrc_does_not_switch_it_online(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine github.com\n  login someone\n  password not-a-wandb-key\n")
    (home / ".netrc").chmod(0o600)
    run = tmp_path / "run"
    proc = run_recipe([*QUICK, "data.val_fraction=0.2", "trainer.limit_val_batches=1"], run,
                      env={"HOME": str(home), "WANDB_MODE": None, "WANDB_API_KEY": None, "NETRC": None})
    # stdout is not a terminal here: the plain text progress line of the last step is in the log
    assert "step 2/2 | loss " in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, sorted(p.name for p in (run / "wandb").iterdir())
    summary = _offline_summary(run)
    assert summary["state"] == "finished" and summary["name"] == "run"
    for key in ("train/loss", "val/loss", "train/grad_norm", "perf/tokens_per_s", "data/padding_fraction", "mem/rss_gib"):
        assert key in summary["summary"], sorted(summary["summary"])
    assert summary["config"]["model"]["preset"] == "tiny"  # the resolved config is the run's config


def test_optuna_sweep_reports_a_best_value(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_recipe(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.direction=minimize",
                       "hydra.sweeper.sampler.seed=0", "optim.lr=interval(0.001,0.01)", "logger=csv", *QUICK,
                       f"hydra.sweep.dir={sweep}"])
    objectives = [json.loads((sweep / job / "objective.json").read_text())["value"] for job in ("0", "1")]
    assert all(isinstance(v, float) and v > 0 for v in objectives)
    best = (sweep / "optimization_results.yaml").read_text()
    assert "best_value" in best and f"{min(objectives):.6f}"[:6] in best, (best, objectives)
    assert "Return value must be float-castable" not in proc.stdout + proc.stderr
