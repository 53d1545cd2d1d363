"""recipes/train_dspark.py's config: composed with the typed schema and resolved by build_dspark_run_spec; every
refusal happens before anything starts and names the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dsv4.training.schema import register_schema
from dsv4.training.spec import build_dspark_run_spec

CONF = Path(__file__).resolve().parents[3] / "conf"


def _spec(overrides, tmp_path):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train_dspark", overrides=["data.tokenizer=byte", "data.max_bytes=20000",
                                                            *overrides])
    return build_dspark_run_spec(cfg)


def test_defaults_resolve(tmp_path):
    spec = _spec([], tmp_path)
    d = spec.dspark
    assert (d.mode, d.init, d.source, d.num_anchors, d.gamma) == ("online", "random", None, 64, 4.0)
    assert spec.model.model_type == "deepseek_v41" and d.vocab_limit == 256  # the byte tokenizer in a 384-id model


@pytest.mark.parametrize(("overrides", "match"), [
    (["model=tiny"], "`model`: drafter training needs a DeepSeek-V4.1 target"),
    (["mode=sideways"], "`mode`='sideways'"),
    (["mode=offline"], "`features`=None: mode=offline needs a finished capture directory"),
    (["features=/tmp"], "`features`='/tmp' is read by mode=offline only"),
    (["drafter.init=release"], "`drafter.init`=release: None holds no mtp.\\* tensors"),
    (["drafter.num_anchors=0"], "`drafter.num_anchors` must be >= 1"),
    (["drafter.l1_alpha=-1"], "`drafter.l1_alpha` must be >= 0"),
    (["drafter.gamma=-2"], "`drafter.gamma` must be >= 0 or null"),
    (["cp=2", "cp_balance=full"], "`cp_balance`='full': drafter training under CP splits rows contiguously"),
    (["peft=lora"], "`peft`: drafter training trains the whole drafter"),
    (["pp=2"], "`pp`=2: drafter training does not run in pipeline stages"),
    (["plan.checkpoint_form=fp8"], "`plan.checkpoint_form` must be one of auto, release, got 'fp8'"),
    (["plan.checkpoint_form=release"], "`plan.checkpoint_form`=release .* needs plan.only=true"),
    (["plan.checkpoint_form=release", "plan.only=true", f"model.checkpoint={CONF}"],
     "`plan.checkpoint_form`=release with `model.checkpoint`=.*conf': the plan reads that checkpoint's stored form"),
])
def test_refusals_name_the_key(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _spec(overrides, tmp_path)


def test_export_beside_a_target_is_checked_at_start(tmp_path):
    from dsv4.checkpoint import export_hf_checkpoint
    from dsv4.config import DSV4Config
    from dsv4.model import build_causal_lm

    other = tmp_path / "other"
    export_hf_checkpoint(build_causal_lm(DSV4Config.preset("v41_tiny", engram_layer_ids=[], engram_num_embeddings=[],
                                                           dspark_markov_rank=8)), str(other))
    with pytest.raises(ValueError, match="`export.hf_dir`=.* another model: dspark_markov_rank=8 there, 16 here"):
        _spec([f"export.hf_dir={other}"], tmp_path)


def _composed(overrides):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train_dspark", overrides=["data.tokenizer=byte", "data.max_bytes=20000",
                                                              *overrides])


def test_plan_only_prints_the_drafter_plan_and_stops(tmp_path, capsys):
    """`plan=true` through the recipe's planning step (the TrainingRecipe's check_memory): the drafter plan's table
    printed, memory_plan.json written, the run stops; a start that plans and fits goes on."""
    import json

    from dsv4.training.dspark_run import TRAIN_DSPARK

    cfg = _composed(["plan=true", "drafter.num_anchors=16"])
    assert TRAIN_DSPARK.check_memory(build_dspark_run_spec(cfg), tmp_path, cfg) is True
    report = capsys.readouterr().out
    for line in ("drafter memory plan per rank (online)", "16 blocks of 5 per row", "phase target forward", "total"):
        assert line in report
    plan = json.loads((tmp_path / "memory_plan.json").read_text())
    assert plan["recipe"] == "train_dspark" and plan["setup"]["num_anchors"] == 16 and plan["fits"]
    start = _composed(["drafter.num_anchors=16"])
    assert TRAIN_DSPARK.check_memory(build_dspark_run_spec(start), tmp_path / "start", start) is False


def test_a_drafter_plan_that_does_not_fit_refuses_the_start_naming_its_biggest_term(tmp_path):
    from dsv4.training.dspark_run import TRAIN_DSPARK

    cfg = _composed(["plan.device_memory_gib=0.001", "plan.reserve_gib=0", "plan.suggest=0"])
    with pytest.raises(ValueError, match=r"drafter memory plan: .* DOES NOT FIT \(biggest term: \w+\)\. Not launching"):
        TRAIN_DSPARK.check_memory(build_dspark_run_spec(cfg), tmp_path, cfg)
    cfg = _composed(["plan.only=true", "plan.rank_by=step_time"])
    with pytest.raises(ValueError, match=r"`plan.rank_by`='step_time': the drafter plan has no step-time estimate"):
        TRAIN_DSPARK.check_memory(build_dspark_run_spec(cfg), tmp_path, cfg)
