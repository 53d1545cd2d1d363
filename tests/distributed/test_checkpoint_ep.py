"""Expert-parallel checkpoints. 2 ranks: the load reads only each rank's own experts' keys (counted per rank); the
export of a dp=2 x ep=2 FSDP2 model is byte-identical to the one-process export. 4 ranks, dp=4 x ep=2 (edp=2, an
uneven edp split): the DCP checkpoint of model and AdamW state round-trips bit for bit, holds every expert at its
global place (read in one process, and loaded under ep=1), and a resumed step equals the uninterrupted one (end of
the file).

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
# One run of 4 gloo ranks: dp=4 x ep=2 with FSDP2, so edp=2. A test-only tiny config with 6 routed experts: each EP
# rank holds 3, split 2 + 1 over edp (torch.chunk, uneven), so the (Shard(0), Shard(0)) nesting of
# dsv4.parallel.expert_state sees both an edp split and an uneven one. Every rank trains the model of seed 3 for
# two real AdamW steps on its own seeded random tokens (so every parameter and every expert has its own gradient
# and moments), saves model + optimizer through ExpertStateLayout into one DCP checkpoint and trains step 3
# (the uninterrupted run). A model of seed 4 with a fresh optimizer (zero moments, step 1 after torch's state
# init) then loads the checkpoint the way DSV4Strategy.load_checkpoint does and trains step 3 (the resumed run);
# an ep=1 model of seed 5 loads it too.
RESUME_CONFIG = dict(n_routed_experts=6)
RESUME_SEQ = 64
MOMENTS = ("exp_avg", "exp_avg_sq")


def _train_step(model, optimizer, rank, step):
    """One real step on this rank's seeded random tokens; returns the loss (computed before the update)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 256, (1, RESUME_SEQ), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    loss = model(ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _local_tensors(state):
    """A (nested) state dict with every DTensor as a clone of this rank's local tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _local_tensors(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        return state.to_local().clone()
    return state.clone() if isinstance(state, torch.Tensor) else state


def _resume_rank(rank, world_size, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor

    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.model.moe import GroupedExperts
    from dsv4.parallel.expert_shard import apply_expert_parallel
    from dsv4.parallel.expert_state import ExpertStateLayout
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp

    meshes = build_meshes(ParallelDims(world_size=world_size, dp=4, ep=2), "cpu")

    def build(seed):
        torch.manual_seed(seed)
        model = DSV4ForCausalLM(DSV4Config.preset("tiny", **RESUME_CONFIG))
        apply_expert_parallel(model, "alltoall", meshes.ep.get_group(), "cpu")
        apply_fsdp(model, meshes)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = build(3)
    for step in (1, 2):
        _train_step(model, optimizer, rank, step)
    layout = ExpertStateLayout.of(model, meshes.experts)
    offsets = {f"{path}.{name}": m.expert_offset for path, m in model.named_modules() if isinstance(m, GroupedExperts)
               for name in m.stacked_names()}
    model_state, optim_state = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
    # the oracle of the checkpoint's global tensors: FSDP's own gather of this EP rank's slice (over edp)
    slices = {n: {"weight": model_state[n].full_tensor(), **{k: optim_state["state"][n][k].full_tensor()
                                                             for k in MOMENTS}} for n in sorted(offsets)}
    saved = {"model": _local_tensors(model_state), "optim": _local_tensors(optim_state["state"])}
    dcp.save({"state_dict": layout.model_state(model_state), "optimizer_0": layout.optimizer_state(optim_state)},
             checkpoint_id=root)
    loss = _train_step(model, optimizer, rank, 3)
    uninterrupted = {"loss": loss, "after": _local_tensors(get_model_state_dict(model))}

    # resume: the steps of DSV4Strategy.load_checkpoint (in place, through the layout, then set_*_state_dict)
    fresh, fresh_optimizer = build(4)
    fresh_model_state = get_model_state_dict(fresh)
    dcp.load({"state_dict": layout.model_state(fresh_model_state)}, checkpoint_id=root)
    set_model_state_dict(fresh, fresh_model_state)
    fresh_optim_state = get_optimizer_state_dict(fresh, fresh_optimizer)
    dcp.load({"optimizer_0": layout.optimizer_state(fresh_optim_state)}, checkpoint_id=root)
    set_optimizer_state_dict(fresh, fresh_optimizer, optim_state_dict=fresh_optim_state,
                             options=StateDictOptions(cpu_offload=True))
    loaded = {"model": _local_tensors(get_model_state_dict(fresh)),
              "optim": _local_tensors(get_optimizer_state_dict(fresh, fresh_optimizer)["state"])}
    loss = _train_step(fresh, fresh_optimizer, rank, 3)
    resumed = {"loss": loss, "after": _local_tensors(get_model_state_dict(fresh))}

    # parts the (Shard(0), Shard(0)) description would misplace: ValueError, not a silent save
    name, errors = "model.layers.1.mlp.experts.w2", []
    part = get_model_state_dict(fresh)[name]
    wrong = (("edp order", ExpertStateLayout(layout.num_experts, layout.ranks.flip(1)), part),
             ("chunk size", layout, DTensor.from_local(part.to_local()[:0], part.device_mesh, part.placements,
                                                      run_check=False, shape=part.shape, stride=part.stride())))
    for what, bad_layout, tensor in wrong:
        try:
            bad_layout.globalize(name, tensor)
            errors.append(f"{what}: no error")
        except ValueError as e:
            errors.append(f"{what}: {e}")
    experts = fresh.model.layers[1].mlp.experts  # a module whose slice is not its EP rank's: ValueError
    experts.expert_offset = 3 - experts.expert_offset
    try:
        ExpertStateLayout.of(fresh, meshes.experts)
        errors.append("slice: no error")
    except ValueError as e:
        errors.append(f"slice: {e}")
    experts.expert_offset = 3 - experts.expert_offset

    # the same checkpoint under ep=1: every expert on every rank, FSDP-sharded 2 + 2 + 2 + 0 over the 4 ranks
    torch.manual_seed(5)
    whole = apply_fsdp(DSV4ForCausalLM(DSV4Config.preset("tiny", **RESUME_CONFIG)),
                       build_meshes(ParallelDims(world_size=world_size, dp=4, ep=1), "cpu"))
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    whole_state, whole_optim = get_model_state_dict(whole), get_optimizer_state_dict(whole, whole_optimizer)
    dcp.load({"state_dict": whole_state, "optimizer_0": whole_optim}, checkpoint_id=root)
    under_ep1 = {n: {"rows": whole_state[n].to_local().shape[0], "weight": whole_state[n].full_tensor(),
                     "step": float(whole_optim["state"][n]["step"]),
                     **{k: whole_optim["state"][n][k].full_tensor() for k in MOMENTS}} for n in sorted(offsets)}
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "resumed": resumed, "slices": slices,
            "offsets": offsets, "ep_names": sorted(layout.num_experts), "errors": errors, "under_ep1": under_ep1}


@pytest.fixture(scope="module")
def resume_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ep-resume") / "ckpt")
    return root, run_on_ranks(_resume_rank, 4, (root,))


def test_dp4_ep2_run_splits_each_expert_slice_unevenly_over_edp(resume_run):
    """The case under test: experts mesh (edp, ep) = [[0, 1], [2, 3]]; EP rank e holds experts [3e, 3e + 3), of
    which edp rank 0 holds 2 and edp rank 1 holds 1; every expert has its own, non-zero moments."""
    _, results = resume_run
    names = results[0]["ep_names"]
    assert len(names) == 5 * 3 and set(names) == set(results[0]["offsets"])  # w1, w3, w2 of 4 layers + MTP
    for rank, res in enumerate(results):
        for n in names:
            assert res["offsets"][n] == 3 * (rank % 2)
            assert res["saved"]["model"][n].shape[0] == (2, 1)[rank // 2], (rank, n)
            assert res["slices"][n]["weight"].shape[0] == 3
            for k in MOMENTS:
                rows = res["slices"][n][k].flatten(1)
                assert (rows.abs().amax(dim=1) > 0).all(), (rank, n, k)  # every expert received tokens
                assert len({tuple(r.tolist()) for r in rows}) == 3, (rank, n, k)  # and has its own moments


def test_ep_checkpoint_loads_every_rank_state_exactly(resume_run):
    """Each rank's loaded weights, AdamW exp_avg / exp_avg_sq and step equal what it saved, bit for bit, expert by
    expert (the fresh optimizer held zero moments at step 1, the saved one non-zero moments at step 2)."""
    _, results = resume_run
    for rank, res in enumerate(results):
        saved, loaded = res["saved"], res["loaded"]
        assert loaded["model"].keys() == saved["model"].keys()
        for n, value in saved["model"].items():
            assert torch.equal(loaded["model"][n], value), (rank, n)
        assert loaded["optim"].keys() == saved["optim"].keys() and len(saved["optim"]) > 100
        for n, entry in saved["optim"].items():
            assert loaded["optim"][n].keys() == entry.keys() == {"step", *MOMENTS}, (rank, n)
            assert float(entry["step"]) == 2.0 and float(loaded["optim"][n]["step"]) == 2.0, (rank, n)
            for k in MOMENTS:
                if n in res["offsets"]:  # expert by expert: global index = EP offset + edp offset + row
                    first = res["offsets"][n] + 2 * (rank // 2)
                    for row in range(entry[k].shape[0]):
                        assert torch.equal(loaded["optim"][n][k][row], entry[k][row]), (rank, n, k, first + row)
                assert torch.equal(loaded["optim"][n][k], entry[k]), (rank, n, k)


def test_ep_checkpoint_holds_every_expert_at_its_global_place(resume_run):
    """Read back in ONE process at the global shapes [6, ...]: every expert's weights and AdamW moments equal the
    EP slice FSDP gathers on the EP rank that owns it (at its offset): both EP ranks' slices, both edp chunks."""
    import torch.distributed.checkpoint as dcp

    root, results = resume_run
    by_ep = {rank % 2: results[rank] for rank in (0, 1)}  # edp rank 0 of each EP group
    names = results[0]["ep_names"]
    oracle = {n: {key: torch.cat([by_ep[e]["slices"][n][key] for e in (0, 1)]) for key in ("weight", *MOMENTS)}
              for n in names}
    for n in names:
        for e in (0, 1):
            assert by_ep[e]["offsets"][n] == 3 * e
    state = {"state_dict": {n: torch.empty_like(oracle[n]["weight"]) for n in names},
             "optimizer_0": {"state": {n: {k: torch.empty_like(oracle[n][k]) for k in MOMENTS} for n in names}}}
    dcp.load(state, checkpoint_id=root, no_dist=True)
    for n in names:
        assert state["state_dict"][n].shape[0] == 6
        for expert in range(6):
            assert torch.equal(state["state_dict"][n][expert], oracle[n]["weight"][expert]), (n, expert)
            for k in MOMENTS:
                assert torch.equal(state["optimizer_0"]["state"][n][k][expert], oracle[n][k][expert]), (n, k, expert)


