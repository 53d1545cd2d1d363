"""`DSV4Strategy`: Lightning's ``ModelParallelStrategy`` with (dp, cp) meshes, an EP view and CP batch sharding.

* ``setup_environment``: initialise the process group (gloo on CPU, NCCL on GPU), validate ``dp x cp == world``
  and ``ep | dp x cp``, build the meshes (:mod:`dsv4.parallel.mesh`) and the ``CPContext`` of this rank's CP group.
* Sampling is by the dp mesh only (``distributed_sampler_kwargs``): the ranks of a CP group read the same rows.
* ``batch_to_device``: move the batch, record its token statistics, and shard it with the DSV4 sharder bound
  (``functools.partial``) to ``dsv4_cp_local_seq_multiple(config)`` and ``sync_packed_length = dispatcher needs
  uniform token counts``.
* ``parallelize(model)`` (called by the module's ``configure_model``): expert parallelism (when ``ep > 1``), the
  MoE dispatcher, then FSDP2 with summed gradients (:mod:`dsv4.parallel.wrap`).
* Checkpoints: the parent's distributed (DCP) save/load of model and optimizer; loop, scheduler, data position and
  RNG travel in ``meta.pt``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy

from dsv4.cp import CPContext, _repad_dsv4_packed_batch, make_dsv4_contiguous_shard_cp_batch_and_ctx
from dsv4.parallel.mesh import Meshes, ParallelDims, build_meshes
from dsv4.parallel.wrap import apply_fsdp
from dsv4.training.step import ParallelConfig, get_batch


def batch_token_stats(batch: dict) -> torch.Tensor:
    """``[rows, slots, real, labelled, pack padding, alignment padding]`` of a caller-coordinate packed batch."""
    ids = batch["input_ids"]
    rows, width = ids.shape[0], ids.shape[1]
    labels = int((batch["labels"] != -100).sum())
    if "seq_lens" in batch:
        real_lens = batch["seq_lens"].clamp_min(0)
        padded = batch.get("seq_lens_padded", batch["seq_lens"]).clamp_min(0)
        real, spans = int(real_lens.sum()), int(torch.maximum(padded, real_lens).sum())
    else:
        mask = batch.get("attention_mask")
        real = int(mask.sum()) if mask is not None else rows * width
        spans = real
    slots = rows * width
    return torch.tensor([rows, slots, real, labels, slots - spans, spans - real], dtype=torch.long)


class DSV4Strategy(ModelParallelStrategy):
    """Args: ``cp``, ``dp`` (-1 = world // cp), ``ep``, ``dispatcher`` name, ``pad_multiple`` (the config's LCM),
    ``sync_packed_length``; the rest goes to ``ModelParallelStrategy`` (``process_group_backend``, ``timeout``)."""

    def __init__(
        self,
        cp: int = 1,
        dp: int = -1,
        ep: int = 1,
        dispatcher: str = "local",
        pad_multiple: int = 1,
        sync_packed_length: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)
        self.cp_size, self._dp, self.ep_size = cp, dp, ep
        self.dispatcher = dispatcher
        self.pad_multiple = max(int(pad_multiple), 1)
        self.shard_batch = functools.partial(
            make_dsv4_contiguous_shard_cp_batch_and_ctx, pad_multiple=pad_multiple,
            sync_packed_length=sync_packed_length,
        )
        self.meshes: Meshes | None = None
        self.cp_context: CPContext | None = None
        self.loss_group = None
        self.dp_group = None

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # skip the parent's hard-coded ("data_parallel", "tensor_parallel") mesh
        self._setup_distributed()
        if self.root_device.type == "cpu":  # one process per rank: share the cores instead of oversubscribing them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(self.num_processes, 1)))
        dims = ParallelDims(world_size=self.world_size, cp=self.cp_size, dp=self._dp, ep=self.ep_size)
        self.meshes = build_meshes(dims, self.root_device)
        self._device_mesh = self.meshes.world
        self.lightning_module._device_mesh = self._device_mesh
        self.cp_context = CPContext(self.meshes.cp.get_group()) if self.cp_size > 1 else None
        self.loss_group = self.meshes.dp_cp.get_group()
        self.dp_group = self.meshes.dp.get_group() if self.dp_size > 1 else None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.meshes.dp
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def parallelize(self, model: torch.nn.Module) -> None:
        if self.ep_size > 1 or self.dispatcher != "local":
            from dsv4.parallel.dispatch import build_dispatcher
            from dsv4.parallel.expert_shard import shard_experts
            from dsv4.model.moe import set_dispatcher

            ep_group = self.meshes.ep.get_group()
            if self.ep_size > 1:
                shard_experts(model, ep_group)
            set_dispatcher(model, build_dispatcher(self.dispatcher, ep_group=ep_group))
        apply_fsdp(model, self.meshes)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        stats = batch_token_stats(batch)
        mesh = self.meshes.cp if self.meshes is not None and self.cp_size > 1 else None
        if mesh is None and "seq_lens" in batch:
            # CP 1 keeps the native THD route, but the model still needs document ids, document-local positions of
            # the alignment pad slots and the padding mask: the same repad, with one rank (a no-op on the layout of
            # rows the packer already aligned; it also refuses rows that would lose a labelled token).
            _repad_dsv4_packed_batch(
                batch, cp_size=1, pad_multiple=self.pad_multiple, padding_token_id=0,
                sync_packed_length=self.shard_batch.keywords["sync_packed_length"],
            )
        local, _ = get_batch(batch, ParallelConfig(cp_mesh=mesh, shard_batch=self.shard_batch))
        local["_step_stats"] = stats
        return local
