"""Context-parallel traffic of a training step against a first-principles lower bound, in several layouts.

The tiny model (window, CSA and HCA layers, MTP) runs one forward+backward on ``--cp`` gloo ranks for each layout:

* ``one_document``: one row, one document of ``S`` tokens;
* ``short_documents``: one row of 512-token documents (every chunk starts a document);
* ``starts_and_padding``: one row where chunk 1 continues a document, chunk 2 starts one and chunk 3 starts with
  padding (as far as the row reaches);
* ``two_rows``: ``one_document`` and ``short_documents`` in one batch (each row needs its own, not the union);
* ``one_document_balanced``: ``one_document`` with ``cp_balance=full`` (head-tail chunks).

Every exchange counts its bytes in the ``CPContext`` traffic counter; every kind it reports must be one this script
classifies (an unknown kind fails). The bound is computed from the token layout alone (documents, positions, the
chunk cut), not from the implementation's exchange plans. Per local row (chunk ``v`` of row ``b``, first column
``c``) whose first token continues a document from column ``c - 1`` (both real, one document) and per attention
layer of ratio ``r``:

* window keys: the K/V rows of that document among the ``W - 1`` columns before ``c`` (the first query's window);
* ratio 4: the previous window's first feature halves as the next window pools them: per channel one logsumexp and
  one weighted mean (2 values per channel, fp32; fewer cannot carry both the weight and the value), for the
  compressor and the indexer's compressor;
* ratio > 0: every complete window of that document before ``c`` is visible to the chunk's queries by the causal
  rule, so its compressed row must arrive (and, ratio 4, its index key, to be scored). This assumes one pass:
  a design that first scores and then fetches only the selected rows could move fewer compressed rows at the
  price of a second round trip per layer;
* multi-token prediction: the ids and labels (int32) of the next chunk's first ``D`` tokens when the document
  continues into it;
* backward: the gradient of every differentiable received value returns to its owner (halo, compressor boundary,
  compressed rows; the frozen indexer's keys carry none);
* metadata: documents are defined by their ids, so a chunk must learn its predecessor's last document id (does
  its first token continue it?), and every chunk must learn where each other chunk's continued document began (who
  sends it what): two int32 per chunk, so a rank receives at least ``8 (V - k)`` bytes per row (``V`` chunks, ``k``
  held).

Per layout and rank one JSON object per measurement: received bytes by category (``payload``, ``backward``,
``metadata``) and their bounds, and ``ratio`` = total received / total bound.

    python benchmarks/cp_traffic.py                     # S = 16384, CP = 4
    python benchmarks/cp_traffic.py --seq-len 4096 --cp 2 --layouts one_document
"""

from __future__ import annotations

import argparse

import torch

from common import emit
from dsv4.launch import run_on_ranks

ELEM = 4  # the tiny preset trains in fp32
PAYLOAD = ("halo", "compressor_halo", "index_compressor_halo", "compressed_gather", "index_key_gather")
METADATA = ("metadata", "metadata_halo", "mtp_metadata")
LAYOUTS = ("one_document", "short_documents", "starts_and_padding", "two_rows", "one_document_balanced")


def category(kind: str) -> str:
    """``payload`` / ``backward`` / ``metadata`` of an exchange kind; KeyError for a kind this script does not know
    (a new exchange must be classified and bounded here before it is counted)."""
    base, _, suffix = kind.partition(".")
    if base in PAYLOAD:
        return "backward" if suffix == "backward" else "payload"
    if base in METADATA and not suffix:
        return "metadata"
    raise KeyError(f"cp_traffic: unknown exchange kind {kind!r}; classify it in benchmarks/cp_traffic.py")


