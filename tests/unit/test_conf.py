"""The config tree composes with the typed schema, and conf/ agrees with the code it describes."""

from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dsv4.config import DSV4Config
from dsv4.training.conf import register_resolvers
from dsv4.training.schema import register_schema
from dsv4.training.step import ParallelConfig, check_partition_mode, get_batch

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize("name", ["tiny", "flash", "pro", "v41_tiny"])
def test_model_yaml_equals_preset(name):
    assert yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text()) == DSV4Config.preset(name).to_dict()


def _compose(overrides):
    register_schema()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="finetune", overrides=overrides)


def test_default_config_composes_and_resolves():
    cfg = _compose(["cp=4"])
    assert cfg.cp == 4 and cfg.dp == -1 and cfg.dispatcher.name == "local" and cfg.data.kind == "stdlib"
    assert cfg.trainer.devices == 4  # dp derived: world = cp on one machine
    assert _compose(["cp=2", "dp=2"]).trainer.devices == 4
    model = OmegaConf.to_container(cfg.model)
    assert model.pop("checkpoint") is None  # the model group also names the weights to load
    DSV4Config.from_dict(model)  # the tiny model validates
    assert cfg.seq_len % (cfg.cp * DSV4Config.preset("tiny").cp_shard_multiple) == 0


def test_every_group_option_composes():
    for group in ("model", "data", "dispatcher", "trainer", "logger"):
        for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
            _compose([f"{group}={option}"])
    cfg = _compose(["experiment=flash_cp8"])
    assert cfg.cp == 8 and cfg.model.num_hidden_layers == 43 and cfg.dispatcher.name == "alltoall"


def test_schema_rejects_typos_and_types():
    with pytest.raises(Exception, match="cpp"):
        _compose(["cpp=4"])
    with pytest.raises(Exception, match="three"):
        _compose(["cp=three"])


def test_only_contiguous_partition_is_accepted():
    check_partition_mode("contiguous")
    with pytest.raises(ValueError, match="contiguous span of the row"):
        check_partition_mode("zigzag")
    batch = {"input_ids": torch.ones(1, 8, dtype=torch.long), "labels": torch.ones(1, 8, dtype=torch.long),
             "cp_partition_mode": "zigzag"}
    with pytest.raises(ValueError, match="cp_partition_mode='zigzag'"):
        get_batch(batch, ParallelConfig(cp_mesh=None, shard_batch=None))
