"""DeepSeek-V4.1 Engram tables held in host memory (``LocalEngramTable.hold_on_host``, ``trainer.engram_tables=host``).

On a CPU host and device are one memory, so these tests check the glue, not a copy across a bus: a module move
(``.to(dtype)``, ``.to("cpu")``) leaves a held table's storage as it is (the same storage, the same dtype) while the
other parameters of the model move; a held table reads exactly the rows the same table reads on the device (float
and FP8, a slice of rows too); a kept FP8 table is never cast by a dtype move; a trainable table is refused; a sharded
table held on the host wraps its rows in a ``DTensor`` of the device's mesh without copying them there.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv4.model.v41.engram_table import LocalEngramTable

ROWS, HEAD = 97, 64


def _table(fp8: bool, row_slice=None, seed: int = 0) -> LocalEngramTable:
    torch.manual_seed(seed)
    table = LocalEngramTable(ROWS, HEAD, row_slice=row_slice)
    table.reset_parameters(0.5)
    table.weight.requires_grad_(False)
    if fp8:
        table.keep_fp8()
    return table


def _storage(table: LocalEngramTable) -> list[tuple[int, torch.dtype]]:
    return [(t.data_ptr(), t.dtype) for t in (table.weight, getattr(table, "scale", None)) if t is not None]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("move", [torch.float64, torch.bfloat16, "cpu", "double"])
def test_a_move_of_the_model_leaves_a_held_tables_storage(fp8, move):
    table = _table(fp8)
    table.hold_on_host()
    model = nn.ModuleDict({"engram": nn.ModuleDict({"embed": table}), "proj": nn.Linear(4, 4)})
    before, proj = _storage(table), model["proj"].weight.data_ptr()
    moved = model.double() if move == "double" else model.to(move)
    assert moved is model and model["engram"]["embed"] is table
    assert _storage(table) == before  # the same storage, the same dtype
    assert table.held_on_host and table.kept_fp8 == fp8
    if move != "cpu":  # the float parameter beside it is cast
        assert model["proj"].weight.dtype == (torch.float64 if move == "double" else move)
        assert model["proj"].weight.data_ptr() != proj
    assert list(dict(model.state_dict())) == ["engram.embed.weight", *(["engram.embed.scale"] if fp8 else []),
                                              "proj.weight", "proj.bias"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_kept_fp8_table_on_the_device_follows_a_move_but_never_its_dtype(dtype):
    table, reference = _table(True), _table(True)
    ids = torch.randint(0, ROWS, (5, 3))
    nn.Sequential(table).to(dtype)
    assert (table.weight.dtype, table.scale.dtype) == (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    assert torch.equal(table.lookup(ids, torch.float32), reference.lookup(ids, torch.float32))
    float_table = _table(False)
    nn.Sequential(float_table).to(dtype)  # a float table on the device moves as any module
    assert float_table.weight.dtype == dtype


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("row_slice", [None, (40, 97)])
def test_a_held_table_reads_the_rows_the_device_table_reads(fp8, row_slice):
    device, host = _table(fp8, row_slice), _table(fp8, row_slice)
    host.hold_on_host()
    nn.Sequential(host).to(torch.float64)  # (no effect on a held table; the device table is left as built)
    start = 0 if row_slice is None else row_slice[0]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(start, ROWS, (2, 11, 6), generator=g)
    ids[0, 0, :2] = torch.tensor([start, ROWS - 1])  # the slice's first and last rows
    for dtype in (torch.float32, torch.bfloat16, None):
        got, want = host.lookup(ids, dtype), device.lookup(ids, dtype)
        assert got.shape == (2, 11, 6, HEAD) and got.dtype == want.dtype
        assert torch.equal(got, want), dtype
    local = ids.reshape(-1)[:7] - start
    assert torch.equal(host.read(local, torch.float32), device.read(local, torch.float32))
    if fp8:
        assert torch.equal(host.encode(local), device.encode(local))
    # the rows read are the held rows at those ids (an oracle apart from the table's own read path)
    if fp8:
        from dsv4.checkpoint.quant import V41_SCHEME, dequantize

        flat = ids.reshape(-1) - start
        want = dequantize(host.weight[flat], host.scale[flat], "fp8_rows", torch.float32, V41_SCHEME)
        assert torch.equal(host.lookup(ids, torch.float32), want.view(*ids.shape, HEAD))
    else:
        assert torch.equal(host.lookup(ids), host.weight[ids - start])


def test_a_trainable_table_is_not_held_on_the_host():
    table = LocalEngramTable(ROWS, HEAD, trainable=True)
    with pytest.raises(ValueError, match=r"a trainable table \(model.engram_trainable=true\) cannot be held in host "
                                         r"memory \(trainer.engram_tables=host"):
        table.hold_on_host()
    assert not table.held_on_host


def test_holding_is_idempotent_and_survives_the_switch_to_fp8():
    """``keep_engram_tables_as_stored`` switches a table to FP8 after the strategy held it: it stays held."""
    table = _table(False)
    table.hold_on_host()
    table.hold_on_host()
    table.keep_fp8()
    before = _storage(table)
    nn.Sequential(table).to(torch.float16)
    assert table.held_on_host and table.kept_fp8 and _storage(table) == before
    assert "in host memory" in repr(table)


def test_a_sharded_table_held_on_the_host_keeps_its_rows_off_the_meshs_device(one_rank_group):
    """Over a mesh of the GPUs (built without a GPU: no collective runs here) the host-held slice is the local tensor
    of a ``Shard(0)`` DTensor of the whole table, the same storage in host memory; a device-held one would be copied
    to the mesh's device (``DTensor.from_local``), which this CPU build cannot do."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from dsv4.parallel.engram_table import _global

    mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
    rows = torch.randn(ROWS, HEAD)
    held = _global(rows, mesh, ROWS, on_host=True)
    assert isinstance(held, DTensor) and held.placements == (Shard(0),) and held.shape == (ROWS, HEAD)
    assert held.device_mesh.device_type == "cuda" and held.to_local().data_ptr() == rows.data_ptr()
    cpu_mesh = DeviceMesh("cpu", torch.arange(1), _init_backend=False)
    assert _global(rows, cpu_mesh, ROWS, on_host=True).to_local().data_ptr() == rows.data_ptr()


