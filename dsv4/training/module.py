"""`DSV4LightningModule`: the DSV4 model, its optimizer and the token-weighted training step.

One step: ``training_step`` receives this dp replica's whole rows (a :class:`~dsv4.batch.TokenBatch`, on the
device), records their statistics, cuts this CP rank's contiguous slice (:meth:`~dsv4.batch.TokenBatch.cut`), runs
:func:`~dsv4.training.step.forward_outputs` with the strategy's ``CPContext``, reduces (CE sum, label count) over
dp x cp so every labelled token counts once, logs ``train/loss`` (token mean over the global batch) and returns
this rank's share of the loss; FSDP sums the gradients over ranks. After the optimizer step the MoE
load-balancing bias is updated from the loads of all ranks (not under LoRA, whose base stays as it is, nor during
the indexer warm-up), and ``last_step_stats`` is published for the callbacks. With ``model.indexer_loss_coeff > 0``
the step also logs ``train/indexer_loss`` (the indexer's KL, a token mean like ``train/loss``, which includes it
times the coefficient); during the first ``indexer_warmup_steps`` only that loss is backpropagated. ``train/lr`` is
the learning rate the optimizer step used.

Gradient accumulation (``global_batch_size``: the Trainer's ``accumulate_grad_batches`` micro-batches per optimizer
step) keeps the step one large batch: the loss is the token mean over every micro-batch of the step, its gradients
those of all the rows in one batch (:meth:`DSV4LightningModule.training_step`), and the published ``StepStats``
cover all of them.

Validation (``val_data``: the held-out rows, ``spec.validation``): after the optimizer steps
:func:`~dsv4.training.validation.validation_due` names, the module evaluates them in eval mode without gradients
(:func:`~dsv4.training.validation.evaluate_token_loss`, the training forward under CP) and logs ``val/loss`` once
(global rank 0, every logger), in the row of the step it follows (the row of that step's ``train/loss``);
``last_validation`` holds the result for the checkpoint callback. It runs after the step's bias update and statistics
and leaves the training state as it was: no expert load is counted (eval mode), no RNG is drawn, the CP traffic
counters are reset afterwards, and the step's gradients (already applied) are freed first.

Non-finite values (:mod:`dsv4.training.nonfinite`): at the optimizer-step boundary
(:meth:`DSV4LightningModule.configure_gradient_clipping`, after the accumulation rescale) a non-finite ``train/loss``
or global gradient norm stops the run with :class:`~dsv4.training.nonfinite.NonFiniteError` naming the step, the
first parameter with a non-finite gradient and the last good checkpoint. Within ``skip_nonfinite_steps`` the step is
skipped instead: its gradients are dropped (the optimizer changes nothing), the LR scheduler is not stepped, the
router biases are not updated; the step counter advances and ``train/skipped_nonfinite`` counts the skips.

Pipeline stages (``pp > 1``, :mod:`dsv4.training.pipeline_step`): Lightning's manual optimization; each
``training_step`` receives every microbatch of this dp replica's step and runs the schedule, the clipping, the
non-finite check and the optimizer, LR and bias steps itself (:meth:`DSV4LightningModule._pipeline_step`); the
optimizer holds this rank's stages' parameters only.

LoRA (``lora``, :mod:`dsv4.peft`): only the adapters are parameters that train; the optimizer sees only them, the
strategy checkpoints only them, and ``on_train_end`` exports them in the PEFT format and / or the merged model.

Parallelism reaches the module through one typed object, :attr:`DSV4LightningModule.parallel` (the
:class:`~dsv4.training.strategy.ParallelState` of a :class:`~dsv4.training.strategy.DSV4Strategy`, or the
single-process state under any other strategy). The optimizer and the LR schedule are factories (Hydra
``_partial_`` targets from ``conf/optim`` and ``conf/scheduler``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterable

import lightning as L
import torch

from dsv4.batch import TokenBatch
from dsv4.distributed import all_reduce_sum, is_initialized
from dsv4.model import DSV4ForCausalLM, build_causal_lm
from dsv4.model.moe import MoEGate, update_load_balancing_bias
from dsv4.parallel.wrap import clip_grad_norm_
from dsv4.training.loss import reduce_token_loss
from dsv4.training.nonfinite import NonFiniteError, first_nonfinite_gradient, last_good_checkpoint
from dsv4.training.stats import StepStats, batch_statistics, document_flops, step_stats_from
from dsv4.training.spec import RunSpec
from dsv4.training.step import forward_outputs
from dsv4.training.strategy import DSV4Strategy, ParallelState
from dsv4.training.validation import ValidationResult, batch_limit, evaluate_token_loss, validation_due

log = logging.getLogger("dsv4")


class DSV4LightningModule(L.LightningModule):
    """The model of a :class:`~dsv4.training.spec.RunSpec` and its training step. It reads from the spec: the model
    config, the optimizer and scheduler factories (the scheduler stepped every optimizer step), the MoE bias step
    (``bias_update_rate``), ``model_checkpoint`` (a Hugging Face-format DSV4 checkpoint loaded before
    parallelisation), ``lora`` (a LoRA fine-tune: the base is frozen, with no gradient, optimizer state, reduction or
    router-bias update; only adapters train) and ``lora_adapter`` (a PEFT adapter to start from), ``export`` (what
    to write at the end of training) and ``indexer_warmup_steps`` (with ``indexer_loss_coeff > 0`` the first steps
    train only the indexer on its KL loss, :mod:`dsv4.model.indexer_loss`; the main model and the router biases stay
    as they are). ``val_data``: a callable returning this dp rank's held-out batches (e.g.
    :meth:`~dsv4.data.datamodule.DSV4DataModule.validation_dataloader`; None: no validation).
    """

    def __init__(self, spec: RunSpec, val_data: Callable[[], Iterable[TokenBatch]] | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.val_data = val_data
        self.last_validation: ValidationResult | None = None
        self.config = spec.model
        self.lora = spec.lora
        self.model: DSV4ForCausalLM | None = None
        self.last_step_stats: StepStats | None = None
        self._flops = document_flops(self.config)
        self._batch_stats: torch.Tensor | None = None  # summed over the micro-batches of the current step
        self._window_sums: torch.Tensor | None = None  # (CE sum, label count[, indexer sum]) under accumulation
        self._step_start = 0.0
        self._step_loss: torch.Tensor | None = None  # the step's global train/loss (checked with the grad norm)
        self.skipped_nonfinite = 0  # steps skipped for a non-finite loss / gradient norm over the run
        self._skipping = False  # this optimizer step was skipped (no update, no LR step, no bias update)
        if spec.parallel.pipelined:  # the pipeline's schedule runs backward itself
            self.automatic_optimization = False

    @property
    def parallel(self) -> ParallelState:
        """This rank's parallel state: the :class:`DSV4Strategy`'s, or a single process's."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        return strategy.parallel if isinstance(strategy, DSV4Strategy) else ParallelState()

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Build the model once (idempotent); load weights; let a DSV4Strategy parallelize it (EP, FSDP2).

        Order: full model -> LoRA (``peft=lora``: adapters, frozen or kept FP8 / FP4 base) -> V4.1's Engram tables
        row-sharded (frozen tables a checkpoint stores in FP8 kept so) -> load (non-expert keys + only this EP rank's
        expert keys + only this rank's table rows) -> a PEFT adapter (``peft.adapter``) -> EP shard -> FSDP2. Loading
        before parallelizing keeps plain tensors; the expert rows of other EP ranks are never read.
        """
        if self.model is not None:
            return
        self.model = build_causal_lm(self.config)
        if getattr(self.config, "engram_layer_ids", None):  # V4.1: Engram hashes through the run's tokenizer
            from dsv4.data.tokenizers import build_tokenizer

            self.model.set_engram_tokenizer(build_tokenizer(self.spec.data.get("tokenizer", "byte")))
        parallel = self.parallel
        if self.lora is not None:  # before loading: a kept base receives the checkpoint's FP8 / FP4 bytes as they are
            from dsv4.peft.apply import apply_lora, lora_summary

            counts = apply_lora(self.model, self.lora)
            summary = lora_summary(self.model, self.lora, counts)
            if self._trainer is None or self.global_rank == 0:
                log.info("%s", summary)
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, DSV4Strategy):  # V4.1: before loading, so that each rank reads only its table rows
            strategy.shard_engram_tables(self.model)
        if self.spec.model_checkpoint:
            from dsv4.checkpoint import load_hf_checkpoint
            from dsv4.checkpoint.load import keep_engram_tables_as_stored

            keep_engram_tables_as_stored(self.model, self.spec.model_checkpoint)
            ep = parallel.ep_size > 1
            load_hf_checkpoint(self.model, self.spec.model_checkpoint, ep_rank=parallel.ep_rank if ep else None,
                               ep_size=parallel.ep_size if ep else None, init_missing_mtp=self.spec.init_missing_mtp)
        if self.spec.lora_adapter:
            from dsv4.peft.peft_format import load_peft_adapter

            load_peft_adapter(self.model, self.spec.lora_adapter)
        if isinstance(strategy, DSV4Strategy):
            strategy.parallelize(self.model)

    def on_train_end(self) -> None:
        """``export.adapter_dir``: the adapters in the PEFT format (every rank gathers, global rank 0 writes);
        ``export.hf_dir``: the trained model in the HF layout (merged under LoRA), each rank writing the tensors it
        owns (:func:`~dsv4.checkpoint.export_hf_checkpoint`), under any cp / dp / ep."""
        write = self.trainer.global_rank == 0
        if self.pipeline is not None:
            self._export_from_checkpoint(write)
            return
        if self.spec.export.adapter_dir:
            from dsv4.peft.peft_format import export_peft_adapter

            export_peft_adapter(self.model, self.spec.export.adapter_dir, self.lora,
                                base_model=self.spec.model_checkpoint, write=write,
                                overwrite=self.spec.export.overwrite)
            if write:
                log.info("wrote the LoRA adapters (PEFT format) to %s", self.spec.export.adapter_dir)
        if not self.spec.export.hf_dir:
            return
        from dsv4.checkpoint import export_hf_checkpoint

        sources = None
        if self.lora is not None:
            from dsv4.peft.apply import merged_sources, requantization_loss

            sources = merged_sources(self.model)
            if self.spec.export.dtype == "quantized":
                lost = requantization_loss(self.model)
                if lost is not None and lost > 0.1:
                    log.warning("export.merge with export.dtype=quantized: re-quantising the merged FP8 / FP4 weights "
                                "rounds away %.0f%% of the LoRA update (relative L2); export bfloat16 or ship the "
                                "adapter (export.adapter_dir)", 100 * lost)
                elif lost is not None:
                    log.info("re-quantised merge keeps the LoRA update within %.1f%% (relative L2)", 100 * lost)
        export_hf_checkpoint(self.model, self.spec.export.hf_dir, dtype=self.spec.export.dtype, sources=sources,
                             overwrite=self.spec.export.overwrite)

    @property
    def pipeline(self):
        """This rank's :class:`~dsv4.training.pipeline_step.PipelineRun` under pipeline stages, else None."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        return getattr(strategy, "pipeline", None)

    def _export_from_checkpoint(self, write: bool) -> None:
        """The end-of-training export in pipeline stages: each rank holds only its stages, so global rank 0 converts
        the run's final checkpoint, which holds them all (:func:`dsv4.checkpoint.convert.export_run`: the files
        ``python -m dsv4.checkpoint export`` writes, those of :func:`~dsv4.checkpoint.export_hf_checkpoint`)."""
        export = self.spec.export
        if not (export.hf_dir or export.adapter_dir):
            return
        from dsv4.checkpoint.convert import export_run

        self.trainer.strategy.finish_checkpoint()  # the final step's save, committed
        run = Path(self.trainer.checkpoint_callback.dirpath) / "last.ckpt"
        alone = torch.distributed.new_group([0]) if torch.distributed.is_initialized() else None  # (every rank)
        if write:
            if export.adapter_dir:
                export_run(run, export.adapter_dir, adapter=True, overwrite=export.overwrite, group=alone)
                log.info("wrote the LoRA adapters (PEFT format) to %s from %s", export.adapter_dir, run)
            if export.hf_dir:
                export_run(run, export.hf_dir, dtype=export.dtype, merge=self.lora is not None,
                           overwrite=export.overwrite, group=alone)
                log.info("wrote the model (HF layout) to %s from %s", export.hf_dir, run)
        self.trainer.strategy.barrier("dsv4-export")

    def configure_optimizers(self):
        held = self.pipeline.parameters() if self.pipeline is not None else self.parameters()  # stages: this rank's
        optimizer = self.spec.optimizer([p for p in held if p.requires_grad])
        if self.spec.scheduler is None:
            return optimizer
        scheduler = self.spec.scheduler(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by the global L2 norm over every mesh (``trainer.gradient_clip_val``; None = log the norm only), then
        check the step: a non-finite ``train/loss`` or gradient norm stops the run or skips the step
        (:meth:`_nonfinite_step`)."""
        if gradient_clip_algorithm is not None and gradient_clip_algorithm != "norm":
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}: only 'norm' is supported")
        norm = clip_grad_norm_(self.parameters(), gradient_clip_val)  # leaves non-finite gradients as they are
        loss, self._step_loss = self._step_loss, None
        self._check_step(loss, norm)

    def _check_step(self, loss: torch.Tensor | None, norm: torch.Tensor) -> None:
        """Log the gradient norm; a non-finite ``train/loss`` or norm stops the run or skips the step."""
        self.log("train/grad_norm", norm, on_step=True, rank_zero_only=True)
        if not bool(torch.isfinite(norm)) or (loss is not None and not bool(torch.isfinite(loss))):
            self._nonfinite_step(loss, norm)

    def _nonfinite_step(self, loss: torch.Tensor | None, norm: torch.Tensor) -> None:
        """A non-finite loss or gradient norm (the same on every rank): stop with :class:`NonFiniteError`, or, within
        ``skip_nonfinite_steps``, drop the step's gradients so that the optimizer step changes nothing."""
        step = self.trainer.global_step + 1
        found = first_nonfinite_gradient(self.model.named_parameters())
        where = (f"first non-finite gradient: {found[0]} (rank {found[1]})" if found is not None else
                 "every gradient is finite (their squared norm overflows float32)" if loss is None or
                 bool(torch.isfinite(loss)) else "no non-finite gradient")
        what = f"train/loss {float(loss) if loss is not None else 'n/a'}, gradient norm {float(norm)}; {where}"
        if self.skipped_nonfinite < self.spec.skip_nonfinite_steps:
            self.skipped_nonfinite += 1
            self._skipping = True
            for param in self.parameters():  # no gradient: torch optimizers leave the parameter and its state alone
                param.grad = None
            log.warning("skipping optimizer step %d (%d of trainer.skip_nonfinite_steps=%d): %s", step,
                        self.skipped_nonfinite, self.spec.skip_nonfinite_steps, what)
            return
        finish = getattr(self.trainer.strategy, "finish_checkpoint", None)
        if finish is not None:  # commit the save of an earlier, good step still in flight
            finish()
        callback = self.trainer.checkpoint_callback
        good = last_good_checkpoint(getattr(callback, "dirpath", None))
        skipped = (f" after skipping {self.skipped_nonfinite} (trainer.skip_nonfinite_steps="
                   f"{self.spec.skip_nonfinite_steps})" if self.spec.skip_nonfinite_steps else "")
        raise NonFiniteError(
            f"non-finite values at optimizer step {step}{skipped}: {what}; last good checkpoint: "
            f"{good if good is not None else 'none yet'}. Nothing of this step was applied or saved; resume from "
            "that checkpoint (e.g. with a lower optim.lr), or set trainer.skip_nonfinite_steps to skip such steps")

    # ------------------------------------------------------------------ step
    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step (the Trainer's ``accumulate_grad_batches``, from ``global_batch_size``)."""
        return int(self._trainer.accumulate_grad_batches) if self._trainer is not None else 1

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._batch_stats is None:  # the first micro-batch of an optimizer step
            self._step_start = time.perf_counter()
            self._skipping = False

    def training_step(self, batch: TokenBatch, batch_idx: int) -> torch.Tensor:
        """``batch``: this dp replica's whole rows (one micro-batch); returns this rank's share of the loss to
        backpropagate.

        Without accumulation that share is ``loss_sum / global label count`` (:func:`reduce_token_loss`). With
        accumulation the label count of the whole optimizer step is known only after its last micro-batch: each
        micro-batch backpropagates ``loss_sum / grad_scale`` (a fixed number) and :meth:`on_before_optimizer_step`
        multiplies the summed gradients by ``grad_scale / global label count``, so the step's gradient is the one
        of the token mean over the whole global batch, exactly as one large batch gives."""
        parallel = self.parallel
        stats = batch_statistics(batch, self.config.shard_multiple, self._flops)
        self._batch_stats = stats if self._batch_stats is None else self._batch_stats + stats
        if self.pipeline is not None:
            return self._pipeline_step(batch)
        balance = parallel.cp.balance if parallel.cp is not None else "none"
        local = batch.cut(parallel.cp_rank, parallel.cp_size, self.config.shard_multiple, balance)
        out = forward_outputs(self.model, local, cp=parallel.cp)
        group = parallel.loss_group if parallel.loss_group is not None else False
        if self.accumulation > 1:
            return self._accumulate(out)
        loss = reduce_token_loss(out.loss_sum, out.label_count, group)
        self._step_loss = loss.value
        self.log("train/loss", loss.value, prog_bar=True, on_step=True, rank_zero_only=True)
        if out.indexer_loss_sum is None:
            return loss.loss
        indexer = reduce_token_loss(out.indexer_loss_sum, out.label_count, group)
        self.log("train/indexer_loss", indexer.value, on_step=True, rank_zero_only=True)
        if not self.in_indexer_warmup:
            return loss.loss
        # warm-up: the indexer learns alone. The LM objective is kept in the graph at weight 0 so that backward runs
        # through every block as usual (FSDP2 gathers a block's parameters when backward reaches its output);
        # on_after_backward then drops every gradient but the indexer's.
        return loss.loss * 0.0 + indexer.loss

    def _pipeline_step(self, batch: TokenBatch) -> torch.Tensor:
        """A whole optimizer step in pipeline stages (:mod:`dsv4.training.pipeline_step`): ``batch`` holds every
        microbatch of this dp replica's step; the schedule runs forward and backward, then the gradient norm (clipped to
        ``trainer.gradient_clip_val``), the non-finite check, the optimizer and LR steps and the bias update, as
        :meth:`configure_gradient_clipping` and :meth:`optimizer_step` do without stages."""
        run, parallel = self.pipeline, self.parallel
        local = batch.cut(parallel.cp_rank, parallel.cp_size, self.config.shard_multiple)
        count = torch.as_tensor(local.label_count(), dtype=torch.float64, device=local.input_ids.device)
        count = all_reduce_sum(count, parallel.loss_group) if parallel.loss_group is not None else count
        loss = run.step_loss(run.step(local, int(count.item())))
        self.log("train/loss", loss, prog_bar=True, on_step=True, rank_zero_only=True)
        self._check_step(loss, run.clip(self.spec.trainer.get("gradient_clip_val")))
        optimizer = self.optimizers()
        lr = float(optimizer.param_groups[0]["lr"])
        step = self.trainer.global_step + 1  # (a manual optimizer step counts itself at once)
        optimizer.step()
        optimizer.zero_grad()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            self.lr_scheduler_step(scheduler, None)
        self._log_applied(lr)
        self._after_optimizer_step(step)
        return loss

    @property
    def grad_scale(self) -> float:
        """The fixed divisor of an accumulated micro-batch's loss sum: the token slots of one global batch."""
        return float(self.accumulation * self.spec.micro_batch_size * self.parallel.dp_size * self.spec.seq_len)

    def _accumulate(self, out) -> torch.Tensor:
        """One micro-batch of an accumulated step: record (CE sum, label count[, indexer sum]) for the step's
        loss; return ``loss_sum / grad_scale`` times the accumulation (Lightning divides by it)."""
        sums = [out.loss_sum.detach(), torch.as_tensor(out.label_count, dtype=out.loss_sum.dtype,
                                                       device=out.loss_sum.device)]
        if out.indexer_loss_sum is not None:
            sums.append(out.indexer_loss_sum.detach())
        values = torch.stack(sums).to(torch.float64)
        self._window_sums = values if self._window_sums is None else self._window_sums + values
        scale = self.accumulation / self.grad_scale
        if out.indexer_loss_sum is None or not self.in_indexer_warmup:
            return out.loss_sum * scale
        return out.loss_sum * 0.0 + out.indexer_loss_sum * scale

    def on_before_optimizer_step(self, optimizer) -> None:
        """With accumulation: reduce the step's (CE sum, label count) over dp x cp, rescale the summed gradients to
        the token mean over the global batch and log ``train/loss`` (before clipping, which follows)."""
        if self._window_sums is None:
            return
        sums, self._window_sums = self._window_sums, None
        group = self.parallel.loss_group
        if group is not None:
            sums = all_reduce_sum(sums, group)
        count = float(sums[1].clamp_min(1))
        factor = self.grad_scale / count
        with torch.no_grad():
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)
        self._step_loss = sums[0] / count
        self.log("train/loss", self._step_loss, prog_bar=True, on_step=True, rank_zero_only=True)
        if sums.numel() > 2:
            self.log("train/indexer_loss", sums[2] / count, on_step=True, rank_zero_only=True)

    def on_after_backward(self) -> None:
        if self.in_indexer_warmup:  # no gradient, so no optimizer update or state, for anything but the indexer
            for name, param in self.model.named_parameters():
                if ".indexer." not in name:
                    param.grad = None

    @property
    def in_indexer_warmup(self) -> bool:
        """Whether this step is one of the first ``indexer_warmup_steps`` (only the indexer trains)."""
        return self._trainer is not None and self.trainer.global_step < self.spec.indexer_warmup_steps

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """Forward, backward and the optimizer step (Lightning's closure), then the MoE bias update and the step
        statistics, so that callbacks' ``on_train_batch_end`` see this step's numbers."""
        lr = float(optimizer.param_groups[0]["lr"])  # a value: some optimizers keep a tensor the schedule fills
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self._log_applied(lr)
        self._after_optimizer_step()

    def _log_applied(self, lr: float) -> None:
        """``train/lr`` the step used, and with ``skip_nonfinite_steps`` the skips so far."""
        self.log("train/lr", lr, on_step=True, rank_zero_only=True)
        if self.spec.skip_nonfinite_steps:
            self.log("train/skipped_nonfinite", float(self.skipped_nonfinite), on_step=True, rank_zero_only=True)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """The schedule counts applied updates: a skipped non-finite step does not advance it."""
        if not self._skipping:
            super().lr_scheduler_step(scheduler, metric)

    def _after_optimizer_step(self, step: int | None = None) -> None:
        """The bias update, the step statistics and a due validation after optimizer step ``step`` (the next one
        by the trainer's count when None)."""
        parallel = self.parallel
        step = self.trainer.global_step + 1 if step is None else step
        if self._skipping:  # a skipped step moves no router bias: drop the loads its forward counted
            for module in self.model.modules():
                if isinstance(module, MoEGate) and module.expert_load is not None:
                    module.expert_load.zero_()
        else:
            self.update_router_biases()
        totals, self._batch_stats = self._batch_stats, None  # every micro-batch of the step
        if parallel.dp_group is not None:
            totals = all_reduce_sum(totals, parallel.dp_group)
        traffic = {}
        if parallel.cp is not None:
            traffic = parallel.cp.traffic.as_dict()
            parallel.cp.traffic.reset()
        self.last_step_stats = step_stats_from(
            totals, step=step, cp=parallel.cp_size, dp=parallel.dp_size,
            world_size=self.trainer.world_size, step_time_s=time.perf_counter() - self._step_start,
            cp_traffic=traffic,
        )
        if self.val_data is not None and validation_due(step, self.spec.validation.every_n_steps, self.spec.max_steps):
            self.validate(step)

    def update_router_biases(self) -> None:
        """The MoE load-balancing bias update after an applied optimizer step. Every router sees different tokens:
        the expert loads of all ranks are summed and the same update applied everywhere. LoRA and the indexer
        warm-up keep the routers as they are."""
        if self.lora is None and not self.in_indexer_warmup:
            update_load_balancing_bias(self.model, self.spec.bias_update_rate,
                                       reduce=all_reduce_sum if is_initialized() else None)

    def validate(self, step: int) -> ValidationResult:
        """Evaluate the held-out rows after optimizer step ``step`` (see the module docstring); log ``val/loss``."""
        for param in self.parameters():  # applied by the optimizer step; the next step starts from zero anyway
            param.grad = None
        loader = self.val_data()
        limit = batch_limit(len(loader), self.spec.validation.limit_batches) if hasattr(loader, "__len__") else None
        was_training = self.model.training
        self.model.eval()
        try:
            if self.pipeline is not None:
                p = self.parallel
                loss, tokens = self.pipeline.evaluate(loader, p.cp_rank, p.cp_size, self.config.shard_multiple,
                                                      self.device, limit)
            else:
                loss, tokens = evaluate_token_loss(self.model, loader, self.parallel, self.config.shard_multiple,
                                                   self.device, limit)
        finally:
            self.model.train(was_training)
        if self.parallel.cp is not None:
            self.parallel.cp.traffic.reset()
        self.last_validation = ValidationResult(step=step, loss=loss, tokens=tokens)
        # to the loggers directly, once: a value self.log-ged in a training hook would be repeated in later rows
        self.trainer.callback_metrics["val/loss"] = torch.tensor(loss)
        if self.trainer.global_rank == 0:
            for logger in self.trainer.loggers:  # the row of the step it follows (0-based, like train/loss)
                logger.log_metrics({"val/loss": loss}, step=step - 1)
            log.info("step %d: val/loss %.4f over %d held-out tokens", step, loss, tokens)
        return self.last_validation

    # ------------------------------------------------------------------ checkpoint extras
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["dsv4"] = {"config": self.config.to_dict(), "model_type": self.config.model_type,
                              "torch_rng": torch.get_rng_state(), "skipped_nonfinite": self.skipped_nonfinite}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        extra = checkpoint.get("dsv4", {})
        if "torch_rng" in extra:
            torch.set_rng_state(extra["torch_rng"])
        self.skipped_nonfinite = int(extra.get("skipped_nonfinite", 0))
