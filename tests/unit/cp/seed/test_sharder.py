"""Non-packed contiguous shard, the CP=1 route, ShardLayout and ContextParallelSharder (seed API)."""

import copy
import functools

import pytest
import torch

from dsv4.cp import (
    ContextParallelSharder,
    ShardLayout,
    contiguous_local_indices,
    convert_attention_mask_to_padding_mask,
    dsv4_cp_sharder,
    make_dsv4_contiguous_shard_cp_batch_and_ctx,
)
from tests.conftest import FakeMesh


def test_non_packed_pads_continues_positions_and_slices():
    batch = {
        "input_ids": torch.arange(1, 6).view(1, 5),
        "labels": torch.arange(11, 16).view(1, 5),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0]]),
    }
    outs = []
    for r in range(2):
        _, out, layout = make_dsv4_contiguous_shard_cp_batch_and_ctx(
            FakeMesh(2, r), None, copy.deepcopy(batch), padding_token_id=9, pad_multiple=3
        )
        outs.append(out)
    # P = 5 rounded up to C * max(3, 2) = 6 -> 6; L = 3
    assert layout == ShardLayout(original_seq_len=5, padded_seq_len=6)
    assert [o["input_ids"].tolist() for o in outs] == [[[1, 2, 3]], [[4, 5, 9]]]
    assert [o["labels"].tolist() for o in outs] == [[[11, 12, 13]], [[14, 15, -100]]]
    assert [o["position_ids"].tolist() for o in outs] == [[[0, 1, 2]], [[3, 4, 5]]]  # continued, not 0
    assert [o["padding_mask"].tolist() for o in outs] == [[[False] * 3], [[False, True, True]]]
    assert "attention_mask" not in outs[0]


def test_non_packed_without_masks_creates_no_padding_mask_and_promotes_loss_mask():
    batch = {"input_ids": torch.arange(4).view(1, 4)}
    loss_mask = torch.tensor([[1, 1, 0, 1]])
    _, out, _ = make_dsv4_contiguous_shard_cp_batch_and_ctx(FakeMesh(2, 1), None, batch, loss_mask=loss_mask)
    assert "padding_mask" not in out  # seed behaviour
    assert out["labels"].tolist() == [[0, 1]]  # loss_mask promoted to labels on the non-packed path


def test_position_ids_broadcast_row_and_3d():
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long),
             "position_ids": torch.tensor([[5, 6, 7, 8]])}
    _, out, _ = make_dsv4_contiguous_shard_cp_batch_and_ctx(FakeMesh(2, 1), None, batch)
    assert out["position_ids"].tolist() == [[7, 8], [7, 8]]
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long),
             "position_ids": torch.arange(4).view(1, 1, 4).expand(3, 1, 4)}
    _, out, _ = make_dsv4_contiguous_shard_cp_batch_and_ctx(FakeMesh(2, 0), None, batch)
    assert out["position_ids"].shape == (3, 1, 2)


def test_cp1_keeps_native_thd_route():
    batch = {"input_ids": torch.arange(6).view(1, 6), "seq_lens": torch.tensor([[6]]), "attention_mask": torch.ones(1, 6)}
    loss_mask = torch.ones(1, 6)
    ctx, out, layout = make_dsv4_contiguous_shard_cp_batch_and_ctx(None, None, batch, loss_mask=loss_mask)
    assert layout is None and out["qkv_format"] == "thd"
    assert "attention_mask" in out and "_dsv4_cp_group" not in out
    assert torch.equal(out["labels"], loss_mask)
    with ctx():
        pass


def test_convert_attention_mask_variants():
    b = {"attention_mask": torch.tensor([[1, 0]])}
    assert convert_attention_mask_to_padding_mask(b)["padding_mask"].tolist() == [[False, True]]
    additive = torch.tensor([[[[0.0, -1e9], [-1e9, -1e9]]]])
    b = {"attention_mask": additive}
    assert convert_attention_mask_to_padding_mask(b)["padding_mask"].tolist() == [[False, True]]
    b = {"attention_mask": torch.tensor([[[[True, False], [False, False]]]])}
    assert convert_attention_mask_to_padding_mask(b)["padding_mask"].tolist() == [[False, True]]
    b = {"attention_mask": torch.tensor([[1, 0]]), "padding_mask": torch.tensor([[True, True]])}
    assert convert_attention_mask_to_padding_mask(b)["padding_mask"].tolist() == [[True, True]]
    assert "attention_mask" not in b


def test_sharder_constructor_modes():
    fn = functools.partial(make_dsv4_contiguous_shard_cp_batch_and_ctx, pad_multiple=8)
    with pytest.raises(TypeError, match="mutually exclusive"):
        ContextParallelSharder(model=object(), shard_batch=fn)
    with pytest.raises(TypeError, match="mutually exclusive"):
        ContextParallelSharder(shard_batch=fn, num_chunks=2)
    with pytest.raises(TypeError, match="`batch`"):
        ContextParallelSharder(model=object())
    with pytest.raises(TypeError, match="require `shard_batch`"):
        ContextParallelSharder(model=object(), batch={}, local_token_global_indices=contiguous_local_indices)


