"""DeepSeek-V4.1's frozen Engram tables row-sharded over 2 gloo ranks and held in host memory
(``shard_engram_tables(..., on_host=True)``, ``trainer.engram_tables=host``) against the same tables held on the device.

On a CPU host and device are one memory: what is checked is the glue. The model is v41_tiny cut to 6 blocks with
tables of 358 and 522 rows (2 ranks: 179 + 179 and 261 + 261), frozen, in float and in the kept FP8 form (switched
after sharding, as ``keep_engram_tables_as_stored`` does). Per rank, one launch:

* each table's ``lookup`` of this rank's ids (a collective) returns exactly the device-held table's rows, in fp32
  and bf16, and exactly the whole one-process table's rows;
* under the real ``apply_fsdp(engram_on_host=True)`` FSDP never receives a held table's tensors to move (its
  ``_move_states_to_device`` is recorded), the buffers are back afterwards (the same tensors), a move of the model
  leaves them (the same storage), and the logits and loss equal the device-held model's; the tables get no gradient;
* a distributed checkpoint of the host-held model (``get_model_state_dict``, as the strategy saves one) holds the
  same tables as the device-held model's, and loads back into a fresh host-held model bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
OVERRIDES = dict(num_hidden_layers=6, compress_ratios=[0, 0, 2, 2, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 4],
                 index_source_layer_ids=[2, 4], candidate_source_layer_id=4, dspark_target_layer_ids=[3, 4, 5],
                 engram_vocab_size=45, engram_num_embeddings=[358, 522], engram_trainable=False)
TABLES = ("model.layers.1.engram.embed", "model.layers.4.engram.embed")


def _model(mesh=None, on_host=False, fp8=False):
    from dsv4.config import DSV4Config
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm
    from dsv4.parallel.engram_table import shard_engram_tables

    torch.manual_seed(0)
    model = build_causal_lm(DSV4Config.preset("v41_tiny", **OVERRIDES))
    model.set_engram_tokenizer(ByteTokenizer())
    if mesh is not None:
        shard_engram_tables(model, mesh, on_host=on_host)
    if fp8:
        for name in TABLES:
            model.get_submodule(name).keep_fp8()
    return model


def _storage(model):
    return {n: [(t.to_local().data_ptr(), t.dtype) for t in (model.get_submodule(n).weight,
                                                             getattr(model.get_submodule(n), "scale", None))
                if t is not None] for n in TABLES}


def _body(rank, world, path):
    import torch.distributed.checkpoint as dcp
    import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp

    meshes = build_meshes(ParallelDims(world_size=world, cp=1), "cpu")
    g = torch.Generator().manual_seed(7 + rank)
    ids = torch.randint(1, 256, (1, 40), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    out = {"lookups": {}, "model": {}}

    # lookups: host-held, device-held and whole tables, float and FP8
    for fp8 in (False, True):
        whole, device, host = _model(fp8=fp8), _model(meshes.dp_cp, fp8=fp8), _model(meshes.dp_cp, True, fp8=fp8)
        for name in TABLES:
            table = host.get_submodule(name)
            assert table.held_on_host and device.get_submodule(name).held_on_host is False
            rows = torch.randint(0, table.rows, (3, 17), generator=g)
            rows[0, :2] = torch.tensor([0, table.rows - 1])
            for dtype in (torch.float32, torch.bfloat16):
                got = table.lookup(rows, dtype)
                out["lookups"][(fp8, name, str(dtype))] = (
                    torch.equal(got, device.get_submodule(name).lookup(rows, dtype)),
                    torch.equal(got, whole.get_submodule(name).lookup(rows, dtype)))

    # the model under FSDP: FSDP never moves a held table's tensors; the same logits as the device-held model
    moved: list[int] = []
    original = fsdp_init._move_states_to_device

    def recording(params, buffers, device):
        moved.extend(id(t) for t in (*params, *buffers))
        return original(params, buffers, device)

    for fp8 in (False, True):
        device = apply_fsdp(_model(meshes.dp_cp, fp8=fp8), meshes)
        host = _model(meshes.dp_cp, True, fp8=fp8)
        tensors = {id(t) for n in TABLES for t in (host.get_submodule(n).weight,
                                                   getattr(host.get_submodule(n), "scale", None)) if t is not None}
        before = _storage(host)
        moved.clear()
        fsdp_init._move_states_to_device = recording
        try:
            apply_fsdp(host, meshes, engram_on_host=True)
        finally:
            fsdp_init._move_states_to_device = original
        seen = {id(t) for n in TABLES for t in (host.get_submodule(n).weight,
                                                getattr(host.get_submodule(n), "scale", None)) if t is not None}
        host.to("cpu").to(torch.float32)
        res, ref = host(ids, labels=labels), device(ids, labels=labels)
        res.loss.backward()
        out["model"][fp8] = {
            "fsdp_moved_a_table": bool(tensors & set(moved)), "fsdp_moved_something": bool(moved),
            "same_tensors_after": seen == tensors, "storage_kept": _storage(host) == before,
            "logits": torch.equal(res.logits, ref.logits), "loss": (res.loss.item(), ref.loss.item()),
            "table_grads": [getattr(host.get_submodule(n).weight, "grad", None) is not None for n in TABLES],
        }
        # a distributed checkpoint: the same tables as the device-held model's, loaded back bit for bit
        saved = os.path.join(path, f"dcp_{int(fp8)}")
        state = get_model_state_dict(host)
        reference = get_model_state_dict(device)
        keys = [k for k in state if ".engram.embed." in k]
        out["model"][fp8]["saved_equal"] = all(torch.equal(state[k].to_local(), reference[k].to_local()) for k in keys)
        out["model"][fp8]["keys"] = sorted(keys)
        dcp.save({"model": state}, checkpoint_id=saved)
        fresh = _model(meshes.dp_cp, True, fp8=fp8)
        with torch.no_grad():
            for n in TABLES:
                fresh.get_submodule(n).weight.to_local().zero_()
        fresh_before = _storage(fresh)
        fresh_state = {"model": get_model_state_dict(fresh)}
        dcp.load(fresh_state, checkpoint_id=saved)
        set_model_state_dict(fresh, fresh_state["model"])
        out["model"][fp8]["loaded_equal"] = all(
            torch.equal(fresh.get_submodule(n).weight.to_local().view(torch.uint8),
                        host.get_submodule(n).weight.to_local().view(torch.uint8)) for n in TABLES)
        out["model"][fp8]["loaded_in_place"] = _storage(fresh) == fresh_before
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("engram_host"))
    return run_on_ranks(_body, WORLD, (path,))


def test_host_held_lookups_equal_the_device_held_and_the_whole_tables(ranks):
    for rank, res in enumerate(ranks):
        assert len(res["lookups"]) == 2 * len(TABLES) * 2
        for key, (same_as_device, same_as_whole) in res["lookups"].items():
            assert same_as_device and same_as_whole, (rank, key)


def test_fsdp_and_model_moves_leave_the_host_held_tables(ranks):
    for rank, res in enumerate(ranks):
        for fp8, m in res["model"].items():
            assert m["fsdp_moved_something"] and not m["fsdp_moved_a_table"], (rank, fp8)
            assert m["same_tensors_after"] and m["storage_kept"], (rank, fp8)
            assert m["table_grads"] == [False, False], (rank, fp8)


def test_host_held_model_gives_the_device_held_logits(ranks):
    for rank, res in enumerate(ranks):
        for fp8, m in res["model"].items():
            assert m["logits"], (rank, fp8)
            assert m["loss"][0] == m["loss"][1], (rank, fp8, m["loss"])


def test_host_held_tables_save_and_load_as_the_device_held_ones(ranks):
    for rank, res in enumerate(ranks):
        for fp8, m in res["model"].items():
            want = sorted(f"{n}.{leaf}" for n in TABLES for leaf in (("weight", "scale") if fp8 else ("weight",)))
            assert m["keys"] == want, (rank, fp8, m["keys"])
            assert m["saved_equal"] and m["loaded_equal"] and m["loaded_in_place"], (rank, fp8)
