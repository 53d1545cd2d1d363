"""The recipe's memory plan: ``plan=true`` plans and stops, a normal start refuses what does not fit (naming the
biggest term) unless ``plan.enforce=false``, and the options are checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dsv4.training.planning import PLAN_FILE
from dsv4.training.spec import PlanOptions, plan_options
from dsv4.training.run import run_finetune
from dsv4.training.schema import register_schema

CONF = Path(__file__).resolve().parents[3] / "conf"
FAST = ["seq_len=256", "logger=none", "data.max_bytes=200000", "callbacks=none"]


def _compose(overrides):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="finetune", overrides=[*FAST, *overrides])


@pytest.mark.parametrize("value,expected", [
    (True, PlanOptions(enabled=True, only=True)),
    (False, PlanOptions(enabled=False, only=False)),
    ({"enforce": False, "device_memory_gib": 141}, PlanOptions(enforce=False, device_memory_gib=141)),
])
def test_plan_options(value, expected):
    assert plan_options(value) == expected


def test_unknown_plan_option_is_named():
    with pytest.raises(KeyError, match="`plan.devices` is not a plan option"):
        plan_options({"devices": 8})


def test_plan_true_writes_the_plan_and_trains_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert run_finetune(_compose(["plan=true", "cp=2", "ep=2"]), run) is None
    plan = json.loads((run / PLAN_FILE).read_text())
    assert set(plan["per_rank_bytes"]) == {"parameters", "gradients", "optimizer", "activations", "communication",
                                           "total"}
    assert plan["fits"] is True and plan["device_memory_bytes"] == 80 * 2**30  # plan-only on the CPU trainer
    assert plan["setup"]["world"] == 2 and plan["setup"]["ep"] == 2 and plan["setup"]["cp"] == 2
    assert "memory plan per rank" in capsys.readouterr().out
    assert not (run / "checkpoints").exists()


def test_trainer_offload_reaches_the_plan_not_the_trainer():
    from dsv4.training.planning import plan_setup
    from dsv4.training.spec import build_run_spec

    spec = build_run_spec(_compose(["trainer.offload=optimizer"]))
    assert spec.offload == "optimizer" and "offload" not in spec.trainer
    assert plan_setup(spec, 2**30).offload == "optimizer"
    assert build_run_spec(_compose([])).offload == "none"


def test_a_start_that_does_not_fit_is_refused_naming_the_biggest_term(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"DOES NOT FIT \(biggest term: activations\).*plan.enforce=false"):
        run_finetune(_compose(["plan.device_memory_gib=0.001", "dry_run=true"]), run)
    assert json.loads((run / PLAN_FILE).read_text())["fits"] is False
    assert not (run / "checkpoints").exists()


def test_enforce_false_and_plan_false_launch_anyway(tmp_path):
    assert run_finetune(_compose(["plan.device_memory_gib=0.001", "plan.enforce=false", "dry_run=true"]),
                        tmp_path / "a") is None
    assert (tmp_path / "a" / PLAN_FILE).exists()
    assert run_finetune(_compose(["plan=false", "dry_run=true"]), tmp_path / "b") is None
    assert not (tmp_path / "b" / PLAN_FILE).exists()