def test_resolution_mode_uses_the_model_hook():
    calls = []

    class Model:
        config = type("C", (), {"compress_ratios": [0, 4, 128]})()

        def prepare_model_inputs_for_cp(self, batch, *, num_chunks=1):
            calls.append(num_chunks)
            return {"cp_sharder": dsv4_cp_sharder(self.config, None), "extra_key": 1}

    batch = {"input_ids": torch.arange(130).view(1, 130), "labels": torch.arange(130).view(1, 130),
             "seq_lens": torch.tensor([[130]])}
    sharder = ContextParallelSharder(Model(), FakeMesh(2, 1), batch)
    assert calls == [1] and batch["extra_key"] == 1
    _, out = sharder.shard(batch)
    # multiple 128 (ratio 4 counts as 8): 130 -> 256 per document, row 256 -> CP 2 x 128
    assert sharder.shard_layout.padded_seq_len == 256
    assert out["input_ids"][0, :2].tolist() == [128, 129] and out["padding_mask"][0, 2:].all()


def test_shard_token_tensor_rules():
    caller = {"input_ids": torch.arange(1, 7).view(1, 6), "labels": torch.arange(1, 7).view(1, 6),
              "seq_lens": torch.tensor([[2, 3]]), "seq_lens_padded": torch.tensor([[3, 3]])}
    caller["labels"][0, 2] = -100
    sharder = dsv4_cp_sharder(type("C", (), {"compress_ratios": [2]})(), FakeMesh(2, 1))
    sharder.shard(copy.deepcopy(caller))
    layout = sharder.shard_layout
    assert layout.padded_seq_len == 8 and layout.input_token_stream_positions.tolist() == [[0, 1, -1, 2, 3, 4]]
    with pytest.raises(ValueError, match="requires `fill`"):
        sharder.shard_token_tensor(torch.zeros(1, 6))
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert sharder.shard_token_tensor(adv, fill=-1.0).tolist() == [[6.0, -1.0, -1.0, -1.0]]
    # a tensor already in padded coordinates is sharded directly
    assert sharder.shard_token_tensor(torch.arange(8).view(1, 8)).tolist() == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match="padded_seq_len=8"):
        sharder.shard_token_tensor(torch.zeros(1, 5))
    # trailing dims go through the map too
    assert sharder.shard_token_tensor(adv.unsqueeze(-1).expand(1, 6, 2), fill=0.0).shape == (1, 4, 2)


def test_gather_token_tensor_without_cp_trims_through_layout():
    layout = ShardLayout(original_seq_len=5, padded_seq_len=8)
    sharder = ContextParallelSharder(
        shard_batch=make_dsv4_contiguous_shard_cp_batch_and_ctx, device_mesh=None,
        local_token_global_indices=contiguous_local_indices, shard_layout=layout,
    )
    t = torch.arange(8.0).view(1, 8)
    assert sharder.gather_token_tensor(t) is t
    assert sharder.gather_token_tensor(t, trim=True).tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0]]
    with pytest.raises(ValueError, match="gathered length 6 on dim 1 != reported padded_seq_len 8"):
        sharder.gather_token_tensor(torch.zeros(1, 6), trim=True)
    # non-packed shard of the original length is right-padded with fill
    assert sharder.shard_token_tensor(torch.ones(1, 5), fill=0.0).tolist() == [[1.0] * 5 + [0.0] * 3]


def test_gather_over_pretend_mesh_refuses_without_distributed():
    sharder = ContextParallelSharder(
        shard_batch=make_dsv4_contiguous_shard_cp_batch_and_ctx, device_mesh=FakeMesh(2, 0),
        local_token_global_indices=contiguous_local_indices,
    )
    with pytest.raises(RuntimeError, match="not initialised"):
        sharder.gather_token_tensor(torch.zeros(1, 4))


def test_layout_local_indices_must_match():
    layout = ShardLayout(local_token_global_indices=torch.arange(4), padded_seq_len=8)
    sharder = ContextParallelSharder(shard_batch=make_dsv4_contiguous_shard_cp_batch_and_ctx,
                                     device_mesh=FakeMesh(2, 0), shard_layout=layout)
    assert sharder.shard_token_tensor(torch.arange(8).view(1, 8)).tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="does not match the batch last sharded"):
        sharder._indices(6, "cpu")
    bare = ContextParallelSharder(shard_batch=make_dsv4_contiguous_shard_cp_batch_and_ctx, device_mesh=FakeMesh(2, 0))
    with pytest.raises(NotImplementedError, match="data-dependent"):
        bare.shard_token_tensor(torch.zeros(1, 8))
