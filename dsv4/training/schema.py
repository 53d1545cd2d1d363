"""Typed schemas of ``conf/finetune.yaml`` and ``conf/capture_dspark.yaml`` (Hydra ConfigStore entries
``finetune_schema``, ``train_dspark_schema``, ``capture_schema`` and ``eval_dspark_schema``).

Typos and wrong types fail while Hydra composes the config, before any process starts: ``cp=three`` -> "Value
'three' ... could not be converted to Integer / full_key: cp"; ``cpp=4`` -> "Key 'cpp' not in 'FinetuneConfig'";
``model.bogus=1`` -> "Key 'bogus' not in 'ModelConfig'". Semantic checks (cp dividing the world, compress_ratios
length, seq_len multiple of cp x the shard multiple, dispatcher availability, the instantiable groups, the data
itself) run in :func:`dsv4.training.run.validate` before the Trainer launches its processes.

The model group names a preset (``model.preset``, defined once in :data:`dsv4.config.PRESETS`); every other key of
:class:`ModelConfig` is a :class:`~dsv4.config.DSV4Config` field that overrides the preset (None = the preset's
value). Groups built by ``hydra.utils.instantiate`` (``optim``, ``scheduler``, ``callbacks``, ``logger``) are
dictionaries with a ``_target_``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from dsv4.config import PRESETS, DSV4Config
from dsv4.config_v41 import DSV41Config


def _model_schema() -> type:
    # DSV41Config's fields are a superset of DSV4Config's: one schema for both families (a key the preset's family
    # lacks is refused by DSV4Config.preset, naming it).
    hints = typing.get_type_hints(DSV41Config)
    overrides = [(f.name, Optional[hints[f.name]], field(default=None)) for f in dataclasses.fields(DSV41Config)]
    schema = dataclasses.make_dataclass(
        "ModelConfig", [("preset", str, field(default="tiny")), ("checkpoint", Optional[str], field(default=None)),
                        ("init_missing_mtp", bool, field(default=False))] + overrides)
    schema.__doc__ = ("The model group: ``preset`` (one of dsv4.config.PRESETS), ``checkpoint`` (a Hugging Face-"
                      "format DSV4 checkpoint directory loaded before training), ``init_missing_mtp`` (MTP depths "
                      "the checkpoint lacks keep their random initialisation instead of stopping the run) and any "
                      "field of the preset's config class (DSV4Config, or DSV41Config for the v41_* presets) to "
                      "override")
    return schema


ModelConfig = _model_schema()


def model_config(model_cfg: Any) -> DSV4Config:
    """The config a composed model group describes (:class:`DSV4Config`, or :class:`DSV41Config` for a V4.1 preset;
    ValueError naming the bad field)."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(model_cfg, resolve=True) if not isinstance(model_cfg, dict) else dict(model_cfg)
    preset = values.pop("preset", "tiny")
    values.pop("checkpoint", None)
    values.pop("init_missing_mtp", None)
    if preset not in PRESETS:
        raise ValueError(f"`model.preset`={preset!r} must be one of {sorted(PRESETS)}")
    try:
        return DSV4Config.preset(preset, **{k: v for k, v in values.items() if v is not None})
    except ValueError as err:
        raise ValueError(f"model: {err}") from None


@dataclass
class DataConfig:
    """Keyword arguments of :func:`dsv4.data.build_documents` (``kind``: a name in :data:`dsv4.data.DATA_SOURCES`,
    stdlib | jsonl | hf built in; ``options``: the keys only that source reads), and ``overlong``:
    what the packer does with a document longer than ``seq_len`` (:data:`dsv4.data.packer.OVERLONG`; the default
    ``truncate_left`` keeps a conversation's last turns, the ones with the answer; ``conf/data/stdlib.yaml`` splits
    its source files). Held-out data, at most one of: ``val``, source keys that override the training source's for a
    second source (e.g. ``{path: val.jsonl}``), or ``val_fraction``, the share of the documents held out by seed
    (:mod:`dsv4.data.validation`). ``tokenizer=auto``: the tokenizer of ``model.checkpoint`` (refused when it has
    none), byte without one (:mod:`dsv4.data.defaults`); ``cache_dir``: where prepared datasets are kept (null:
    tokenize in memory at every start), ``num_proc``: tokenizing processes (null: min(8, CPUs)), see
    :mod:`dsv4.data.prepared`."""

    kind: str = "stdlib"
    path: Optional[str] = None
    tokenizer: str = "auto"
    split: str = "train"
    text_key: str = "text"
    messages_key: str = "messages"
    chat_template_file: Optional[str] = None
    max_documents: Optional[int] = None
    max_bytes: Optional[int] = None
    min_bytes: int = 64
    seed: int = 0
    options: Dict[str, Any] = field(default_factory=dict)
    overlong: str = "truncate_left"
    val: Any = None  # a mapping of source keys, or null
    val_fraction: Optional[float] = None
    cache_dir: Optional[str] = None
    num_proc: Optional[int] = None


