"""A finished run's distributed (DCP) checkpoint -> the files ``export.hf_dir`` writes, in one CPU process.

``python -m dsv4.checkpoint export RUN_DIR [--step N] --out DIR [--dtype bfloat16|float32|quantized] [--adapter]``
(:func:`export_run`): the checkpoint is ``RUN_DIR/checkpoints/step<N>.ckpt`` (``last.ckpt`` without ``--step``; a
``*.ckpt`` directory may be given as ``RUN_DIR``). The model config comes from its ``meta.pt``; the model is built
on the meta device (no memory), and each tensor is read from the checkpoint only when the export writes it
(``torch.distributed.checkpoint`` loads one key at a time), so peak memory is two copies of the largest tensor (the
chunk deserialised, then copied into place) and its converted form (2.0x in ``benchmarks/checkpoint_export.py``).
The files are byte-identical to the run's own ``export.hf_dir`` of the same step
(``tests/unit/checkpoint/test_convert.py``).

Before anything is read, every tensor's chunks are checked against the checkpoint's ``.metadata``: a missing or
short ``*.distcp`` file, a missing key or a shape other than the model's is a :class:`CheckpointFormatError`
(``ValueError``) naming the file or the key.

A LoRA run's checkpoint holds only the adapters: ``--adapter`` writes them as ``export.adapter_dir`` does (the LoRA
settings and the base's name from the run's ``resolved_config.yaml``), byte for byte. Not yet: ``--merge`` (the
merged model, which needs the base streamed from ``model.checkpoint``), and checkpoints written with ``ep > 1``,
whose routed-expert tensors hold one EP rank's experts only (refused, naming the key and the numbers; see
``docs/checkpoints.md``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, load

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.export import ExportReport, ExportSource, export_hf_checkpoint
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
            load({key: t}, storage_reader=FileSystemReader(str(self.path)), no_dist=True)
        except Exception as err:  # noqa: BLE001 - name the checkpoint and the key
            raise CheckpointFormatError(f"{self.path}: reading {key} failed ({type(err).__name__}: {err})") from None
        return t


def _config(ckpt: Path):
    from dsv4.config import DSV4Config

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
    return DSV4Config.from_dict(config)


def export_run(run_dir: str | os.PathLike, out: str, *, step: int | None = None, dtype: str = "bfloat16",
               progress: bool = False, max_shard_bytes: int | None = None, adapter: bool = False) -> ExportReport:
    """Write the HF-format export of ``run_dir``'s checkpoint to ``out`` (see the module docstring); ``adapter``:
    a LoRA run's PEFT adapter instead (what ``export.adapter_dir`` writes)."""
    from dsv4.model import DSV4ForCausalLM
    from dsv4.peft.lora import is_adapter_name

    ckpt = find_checkpoint(run_dir, step)
    config = _config(ckpt)
    tensors = DCPTensors(ckpt)
    if any(is_adapter_name(k) for k in tensors.entries if k.startswith(MODEL_PREFIX)):
        if not adapter:
            raise ValueError(f"{ckpt}: a LoRA run's checkpoint (adapters only): pass --adapter for the PEFT adapter "
                             "(--merge, the merged model, is not supported yet: use export.merge in the run)")
        return _export_adapter(ckpt, out, config, tensors)
    if adapter:
        raise ValueError(f"{ckpt}: --adapter needs a LoRA run's checkpoint; this one holds the full model")
    with torch.device("meta"):
        model = DSV4ForCausalLM(config)
    names = list(model.state_dict())
    missing = [MODEL_PREFIX + n for n in names if MODEL_PREFIX + n not in tensors.entries]
    if missing:
        raise CheckpointFormatError(f"{ckpt}: {len(missing)} model tensors missing from the checkpoint, e.g. "
                                    f"{missing[:3]}")
    state = model.state_dict()
    for name in names:
        key, want = MODEL_PREFIX + name, tuple(state[name].shape)
        got = tensors.shape(key)
        if got != want:
            if K.is_stacked_expert(name) and got[1:] == want[1:] and got[0] < want[0]:
                raise ValueError(f"{ckpt}: {key} holds {got[0]} of the {want[0]} routed experts: the checkpoint was "
                                 "written with ep > 1, where each EP rank's experts share one name, so the others' "
                                 "are not in it; export with export.hf_dir in the run instead")
            raise CheckpointFormatError(f"{ckpt}: {key} has shape {list(got)}, the model's {list(want)}")
    tensors.check_files([MODEL_PREFIX + n for n in names])

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(names), unit="tensor", desc=f"export {ckpt.name}")

    def fetch(key: str) -> torch.Tensor:
        t = tensors.read(key)
        if bar is not None:
            bar.update(1)
        return t

    sources = [ExportSource(n, tensors.shape(MODEL_PREFIX + n), tensors.dtype(MODEL_PREFIX + n).is_floating_point,
                            lambda k=MODEL_PREFIX + n: fetch(k)) for n in names]
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    try:
        return export_hf_checkpoint(model, out, dtype=dtype, config=config, sources=sources, **kwargs)
    finally:
        if bar is not None:
            bar.close()


