"""Context-parallel traffic of a training step against a first-principles lower bound, in several layouts.

Each model of ``--models`` runs one forward+backward on ``--cp`` gloo ranks for each layout: ``tiny`` (DeepSeek-V4:
window, CSA and HCA layers, MTP) and ``v41_tiny`` (DeepSeek-V4.1: window, Full, Reindex and Reuse layers of ratios
1 and 2, Engram, ``fake_quant``). The layouts:

* ``one_document``: one row, one document of ``S`` tokens;
* ``short_documents``: one row of 512-token documents (every chunk starts a document);
* ``starts_and_padding``: one row where chunk 1 continues a document, chunk 2 starts one and chunk 3 starts with
  padding (as far as the row reaches);
* ``two_rows``: ``one_document`` and ``short_documents`` in one batch (each row needs its own, not the union);
* ``one_document_balanced``: ``one_document`` with ``cp_balance=full`` (head-tail chunks);
* ``late_starts``: one row whose documents begin a few tokens before the chunk boundaries: chunk ``v`` (``v >= 1``)
  continues a document that began ``2^(v-1)`` shard multiples before it (v41_tiny, multiple 2: 2, 4 and 8 tokens),
  so its queries read fewer earlier tokens than the window (and Engram's n-grams) could reach;
* ``late_starts_window16``: ``late_starts`` with ``sliding_window = 16`` (the preset's otherwise).

Every exchange counts its bytes in the ``CPContext`` traffic counter; every kind it reports must be one this script
classifies (an unknown kind fails). Independently of the counters, a wire tap (:class:`WireTap`) counts the bytes
each rank receives at the ``torch.distributed`` calls themselves (point-to-point receive buffers, the other ranks'
share of all-gathers and reduce-scatters); the model's exchanges are all of them, so the two must agree. The bound is computed from the token layout alone (documents, positions, the
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

DeepSeek-V4.1 differs in what its attention reads (the same continuing rows, per layer):

* window keys: as above, in every layer (window, Full, Reindex and Reuse alike);
* no compressor boundary: ratio-2 windows are disjoint pairs that never straddle a chunk (chunks start on the
  shard multiple), ratio 1 has none;
* compressed rows and index keys: a Full layer compresses its own input, and the Reindex and Reuse layers after it
  read exactly those rows and keys (the CSA2 shared state), so every complete window of the continued document
  before ``c`` must arrive once per Full layer: its compressed row (gradient back) and its index key (frozen, to
  be scored), not once per consumer. This counts the rows and keys as the attention reads them; a design that
  sends the compressor latent and recomputes both on the receiver would move ``D`` instead of ``D + D_I`` per
  window at the price of recomputing them;
* Engram: a position's n-grams read the ``engram_max_ngram_size - 1`` tokens before it within its document, so a
  continuing chunk needs that many of the previous chunk's token ids (fewer when the document began later): int32
  each, forward only;
* no multi-token prediction depths (V4.1's DSpark drafter is not part of the backbone).

Per model, layout and rank one JSON object per measurement: received bytes by category (``payload``,
``backward``, ``metadata``) and their bounds, the wire tap's bytes (``wire``) beside the counters' total
(``counted``), and ``ratio`` = total received / total bound; per model and layout, over all ranks, that ratio
(``ratio_all_ranks``) and its forward (payload and metadata received) and backward (gradients returned) parts
(``forward_ratio_all_ranks``, ``backward_ratio_all_ranks``; 1.0 where both sides are 0). Every shape names the
``sliding_window`` it ran with.

    python benchmarks/cp_traffic.py                     # S = 16384, CP = 4, both models
    python benchmarks/cp_traffic.py --seq-len 4096 --cp 2 --layouts one_document --models v41_tiny
"""

from __future__ import annotations

import argparse
import itertools

import torch

from common import emit
from dsv4.launch import run_on_ranks

ELEM = 4  # the tiny presets train in fp32
ID_BYTES = 4  # a token id (int32: any vocabulary fits)
PAYLOAD = ("halo", "compressor_halo", "index_compressor_halo", "compressed_gather", "index_key_gather", "engram_ids")
METADATA = ("metadata", "metadata_halo", "mtp_metadata")
LAYOUTS = ("one_document", "short_documents", "starts_and_padding", "two_rows", "one_document_balanced", "late_starts",
           "late_starts_window16")
WINDOWS = {"late_starts_window16": 16}  # a layout's sliding window when not the preset's
MODELS = ("tiny", "v41_tiny")