@dataclass
class DispatcherConfig:
    """MoE token dispatcher: auto (local when ep = 1, else alltoall) or a name in
    :data:`dsv4.parallel.dispatch.TOKEN_DISPATCHERS` (local | alltoall | allgather | deepep built in)."""

    name: str = "auto"


@dataclass
class CheckpointConfig:
    """``every_n_steps``: distributed checkpoint cadence (0 = only at the end); ``resume``: ``auto`` (the run
    dir's newest complete checkpoint, if any), ``none``, or a checkpoint directory; ``keep_last``: periodic
    checkpoints kept (null: all); ``keep_every_n_steps``: periodic checkpoints of these steps are always kept;
    ``async_save``: write in the background, the step waits only for the host copy; ``monitor``: ``val/loss`` also
    keeps ``best.ckpt`` (the lowest one), null: no best checkpoint."""

    every_n_steps: int = 50
    resume: str = "auto"
    keep_last: Optional[int] = 3
    keep_every_n_steps: Optional[int] = None
    async_save: bool = True
    monitor: Optional[str] = None


@dataclass
class PreemptionConfig:
    """``signals``: signal names that stop the run after the current optimizer step with a complete checkpoint
    (:class:`dsv4.callbacks.preemption.Preemption`; [] = off); ``exit_code``: the process status after such a stop."""

    signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGUSR2"])
    exit_code: int = 143


@dataclass
class ExportConfig:
    """``hf_dir``: write the trained model there at the end of training in the HF layout (``dsv4.checkpoint``);
    ``dtype``: bfloat16 | float32 | quantized (release FP8/FP4 formats); ``adapter_dir`` (LoRA): the adapters in
    the PEFT format; ``merge`` (LoRA): ``hf_dir`` gets the merged model; ``overwrite``: a non-empty ``hf_dir`` /
    ``adapter_dir`` is accepted (else refused at start-up) and every file the export does not write is removed."""

    hf_dir: Optional[str] = None
    dtype: str = "bfloat16"
    adapter_dir: Optional[str] = None
    merge: bool = False
    overwrite: bool = False


@dataclass
class PeftGroupConfig:
    """The ``peft`` group: ``name`` none | lora and the :class:`dsv4.peft.LoRAConfig` fields; ``adapter``: a PEFT
    adapter directory to start from."""

    name: str = "none"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: List[str] = field(default_factory=lambda: ["attention", "shared_experts", "routed_experts"])
    base_dtype: str = "bf16"
    adapter: Optional[str] = None


def lora_config(peft_cfg: Any):
    """The :class:`dsv4.peft.LoRAConfig` of a composed ``peft`` group (None for ``peft=none``)."""
    from omegaconf import OmegaConf

    from dsv4.peft.config import LoRAConfig

    values = OmegaConf.to_container(peft_cfg, resolve=True) if not isinstance(peft_cfg, dict) else dict(peft_cfg)
    values.pop("adapter", None)
    return LoRAConfig.from_mapping(values)