def test_ep2_checkpoint_loads_under_ep1(resume_run):
    """The dp=4 ep=2 checkpoint loads into an ep=1 model (each expert stack [6, ...] FSDP-sharded 2 + 2 + 2 + 0 over
    the 4 ranks; DCP reshards): every expert's weights, AdamW moments and step, gathered, equal the EP slices of the
    saving run at their offsets."""
    _, results = resume_run
    by_ep = {rank % 2: results[rank] for rank in (0, 1)}
    for rank, res in enumerate(results):
        for n, got in res["under_ep1"].items():
            assert got["rows"] == (2, 2, 2, 0)[rank] and got["step"] == 2.0, (rank, n)
            for key in ("weight", *MOMENTS):
                want = torch.cat([by_ep[e]["slices"][n][key] for e in (0, 1)])
                for expert in range(6):
                    assert torch.equal(got[key][expert], want[expert]), (rank, n, key, expert)


def test_dp4_ep2_resumed_step_equals_the_uninterrupted_step(resume_run):
    """Step 3 after the resume equals step 3 of the uninterrupted run on every rank, bit for bit: its loss (the
    loaded weights) and every weight after its AdamW update (the loaded moments and step: the fresh optimizer's
    zero moments at step 1 give another update)."""
    _, results = resume_run
    for rank, res in enumerate(results):
        assert torch.equal(res["resumed"]["loss"], res["uninterrupted"]["loss"]), rank
        after, want = res["resumed"]["after"], res["uninterrupted"]["after"]
        assert after.keys() == want.keys()
        for n, value in want.items():
            assert torch.equal(after[n], value), (rank, n)