class WireTap:
    """Bytes this rank receives through ``torch.distributed`` while active, counted at the transport calls the CP
    collectives make (not by them): the receive buffers of point-to-point batches, and the other ranks' share of
    every all-gather output and reduce-scatter input."""

    def __enter__(self) -> "WireTap":
        import torch.distributed as dist

        import dsv4.distributed as transport

        self.received = 0
        self._saved = (dist.batch_isend_irecv, transport._ALL_GATHER, transport._REDUCE_SCATTER)
        p2p, gather, scatter = self._saved

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def tapped_p2p(ops):
            self.received += sum(nbytes(op.tensor) for op in ops if op.op is dist.irecv)
            return p2p(ops)

        def tapped_gather(out, tensor, **kwargs):
            self.received += nbytes(out) - nbytes(tensor)
            return gather(out, tensor, **kwargs)

        def tapped_scatter(out, tensor, **kwargs):
            self.received += nbytes(tensor) - nbytes(out)
            return scatter(out, tensor, **kwargs)

        dist.batch_isend_irecv, transport._ALL_GATHER, transport._REDUCE_SCATTER = (tapped_p2p, tapped_gather,
                                                                                    tapped_scatter)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        import dsv4.distributed as transport

        dist.batch_isend_irecv, transport._ALL_GATHER, transport._REDUCE_SCATTER = self._saved


def category(kind: str) -> str:
    """``payload`` / ``backward`` / ``metadata`` of an exchange kind; KeyError for a kind this script does not know
    (a new exchange must be classified and bounded here before it is counted)."""
    base, _, suffix = kind.partition(".")
    if base in PAYLOAD:
        return "backward" if suffix == "backward" else "payload"
    if base in METADATA and not suffix:
        return "metadata"
    raise KeyError(f"cp_traffic: unknown exchange kind {kind!r}; classify it in benchmarks/cp_traffic.py")


