"""Communication in the plan (dsv4.plan.comm) and the reserve of the verdict: which link a group runs over, FSDP's
bytes by unit (mixed precision, frozen parameters, one-rank meshes, units called twice), the stand-ins' CP and EP
counts, the step-time model, the table in the report and the JSON, the reserve, and ranking what fits by step time.
The counts against the bytes real CPU runs move: tests/distributed/test_comm_plan.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.peft import LoRAConfig
from dsv4.plan.comm import KINDS, CommPlan, LinkSpeeds, Traffic, engram_traffic, group_link, step_flops
from dsv4.plan.plan import DEFAULT_RESERVE_GIB, GIB, PlanSetup, memory_plan
from dsv4.plan.suggest import Change, Planned, search

TINY2 = dict(num_hidden_layers=2, compress_ratios=[0, 4])  # one window block, one CSA block (with its indexer)


def _tiny(**kw) -> DSV4Config:
    return DSV4Config.preset("tiny", **TINY2, **kw)


@pytest.fixture(scope="module")
def plans():
    """The 2-block tiny model at 256 tokens, world 2: dp 2 in fp32, dp 2 in bf16, ep 2 in bf16, cp 2 in bf16."""
    def plan(**kw):
        return memory_plan(PlanSetup(_tiny(activation_checkpointing="block"), seq_len=256, **kw))

    return {"dp": plan(dp=2), "dp_bf16": plan(dp=2, compute_dtype=torch.bfloat16),
            "ep": plan(dp=2, ep=2, compute_dtype=torch.bfloat16),
            "cp": plan(cp=2, compute_dtype=torch.bfloat16)}


@pytest.mark.parametrize("world,size,stride,link", [
    (64, 8, 1, "nvlink"),  # CP 8 / EP 8: consecutive ranks, one node each
    (64, 16, 1, "infiniband"),  # CP 16 spans two nodes
    (64, 64, 1, "infiniband"),  # FSDP over dp x cp
    (8, 8, 1, "nvlink"),  # one node
    (64, 8, 8, "infiniband"),  # the experts' edp mesh: one rank of each node
    (8, 2, 4, "nvlink"),  # edp of world 8, ep 4: ranks r and r + 4, one node
    (64, 1, 1, "-"),  # one rank moves nothing
    (12, 3, 1, "infiniband"),  # CP 3 on nodes of 8: the group of ranks 6, 7, 8 spans two
])
def test_group_link(world, size, stride, link):
    assert group_link(world, size, stride, gpus_per_node=8) == link


def test_fsdp_gathers_in_the_compute_dtype_and_reduces_in_fp32(plans):
    """dp 2: a rank sends its shard of each unit to the other rank (and receives the other's) at each gather, twice
    per step for every unit but the root (forward, backward), once for the root; fp32 -> bf16 halves what the
    blocks and experts gather (the fp32 modules, units of their own under bf16, stay fp32); the gradients are
    reduced in fp32 either way."""
    fp32, bf16 = plans["dp"].comm.by_kind(), plans["dp_bf16"].comm.by_kind()
    gathers = lambda c: c["fsdp all-gather"].sent + c["fsdp all-gather, experts"].sent  # noqa: E731
    reduces = lambda c: c["fsdp reduce-scatter"].sent + c["fsdp reduce-scatter, experts"].sent  # noqa: E731
    dp = plans["dp"]
    shards = memory_plan(replace(dp.setup, offload="optimizer"), dp.activations).offload.parameters  # every unit's
    root = dp.states.root_gathered // 2  # the root's shard: its gathered parameters over 2 ranks
    assert gathers(fp32) == 2 * shards - root
    assert fp32["fsdp all-gather"].calls + fp32["fsdp all-gather, experts"].calls == 2 * 6 + 1  # 3 blocks, 3 experts
    assert reduces(fp32) == dp.states.gradients and fp32["fsdp reduce-scatter"].calls == 3 + 1
    assert fp32["fsdp all-gather"].sent == fp32["fsdp all-gather"].received  # each way the same
    assert gathers(fp32) / 2 < gathers(bf16) < gathers(fp32) * 0.6  # mostly halved: the fp32 units are small
    assert reduces(bf16) == reduces(fp32)


def test_a_frozen_base_is_gathered_never_reduced():
    lora = memory_plan(PlanSetup(_tiny(), seq_len=256, dp=2, compute_dtype=torch.bfloat16,
                                 lora=LoRAConfig(rank=4, alpha=8.0))).comm.by_kind()
    full = memory_plan(PlanSetup(_tiny(), seq_len=256, dp=2, compute_dtype=torch.bfloat16)).comm.by_kind()
    assert lora["fsdp all-gather"].sent > full["fsdp all-gather"].sent  # the base plus the adapters, in bf16
    assert 0 < lora["fsdp reduce-scatter"].sent < full["fsdp reduce-scatter"].sent / 10  # the adapters only


def test_expert_parallelism_moves_tokens_not_expert_weights(plans):
    """ep 2 of world 2: the experts' edp mesh is one rank (no gather, no reduce), and the dispatcher's all-to-alls
    carry (ep - 1) / ep of the (token, expert) pairs' bf16 rows out and back, in forward, the recomputed forward and
    backward, plus the per-expert counts (int64) of each forward."""
    ep, c = plans["ep"].comm.by_kind(), _tiny()
    assert ep["fsdp all-gather, experts"].sent == ep["fsdp reduce-scatter, experts"].sent == 0
    assert ep["fsdp all-gather, experts"].link == "-" and ep["ep dispatch + combine"].link == "nvlink"
    moe_layers = c.num_hidden_layers + c.num_nextn_predict_layers
    rows = 256 * c.num_experts_per_tok // 2 * c.hidden_size * 2  # pairs leaving the rank x d x bf16
    counts = c.n_routed_experts // 2 * 8  # to the other rank: its experts' counts
    per_layer = 2 * (counts + 2 * rows) + 2 * rows  # forward and recomputed: dispatch and combine; backward: both
    assert ep["ep dispatch + combine"].sent == ep["ep dispatch + combine"].received == moe_layers * per_layer
    assert plans["dp"].comm.by_kind()["ep dispatch + combine"].sent == 0


def test_the_allgather_dispatcher_gathers_every_token():
    alltoall, allgather = (memory_plan(PlanSetup(_tiny(), seq_len=256, dp=2, ep=2, dispatcher=d)).comm.by_kind()
                           ["ep dispatch + combine"].sent for d in ("alltoall", "allgather"))
    assert allgather > alltoall > 0  # the tokens to every rank, and the fp32 partial sums back
    with pytest.raises(ValueError, match="`dispatcher`='nccl' must be one of"):
        memory_plan(PlanSetup(_tiny(), seq_len=256, dp=2, ep=2, dispatcher="nccl"))


def test_cp_counts_the_last_ranks_exchanges_and_a_compressor_called_twice(plans):
    """cp 2: the last rank receives its halo, the compressors' boundaries and the earlier compressed rows and index
    keys, and sends back the differentiable ones' gradients (none for the frozen indexer's keys). Under CP an overlap
    compressor runs twice in forward (its boundary for the next rank): FSDP gathers it at each call, and in backward
    once per call backward reaches (the attention's: twice; the frozen indexer's: once, by FSDP's prefetch)."""
    from dsv4.plan.comm import unit_gathers

    cp = plans["cp"]
    traffic = cp.activations.traffic()
    assert {"halo", "compressor_halo", "index_compressor_halo", "compressed_gather", "index_key_gather",
            "metadata"} <= set(traffic)
    assert traffic["index_key_gather"]["bytes_received"] > 0 and "index_key_gather.backward" not in traffic
    # block recompute: the forward's exchanges run again in backward, their gradients go back once
    assert 2 * traffic["halo.backward"]["bytes_sent"] == traffic["halo"]["bytes_received"]
    row = cp.comm.by_kind()["cp exchanges"]
    assert row.received == sum(r["bytes_received"] for r in traffic.values()) > row.sent > 0
    block = cp.activations.segments[2].unit_calls  # block 1 (ratio 4)
    assert block["self_attn.compressor"] == [2, 2] and block["self_attn.indexer.compressor"] == [2, 0]
    assert plans["dp_bf16"].activations.segments[2].unit_calls["self_attn.compressor"] == [1, 1]
    with torch.device("meta"):
        from dsv4.model import build_causal_lm
        from dsv4.parallel.wrap import fsdp_units

        model = build_causal_lm(cp.setup.config)
    units = fsdp_units(model, torch.bfloat16)
    names = {m: n for n, m in model.named_modules()}
    gathers = {names[u.module]: n for u, n in zip(units, unit_gathers(model, units, cp.activations.segments).values())}
    assert gathers["model.layers.1.self_attn.compressor"] == 4
    assert gathers["model.layers.1.self_attn.indexer.compressor"] == 3
    assert gathers["model.layers.0"] == 2 and gathers[""] == 1  # a block; the root


def test_host_offload_copies_each_gathered_shard_and_each_gradient():
    base = PlanSetup(_tiny(), seq_len=256, dp=2)
    off = memory_plan(replace(base, offload="optimizer"))
    kinds = off.comm.by_kind()
    h2d, d2h = kinds["host -> device"], kinds["device -> host"]
    assert h2d.received == off.offload.host_to_device and h2d.sent == 0 and h2d.link == "pcie"
    assert d2h.sent == off.offload.device_to_host == off.states.gradients and d2h.received == 0
    fsdp = kinds["fsdp all-gather"].sent + kinds["fsdp all-gather, experts"].sent
    assert h2d.received == fsdp  # dp 2, fp32: each gather copies the shard it contributes
    assert memory_plan(base).comm.by_kind()["host -> device"].received == 0


def test_step_time_overlaps_fsdp_and_the_copies_with_compute_and_adds_ep_and_cp():
    speeds = LinkSpeeds(nvlink_gb_s=100, infiniband_gb_s=10, pcie_gb_s=50, tflops=100)
    t = lambda kind, n, link: Traffic(kind, n, n, 1, link, 2, n / speeds.bandwidth(link))  # noqa: E731
    rows = [t("fsdp all-gather", 3 * 10**9, "infiniband"), t("ep dispatch + combine", 10**11, "nvlink"),
            t("cp exchanges", 2 * 10**11, "nvlink"), t("host -> device", 10**11, "pcie"),
            t("device -> host", 5 * 10**10, "pcie")]
    plan = CommPlan(rows, flops=10**14, model_flops=7.5 * 10**13, speeds=speeds)
    assert plan.compute_seconds == pytest.approx(1.0)
    assert plan.overlapped_seconds == pytest.approx(0.3 + 2.0)  # FSDP + the busier copy direction
    assert plan.exposed_seconds == pytest.approx(3.0)
    assert plan.step_seconds == pytest.approx(2.3 + 3.0) and plan.serial_seconds == pytest.approx(1 + 0.3 + 3 + 3)
    with pytest.raises(ValueError, match="`tflops` must be a positive number"):
        LinkSpeeds(tflops=0).check()


def test_flops_add_the_recomputed_forward_and_lora_skips_the_base_weight_gradients():
    c = _tiny()
    none = step_flops(replace(c, activation_checkpointing="none"), 256, 1)
    block = step_flops(replace(c, activation_checkpointing="block"), 256, 1)
    lora = step_flops(replace(c, activation_checkpointing="none"), 256, 1, lora=True)
    assert none[0] == none[1] == block[1] and none[0] < block[0] < none[0] * 4 / 3 + 1
    assert lora[0] < none[0] * 0.7
    two = step_flops(c, 256, 2)  # the busier of 2 CP ranks (the later positions attend to more)
    assert none[0] / 2 < two[0] < none[0]


def test_engram_lookups_are_counted_for_v41_only():
    v41 = DSV4Config.preset("v41_tiny")
    moved, calls = engram_traffic(v41, 256, 2, torch.float32, fp8=False)
    ids = 256 * (v41.engram_max_ngram_size - 1) * v41.engram_n_heads // 2  # every id distinct, half another rank's
    assert moved == len(v41.engram_layer_ids) * (8 + ids * 8 + ids * v41.engram_head_dim * 4) and calls > 0
    assert engram_traffic(v41, 256, 1, torch.float32, fp8=False) == (0, 0)
    assert engram_traffic(DSV4Config.preset("tiny"), 256, 2, torch.float32, fp8=False) == (0, 0)


def test_the_table_is_in_the_report_and_the_json(plans):
    plan = plans["cp"]
    report = plan.report()
    assert "communication per rank and step" in report and "step estimate" in report
    for kind in KINDS:
        assert kind in report, kind
    data = json.loads(json.dumps(plan.as_dict()))
    comm = data["communication_per_step"]
    assert [k["kind"] for k in comm["kinds"]] == list(KINDS)
    assert comm["step_seconds"] == plan.comm.step_seconds > 0 and comm["speeds"]["nvlink_gb_s"] == 450
    assert "step about" in plan.summary()


def test_the_verdict_keeps_the_reserve_free(plans):
    """A plan fits when its total is at most the device memory less the reserve: one byte more and it does not."""
    plan = plans["dp"]
    total, reserve = plan.total, 3 * GIB
    at = memory_plan(replace(plan.setup, device_memory_bytes=total + reserve, reserve_bytes=reserve), plan.activations)
    over = memory_plan(replace(at.setup, device_memory_bytes=total + reserve - 1), plan.activations)
    assert at.fits and not over.fits and at.total == over.total == total
    assert "less a 3.00 GiB reserve" in over.report() and "DOES NOT FIT" in over.summary()
    data = over.as_dict()
    assert data["reserve_bytes"] == reserve and data["usable_memory_bytes"] == total - 1 and data["fits"] is False
    none = memory_plan(replace(plan.setup, device_memory_bytes=total, reserve_bytes=0), plan.activations)
    assert none.fits and "reserve" not in none.summary()
    with pytest.raises(ValueError, match="the reserve must be a number of bytes >= 0"):
        memory_plan(replace(plan.setup, reserve_bytes=-1))


def test_plan_options_defaults_are_the_libraries():
    from dsv4.training.options.plan import PlanOptions, plan_options
    from dsv4.training.planning import link_speeds

    options = PlanOptions()
    assert options.reserve_gib == DEFAULT_RESERVE_GIB and options.rank_by == "cost"
    assert link_speeds(options) == LinkSpeeds()
    assert plan_options({"reserve_gib": 0, "rank_by": "step_time", "tflops": 800}).tflops == 800
    for bad, needle in (({"reserve_gib": -1}, "`plan.reserve_gib` must be a number of GiB >= 0"),
                        ({"rank_by": "speed"}, "`plan.rank_by` must be one of cost, step_time"),
                        ({"nvlink_gb_s": 0}, "`plan.nvlink_gb_s` must be a positive number"),
                        ({"gpus_per_node": 0}, "`plan.gpus_per_node` must be a positive integer")):
        with pytest.raises(ValueError, match=needle):
            plan_options(bad)


class _Timed:
    """A planner whose candidates fit with known totals and step times: a=1 (cost 1, slow), b=1 (cost 2, fast),
    c=1 (cost 3, fastest) each fit alone."""

    device_memory_bytes = 80
    reserve_bytes = 20
    SECONDS = {"a": 3.0, "b": 2.0, "c": 1.0}

    def estimate(self, changes):
        return self.plan(changes)

    def plan(self, changes):
        return Planned(70, seconds=sum(self.SECONDS[c.group] for c in changes))


def test_suggest_ranks_by_step_time_on_request():
    changes = [Change(g, ((g, 1),), cost) for g, cost in (("a", 1), ("b", 2), ("c", 3))]
    cheapest = search(changes, _Timed(), count=2)
    fastest = search(changes, _Timed(), count=2, rank_by="step_time")
    assert [s.overrides for s in cheapest.suggestions] == [["a=1"], ["b=1"]]
    assert [s.overrides for s in fastest.suggestions] == [["c=1"], ["b=1"]]
    assert fastest.suggestions[0].seconds == 1.0 and "step about 1.00 s" in fastest.report()
    assert "fastest first" in fastest.report() and "cheapest first" in cheapest.report()
    assert "less the" in fastest.report() and fastest.as_dict()["reserve_bytes"] == 20
    assert fastest.as_dict()["rank_by"] == "step_time" and fastest.as_dict()["fits_with"][0]["step_seconds"] == 1.0
    with pytest.raises(ValueError, match="rank_by must be one of cost, step_time"):
        search(changes, _Timed(), rank_by="speed")


@pytest.mark.parametrize("length,routed", [(32768, True), (65536, False)])
def test_the_cp_stand_in_summaries_follow_the_real_limits(length, routed):
    """V4.1 (shard multiple 2), CP 2, one document of 2 x ``length`` tokens: the last rank's chunk starts at
    ``length``. At 32768 (16384 shard multiples, under the summaries' 32767) it continues the document: a halo and
    the earlier compressed rows arrive (the stand-in once wrote the last chunk's tail, 32768 multiples, into the
    field's flag bit, and planned no exchange at 64K tokens). At 65536 the chunk's position is past what a summary
    holds: the real run refuses it, the stand-in routes nothing."""
    from dsv4.plan.stand_ins import PlanCP, plan_metadata

    meta = plan_metadata(DSV4Config.preset("v41_tiny"), 1, length, PlanCP(1, 2))
    received = sum(t.hi - t.lo for plan in meta.routes.preceding.values() for ts in plan.recvs.values() for t in ts)
    assert (meta.routes.halo.pairs == ((0, 0, 1, 0),)) is routed and (received > 0) is routed


def test_v41_compute_is_not_estimated():
    """dsv4/flops.py counts V4's attention; V4.1's CSA2 layers would count as dense: no compute time for V4.1."""
    assert step_flops(DSV4Config.preset("v41_tiny"), 256, 1) is None
    plan = CommPlan([], None, None)
    assert plan.compute_seconds == 0 and "not estimated" in plan.report() and "compute not estimated" in plan.summary()


@pytest.mark.parametrize("fp8,dtype", [(False, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16)])
def test_engram_tables_in_host_memory_copy_the_rows_each_rank_serves(fp8, dtype):
    """``engram_on_host``: per Engram layer and lookup (block recompute: two), the ids go device -> host (int64) and
    the rows a rank serves (as many as it asks, every id distinct) come back host -> device in the FP8 form's bytes
    or the compute dtype, counted as their own exposed kind; nothing without the option, or on a V4 model."""
    v41 = DSV4Config.preset("v41_tiny", activation_checkpointing="block")
    setup = PlanSetup(v41, seq_len=256, dp=2, compute_dtype=dtype, engram_fp8=fp8)
    device = memory_plan(setup)
    host = memory_plan(replace(setup, engram_on_host=True), device.activations)
    ids = 256 * (v41.engram_max_ngram_size - 1) * v41.engram_n_heads
    row = 32 + 1 if fp8 else 32 * dtype.itemsize
    lookups = len(v41.engram_layer_ids) * 2
    copies = host.comm.by_kind()["engram host copies"]
    assert (copies.sent, copies.received, copies.calls) == (lookups * ids * 8, lookups * ids * row, lookups * 2)
    assert copies.link == "pcie" and copies.seconds == pytest.approx(copies.received / (64 * 1e9))
    assert device.comm.by_kind()["engram host copies"].received == 0
    assert host.comm.exposed_seconds == pytest.approx(device.comm.exposed_seconds + copies.seconds)
    others = {k: t for k, t in host.comm.by_kind().items() if k != "engram host copies"}
    assert others == {k: t for k, t in device.comm.by_kind().items() if k != "engram host copies"}
    assert f"{copies.received / 2**20:.1f} MiB of rows host -> device" in host.report()
