"""dsv4.training.resume: a checkpoint's loop state rewritten for a resume under another layout (hand-computed
counts on ``meta.pt`` dicts shaped as Lightning 2.6 writes them; the recipe-level resume is
tests/e2e/test_resume_layout.py)."""

from __future__ import annotations

import copy
import logging

import pytest

from dsv4.training.resume import LAYOUT_KEY, RunLayout, adapt_to_layout


def _counts(processed: int) -> dict[str, int]:
    # saved in on_train_batch_end: the batch is processed, not yet completed
    return {"ready": processed, "started": processed, "processed": processed, "completed": processed - 1}


def _meta(layout: RunLayout, processed: int, earlier_epochs: int = 0, dataset_len: int = 100,
          global_position: int | None = None) -> dict:
    """``processed`` micro-batches into the current epoch (``earlier_epochs`` more in the total)."""
    rows = processed * layout.rows_per_micro_batch
    return {
        LAYOUT_KEY: layout.as_dict(),
        "loops": {"fit_loop": {"epoch_loop.batch_progress": {
            "current": _counts(processed), "total": _counts(processed + earlier_epochs), "is_last_batch": False}}},
        "DSV4DataModule": {"sampler": {"epoch": 1, "global_position": rows if global_position is None else
                                       global_position, "dataset_len": dataset_len, "dp_size": layout.dp,
                                       "seed": 0, "shuffle": True, "drop_last": False}},
    }


def _progress(meta: dict) -> dict:
    return meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]


DP2 = RunLayout(dp=2, micro_batch_size=1, accumulation=2)  # global batch 4


@pytest.mark.parametrize("now, batches", [
    (RunLayout(dp=1, micro_batch_size=1, accumulation=4), 24),  # 24 rows of 1 on 1 replica
    (RunLayout(dp=4, micro_batch_size=1, accumulation=1), 6),
    (RunLayout(dp=1, cp=2, micro_batch_size=2, accumulation=2), 12),
    (RunLayout(dp=2, ep=2, micro_batch_size=1, accumulation=2), 12),  # only ep changes: nothing to rescale
])
def test_the_epochs_micro_batches_are_counted_in_the_new_layout(now, batches):
    """Saved at dp=2 after 6 optimizer steps of 2 micro-batches (12 micro-batches, 24 rows) of this epoch, and 50
    micro-batches of earlier epochs: the same 24 rows in the new layout's micro-batches; every counter (total too)
    shifts by the same amount, so Lightning restarts at the same stage (after a batch's end, before the next)."""
    meta = _meta(DP2, processed=12, earlier_epochs=50)
    saved = adapt_to_layout(meta, now)
    assert saved == DP2
    assert _progress(meta)["current"] == _counts(batches)
    assert _progress(meta)["total"] == _counts(batches + 50)
    assert batches % now.accumulation == 0  # a whole number of optimizer steps


def test_the_same_layout_changes_nothing():
    meta = _meta(DP2, processed=12)
    before = copy.deepcopy(meta)
    adapt_to_layout(meta, DP2)
    assert meta == before


def test_an_exhausted_epoch_stays_exhausted_under_the_new_layout():
    """The saving layout used up its epoch (the data position says all 101 rows): the resumed count is the new
    layout's whole epoch (ceil(101 / 4) = 26 rows per replica, 13 micro-batches of 2), so Lightning starts the next
    epoch, even though 25 steps x 4 rows = 100 do not divide into the new micro-batches exactly."""
    meta = _meta(RunLayout(dp=1, micro_batch_size=1, accumulation=4), processed=101, dataset_len=101,
                 global_position=101)
    adapt_to_layout(meta, RunLayout(dp=4, micro_batch_size=2, accumulation=1))
    assert _progress(meta)["current"] == _counts(13)


def test_another_global_batch_size_is_refused_when_the_rows_are_not_whole_steps():
    meta = _meta(DP2, processed=6)  # 3 steps of 4 rows: 12 rows
    with pytest.raises(ValueError, match=r"stopped after 12 rows of its epoch, not a whole number of optimizer steps "
                                         r"of global_batch_size=8 .*saved global_batch_size=4 or one dividing 12"):
        adapt_to_layout(meta, RunLayout(dp=2, micro_batch_size=1, accumulation=4), source="ckpt")


def test_another_global_batch_size_that_fits_is_a_warning(caplog):
    meta = _meta(DP2, processed=12)  # 24 rows: 4 steps of 6 rows
    caplog.set_level(logging.INFO, logger="dsv4")
    adapt_to_layout(meta, RunLayout(dp=3, micro_batch_size=1, accumulation=2), source="ckpt")
    assert _progress(meta)["current"] == _counts(8)
    assert ("resuming ckpt, written under dp=2 cp=1 ep=1 (micro_batch_size=1, global_batch_size=4), under dp=3"
            in caplog.text)
    assert any(r.levelname == "WARNING" and "global_batch_size 4 in ckpt, 6 now" in r.message for r in caplog.records)


def test_a_loop_count_the_data_position_contradicts_is_refused():
    meta = _meta(DP2, processed=12, global_position=20)
    with pytest.raises(ValueError, match=r"data position says 20 rows of epoch 1 were consumed, the loop counts 12 "
                                         r"micro-batches of 2 rows = 24"):
        adapt_to_layout(meta, RunLayout(dp=1, accumulation=4))


def test_a_checkpoint_without_its_layout_is_refused():
    meta = _meta(DP2, processed=12)
    del meta[LAYOUT_KEY]
    with pytest.raises(KeyError, match=r"ckpt has no `dsv4_layout` entry"):
        adapt_to_layout(meta, DP2, source="ckpt")


def test_the_recipe_refuses_a_layout_it_cannot_resume_before_training(tmp_path):
    """``run_finetune`` checks the resume in the launching process: the checkpoint's epoch consumed 12 rows, which
    ``global_batch_size=8`` cannot continue in whole steps; refused before the run writes its resolved config."""
    import torch

    from dsv4.training.run import run_finetune
    from tests.unit.training.test_run import FAST, _compose

    ckpt = tmp_path / "step3.ckpt"
    ckpt.mkdir()
    torch.save(_meta(DP2, processed=6, dataset_len=785), ckpt / "meta.pt")  # 3 steps of 4 rows
    (ckpt / ".metadata").write_bytes(b"")  # complete as far as the resume's choice goes: never read
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ValueError, match=r"step3.ckpt stopped after 12 rows of its epoch, not a whole number of "
                                         r"optimizer steps of global_batch_size=8"):
        run_finetune(_compose([*FAST, "global_batch_size=8", f"checkpoint.resume={ckpt}"]), run)
    assert not (run / "resolved_config.yaml").exists()
