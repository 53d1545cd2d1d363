"""The drafter-training memory plan (dsv4.plan.dspark) on the tiny V4.1 model: the target's bytes against the real
objects a rank holds, the Engram rows by hand, how the phases compose (host tables, offline, no evaluation) and the
setup's errors. Its traced activations against a measured step: tests/benchmarks (benchmarks/dspark_plan.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.plan.dspark import DSparkPlanSetup, dspark_memory_plan, trace_key
from dsv4.plan.plan import PlanSetup


def _base(**kw) -> PlanSetup:
    return PlanSetup(DSV4Config.preset("v41_tiny"), seq_len=256, **kw)


@pytest.fixture(scope="module")
def plans():
    """One online plan on 2 ranks (dp 2, ep 2) and its variants, the variants reusing its traces."""
    online = dspark_memory_plan(DSparkPlanSetup(_base(dp=2, ep=2), num_anchors=16))
    variant = lambda **kw: dspark_memory_plan(replace(online.setup, **kw), online.traces)  # noqa: E731
    return {"online": online,
            "host": dspark_memory_plan(replace(online.setup, base=replace(online.setup.base, engram_on_host=True)),
                                       online.traces),
            "no_eval": variant(evaluates=False),
            "offline": dspark_memory_plan(replace(online.setup, mode="offline"))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_target_is_the_bytes_the_rank_holds(dtype):
    """The target term: the real frozen target of EP rank 0 of 2 (routed experts sliced, float weights in the compute
    dtype as the run stores them), every parameter and buffer but the Engram tables; the Engram rows by hand:
    ceil(rows / 2) of the two tables (384 and 552 rows of 32, fp32) on each of the 2 ranks."""
    from dsv4.parallel.expert_shard import shard_experts
    from dsv4.plan.states import table_tensors
    from dsv4.speculative.target import build_frozen_target

    plan = dspark_memory_plan(DSparkPlanSetup(_base(dp=2, ep=2, compute_dtype=dtype), num_anchors=16))
    target = build_frozen_target(DSV4Config.preset("v41_tiny"), seed=0, compute_dtype=dtype)
    shard_experts(target, ep_rank=0, ep_size=2)
    tables = {id(t) for t in table_tensors(target)}
    held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
            for t in [*target.parameters(), *target.buffers()] if id(t) not in tables}
    assert plan.target_bytes == sum(held.values())
    assert plan.engram_table_bytes == (384 // 2 + 552 // 2) * 32 * 4
    assert plan.per_rank_bytes["target"] == plan.target_bytes + plan.engram_table_bytes


def test_the_phases_hold_what_the_module_docstring_says(plans):
    p = plans["online"]
    s, fixed = p.states, p.states.parameters + p.states.optimizer
    target = p.target_bytes + p.engram_table_bytes
    assert p.phase_bytes == {
        "target forward": target + fixed + p.target_forward,
        "drafter step": target + fixed + s.communication + p.features + s.gradients + p.drafter_step,
        "optimizer step": target + fixed + s.gradients + s.step_temporary,
        "decoding evaluation": target + fixed + p.gathered_drafter + p.target_forward,
    }
    assert p.total == max(p.phase_bytes.values()) and p.peak_phase == "drafter step"
    assert 0 < p.features < p.drafter_step and p.target_forward > p.features
    assert set(plans["no_eval"].phase_bytes) == {"target forward", "drafter step", "optimizer step"}


def test_engram_tables_in_host_memory_leave_every_phase(plans):
    online, host = plans["online"], plans["host"]
    rows = online.engram_table_bytes
    assert host.host_bytes == rows and online.host_bytes == 0
    assert {k: v + rows for k, v in host.phase_bytes.items()} == online.phase_bytes
    assert host.per_rank_bytes["target"] == host.target_bytes
    assert "Engram rows in host memory" in host.summary() and "host" in host.report()


def test_the_engram_traffic_of_the_target_forward_by_hand(plans):
    """v41_tiny (Engram layers 1 and 4, n-grams up to 4, 2 heads of 32), 256 tokens per rank on 2 ranks, fp32 rows:
    1536 ids per layer and lookup (256 x 3 x 2), one lookup per layer (no recompute without gradients, even with
    block recompute set). Between the ranks, per layer: the count to the other rank (8 bytes), half the ids (768 x
    8) and their rows (768 x 128): 104456 bytes, 208912 for the two layers. Host copies: 2 x 1536 ids x 8 bytes
    down, 2 x 1536 rows x 128 bytes up, the rows' time at 64 GB/s."""
    host, online = plans["host"], plans["online"]
    expected = {"lookups": 208912, "host_ids": 24576, "host_rows": 393216, "host_seconds": 393216 / 64e9}
    assert host.engram_traffic() == expected
    assert online.engram_traffic() == {**expected, "host_ids": 0, "host_rows": 0, "host_seconds": 0.0}
    assert plans["offline"].engram_traffic() == dict.fromkeys(expected, 0)
    setup = host.setup
    block = replace(setup, base=replace(setup.base, config=replace(setup.base.config, activation_checkpointing="block")))
    assert dspark_memory_plan(block, host.traces).engram_traffic() == expected
    assert "rows 0.4 MiB host -> device" in host.report()
    assert host.as_dict()["engram_traffic_per_micro_batch"] == expected


