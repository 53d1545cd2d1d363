"""`DSV4LightningModule`: the DSV4 model, its optimizer and the token-weighted training step.

The strategy (:class:`~dsv4.training.strategy.DSV4Strategy`) hands ``training_step`` a batch already sharded for
this CP rank (keys of ``make_dsv4_contiguous_shard_cp_batch_and_ctx``) plus ``_step_stats`` (this dp replica's
token counts before sharding). The step runs ``forward_step``, reduces (CE sum, label count) over dp x cp so every
labelled token counts once, logs ``train/loss`` (token mean over the global batch) and returns this rank's share of
the loss; FSDP sums the gradients over ranks. After the optimizer step the MoE load-balancing bias is updated from
the loads of all ranks, and ``last_step_stats`` is published for the callbacks.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.model.moe import update_load_balancing_bias
from dsv4.parallel.wrap import clip_grad_norm_
from dsv4.training.loss import reduce_token_loss
from dsv4.training.stats import StepStats
from dsv4.training.step import forward_step


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _sum_over_ranks(loads: torch.Tensor) -> torch.Tensor:
    """Expert loads of every rank (all routers see different tokens; every rank applies the same bias update)."""
    loads = loads.clone()
    dist.all_reduce(loads)
    return loads


class DSV4LightningModule(L.LightningModule):
    def __init__(
        self,
        model: dict[str, Any],
        optim: dict[str, Any] | None = None,
        max_steps: int = 100,
        bias_update_rate: float = 1e-3,
        hf_checkpoint: str | None = None,
        export_hf_dir: str | None = None,
        export_dtype: str = "bfloat16",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = DSV4Config.from_dict(dict(model))
        self.optim = {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.9, 0.95), "warmup_steps": 10,
                      "min_lr_ratio": 0.1, "grad_clip": 1.0, **(optim or {})}
        self.max_steps = max_steps
        self.bias_update_rate = bias_update_rate
        self.hf_checkpoint = hf_checkpoint
        self.export_hf_dir = export_hf_dir
        self.export_dtype = export_dtype
        self.model: DSV4ForCausalLM | None = None
        self.last_step_stats: StepStats | None = None
        self._step_start = 0.0

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Build the model once (idempotent) and let the strategy parallelize it (EP, FSDP2)."""
        if self.model is not None:
            return
        self.model = DSV4ForCausalLM(self.config)
        strategy = self.trainer.strategy if self._trainer is not None else None
        if self.hf_checkpoint:
            # Order: full model -> load (non-expert keys + only this EP rank's expert keys) -> EP shard -> FSDP2.
            # Loading before parallelize keeps plain tensors (no DTensor copies); the expert rows of other EP ranks
            # are never read and are dropped by shard_experts.
            from dsv4.checkpoint import load_hf_checkpoint

            ep_size = int(getattr(strategy, "ep_size", 1) or 1)
            ep_rank = None
            if ep_size > 1:
                ep_rank = strategy.meshes.ep.get_local_rank()
            load_hf_checkpoint(self.model, self.hf_checkpoint, ep_rank=ep_rank, ep_size=ep_size if ep_rank is not None else None)
        parallelize = getattr(strategy, "parallelize", None)
        if parallelize is not None:
            parallelize(self.model)

    def on_train_end(self) -> None:
        """``export.hf_dir``: write the trained model in the HF layout (every rank gathers, global rank 0 writes)."""
        if not self.export_hf_dir:
            return
        from dsv4.checkpoint import export_hf_checkpoint

        export_hf_checkpoint(self.model, self.export_hf_dir, dtype=self.export_dtype,
                             write=self.trainer.global_rank == 0)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.optim["lr"], betas=tuple(self.optim["betas"]),
                                weight_decay=self.optim["weight_decay"], foreach=False)
        warmup, floor = int(self.optim["warmup_steps"]), float(self.optim["min_lr_ratio"])
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine(step, warmup, self.max_steps, floor)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        norm = clip_grad_norm_(self.parameters(), self.optim["grad_clip"])
        self.log("train/grad_norm", norm, on_step=True, rank_zero_only=True)

    # ------------------------------------------------------------------ step
    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_start = time.perf_counter()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        strategy = self.trainer.strategy
        stats = batch.pop("_step_stats")
        cp = getattr(strategy, "cp_context", None)
        loss_sum, count = forward_step(self.model, batch, cp=cp)
        group = getattr(strategy, "loss_group", None)
        loss = reduce_token_loss(loss_sum, count, group if group is not None else False)
        self.log("train/loss", loss.value, prog_bar=True, on_step=True, rank_zero_only=True)
        self._pending_stats = stats
        return loss.loss

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """Forward, backward and the optimizer step (Lightning's closure), then the MoE bias update and the step
        statistics, so that callbacks' ``on_train_batch_end`` see this step's numbers."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self._after_optimizer_step()

    def _after_optimizer_step(self) -> None:
        strategy = self.trainer.strategy
        distributed = dist.is_available() and dist.is_initialized()
        update_load_balancing_bias(self.model, self.bias_update_rate, reduce=_sum_over_ranks if distributed else None)
        stats = self._pending_stats
        dp_group = getattr(strategy, "dp_group", None)
        if dp_group is not None:
            stats = stats.clone()
            dist.all_reduce(stats, group=dp_group)
        rows, slots, real, labels, pack_pad, align_pad = (int(v) for v in stats.tolist())
        cp = getattr(strategy, "cp_context", None)
        traffic = cp.traffic.as_dict() if cp is not None else {}
        if cp is not None:
            cp.traffic.reset()
        self.last_step_stats = StepStats(
            step=self.trainer.global_step + 1, seq_len=slots // max(rows, 1), rows=rows, slots=slots, real_tokens=real,
            label_tokens=labels, pack_padding=pack_pad, alignment_padding=align_pad,
            cp=getattr(strategy, "cp_size", 1), dp=getattr(strategy, "dp_size", 1),
            world_size=self.trainer.world_size, step_time_s=time.perf_counter() - self._step_start,
            cp_traffic=traffic,
        )

    # ------------------------------------------------------------------ checkpoint extras
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["dsv4"] = {"config": self.config.to_dict(), "torch_rng": torch.get_rng_state()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        extra = checkpoint.get("dsv4", {})
        if "torch_rng" in extra:
            torch.set_rng_state(extra["torch_rng"])
