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
    ({"only": True, "suggest": 0}, PlanOptions(only=True, suggest=0)),
])
def test_plan_options(value, expected):
    assert plan_options(value) == expected


@pytest.mark.parametrize("suggest", [-1, True, 2.5])
def test_plan_suggest_must_be_a_count(suggest):
    with pytest.raises(ValueError, match=r"`plan.suggest` must be an integer >= 0 \(0: no suggestions\), got"):
        plan_options({"suggest": suggest})


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
    """... and what would fit: here nothing (1 MiB), which the message and memory_plan.json say."""
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"DOES NOT FIT \(biggest term: activations\).*plan.enforce=false") as info:
        run_finetune(_compose(["plan.device_memory_gib=0.001", "plan.reserve_gib=0", "dry_run=true"]), run)
    assert "what would fit 1.0 MiB per rank: no candidate of at most 3 changes was planned to fit" in str(info.value)
    plan = json.loads((run / PLAN_FILE).read_text())
    assert plan["fits"] is False and plan["suggestions"]["fits_with"] == []
    assert sum(plan["suggestions"]["outcomes"].values()) > 0 and plan["suggestions"]["new_traces"] == 0
    assert not (run / "checkpoints").exists()


def test_enforce_false_and_plan_false_launch_anyway(tmp_path):
    assert run_finetune(_compose(["plan.device_memory_gib=0.001", "plan.enforce=false", "dry_run=true"]),
                        tmp_path / "a") is None
    assert (tmp_path / "a" / PLAN_FILE).exists()
    assert run_finetune(_compose(["plan=false", "dry_run=true"]), tmp_path / "b") is None
    assert not (tmp_path / "b" / PLAN_FILE).exists()


def test_what_would_fit_v41_through_the_recipe_checks():
    """V4.1 tiny on 2 ranks (dp 2): with the device memory between the plan and the plan with bf16 moments, the
    cheapest candidate is `optim.state_dtype=bfloat16` (one planned candidate, no new trace), and the plan of the
    config Hydra composes with that override (the oracle; on the base trace, which an optimizer change does not
    alter: tests/unit/plan/test_suggest.py) has the same total and fits. A cp candidate gets exactly what the
    recipe's own validation says of that config: refused with its message, or a setup with that cp."""
    from dataclasses import replace

    from dsv4.plan.plan import memory_plan
    from dsv4.plan.suggest import Change, Refused
    from dsv4.training.planning import candidate_setup, plan_setup, suggest_fits
    from dsv4.training.spec import build_run_spec

    base_overrides = ["model=v41_tiny", "dp=2", "plan.only=true", "plan.reserve_gib=0"]  # a device of under 1 GiB
    cfg = _compose(base_overrides)
    spec = build_run_spec(cfg)
    base = memory_plan(plan_setup(spec, 2**40))
    gib = 2**30
    bf16_saving = base.states.optimizer // 2  # fp32 -> bf16 moments: half the optimizer term
    device = base.total - bf16_saving // 2
    plan = memory_plan(replace(base.setup, device_memory_bytes=device), base.activations)
    result = suggest_fits(cfg, spec, plan, count=1)
    assert [s.overrides for s in result.suggestions] == [["optim.state_dtype=bfloat16"]]
    assert result.traced == 0 and result.outcomes == {"fits": 1}
    oracle_spec = build_run_spec(_compose([*base_overrides, *result.suggestions[0].overrides]))
    oracle = memory_plan(plan_setup(oracle_spec, device), base.activations)
    assert oracle.fits and oracle.total == result.suggestions[0].total < base.total
    assert oracle.setup.optimizer.state_dtype == "bfloat16" and device / gib < 1

    cp2 = (Change("cp", (("cp", 2), ("dp", 1)), 3),)
    try:
        build_run_spec(_compose([*base_overrides, "cp=2", "dp=1"]))
        refused = None
    except ValueError as err:
        refused = str(err)
    if refused is None:
        assert candidate_setup(cfg, cp2, device).cp == 2
    else:
        with pytest.raises(Refused) as info:
            candidate_setup(cfg, cp2, device)
        assert str(info.value) == refused


def test_trainer_engram_tables_reaches_the_plan_and_what_would_fit_proposes_it():
    """``trainer.engram_tables=host`` sets the plan's ``engram_on_host``; ``plan_changes`` proposes it (cost
    ``COSTS['engram host']``) for a V4.1 model whose Engram tables are frozen and on the device, and its candidate,
    built by the recipe's own checks, plans the device total less exactly the tables' bytes; it is not proposed when
    the tables are held on the host already, train, or do not exist (V4)."""
    from dsv4.plan.plan import memory_plan
    from dsv4.training.planning import COSTS, candidate_setup, plan_changes, plan_setup
    from dsv4.training.spec import build_run_spec

    spec = build_run_spec(_compose(["model=v41_tiny", "trainer.engram_tables=host", "plan.only=true"]))
    assert spec.engram_tables == "host" and plan_setup(spec, 2**30).engram_on_host
    overrides = ["model=v41_tiny", "dp=2", "plan.only=true", "plan.reserve_gib=0"]
    cfg = _compose(overrides)
    base = memory_plan(plan_setup(build_run_spec(cfg), 2**40))
    assert not base.setup.engram_on_host
    proposed = [c for c in plan_changes(cfg, base.setup, 2) if c.group == "engram tables"]
    assert [(c.overrides, c.cost) for c in proposed] == [(["trainer.engram_tables=host"], COSTS["engram host"])]
    setup = candidate_setup(cfg, tuple(proposed), 2**40)
    assert setup.engram_on_host and base.total - memory_plan(setup, base.activations).total == base.engram_table_bytes
    for others in (["trainer.engram_tables=host"], ["model.engram_trainable=true"], ["model=tiny"]):
        c = _compose([*overrides, *others])
        setup = plan_setup(build_run_spec(c), 2**40)
        assert not [ch for ch in plan_changes(c, setup, 2) if ch.group == "engram tables"], others


