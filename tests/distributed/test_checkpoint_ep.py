"""2-rank expert-parallel checkpoints: the load reads only each rank's own experts' keys (counted per rank); the
export of a dp=2 x ep=2 FSDP2 model is byte-identical to the one-process export (end of the file).

Load:

The parent writes a synthetic release-format checkpoint (FP8 / FP4 tensors with known values, 3 shards). Each gloo
rank builds the tiny model, EP-shards it over the default group (``shard_experts``), loads the checkpoint and
returns the on-disk keys it read plus its expert weights. Asserted: rank r read exactly the expert keys of
experts [4r, 4r + 4) (weights and scales, backbone and MTP) plus every non-expert key, and its expert slices
equal the known dequantised values.
"""

import json
import os

import pytest
import torch

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed


def _load_rank(rank, world_size, path):
    from dsv4.checkpoint import load_hf_checkpoint
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.parallel.expert_shard import shard_experts

    torch.manual_seed(5)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    shard_experts(model)  # default group: rank r keeps experts [4r, 4r + 4)
    report = load_hf_checkpoint(model, path)
    experts = {k: v.clone() for k, v in model.state_dict().items() if ".mlp.experts." in k}
    return {"keys_read": list(report.keys_read), "experts": experts}


def test_two_rank_ep_load_reads_only_own_experts(tmp_path):
    from dsv4.checkpoint import CheckpointDir
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from tests.unit.checkpoint.helpers import synthetic_release_checkpoint

    path = str(tmp_path)
    expected = synthetic_release_checkpoint(DSV4ForCausalLM(DSV4Config.preset("tiny")), path, num_shards=3)
    all_keys = set(CheckpointDir.open(path).tensors)
    non_expert = {k for k in all_keys if ".experts." not in k}
    results = run_on_ranks(_load_rank, 2, (path,))
    for rank, res in enumerate(results):
        read = res["keys_read"]
        assert len(read) == len(set(read))  # nothing read twice
        experts_read = {k for k in read if ".experts." in k}
        own = {k for k in all_keys if ".experts." in k and 4 * rank <= int(k.split(".experts.")[1].split(".")[0]) < 4 * rank + 4}
        assert experts_read == own
        assert len(experts_read) == 5 * 4 * 3 * 2  # 4 layers + MTP, 4 experts, w1/w3/w2, weight + scale
        assert set(read) - experts_read == non_expert
        w2 = res["experts"]["model.layers.2.mlp.experts.w2"]
        assert w2.shape[0] == 4
        for row in range(4):
            assert torch.equal(w2[row], expected[f"layers.2.ffn.experts.{4 * rank + row}.w2.weight"])


# ---------------------------------------------------------------------------------------------- export under EP
# One run of 2 gloo ranks: dp=2 x ep=2 with FSDP2 (the non-expert tensors are DTensors sharded over both ranks,
# rank r holds experts [4r, 4r + 4)). Exported: the full model in every dtype, and a LoRA model (base kept in
# FP8 / FP4, random adapters) merged and as a PEFT adapter. Oracle: the same weights exported by one process.
LORA = dict(rank=4, alpha=8.0, base_dtype="fp8")
DTYPES = ("bfloat16", "float32", "quantized")


def _full_model():
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(3)
    return DSV4ForCausalLM(DSV4Config.preset("tiny"))


def _lora_model():
    from dsv4.peft import LoRAConfig, adapter_state, apply_lora

    model = _full_model()
    apply_lora(model, LoRAConfig(**LORA))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _export_all(model, root, merged, write_adapter=True):
    """Every export of ``model`` under ``root``; returns ``{dir: keys this rank wrote}``."""
    from dsv4.checkpoint import export_hf_checkpoint
    from dsv4.peft import LoRAConfig
    from dsv4.peft.apply import merged_sources
    from dsv4.peft.peft_format import export_peft_adapter

    written = {}
    if not merged:
        for dtype in DTYPES:
            report = export_hf_checkpoint(model, f"{root}/{dtype}", dtype=dtype, max_shard_bytes=400_000)
            written[dtype] = report.keys_written
        return written
    report = export_hf_checkpoint(model, f"{root}/merged", dtype="bfloat16", sources=merged_sources(model),
                                  max_shard_bytes=400_000)
    written["merged"] = report.keys_written
    export_peft_adapter(model, f"{root}/adapter", LoRAConfig(**LORA), write=write_adapter)
    return written


def _export_rank(rank, world_size, root):
    from dsv4.parallel.expert_shard import shard_experts
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp

    meshes = build_meshes(ParallelDims(world_size=world_size, ep=2), "cpu")
    written = {}
    for merged, build in ((False, _full_model), (True, _lora_model)):
        model = build()
        shard_experts(model, meshes.ep)
        apply_fsdp(model, meshes)
        written.update(_export_all(model, f"{root}/ep", merged, write_adapter=rank == 0))
    return written


