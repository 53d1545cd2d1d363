"""The memory plan: totals from the terms and phases, the verdict, the JSON and report, and bad input."""

import json

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.plan.plan import GIB, TERMS, PlanSetup, memory_plan


@pytest.fixture(scope="module")
def tiny_plan():
    return memory_plan(PlanSetup(DSV4Config.preset("tiny"), seq_len=1024, cp=2, dp=2, ep=2,
                                 device_memory_bytes=GIB))


def test_total_is_the_largest_phase_and_never_more_than_the_terms(tiny_plan):
    per_rank = tiny_plan.per_rank_bytes
    fixed = per_rank["parameters"] + per_rank["optimizer"]
    assert per_rank["total"] <= sum(per_rank[t] for t in TERMS)
    assert per_rank["total"] >= fixed + per_rank["communication"] + per_rank["activations"]
    assert per_rank["total"] >= fixed + per_rank["gradients"] + tiny_plan.states.step_temporary  # optimizer step
    assert sum(tiny_plan.segment_gradients) < per_rank["gradients"]  # the root's are reduced last


def test_verdict_and_biggest_term():
    config = DSV4Config.preset("tiny")
    small = memory_plan(PlanSetup(config, seq_len=1024, device_memory_bytes=1024))
    assert not small.fits and small.biggest_term == "activations"
    assert "DOES NOT FIT (biggest term: activations)" in small.summary()
    assert memory_plan(PlanSetup(config, seq_len=1024, device_memory_bytes=GIB)).fits


def test_json_and_report(tiny_plan):
    data = json.loads(json.dumps(tiny_plan.as_dict()))
    assert set(data["per_rank_bytes"]) == {*TERMS, "total"} and data["fits"] is True
    assert data["setup"]["world"] == 4 and data["setup"]["ep"] == 2
    report = tiny_plan.report()
    for needle in ("parameters", "gradients", "optimizer", "activations", "communication", "total",
                   "block ratio 4", "attention", "indexer", "moe", "hyper_connections", "mtp", "loss chunk"):
        assert needle in report, needle


def test_longer_sequences_need_more_and_cp_divides_the_activations():
    config = DSV4Config.preset("tiny")
    act = lambda **kw: memory_plan(PlanSetup(config, **kw)).per_rank_bytes["activations"]  # noqa: E731
    one, two = act(seq_len=2048, cp=1), act(seq_len=2048, cp=2)
    assert act(seq_len=1024, cp=1) < one and two < one


