"""DeepSeek-V4.1 under context parallelism: CP=2 and CP=4 on gloo equal one process (logits, loss, every gradient),
contiguous and balanced (``cp_balance="full"``) layouts.

``v41_tiny`` (every CSA2 role: window 0-1, Full 2/4/6 with 6 the candidate source, Reuse 3/5/7/9/11, Reindex
8/10; Engram at 1 and 4; ``fake_quant`` on), fp32, byte-tokenizer Engram classes. Rows: the packer's rows of
uneven documents (aligned to 2, documents crossing chunk boundaries, one shorter than the window, padding, a chunk
of padding only under CP=4) and one row of a single document (every chunk continues it). One forked run per CP
size serves every test of the module: each rank runs the training-path cut of both layouts through the same
model. Traffic: only the designed kinds; each Full layer gathers its compressed rows and index keys once (the
Reindex and Reuse layers read the shared state without exchanging); Engram receives exactly
``engram_max_ngram_size - 1`` int32 token ids per chunk that continues a document held by another rank.
After each layout's step the same model runs the rows again with other token ids (same documents, positions and
padding, so every local shape repeats): the logits equal those of a fresh one-process model on those tokens (nothing
of the earlier forward's selection or shared state survives). The CP=2 ranks also run the DSpark capture job of
``recipes/capture_dspark.py model=v41_tiny cp=2`` (three aligned documents of 12 per row, the middle one across the
rank boundary): it writes the same features as ``cp=1``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks
from tests.distributed.grads import assert_rank_grads_sum_to

pytestmark = pytest.mark.distributed

WIDTH = 128
DOCS = (41, 7, 1, 50, 17, 89, 3, 30, 64)  # uneven lengths, packed first-fit into rows of WIDTH
LAYOUTS = ("none", "full")
KINDS = {"metadata", "halo", "compressed_gather", "index_key_gather", "engram_ids"}


def _model():
    from dsv4.config import DSV4Config
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm

    torch.manual_seed(0)
    config = DSV4Config.preset("v41_tiny")
    assert config.fake_quant and config.engram_layer_ids and config.engram_max_ngram_size == 4
    return build_causal_lm(config, tokenizer=ByteTokenizer())


def _batch():
    """The packer's rows (documents on multiples of 2, padding = document id 0) and one single-document row."""
    from dsv4.batch import TokenBatch
    from dsv4.data import pack_documents

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(1, 256, (n,), generator=g).tolist() for n in DOCS]
    rows = pack_documents(docs, WIDTH, 2)
    ids = torch.randint(1, 256, (1, WIDTH), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    long_doc = TokenBatch(ids, labels, torch.ones_like(ids), torch.arange(WIDTH)[None])
    return TokenBatch.stack([rows[i] for i in range(len(rows))] + [long_doc])


def _new_tokens(batch):
    """``batch`` with other token ids in its real slots (same rows, documents, positions and padding)."""
    from dataclasses import replace

    ids = torch.randint(1, 256, tuple(batch.input_ids.shape), generator=torch.Generator().manual_seed(6))
    return replace(batch, input_ids=torch.where(batch.padding, batch.input_ids, ids))


def _capture_job(tmp_path, cp):
    """The capture recipe's job for ``model=v41_tiny`` at ``cp`` (validated in this process, as the recipe does)."""
    from dsv4.speculative.capture_job import capture_job
    from tests.unit.test_conf import _compose

    args = ["model=v41_tiny", "max_documents=3", "docs_per_shard=3", "max_document_tokens=11", "seq_len=48",
            "progress=false", f"cp={cp}", f"output_dir={tmp_path / f'cp{cp}'}"]
    return capture_job(_compose(args, name="capture_dspark"), tmp_path)


def _body(rank, world_size, capture=None):
    from dsv4.cp import CPContext
    from dsv4.speculative.capture_job import capture_rank
    from dsv4.training.loss import reduce_token_loss

    group = dist.new_group(list(range(world_size)))
    model = _model()
    batch = _batch()
    results = {}
    for balance in LAYOUTS:
        model.zero_grad(set_to_none=True)
        local = batch.cut(rank, world_size, model.config.shard_multiple, balance=balance)
        cp = CPContext(group, balance=balance)
        out = model(local.input_ids, position_ids=local.positions, packed_seq_ids=local.seq_ids,
                    padding_mask=local.padding, labels=local.labels, cp=cp)
        loss = reduce_token_loss(out.loss_sum, out.label_count, group)
        loss.loss.backward()
        results[balance] = {
            "logits": out.logits.detach(), "loss": loss.value,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "traffic": cp.traffic.as_dict(),
        }
        again = _new_tokens(batch).cut(rank, world_size, model.config.shard_multiple, balance=balance)
        assert again.input_ids.shape == local.input_ids.shape
        with torch.no_grad():  # the same model, the same local shapes, other tokens
            results[balance]["new_logits"] = model(
                again.input_ids, position_ids=again.positions, packed_seq_ids=again.seq_ids,
                padding_mask=again.padding, cp=CPContext(group, balance=balance)).logits
    if capture is not None:
        capture_rank(rank, world_size, capture)
    return results


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    model = _model()
    batch = _batch()
    out = model(batch.input_ids, position_ids=batch.positions, packed_seq_ids=batch.seq_ids,
                padding_mask=batch.padding, labels=batch.labels)
    (out.loss_sum / out.label_count).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    new = _new_tokens(batch)
    with torch.no_grad():  # a fresh model (same seed) whose first forward this is: an oracle of its own
        new_logits = _model()(new.input_ids, position_ids=new.positions, packed_seq_ids=new.seq_ids,
                              padding_mask=new.padding).logits
    return {"batch": batch, "logits": out.logits.detach(), "loss": (out.loss_sum / out.label_count).detach(),
            "grads": grads, "config": model.config, "new_logits": new_logits}


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    """The capture jobs of cp=1 and cp=2 (same documents, same seeded model); the cp=2 job runs in the CP=2 ranks."""
    tmp = tmp_path_factory.mktemp("capture")
    return {cp: _capture_job(tmp, cp) for cp in (1, 2)}


@pytest.fixture(scope="module")
def run(captures):
    """``run(cp)``: the forked ranks' results at ``cp`` ranks, run once per size for the whole module."""
    done = {}

    def get(cp):
        if cp not in done:
            done[cp] = run_on_ranks(_body, cp, args=(captures.get(cp),))
        return done[cp]
    return get


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ranks(request, run):
    return request.param, run(request.param)


@pytest.mark.parametrize("balance", LAYOUTS)
def test_logits_and_loss_equal_one_process(ranks, reference, balance):
    from dsv4.parallel.cp.layout import CPLayout

    world_size, results = ranks
    batch = reference["batch"]
    real = ~batch.padding
    # the case is what the docstring says: several documents per row, documents crossing chunk boundaries
    assert len(batch.input_ids) >= 3 and bool(batch.padding.any())
    got = CPLayout(world_size, balance).assemble(torch.stack([r[balance]["logits"] for r in results]))
    torch.testing.assert_close(got[real], reference["logits"][real], atol=1e-5, rtol=0)
    for res in results:
        torch.testing.assert_close(res[balance]["loss"], reference["loss"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("balance", LAYOUTS)
def test_a_second_forward_with_new_tokens_of_the_same_shape_equals_one_process(ranks, reference, balance):
    """Right after the layout's step, the same model on other tokens of the same local shapes (a Reuse or Reindex
    layer keeping the earlier forward's selection, e.g. cached by shape, would attend to the wrong rows)."""
    from dsv4.parallel.cp.layout import CPLayout

    world_size, results = ranks
    real = ~reference["batch"].padding
    want = reference["new_logits"]
    assert (want - reference["logits"])[real].abs().max() > 1.0  # other tokens: other logits
    got = CPLayout(world_size, balance).assemble(torch.stack([r[balance]["new_logits"] for r in results]))
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("balance", LAYOUTS)
def test_every_gradient_equals_one_process(ranks, reference, balance):
    _, results = ranks
    names = set().union(*(r[balance]["grads"] for r in results))
    assert names == set(reference["grads"]), sorted(names ^ set(reference["grads"]))
    assert any(".engram." in n for n in names) and any(".compressor." in n for n in names)
    assert_rank_grads_sum_to(reference["grads"], [r[balance]["grads"] for r in results])


def _continuing_chunks_from_another_rank(batch, layout, rank):
    """Local rows of ``rank`` whose first token continues a document from a chunk held by another rank."""
    length = batch.width // layout.num_chunks
    count = 0
    for chunk in layout.chunks(rank):
        if chunk == 0 or layout.owner(chunk - 1)[0] == rank:
            continue
        col = chunk * length
        same = (batch.seq_ids[:, col] == batch.seq_ids[:, col - 1]) & (batch.seq_ids[:, col] > 0)
        count += int((same & (batch.positions[:, col] > 0)).sum())
    return count


@pytest.mark.parametrize("balance", LAYOUTS)
def test_each_full_layer_gathers_once_and_engram_receives_its_history(ranks, reference, balance):
    from dsv4.parallel.cp.layout import CPLayout

    world_size, results = ranks
    config = reference["config"]
    layout = CPLayout(world_size, balance)
    full_layers = len(config.kv_source_layer_ids)
    reach = config.engram_max_ngram_size - 1
    for rank, res in enumerate(results):
        traffic = res[balance]["traffic"]
        assert {k.removesuffix(".backward") for k in traffic} <= KINDS, sorted(traffic)
        # one gather per Full layer: the Reindex and Reuse layers read the gathered rows from the shared state
        assert traffic["compressed_gather"]["calls"] == full_layers
        assert traffic["index_key_gather"]["calls"] == full_layers
        assert "index_key_gather.backward" not in traffic  # the indexer is frozen: no gradient to return
        expected = 4 * reach * _continuing_chunks_from_another_rank(reference["batch"], layout, rank)
        assert traffic["engram_ids"]["calls"] == 1
        assert traffic["engram_ids"]["bytes_received"] == expected, (rank, traffic["engram_ids"], expected)
        for kind in ("halo", "compressed_gather"):  # every received row's gradient goes back to its owner
            back = traffic.get(f"{kind}.backward", {"bytes_sent": 0})
            assert back["bytes_sent"] == traffic[kind]["bytes_received"], (rank, kind, traffic)
    if balance == "none":  # rank 0 holds the first chunk: nothing precedes it
        assert results[0][balance]["traffic"]["compressed_gather"]["bytes_received"] == 0
    assert all(r[balance]["traffic"]["compressed_gather"]["bytes_received"] > 0 for r in results[1:])
    assert sum(r[balance]["traffic"]["engram_ids"]["bytes_received"] for r in results) > 0


def test_a_chunk_shorter_than_engram_history_is_refused():
    """Engram's history comes from one preceding chunk: a chunk shorter than ``engram_max_ngram_size - 1`` tokens
    is refused before any exchange (here the window's halo alone would fit)."""
    from dsv4.config import DSV4Config
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm
    from dsv4.plan.stand_ins import PlanCP

    model = build_causal_lm(DSV4Config.preset("v41_tiny", sliding_window=2), tokenizer=ByteTokenizer())
    ids = torch.randint(1, 256, (1, 2))
    with pytest.raises(ValueError, match=r"each local chunk has 2 tokens but Engram's history needs the previous "
                                         r"engram_max_ngram_size - 1 = 3 token ids from one chunk; use fewer CP "
                                         r"ranks \(2\)"):
        model(ids, position_ids=torch.arange(2)[None], cp=PlanCP(0, 2))


def test_capture_recipe_at_cp2_writes_the_features_of_cp1(run, captures):
    """``recipes/capture_dspark.py model=v41_tiny cp=2`` (its job, on the CP=2 ranks) against ``cp=1`` (its job in
    this process): the same documents, the same stored features (the config's DSpark targets and the final norm's
    output) within 1e-5."""
    from pathlib import Path

    from safetensors.torch import load_file

    from dsv4.speculative.capture_job import capture_rank, write_index

    run(2)
    capture_rank(0, 1, captures[1])
    one, two = (write_index(Path(captures[cp]["output_dir"]), captures[cp]["shards_total"], captures[cp])
                for cp in (1, 2))
    assert one is not None and two is not None and one["documents"] == two["documents"]
    assert one["layer_ids"] == [9, 10, 11] and [d["length"] for d in one["documents"]] == [11, 11, 11]
    for shard in one["shards"]:
        a, b = (load_file(str(Path(captures[cp]["output_dir"]) / shard)) for cp in (1, 2))
        assert a.keys() == b.keys() and len(a) == 12  # 3 documents: features, final hidden, token ids, mask
        for key in a:
            torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0, msg=key)
