"""The recipe's training step in pipeline stages (``pp > 1``): :class:`PipelineRun`, built by the strategy from this
rank's stages (:mod:`dsv4.parallel.pipeline`) and driven by the module once per optimizer step.

* **Stages.** The model is built whole on every rank (the recipes' model set-up, checkpoint loading included), its
  routed experts sharded over the stage's EP group, then this rank's stages (:func:`~dsv4.parallel.pipeline.
  stage_layers` split, ``stage_indices`` placement) are sharded with FSDP2 over the stage's ``dp x cp`` ranks
  (:func:`~dsv4.parallel.pipeline.shard_stages`) and wrapped in ``torch.distributed.pipelining``'s
  ``PipelineStage`` on the pipeline group; the blocks of other stages stay as built and are never run, trained or
  saved by this rank.
* **A step** is one batch of ``microbatches x micro_batch_size`` rows per data-parallel replica (the run's gradient
  accumulation: every rank of a pipeline reads the same rows, its dp index's), cut for the rank's CP index, and one
  schedule step over the microbatches (:func:`~dsv4.parallel.pipeline.build_schedule`, ``pp_schedule``). The loss is
  each microbatch's loss sum over the step's label count (reduced over the stage's ranks, known before the step), so
  the gradients are those of the token mean over the global batch, as without stages; FSDP sums them over the stage's
  ranks after the last microbatch, and the MTP depths' embedding, held by the first and the last stage, gets the sum
  of both copies' gradients (:func:`~dsv4.parallel.pipeline.reduce_embedding_grads`).
* **The step's loss** (``train/loss``) is the last stage's microbatch losses summed over its ranks, then given to
  every rank of the pipeline (the logging rank 0 holds the first stage).
* **Clipping**: :func:`~dsv4.parallel.pipeline.clip_pipeline_grad_norm_`, the global norm over every stage.
* **Validation** (:meth:`PipelineRun.evaluate`): the held-out rows forward only through the schedule, in groups of a
  step's microbatches (the last filled with rows of padding), the token-mean loss as without stages.
* **Checkpoints** hold each rank's stages' tensors under the model's names (:meth:`PipelineRun.owns`): a checkpoint
  written under one ``pp`` resumes under another, ``pp=1`` included, and ``python -m dsv4.checkpoint export``
  converts it as any run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dsv4.batch import TokenBatch


@dataclass
class PipelineRun:
    """This rank's stages of a run in pipeline stages and how a step drives them (module docstring). ``modules``: the
    :class:`~dsv4.parallel.pipeline.DSV4PipelineStage` views of the model this rank holds; ``engine``: their
    ``PipelineStage`` wrappers; ``groups``: ``pp`` (the pipeline), ``stage`` (the stage's ``dp x cp`` ranks: FSDP,
    the loss), ``pair`` (the MTP embedding's two stages of this (dp, cp) index; None when it has no second copy or this
    rank holds neither)."""

    model: nn.Module
    modules: list[nn.Module]
    engine: list[Any]
    schedule: str
    micro_batch_size: int
    microbatches: int  # per training step
    groups: dict[str, Any]
    _names: set[str] | None = None

    @property
    def first(self) -> bool:
        return any(m.span.first for m in self.modules)

    @property
    def last(self) -> bool:
        return any(m.span.last for m in self.modules)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages, each once: what its optimizer steps."""
        return list({id(p): p for m in self.modules for p in m.parameters()}.values())

    def owns(self, name: str) -> bool:
        """Whether the model's tensor ``name`` (a parameter or buffer) belongs to this rank's stages."""
        if self._names is None:
            held = {id(t) for m in self.modules for t in [*m.parameters(), *m.buffers()]}
            self._names = {n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
                           if id(t) in held}
        return name in self._names

    def step(self, batch: TokenBatch, label_count: int) -> torch.Tensor:
        """One schedule step over ``batch`` (this rank's CP cut of the step's rows, ``microbatches x
        micro_batch_size`` of them) with the step's global ``label_count``; then the embedding's two copies summed.
        Returns this rank's part of the step's loss sum over ``label_count`` (0 off the last stage)."""
        from dsv4.parallel.pipeline import build_schedule, pipeline_loss, reduce_embedding_grads

        rows = batch.num_rows
        if rows % self.micro_batch_size:
            raise ValueError(f"pipeline step: {rows} rows are not whole microbatches of micro_batch_size="
                             f"{self.micro_batch_size}")
        # a schedule per step: its loss divides by this step's label count
        schedule = build_schedule(self.engine, rows // self.micro_batch_size, self.schedule, pipeline_loss(label_count))
        losses: list[torch.Tensor] = []
        args, target = self._inputs(batch, losses)
        schedule.step(*args, **target)
        if self.groups.get("pair") is not None:
            reduce_embedding_grads(self.model, self.groups["pair"])
        device = batch.input_ids.device
        return torch.stack(losses).sum().to(torch.float32) if losses else torch.zeros((), device=device)

    def _inputs(self, batch: TokenBatch, losses: list) -> tuple[tuple, dict[str, Any]]:
        """The schedule's arguments for ``batch`` on this rank: the rows' tensors where it holds the first stage, the
        (unread) target and the list collecting the microbatches' losses where it holds the last."""
        args = (batch.input_ids, batch.positions, batch.seq_ids, batch.padding, batch.labels) if self.first else ()
        target = {"target": torch.zeros(batch.num_rows, device=batch.input_ids.device), "losses": losses} \
            if self.last else {}
        return args, target

    @torch.no_grad()
    def evaluate(self, batches: Any, cp_rank: int, cp_size: int, shard_multiple: int, device: Any,
                 limit: int | None = None) -> tuple[float, int]:
        """``(token-mean loss, supervised tokens)`` of ``batches`` (this dp replica's held-out micro-batches, every
        rank of a pipeline the same; the first ``limit``), forward only through the schedule (its ``eval``), as
        :func:`~dsv4.training.validation.evaluate_token_loss` computes it without stages: the rows go through in
        groups of a training step's microbatches (the schedule's shape), the last group filled with rows of padding,
        which hold no label."""
        import itertools

        from dsv4.parallel.pipeline import build_schedule, pipeline_loss

        rows = [b.select(slice(i, i + 1)) for b in itertools.islice(batches, limit) for i in range(b.num_rows)]
        group = self.micro_batch_size * self.microbatches
        if rows and len(rows) % group:
            pad = rows[0]
            blank = TokenBatch(torch.zeros_like(pad.input_ids), torch.full_like(pad.labels, -100),
                               torch.zeros_like(pad.seq_ids), torch.zeros_like(pad.positions))
            rows += [blank] * (group - len(rows) % group)
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for start in range(0, len(rows), group):
            local = TokenBatch.stack(rows[start:start + group]).to(device).cut(cp_rank, cp_size, shard_multiple)
            schedule = build_schedule(self.engine, self.microbatches, self.schedule, pipeline_loss(1))
            losses: list[torch.Tensor] = []
            args, target = self._inputs(local, losses)
            schedule.eval(*args, **target)
            loss = torch.stack(losses).sum().to(torch.float64) if losses else torch.zeros((), dtype=torch.float64,
                                                                                          device=device)
            sums += torch.stack([loss, local.label_count().to(torch.float64) if self.last else loss * 0])
        dist.all_reduce(sums, group=self.groups["stage"])
        dist.all_reduce(sums, group=self.groups["pp"])
        total, tokens = float(sums[0]), int(sums[1])
        return (total / tokens if tokens else float("nan")), tokens

    def step_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The step's loss on every rank: ``local`` summed over the stage's ranks and the pipeline."""
        total = local.detach().to(torch.float64).clone()
        dist.all_reduce(total, group=self.groups["stage"])
        dist.all_reduce(total, group=self.groups["pp"])
        return total.to(torch.float32)

    def clip(self, max_norm: float | None) -> torch.Tensor:
        """The global gradient norm over every stage, clipped to ``max_norm`` (None: the norm only)."""
        from dsv4.parallel.pipeline import clip_pipeline_grad_norm_

        return clip_pipeline_grad_norm_(self.modules, max_norm, self.groups["pp"], stage_group=self.groups["stage"])


def build_pipeline_run(model: nn.Module, meshes: Any, *, pp: int, virtual: int, schedule: str, seq_len: int,
                       micro_batch_size: int, microbatches: int, compute_dtype: torch.dtype, device: torch.device,
                       cp: Any = None) -> PipelineRun:
    """This rank's :class:`PipelineRun` of ``model`` (experts already sharded for EP): its stages split for
    ``seq_len``, sharded with FSDP2 over ``meshes.dp_cp``, wrapped for the engine on ``meshes.pp``; the pair groups
    of the MTP embedding made on every rank (collectively)."""
    from torch.distributed.pipelining import PipelineStage

    from dsv4.parallel.pipeline import (DSV4PipelineStage, check_pipeline, embedding_pair, shard_stages,
                                        stage_indices, stage_io, stage_layers)

    check_pipeline(model.config, pp)
    count = pp * virtual
    spans = stage_layers(model.config, seq_len, count)
    pp_rank = meshes.pp.get_local_rank()
    modules = [DSV4PipelineStage(model, spans[i], cp=cp) for i in stage_indices(pp_rank, pp, virtual)]
    shard_stages(model, modules, meshes, compute_dtype)
    cp_size = cp.size if cp is not None else 1
    group = meshes.pp.get_group()
    engine = [PipelineStage(m, m.span.index, count, device,
                            *stage_io(m, micro_batch_size, seq_len // cp_size, compute_dtype), group=group)
              for m in modules]
    stage_size, inner = meshes.dp_cp.size(), dist.get_rank() % meshes.dp_cp.size()
    pair = embedding_pair(model, count, pp)
    pair_groups = [dist.new_group([p * stage_size + i for p in pair]) for i in range(stage_size)] if pair else None
    groups = {"pp": group, "stage": meshes.dp_cp.get_group(),
              "pair": pair_groups[inner] if pair and pp_rank in pair else None}
    return PipelineRun(model, modules, engine, schedule, micro_batch_size, microbatches, groups)
