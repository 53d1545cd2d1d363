"""dspark_packed_forward with a uniform-token dispatcher (allgather, EP over 2 gloo ranks): both ranks run the
same padded aligned width although their rows differ in aligned length, and the features are unchanged."""

from __future__ import annotations

import pytest
import torch

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

LAYERS = [1, 3]
# v4_ratio2_tiny aligns documents to 2: rank 0 -> 4 + 2 = 6 aligned slots, rank 1 -> 6 + 10 = 16
_ROWS = {0: ([3, 1], 5), 1: ([5, 9], 15)}


def _model():
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset("v4_ratio2_tiny"))


def _inputs(rank: int):
    lengths, width = _ROWS[rank]
    ids = torch.randint(1, 256, (1, width), generator=torch.Generator().manual_seed(10 + rank))
    return ids, torch.tensor([lengths])


def _body(rank: int, world_size: int) -> dict:
    from dsv4.parallel.expert_shard import apply_expert_parallel
    from dsv4.speculative import capture_dspark_features, model_needs_uniform_tokens

    model = _model()
    apply_expert_parallel(model, "allgather")  # WORLD = the EP group: each rank holds half of the experts
    widths = []
    model.model.register_forward_pre_hook(lambda _m, args: widths.append(int(args[0].shape[1])))
    ids, lens = _inputs(rank)
    feats = capture_dspark_features(model, ids, lens, LAYERS)
    return {"widths": widths, "uniform": model_needs_uniform_tokens(model),
            "hidden": feats.hidden_states.tolist(), "last": feats.last_hidden_state.tolist()}


def test_uniform_dispatcher_pads_every_rank_to_the_longest_row():
    from dsv4.speculative import capture_dspark_features

    results = run_on_ranks(_body, world_size=2)
    assert [r["uniform"] for r in results] == [True, True]
    assert [r["widths"] for r in results] == [[16], [16]]  # not [6] and [16]
    model = _model()  # every expert local: the unsynchronised single-rank reference
    for rank, r in enumerate(results):
        ids, lens = _inputs(rank)
        ref = capture_dspark_features(model, ids, lens, LAYERS)
        assert ref.layout.aligned_length == (6, 16)[rank]
        torch.testing.assert_close(torch.tensor(r["hidden"]), ref.hidden_states, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(r["last"]), ref.last_hidden_state, atol=1e-5, rtol=0)