def test_plan_checkpoint_form_release_plans_the_released_engram_tables_in_fp8():
    """Fine-tuning V4.1 without a checkpoint builds fp32 Engram tables; ``plan.checkpoint_form=release`` plans a run
    from the release, whose frozen tables are kept in FP8 (264 bytes per row of 256: 3.88 times fewer than fp32);
    tables that train are fp32 whatever the form."""
    from dsv4.plan.plan import memory_plan
    from dsv4.training.planning import plan_setup
    from dsv4.training.spec import build_run_spec

    def setup(*overrides):
        return plan_setup(build_run_spec(_compose(["model=v41_tiny", "plan.only=true", *overrides])), 2**40)

    built, release = setup(), setup("plan.checkpoint_form=release")
    assert (built.engram_fp8, release.engram_fp8) == (False, True)
    assert not setup("plan.checkpoint_form=release", "model.engram_trainable=true").engram_fp8
    head = built.config.engram_head_dim
    fp32, fp8 = memory_plan(built).engram_table_bytes, memory_plan(release).engram_table_bytes
    assert fp32 * (head + head // 32) == fp8 * head * 4


def test_pp_is_planned_per_stage_and_its_limits_named(tmp_path):
    run = tmp_path / "run"
    overrides = ["pp=2", "trainer.devices=4", "global_batch_size=4", "pp_schedule=gpipe"]
    assert run_finetune(_compose(["plan=true", *overrides]), run) is None
    plan = json.loads((run / PLAN_FILE).read_text())
    assert plan["setup"]["pp"] == 2 and plan["setup"]["dp"] == 2 and plan["setup"]["gpus"] == 4
    assert plan["pipeline"]["schedule"] == "gpipe" and plan["pipeline"]["microbatches"] == 2  # 4 rows over dp 2
    assert [r["rank"] for r in plan["pipeline"]["ranks"]] == [0, 1]
    for bad, needle in ((["pp=2", "trainer.devices=2", "model.indexer_loss_coeff=0.1", "plan=true"],
                         r"`pp`=2 with `model.indexer_loss_coeff`=0.1: the indexer's KL loss is not carried"),
                        (["pp=2", "cp=2", "cp_balance=full", "trainer.devices=4", "plan=true", "seq_len=512"],
                         r"`pp`=2 with `cp_balance`=full"),
                        (["pp=2", "trainer.devices=2", "pp_virtual=2", "plan=true"],
                         r"`pp_virtual`=2 needs an interleaved `pp_schedule`"),
                        (["pp=2", "trainer.devices=2", "plan=true", "trainer.offload=optimizer"], r"host offload is not planned"),
                        (["pp=3", "trainer.devices=4", "plan=true"], r"`pp`=3 x `cp`=1 does not divide the world"),
                        (["pp=2", "trainer.devices=2", "plan=true"], r"`pp_schedule`=1f1b needs at least pp=2 "
                         r"microbatches per step, got 1"),
                        (["pp=2", "trainer.devices=4", "global_batch_size=10", "pp_virtual=2",
                          "pp_schedule=interleaved_1f1b", "plan=true"],
                         r"`pp_schedule`=interleaved_1f1b with pp=2, pp_virtual=2 and 5 microbatches")):
        with pytest.raises(ValueError, match=needle):
            run_finetune(_compose(bad), tmp_path / "refused")


def test_what_would_fit_considers_pipeline_stages():
    from dsv4.plan.plan import memory_plan
    from dsv4.plan.suggest import activation_key
    from dsv4.training.planning import candidate_setup, plan_changes, plan_setup
    from dsv4.training.spec import build_run_spec

    cfg = _compose(["trainer.devices=4", "plan.only=true", "global_batch_size=16"])
    base = memory_plan(plan_setup(build_run_spec(cfg), 2**40))
    pp = [c for c in plan_changes(cfg, base.setup, 4) if c.group == "pp"]
    assert [c.settings for c in pp] == [(("pp", 2), ("dp", 2))]
    setup = candidate_setup(cfg, tuple(pp), 2**40)
    assert (setup.pp, setup.dp, setup.gpus, setup.microbatches) == (2, 2, 4, 8)
    # the stages compose the same trace: the candidate reuses it, and plans as a fresh trace does
    assert activation_key(setup) == activation_key(base.setup)
    assert memory_plan(setup, base.traced).total == memory_plan(setup).total