def test_ep_layout_refuses_an_fsdp_part_it_would_misplace(resume_run):
    """globalize raises ValueError naming the ranks or sizes when FSDP's part of an EP slice is not the part the
    (Shard(0), Shard(0)) description places: a layout with the edp ranks in the other order, and a local part of
    another size than this rank's torch.chunk part; ExpertStateLayout.of when a module holds another EP rank's slice."""
    _, results = resume_run
    for rank, res in enumerate(results):
        order, size, slice_ = res["errors"]
        ep = rank % 2
        assert order == (f"edp order: model.layers.1.mlp.experts.w2: FSDP shards EP rank {ep}'s slice over ranks "
                         f"[{ep}, {ep + 2}], the expert mesh's edp ranks of that slice are [{ep + 2}, {ep}]"), rank
        assert size == (f"chunk size: model.layers.1.mlp.experts.w2: rank {rank} holds 0 of EP rank {ep}'s 3 "
                        f"experts, torch.chunk over edp=2 gives edp rank {rank // 2} {(2, 1)[rank // 2]}"), rank
        assert slice_ == (f"slice: model.layers.1.mlp.experts: this rank holds experts [{3 - 3 * ep}, "
                          f"{6 - 3 * ep}), EP rank {ep} of the expert mesh [[0, 2], [1, 3]] ([ep, edp]) holds "
                          f"[{3 * ep}, {3 * ep + 3})"), rank