def test_the_dspark_target_holds_its_tables_through_the_strategys_before_load(one_rank_group):
    """``build_frozen_target(before_load=strategy.shard_engram_tables)`` (drafter training's target) under
    ``trainer.engram_tables=host``: the target's tables are held in host memory, stay there when the target moves to
    the module's device, and its DSpark features equal those of the target held on the device."""
    from dsv4.batch import TokenBatch
    from dsv4.config import DSV4Config
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.speculative.dspark_step import target_features
    from dsv4.speculative.target import build_frozen_target
    from dsv4.training.strategy import DSV4Strategy

    config = DSV4Config.preset("v41_tiny")
    meshes = build_meshes(ParallelDims(world_size=1), "cpu")
    targets = {}
    for where in ("device", "host"):
        strategy = DSV4Strategy(engram_tables=where)
        strategy.meshes = meshes
        targets[where] = build_frozen_target(config, seed=0, before_load=strategy.shard_engram_tables)
    tables = [m for m in targets["host"].modules() if isinstance(m, LocalEngramTable)]
    assert len(tables) == 2 and all(t.held_on_host for t in tables)
    assert not any(m.held_on_host for m in targets["device"].modules() if isinstance(m, LocalEngramTable))
    before = [_storage(t) for t in tables]
    targets["host"].to(torch.device("cpu")).to(torch.float64).to(torch.float32)  # a move there and back
    assert [_storage(t) for t in tables] == before
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))  # byte tokens
    batch = TokenBatch(ids, ids, torch.ones_like(ids), torch.arange(64).unsqueeze(0))
    got = target_features(targets["host"], batch, config.dspark_target_layer_ids)
    want = target_features(targets["device"], batch, config.dspark_target_layer_ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