def _export_adapter(ckpt: Path, out: str, config, tensors: DCPTensors) -> ExportReport:
    """A LoRA run's adapters (all in the checkpoint, small) -> ``export.adapter_dir``'s files. The LoRA settings
    and the base's name come from the run's ``resolved_config.yaml``."""
    from omegaconf import OmegaConf

    from dsv4.model import DSV4ForCausalLM
    from dsv4.peft.apply import apply_lora
    from dsv4.peft.lora import LoRAGroupedExperts, LoRALinear
    from dsv4.peft.peft_format import PREFIX, release_to_transformers, write_peft_adapter
    from dsv4.training.schema import lora_config

    resolved = ckpt.parent.parent / "resolved_config.yaml"
    if not resolved.is_file():
        raise CheckpointFormatError(f"{resolved}: missing (the run's peft settings are read there)")
    cfg = OmegaConf.load(resolved)
    lora = lora_config(cfg.peft)
    if lora is None:
        raise CheckpointFormatError(f"{resolved}: peft is none, but {ckpt} holds LoRA adapters")
    with torch.device("meta"):
        model = DSV4ForCausalLM(config)
        apply_lora(model, lora)
    wanted = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoRALinear) and module.rank:
            wanted.update({f"{module_name}.lora_{ab}": getattr(module, f"lora_{ab}") for ab in "AB"})
        elif isinstance(module, LoRAGroupedExperts) and module.rank:
            wanted.update({f"{module_name}.{n}_lora_{ab}": getattr(module, f"{n}_lora_{ab}")
                           for n in module.WEIGHTS for ab in "AB"})
    for name, param in wanted.items():
        key = MODEL_PREFIX + name
        if key not in tensors.entries:
            raise CheckpointFormatError(f"{ckpt}: {key} missing (peft.targets of {resolved} adapt it)")
        got, want = tensors.shape(key), tuple(param.shape)
        if got != want:
            if ".experts." in name and got[1:] == want[1:] and got[0] < want[0]:
                raise ValueError(f"{ckpt}: {key} holds {got[0]} of the {want[0]} routed experts: the checkpoint was "
                                 "written with ep > 1, where each EP rank's experts share one name, so the others' "
                                 "are not in it; export with export.adapter_dir in the run instead")
            raise CheckpointFormatError(f"{ckpt}: {key} has shape {list(got)}, the model's {list(want)}")
    tensors.check_files([MODEL_PREFIX + n for n in wanted])
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
    write_peft_adapter(adapters, out, lora, cfg.model.get("checkpoint") or None, "transformers")
    report = ExportReport(path=out, files=["adapter_model.safetensors", "adapter_config.json"])
    report.num_tensors = len(adapters)
    report.total_size = sum(t.numel() * t.element_size() for t in adapters.values())
    return report
