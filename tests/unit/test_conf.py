"""The config tree composes with the typed schemas, drives construction, and agrees with the code it describes."""

from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from dsv4.config import PRESETS, DSV4Config
from dsv4.training.spec import build_callbacks, build_logger, build_optimization
from dsv4.training.schema import model_config, register_schema

CONF = Path(__file__).resolve().parents[2] / "conf"


def _compose(overrides, name="finetune"):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_yaml_names_its_preset_only(name):
    """Presets are defined once (dsv4.config.PRESETS); a model YAML selects one and may only add training choices
    (the real-scale presets recompute every block)."""
    values = yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text())
    training = {k: v for k, v in values.items() if k not in ("preset", "checkpoint", "init_missing_mtp")}
    assert set(training) <= {"activation_checkpointing"}
    assert training == ({"activation_checkpointing": "block"} if name in ("flash", "pro", "v41_flash") else {})
    assert model_config(_compose([f"model={name}"]).model) == DSV4Config.preset(name, **training)


def test_default_config_composes_and_resolves():
    cfg = _compose(["cp=4"])
    assert cfg.cp == 4 and cfg.dp == -1 and cfg.dispatcher.name == "auto" and cfg.data.kind == "stdlib"
    assert cfg.trainer.devices == 4  # dp derived: world = cp on one machine
    assert _compose(["cp=2", "dp=2"]).trainer.devices == 4
    assert cfg.model.checkpoint is None  # the model group also names the weights to load
    config = model_config(cfg.model)
    assert config == DSV4Config.preset("tiny") and cfg.seq_len % (cfg.cp * config.shard_multiple) == 0


def test_model_fields_override_the_preset_with_types_checked():
    cfg = _compose(["model=flash", "model.sliding_window=64", "model.compress_ratios=[0,4]",
                    "model.num_hidden_layers=2", "model.num_hash_layers=1"])
    config = model_config(cfg.model)
    assert (config.sliding_window, config.compress_ratios, config.num_hidden_layers) == (64, [0, 4], 2)
    assert config.hidden_size == DSV4Config.preset("flash").hidden_size
    with pytest.raises(Exception, match="sliding_window"):
        _compose(["model.sliding_window=wide"])
    with pytest.raises(ValueError, match=r"model: DSV4Config.sliding_window: must be an integer >= 1, got 0"):
        model_config(_compose(["model.sliding_window=0"]).model)
    with pytest.raises(ValueError, match=r"`model.preset`='huge' must be one of"):
        model_config(_compose(["model.preset=huge"]).model)


def test_every_group_option_composes_and_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for group in ("model", "data", "dispatcher", "trainer", "logger", "optim", "scheduler", "callbacks"):
        for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
            cfg = _compose([f"{group}={option}"])
            optimizer, scheduler = build_optimization(cfg)
            assert isinstance(optimizer([torch.nn.Parameter(torch.zeros(2))]), torch.optim.Optimizer)
            build_callbacks(cfg)
            factory = build_logger(cfg)
            assert factory is None or factory(tmp_path / option).save_dir == str(tmp_path / option)
    from dsv4.training.schema import lora_config

    assert lora_config(_compose(["peft=none"]).peft) is None
    lora = lora_config(_compose(["peft=lora", "peft.rank=4", "peft.base_dtype=fp8"]).peft)
    assert (lora.rank, lora.alpha, lora.base_dtype) == (4, 16.0, "fp8") and "routed_experts" in lora.targets
    cfg = _compose(["experiment=flash_cp8"])
    assert cfg.cp == 8 and model_config(cfg.model).num_hidden_layers == 43 and cfg.dispatcher.name == "alltoall"
    cfg = _compose(["experiment=flash_128k_80g"])
    assert (cfg.cp, cfg.dp, cfg.ep, cfg.optim.state_dtype) == (16, 4, 8, "bfloat16")
    assert model_config(cfg.model).moe_chunk_tokens == 6144
    cfg = _compose(["experiment=v41_flash_128k_80g"])
    assert (cfg.cp, cfg.dp, cfg.ep, cfg.optim.state_dtype, cfg.trainer.offload) == (16, 4, 8, "bfloat16", "optimizer")
    assert model_config(cfg.model).model_type == "deepseek_v41" and cfg.dispatcher.name == "alltoall"


def test_groups_select_what_is_built():
    cfg = _compose(["optim.lr=0.5", "scheduler=constant", "callbacks=none", "logger=none"])
    optimizer, scheduler = build_optimization(cfg)
    assert optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults["lr"] == 0.5 and scheduler is None
    assert build_callbacks(cfg) == [] and build_logger(cfg) is None
    names = [type(c).__name__ for c in build_callbacks(_compose([]))]
    assert names == ["ThroughputCallback", "PaddingCallback", "CPTrafficCallback", "MemoryCallback",
                     "TextProgressCallback"]
    assert "MemoryCallback" not in [type(c).__name__ for c in build_callbacks(_compose(["~callbacks.memory"]))]
    sched = instantiate(_compose(["trainer.max_steps=40"]).scheduler)
    assert sched.keywords["total_steps"] == 40  # the schedule follows trainer.max_steps


def test_bad_group_values_name_the_key():
    with pytest.raises(ValueError, match=r"`optim` cannot be instantiated: TypeError: .*lrr"):
        build_optimization(_compose(["+optim.lrr=1"]))
    with pytest.raises(ValueError, match=r"`callbacks.throughput` cannot be instantiated: .*window must be >= 1"):
        build_callbacks(_compose(["callbacks.throughput.window=0"]))


def test_schema_rejects_typos_and_types():
    with pytest.raises(Exception, match="cpp"):
        _compose(["cpp=4"])
    with pytest.raises(Exception, match="three"):
        _compose(["cp=three"])
    with pytest.raises(Exception, match="bogus"):
        _compose(["model.bogus=1"])


def test_capture_config_is_typed_and_names_weights_like_finetune():
    cfg = _compose(["model=v4_ratio2_tiny", "model.checkpoint=/ckpt"], name="capture_dspark")
    assert cfg.model.checkpoint == "/ckpt" and model_config(cfg.model) == DSV4Config.preset("v4_ratio2_tiny")
    with pytest.raises(Exception, match="weights"):
        _compose(["weights=/ckpt"], name="capture_dspark")
    with pytest.raises(Exception, match="layer_ids"):
        _compose(["layer_ids=three"], name="capture_dspark")


def test_eval_dspark_config_is_typed():
    cfg = _compose(["drafter.checkpoint=/ckpt", "temperature=0.5"], name="eval_dspark")
    assert cfg.drafter.checkpoint == "/ckpt" and cfg.temperature == 0.5 and cfg.logger.name == "csv"
    assert model_config(cfg.model) == DSV4Config.preset("v41_tiny")
    with pytest.raises(Exception, match="drafter_checkpoint"):
        _compose(["drafter_checkpoint=/ckpt"], name="eval_dspark")
    with pytest.raises(Exception, match="max_new_tokens"):
        _compose(["max_new_tokens=many"], name="eval_dspark")