def _rows(layout: str, seq_len: int, l: int):
    """``(seq_ids, positions)`` ``[B, S]`` of a layout (padding = id 0, documents on multiples of 128)."""
    def row(docs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        seq, pos = torch.zeros(seq_len, dtype=torch.long), torch.zeros(seq_len, dtype=torch.long)
        col = 0
        for i, n in enumerate(docs):
            n = max(min(n, seq_len - col), -(seq_len - col))  # the row ends where it ends
            if n > 0:
                seq[col:col + n], pos[col:col + n] = i + 1, torch.arange(n)
            col += abs(n)  # a negative length is that much padding
        return seq, pos

    short = [512] * (seq_len // 512)
    rows = {
        "one_document": [[seq_len]], "one_document_balanced": [[seq_len]], "short_documents": [short],
        # a document from chunk 0 into chunk 1, padding to chunk 2, which starts a document that ends 128 early;
        # chunk 3 starts with 256 padding, then a document (cut where the row ends)
        "starts_and_padding": [[l + l // 2, -(l // 2), l - 128, -128, -256, l - 256]],
        "two_rows": [[seq_len], short],
    }[layout]
    built = [row(docs) for docs in rows]
    return torch.stack([s for s, _ in built]), torch.stack([p for _, p in built])


def _config():
    from dsv4.config import DSV4Config

    return DSV4Config.preset("tiny")


def _rank_body(rank: int, world_size: int, layout: str, seq_len: int) -> dict:
    import torch.distributed as dist

    from dsv4.batch import TokenBatch
    from dsv4.parallel.cp import CPContext
    from dsv4.model import DSV4ForCausalLM
    from dsv4.training.loss import reduce_token_loss
    from dsv4.training.step import forward_outputs

    torch.manual_seed(0)
    config = _config()
    model = DSV4ForCausalLM(config)
    balance = "full" if layout.endswith("balanced") else "none"
    chunks = world_size * (2 if balance == "full" else 1)
    seq, pos = _rows(layout, seq_len, seq_len // chunks)
    ids = torch.randint(1, config.vocab_size, seq.shape, generator=torch.Generator().manual_seed(1)) * (seq > 0)
    labels = torch.where((seq > 0) & (torch.roll(seq, -1, 1) == seq), torch.roll(ids, -1, 1), -100)
    batch = TokenBatch(ids, labels, seq, pos).cut(rank, world_size, config.shard_multiple, balance)
    group = dist.new_group(list(range(world_size)))
    cp = CPContext(group, balance=balance)
    out = forward_outputs(model, batch, cp)
    loss_sum, count = out.loss_sum, out.label_count
    reduce_token_loss(loss_sum, count, group).loss.backward()
    return cp.traffic.as_dict()


def lower_bound(layout: str, seq_len: int, world_size: int) -> list[dict[str, int]]:
    """Per rank, the minimum bytes received by category (see the module docstring)."""
    from dsv4.parallel.cp.layout import CPLayout

    config = _config()
    cut = CPLayout(world_size, "full" if layout.endswith("balanced") else "none")
    l = seq_len // cut.num_chunks
    seq, pos = _rows(layout, seq_len, l)
    ratios = [config.ratio_for_layer(i) for i in range(config.num_hidden_layers + config.num_nextn_predict_layers)]
    window, d, d_i = config.sliding_window, config.head_dim, config.index_head_dim
    bound = [{"payload": 0, "backward": 0, "metadata": 0} for _ in range(world_size)]
    for b in range(seq.shape[0]):
        for v in range(cut.num_chunks):
            rank, c = cut.owner(v)[0], v * l
            bound[rank]["metadata"] += 8 * (cut.num_chunks - cut.chunks_per_rank) // cut.chunks_per_rank
            end = c + l
            after = v + 1 < cut.num_chunks and cut.owner(v + 1)[0] != rank  # the next chunk lives on another rank
            if after and seq[b, end] > 0 and seq[b, end] == seq[b, end - 1]:  # MTP: the next chunk's head
                bound[rank]["metadata"] += config.num_nextn_predict_layers * 2 * 4
            if not (c > 0 and seq[b, c] > 0 and seq[b, c] == seq[b, c - 1]):
                continue
            start = c - int(pos[b, c])  # the continuing document's first column
            for r in ratios:
                grads, frozen = {}, {}  # source chunk -> bytes; the differentiable ones' gradients go back there

                def add(into: dict, source: int, nbytes: int) -> None:
                    into[source] = into.get(source, 0) + nbytes

                for col in range(c - min(window - 1, c - start), c):
                    add(grads, col // l, d * ELEM)
                if r == 4 and c - start >= 4:
                    add(grads, v - 1, 2 * d * 4)
                    add(frozen, v - 1, 2 * d_i * 4)
                if r > 0:
                    for w in range(start // r, c // r):
                        add(grads, w * r // l, d * ELEM)
                        if r == 4:
                            add(frozen, w * r // l, d_i * ELEM)
                for pieces, backward in ((grads, True), (frozen, False)):
                    for source, nbytes in pieces.items():
                        if cut.owner(source)[0] == rank:  # held by this rank: nothing crosses
                            continue
                        bound[rank]["payload"] += nbytes
                        if backward:
                            bound[cut.owner(source)[0]]["backward"] += nbytes
    return bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    for layout in args.layouts:
        traffic = run_on_ranks(_rank_body, args.cp, args=(layout, args.seq_len))
        bounds = lower_bound(layout, args.seq_len, args.cp)
        shape = {"layout": layout, "seq_len": args.seq_len, "cp": args.cp, "preset": "tiny", "dtype": "float32"}
        totals = [0, 0]
        for rank, (kinds, bound) in enumerate(zip(traffic, bounds)):
            received = {"payload": 0, "backward": 0, "metadata": 0}
            for kind, record in kinds.items():
                received[category(kind)] += record["bytes_received"]
            rank_shape = {**shape, "rank": rank}
            for part in received:
                emit(f"cp_traffic.{part}", rank_shape, received[part], "bytes")
                emit(f"cp_traffic.{part}.bound", rank_shape, bound[part], "bytes")
            got, least = sum(received.values()), sum(bound.values())
            totals[0], totals[1] = totals[0] + got, totals[1] + least
            emit("cp_traffic.ratio", rank_shape, round(got / least, 3) if least else None, "x")
        emit("cp_traffic.ratio_all_ranks", shape, round(totals[0] / totals[1], 3) if totals[1] else None, "x")


if __name__ == "__main__":
    main()
