"""DSpark feature capture throughput: packed rows versus one document per row, on the same documents.

Prints JSON objects (one per measurement): documents/s and tokens/s of a frozen capture
(:func:`dsv4.speculative.capture_dspark_features`) when the documents are packed ``docs_per_row`` to a row
(aligned to the model's document alignment) versus one document per row (rows padded to the longest document),
the alignment padding fraction of the packed layout (alignment slots / aligned slots), the slot ratio
(one-document-per-row slots / packed slots: the speed-up if time followed the slots run) the row bound
(one-document-per-row slots / (packed rows x the most tokens in one of them): the speed-up of any layout that keeps
the caller's rows, with no alignment at all, if time followed the slots run) and the token bound
(one-document-per-row slots / tokens: the same for a perfect packing that may also move documents between rows; no
layout of these documents runs fewer slots than there are tokens). Random token ids,
random document lengths, median of ``--repeats`` rounds that run the two modes in turn, one process.

    python benchmarks/dspark_capture.py                          # tiny (alignment 128) and v4_ratio2_tiny (2)
    python benchmarks/dspark_capture.py --presets v4_ratio2_tiny --docs 32 --max-len 512
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from common import emit
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.speculative import capture_dspark_features


def _rows(lengths: list[int], per_row: int, vocab: int, g: torch.Generator):
    groups = [lengths[i : i + per_row] for i in range(0, len(lengths), per_row)]
    width = max(sum(grp) for grp in groups)
    ids = torch.randint(1, vocab, (len(groups), width), generator=g)
    seq_lens = torch.full((len(groups), per_row), -1000, dtype=torch.long)
    for b, grp in enumerate(groups):
        seq_lens[b, : len(grp)] = torch.tensor(grp)
    return ids, seq_lens


def _time_interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds of each of ``fns`` (name -> callable) over ``repeats`` rounds that run every one of them in
    turn, after one warm-up round (interleaved, so a slow spell of a shared machine hits every mode alike)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "v4_ratio2_tiny"])
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--docs-per-row", type=int, default=8)
    p.add_argument("--layer-ids", type=int, nargs="+", default=[1, 3])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.docs,), generator=g).tolist()
    tokens = sum(lengths)
    for preset in args.presets:
        torch.manual_seed(0)
        config = DSV4Config.preset(preset)
        model = DSV4ForCausalLM(config).eval()
        shape = {"preset": preset, "docs": args.docs, "tokens": tokens, "docs_per_row": args.docs_per_row,
                 "alignment": config.shard_multiple, "layer_ids": args.layer_ids}
        rows = {mode: _rows(lengths, per_row, config.vocab_size, g)
                for mode, per_row in (("packed", args.docs_per_row), ("one_per_row", 1))}
        results = _time_interleaved({mode: functools.partial(capture_dspark_features, model, ids, seq_lens,
                                                             args.layer_ids)
                                     for mode, (ids, seq_lens) in rows.items()}, args.repeats)
        slots = {}
        for mode, (ids, seq_lens) in rows.items():
            seconds = results[mode]
            run_layout = capture_dspark_features(model, ids, seq_lens, args.layer_ids).layout
            slots[mode] = run_layout.batch_size * run_layout.aligned_length
            emit("dspark_capture_documents_per_s", {**shape, "mode": mode}, args.docs / seconds, "documents/s")
            emit("dspark_capture_tokens_per_s", {**shape, "mode": mode}, tokens / seconds, "tokens/s")
            if mode == "packed":
                layout = capture_dspark_features(model, ids, seq_lens, args.layer_ids).layout
                pad_to = -(-torch.tensor(lengths) // config.shard_multiple) * config.shard_multiple
                alignment_slots = int(pad_to.sum()) - tokens
                total = layout.batch_size * layout.aligned_length
                emit("dspark_capture_alignment_padding_fraction", shape, alignment_slots / total, "fraction")
                emit("dspark_capture_padding_fraction", shape, 1 - tokens / total, "fraction")
        emit("dspark_capture_packed_speedup", shape, results["one_per_row"] / results["packed"], "x")
        # the bound when time follows the slots the model runs: one-document-per-row slots / packed slots
        emit("dspark_capture_slot_ratio", shape, slots["one_per_row"] / slots["packed"], "x")
        # the bounds of any layout: keeping the caller's rows (each as wide as the most tokens in a row), and not
        groups = [lengths[i : i + args.docs_per_row] for i in range(0, len(lengths), args.docs_per_row)]
        row_slots = len(groups) * max(sum(grp) for grp in groups)
        emit("dspark_capture_row_bound", shape, slots["one_per_row"] / row_slots, "x")
        emit("dspark_capture_token_bound", shape, slots["one_per_row"] / tokens, "x")


if __name__ == "__main__":
    main()
