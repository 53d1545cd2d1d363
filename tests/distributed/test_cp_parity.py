"""Context parallelism inside the model: CP=2 and CP=4 on gloo equal CP=1 (logits, loss, every gradient).

Tiny preset (ratio 0, 4 and 128 layers, hash layers, hc_mult 4, MTP), fp32. Packed rows of several documents —
one spans a rank boundary, one is shorter than the sliding window, one rank holds only pack padding — and
unpacked rows with right padding. Each rank shards the same caller batch with the DSV4 sharder, runs
``model(**local_batch)``, reduces the token-weighted loss over the CP group and backpropagates; the parent
compares against a single-process run of the same (repadded) rows.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks
from tests.distributed.grads import assert_rank_grads_sum_to

pytestmark = pytest.mark.distributed

# documents per row; after the repad to the multiple 128 they occupy [256, 128, 128, 512, 128] / [768, 128, 256]
PACKED_DOCS = [[200, 37, 5, 400, 60], [700, 3, 250]]
WIDTH = 1000


def _packed_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 256, (2, WIDTH), generator=g)
    labels = torch.full((2, WIDTH), -100)
    seq_lens = torch.full((2, 5), -1000)
    for b, docs in enumerate(PACKED_DOCS):
        off = 0
        for k, n in enumerate(docs):
            labels[b, off : off + n - 1] = ids[b, off + 1 : off + n]  # shifted inside the document
            seq_lens[b, k] = n
            off += n
    return {"input_ids": ids, "labels": labels, "seq_lens": seq_lens, "seq_lens_padded": seq_lens.clone()}


def _unpacked_batch():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 256, (2, 640), generator=g)
    real = torch.tensor([640, 450])  # row 1 is right-padded
    attention_mask = (torch.arange(640)[None] < real[:, None]).long()
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[attention_mask == 0] = -100
    labels[1, 449] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": attention_mask}


def _model(activation_checkpointing="none", moe_chunk_tokens=0):
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    config = DSV4Config.preset("tiny", activation_checkpointing=activation_checkpointing,
                               moe_chunk_tokens=moe_chunk_tokens)
    assert {0, 4, 128} <= set(config.compress_ratios) and config.num_hash_layers >= 1
    assert config.hc_mult == 4 and config.num_nextn_predict_layers >= 1
    return DSV4ForCausalLM(config)


def _cp_body(rank, world_size, kind):
    from dsv4.cp import CPContext, dsv4_cp_sharder
    from dsv4.training.loss import reduce_token_loss

    group = dist.new_group(list(range(world_size)))
    model = _model()
    batch = _packed_batch() if kind == "packed" else _unpacked_batch()
    sharder = dsv4_cp_sharder(model.config, group)
    _, local = sharder.shard(batch)
    try:  # a context whose size differs from the group the batch was sharded for is refused up front
        model(**local, cp=CPContext(None))
        raise AssertionError("a CP size mismatch was not detected")
    except ValueError as err:
        assert f"sharded for a CP group of {world_size} ranks but the forward got a CPContext of 1" in str(err)
    cp = CPContext(group)
    out = model(**local, cp=cp)  # the batch also carries its group: the sizes agree
    loss = reduce_token_loss(out.loss_sum, out.label_count, group)
    loss.loss.backward()
    logits = sharder.gather_token_tensor(out.logits.detach(), trim=True, fill=0.0)
    mtp = sharder.gather_token_tensor(out.mtp_logits[0].detach(), trim=True, fill=0.0)
    return {
        "logits": logits,
        "mtp": mtp,
        "loss": loss.value,
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "traffic": cp.traffic.as_dict(),
    }


def packed_reference(model):
    """``model`` on :func:`_packed_batch` in one process (repadded like the sharder does), with labels; returns the
    output and the caller positions of the repadded rows (the oracle of the CP parity tests)."""
    from dsv4.cp import _repad_dsv4_packed_batch

    rows, _, positions = _repad_dsv4_packed_batch(
        copy.deepcopy(_packed_batch()), cp_size=1, pad_multiple=model.config.shard_multiple, padding_token_id=0
    )
    out = model(rows["input_ids"], position_ids=rows["position_ids"], packed_seq_ids=rows["packed_seq_ids"],
                padding_mask=rows["padding_mask"], labels=rows["labels"])
    return out, positions


def _reference(kind):
    """Single process: the same rows (repadded like the sharder does for packed batches), cp=None."""
    torch.set_num_threads(1)
    model = _model()
    batch = _packed_batch() if kind == "packed" else _unpacked_batch()
    if kind == "packed":
        out, positions = packed_reference(model)

        def restore(t):
            gathered = t.gather(1, positions.clamp_min(0).unsqueeze(-1).expand(-1, -1, t.shape[-1]))
            return torch.where((positions >= 0).unsqueeze(-1), gathered, torch.zeros_like(gathered))

        covered = positions >= 0
    else:
        out = model(batch["input_ids"], padding_mask=batch["attention_mask"] == 0, labels=batch["labels"])

        def restore(t):
            return t

        covered = batch["attention_mask"] == 1
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return restore(out.logits.detach()), restore(out.mtp_logits[0].detach()), out.loss.detach(), grads, covered


@pytest.mark.parametrize("kind", ["packed", "unpacked"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_matches_single_rank(world_size, kind):
    results = run_on_ranks(_cp_body, world_size, args=(kind,))
    ref_logits, ref_mtp, ref_loss, ref_grads, covered = _reference(kind)
    for res in results:
        torch.testing.assert_close(res["logits"][covered], ref_logits[covered], atol=1e-5, rtol=0)
        torch.testing.assert_close(res["mtp"][covered], ref_mtp[covered], atol=1e-5, rtol=0)
        torch.testing.assert_close(res["loss"], ref_loss.to(res["loss"].dtype), atol=1e-6, rtol=0)
    # only the designed exchanges ran; rank 0 receives nothing from a predecessor
    kinds = {"metadata", "metadata_halo", "halo", "compressor_halo", "index_compressor_halo", "compressed_gather",
             "index_key_gather", "mtp_metadata"}
    for res in results:
        assert {k.removesuffix(".backward") for k in res["traffic"]} <= kinds, sorted(res["traffic"])
    first = results[0]["traffic"]
    assert first["halo"]["bytes_received"] == 0 and first["compressed_gather"]["bytes_received"] == 0
    assert results[1]["traffic"]["halo"]["bytes_received"] > 0
    names = set().union(*(r["grads"] for r in results))
    assert names == set(ref_grads), sorted(names ^ set(ref_grads))
    assert_rank_grads_sum_to(ref_grads, [r["grads"] for r in results])


def _token_batch():
    """The training path's batch: the packer's rows (documents on multiples of 128, padding = document id 0)."""
    from dsv4.batch import TokenBatch
    from dsv4.config import DSV4Config
    from dsv4.data import pack_documents

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (200, 37, 5, 400, 60, 700, 3, 250, 900)]
    rows = pack_documents(docs, 1024, DSV4Config.preset("tiny").shard_multiple)
    return rows, TokenBatch.stack([rows[i] for i in range(len(rows))])


def _training_step_body(rank, world_size, recompute, moe_chunk_tokens=0):
    from dsv4.cp import CPContext
    from dsv4.training.loss import reduce_token_loss
    from dsv4.training.step import forward_outputs

    group = dist.new_group(list(range(world_size)))
    model = _model(recompute, moe_chunk_tokens)
    _, batch = _token_batch()
    local = batch.cut(rank, world_size, model.config.shard_multiple)
    try:  # the batch knows which shard it is: a context of another rank or size is refused before the forward
        forward_outputs(model, local, cp=None)
        raise AssertionError("a shard / CP context mismatch was not detected")
    except ValueError as err:
        assert f"CP shard {rank} of {world_size} but the forward runs as rank 0 of a CP group of 1" in str(err)
    cp = CPContext(group)
    out = forward_outputs(model, local, cp=cp)
    loss_sum, count = out.loss_sum, out.label_count
    loss = reduce_token_loss(loss_sum, count, group)
    loss.loss.backward()
    return {"loss": loss.value, "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            "traffic": cp.traffic.as_dict()}


@pytest.mark.parametrize("world_size, recompute, moe_chunk_tokens",
                         [(2, "none", 0), (4, "none", 0), (2, "block", 64), (4, "selective", 0)])
def test_training_path_cp_matches_single_rank(world_size, recompute, moe_chunk_tokens):
    """The training path (packer rows -> TokenBatch.cut -> forward_outputs with the CPContext) against one process
    without recompute: a recomputed block (the MTP depth too; with chunked experts) exchanges again in backward, with
    the same data, on every rank; the MTP's document shift runs once, outside the recomputed depth."""
    from dsv4.training.step import forward_outputs

    rows, batch = _token_batch()
    assert len(rows) >= 2 and bool((batch.seq_ids == 0).any())  # several rows, padding present
    results = run_on_ranks(_training_step_body, world_size, args=(recompute, moe_chunk_tokens))
    if recompute != "none":  # the recompute really ran the exchanges a second time
        assert results[1]["traffic"]["halo"]["calls"] > results[1]["traffic"]["halo.backward"]["calls"]
    for res in results:  # ids and labels shifted once per MTP depth, never again in backward
        assert res["traffic"]["mtp_metadata"]["calls"] == 2, res["traffic"]["mtp_metadata"]
    torch.set_num_threads(1)
    model = _model()
    out = forward_outputs(model, batch)
    loss_sum, count = out.loss_sum, out.label_count
    (loss_sum / count).backward()
    for res in results:
        torch.testing.assert_close(res["loss"], (loss_sum / count).detach().to(res["loss"].dtype), atol=1e-6, rtol=0)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        total = sum(r["grads"][name] for r in results)
        err = ((total - p.grad).norm() / p.grad.norm().clamp_min(1e-12)).item()
        assert err < 1e-4 or (total - p.grad).abs().max() < 1e-9, f"{name}: relative gradient error {err:.2e}"
