"""The run function in-process: start-up validation names the bad key before anything is written; a one-device
run trains, writes its outputs and objective, and resumes."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from dsv4.training.checkpointing import checkpoint_step
from dsv4.training.run import read_objective, run_finetune
from dsv4.training.spec import build_run_spec
from dsv4.training.schema import register_schema

CONF = Path(__file__).resolve().parents[3] / "conf"
FAST = ["seq_len=256", "logger=csv", "data.max_bytes=200000", "scheduler.warmup_steps=1", "callbacks=none"]


def _compose(overrides):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="finetune", overrides=overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cp=3", "trainer.devices=4"], "`cp`=3 does not divide the world size 4"),
        (["dp=3", "trainer.devices=4"], "`dp`=3 x `cp`=1 = 3 does not match the world size 4"),
        (["model.compress_ratios=[0,4]"], "compress_ratios"),
        (["seq_len=1000", "cp=2"], "`seq_len`=1000 must be a positive multiple of cp x shard multiple = 2 x 128 = 256"),
        (["model=v4_ratio2_tiny", "seq_len=6", "cp=4"], "`seq_len`=6 must be a positive multiple of cp x shard "
                                                        "multiple = 4 x 2 = 8"),
        (["ep=3", "cp=2"], "`ep`=3 must divide dp x cp = 2"),
        (["ep=2", "model.n_routed_experts=9", "cp=2"], "`ep`=2 must divide model.n_routed_experts=9"),
        (["dispatcher=deepep"], "DeepEP"),
        (["dispatcher.name=fast"], "`dispatcher`: unknown MoE dispatcher 'fast'; expected one of auto, local, "
                                   "alltoall, allgather, deepep"),
        (["ep=2", "cp=2", "dispatcher=local"], "`dispatcher`=local keeps every expert on every rank and cannot run"),
        (["plan.device_memory_gib=-1"], "`plan.device_memory_gib` must be a positive number of GiB, got -1"),
        (["plan.only=maybe"], "`plan.only` must be true or false, got 'maybe'"),
        (["cp=0"], "`cp` must be a positive integer"),
        (["cp_balance=half"], "cp_balance='half' is not one of ['none', 'full']"),
        (["seq_len=256", "cp=2", "cp_balance=full"], "`seq_len`=256 must be a multiple of 2 x cp x shard multiple = "
                                                     "512 under cp_balance=full"),
        (["micro_batch_size=0"], "`micro_batch_size` must be >= 1, got 0"),
        (["global_batch_size=3", "trainer.devices=2"], "`global_batch_size`=3 must be a positive multiple of "
                                                       "micro_batch_size x dp = 1 x 2 = 2"),
        (["data.overlong=cut"], "`data.overlong`='cut' must be one of split, truncate_left, drop, error"),
        (["global_batch_size=0"], "`global_batch_size` must be >= 1 or null, got 0"),
        (["+trainer.accumulate_grad_batches=2"], "`trainer.accumulate_grad_batches`=2 is derived: set "
                                                 "`global_batch_size`"),
        (["trainer.precision=bf16-true"], "`trainer.precision`='bf16-true' must be auto or one of"),
        (["trainer.offload=params"], "`trainer.offload`='params' must be one of none, optimizer"),
        (["trainer.startup_timeout_s=0"], "`trainer.startup_timeout_s`=0 must be a number of seconds > 0"),
        (["checkpoint.every_n_steps=-1"], "`checkpoint.every_n_steps` must be >= 0, got -1"),
        (["preemption.signals=[SIGTERM,SIGNOPE]"], "`preemption.signals`: 'SIGNOPE' is not a catchable signal name"),
        (["preemption.signals=[SIGKILL]"], "`preemption.signals`: 'SIGKILL' is not a catchable signal name"),
        (["preemption.exit_code=300"], "`preemption.exit_code`=300 must be an integer in 0..255"),
        (["model.checkpoint=/no/such/dir"], "`model.checkpoint`='/no/such/dir' is not a directory"),
        (["export.hf_dir=out", "export.dtype=fp7"], "`export.dtype`='fp7' must be one of"),
        (["model.indexer_loss_coeff=-1"], "DSV4Config.indexer_loss_coeff: must be >= 0, got -1.0"),
        (["indexer_warmup_steps=5"], "`indexer_warmup_steps`=5 must be >= 0, and > 0 only with model.indexer_loss_coeff > 0"),
        (["peft=lora", "peft.rank=0"], "`peft.rank` must be an integer >= 1, got 0"),
        (["peft=lora", "peft.targets=[attention,gate]"], "`peft.targets`=['attention', 'gate']: each must be one of"),
        (["peft=lora", "peft.base_dtype=int4"], "`peft.base_dtype`='int4' must be one of ['bf16', 'fp8']"),
        (["peft.name=qlora"], "`peft.name`='qlora' must be none or lora"),
        (["peft=lora", "peft.adapter=/no/such/dir"], "`peft.adapter`='/no/such/dir' is not a directory"),
        (["peft.adapter=/tmp"], "`peft.adapter`='/tmp' needs peft=lora"),
        (["export.adapter_dir=out"], "`export.adapter_dir` / `export.merge` need peft=lora"),
        (["peft=lora", "export.hf_dir=out"], "`export.hf_dir` with peft=lora writes the merged model: set export.merge"),
        (["peft=lora", "export.merge=true"], "`export.merge=true` needs `export.hf_dir`"),
        (["+optim.momentum=0.9"], "`optim` cannot be instantiated: TypeError"),
        (["scheduler.min_lr_ratio=2"], "`scheduler` cannot be instantiated: ValueError: min_lr_ratio must be in"),
        (["callbacks=default", "callbacks.throughput.warmup_steps=-1"], "`callbacks.throughput` cannot be"),
        (["logger._target_=no.such.Logger"], "`logger._target_`='no.such.Logger' cannot be imported"),
        (["model=v41_tiny", "model.engram_compressed_vocab_size=300"],
         "`data.tokenizer`='byte' has 227 Engram classes but `model.engram_compressed_vocab_size` is 300"),
        (["trainer.engram_tables=cpu"], "`trainer.engram_tables`='cpu' must be one of device, host"),
        (["trainer.engram_tables=host"], "`trainer.engram_tables`='host' holds DeepSeek-V4.1's Engram tables in host "
                                         "memory, but this model (model_type 'deepseek_v4') has no Engram tables"),
        (["model=v41_tiny", "model.engram_trainable=true", "trainer.engram_tables=host"],
         "`trainer.engram_tables`='host' holds frozen Engram tables only, but `model.engram_trainable`=true trains"),
    ],
)
def test_run_spec_names_the_bad_key(overrides, message):
    with pytest.raises((ValueError, RuntimeError)) as err:  # RuntimeError: a dispatcher this machine cannot run
        build_run_spec(_compose([*FAST, *overrides]))
    assert message in str(err.value)


def test_the_startup_timeout_goes_to_the_strategy_not_to_lightning():
    from datetime import timedelta

    from dsv4.training.strategy import DSV4Strategy

    spec = build_run_spec(_compose([*FAST, "trainer.startup_timeout_s=45"]))
    assert spec.startup_timeout_s == 45.0 and "startup_timeout_s" not in spec.trainer
    assert DSV4Strategy.from_spec(spec).startup_timeout == timedelta(seconds=45)
    assert build_run_spec(_compose(FAST)).startup_timeout_s == 300.0  # conf/trainer/cpu.yaml


def test_engram_tables_go_to_the_strategy_not_to_lightning():
    from dsv4.training.strategy import DSV4Strategy

    spec = build_run_spec(_compose([*FAST, "model=v41_tiny", "trainer.engram_tables=host"]))
    assert spec.engram_tables == "host" and "engram_tables" not in spec.trainer
    assert DSV4Strategy.from_spec(spec).engram_tables == "host"
    assert build_run_spec(_compose(FAST)).engram_tables == "device"  # conf/trainer/cpu.yaml
    with pytest.raises(ValueError, match="`trainer.engram_tables`='disk' must be one of device, host"):
        DSV4Strategy(engram_tables="disk")


def test_unknown_dispatcher_group_lists_the_options():
    """``dispatcher=fast`` (no conf/dispatcher/fast.yaml) fails while Hydra composes, listing the dispatcher
    options; ``dispatcher.name=fast`` reaches :func:`~dsv4.training.spec.build_run_spec` (ValueError, case above)."""
    with pytest.raises(Exception, match="Could not find 'dispatcher/fast'") as err:
        _compose([*FAST, "dispatcher=fast"])
    for name in ("auto", "local", "alltoall", "allgather", "deepep"):
        assert f"\t{name}\n" in str(err.value)


def test_export_directories_are_checked_at_start_up(tmp_path):
    """A non-empty ``export.hf_dir`` / ``export.adapter_dir`` stops the run before it trains, naming the key and the
    directory; ``export.overwrite=true`` accepts it; the two directories may not overlap."""
    stale = tmp_path / "hf"
    stale.mkdir()
    (stale / "model-00001-of-00009.safetensors").write_bytes(b"\0")
    with pytest.raises(ValueError) as err:
        build_run_spec(_compose([*FAST, f"export.hf_dir={stale}"]))
    assert (f"`export.hf_dir`={str(stale)!r} is not empty (1 file(s), e.g. ['model-00001-of-00009.safetensors']); "
            "the export would leave them beside its own files: choose an empty directory, or set "
            "export.overwrite=true") in str(err.value)
    assert build_run_spec(_compose([*FAST, f"export.hf_dir={stale}", "export.overwrite=true"])).export.overwrite
    lora = [*FAST, "peft=lora", "export.merge=true", f"export.hf_dir={tmp_path / 'merged'}"]
    with pytest.raises(ValueError, match=r"`export.adapter_dir`='.*/hf' is not empty"):
        build_run_spec(_compose([*lora, f"export.adapter_dir={stale}"]))
    with pytest.raises(ValueError, match=r"`export.hf_dir`='.*/merged' and `export.adapter_dir`='.*/merged/adapter': "
                                         "the merged model and the adapter go to two separate directories"):
        build_run_spec(_compose([*lora, f"export.adapter_dir={tmp_path / 'merged' / 'adapter'}"]))


def test_a_checkpoint_without_the_models_mtp_depths_stops_the_run_at_start_up(tmp_path):
    """``model.checkpoint`` with no MTP weights for the tiny model's one depth: refused while the spec resolves,
    unless ``model.init_missing_mtp=true`` or ``model.num_nextn_predict_layers=0``."""
    import torch

    from dsv4.checkpoint import export_hf_checkpoint
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    ckpt = tmp_path / "no_mtp"
    export_hf_checkpoint(DSV4ForCausalLM(DSV4Config.preset("tiny", num_nextn_predict_layers=0)), str(ckpt))
    with pytest.raises(ValueError, match=rf"{ckpt} \(release layout\) holds no weights for MTP depth\(s\) \[0\] of "
                                         r"the 1 the model builds .*model.num_nextn_predict_layers=0 .* or "
                                         r"model.init_missing_mtp=true"):
        build_run_spec(_compose([*FAST, f"model.checkpoint={ckpt}", "data.tokenizer=byte"]))
    with_ckpt = [*FAST, f"model.checkpoint={ckpt}", "data.tokenizer=byte"]  # the export holds no tokenizer
    assert build_run_spec(_compose([*with_ckpt, "model.init_missing_mtp=true"])).init_missing_mtp
    spec = build_run_spec(_compose([*with_ckpt, "model.num_nextn_predict_layers=0"]))
    assert spec.model.num_nextn_predict_layers == 0 and not spec.init_missing_mtp


def _metric(run: Path, name: str = "train/loss") -> dict[int, float]:
    with open(run / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def _losses(run: Path) -> dict[int, float]:
    return _metric(run, "train/loss")


def test_run_trains_writes_its_outputs_and_resumes(tmp_path, one_rank_group):
    run = tmp_path / "run"
    run.mkdir()
    value = run_finetune(_compose([*FAST, "trainer.max_steps=3", "checkpoint.every_n_steps=2"]), run)
    losses = _losses(run)
    assert sorted(losses) == [0, 1, 2] and value == pytest.approx(losses[2])
    assert read_objective(run) == pytest.approx(value)
    assert json.loads((run / "objective.json").read_text())["metric"] == "train/loss"
    # every 2 steps, and the last step although 3 is not a multiple of 2
    assert (run / "checkpoints" / "step2.ckpt" / ".metadata").exists()
    assert checkpoint_step(run / "checkpoints" / "step2.ckpt") == 2
    assert checkpoint_step(run / "checkpoints" / "step3.ckpt") == 3
    assert checkpoint_step(run / "checkpoints" / "last.ckpt") == 3
    # the learning rate is logged: warm-up 1 step, cosine over total_steps = max_steps = 3 to 0.1 x 3e-3
    assert _metric(run, "train/lr") == pytest.approx({0: 3e-3, 1: 3e-3, 2: 0.55 * 3e-3})
    resolved = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert resolved["model"]["preset"] == "tiny" and resolved["model"]["sliding_window"] == 16  # preset spelled out
    assert (run / "csv" / "hparams.yaml").exists()  # the logger got the config
    # resumed from the step-2 checkpoint with more steps: the same trajectory (its first step is the first run's
    # third), the CSV keeps the steps before 2 and appends, and the learning rate does not jump: the cosine goes on
    # from step 2's phase pi/2 to pi at the new max_steps 5 (re-stretching it would give step 3 0.55 x 3e-3)
    run_finetune(_compose([*FAST, "trainer.max_steps=5", "checkpoint.every_n_steps=2",
                           f"checkpoint.resume={run / 'checkpoints' / 'step2.ckpt'}"]), run)
    resumed = _losses(run)
    assert sorted(resumed) == [0, 1, 2, 3, 4]
    assert resumed[0] == losses[0] and resumed[1] == losses[1]  # the first run's rows are kept
    assert resumed[2] == pytest.approx(losses[2], abs=1e-6)
    expected = [0.1 + 0.45 * (1 + math.cos(phase)) for phase in (math.pi / 2, 2 * math.pi / 3, 5 * math.pi / 6)]
    lrs = _metric(run, "train/lr")
    assert [lrs[s] for s in (2, 3, 4)] == pytest.approx([3e-3 * f for f in expected])
    assert checkpoint_step(run / "checkpoints" / "last.ckpt") == 5


def test_global_batch_size_sets_the_accumulation_of_the_run(tmp_path, one_rank_group):
    """One rank, micro_batch_size 1, global_batch_size 3: one optimizer step reads 3 rows (the data position)."""
    import torch

    run_finetune(_compose([*FAST, "global_batch_size=3", "trainer.max_steps=1", "checkpoint.every_n_steps=0"]),
                 tmp_path)
    assert sorted(_losses(tmp_path)) == [0]  # one logged step
    meta = torch.load(tmp_path / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=False)
    assert meta["global_step"] == 1 and meta["DSV4DataModule"]["sampler"]["global_position"] == 3


def test_resume_continues_the_same_wandb_run(tmp_path, one_rank_group, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    run.mkdir()
    quick = [*FAST, "logger=wandb", "checkpoint.every_n_steps=0"]
    run_finetune(_compose([*quick, "trainer.max_steps=1"]), run)
    run_id = (run / "wandb" / "run_id").read_text().strip()
    run_finetune(_compose([*quick, "trainer.max_steps=2"]), run)  # resumes from the last step (1)
    offline = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{run_id}") for name in offline), (offline, run_id)
    # a fresh start in the same directory is a new wandb run
    run_finetune(_compose([*quick, "trainer.max_steps=1", "checkpoint.resume=none"]), run)
    assert (run / "wandb" / "run_id").read_text().strip() != run_id


def test_dry_run_packs_and_stops(tmp_path, caplog):
    caplog.set_level("INFO", logger="dsv4")
    assert run_finetune(_compose([*FAST, "dry_run=true"]), tmp_path) is None
    assert "dry run:" in caplog.text and not (tmp_path / "checkpoints").exists()
    # the packing statistics are logged at start: documents split, rows without labels, padding
    line = next(line for line in caplog.text.splitlines() if "packing:" in line)
    for part in ("rows of 256 tokens", "longer than a row (data.overlong=split):", " split;",
                 "rows without labels: 0", "padding "):
        assert part in line, line


def test_overlong_default_is_truncate_left_for_chat_data_and_split_for_the_bundled_corpus(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}\n')
    assert build_run_spec(_compose([*FAST, "data=jsonl", f"data.path={path}"])).overlong == "truncate_left"
    spec = build_run_spec(_compose(FAST))
    assert spec.overlong == "split" and "overlong" not in spec.data  # not a keyword of the document source


def test_keep_last_leaves_the_newest_periodic_checkpoints_and_last(tmp_path, one_rank_group):
    """5 periodic saves with keep_last=2: exactly step4, step5 and last.ckpt (a link to step5) remain; a milestone
    (keep_every_n_steps=2) survives; no *.partial is left behind."""
    run = tmp_path / "run"
    run.mkdir()
    run_finetune(_compose([*FAST, "trainer.max_steps=5", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2",
                           "checkpoint.keep_every_n_steps=2"]), run)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step2.ckpt", "step4.ckpt", "step5.ckpt"]
    assert (ckpts / "last.ckpt").is_symlink() and (ckpts / "last.ckpt").resolve() == (ckpts / "step5.ckpt").resolve()
    assert checkpoint_step(ckpts / "last.ckpt") == 5


@pytest.mark.parametrize("key, value, message", [
    ("keep_last", 0, r"`checkpoint.keep_last`=0 must be at least 1"),
    ("keep_every_n_steps", -5, r"`checkpoint.keep_every_n_steps`=-5 must be at least 1"),
])
def test_checkpoint_counts_are_checked(key, value, message):
    from dsv4.training.spec import build_run_spec

    with pytest.raises(ValueError, match=message):
        build_run_spec(_compose([*FAST, f"checkpoint.{key}={value}"]))


def test_resume_never_picks_an_incomplete_checkpoint(tmp_path, caplog):
    """A save killed before every rank finished leaves `<name>.partial` (never renamed) or a `*.ckpt` without its
    metadata: resume=auto takes the newest complete one and logs why it skipped the others; an explicit
    resume=<incomplete dir> is refused naming the files it needs."""
    import logging
    import os
    import time

    import torch

    from dsv4.config import DSV4Config
    from dsv4.training.run import _resume_path
    from dsv4.training.spec import CheckpointSpec, RunSpec

    ckpts = tmp_path / "checkpoints"
    for name, files in (("step2.ckpt", ("meta.pt", ".metadata")), ("step4.ckpt", (".metadata",)),
                        ("step4.ckpt.partial", ("meta.pt", ".metadata"))):
        (ckpts / name).mkdir(parents=True)
        for f in files:
            (ckpts / name / f).write_bytes(b"x")
    later = time.time() + 10
    os.utime(ckpts / "step4.ckpt.partial" / "meta.pt", (later, later))

    def spec(resume):
        return RunSpec(DSV4Config.preset("tiny"), optimizer=torch.optim.SGD, checkpoint=CheckpointSpec(resume=resume))

    with caplog.at_level(logging.WARNING):
        assert _resume_path(spec("auto"), ckpts) == str(ckpts / "step2.ckpt")
    assert "not resuming from" in caplog.text and "step4.ckpt.partial" in caplog.text and "step4.ckpt:" in caplog.text
    with pytest.raises(ValueError, match=r"step4.ckpt'? is not a complete distributed checkpoint .*meta.pt and .metadata"):
        _resume_path(spec(str(ckpts / "step4.ckpt")), ckpts)


def test_v41_tiny_trains_on_the_default_data_and_with_lora(tmp_path, one_rank_group):
    """``model=v41_tiny`` on the byte tokenizer (Engram hashing through its 227 classes; the start-up memory plan of
    the V4.1 model included, which counts its Engram tables), the tables trainable (row-sharded by the strategy, left
    out of FSDP, in the optimizer, clipped and saved with the rest): the loss falls over 4 steps; ``peft=lora
    peft.base_dtype=fp8`` (adapters on a frozen kept base, Engram tables frozen) trains too."""
    run = tmp_path / "full"
    run.mkdir()
    run_finetune(_compose([*FAST, "model=v41_tiny", "model.engram_trainable=true", "trainer.max_steps=4",
                           "checkpoint.every_n_steps=0"]), run)
    losses = _losses(run)
    assert sorted(losses) == [0, 1, 2, 3] and losses[3] < losses[0] - 0.3, losses
    plan = json.loads((run / "memory_plan.json").read_text())
    assert plan["engram_table_bytes"] == 4 * (384 + 552) * 32  # v41_tiny's two fp32 tables on one rank
    from dsv4.checkpoint.convert import DCPTensors

    saved = DCPTensors(run / "checkpoints" / "last.ckpt")  # the trained tables and their AdamW moments, whole
    for layer, rows in ((1, 384), (4, 552)):
        for key in ("state_dict.model", "optimizer_0.state.model"):
            suffix = "" if key == "state_dict.model" else ".exp_avg"
            assert saved.shape(f"{key}.model.layers.{layer}.engram.embed.weight{suffix}") == (rows, 32)
    lora = tmp_path / "lora"
    lora.mkdir()
    run_finetune(_compose([*FAST, "model=v41_tiny", "peft=lora", "peft.base_dtype=fp8", "trainer.max_steps=3",
                           "checkpoint.every_n_steps=0", "plan=false"]), lora)
    adapted = _losses(lora)
    # a fresh adapter is the base model, here its FP8 / FP4 kept form (measured 0.009 from the fp32 base's loss)
    assert adapted[0] == pytest.approx(losses[0], abs=0.02)
    assert adapted[2] < adapted[0] - 0.1, adapted


def test_v41_tiny_with_engram_tables_in_host_memory_trains_as_on_the_device(tmp_path, one_rank_group, caplog):
    """``trainer.engram_tables=host`` (frozen tables held in host memory by the strategy; on a CPU host and device are
    one memory): the same losses as the device-held run over 3 steps, bit for bit; the checkpoint holds the same
    tables; resumed from its step-2 checkpoint the host-held run repeats its third step; the plan moves the tables'
    bytes from the device's parameters to host memory."""
    from dsv4.checkpoint.convert import DCPTensors

    caplog.set_level("INFO", logger="dsv4")
    common = [*FAST, "model=v41_tiny", "trainer.max_steps=3", "checkpoint.every_n_steps=2"]
    runs = {}
    for where in ("device", "host"):
        runs[where] = tmp_path / where
        runs[where].mkdir()
        run_finetune(_compose([*common, f"trainer.engram_tables={where}"]), runs[where])
    losses = {where: _losses(run) for where, run in runs.items()}
    assert sorted(losses["host"]) == [0, 1, 2] and losses["host"] == losses["device"], losses
    held = [line for line in caplog.text.splitlines() if "Engram tables in host memory (trainer" in line]
    assert len(held) == 1 and "2 tables" in held[0], held  # the host run's strategy held them; the other did not
    saved = {where: DCPTensors(run / "checkpoints" / "last.ckpt") for where, run in runs.items()}
    for layer in (1, 4):
        key = f"state_dict.model.model.layers.{layer}.engram.embed.weight"
        assert torch.equal(saved["host"].read(key), saved["device"].read(key)), key
    plans = {where: json.loads((run / "memory_plan.json").read_text()) for where, run in runs.items()}
    tables = plans["device"]["engram_table_bytes"]
    assert tables == 4 * (384 + 552) * 32 and plans["host"]["engram_host_bytes"] == tables
    assert plans["device"]["per_rank_bytes"]["parameters"] - plans["host"]["per_rank_bytes"]["parameters"] == tables
    run_finetune(_compose([*common, "trainer.engram_tables=host",
                           f"checkpoint.resume={runs['host'] / 'checkpoints' / 'step2.ckpt'}"]), runs["host"])
    assert _losses(runs["host"])[2] == pytest.approx(losses["host"][2], abs=1e-6)


def test_v41_image_tokens_in_the_data_are_refused_before_training(tmp_path):
    """A packed row holding ``model.image_token_id`` (here the byte of "a") stops the run after packing."""
    with pytest.raises(ValueError, match=r"the training data holds \d+ image tokens \(model.image_token_id=97\): "
                                         "DeepSeek-V4.1 trains on text only"):
        run_finetune(_compose([*FAST, "model=v41_tiny", "model.image_token_id=97", "dry_run=true"]), tmp_path)
