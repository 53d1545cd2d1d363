"""The per-segment composition of the activation peak equals a trace of the whole step (its oracle)."""

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model.model import DSV4ForCausalLM
from dsv4.plan.activations import StepTracer, plan_activations


def _tracer(mode: str, cp: int, local_len: int = 512, return_logits: bool = False, balance: str = "none"
            ) -> StepTracer:
    config = DSV4Config.preset("tiny", activation_checkpointing=mode)
    with torch.device("meta"):
        model = DSV4ForCausalLM(config)
    return StepTracer(model, 1, local_len, cp, expert_parallel=False, return_logits=return_logits, cp_balance=balance)


@pytest.mark.parametrize("mode,cp,return_logits,balance", [
    ("none", 1, False, "none"), ("block", 1, False, "none"), ("selective", 1, False, "none"),
    ("none", 2, True, "none"), ("block", 4, False, "none"), ("none", 4, False, "full")])
def test_composed_peak_matches_the_whole_step(mode, cp, return_logits, balance):
    tracer = _tracer(mode, cp, return_logits=return_logits, balance=balance)
    plan = plan_activations(tracer)
    whole = tracer.whole_step() + plan.metadata
    assert plan.peak == pytest.approx(whole, rel=0.02), (plan.peak, whole, plan.phase)


def test_recompute_saves_less_and_blocks_of_a_kind_share_a_trace():
    none, block = plan_activations(_tracer("none", 1)), plan_activations(_tracer("block", 1))
    assert block.peak < none.peak
    kinds = {seg.kind: n for seg, n in none.block_kinds()}
    assert kinds == {"ratio 0, hash, first": 1, "ratio 4": 2, "ratio 128": 1}  # tiny: ratios [0, 4, 128, 4]
    for seg, _ in block.block_kinds():  # a recomputed block keeps only its input streams ...
        assert set(seg.saved_by_component) == {"block input"}
        # ... and its recomputed internals are charged to their parts at the backward peak
        assert {"attention", "moe", "hyper_connections"} <= set(seg.backward_peak_by_component)
        assert sum(seg.backward_peak_by_component.values()) == seg.backward_peak
    for seg, _ in none.block_kinds():
        assert {"attention", "moe", "hyper_connections"} <= set(seg.saved_by_component)


def test_the_last_cp_rank_receives_more_than_an_even_share():
    one, four = plan_activations(_tracer("none", 1, local_len=2048)), plan_activations(_tracer("none", 4))
    attention = lambda plan: sum(seg.saved_by_component.get("attention", 0) for seg in plan.segments[1:-1])  # noqa: E731
    assert attention(four) > attention(one) / 4  # halo and the earlier compressed rows come on top
    assert four.peak < one.peak
    # head-tail: rank 0 holds two chunks of 256 (0 and 7); its last chunk's keys span the whole row, and its first
    # chunk's keys are padded to the same length, so it keeps more attention than the contiguous last rank
    tracer = _tracer("none", 4, balance="full")
    assert (tracer.rows, tracer.local_len, tracer.cp.rank) == (2, 256, 0)
    balanced = plan_activations(tracer)
    assert attention(four) < attention(balanced) < 2 * attention(four)


def test_v41_composed_peak_matches_the_whole_step():
    """DeepSeek-V4.1 (v41_tiny, no recompute): blocks traced by kind, each with the carry and the CSA2 shared state of
    the blocks before it, compose to the peak of a trace of the whole step."""
    from dsv4.model import build_causal_lm
    from dsv4.plan.activations import V41StepTracer, step_tracer

    with torch.device("meta"):
        model = build_causal_lm(DSV4Config.preset("v41_tiny"))
    tracer = step_tracer(model, 1, 256, 1, expert_parallel=False)
    assert isinstance(tracer, V41StepTracer)
    plan = plan_activations(tracer)
    assert {seg.kind: n for seg, n in plan.block_kinds()} == {
        "window, ratio 0, first": 1, "window, ratio 0, engram": 1, "full, ratio 2": 1, "reuse, ratio 2": 2,
        "full, ratio 2, engram": 1, "full, ratio 1": 1, "reuse, ratio 1": 3, "reindex, ratio 1": 2}
    whole = tracer.whole_step() + plan.metadata
    assert plan.peak == pytest.approx(whole, rel=0.02), (plan.peak, whole, plan.phase)


@pytest.mark.parametrize("fp8", [True, False])
def test_v41_engram_table_is_never_an_activation(fp8):
    """An Engram layer's trace does not depend on its table's size (the table is the plan's `parameters`): the same
    peaks and saved bytes with 1,000 and 1,000,000 rows, with the table in float and in the release's FP8 form (whose
    lookup reads the rows through a `uint8` view of the whole table)."""
    from dsv4.model.v41.engram import Engram
    from dsv4.plan.activations import _leaf, trace_segment

    traces = []
    for rows in (1000, 1_000_000):
        config = DSV4Config.preset("v41_tiny", engram_num_embeddings=[rows, 552])
        with torch.device("meta"):
            engram = Engram(config, 1)
        if fp8:
            engram.embed.keep_fp8()
        ids = torch.zeros(1, 64, engram.n_buckets, dtype=torch.long, device="meta")
        streams = _leaf((1, 64, config.hc_mult, config.hidden_size), torch.float32, lambda x: x)
        trace = trace_segment("engram", "engram", lambda x: engram(x, ids), streams, engram, {}, "engram")
        traces.append((trace.forward_peak, trace.retained, trace.backward_peak))
    assert traces[0] == traces[1] and traces[0][0] < 1_000_000, traces
