"""`DSparkLightningModule`: DSpark drafter training on the fine-tuning module's machinery.

It is :class:`~dsv4.training.module.DSV4LightningModule` (optimizer and schedule factories, clipping, non-finite
steps, gradient accumulation over one global batch, step statistics for the callbacks, checkpoints through the
strategy) with another model and another step:

* the trained model (``self.model``, what the strategy parallelises, checkpoints and what the optimizer sees) is the
  drafter (:class:`~dsv4.model.v41.drafter.DSparkDrafter`), started from the release's ``mtp.*`` (``drafter.init``
  ``release``, or ``auto`` when the checkpoint holds them) or fresh (``random``) with the target's embedding and
  head;
* the frozen target (``online``; :func:`~dsv4.speculative.target.build_frozen_target`: a quantised checkpoint's
  FP8 / FP4 weights kept as released) is held apart from the module's parameters (no gradient, no optimizer state,
  not in checkpoints: it is rebuilt from ``model.checkpoint`` or the seed at every start) and runs on each micro-batch's
  rows to give the drafter its features (:func:`~dsv4.speculative.dspark_step.target_features`); ``offline`` the
  rows come with captured features (:class:`~dsv4.speculative.dspark_step.FeatureBatch`, from
  :mod:`dsv4.speculative.feature_data`), the fresh drafter takes the captured target's embedding and head, and a
  target is built only for the decoding evaluation (from ``model.checkpoint`` or the seed, as the capture built it);
* the step's loss is the drafter objective (:func:`~dsv4.speculative.dspark_step.drafter_terms`): each micro-batch
  backpropagates its weighted sum, divided by the weight sum of the whole step over every rank (as the fine-tuning
  loss divides by the step's label count), and ``train/loss``, ``train/ce``, ``train/l1``, ``train/confidence``,
  ``train/tau``, ``train/accept_rate/k`` and ``train/confidence_abs_error`` are logged for the step;
* the drafter's router biases do not move (NeMo Automodel trains the drafter with a bias update factor of 0);
* validation (``data.val_fraction`` / ``data.val``, ``trainer.val_check_interval``): the same terms on the held-out
  rows (the TV estimate of the acceptance: ``val/tau``, ``val/accept_rate/k``; anchors drawn as at step 0, so every
  validation sees the same blocks), and at the end of the run (and every ``drafter.eval_every_n_steps``) the real
  accepted length of greedy speculative decoding on held-out prompts (``val/acceptance_length``,
  ``val/acceptance_per_position/k``; :mod:`dsv4.speculative.decoding`);
* ``export.hf_dir``: the trained drafter in the release layout, beside the target when the directory holds one
  (:func:`~dsv4.speculative.drafter_checkpoint.export_dspark_drafter`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dsv4.distributed import all_reduce_sum
from dsv4.speculative.dspark_step import (FeatureBatch, LossOptions, drafter_terms, drafter_terms_cp,
                                          target_features, term_metrics, term_vector)
from dsv4.training.module import DSV4LightningModule
from dsv4.training.spec import RunSpec
from dsv4.training.validation import batch_limit

log = logging.getLogger("dsv4")


@dataclass
class _Weighted:
    """What :meth:`DSV4LightningModule._accumulate` reads of a forward: a differentiable sum and its weight."""

    loss_sum: torch.Tensor
    label_count: torch.Tensor
    indexer_loss_sum: None = None


class _Frozen:
    """Holds the frozen target outside the module tree (so it is neither a parameter of the module nor in its
    state dict)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


