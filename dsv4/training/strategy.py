"""`DSV4Strategy`: Lightning's ``ModelParallelStrategy`` with (dp, cp) meshes, an EP view and CP batch cutting.

* ``setup_environment``: form the process group (gloo on CPU, NCCL on GPU) within ``startup_timeout`` seconds, on
  a store scoped to this start under torchrun's restarts (:func:`dsv4.training.elastic.form_process_group`),
  validate ``dp x cp == world`` and ``ep | dp x cp``, build the meshes (:mod:`dsv4.parallel.mesh`) and publish
  :attr:`DSV4Strategy.parallel`, a :class:`ParallelState` (this rank's ``CPContext``, groups, ranks and sizes):
  the one typed channel through which the LightningModule learns about parallelism.
* Sampling is by the dp mesh only (``distributed_sampler_kwargs``): the ranks of a CP group read the same rows.
* Batches (:class:`~dsv4.batch.TokenBatch`) move to the device through their ``to``; the module cuts this CP
  rank's slice with :attr:`ParallelState.cp_rank` / ``cp_size``.
* ``shard_engram_tables(model)`` (called by the module's ``configure_model`` before a checkpoint is loaded, so each
  rank reads only its rows, and by the DSpark target's ``before_load``): DeepSeek-V4.1's Engram tables row-sharded
  over the ``dp_cp`` mesh (:mod:`dsv4.parallel.engram_table`); with ``engram_tables="host"``
  (``trainer.engram_tables=host``) the frozen tables are held in host memory: the model's move to the device and
  FSDP leave their rows there, a lookup copies the asked rows to the device.
* ``parallelize(model)`` (called by the module's ``configure_model``): expert parallelism and the MoE dispatcher
  (:func:`dsv4.parallel.expert_shard.apply_expert_parallel`), then FSDP2 with summed gradients
  (:func:`dsv4.parallel.wrap.apply_fsdp`) in ``compute_dtype`` (FSDP2 mixed precision: fp32 master weights,
  optimizer state and gradient reduction; :func:`~dsv4.training.options.trainer.compute_dtype_for` maps the trainer's precision).
  ``offload`` (``trainer.offload=optimizer``): FSDP2's CPU offload policy, the shards, gradients and optimizer state
  in host memory; FSDP places parameters and buffers itself, so the model is not moved to the device afterwards.
* Pipeline stages (``pp > 1``): the meshes are ("pp", "dp", "cp"), ``parallelize`` builds this rank's stages with
  FSDP2 inside them (:attr:`DSV4Strategy.pipeline`, :mod:`dsv4.training.pipeline_step`) instead of sharding the whole
  model, and a checkpoint holds each rank's stages' tensors only (the other stages' blocks are never trained here);
  a step is one batch of every microbatch (the layout records ``micro_batch_size x microbatches`` rows and no
  accumulation), and the optimizer step count moves between Lightning's automatic and manual records on a resume
  across ``pp`` (:func:`~dsv4.training.resume.carry_optimizer_steps`).
* Checkpoints: distributed (DCP) save/load of model and optimizer; loop, scheduler, data position, RNG and the
  run's :class:`~dsv4.training.resume.RunLayout` travel in ``meta.pt``. Routed experts sliced over EP ranks are
  saved at their global shapes (:mod:`dsv4.parallel.expert_state`), so every expert is in the checkpoint once and a
  checkpoint loads under any layout; the loop's micro-batch count is rewritten for this run's layout
  (:func:`~dsv4.training.resume.adapt_to_layout`). A LoRA model (:mod:`dsv4.peft`) saves and loads only its
  adapters (and the optimizer, which holds nothing else): the frozen base comes from the model's own source (init
  seed or ``model.checkpoint``).
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy

from dsv4.parallel.cp import CPContext
from dsv4.distributed import ProcessGroup
from dsv4.parallel.engram_table import engram_tables, shard_engram_tables
from dsv4.parallel.expert_shard import apply_expert_parallel
from dsv4.parallel.expert_state import ExpertStateLayout
from dsv4.parallel.mesh import Meshes, ParallelDims, build_meshes
from dsv4.parallel.wrap import apply_fsdp
from dsv4.peft.apply import is_lora_model
from dsv4.peft.lora import is_adapter_name
from dsv4.training.checkpoint_writer import CheckpointWriter
from dsv4.training.elastic import form_process_group
from dsv4.training.options.trainer import ENGRAM_TABLES, offload_mode
from dsv4.training.resume import LAYOUT_KEY, RunLayout, adapt_to_layout, carry_optimizer_steps
from dsv4.training.spec import RunSpec

if TYPE_CHECKING:
    from dsv4.training.pipeline_step import PipelineRun

log = logging.getLogger("dsv4")


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the run. ``cp``: the CP context handed to the model (None without CP);
    ``loss_group``: the dp x cp ranks the token loss is reduced over (None = this rank only); ``dp_group``: the
    data-parallel replicas (None when dp = 1); ``ep_rank`` / ``ep_size``: this rank's expert-parallel slice."""

    cp: CPContext | None = None
    cp_rank: int = 0
    cp_size: int = 1
    dp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    loss_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None


