"""A pipeline checkpoint (dsv4.parallel.pipeline_checkpoint) written at ``pp=2`` resumes at ``pp=1`` and trains on,
and exports to a checkpoint transformers loads with the logits of the one-process run's export.

V4 tiny, the data and steps of tests/distributed/test_pipeline.py: 2 gloo ranks train 2 AdamW steps with 1F1B, save
(model and AdamW state by the model's names, each rank its stages), then train the third step. In this process the
whole model (one stage: ``pp=1``) loads that checkpoint, model and optimizer, and trains the third step: its loss
equals the ``pp=2`` run's third loss and the uninterrupted one-process run's (1e-6 relative). The loaded model's HF
export and the one-process run's export after 2 steps, both read by transformers' ``AutoModelForCausalLM``, give
logits within 1e-5 relative (the two runs' parameters differ by float rounding only)."""

from __future__ import annotations

import pytest
import torch

from dsv4.launch import run_on_ranks
from tests.distributed.test_pipeline import ROWS, _accumulate, _batch
from tests.distributed.test_pipeline import _model as _preset_model

pytestmark = pytest.mark.distributed

SAVED_AFTER = 2  # steps


def _model(preset: str):
    """The preset with 8 indexer heads (transformers' indexer then breaks no top-k tie on these inputs, as in
    tests/unit/checkpoint/test_export_to_transformers.py)."""
    return _preset_model(preset, index_n_heads=8)


def _train_step(model, opt, step: int) -> float:
    """One process: the step's rows as microbatches, the step's token mean (as the pipeline's loss)."""
    batch = _batch(step)
    total = _accumulate(model, batch, int((batch[4] != -100).sum()))
    opt.step()
    opt.zero_grad()
    return total


def _pp_body(rank: int, world: int, path: str):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from dsv4.parallel.pipeline import (DSV4PipelineStage, build_schedule, embedding_pair, pipeline_loss,
                                        reduce_embedding_grads, stage_io, stage_layers)
    from dsv4.parallel.pipeline_checkpoint import save_pipeline_checkpoint

    torch.set_num_threads(1)
    model = _model("tiny")
    span = stage_layers(model.config, 256, world)[rank]
    stage_module = DSV4PipelineStage(model, span)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"), *stage_io(stage_module, 1, 256,
                                                                                     torch.float32))
    pair_group = dist.new_group(embedding_pair(model, world, world))
    opt = torch.optim.AdamW(list(stage_module.parameters()), lr=1e-3)
    losses = []
    for step in range(SAVED_AFTER + 1):
        if step == SAVED_AFTER:
            save_pipeline_checkpoint(path, model, [stage_module], opt)
        ids, pos, seq, pad, labels = _batch(step)
        sched = build_schedule([stage], ROWS, "1f1b", pipeline_loss(int((labels != -100).sum())))
        micro = []
        if rank == 0:
            sched.step(ids, pos, seq, pad, labels, losses=micro)
        else:
            sched.step(target=torch.zeros(ROWS), losses=micro)
        reduce_embedding_grads(model, pair_group)
        opt.step()
        opt.zero_grad()
        losses.append(float(sum(m.detach() for m in micro)) if micro else None)
    return losses


def test_a_pp2_checkpoint_resumes_at_pp1_and_exports_for_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from dsv4.checkpoint import export_hf_checkpoint
    from dsv4.parallel.pipeline_checkpoint import load_pipeline_checkpoint
    from tests.unit.checkpoint.hf_reference import indexer_ties, relative_error

    path = tmp_path / "pp2"
    pp_losses = run_on_ranks(_pp_body, 2, (str(path),))[1]

    torch.manual_seed(1)  # the loaded state, not this process's seed, decides
    resumed = _model("tiny")
    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    load_pipeline_checkpoint(path, resumed, [resumed], opt)
    export_hf_checkpoint(resumed, str(tmp_path / "from_pp2"))

    reference = _model("tiny")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_losses = [_train_step(reference, ref_opt, s) for s in range(SAVED_AFTER)]
    # AdamW's state for every parameter that had a gradient (the frozen indexer's have none), step and moments
    with_state = lambda m, o: sorted(n for n, p in m.named_parameters() if p in o.state)  # noqa: E731
    assert with_state(resumed, opt) == with_state(reference, ref_opt)
    for (name, p), q in zip(resumed.named_parameters(), reference.parameters()):
        if q in ref_opt.state:
            assert float(opt.state[p]["step"]) == SAVED_AFTER, name
            torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rtol=1e-4,
                                       atol=1e-12, msg=name)
    resumed_loss = _train_step(resumed, opt, SAVED_AFTER)
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(pp_losses[:SAVED_AFTER], ref_losses)), (pp_losses, ref_losses)
    export_hf_checkpoint(reference, str(tmp_path / "one_process"))
    ref_third = _train_step(reference, ref_opt, SAVED_AFTER)
    assert abs(resumed_loss - pp_losses[SAVED_AFTER]) <= 1e-6 * pp_losses[SAVED_AFTER], (resumed_loss, pp_losses)
    assert abs(resumed_loss - ref_third) <= 1e-6 * ref_third, (resumed_loss, ref_third)

    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(2))
    logits = []
    for name in ("from_pp2", "one_process"):
        hf, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32,
                                                        output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        with torch.no_grad(), indexer_ties(hf) as ties:
            logits.append(hf.eval()(ids).logits)
        assert not any(ties), ties
    err = relative_error(logits[0], logits[1])
    assert err < 1e-5, err


def test_a_checkpoint_of_another_model_is_refused_naming_the_key(tmp_path):
    from dsv4.parallel.pipeline_checkpoint import load_pipeline_checkpoint, save_pipeline_checkpoint

    model = _model("tiny")
    save_pipeline_checkpoint(tmp_path / "ck", model, [model], torch.optim.AdamW(model.parameters()))
    other = _preset_model("tiny", index_n_heads=8, vocab_size=300)
    with pytest.raises(ValueError, match=r"'model.model.embed_tokens.weight' is \(256, 64\) there, \(300, 64\) here"):
        load_pipeline_checkpoint(tmp_path / "ck", other, [other])
    deeper = _preset_model("tiny", index_n_heads=8, num_hidden_layers=5, compress_ratios=[0, 4, 128, 4, 0, 0])
    with pytest.raises(KeyError, match=r"no tensor 'model.model.layers.4."):
        load_pipeline_checkpoint(tmp_path / "ck", deeper, [deeper])