class DSparkLightningModule(DSV4LightningModule):
    """The drafter of ``spec.dspark`` trained against the frozen target of ``spec.model`` (module docstring)."""

    def __init__(self, spec: RunSpec, val_data=None, prompts=None) -> None:
        super().__init__(spec, val_data)
        self.dspark = spec.dspark
        self.loss_options = LossOptions(self.dspark.num_anchors, self.dspark.gamma, self.dspark.ce_alpha,
                                        self.dspark.l1_alpha, self.dspark.confidence_alpha)
        self.prompts = prompts  # held-out prompts of the decoding evaluation (token tensors)
        self._frozen: _Frozen | None = None
        self._terms: torch.Tensor | None = None  # the step's summed term_vector (micro-batches of this rank)
        self.last_acceptance: dict | None = None

    # ------------------------------------------------------------------ models
    def configure_model(self) -> None:
        """Build the frozen target (loaded from ``model.checkpoint``; eval mode, no gradient) and the drafter
        (released weights or fresh with the target's embedding and head), then let the strategy parallelise the
        drafter."""
        if self.model is not None:
            return
        from dsv4.model.v41.drafter import DSparkDrafter
        from dsv4.training.strategy import DSV4Strategy

        if self.dspark.mode == "online":
            self._frozen = _Frozen(self._build_target())
        torch.manual_seed(self.spec.seed)  # the same fresh drafter whether or not a target was built first
        drafter = DSparkDrafter(self.config)
        if self.dspark.init == "release":
            from dsv4.speculative.drafter_checkpoint import load_dspark_drafter_into

            load_dspark_drafter_into(drafter, self.dspark.source)
            log.info("drafter: the released weights of %s", self.dspark.source)
        elif self.dspark.mode == "online":
            drafter.copy_target_embeddings(self.target)
            log.info("drafter: random initialisation, the target's embedding and head")
        else:
            from dsv4.speculative.feature_data import CaptureReader

            weights = CaptureReader(self.dspark.features).target_weights()
            with torch.no_grad():
                drafter.embed_tokens.weight.copy_(weights["embed.weight"])
                drafter.lm_head.weight.copy_(weights["head.weight"])
            log.info("drafter: random initialisation, the captured target's embedding and head")
        self.model = drafter
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, DSV4Strategy):
            strategy.parallelize(self.model)

    def _build_target(self) -> torch.nn.Module:
        """The frozen target, parallel as the run is: Engram tables row-sharded over every rank (each reads its
        rows) and routed experts over the expert-parallel ranks (each reads its experts), as fine-tuning holds the
        model; no FSDP (nothing of it trains); its float weights in the run's compute dtype as FSDP2's mixed
        precision would cast them (:func:`~dsv4.speculative.target.store_in_compute_dtype`)."""
        from dsv4.parallel.expert_shard import apply_expert_parallel
        from dsv4.speculative.target import build_frozen_target
        from dsv4.training.strategy import DSV4Strategy

        strategy = self._trainer.strategy if self._trainer is not None else None
        parallel = isinstance(strategy, DSV4Strategy)
        ep = parallel and strategy.ep_size > 1
        target = build_frozen_target(self.config, checkpoint=self.spec.model_checkpoint,
                                     tokenizer=self.spec.data.get("tokenizer", "byte"), seed=self.spec.seed,
                                     before_load=strategy.shard_engram_tables if parallel else None,
                                     ep_rank=self.parallel.ep_rank if ep else None,
                                     ep_size=self.parallel.ep_size if ep else None,
                                     compute_dtype=self.spec.compute_dtype)
        if parallel and (ep or strategy.dispatcher != "local"):
            apply_expert_parallel(target, strategy.dispatcher, strategy.meshes.ep.get_group(),
                                  strategy.root_device.type)
        return target

    @property
    def target(self) -> torch.nn.Module:
        """The frozen target; offline, built at its first use (the decoding evaluation), on the module's device."""
        if self._frozen is None:
            with torch.random.fork_rng():
                self._frozen = _Frozen(self._build_target().to(self.device))
        return self._frozen.model

    def on_fit_start(self) -> None:
        if self._frozen is not None:
            self.target.to(self.device)

    # ------------------------------------------------------------------ step
    def _terms_of(self, batch, step: int) -> dict:
        """The drafter's terms on a micro-batch of whole rows: captured features (offline) or the target's on this
        rank's chunk (online; under CP the drafter's blocks of that chunk, :func:`drafter_terms_cp`)."""
        parallel = self.parallel
        if isinstance(batch, FeatureBatch):
            tokens, features, last = batch.tokens, batch.features, batch.last_hidden
            if parallel.cp_size > 1:
                local = slice(parallel.cp_rank * tokens.width // parallel.cp_size,
                              (parallel.cp_rank + 1) * tokens.width // parallel.cp_size)
                features, last = features[:, local], last[:, local]
        else:
            tokens = batch
            local = batch.cut(parallel.cp_rank, parallel.cp_size, self.config.shard_multiple)
            features, last = target_features(self.target, local, self.config.dspark_target_layer_ids, cp=parallel.cp)
        if parallel.cp_size > 1:
            return drafter_terms_cp(self.model, tokens, features, last, self.loss_options, parallel.cp,
                                    seed=self.spec.seed, step=step)
        return drafter_terms(self.model, tokens, features, last, self.loss_options, seed=self.spec.seed, step=step)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        from dsv4.training.stats import batch_statistics

        tokens = batch.tokens if isinstance(batch, FeatureBatch) else batch
        stats = batch_statistics(tokens, self.config.shard_multiple, None)
        self._batch_stats = stats if self._batch_stats is None else self._batch_stats + stats
        terms = self._terms_of(batch, self.trainer.global_step)
        vector = term_vector(terms).detach()
        self._terms = vector if self._terms is None else self._terms + vector
        out = _Weighted(terms["numerator"], terms["weight"])
        if self.accumulation > 1:
            return self._accumulate(out)
        from dsv4.training.loss import reduce_token_loss

        group = self.parallel.loss_group if self.parallel.loss_group is not None else False
        loss = reduce_token_loss(out.loss_sum, out.label_count, group)
        self._step_loss = loss.value
        self.log("train/loss", loss.value, prog_bar=True, on_step=True, rank_zero_only=True)
        return loss.loss

    def _after_optimizer_step(self) -> None:
        vector, self._terms = self._terms, None
        if vector is not None:
            if self.parallel.loss_group is not None:
                vector = all_reduce_sum(vector, self.parallel.loss_group)
            metrics = term_metrics(vector, self.loss_options, "train")
            metrics.pop("train/loss")  # logged with the step (the same number)
            for name, value in metrics.items():
                self.log(name, value, on_step=True, rank_zero_only=True)
        super()._after_optimizer_step()
        step = self.trainer.global_step + 1
        every = self.dspark.eval_every_n_steps
        if self.prompts and ((every and step % every == 0) or step == self.spec.max_steps):
            self.evaluate_acceptance(step)

    def update_router_biases(self) -> None:
        """The drafter's router biases stay as they are (see the module docstring)."""
        for module in self.model.modules():
            if getattr(module, "expert_load", None) is not None:
                module.expert_load.zero_()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def validate(self, step: int):
        """The drafter's terms on the held-out rows (anchors as at step 0); logs ``val/*`` once."""
        from dsv4.training.validation import ValidationResult

        for param in self.parameters():
            param.grad = None
        loader = self.val_data()
        limit = batch_limit(len(loader), self.spec.validation.limit_batches) if hasattr(loader, "__len__") else None
        was_training = self.model.training
        self.model.eval()
        total = None
        try:
            for index, batch in enumerate(loader):
                if limit is not None and index >= limit:
                    break
                vector = term_vector(self._terms_of(batch.to(self.device), 0))
                total = vector if total is None else total + vector
        finally:
            self.model.train(was_training)
        if self.parallel.loss_group is not None and total is not None:
            total = all_reduce_sum(total, self.parallel.loss_group)
        metrics = term_metrics(total, self.loss_options, "val") if total is not None else {}
        loss = metrics.get("val/loss", float("nan"))
        self.last_validation = ValidationResult(step=step, loss=loss, tokens=int(total[0]) if total is not None else 0)
        self.trainer.callback_metrics["val/loss"] = torch.tensor(loss)
        if self.trainer.global_rank == 0:
            for logger in self.trainer.loggers:
                logger.log_metrics(metrics, step=step - 1)
            log.info("step %d: val/loss %.4f, val/tau %.3f", step, loss, metrics.get("val/tau", float("nan")))
        return self.last_validation

    @torch.no_grad()
    def evaluate_acceptance(self, step: int) -> dict:
        """Greedy speculative decoding of the held-out prompts: the real accepted length (logged ``val/*``)."""
        from dsv4.speculative.decoding import AcceptanceStats, DSparkProposer, TargetRunner, speculative_generate
        from dsv4.speculative.eval_job import flat_metrics

        from dsv4.parallel.wrap import gathered

        for param in self.parameters():  # applied by the optimizer step; the next step starts from zero anyway
            param.grad = None
        was_training = self.model.training
        self.model.eval()
        stats = AcceptanceStats(self.model.block_size)
        runner = TargetRunner(self.target, self.config.dspark_target_layer_ids, self.dspark.vocab_limit)
        proposer = DSparkProposer(self.model, 0.0, None, self.dspark.vocab_limit)
        try:  # every rank decodes every prompt (greedy: the same tokens, so the same collectives in the same order)
            with gathered(self.model):
                for prompt in self.prompts:
                    speculative_generate(runner, proposer, prompt.to(self.device), self.dspark.eval_new_tokens,
                                         stats=stats)
        finally:
            self.model.train(was_training)
        summary = stats.summary()
        metrics = {f"val/{k}": v for k, v in flat_metrics(summary).items()
                   if k.startswith(("acceptance_length", "acceptance_per_position"))}
        self.last_acceptance = {"step": step, **summary}
        if self.trainer.global_rank == 0:
            for logger in self.trainer.loggers:
                logger.log_metrics(metrics, step=step - 1)
            log.info("step %d: real accepted length %.3f on %d held-out prompts", step,
                     summary["acceptance_length"], len(self.prompts))
        return summary

    # ------------------------------------------------------------------ export
    def on_train_end(self) -> None:
        """``export.hf_dir``: the drafter in the release layout, beside the target when the directory holds one."""
        if not self.spec.export.hf_dir:
            return
        from dsv4.speculative.drafter_checkpoint import export_dspark_drafter

        export_dspark_drafter(self.model, self.spec.export.hf_dir, dtype=self.spec.export.dtype,
                              overwrite=self.spec.export.overwrite)
        if self.trainer.global_rank == 0:
            log.info("wrote the drafter (release layout) to %s", self.spec.export.hf_dir)
