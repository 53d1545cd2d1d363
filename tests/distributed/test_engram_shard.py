"""DeepSeek-V4.1 Engram tables row-sharded over 4 gloo ranks (:mod:`dsv4.parallel.engram_table`) against the
one-process model.

The model is v41_tiny cut to 6 blocks (window 0, 1; Full 2 (ratio 2) and 4 (ratio 1, the candidate source); Reuse 3,
5; Engram at 1 and 4) with ``engram_vocab_size=45``: tables of 358 and 522 rows, which 4 ranks split unevenly (90,
90, 90, 88 and 131, 131, 131, 129). Every rank runs its own rows. One launch:

* trainable tables (``engram_trainable``) under the real ``apply_fsdp`` (which row-shards them and leaves them out of
  every FSDP unit): logits equal the one-process model's on the rank's rows; each table's gradient on its owner
  equals the one-process gradients summed over the 4 ranks' rows, and is exactly zero on the rows nobody looked up;
  AdamW keeps moments over the owner's rows only; a DCP save / load into a fresh model round trips the rows and the
  moments (and loads into one whole table in the parent: 4 -> 1 ranks);
* the HF export (``dtype=quantized``) of the trained sharded model writes whole tables: the parent loads them and
  gets the gathered rows, FP8-rounded;
* frozen tables loaded from that export: kept in the stored FP8 form, each rank reads only its rows from the
  safetensors, the logits equal a whole FP8-kept table's, and the optimizer holds nothing for them; their bf16
  export (each rank its rows, dequantised) holds the same values.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

WORLD = 4
OVERRIDES = dict(num_hidden_layers=6, compress_ratios=[0, 0, 2, 2, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 4],
                 index_source_layer_ids=[2, 4], candidate_source_layer_id=4, dspark_target_layer_ids=[3, 4, 5],
                 engram_vocab_size=45, engram_num_embeddings=[358, 522], engram_trainable=True)
TABLES = ("model.layers.1.engram.embed.weight", "model.layers.4.engram.embed.weight")


def _config(**changes):
    from dsv4.config import DSV4Config

    return DSV4Config.preset("v41_tiny", **{**OVERRIDES, **changes})


def _model(**changes):
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm

    torch.manual_seed(0)
    model = build_causal_lm(_config(**changes))
    model.set_engram_tokenizer(ByteTokenizer())
    return model


def _rows(rank):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(1, 256, (1, 40), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return ids, labels


def _optimizer(params):
    from dsv4.training.optimizer import adamw

    return adamw(params, lr=1e-2, betas=[0.9, 0.95], weight_decay=0.0)


def _table(model, name):
    return model.get_submodule(name.removesuffix(".weight"))


def _body(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    from dsv4.checkpoint import export_hf_checkpoint, load_hf_checkpoint
    from dsv4.checkpoint.load import keep_engram_tables_as_stored
    from dsv4.model.v41.engram_table import EngramTable
    from dsv4.parallel.engram_table import RowShardedEngramTable
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp

    ids, labels = _rows(rank)
    out = {}
    # the one-process model on this rank's rows; its table gradients summed over the ranks
    reference = _model()
    ref = reference(ids, labels=labels)
    ref.loss.backward()
    ref_grads = {n: reference.get_parameter(n).grad.clone() for n in TABLES}
    for g in ref_grads.values():
        dist.all_reduce(g)
    out["ref_logits"] = ref.logits.detach()

    # trainable tables under FSDP
    meshes = build_meshes(ParallelDims(world_size=world, cp=1), "cpu")
    model = apply_fsdp(_model(), meshes)
    res = model(ids, labels=labels)
    res.loss.backward()
    out["logits"] = res.logits.detach()
    out["tables"] = {}
    for name in TABLES:
        table = _table(model, name)
        assert isinstance(table, RowShardedEngramTable) and isinstance(table, EngramTable)
        local = table.weight.to_local()
        start = table.row_start
        out["tables"][name] = {
            "start": start, "rows": local.shape[0], "bytes": local.numel() * local.element_size(),
            "grad": table.weight.grad.to_local().clone(),
            "ref_grad": ref_grads[name][start:start + local.shape[0]],
            "value": local.detach().clone(),
        }
    optimizer = _optimizer([p for p in model.parameters() if p.requires_grad])
    optimizer.step()
    for name in TABLES:
        state = optimizer.state[_table(model, name).weight]
        entry = out["tables"][name]
        entry["state_shapes"] = {k: tuple(v.to_local().shape) for k, v in state.items() if v.dim() > 0}
        entry["state_bytes"] = sum(v.to_local().numel() * v.element_size() for v in state.values() if v.dim() > 0)
        entry["trained"] = _table(model, name).weight.to_local().detach().clone()
        entry["exp_avg"] = state["exp_avg"].to_local().clone()

    # DCP save of each rank's rows and moments, then a fresh model and optimizer load them
    saved = os.path.join(path, "dcp")
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=saved)
    fresh = apply_fsdp(_model(), meshes)
    fresh_optimizer = _optimizer([p for p in fresh.parameters() if p.requires_grad])
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_optimizer)}
    dcp.load(state, checkpoint_id=saved)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_optimizer, optim_state_dict=state["optim"])
    for name in TABLES:
        entry = out["tables"][name]
        weight = _table(fresh, name).weight
        entry["resumed"] = weight.to_local().detach().clone()
        entry["resumed_exp_avg"] = fresh_optimizer.state[weight]["exp_avg"].to_local().clone()

    # the HF export writes whole tables (FP8 rows with row scales)
    export_hf_checkpoint(model, os.path.join(path, "hf"), dtype="quantized")

    # frozen tables from that export: kept in FP8, each rank reading its rows only
    frozen = _model(engram_trainable=False)
    from dsv4.parallel.engram_table import shard_engram_tables

    shard_engram_tables(frozen, meshes.dp_cp)
    kept = keep_engram_tables_as_stored(frozen, os.path.join(path, "hf"))
    report = load_hf_checkpoint(frozen, os.path.join(path, "hf"))
    whole = _model(engram_trainable=False)
    keep_engram_tables_as_stored(whole, os.path.join(path, "hf"))
    whole_report = load_hf_checkpoint(whole, os.path.join(path, "hf"))
    frozen_out = frozen(ids, labels=labels)
    frozen_out.loss.backward()
    frozen_optimizer = _optimizer([p for p in frozen.parameters() if p.requires_grad])
    frozen_optimizer.step()
    export_hf_checkpoint(frozen, os.path.join(path, "hf_frozen"), dtype="bfloat16")
    dcp.save({"state_dict": {f"model.{k}": v for k, v in get_model_state_dict(frozen).items()}},
             checkpoint_id=os.path.join(path, "dcp_frozen"))  # a run's checkpoint holds its kept tables
    table_tensors = {id(t) for n in TABLES for t in (_table(frozen, n).weight, _table(frozen, n).scale)}
    out["frozen"] = {
        "kept": kept, "logits": frozen_out.logits.detach(), "whole_logits": whole(ids, labels=labels).logits.detach(),
        "dtypes": [str(_table(frozen, n).weight.dtype) for n in TABLES],
        "bytes_read": report.bytes_read,
        "whole_bytes_read": whole_report.bytes_read,
        "in_optimizer": sum(id(p) in table_tensors for p in frozen_optimizer.state),
        "table_grads": [getattr(_table(frozen, n).weight, "grad", None) is not None for n in TABLES],
        "held_bytes": sum(t.to_local().numel() * t.element_size() for n in TABLES
                          for t in (_table(frozen, n).weight, _table(frozen, n).scale)),
        "stored": {n: (_table(frozen, n).weight.to_local().view(torch.uint8).clone(),
                       _table(frozen, n).scale.to_local().view(torch.uint8).clone()) for n in TABLES},
    }
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("engram_shard"))
    return path, run_on_ranks(_body, WORLD, (path,))


def test_each_rank_holds_a_quarter_of_the_rows(ranks):
    from dsv4.model import build_causal_lm
    from dsv4.plan.states import engram_table_bytes

    _, results = ranks
    for name, rows in zip(TABLES, OVERRIDES["engram_num_embeddings"]):
        held = [r["tables"][name]["rows"] for r in results]
        chunk = -(-rows // WORLD)
        assert held == [chunk] * (WORLD - 1) + [rows - (WORLD - 1) * chunk] and sum(held) == rows, (name, held)
        assert [r["tables"][name]["start"] for r in results] == [k * chunk for k in range(WORLD)]
    with torch.device("meta"):
        meta = build_causal_lm(_config())
    # the plan's per-rank table bytes are what rank 0 (the largest slices) measured
    assert engram_table_bytes(meta, WORLD) == sum(results[0]["tables"][n]["bytes"] for n in TABLES)


def test_logits_equal_the_one_process_model(ranks):
    _, results = ranks
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["logits"], res["ref_logits"], atol=1e-6, rtol=0, msg=f"rank {rank}")


def test_gradients_touch_only_the_looked_up_rows(ranks):
    _, results = ranks
    for name in TABLES:
        touched = 0
        for rank, res in enumerate(results):
            t = res["tables"][name]
            torch.testing.assert_close(t["grad"], t["ref_grad"], atol=1e-7, rtol=1e-5, msg=f"rank {rank} {name}")
            looked_up = t["ref_grad"].abs().sum(-1) > 0
            assert torch.equal(t["grad"].abs().sum(-1) > 0, looked_up), (rank, name)
            assert not looked_up.all()
            touched += int(looked_up.sum())
        assert touched > 0, name


def test_optimizer_state_is_the_owners_rows_and_round_trips(ranks):
    from dsv4.plan.states import OptimizerProfile, state_bytes
    from dsv4.model import build_causal_lm

    path, results = ranks
    for name in TABLES:
        for res in results:
            t = res["tables"][name]
            assert t["state_shapes"] == {"exp_avg": (t["rows"], 32), "exp_avg_sq": (t["rows"], 32)}
            assert torch.equal(t["resumed"], t["trained"]) and torch.equal(t["resumed_exp_avg"], t["exp_avg"])
            assert not torch.equal(t["trained"], t["value"])
    with torch.device("meta"):
        meta = build_causal_lm(_config())
    planned = state_bytes(meta, world=WORLD, ep=1, compute_dtype=torch.float32, optimizer=OptimizerProfile())
    assert planned.table_optimizer == sum(results[0]["tables"][n]["state_bytes"] for n in TABLES)
    # 4 ranks -> one whole table: DCP places each rank's rows at its offset
    import torch.distributed.checkpoint as dcp

    whole = {f"model.{n}": torch.zeros(rows, 32) for n, rows in zip(TABLES, OVERRIDES["engram_num_embeddings"])}
    whole = {n.removeprefix("model."): t for n, t in whole.items()}
    dcp.load({"model": whole}, checkpoint_id=os.path.join(path, "dcp"), no_dist=True)
    for name in TABLES:
        assert torch.equal(whole[name], torch.cat([r["tables"][name]["trained"] for r in results])), name


def test_export_writes_whole_tables(ranks):
    from dsv4.checkpoint import load_hf_checkpoint
    from dsv4.checkpoint.quant import V41_SCHEME, dequantize, quantize

    path, results = ranks
    model = _model()
    load_hf_checkpoint(model, os.path.join(path, "hf"))
    for name in TABLES:
        trained = torch.cat([r["tables"][name]["trained"] for r in results])
        expected = dequantize(*quantize(trained, "fp8_rows", V41_SCHEME), "fp8_rows", torch.float32, V41_SCHEME)
        assert torch.equal(model.get_parameter(name), expected), name


def test_export_of_fp8_kept_tables_writes_their_values(ranks):
    """The frozen FP8-kept tables exported in bf16 (each rank its rows, dequantised): the values of the quantized
    export they were loaded from, exactly (FP8 values are bf16 values)."""
    from dsv4.checkpoint import load_hf_checkpoint

    path, _ = ranks
    quantized, kept = _model(), _model()
    load_hf_checkpoint(quantized, os.path.join(path, "hf"))
    load_hf_checkpoint(kept, os.path.join(path, "hf_frozen"))
    for name in TABLES:
        assert torch.equal(kept.get_parameter(name), quantized.get_parameter(name)), name


def test_converter_dequantises_tables_a_run_kept_in_fp8(ranks):
    """``python -m dsv4.checkpoint export`` reads a run checkpoint's FP8-kept table (rows and row scales saved by
    each rank) as the values it stands for."""
    from dsv4.checkpoint import load_hf_checkpoint
    from dsv4.checkpoint.convert import DCPTensors, _read_model_tensor

    path, _ = ranks
    quantized = _model()
    load_hf_checkpoint(quantized, os.path.join(path, "hf"))
    tensors = DCPTensors(Path(path) / "dcp_frozen")
    for name in TABLES:
        assert torch.equal(_read_model_tensor(tensors, name), quantized.get_parameter(name)), name


def test_frozen_tables_kept_in_fp8_read_only_their_rows(ranks):
    from safetensors import safe_open

    from dsv4.checkpoint import keys as K

    path, results = ranks
    files = {}
    with open(os.path.join(path, "hf", "model.safetensors.index.json")) as f:
        import json

        weight_map = json.load(f)["weight_map"]
    for name in TABLES:
        hf = K.ours_to_hf(name, family=K.V41)
        with safe_open(os.path.join(path, "hf", weight_map[hf]), "pt") as f:
            files[name] = f.get_tensor(hf).view(torch.uint8)
        with safe_open(os.path.join(path, "hf", weight_map[hf[: -len("weight")] + "scale"]), "pt") as f:
            files[name + ".scale"] = f.get_tensor(hf[: -len("weight")] + "scale").view(torch.uint8)
    from dsv4.model import build_causal_lm
    from dsv4.plan.states import engram_table_bytes

    with torch.device("meta"):  # the plan's FP8 form (PlanSetup.engram_fp8): what rank 0 holds
        meta = build_causal_lm(_config(engram_trainable=False))
    for name in TABLES:
        _table(meta, name).keep_fp8()
    assert engram_table_bytes(meta, WORLD) == results[0]["frozen"]["held_bytes"]
    for rank, res in enumerate(results):
        fr = res["frozen"]
        assert fr["kept"] == list(TABLES) and fr["dtypes"] == ["torch.float8_e4m3fn"] * 2
        torch.testing.assert_close(fr["logits"], fr["whole_logits"], atol=1e-6, rtol=0, msg=f"rank {rank}")
        assert fr["in_optimizer"] == 0 and fr["table_grads"] == [False, False]
        not_held = sum((rows - res["tables"][n]["rows"]) * (32 + 1)  # e4m3 bytes + one e8m0 scale per row
                       for n, rows in zip(TABLES, OVERRIDES["engram_num_embeddings"]))
        assert fr["whole_bytes_read"] - fr["bytes_read"] == not_held, rank
        for name in TABLES:
            start, rows = res["tables"][name]["start"], res["tables"][name]["rows"]
            weight, scale = fr["stored"][name]
            assert torch.equal(weight, files[name][start:start + rows])
            assert torch.equal(scale, files[name + ".scale"][start:start + rows])