def test_offline_holds_no_target_while_it_trains(plans):
    """Offline the rows carry the features (fp32, whole rows: at CP 1 the online features' bytes); the target is
    built for the decoding evaluation only."""
    online, offline = plans["online"], plans["offline"]
    target = online.target_bytes + online.engram_table_bytes
    assert "target forward" not in offline.phase_bytes
    assert offline.features == online.features
    assert offline.phase_bytes["drafter step"] == online.phase_bytes["drafter step"] - target
    assert offline.phase_bytes["optimizer step"] == online.phase_bytes["optimizer step"] - target
    assert offline.phase_bytes["decoding evaluation"] == online.phase_bytes["decoding evaluation"]


def test_the_traces_depend_only_on_what_they_read(plans):
    setup = plans["online"].setup
    same = replace(setup, evaluates=False, base=replace(setup.base, dp=4, engram_on_host=True, reserve_bytes=2**30))
    assert trace_key(same) == trace_key(setup)
    for other in (replace(setup, num_anchors=8), replace(setup, base=replace(setup.base, ep=1)),
                  replace(setup, base=replace(setup.base, seq_len=512))):
        assert trace_key(other) != trace_key(setup)


def test_the_plan_report_and_json_name_every_term(plans):
    p = plans["online"]
    report, record = p.report(), p.as_dict()
    for term in ("target", "parameters", "gradients", "optimizer", "activations", "communication", "total",
                 "phase drafter step", "not counted"):
        assert term in report
    assert record["recipe"] == "train_dspark" and record["per_rank_bytes"]["total"] == p.total
    assert record["setup"] == {**record["setup"], "mode": "online", "num_anchors": 16, "dp": 2, "ep": 2, "world": 2}


@pytest.mark.parametrize(("change", "message"), [
    (dict(mode="both"), r"`mode`='both' must be one of online, offline"),
    (dict(num_anchors=0), r"`drafter.num_anchors` must be a positive integer, got 0"),
    (dict(base=_base(offload="optimizer")), r"`trainer.offload`='optimizer' is not planned for drafter training"),
    (dict(base=PlanSetup(DSV4Config.preset("tiny"), seq_len=256)), r"a DSpark drafter needs a DeepSeek-V4.1 model"),
])
def test_a_bad_setup_is_refused_before_anything_is_built(change, message):
    with pytest.raises(ValueError, match=message):
        dspark_memory_plan(replace(DSparkPlanSetup(_base()), **change))
