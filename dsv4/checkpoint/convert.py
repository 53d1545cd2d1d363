"""A finished run's distributed (DCP) checkpoint -> the files ``export.hf_dir`` writes, in one CPU process.

``python -m dsv4.checkpoint export RUN_DIR [--step N] --out DIR [--dtype bfloat16|float32|quantized] [--adapter]
[--merge] [--overwrite]``
(:func:`export_run`): the checkpoint is ``RUN_DIR/checkpoints/step<N>.ckpt`` (``last.ckpt`` without ``--step``; a
``*.ckpt`` directory may be given as ``RUN_DIR``). The model config comes from its ``meta.pt``, of the class its
``model_type`` names (a V4.1 run's exports in the V4.1 layout); the model is built on the meta device (no memory),
and each tensor is read from the checkpoint only when the export writes it
(``torch.distributed.checkpoint`` loads one key at a time), so peak memory is two copies of the largest tensor (the
chunk deserialised, then copied into place) and its converted form (2.0x in ``benchmarks/checkpoint_export.py``).
The files are byte-identical to the run's own ``export.hf_dir`` of the same step
(``tests/unit/checkpoint/test_convert.py``).

Before anything is read, every tensor's chunks are checked against the checkpoint's ``.metadata``: a missing or
short ``*.distcp`` file, a missing key or a shape other than the model's is a :class:`CheckpointFormatError`
(``ValueError``) naming the file or the key.

A LoRA run's checkpoint holds only the adapters: ``--adapter`` writes them as ``export.adapter_dir`` does (the LoRA
settings and the base's name from the run's ``resolved_config.yaml``), byte for byte. ``--merge`` writes the merged
model (``export.merge`` with ``export.hf_dir``), byte for byte, with the base streamed from the run's
``model.checkpoint`` one block at a time (:class:`_BlockLoader`): peak memory is one transformer block of the base in
the format the run keeps it in, plus one merged tensor.

A V4.1 run's Engram tables are in the checkpoint at their global shapes (each rank saved its rows); a table the run
kept in FP8 (frozen, from a release) is dequantised on the way out.

Checkpoints of expert-parallel runs hold every routed expert at its global shape (:mod:`dsv4.parallel.expert_state`)
and convert like any other; a routed-expert tensor holding fewer experts than the model is refused, naming the key
and the numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, load

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.export import ExportReport, ExportSource, export_hf_checkpoint
from dsv4.checkpoint.export_dir import check_export_dir
from dsv4.checkpoint.safetensors_io import CheckpointFormatError

MODEL_PREFIX = "state_dict.model."
META_FILE = "meta.pt"


def find_checkpoint(run_dir: str | os.PathLike, step: int | None = None) -> Path:
    """The DCP directory of ``run_dir`` for ``step`` (``last.ckpt`` when None); ``run_dir`` may be one itself."""
    run = Path(run_dir)
    if (run / ".metadata").is_file() and step is None:
        return run
    ckpts = run / "checkpoints"
    path = ckpts / ("last.ckpt" if step is None else f"step{step}.ckpt")
    if not path.is_dir():
        found = sorted(p.name for p in ckpts.glob("*.ckpt")) if ckpts.is_dir() else []
        raise FileNotFoundError(f"{path}: no such checkpoint directory (found in {ckpts}: {found or 'none'})")
    return path


class _ReaderOf(FileSystemReader):
    """A ``FileSystemReader`` that hands DCP the checkpoint's metadata, read once, instead of unpickling
    ``.metadata`` again for every key (which costs about as much as the key's bytes for a small tensor)."""

    def __init__(self, path: Path, metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class DCPTensors:
    """The tensors of one DCP checkpoint directory, read one key at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not (path / ".metadata").is_file():
            raise CheckpointFormatError(f"{path / '.metadata'}: missing (an incomplete or damaged checkpoint)")
        try:
            self.metadata = FileSystemReader(str(path)).read_metadata()
        except Exception as err:  # noqa: BLE001 - a truncated or foreign pickle
            raise CheckpointFormatError(f"{path / '.metadata'}: unreadable ({type(err).__name__}: {err})") from None
        self.entries = self.metadata.state_dict_metadata

    def check_files(self, keys: list[str]) -> None:
        """Every chunk of ``keys`` lies inside an existing ``*.distcp`` file, else the file is named."""
        wanted = set(keys)
        sizes: dict[str, int | None] = {}
        for index, info in self.metadata.storage_data.items():
            if index.fqn not in wanted:
                continue
            name = info.relative_path
            if name not in sizes:
                file = self.path / name
                sizes[name] = file.stat().st_size if file.is_file() else None
            if sizes[name] is None:
                raise CheckpointFormatError(f"{self.path / name}: missing (holds {index.fqn}); the checkpoint is "
                                            "incomplete")
            if info.offset + info.length > sizes[name]:
                raise CheckpointFormatError(
                    f"{self.path / name}: {sizes[name]} bytes, but {index.fqn} lies at bytes [{info.offset}, "
                    f"{info.offset + info.length}): truncated")

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key].properties.dtype

    def read(self, key: str) -> torch.Tensor:
        t = torch.empty(self.shape(key), dtype=self.dtype(key))
        try:
            load({key: t}, storage_reader=_ReaderOf(self.path, self.metadata), no_dist=True)
        except Exception as err:  # noqa: BLE001 - name the checkpoint and the key
            raise CheckpointFormatError(f"{self.path}: reading {key} failed ({type(err).__name__}: {err})") from None
        return t


def _config(ckpt: Path):
    """The run's model config from ``meta.pt``, of the class its ``model_type`` names (absent: a V4 run)."""
    from dsv4.config import config_class

    meta = ckpt / META_FILE
    if not meta.is_file():
        raise CheckpointFormatError(f"{meta}: missing (the run's model config is kept there)")
    try:
        state = torch.load(meta, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001
        raise CheckpointFormatError(f"{meta}: unreadable ({type(err).__name__}: {err})") from None
    config = state.get("dsv4", {}).get("config") if isinstance(state, dict) else None
    if not isinstance(config, dict):
        raise CheckpointFormatError(f"{meta}: no dsv4 model config (not written by a dsv4 run?)")
    try:
        return config_class(state["dsv4"].get("model_type", "deepseek_v4")).from_dict(config)
    except ValueError as err:
        raise CheckpointFormatError(f"{meta}: {err}") from None


def export_run(run_dir: str | os.PathLike, out: str, *, step: int | None = None, dtype: str = "bfloat16",
               progress: bool = False, max_shard_bytes: int | None = None, adapter: bool = False,
               merge: bool = False, overwrite: bool = False, group=None) -> ExportReport:
    """Write the HF-format export of ``run_dir``'s checkpoint to ``out`` (see the module docstring). A LoRA run:
    ``adapter`` writes its PEFT adapter (``export.adapter_dir``), ``merge`` the merged model. ``out`` must be absent
    or empty (checked first) unless ``overwrite`` (``--overwrite``: every file the export does not write is
    removed from it). ``group``: the process group the export runs on (a one-rank group from a process of a
    distributed run, which then writes every file itself; None: the world, or none without ``torch.distributed``)."""
    from dsv4.model import build_causal_lm
    from dsv4.peft.lora import is_adapter_name

    if adapter and merge:
        raise ValueError("--adapter and --merge: choose one (the PEFT adapter, or the merged model)")
    check_export_dir(str(out), key="--out", overwrite=overwrite, flag="--overwrite")
    ckpt = find_checkpoint(run_dir, step)
    config = _config(ckpt)
    tensors = DCPTensors(ckpt)
    if any(is_adapter_name(k) for k in tensors.entries if k.startswith(MODEL_PREFIX)):
        if adapter:
            return _export_adapter(ckpt, out, config, tensors, overwrite)
        if merge:
            return _export_merged(ckpt, out, config, tensors, dtype, progress, max_shard_bytes, overwrite, group)
        raise ValueError(f"{ckpt}: a LoRA run's checkpoint (adapters only): pass --adapter for the PEFT adapter or "
                         "--merge for the merged model")
    if adapter or merge:
        raise ValueError(f"{ckpt}: --{'adapter' if adapter else 'merge'} needs a LoRA run's checkpoint; this one "
                         "holds the full model")
    with torch.device("meta"):
        model = build_causal_lm(config)
    state = model.state_dict()
    names = list(state)
    missing = [MODEL_PREFIX + n for n in names if MODEL_PREFIX + n not in tensors.entries]
    if missing:
        raise CheckpointFormatError(f"{ckpt}: {len(missing)} model tensors missing from the checkpoint, e.g. "
                                    f"{missing[:3]}")
    for name in names:
        _check_shape(ckpt, tensors, MODEL_PREFIX + name, tuple(state[name].shape), K.is_stacked_expert(name))
    tensors.check_files([MODEL_PREFIX + n for n in names])
    sources = [ExportSource(n, tensors.shape(MODEL_PREFIX + n), tensors.dtype(MODEL_PREFIX + n).is_floating_point,
                            lambda n=n: _read_model_tensor(tensors, n)) for n in names]
    return _export_sources(model, out, config, sources, dtype, ckpt, progress, max_shard_bytes, overwrite, group)


def _read_model_tensor(tensors: DCPTensors, name: str) -> torch.Tensor:
    """The model tensor ``name`` of the checkpoint; an Engram table the run kept in FP8 (its ``scale`` saved beside
    it, :mod:`dsv4.model.v41.engram_table`) dequantised."""
    from dsv4.checkpoint.quant import V41_SCHEME, dequantize

    key = MODEL_PREFIX + name
    scale = key[: -len("weight")] + "scale"
    if name.endswith(".engram.embed.weight") and scale in tensors.entries:
        return dequantize(tensors.read(key), tensors.read(scale), "fp8_rows", torch.float32, V41_SCHEME)
    return tensors.read(key)


def _export_sources(model, out: str, config, sources: list[ExportSource], dtype: str, ckpt: Path, progress: bool,
                    max_shard_bytes: int | None, overwrite: bool, group=None) -> ExportReport:
    """``export_hf_checkpoint`` of ``sources``, with a progress bar over the tensors when asked."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sources), unit="tensor", desc=f"export {ckpt.name}")

        def counted(fetch):
            def run() -> torch.Tensor:
                t = fetch()
                bar.update(1)
                return t
            return run

        sources = [ExportSource(s.name, s.shape, s.is_float, counted(s.fetch)) for s in sources]
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    try:
        return export_hf_checkpoint(model, out, dtype=dtype, config=config, sources=sources, overwrite=overwrite,
                                    group=group, **kwargs)
    finally:
        if bar is not None:
            bar.close()


def _check_shape(ckpt: Path, tensors: DCPTensors, key: str, want: tuple[int, ...], expert: bool) -> None:
    got = tensors.shape(key)
    if got == want:
        return
    if expert and got[1:] == want[1:] and got[0] < want[0]:
        raise ValueError(f"{ckpt}: {key} holds {got[0]} of the {want[0]} routed experts (one expert-parallel rank's "
                         "slice): not a complete checkpoint of this model")
    raise CheckpointFormatError(f"{ckpt}: {key} has shape {list(got)}, the model's {list(want)}")


def _lora_run(ckpt: Path, config):
    """The LoRA settings and resolved config of the run that wrote ``ckpt`` (its ``resolved_config.yaml``), and
    its model on the meta device with the adapters applied; the adapters' checkpoint keys are checked."""
    from omegaconf import OmegaConf

    from dsv4.model import build_causal_lm
    from dsv4.peft.apply import apply_lora
    from dsv4.training.schema import lora_config

    resolved = ckpt.parent.parent / "resolved_config.yaml"
    if not resolved.is_file():
        raise CheckpointFormatError(f"{resolved}: missing (the run's peft settings are read there)")
    cfg = OmegaConf.load(resolved)
    lora = lora_config(cfg.peft)
    if lora is None:
        raise CheckpointFormatError(f"{resolved}: peft is none, but {ckpt} holds LoRA adapters")
    with torch.device("meta"):
        model = build_causal_lm(config)
        apply_lora(model, lora)
    return cfg, lora, model


def _check_adapters(ckpt: Path, tensors: DCPTensors, model, resolved_name: str) -> list[str]:
    """The adapter parameter names of ``model``, each in the checkpoint at the model's shape."""
    from dsv4.peft.lora import is_adapter_name

    names = [n for n, _ in model.named_parameters() if is_adapter_name(n)]
    shapes = dict(model.named_parameters())
    for name in names:
        key = MODEL_PREFIX + name
        if key not in tensors.entries:
            raise CheckpointFormatError(f"{ckpt}: {key} missing (peft.targets of {resolved_name} adapt it)")
        _check_shape(ckpt, tensors, key, tuple(shapes[name].shape), ".experts." in name)
    tensors.check_files([MODEL_PREFIX + n for n in names])
    return names


def model_blocks(model) -> dict[str, list[str]]:
    """The state-dict names of ``model`` by block: ``"model.layers.<i>."`` / ``"mtp.layers.<i>."`` for each
    transformer layer, ``""`` for everything else (embedding, norms, head); the unit ``--merge`` loads at a time."""
    layers = [f"model.layers.{i}." for i in range(len(model.model.layers))]
    layers += [f"mtp.layers.{i}." for i in range(len(model.mtp.layers))] if hasattr(model, "mtp") else []
    blocks: dict[str, list[str]] = {}
    for name in model.state_dict(keep_vars=True):
        blocks.setdefault(next((p for p in layers if name.startswith(p)), ""), []).append(name)
    return blocks


class _BlockLoader:
    """The tensors of a meta-device LoRA model, materialised on the CPU one block at a time: the base from the
    run's ``model.checkpoint`` (in the format the run keeps it: :func:`~dsv4.checkpoint.load.load_hf_checkpoint`
    with ``only`` the block's names), the adapters from the DCP checkpoint. A block is a backbone or MTP
    transformer layer, or everything else (embedding, norms, head). ``fetch(source)`` makes the source's block the
    one on the CPU (the previous one goes back to the meta device) and returns ``source.fetch()``."""

    def __init__(self, model, base: str, tensors: DCPTensors) -> None:
        self.model, self.base, self.tensors = model, base, tensors
        self.blocks = model_blocks(model)
        self.current: str | None = None

    def _block_of(self, name: str) -> str:
        return next((b for b in self.blocks if b and name.startswith(b)), "")

    def _place(self, names: list[str], device: str) -> None:
        from torch import nn

        for name in names:
            module_name, _, leaf = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            old = getattr(module, leaf)
            new = torch.empty_like(old, device=device)
            if isinstance(old, nn.Parameter):
                setattr(module, leaf, nn.Parameter(new, requires_grad=old.requires_grad))
            else:
                module.register_buffer(leaf, new)

    def fetch(self, source: ExportSource) -> torch.Tensor:
        from dsv4.checkpoint.load import load_hf_checkpoint
        from dsv4.peft.lora import is_adapter_name

        block = self._block_of(source.name)
        if block != self.current:
            if self.current is not None:
                self._place(self.blocks[self.current], "meta")
            names = self.blocks[block]
            self._place(names, "cpu")
            report = load_hf_checkpoint(self.model, self.base, only=set(names).__contains__, init_missing_mtp=True)
            if report.fresh:
                raise ValueError(f"{self.base}: the run's model.checkpoint holds no MTP weights (the run initialised "
                                 "them from its seed); export the merged model with export.merge in the run")
            with torch.no_grad():
                for name in names:
                    if is_adapter_name(name):
                        self.model.get_parameter(name).copy_(self.tensors.read(MODEL_PREFIX + name))
            self.current = block
        return source.fetch()


def _export_merged(ckpt: Path, out: str, config, tensors: DCPTensors, dtype: str, progress: bool,
                   max_shard_bytes: int | None, overwrite: bool, group=None) -> ExportReport:
    """A LoRA run's merged model (``export.merge`` with ``export.hf_dir``): base + alpha/r B A, streamed by block."""
    from dsv4.peft.apply import merged_sources

    cfg, _, model = _lora_run(ckpt, config)
    base = cfg.model.get("checkpoint") or None
    if base is None:
        raise ValueError(f"{ckpt}: --merge reads the base weights from the run's model.checkpoint, and this run has "
                         "none (its base is a random initialisation); export with export.merge in the run")
    if not Path(base).is_dir():
        raise FileNotFoundError(f"{base}: the run's model.checkpoint (the base --merge reads) is not a directory")
    _check_adapters(ckpt, tensors, model, str(ckpt.parent.parent / "resolved_config.yaml"))
    loader = _BlockLoader(model, str(base), tensors)
    sources = [ExportSource(s.name, s.shape, s.is_float, lambda s=s: loader.fetch(s)) for s in merged_sources(model)]
    return _export_sources(model, out, config, sources, dtype, ckpt, progress, max_shard_bytes, overwrite, group)


def _export_adapter(ckpt: Path, out: str, config, tensors: DCPTensors, overwrite: bool) -> ExportReport:
    """A LoRA run's adapters (all in the checkpoint, small) -> ``export.adapter_dir``'s files. The LoRA settings
    and the base's name come from the run's ``resolved_config.yaml``."""
    from dsv4.peft.lora import LoRAGroupedExperts, LoRALinear
    from dsv4.peft.peft_format import PREFIX, release_to_transformers, write_peft_adapter

    cfg, lora, model = _lora_run(ckpt, config)
    _check_adapters(ckpt, tensors, model, str(ckpt.parent.parent / "resolved_config.yaml"))
    release: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoRALinear) and module.rank:
            hf = K.ours_to_hf(f"{module_name}.weight")[: -len(".weight")]
            for ab in "AB":
                release[f"{PREFIX}{hf}.lora_{ab}.weight"] = tensors.read(f"{MODEL_PREFIX}{module_name}.lora_{ab}").float()
        elif isinstance(module, LoRAGroupedExperts) and module.rank:
            for n in module.WEIGHTS:
                stacks = {ab: tensors.read(f"{MODEL_PREFIX}{module_name}.{n}_lora_{ab}").float() for ab in "AB"}
                for e in range(module.num_experts):
                    hf = K.ours_to_hf(f"{module_name}.{n}", e)[: -len(".weight")]
                    for ab in "AB":
                        release[f"{PREFIX}{hf}.lora_{ab}.weight"] = stacks[ab][e].clone()
    adapters = release_to_transformers(release)
    write_peft_adapter(adapters, out, lora, cfg.model.get("checkpoint") or None, "transformers", overwrite=overwrite)
    report = ExportReport(path=out, files=["adapter_model.safetensors", "adapter_config.json"])
    report.num_tensors = len(adapters)
    report.total_size = sum(t.numel() * t.element_size() for t in adapters.values())
    return report