def _rows(layout: str, seq_len: int, l: int, multiple: int):
    """``(seq_ids, positions)`` ``[B, S]`` of a layout (padding = id 0, documents on multiples of ``multiple``,
    128 except in ``late_starts``)."""
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
    }.get(layout)
    if layout.startswith("late_starts"):  # a document begins 1, 2, 4, ... multiples before chunk 1, 2, 3, ...
        begins = [0] + [v * l - 2 ** (v - 1) * multiple for v in range(1, seq_len // l)] + [seq_len]
        rows = [[b - a for a, b in itertools.pairwise(begins)]]
    built = [row(docs) for docs in rows]
    return torch.stack([s for s, _ in built]), torch.stack([p for _, p in built])


def _config(model: str = "tiny", layout: str = ""):
    from dsv4.config import DSV4Config

    return DSV4Config.preset(model, **({"sliding_window": WINDOWS[layout]} if layout in WINDOWS else {}))


def _rank_body(rank: int, world_size: int, layout: str, seq_len: int, model_name: str = "tiny") -> dict:
    import torch.distributed as dist

    from dsv4.batch import TokenBatch
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm
    from dsv4.parallel.cp import CPContext
    from dsv4.training.loss import reduce_token_loss
    from dsv4.training.step import forward_outputs

    torch.manual_seed(0)
    config = _config(model_name, layout)
    v41 = config.model_type == "deepseek_v41"
    model = build_causal_lm(config, tokenizer=ByteTokenizer()) if v41 else build_causal_lm(config)
    balance = "full" if layout.endswith("balanced") else "none"
    chunks = world_size * (2 if balance == "full" else 1)
    seq, pos = _rows(layout, seq_len, seq_len // chunks, config.shard_multiple)
    vocab = min(config.vocab_size, ByteTokenizer.vocab_size) if v41 else config.vocab_size  # Engram's class map
    ids = torch.randint(1, vocab, seq.shape, generator=torch.Generator().manual_seed(1)) * (seq > 0)
    labels = torch.where((seq > 0) & (torch.roll(seq, -1, 1) == seq), torch.roll(ids, -1, 1), -100)
    batch = TokenBatch(ids, labels, seq, pos).cut(rank, world_size, config.shard_multiple, balance)
    group = dist.new_group(list(range(world_size)))
    cp = CPContext(group, balance=balance)
    with WireTap() as wire:
        out = forward_outputs(model, batch, cp)
        loss_sum, count = out.loss_sum, out.label_count
        loss = reduce_token_loss(loss_sum, count, group).loss
        loss.backward()
    return {"traffic": cp.traffic.as_dict(), "wire": wire.received}


def lower_bound(layout: str, seq_len: int, world_size: int, model: str = "tiny") -> list[dict[str, int]]:
    """Per rank, the minimum bytes received by category (see the module docstring)."""
    from dsv4.parallel.cp.layout import CPLayout

    config = _config(model, layout)
    v41 = config.model_type == "deepseek_v41"
    cut = CPLayout(world_size, "full" if layout.endswith("balanced") else "none")
    l = seq_len // cut.num_chunks
    seq, pos = _rows(layout, seq_len, l, config.shard_multiple)
    depths = 0 if v41 else config.num_nextn_predict_layers  # V4.1's DSpark layers are not backbone depths
    layers = range(config.num_hidden_layers + depths)
    ratios = [config.ratio_for_layer(i) for i in layers]
    # the layers whose compressed rows and index keys must arrive: V4's compressed layers (keys: ratio 4), V4.1's
    # Full layers (their consumers read the same rows)
    sources = [i for i in layers if (config.attention_role(i) == "full" if v41 else ratios[i] > 0)]
    keyed = set(sources) if v41 else {i for i in sources if ratios[i] == 4}
    reach = config.engram_max_ngram_size - 1 if v41 and config.engram_layer_ids else 0
    window, d, d_i = config.sliding_window, config.head_dim, config.index_head_dim
    bound = [{"payload": 0, "backward": 0, "metadata": 0} for _ in range(world_size)]
    for b in range(seq.shape[0]):
        for v in range(cut.num_chunks):
            rank, c = cut.owner(v)[0], v * l
            bound[rank]["metadata"] += 8 * (cut.num_chunks - cut.chunks_per_rank) // cut.chunks_per_rank
            end = c + l
            after = v + 1 < cut.num_chunks and cut.owner(v + 1)[0] != rank  # the next chunk lives on another rank
            if depths and after and seq[b, end] > 0 and seq[b, end] == seq[b, end - 1]:  # MTP: the next chunk's head
                bound[rank]["metadata"] += depths * 2 * 4
            if not (c > 0 and seq[b, c] > 0 and seq[b, c] == seq[b, c - 1]):
                continue
            start = c - int(pos[b, c])  # the continuing document's first column
            grads, frozen = {}, {}  # source chunk -> bytes; the differentiable ones' gradients go back there

            def add(into: dict, source: int, nbytes: int) -> None:
                into[source] = into.get(source, 0) + nbytes

            for col in range(c - min(reach, c - start), c):  # Engram's n-grams: token ids, no gradient
                add(frozen, col // l, ID_BYTES)
            for i in layers:
                r = ratios[i]
                for col in range(c - min(window - 1, c - start), c):
                    add(grads, col // l, d * ELEM)
                if r == 4 and c - start >= 4:
                    add(grads, v - 1, 2 * d * 4)
                    add(frozen, v - 1, 2 * d_i * 4)
                if i in sources:
                    for w in range(start // r, c // r):
                        add(grads, w * r // l, d * ELEM)
                        if i in keyed:
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
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    for model in args.models:
        for layout in args.layouts:
            results = run_on_ranks(_rank_body, args.cp, args=(layout, args.seq_len, model))
            bounds = lower_bound(layout, args.seq_len, args.cp, model)
            shape = {"layout": layout, "seq_len": args.seq_len, "cp": args.cp, "preset": model, "dtype": "float32",
                     "sliding_window": _config(model, layout).sliding_window}
            totals = {"all": [0, 0], "forward": [0, 0], "backward": [0, 0]}
            for rank, (result, bound) in enumerate(zip(results, bounds)):
                received = {"payload": 0, "backward": 0, "metadata": 0}
                for kind, record in result["traffic"].items():
                    received[category(kind)] += record["bytes_received"]
                rank_shape = {**shape, "rank": rank}
                for part in received:
                    emit(f"cp_traffic.{part}", rank_shape, received[part], "bytes")
                    emit(f"cp_traffic.{part}.bound", rank_shape, bound[part], "bytes")
                got, least = sum(received.values()), sum(bound.values())
                emit("cp_traffic.counted", rank_shape, got, "bytes")
                emit("cp_traffic.wire", rank_shape, result["wire"], "bytes")
                emit("cp_traffic.ratio", rank_shape, _ratio(got, least), "x")
                forward = (received["payload"] + received["metadata"], bound["payload"] + bound["metadata"])
                for key, (g, b) in (("all", (got, least)), ("forward", forward),
                                    ("backward", (received["backward"], bound["backward"]))):
                    totals[key][0] += g
                    totals[key][1] += b
            emit("cp_traffic.ratio_all_ranks", shape, _ratio(*totals["all"]), "x")
            # forward: payload and metadata received; backward: gradients returned to their owners
            emit("cp_traffic.forward_ratio_all_ranks", shape, _ratio(*totals["forward"]), "x")
            emit("cp_traffic.backward_ratio_all_ranks", shape, _ratio(*totals["backward"]), "x")


def _ratio(got: int, least: int) -> float | None:
    """received / bound, rounded to 3 places: 1.0 when both are 0, None when bytes arrived against a bound of 0."""
    if least:
        return round(got / least, 3)
    return 1.0 if got == 0 else None


if __name__ == "__main__":
    main()