def _files(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def test_two_rank_ep_fsdp_export_is_byte_identical_to_one_process(tmp_path):
    root = str(tmp_path)
    _export_all(_full_model(), f"{root}/one", merged=False)
    _export_all(_lora_model(), f"{root}/one", merged=True)
    written = run_on_ranks(_export_rank, 2, (root,))
    for name in (*DTYPES, "merged", "adapter"):
        one, ep = _files(f"{root}/one/{name}"), _files(f"{root}/ep/{name}")
        assert list(ep) == list(one) and len(one) >= (2 if name == "adapter" else 4), (name, list(one))
        for file in one:
            assert ep[file] == one[file], f"{name}/{file} differs from the one-process export"
    # each rank wrote its own experts (and a share of the rest), every tensor exactly once
    for name in (*DTYPES, "merged"):
        keys = [set(w[name]) for w in written]
        assert not keys[0] & keys[1] and len(keys[0] | keys[1]) == len(written[0][name]) + len(written[1][name])
        index = json.load(open(f"{root}/one/{name}/model.safetensors.index.json"))["weight_map"]
        assert keys[0] | keys[1] == set(index)
        for rank in range(2):
            experts = {int(k.split(".experts.")[1].split(".")[0]) for k in keys[rank] if ".experts." in k}
            assert experts == set(range(4 * rank, 4 * rank + 4)), (name, rank, experts)
            assert any(".experts." not in k for k in keys[rank])


# ------------------------------------------------------------------------------- DCP checkpoints under EP
# 2 gloo ranks, dp=2 x ep=2 with FSDP2, an AdamW step taken: the model and optimizer state dicts go through
# ExpertStateLayout into one DCP checkpoint. Oracle: the unsharded model of the same seed. Asserted: read back in
# ONE process at the saved global shapes, every expert equals the unsharded model's (both EP ranks' slices are in
# it), and a fresh ep=2 model of another seed loads it in place to the same weights and AdamW moments.


def _dcp_rank(rank, world_size, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from dsv4.parallel.expert_shard import shard_experts
    from dsv4.parallel.expert_state import ExpertStateLayout
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp

    meshes = build_meshes(ParallelDims(world_size=world_size, ep=2), "cpu")

    def build(seed):
        from dsv4.config import DSV4Config
        from dsv4.model import DSV4ForCausalLM

        torch.manual_seed(seed)
        model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
        shard_experts(model, meshes.ep)
        apply_fsdp(model, meshes)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():  # one update with a known gradient: non-zero moments to compare
            p.grad = torch.ones_like(p) * 1e-2
        optimizer.step()
        return model, optimizer

    model, optimizer = build(3)
    layout = ExpertStateLayout.of(model, meshes.experts)
    dcp.save({"state_dict": layout.model_state(get_model_state_dict(model)),
              "optimizer_0": layout.optimizer_state(get_optimizer_state_dict(model, optimizer))},
             checkpoint_id=root)

    fresh, fresh_optimizer = build(4)
    model_state = get_model_state_dict(fresh)
    optim_state = get_optimizer_state_dict(fresh, fresh_optimizer)
    dcp.load({"state_dict": layout.model_state(model_state), "optimizer_0": layout.optimizer_state(optim_state)},
             checkpoint_id=root)

    def local(state):
        return {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state.items()
                if isinstance(v, torch.Tensor)}

    return {"saved": local(get_model_state_dict(model)), "loaded": local(get_model_state_dict(fresh)),
            "saved_m": local(get_optimizer_state_dict(model, optimizer)["state"]["model.layers.1.mlp.experts.w2"]),
            "loaded_m": local(optim_state["state"]["model.layers.1.mlp.experts.w2"]),
            "ep_names": sorted(layout.num_experts)}


def test_ep_checkpoint_holds_every_expert_at_global_shape_and_loads_in_place(tmp_path):
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path / "ckpt")
    results = run_on_ranks(_dcp_rank, 2, (root,))
    unsharded = _full_model()  # the model both ranks sliced (seed 3), with the same AdamW update
    optimizer = torch.optim.AdamW(unsharded.parameters(), lr=1e-3)
    for p in unsharded.parameters():
        p.grad = torch.ones_like(p) * 1e-2
    optimizer.step()
    reference = unsharded.state_dict()
    names = results[0]["ep_names"]
    assert len(names) == 5 * 3  # w1, w3, w2 of 4 layers + the MTP depth
    full = {f"state_dict.{n}": torch.empty_like(reference[n]) for n in names}
    dcp.load(full, checkpoint_id=root, no_dist=True)  # one process, global shapes
    for n in names:
        assert full[f"state_dict.{n}"].shape[0] == 8
        torch.testing.assert_close(full[f"state_dict.{n}"], reference[n], rtol=1.3e-6, atol=0, msg=n)
    for rank, res in enumerate(results):
        assert res["saved"].keys() == res["loaded"].keys()
        for k in res["saved"]:
            assert torch.equal(res["loaded"][k], res["saved"][k]), (rank, k)
        for k in ("exp_avg", "exp_avg_sq"):
            assert res["saved_m"][k].abs().sum() > 0
            assert torch.equal(res["loaded_m"][k], res["saved_m"][k]), (rank, k)
