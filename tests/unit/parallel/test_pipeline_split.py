"""dsv4.parallel.pipeline's split and refusals: the FLOP-balanced split of the decoder blocks into stages against
every contiguous split enumerated (the smallest largest-stage cost, the head on the last stage), and what the
pipeline does not compose with yet refused naming the key. Its training equals one process:
tests/distributed/test_pipeline.py."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from dsv4.config import DSV4Config
from dsv4.parallel import pipeline
from dsv4.parallel.pipeline import check_pipeline, split_points, stage_indices, stage_layers


def _brute_force(blocks, head, stages):
    n, best = len(blocks), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        costs = [sum(blocks[a:b]) for a, b in zip(bounds, bounds[1:])]
        costs[-1] += head
        best = max(costs) if best is None else min(best, max(costs))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_split_is_the_min_max_of_every_contiguous_split(seed, monkeypatch):
    rng = random.Random(seed)
    blocks = [float(rng.randint(1, 20)) for _ in range(rng.randint(3, 9))]
    head = float(rng.randint(0, 30))
    monkeypatch.setattr(pipeline, "layer_costs", lambda config, seq_len: (blocks, head))
    monkeypatch.setattr(pipeline, "split_points", lambda config: list(range(1, len(blocks))))
    for stages in range(1, len(blocks) + 1):
        spans = stage_layers(None, 0, stages)
        assert [s.start for s in spans][0] == 0 and spans[-1].stop == len(blocks)
        assert all(a.stop == b.start and a.stop > a.start for a, b in zip(spans, spans[1:]))
        assert max(s.cost for s in spans) == _brute_force(blocks, head, stages), (blocks, head, stages)
        assert spans[-1].cost == sum(blocks[spans[-1].start:]) + head


def test_a_hand_case_and_the_real_flop_model():
    """Blocks 1, 2, 3, 4 and a head of 5 in 2 stages: [0, 3) costs 6, [3, 4) 4 + 5 = 9, every other split more. The
    tiny preset's 2 stages: its last block and the head (lm_head, MTP depth) weigh as much as the three others."""
    blocks, head = [1.0, 2.0, 3.0, 4.0], 5.0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "layer_costs", lambda config, seq_len: (blocks, head))
        patch.setattr(pipeline, "split_points", lambda config: [1, 2, 3])
        assert [(s.start, s.stop, s.cost) for s in stage_layers(None, 0, 2)] == [(0, 3, 6.0), (3, 4, 9.0)]
    spans = stage_layers(DSV4Config.preset("tiny"), 256, 2)
    assert [(s.start, s.stop) for s in spans] == [(0, 3), (3, 4)]
    assert stage_indices(1, 2, 2) == [1, 3] and stage_indices(0, 4, 1) == [0]


def test_v41_stages_start_where_no_layer_reads_an_earlier_stages_state():
    """v41_tiny: ratios 0, 0, 2, 2, 2, 2, 1 x 6; Full layers (kv sources) 2, 4, 6. A stage may start at 1 or 2 (the
    first compressed layer after is Full layer 2), at 4 and at 6, never at 3, 5 or 7-11 (a Reindex / Reuse layer
    would read the state of a Full layer on an earlier stage); at most 5 stages."""
    config = DSV4Config.preset("v41_tiny")
    assert split_points(config) == [1, 2, 4, 6]
    for stages in range(1, 6):
        assert {s.start for s in stage_layers(config, 256, stages)} <= {0, 1, 2, 4, 6}
    with pytest.raises(ValueError, match=r"6 stages for 12 decoder blocks that can start a stage at \[0, 1, 2, 4, 6\]"):
        stage_layers(config, 256, 6)
    assert split_points(DSV4Config.preset("tiny")) == [1, 2, 3]


@pytest.mark.parametrize(("config", "kw", "match"), [
    (DSV4Config.preset("tiny"), dict(pp=2, stages=5), r"5 stages for 4 decoder blocks"),
    (replace(DSV4Config.preset("tiny"), indexer_loss_coeff=0.1), dict(pp=2), r"`model.indexer_loss_coeff`=0.1"),
])
def test_what_the_pipeline_does_not_compose_with_is_refused(config, kw, match):
    with pytest.raises(ValueError, match=match):
        stages = kw.pop("stages", None)
        if stages is not None:
            stage_layers(config, 256, stages)
        check_pipeline(config, **kw)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match=r"`pp_schedule`='zb' must be one of gpipe, 1f1b, interleaved_1f1b"):
        pipeline.build_schedule([object()], 4, "zb", lambda out, target: out)


def test_clipping_one_stage_equals_torchs_clip_grad_norm():
    """The whole model as one stage, one process: clip_pipeline_grad_norm_ returns torch.nn.utils.clip_grad_norm_'s
    norm and leaves the same clipped gradients (a clipping norm below the gradients' own)."""
    import copy

    import torch

    from dsv4.model import build_causal_lm
    from dsv4.parallel.pipeline import DSV4PipelineStage, StageSpan, clip_pipeline_grad_norm_

    torch.manual_seed(0)
    model = build_causal_lm(DSV4Config.preset("tiny"))
    ids = torch.randint(1, 256, (1, 128), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids.roll(-1, 1), return_logits=False).loss.backward()
    other = copy.deepcopy(model)
    for p, q in zip(model.parameters(), other.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(other.parameters(), 0.1)
    stage = DSV4PipelineStage(model, StageSpan(0, 1, 0, model.config.num_hidden_layers, 0.0))
    got = clip_pipeline_grad_norm_([stage], 0.1)
    assert want > 0.2 and abs(float(got) - float(want)) <= 1e-6 * float(want)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=name)
