"""``recipes/train_dspark.py``'s recipe for :func:`dsv4.training.run.run_finetune` (:data:`TRAIN_DSPARK`): the
run resolved with the drafter's keys (:func:`~dsv4.training.spec.build_dspark_run_spec`), the fine-tuning data
module (online: packed rows, the target computes the features) and :class:`~dsv4.training.dspark_module.
DSparkLightningModule` with the held-out prompts of the decoding evaluation.

Prompts: the documents held out by ``data.val_fraction`` (split by the run's seed, as the held-out rows are), else
those of ``data.val``, else the training documents; the first ``drafter.eval_prompts`` that give a prompt
(:func:`dsv4.speculative.eval_job.prompts_of`: a chat document's tokens before its first assistant token, a text
document's first ``drafter.eval_prompt_tokens``).
"""

from __future__ import annotations

import logging

from dsv4.training.run import TrainingRecipe, _finetune_data
from dsv4.training.spec import RunSpec, build_dspark_run_spec

log = logging.getLogger("dsv4")


def evaluation_prompts(spec: RunSpec) -> list:
    """The decoding evaluation's prompts of ``spec`` (module docstring)."""
    from dsv4.data import build_documents
    from dsv4.data.validation import split_documents
    from dsv4.speculative.eval_job import prompts_of

    validation = spec.validation
    if validation.fraction is not None:
        documents = split_documents(build_documents(**spec.data), validation.fraction, spec.seed)[1]
    elif validation.source is not None:
        documents = build_documents(**validation.source)
    else:
        documents = build_documents(**spec.data)
        log.info("drafter evaluation: no held-out data (data.val_fraction / data.val): prompts from the training "
                 "documents")
    return prompts_of(documents, spec.dspark.eval_prompts, spec.dspark.eval_prompt_tokens)


def _data(spec: RunSpec):
    if spec.dspark.mode == "offline":
        from dsv4.speculative.feature_data import FeatureDataModule

        return FeatureDataModule.from_spec(spec)
    return _finetune_data(spec)


def _module(spec: RunSpec, data):
    from dsv4.training.dspark_module import DSparkLightningModule

    return DSparkLightningModule(spec, val_data=data.validation_dataloader if data.has_validation else None,
                                 prompts=evaluation_prompts(spec))


def _check_memory(spec: RunSpec, output_dir, cfg) -> bool:
    from dsv4.training.dspark_planning import check_dspark_memory

    return check_dspark_memory(spec, output_dir, cfg)


TRAIN_DSPARK = TrainingRecipe(build_dspark_run_spec, _data, _module, _check_memory)
