"""Parallel layout: data parallel (dp) x context parallel (cp), with expert parallelism (ep) borrowing ranks.

World ranks are laid out row-major over ``(dp, cp)``: the ranks of one CP group are consecutive, e.g. dp=2, cp=2
gives CP groups [0, 1], [2, 3] and DP groups [0, 2], [1, 3]. Expert parallelism does not multiply the world: the
``dp * cp`` ranks are re-grouped as ``(edp, ep)`` with ``ep`` innermost (consecutive ranks form an EP group that
holds all experts between them; ``edp = world / ep`` replicas of each expert slice).

``ParallelDims.validate`` raises ``ValueError`` naming the sizes before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions; ``dp = -1`` means ``world_size // (pp x cp)``; ``pp``: pipeline stages'
    ranks (the pipeline outermost: the ``dp x cp`` ranks of a stage are consecutive; dsv4.plan.stages)."""

    world_size: int
    cp: int = 1
    dp: int = -1
    ep: int = 1
    pp: int = 1

    def resolved(self) -> "ParallelDims":
        """Validate and return the dims with ``dp`` filled in."""
        return ParallelDims(world_size=self.world_size, cp=self.cp, dp=self.validate(), ep=self.ep, pp=self.pp)

    def validate(self, n_routed_experts: int | None = None) -> int:
        """Raise ValueError naming the sizes that do not fit; return the (derived) dp."""
        for name in ("world_size", "cp", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        ranks = self.cp * self.pp
        what = "`cp`" if self.pp == 1 else f"`pp`={self.pp} x `cp`"
        if self.world_size % ranks:
            raise ValueError(
                f"{what}={self.cp} does not divide the world size {self.world_size} (devices x nodes); "
                f"use a {'cp' if self.pp == 1 else 'pp x cp'} that divides it or set trainer.devices to a multiple "
                f"of {ranks}"
            )
        dp = self.world_size // ranks if self.dp in (-1, 0, None) else self.dp
        if dp * ranks != self.world_size:
            raise ValueError(
                f"`dp`={self.dp} x {what}={self.cp} = {dp * ranks} does not match the world size {self.world_size}; "
                f"set dp={self.world_size // ranks} or dp=-1 (derived)"
            )
        stage = dp * self.cp
        if stage % self.ep:
            raise ValueError(
                f"`ep`={self.ep} must divide dp x cp = {stage} (expert parallelism borrows those ranks)"
            )
        if n_routed_experts is not None and n_routed_experts % self.ep:
            raise ValueError(f"`ep`={self.ep} must divide model.n_routed_experts={n_routed_experts}")
        return dp


@dataclass
class Meshes:
    """The device meshes of a run: ``world`` ("dp", "cp"; with pipeline stages ("pp", "dp", "cp")), ``dp_cp``
    (flattened, for FSDP and the loss: a stage's ranks) and ``experts`` ("edp", "ep")."""

    world: DeviceMesh
    dp_cp: DeviceMesh
    experts: DeviceMesh

    @property
    def dp(self) -> DeviceMesh:
        return self.world["dp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.world["cp"]

    @property
    def ep(self) -> DeviceMesh:
        return self.experts["ep"]

    @property
    def edp(self) -> DeviceMesh:
        return self.experts["edp"]

    @property
    def pp(self) -> DeviceMesh:
        """The pipeline's ranks (a mesh of ``pp > 1`` only)."""
        return self.world["pp"]


def build_meshes(dims: ParallelDims, device: torch.device | str) -> Meshes:
    """Create the meshes (``torch.distributed`` must be initialised with ``dims.world_size`` ranks). With ``pp > 1``
    the pipeline is the outermost dimension: ``world`` is ("pp", "dp", "cp"), and ``dp_cp`` and ``experts`` are this
    rank's stage's (its ``dp x cp`` ranks); :attr:`Meshes.pp` joins the ranks of one (dp, cp) index."""
    dims = dims.resolved()
    device_type = torch.device(device).type
    stage = dims.dp * dims.cp
    if dims.pp == 1:
        world = init_device_mesh(device_type, (dims.dp, dims.cp), mesh_dim_names=("dp", "cp"))
        experts = init_device_mesh(device_type, (stage // dims.ep, dims.ep), mesh_dim_names=("edp", "ep"))
    else:
        world = init_device_mesh(device_type, (dims.pp, dims.dp, dims.cp), mesh_dim_names=("pp", "dp", "cp"))
        experts = init_device_mesh(device_type, (dims.pp, stage // dims.ep, dims.ep),
                                   mesh_dim_names=("pp", "edp", "ep"))["edp", "ep"]
    dp_cp = world["dp", "cp"]._flatten("dp_cp")
    return Meshes(world=world, dp_cp=dp_cp, experts=experts)