@pytest.mark.parametrize("kwargs,needle", [
    ({"seq_len": 1000}, "`seq_len`=1000"),
    ({"seq_len": 1024, "ep": 3}, "`ep`=3"),
    ({"seq_len": 1024, "cp": 0}, "`cp`"),
    ({"seq_len": 1024, "device_memory_bytes": 0}, "device memory"),
    ({"seq_len": 1024, "offload": "params"}, "`offload`='params' must be one of none, optimizer"),
])
def test_bad_setups_raise_before_building(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        memory_plan(PlanSetup(DSV4Config.preset("tiny"), **kwargs))


@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
def test_lora_plan_counts_adapters_the_frozen_base_and_the_kept_buffers(base_dtype):
    """Against a real (CPU) LoRA model built the same way: gradients and AdamW state for the adapters only (fp32, 4
    and 8 bytes per element); parameters = adapters in fp32 + the frozen base in its unit's compute dtype (bf16, the
    fp32 modules fp32) + every buffer (the kept FP8 / FP4 base at its checkpoint bytes)."""
    from dsv4.model import DSV4ForCausalLM
    from dsv4.parallel.wrap import fsdp_units, store_frozen_in_compute_dtype
    from dsv4.peft import LoRAConfig, apply_lora

    lora = LoRAConfig(rank=4, base_dtype=base_dtype)
    config = DSV4Config.preset("tiny")
    plan = memory_plan(PlanSetup(config, seq_len=512, compute_dtype=torch.bfloat16, lora=lora))
    model = DSV4ForCausalLM(config)
    apply_lora(model, lora)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.states.gradients == 4 * adapters and plan.states.optimizer == 8 * adapters
    store_frozen_in_compute_dtype(fsdp_units(model, torch.bfloat16))
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert plan.states.parameters == 4 * adapters + frozen + buffers
    full = memory_plan(PlanSetup(config, seq_len=512, compute_dtype=torch.bfloat16))
    assert plan.states.parameters < full.states.parameters and plan.total < full.total
    assert "LoRA r=4" in plan.report() and plan.as_dict()["setup"]["lora"]["base_dtype"] == base_dtype


def test_checkpoint_bytes_match_a_real_save(tmp_path):
    """The plan's checkpoint share against the bytes DCP writes for the same model and its AdamW state after one
    step (one process, no sharding; wider than the preset so DCP's per-tensor framing, about 1 KB per tensor, is
    small beside the data): within 2%."""
    import torch.distributed.checkpoint as dcp

    from dsv4.model import DSV4ForCausalLM

    config = DSV4Config.preset("tiny", hidden_size=256, moe_intermediate_size=256, n_routed_experts=16,
                               q_lora_rank=128, o_lora_rank=128)
    plan = memory_plan(PlanSetup(config, seq_len=512))
    torch.manual_seed(0)
    model = DSV4ForCausalLM(config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    for p in trainable:
        p.grad = torch.ones_like(p)
    optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"state_dict": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=str(tmp_path), no_dist=True)
    written = sum(f.stat().st_size for f in tmp_path.glob("*.distcp"))
    assert written == pytest.approx(plan.checkpoint_bytes, rel=0.02)
    assert plan.host_staging_bytes == plan.checkpoint_bytes  # asynchronous saves by default
    assert memory_plan(PlanSetup(config, seq_len=512, async_checkpoint=False)).host_staging_bytes == 0
    assert plan.as_dict()["checkpoint_bytes"] == {"per_rank": plan.checkpoint_bytes, "disk": plan.checkpoint_bytes,
                                                  "host_staging_per_rank": plan.checkpoint_bytes}
    assert "on disk per checkpoint; host staging" in plan.report()


def test_host_offload_moves_the_shards_gradients_and_optimizer_state_off_the_device(tiny_plan):
    """trainer.offload=optimizer, same layout as ``tiny_plan``: each phase's device bytes fall by exactly what moved
    (the parameter shards, the optimizer state, the gradient shards already reduced; the optimizer step with its
    gradients and temporary entirely) less FSDP's staging copies; the host term is the moved state; on one memory
    the peak is the plain plan's."""
    from dataclasses import replace

    host = memory_plan(replace(tiny_plan.setup, offload="optimizer"))
    plain, o, s = tiny_plan.per_rank_bytes, host.offload, host.states
    assert (o.parameters, o.gradients, o.optimizer, o.step_temporary) == (
        s.parameters - sum(b.numel() * b.element_size() for b in _meta_model_buffers()), s.gradients, s.optimizer,
        s.step_temporary)
    assert host.host_offload_bytes == o.parameters + o.gradients + o.optimizer
    assert host.per_rank_bytes == {"parameters": plain["parameters"] - o.parameters, "gradients": 0, "optimizer": 0,
                                   "activations": plain["activations"],
                                   "communication": plain["communication"] + o.gather_staging + o.reduce_staging,
                                   "total": host.total}
    assert 0 < o.reduce_staging <= o.gather_staging < o.parameters  # the largest unit's, not all of them
    assert o.device_to_host == o.gradients and o.parameters < o.host_to_device < 2 * o.parameters
    phases = {p.name: p for p in tiny_plan.activations.phases}
    assert host.phase_bytes.keys() == tiny_plan.phase_bytes.keys() == {"optimizer step", *phases}
    for name, before in tiny_plan.phase_bytes.items():
        if name == "optimizer step":
            moved = o.parameters + o.optimizer + o.gradients + o.step_temporary
        else:
            back = phases[name].backward_of
            reduced = 0 if back is None else sum(tiny_plan.segment_gradients[back + 1:])
            moved = o.parameters + o.optimizer + reduced - o.gather_staging - o.reduce_staging
        assert before - host.phase_bytes[name] == moved, name
    assert host.total == max(host.phase_bytes.values()) < tiny_plan.total
    # host and device one memory (a CPU run): the staging copies are the shards themselves (fp32 compute, no cast),
    # so every phase holds what it holds without offload
    assert o.gather_cast == 0 and tiny_plan.setup.compute_dtype == torch.float32
    assert host.shared_memory_total == tiny_plan.shared_memory_total == tiny_plan.total
    data = json.loads(json.dumps(host.as_dict()))
    assert data["setup"]["offload"] == "optimizer" and tiny_plan.as_dict()["host_offload_bytes"] is None
    assert data["host_offload_bytes"]["per_rank"] == host.host_offload_bytes
    assert f"host offload {host.host_offload_bytes / 2**20:.1f} MiB" in host.summary()
    assert "host offload" in host.report() and "host offload" not in tiny_plan.report()


def _meta_model_buffers():
    from dsv4.model import DSV4ForCausalLM

    with torch.device("meta"):
        return list(DSV4ForCausalLM(DSV4Config.preset("tiny")).buffers())


def test_v41_plan_counts_the_frozen_engram_tables_and_the_shared_state():
    """DeepSeek-V4.1 (v41_tiny, one rank): the Engram tables (layers 1 and 4: 384 and 552 rows of
    32, fp32) are parameter shards with no gradient and no optimizer state (nor have the frozen indexers); the per-forward state (attention
    metadata, Engram n-gram ids, the CSA2 state the Full / Reindex blocks publish) is reported."""
    from dsv4.model import build_causal_lm

    config = DSV4Config.preset("v41_tiny")
    with torch.device("meta"):
        named = dict(build_causal_lm(config).named_parameters())
    total = sum(p.numel() for p in named.values())
    indexers = sum(p.numel() for n, p in named.items() if ".indexer." in n)  # frozen, as in the released training
    tables = (384 + 552) * 32
    one = memory_plan(PlanSetup(config, seq_len=256))
    assert one.engram_table_bytes == 4 * tables
    assert one.states.gradients == 4 * (total - tables - indexers)  # the rest, fp32, one rank
    assert one.states.optimizer == 2 * one.states.gradients  # AdamW: two fp32 moments per trainable element
    assert one.states.parameters >= 4 * total
    parts = one.activations.per_forward
    assert parts["Engram n-gram ids"] == 2 * 256 * (3 * 2) * 8 + 256  # two layers' int64 ids + the active mask
    assert parts["attention metadata"] + parts["Engram n-gram ids"] == one.activations.metadata
    assert parts["CSA2 shared state"] > 0
    report = one.report()
    assert "of which Engram tables" in report and "frozen: no gradients, no optimizer state" in report
    assert "CSA2 shared state" in report and "top (head, loss)" in report


@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_engram_tables_in_host_memory_leave_the_device_total_by_exactly_their_bytes(offload):
    """``engram_on_host`` (``trainer.engram_tables=host``; v41_tiny on 2 ranks, fp32 and the kept FP8 form, with and
    without host offload): every device phase, so the total and the ``parameters`` term, is the device-held plan's
    less exactly the rank's table bytes, which are the host's (report, summary, JSON); the CPU's one-memory peak is
    the device-held plan's; nothing else changes."""
    from dataclasses import replace

    for fp8 in (False, True):
        setup = PlanSetup(DSV4Config.preset("v41_tiny"), seq_len=256, dp=2, offload=offload, engram_fp8=fp8)
        device = memory_plan(setup)
        host = memory_plan(replace(setup, engram_on_host=True), device.activations)
        tables = device.engram_table_bytes
        row = 32 + 1 if fp8 else 32 * 4  # e4m3 bytes + one e8m0 scale per row, or fp32
        assert tables == ((384 + 1) // 2 * row + (552 + 1) // 2 * row) and host.engram_table_bytes == tables
        assert host.engram_host_bytes == tables and device.engram_host_bytes == 0
        assert host.host_bytes == host.host_offload_bytes + tables
        assert device.per_rank_bytes["parameters"] - host.per_rank_bytes["parameters"] == tables
        assert device.total - host.total == tables
        assert {k: device.phase_bytes[k] - v for k, v in host.phase_bytes.items()} == dict.fromkeys(host.phase_bytes,
                                                                                                    tables)
        for term in ("gradients", "optimizer", "activations", "communication"):
            assert host.per_rank_bytes[term] == device.per_rank_bytes[term], term
        assert host.shared_memory_total == device.shared_memory_total
        assert host.checkpoint_bytes == device.checkpoint_bytes  # a full fine-tune saves the tables wherever held
        data = json.loads(json.dumps(host.as_dict()))
        assert data["engram_host_bytes"] == tables and data["host_bytes_per_rank"] == host.host_bytes
        assert data["setup"]["engram_on_host"] is True and data["setup"]["engram_fp8"] is fp8
        report = host.report()
        assert "host Engram" in report and "of which Engram tables" not in report
        params = next(line for line in report.splitlines() if line.startswith("  parameters"))
        assert params.split()[1:3] == _gib_or_mib(host.per_rank_bytes["parameters"]), params  # the device's bytes
        assert "of which Engram tables" in device.report() and "host Engram" not in device.report()
        assert f"Engram tables in host memory {tables / 2**20:.1f} MiB per rank" in host.summary()


def test_engram_tables_in_host_memory_are_frozen_tables():
    with pytest.raises(ValueError, match="`engram_on_host` holds frozen Engram tables in host memory, but "
                                         "model.engram_trainable=true trains them"):
        memory_plan(PlanSetup(DSV4Config.preset("v41_tiny", engram_trainable=True), seq_len=256, engram_on_host=True))


def _gib_or_mib(n: int) -> list[str]:
    """The report's size of ``n`` bytes as its two words."""
    return (f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB").split()
