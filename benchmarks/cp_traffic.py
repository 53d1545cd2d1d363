"""Context-parallel traffic per layer type versus its analytic lower bound and an all-gather design.

For each layer type (SWA ratio 0, CSA ratio 4, HCA ratio 128) a one-layer tiny model runs forward+backward on one
unpacked document of ``--seq-len`` tokens over ``--cp`` gloo ranks. Every exchange counts its bytes in the
``CPContext`` traffic counter; this script prints, per layer type and rank, one JSON object per measurement:

* ``received``: forward bytes this rank received for the layer (halo, compressor boundary, compressed rows,
  index keys; the once-per-forward token metadata is reported separately as ``metadata``);
* ``lower_bound``: what the rank must receive at minimum: the ``sliding_window - 1`` K/V rows of its predecessor,
  the previous window's first-half compressor (and indexer) projections, and every earlier compressed row /
  index key of the document that is visible to one of its queries (for one document: all earlier windows);
* ``ratio`` = received / lower_bound (null where the bound is 0, i.e. rank 0);
* ``allgather_everything``: what an all-gather design (NeMo Automodel / Miles style) moves to this rank: raw K/V of every other rank, the fp32 compressor (and indexer) overlap windows
  (kv + gate), and the pooled rows;
* ``backward_received``: gradient bytes received in backward (the mirror of what was sent).

    python benchmarks/cp_traffic.py                     # S = 32768, CP = 4 (about a minute on 2 cores)
    python benchmarks/cp_traffic.py --seq-len 4096 --cp 2
"""

from __future__ import annotations

import argparse

import torch

from common import cp_training_step, emit
from dsv4.config import DSV4Config
from dsv4.launch import run_on_ranks

LAYER_TYPES = {"swa": 0, "csa": 4, "hca": 128}
FORWARD_KINDS = ("halo", "compressor_halo", "index_compressor_halo", "compressed_gather", "index_key_gather")


def layer_config(ratio: int) -> DSV4Config:
    return DSV4Config.preset("tiny", num_hidden_layers=1, compress_ratios=[ratio], num_nextn_predict_layers=0,
                             num_hash_layers=0)


def _rank_body(rank: int, world_size: int, ratio: int, seq_len: int) -> dict:
    cp, _ = cp_training_step(layer_config(ratio), seq_len, world_size)
    return cp.traffic.as_dict()


def lower_bound(config: DSV4Config, ratio: int, rank: int, local_len: int, elem: int) -> int:
    """Minimum forward bytes rank ``rank`` receives for one layer (one unpacked document)."""
    if rank == 0:
        return 0
    d, d_i = config.head_dim, config.index_head_dim
    total = (config.sliding_window - 1) * d * elem  # K/V halo
    if ratio > 0:
        total += rank * (local_len // ratio) * d * elem  # every earlier pooled row is visible to a local query
    if ratio == 4:
        total += ratio * 2 * d * 4 + ratio * 2 * d_i * 4  # boundary window: first-half kv + gate, fp32
        total += rank * (local_len // ratio) * d_i * elem  # index keys of every earlier window
    return total


def allgather_everything(config: DSV4Config, ratio: int, local_len: int, cp: int, elem: int) -> int:
    """Bytes an all-gather design receives per rank for one layer: (C-1)/C of the gathered buffers."""
    d, d_i = config.head_dim, config.index_head_dim
    per_token = d * elem  # raw K/V
    if ratio > 0:
        per_token += d * elem / ratio  # pooled rows
    if ratio == 4:
        per_token += 2 * (2 * d) * 4 + 2 * (2 * d_i) * 4  # fp32 overlap windows (kv + gate), attention and indexer
        per_token += d_i * elem / ratio  # pooled index keys
    return int((cp - 1) * local_len * per_token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--layers", nargs="*", default=list(LAYER_TYPES), choices=list(LAYER_TYPES))
    args = parser.parse_args()
    local_len = args.seq_len // args.cp
    elem = torch.finfo(torch.float32).bits // 8  # the tiny preset trains in fp32
    for name in args.layers:
        ratio = LAYER_TYPES[name]
        config = layer_config(ratio)
        traffic = run_on_ranks(_rank_body, args.cp, args=(ratio, args.seq_len))
        shape = {"layer": name, "ratio": ratio, "seq_len": args.seq_len, "cp": args.cp, "local_len": local_len,
                 "preset": "tiny", "dtype": "float32"}
        total_received = total_bound = 0
        for rank, kinds in enumerate(traffic):
            received = sum(kinds.get(k, {}).get("bytes_received", 0) for k in FORWARD_KINDS)
            backward = sum(kinds.get(f"{k}.backward", {}).get("bytes_received", 0) for k in FORWARD_KINDS)
            bound = lower_bound(config, ratio, rank, local_len, elem)
            total_received, total_bound = total_received + received, total_bound + bound
            rank_shape = {**shape, "rank": rank}
            emit(f"cp_traffic.{name}.received", rank_shape, received, "bytes")
            emit(f"cp_traffic.{name}.lower_bound", rank_shape, bound, "bytes")
            emit(f"cp_traffic.{name}.ratio", rank_shape, round(received / bound, 4) if bound else None, "x")
            emit(f"cp_traffic.{name}.allgather_everything", rank_shape,
                 allgather_everything(config, ratio, local_len, args.cp, elem), "bytes")
            emit(f"cp_traffic.{name}.backward_received", rank_shape, backward, "bytes")
            emit(f"cp_traffic.{name}.metadata", rank_shape, kinds.get("metadata", {}).get("bytes_received", 0),
                 "bytes")
        emit(f"cp_traffic.{name}.ratio_all_ranks", shape,
             round(total_received / total_bound, 4) if total_bound else None, "x")


if __name__ == "__main__":
    main()
