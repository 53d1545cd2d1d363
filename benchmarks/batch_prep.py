"""Batch preparation throughput: DSV4 packed repad (+ contiguous CP shard), beside NeMo Automodel's repad.

Prints one JSON object per measurement, as tokens per second of input (``rows x seq_len`` tokens with ``docs``
documents per row, ``pad_multiple``, CP size ``cp``; median of ``--repeats`` runs after one warm-up, single process):

* ``batch_prep.repad.throughput`` / ``.latency`` (``impl`` in the shape): ``_repad_dsv4_packed_batch`` on the whole
  batch, dsv4's and, when the ``nemo-automodel`` package is installed, NeMo Automodel's, measured side by side in
  this process (the two interleaved run by run, so a slow spell of the machine hits both); the outputs are checked
  equal first (the run fails otherwise). ``batch_prep.repad.speedup_vs_nemo``: dsv4's throughput / NeMo's.
* ``batch_prep.repad_shard.throughput`` / ``.latency``: ``make_dsv4_contiguous_shard_cp_batch_and_ctx`` for the
  last rank of a :class:`~dsv4.cp.SimulatedMesh` (repad and cut to that rank's slice; every rank does the same work).

Every record's shape says ``nemo_automodel``: the version measured, or ``"not installed"`` (then only dsv4 is
measured). NeMo's module is loaded from the installed package's file alone (it needs only torch), so the
package's own dependencies need not be installed; it is not a dependency of dsv4 (``pip install --no-deps
nemo-automodel`` is enough).

    python benchmarks/batch_prep.py                    # 8 x 16384 tokens, 64 docs/row, multiple 128, CP 4
    python benchmarks/batch_prep.py --rows 2 --seq-len 4096 --repeats 3 --nemo off
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import statistics
import sys
import time
from types import ModuleType

import torch

from common import emit
from dsv4.cp import SimulatedMesh, _repad_dsv4_packed_batch, make_dsv4_contiguous_shard_cp_batch_and_ctx

NEMO_MODULE = "nemo_automodel.components.models.deepseek_v4.cp"


def make_batch(rows: int, seq_len: int, docs: int, seed: int = 0) -> dict:
    """Rows of ``docs`` documents of random lengths that fill ``seq_len`` exactly; labels on every token."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(seq_len - 1, generator=g)[: docs - 1] + 1).values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([seq_len])])
    lengths = (bounds[1:] - bounds[:-1]).expand(rows, docs).contiguous()
    ids = torch.randint(0, 32000, (rows, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "seq_lens": lengths, "seq_lens_padded": lengths.clone()}


def load_nemo() -> tuple[ModuleType | None, str]:
    """NeMo Automodel's DSV4 CP module and the package version, or ``(None, "not installed")``.

    The module file is loaded on its own (its imports are torch only), without the package's ``__init__``.
    """
    spec = importlib.util.find_spec("nemo_automodel")
    if spec is None or not spec.submodule_search_locations:
        return None, "not installed"
    version = importlib.metadata.version("nemo-automodel")
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "components", "models", "deepseek_v4", "cp.py")
        if os.path.exists(path):
            module_spec = importlib.util.spec_from_file_location("_nemo_dsv4_cp", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            if hasattr(module, "_repad_dsv4_packed_batch"):
                return module, version
    return None, f"{version} (no {NEMO_MODULE}._repad_dsv4_packed_batch)"


def same_output(ours: tuple, theirs: tuple) -> list[str]:
    """Names of the outputs (batch keys, ``loss_mask``, ``input_positions``) where the two repads differ."""
    (batch_a, mask_a, pos_a), (batch_b, mask_b, pos_b) = ours, theirs
    differ = sorted(set(batch_a) ^ set(batch_b))
    for key in sorted(set(batch_a) & set(batch_b)):
        a, b = batch_a[key], batch_b[key]
        equal = (a.dtype == b.dtype and torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b
        if not equal:
            differ.append(key)
    if (mask_a is None) != (mask_b is None) or (mask_a is not None and not torch.equal(mask_a, mask_b)):
        differ.append("loss_mask")
    if not torch.equal(pos_a, pos_b):
        differ.append("input_positions")
    return differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--pad-multiple", type=int, default=128)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nemo", choices=("auto", "on", "off"), default="auto",
                        help="measure NeMo Automodel's repad too: when installed (auto), always (on: fail when it "
                             "is not installed), never (off)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    nemo, nemo_version = (None, "not measured (--nemo off)") if args.nemo == "off" else load_nemo()
    if args.nemo == "on" and nemo is None:
        sys.exit(f"--nemo on: NeMo Automodel's repad is unavailable: {nemo_version}")

    batch = make_batch(args.rows, args.seq_len, args.docs)
    options = {"cp_size": args.cp, "pad_multiple": args.pad_multiple, "padding_token_id": 0}
    repads = {"dsv4": _repad_dsv4_packed_batch}
    if nemo is not None:
        repads["nemo_automodel"] = nemo._repad_dsv4_packed_batch
        differ = same_output(_repad_dsv4_packed_batch({k: v.clone() for k, v in batch.items()}, **options),
                             nemo._repad_dsv4_packed_batch({k: v.clone() for k, v in batch.items()}, **options))
        if differ:
            sys.exit(f"dsv4's and NeMo Automodel's repads differ on the benchmark batch in: {differ}")

    def repad_shard(fresh: dict):
        return make_dsv4_contiguous_shard_cp_batch_and_ctx(
            SimulatedMesh(args.cp, args.cp - 1), None, fresh, pad_multiple=args.pad_multiple
        )

    runs = {f"repad.{name}": (lambda fresh, fn=fn: fn(fresh, **options)) for name, fn in repads.items()}
    runs["repad_shard.dsv4"] = repad_shard
    times: dict[str, list[float]] = {name: [] for name in runs}
    padded_len = None
    for i in range(args.repeats + 1):
        for name, run in runs.items():  # interleaved: each round times every implementation once
            fresh = {k: v.clone() for k, v in batch.items()}
            start = time.perf_counter()
            out = run(fresh)
            elapsed = time.perf_counter() - start
            if i:  # the first round warms up allocator and kernels
                times[name].append(elapsed)
            if name == "repad_shard.dsv4":
                padded_len = out[2].padded_seq_len

    shape = {"rows": args.rows, "seq_len": args.seq_len, "docs_per_row": args.docs,
             "pad_multiple": args.pad_multiple, "cp": args.cp, "padded_len": padded_len,
             "threads": torch.get_num_threads(), "repeats": args.repeats, "nemo_automodel": nemo_version}
    tokens = args.rows * args.seq_len
    seconds = {name: statistics.median(t) for name, t in times.items()}
    for name in repads:
        impl_shape = {**shape, "impl": name}
        emit("batch_prep.repad.throughput", impl_shape, round(tokens / seconds[f"repad.{name}"], 1), "tokens/s")
        emit("batch_prep.repad.latency", impl_shape, round(seconds[f"repad.{name}"] * 1e3, 3), "ms")
    if nemo is not None:
        emit("batch_prep.repad.speedup_vs_nemo", {**shape, "same_output": True},
             round(seconds["repad.nemo_automodel"] / seconds["repad.dsv4"], 2), "x")
    emit("batch_prep.repad_shard.throughput", {**shape, "impl": "dsv4"},
         round(tokens / seconds["repad_shard.dsv4"], 1), "tokens/s")
    emit("batch_prep.repad_shard.latency", {**shape, "impl": "dsv4"}, round(seconds["repad_shard.dsv4"] * 1e3, 3), "ms")


if __name__ == "__main__":
    main()