class DSV4Strategy(ModelParallelStrategy):
    """Args: ``cp``, ``dp`` (-1 = world // cp), ``ep``, ``dispatcher`` name, ``compute_dtype``, ``cp_balance``
    (:class:`~dsv4.parallel.cp.layout.CPLayout`), ``async_save``, ``offload`` (``none`` | ``optimizer``),
    ``engram_tables`` (``device`` | ``host``: where V4.1's frozen Engram tables are held),
    ``micro_batch_size`` (rows per replica per forward: recorded in checkpoints with the layout),
    ``startup_timeout`` (seconds the process group may take to form); the rest goes to ``ModelParallelStrategy``
    (``process_group_backend``, ``timeout``: the group's timeout once formed)."""

    def __init__(self, cp: int = 1, dp: int = -1, ep: int = 1, dispatcher: str = "local",
                 compute_dtype: torch.dtype = torch.float32, cp_balance: str = "none", async_save: bool = False,
                 offload: str = "none", micro_batch_size: int = 1, startup_timeout: float = 300.0,
                 engram_tables: str = "device", pp: int = 1, pp_schedule: str = "1f1b", pp_virtual: int = 1,
                 seq_len: int | None = None, **kwargs: Any) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)
        self.startup_timeout = timedelta(seconds=startup_timeout)
        self.cp_size, self._dp, self.ep_size = cp, dp, ep
        self.cp_balance = cp_balance
        self.dispatcher = dispatcher
        self.compute_dtype = compute_dtype
        self.offload = offload_mode(offload)
        if engram_tables not in ENGRAM_TABLES:
            raise ValueError(f"`trainer.engram_tables`={engram_tables!r} must be one of {', '.join(ENGRAM_TABLES)}")
        self.engram_tables = engram_tables
        self.meshes: Meshes | None = None
        self.parallel = ParallelState()
        self._expert_layout: ExpertStateLayout | None | bool = False  # False: not looked at yet
        self.async_save = async_save
        self.micro_batch_size = micro_batch_size
        self._writer: CheckpointWriter | None = None
        self.pp_size, self.pp_schedule, self.pp_virtual, self.seq_len = pp, pp_schedule, pp_virtual, seq_len
        self.microbatches = 1  # per step under pipeline stages (the run's accumulation; set by the recipe)
        self.pipeline: PipelineRun | None = None  # this rank's stages under pp > 1 (set by parallelize)

    @classmethod
    def from_spec(cls, spec: RunSpec, **kwargs: Any) -> "DSV4Strategy":
        """The strategy of a resolved run: its parallel dims, CP layout, dispatcher and compute dtype."""
        p = spec.parallel
        return cls(cp=p.cp, dp=p.dp, ep=p.ep, cp_balance=p.cp_balance, dispatcher=spec.dispatcher,
                   compute_dtype=spec.compute_dtype, async_save=spec.checkpoint.async_save,
                   offload=spec.offload, micro_batch_size=spec.micro_batch_size,
                   startup_timeout=spec.startup_timeout_s, engram_tables=spec.engram_tables, pp=p.pp,
                   pp_schedule=p.pp_schedule, pp_virtual=p.pp_virtual, seq_len=spec.seq_len, **kwargs)

    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # skip the parent's hard-coded ("data_parallel", "tensor_parallel") mesh
        self._setup_distributed()
        # one process per rank on a CPU: share the cores instead of oversubscribing them, unless OMP_NUM_THREADS says
        # how many threads a process gets (as torchrun sets it)
        if self.root_device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(self.num_processes, 1)))
        dims = ParallelDims(world_size=self.world_size, cp=self.cp_size, dp=self._dp, ep=self.ep_size,
                            pp=self.pp_size).resolved()
        self.meshes = build_meshes(dims, self.root_device)
        self._device_mesh = self.meshes.world
        self.lightning_module._device_mesh = self._device_mesh
        self.parallel = ParallelState(
            cp=CPContext(self.meshes.cp.get_group(), balance=self.cp_balance) if dims.cp > 1 else None,
            cp_rank=self.meshes.cp.get_local_rank(),
            cp_size=dims.cp,
            dp_size=dims.dp,
            ep_rank=self.meshes.ep.get_local_rank(),
            ep_size=dims.ep,
            loss_group=self.meshes.dp_cp.get_group(),
            dp_group=self.meshes.dp.get_group() if dims.dp > 1 else None,
        )

    def _setup_distributed(self) -> None:
        """Form the default process group (:func:`~dsv4.training.elastic.form_process_group`), then Lightning's
        own steps, whose init finds the group formed and leaves it."""
        self.set_world_ranks()
        if not torch.distributed.is_initialized():
            env, backend = self.cluster_environment, self._get_process_group_backend()
            form_process_group(backend, env.main_address, env.main_port, self.global_rank, self.world_size,
                               startup_timeout=self.startup_timeout, timeout=self._timeout,
                               device=self.root_device if self.root_device.type != "cpu" else None)
            if backend == "nccl":  # as Lightning's own init does: torch warns about an NCCL group left at exit
                from lightning.fabric.utilities.distributed import _destroy_dist_connection

                atexit.register(_destroy_dist_connection)
        super()._setup_distributed()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.meshes.dp
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def shard_engram_tables(self, model: torch.nn.Module) -> int:
        """Row-shard ``model``'s Engram tables over every rank (the ``dp_cp`` mesh), held in host memory under
        ``engram_tables="host"`` (logged once, with this rank's table bytes); returns how many were sharded."""
        count = shard_engram_tables(model, self.meshes.dp_cp, on_host=self.engram_tables == "host")
        tables = [table for _, table in engram_tables(model) if table.held_on_host]
        if tables and self.global_rank == 0:
            held = sum(_local_bytes(t) for table in tables for t in (table.weight, getattr(table, "scale", None))
                       if t is not None)
            log.info("Engram tables in host memory (trainer.engram_tables=host): %d tables, %.1f MiB of rows on rank "
                     "0; each lookup copies the rows it reads to the device", len(tables), held / 2**20)
        return count

    @property
    def pipelined(self) -> bool:
        """The run is split into pipeline stages (``pp > 1`` or virtual stages)."""
        return self.pp_size > 1 or self.pp_virtual > 1

    def parallelize(self, model: torch.nn.Module) -> None:
        """Expert parallelism (when ``ep > 1`` or an EP dispatcher is chosen), then FSDP2; with ``pp > 1`` this
        rank's pipeline stages, FSDP2 inside them (:attr:`pipeline`, :mod:`dsv4.training.pipeline_step`)."""
        if self.ep_size > 1 or self.dispatcher != "local":
            apply_expert_parallel(model, self.dispatcher, self.meshes.ep.get_group(), self.root_device.type)
        if self.pipelined:
            from dsv4.training.pipeline_step import build_pipeline_run

            self.pipeline = build_pipeline_run(
                model, self.meshes, pp=self.pp_size, virtual=self.pp_virtual, schedule=self.pp_schedule,
                seq_len=self.seq_len, micro_batch_size=self.micro_batch_size, microbatches=self.microbatches,
                compute_dtype=self.compute_dtype,
                device=self.root_device, cp=self.parallel.cp)
            return
        apply_fsdp(model, self.meshes, compute_dtype=self.compute_dtype, offload=self.offload == "optimizer",
                   engram_on_host=self.engram_tables == "host")

    def model_to_device(self) -> None:
        """Lightning's move of the whole model to the device, except under host offload: ``fully_shard`` has put
        the buffers on the device and the shards in host memory, and a ``.to(device)`` would move the shards."""
        if self.offload == "none":
            super().model_to_device()

    # ------------------------------------------------------------------ distributed checkpoints
    @property
    def layout(self) -> RunLayout:
        """This run's layout (recorded in every checkpoint; a resume adapts the saved loop state to it)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        accumulation = int(trainer.accumulate_grad_batches) if trainer is not None else 1
        p = self.parallel
        if self.pipelined:  # one batch of every microbatch per step (module docstring)
            return RunLayout(dp=p.dp_size, cp=p.cp_size, ep=p.ep_size,
                             micro_batch_size=self.micro_batch_size * self.microbatches, accumulation=1)
        return RunLayout(dp=p.dp_size, cp=p.cp_size, ep=p.ep_size, micro_batch_size=self.micro_batch_size,
                         accumulation=accumulation)

    def _expert_state(self) -> ExpertStateLayout | None:
        """The EP-sliced expert tensors of the model (None without expert parallelism): saved and loaded at their
        global shapes (:mod:`dsv4.parallel.expert_state`)."""
        if self._expert_layout is False:
            self._expert_layout = ExpertStateLayout.of(self.model, self.meshes.experts)
        return self._expert_layout

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's DCP state: FSDP shards, experts at global shapes; a LoRA model's adapters only. Offloaded
        to the host for a synchronous save; an asynchronous one leaves the copy to DCP's staging (one copy)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=not self.async_save))
        if self.model is not None and is_lora_model(self.model):
            state = {k: v for k, v in state.items() if is_adapter_name(k)}
        state = self._own(state)
        layout = self._expert_state()
        return layout.model_state(state) if layout is not None else state

    def _own(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` less what this rank does not hold under pipeline stages (the other stages' blocks, as built and
        never trained here); all of it otherwise."""
        if self.pipeline is None:
            return state
        name = next(n for n, m in self.model.named_modules() if m is self.pipeline.model)  # the causal LM's
        prefix = f"{name}." if name else ""
        return {k: v for k, v in state.items() if k.startswith(prefix) and self.pipeline.owns(k[len(prefix):])}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        state = get_optimizer_state_dict(self.model, optimizer,
                                         options=StateDictOptions(cpu_offload=not self.async_save))
        layout = self._expert_state()
        return layout.optimizer_state(state) if layout is not None else state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Write the model and optimizer shards (DCP) and ``meta.pt`` atomically to ``filepath``, in the background
        with ``async_save`` (:class:`~dsv4.training.checkpoint_writer.CheckpointWriter`)."""
        if storage_options is not None:
            raise TypeError("DSV4Strategy.save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        checkpoint[LAYOUT_KEY] = self.layout.as_dict()
        state = {"state_dict": checkpoint.pop("state_dict"),
                 **{f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}}
        self.checkpoint_writer.save(state, checkpoint if self.global_rank == 0 else None, path)

    @property
    def checkpoint_writer(self) -> CheckpointWriter:
        if self._writer is None:
            group = None
            if self.async_save and torch.distributed.is_initialized():
                group = torch.distributed.new_group(backend="gloo")  # DCP's background coordination only
            self._writer = CheckpointWriter(self.global_rank, self.barrier, self.async_save, group)
        return self._writer

    def finish_checkpoint(self) -> None:
        """Wait for an asynchronous save in flight and commit it (every rank)."""
        if self._writer is not None:
            self._writer.finish()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model (a LoRA model: its adapters; the frozen base comes from its own source) and the
        optimizers from a DCP checkpoint directory, in place, under this run's layout (DCP reshards: a checkpoint
        written with another dp, cp or ep loads). Every tensor's saved shape is checked against the model's first
        (a ``ValueError`` naming the key and both shapes), and the saved loop state is checked and adapted to this
        run's layout (:func:`~dsv4.training.resume.adapt_to_layout`) before any tensor is read. Returns the metadata
        (``meta.pt``) for the loops."""
        from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_load
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)

        self.finish_checkpoint()
        path = Path(self.broadcast(checkpoint_path))
        lora = is_lora_model(self.model)
        if not (path / _METADATA_FILENAME).is_file() or not (path / ".metadata").is_file():
            hint = " (start from a PEFT adapter with peft.adapter=DIR)" if lora else ""
            raise ValueError(f"`checkpoint.resume`={str(path)!r} is not a complete distributed checkpoint directory "
                             f"(it needs {_METADATA_FILENAME} and .metadata){hint}")
        meta = torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
        adapt_to_layout(meta, self.layout, source=str(path))
        carry_optimizer_steps(meta, manual=self.pipelined)
        layout = self._expert_state()
        saved_shapes = _saved_shapes(path)

        model_state = self._own(get_model_state_dict(self.model))
        if lora:
            model_state = {k: v for k, v in model_state.items() if is_adapter_name(k)}
        on_disk = {"state_dict": layout.model_state(model_state) if layout is not None else model_state}
        _check_shapes(path, on_disk, saved_shapes)
        _distributed_checkpoint_load(on_disk, path)  # fills model_state's tensors in place (same storage)
        set_model_state_dict(self.model, model_state,
                             options=StateDictOptions(strict=not lora and self.pipeline is None))
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = get_optimizer_state_dict(self.model, optimizer)
            on_disk = {key: layout.optimizer_state(optim_state) if layout is not None else optim_state}
            _check_shapes(path, on_disk, saved_shapes)
            _distributed_checkpoint_load(on_disk, path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state,
                                     options=StateDictOptions(cpu_offload=True))
        return meta


def _local_bytes(t: torch.Tensor) -> int:
    """The bytes of this rank's part of ``t`` (a ``DTensor`` 's local tensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The global shape of every tensor in the DCP checkpoint at ``path`` (from its ``.metadata``, read as the
    converter reads it: an unreadable file is a ``CheckpointFormatError`` naming it)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dsv4.checkpoint.convert import DCPTensors

    entries = DCPTensors(path).entries
    return {k: tuple(v.size) for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}


def _check_shapes(path: Path, state: dict[str, Any], saved: dict[str, tuple[int, ...]], prefix: str = "") -> None:
    """Every tensor of the nested ``state`` that the checkpoint holds has the saved global shape (DCP would fill
    only the overlap of two shapes, silently)."""
    for key, value in state.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            _check_shapes(path, value, saved, name)
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and name in saved:
            if tuple(value.shape) != saved[name]:
                raise ValueError(f"{path}: {name} is saved with shape {list(saved[name])}, this run's model has "
                                 f"{list(value.shape)}; the checkpoint was written by a different model")
