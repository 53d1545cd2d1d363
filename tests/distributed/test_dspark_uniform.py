"""dspark_packed_forward with a uniform-token dispatcher (allgather, EP over 2 gloo ranks): both ranks run the
same padded aligned width although their rows differ in aligned length, and the features are unchanged; for a
DeepSeek-V4 and a V4.1 target (V4.1's ratios 2 and 1 also align documents to 2)."""

from __future__ import annotations

import pytest
import torch

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

LAYERS = [1, 3]
# both presets align documents to 2: rank 0 -> 4 + 2 = 6 aligned slots, rank 1 -> 6 + 10 = 16
_ROWS = {0: ([3, 1], 5), 1: ([5, 9], 15)}
PRESETS = ("v4_ratio2_tiny", "v41_tiny")


def _model(preset: str):
    from dsv4.config import DSV4Config
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm

    torch.manual_seed(0)
    config = DSV4Config.preset(preset)
    return build_causal_lm(config, tokenizer=ByteTokenizer()) if config.model_type == "deepseek_v41" else \
        build_causal_lm(config)


def _inputs(rank: int):
    lengths, width = _ROWS[rank]
    ids = torch.randint(1, 256, (1, width), generator=torch.Generator().manual_seed(10 + rank))
    return ids, torch.tensor([lengths])


def _body(rank: int, world_size: int) -> dict:
    from dsv4.parallel.expert_shard import apply_expert_parallel
    from dsv4.speculative import capture_dspark_features, model_needs_uniform_tokens

    out = {}
    for preset in PRESETS:
        model = _model(preset)
        apply_expert_parallel(model, "allgather")  # WORLD = the EP group: each rank holds half of the experts
        widths = []
        model.model.register_forward_pre_hook(lambda _m, args: widths.append(int(args[0].shape[1])))
        ids, lens = _inputs(rank)
        feats = capture_dspark_features(model, ids, lens, LAYERS)
        out[preset] = {"widths": widths, "uniform": model_needs_uniform_tokens(model),
                       "hidden": feats.hidden_states.tolist(), "last": feats.last_hidden_state.tolist()}
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_body, world_size=2)


@pytest.mark.parametrize("preset", PRESETS)
def test_uniform_dispatcher_pads_every_rank_to_the_longest_row(results, preset):
    from dsv4.speculative import capture_dspark_features

    runs = [r[preset] for r in results]
    assert [r["uniform"] for r in runs] == [True, True]
    assert [r["widths"] for r in runs] == [[16], [16]]  # not [6] and [16]
    model = _model(preset)  # every expert local: the unsynchronised single-rank reference
    for rank, r in enumerate(runs):
        ids, lens = _inputs(rank)
        ref = capture_dspark_features(model, ids, lens, LAYERS)
        assert ref.layout.aligned_length == (6, 16)[rank]
        torch.testing.assert_close(torch.tensor(r["hidden"]), ref.hidden_states, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(r["last"]), ref.last_hidden_state, atol=1e-5, rtol=0)
