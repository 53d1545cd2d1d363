"""DSpark capture with context parallelism: on 2 and 4 gloo ranks, every rank's features (the whole rows, gathered
over the CP group) equal the single-rank capture of the same packed rows.

Tiny preset (ratios 0 / 4 / 128: shard multiple 128): two rows of documents, one spanning rank boundaries, one
shorter than the sliding window, and a row whose aligned width is not a multiple of CP x 128 (right-padded).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

LAYERS = [1, 3]
LENGTHS = [[300, 5, 140], [700, 0, 0]]


def _model():
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset("tiny"))


def _inputs():
    lens = torch.tensor(LENGTHS)
    ids = torch.randint(1, 256, (2, int(lens.sum(1).max())), generator=torch.Generator().manual_seed(4))
    return ids, lens


def _body(rank: int, world_size: int) -> dict:
    from dsv4.cp import CPContext
    from dsv4.speculative import capture_dspark_features

    cp = CPContext(dist.new_group(list(range(world_size))))
    ids, lens = _inputs()
    widths = []
    model = _model()
    model.model.register_forward_pre_hook(lambda _m, args: widths.append(int(args[0].shape[1])))
    feats = capture_dspark_features(model, ids, lens, LAYERS, cp=cp)
    return {"hidden": feats.hidden_states, "last": feats.last_hidden_state, "widths": widths,
            "traffic": cp.traffic.as_dict()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_capture_equals_one_rank(world_size):
    from dsv4.speculative import capture_dspark_features

    results = run_on_ranks(_body, world_size)
    ids, lens = _inputs()
    ref = capture_dspark_features(_model(), ids, lens, LAYERS)
    aligned = ref.layout.aligned_length
    padded = -(-aligned // (world_size * 128)) * world_size * 128
    for r in results:
        assert r["widths"] == [padded // world_size]  # each rank ran its slice of the padded aligned rows
        torch.testing.assert_close(r["hidden"], ref.hidden_states, atol=1e-5, rtol=0)
        torch.testing.assert_close(r["last"], ref.last_hidden_state, atol=1e-5, rtol=0)
    assert results[1]["traffic"]["halo"]["bytes_received"] > 0  # the model really ran across ranks