@dataclass
class FinetuneConfig:
    cp: int = 1
    cp_balance: str = "none"
    dp: int = -1
    ep: int = 1
    pp: int = 1  # pipeline stages' ranks (dsv4.training.pipeline_step)
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    seq_len: int = 2048
    seed: int = 1234
    micro_batch_size: int = 1
    # rows per optimizer step over all dp replicas (None: micro_batch_size x dp, no gradient accumulation)
    global_batch_size: Optional[int] = None
    dry_run: bool = False
    bias_update_rate: float = 1e-3
    indexer_warmup_steps: int = 0
    # the metric a sweep job reports (objective.json): train/loss (last step) | val/loss (validation after it)
    objective: str = "train/loss"
    model: ModelConfig = field(default_factory=ModelConfig)
    peft: PeftGroupConfig = field(default_factory=PeftGroupConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dispatcher: DispatcherConfig = field(default_factory=DispatcherConfig)
    # lightning.Trainer keywords, but precision, val_check_interval, limit_val_batches, skip_nonfinite_steps
    # (dsv4's: int >= 0, non-finite steps skipped before one stops the run), offload (dsv4's: none | optimizer,
    # FSDP2's CPU offload of master shards, gradients and optimizer state), engram_tables (dsv4's: device | host, V4.1's
    # frozen Engram tables in host memory) and startup_timeout_s, checked in dsv4.training.options.trainer
    trainer: Dict[str, Any] = field(default_factory=dict)
    optim: Dict[str, Any] = field(default_factory=dict)
    scheduler: Optional[Dict[str, Any]] = None
    callbacks: Dict[str, Any] = field(default_factory=dict)
    logger: Optional[Dict[str, Any]] = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # true = plan only, false = no plan, or the options of dsv4.training.options.plan.PlanOptions
    plan: Any = field(default_factory=lambda: {"enabled": True, "only": False, "enforce": True,
                                               "device_memory_gib": None, "suggest": 3})


@dataclass
class DrafterTrainConfig:
    """The ``drafter`` group of ``recipes/train_dspark.py`` (:mod:`dsv4.training.options.dspark`)."""

    init: str = "auto"
    checkpoint: Optional[str] = None
    num_anchors: int = 64
    gamma: Optional[float] = 4.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    eval_every_n_steps: Optional[int] = None
    eval_prompts: int = 4
    eval_prompt_tokens: int = 64
    eval_new_tokens: int = 32


@dataclass
class TrainDSparkConfig(FinetuneConfig):
    """``recipes/train_dspark.py``: the fine-tuning run's keys, ``mode``, ``features`` and ``drafter``."""

    mode: str = "online"
    features: Optional[str] = None
    drafter: DrafterTrainConfig = field(default_factory=DrafterTrainConfig)


@dataclass
class CaptureConfig:
    """``recipes/capture_dspark.py`` (:func:`dsv4.speculative.capture_job.run_capture`)."""

    layer_ids: Optional[List[int]] = None  # None: the model's DSpark targets (dsv4.speculative.capture_job)
    seq_len: int = 1024
    micro_batch_size: int = 2
    dp: int = 1
    cp: int = 1
    dispatcher: str = "local"
    docs_per_shard: int = 64
    max_documents: Optional[int] = 256
    max_document_tokens: Optional[int] = 4096
    max_shards_this_run: Optional[int] = None
    dtype: str = "float32"
    seed: int = 1234
    output_dir: Optional[str] = None
    progress: bool = True
    threads: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)


@dataclass
class DrafterSourceConfig:
    """The drafter ``recipes/eval_dspark.py`` runs: a V4.1 checkpoint directory holding ``mtp.*`` (None: a fresh
    drafter with the target's embedding and head)."""

    checkpoint: Optional[str] = None


@dataclass
class EvalDSparkConfig:
    """``recipes/eval_dspark.py`` (:func:`dsv4.speculative.eval_job.run_eval`)."""

    num_prompts: int = 8
    prompt_tokens: int = 64
    max_new_tokens: int = 32
    temperature: float = 0.0
    eos_token_id: Optional[int] = None
    max_documents: Optional[int] = 256
    seed: int = 1234
    threads: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterSourceConfig = field(default_factory=DrafterSourceConfig)
    logger: Optional[Dict[str, Any]] = None


def cpu_world_size(dp: int, cp: int) -> int:
    """``${dsv4.world:${dp},${cp}}``: processes on one machine, ``dp * cp`` (``cp`` when dp is derived, -1)."""
    return cp if dp in (-1, 0, None) else dp * cp


def register_schema() -> None:
    """Store the schemas in Hydra's ConfigStore and register the ``dsv4.*`` resolvers ``conf/`` uses."""
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    store.store(name="finetune_schema", node=FinetuneConfig)
    store.store(name="capture_schema", node=CaptureConfig)
    store.store(name="eval_dspark_schema", node=EvalDSparkConfig)
    store.store(name="train_dspark_schema", node=TrainDSparkConfig)
    OmegaConf.register_new_resolver("dsv4.world", cpu_world_size, replace=True)
