"""The memory plan of pipeline stages (dsv4.plan.stages): each rank's state bytes are its real stage modules'
(dsv4.parallel.pipeline.DSV4PipelineStage of a built model), the schedules' microbatches in flight, the recipe's
``pp`` keys and what it refuses. The engine's in-flight counts and the ``pp sends`` bytes are checked against gloo
runs in tests/distributed/test_pipeline.py."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model import build_causal_lm
from dsv4.parallel.pipeline import DSV4PipelineStage, stage_indices, stage_layers
from dsv4.plan.plan import PlanSetup, memory_plan
from dsv4.plan.stages import bubble, in_flight_timeline, peak_held

SEQ = 512


@pytest.fixture(scope="module")
def pipeline_plan():
    """V4 tiny, pp=2 x 2 virtual stages, interleaved 1F1B, 4 microbatches, one rank per stage."""
    return memory_plan(PlanSetup(DSV4Config.preset("tiny"), seq_len=SEQ, pp=2, pp_virtual=2,
                                 pp_schedule="interleaved_1f1b", microbatches=4))


def test_each_rank_holds_its_real_stages_parameters(pipeline_plan):
    torch.manual_seed(0)
    model = build_causal_lm(DSV4Config.preset("tiny"))
    spans = stage_layers(model.config, SEQ, 4)
    assert [p.stages.spans for p in pipeline_plan.ranks] == [[spans[i] for i in stage_indices(r, 2, 2)]
                                                            for r in range(2)]
    for plan in pipeline_plan.ranks:
        modules = [DSV4PipelineStage(model, s) for s in plan.stages.spans]
        params = {id(p): p for m in modules for p in m.parameters()}.values()
        buffers = {id(b): b for m in modules for b in m.buffers()}.values()
        stored = sum(p.numel() * 4 for p in params)  # fp32 master weights, one rank per stage: nothing sharded
        trained = sum(p.numel() * 4 for p in params if p.requires_grad)  # the frozen indexers (blocks 1, 3): none
        assert (trained < stored) == (plan.stages.rank == 1)
        assert plan.states.parameters == stored + sum(b.numel() * b.element_size() for b in buffers)
        assert plan.states.gradients == trained and plan.states.reduce_buffer == trained  # sharded, and unsharded
        assert plan.states.gathered == stored  # computing in fp32: the gathered copy is the size of the shard
    # the MTP depth embeds with the model's embedding: the first and the last stage both hold it
    embedding = model.model.embed_tokens.weight.numel() * 4
    every = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    assert sum(p.states.parameters for p in pipeline_plan.ranks) == every + embedding


def test_the_largest_rank_decides_and_the_report_lists_every_rank(pipeline_plan):
    assert pipeline_plan.total == max(p.total for p in pipeline_plan.ranks)
    data = json.loads(json.dumps(pipeline_plan.as_dict()))
    assert data["pipeline"]["pp"] == 2 and data["setup"]["gpus"] == 2
    assert [r["stages"] for r in data["pipeline"]["ranks"]] == [[[0, 0, 1], [2, 2, 3]], [[1, 1, 2], [3, 3, 4]]]
    assert data["communication_per_step"]["microbatches"] == 4
    report = pipeline_plan.report()
    assert "pp 2 x 2 virtual, interleaved_1f1b, 4 microbatches per step" in report
    assert "rank 0:" in report and "rank 1:" in report and "receive buffers" in report
    rows = {t.kind: t for t in pipeline_plan.comm.traffic}
    assert rows["pp sends"].sent > 0 and rows["pp sends"].link == "nvlink"
    assert pipeline_plan.comm.bubble == bubble("interleaved_1f1b", 2, 2, 4) == 1 / 8


def test_schedules_in_flight_worked_by_hand():
    # GPipe: every forward first; 1F1B: pp - rank forwards, then one backward and one forward in turn
    assert [t[0] for t in in_flight_timeline("gpipe", 2, 1, 3, 0)] == [1, 2, 3, 2, 1, 0]
    assert [t[0] for t in in_flight_timeline("1f1b", 2, 1, 3, 0)] == [1, 2, 1, 2, 1, 0]
    assert [t[1] for t in in_flight_timeline("1f1b", 2, 1, 3, 1)] == [1, 0, 1, 0, 1, 0]
    # held bytes: the weighted peak over the timeline
    assert peak_held([{0: 1, 2: 0}, {0: 2, 2: 1}, {0: 1, 2: 1}], {0: 10, 2: 100}) == 120


def test_pipeline_keys_and_what_they_refuse():
    config = DSV4Config.preset("tiny")
    with pytest.raises(ValueError, match=r"pp_virtual`=2 needs"):
        in_flight_timeline("1f1b", 2, 2, 4, 0)
    with pytest.raises(ValueError, match=r"`pp_schedule`=interleaved_1f1b with pp=2, pp_virtual=2 and 5 microbatches"):
        in_flight_timeline("interleaved_1f1b", 2, 2, 5, 0)
    with pytest.raises(ValueError, match=r"host offload is not planned under a pipeline"):
        memory_plan(PlanSetup(config, seq_len=SEQ, pp=2, offload="optimizer"))
    with pytest.raises(ValueError, match=r"`pp_schedule`='zb' must be one of"):
        memory_plan(PlanSetup(config, seq_len=SEQ, pp=2, pp_schedule="zb"))
    with pytest.raises(ValueError, match=r"`pp` x virtual stages = 8 stages for 4 decoder blocks"):
        memory_plan(PlanSetup(config, seq_len=SEQ, pp=8, microbatches=8))
    with pytest.raises(ValueError, match=r"`pp_schedule`=1f1b needs at least pp=2 microbatches per step, got 1 .* "
                                         r"raise global_batch_size"):
        memory_plan(PlanSetup(config, seq_len=SEQ, pp=2))
