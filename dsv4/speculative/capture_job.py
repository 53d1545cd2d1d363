"""The capture job behind ``recipes/capture_dspark.py``: frozen target -> per-document DSpark features on disk.

Output folder (``output_dir``)::

    shard_00000.safetensors   per document d: "<d>.hidden_states" [len, len(layer_ids) * hidden],
                              "<d>.last_hidden_state" [len, hidden] (d = global document id), and what drafter
                              training reads with them: "<d>.input_ids" [len] int64, "<d>.loss_mask" [len] bool
                              (the supervised tokens, all True without a mask)
    shard_00000.json          the shard's index: documents (document_id, length, source), layer_ids, dtype
    target.safetensors        the target's "embed.weight" [V, hidden] and "head.weight" [V, hidden] (fp32): what a
                              drafter trained offline copies (written once, by the first rank)
    index.json                written when every shard exists: the shard indexes merged + totals

Documents are numbered in corpus order and cut into shards of ``docs_per_shard``; shard ``k`` belongs to dp rank
``k % dp``. With ``cp > 1`` the job runs ``dp x cp`` ranks: the ``cp`` ranks of a dp replica (consecutive global
ranks) run every row together, each its contiguous slice (:func:`dsv4.speculative.dspark_packed_forward` with a
``CPContext``), all receive the whole rows' features and the replica's first rank writes the shard. A shard is
finished when its ``.json`` exists (written after its ``.safetensors``, both by an
atomic rename), so a killed job re-run with the same config skips finished shards and rewrites nothing.
Inside a shard, documents are packed first-fit-decreasing into rows of ``seq_len`` aligned slots (the data packer's
placement with the model's shard multiple; a longer document gets a row of its own), ``micro_batch_size`` rows
per frozen forward (:func:`dsv4.speculative.capture_dspark_features`: aligned layout, last-position logits only).
Weights: ``model.checkpoint`` (a Hugging Face-format DSV4 directory, or a safetensors file of a dsv4 state dict);
a seeded init without one.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("dsv4")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shard_name(k: int) -> str:
    return f"shard_{k:05d}"


def build_target(job: dict):
    """The frozen target of ``job`` (:func:`dsv4.speculative.target.build_frozen_target`: its config, seeded init,
    ``checkpoint`` loaded, a quantised one kept as stored)."""
    from dsv4.config import DSV4Config, config_class
    from dsv4.speculative.target import build_frozen_target

    config = config_class(job.get("model_type", DSV4Config.model_type)).from_dict(job["model"])
    return build_frozen_target(config, checkpoint=job.get("checkpoint"),
                               tokenizer=job["data"].get("tokenizer", "byte"), seed=job["seed"])


def job_documents(job: dict):
    """The documents of ``job["data"]``: the first ``max_documents``, each cut to ``max_document_tokens``."""
    from dsv4.data import build_documents

    docs = build_documents(**job["data"])
    if job.get("max_documents") is not None:
        docs = docs[: job["max_documents"]]
    cap = job.get("max_document_tokens")
    if cap is not None:  # keep each document's first tokens (the bundled corpus holds whole source files)
        from dsv4.data import Document

        docs = [d if len(d) <= cap else Document(list(d.ids[:cap]), None if d.loss_mask is None
                                                 else list(d.loss_mask[:cap]), d.source) for d in docs]
    return docs


def _write_shard(out: Path, k: int, tensors: dict, entries: list[dict], job: dict) -> None:
    from safetensors.torch import save_file

    name = shard_name(k)
    tmp = out / f"{name}.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"layer_ids": json.dumps(job["layer_ids"]), "dtype": job["dtype"]})
    os.replace(tmp, out / f"{name}.safetensors")
    index = {"shard": f"{name}.safetensors", "layer_ids": job["layer_ids"], "dtype": job["dtype"],
             "hidden_size": job["model"]["hidden_size"], "documents": entries}
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / f"{name}.json")  # last: the shard counts as finished from here on


TARGET_FILE = "target.safetensors"


def _write_target_weights(out: Path, model) -> None:
    """The target's embedding and head, fp32, in ``target.safetensors`` (atomically)."""
    from safetensors.torch import save_file

    tmp = out / f"{TARGET_FILE}.tmp"
    save_file({"embed.weight": model.model.embed_tokens.weight.detach().float().contiguous(),
               "head.weight": model.lm_head.weight.detach().float().contiguous()}, str(tmp))
    os.replace(tmp, out / TARGET_FILE)


def _cp_context(rank: int, world: int, cp: int):
    """This rank's ``CPContext`` (groups of ``cp`` consecutive ranks; every rank creates every group), None for
    ``cp == 1``. Also a barrier: every rank has looked at the output folder before any rank writes to it."""
    if cp == 1:
        return None
    import torch.distributed as dist

    from dsv4.parallel.cp import CPContext

    groups = [dist.new_group(list(range(start, start + cp))) for start in range(0, world, cp)]
    dist.barrier()
    return CPContext(groups[rank // cp])


def capture_rank(rank: int, world: int, job: dict) -> dict:
    """Capture this rank's unfinished shards; returns ``{"shards", "tokens", "seconds"}`` written by it (the shards
    of its dp replica, counted on the replica's first CP rank only)."""
    from tqdm import tqdm

    from dsv4.data.packer import first_fit_decreasing
    from dsv4.speculative.dspark import capture_dspark_features

    torch.set_num_threads(max(1, int(job.get("threads") or 1)))
    out = Path(job["output_dir"])
    docs = job_documents(job)
    cp_size = int(job.get("cp", 1))
    dp_rank, dp_size, writer = rank // cp_size, world // cp_size, rank % cp_size == 0
    n_shards = -(-len(docs) // job["docs_per_shard"])
    mine = [k for k in range(dp_rank, n_shards, dp_size) if not (out / f"{shard_name(k)}.json").exists()]
    if job.get("max_shards_this_run") is not None:
        mine = mine[: job["max_shards_this_run"]]
    cp = _cp_context(rank, world, cp_size)  # after every rank listed its shards: none is written yet
    weights_missing = rank == 0 and not (out / TARGET_FILE).exists()
    if not mine and not weights_missing:
        return {"shards": [], "tokens": 0, "seconds": 0.0}
    model = build_target(job)
    if weights_missing:
        _write_target_weights(out, model)
    if not mine:
        return {"shards": [], "tokens": 0, "seconds": 0.0}
    dtype, multiple = _DTYPES[job["dtype"]], model.config.shard_multiple
    tokens, start = 0, time.perf_counter()
    bar = tqdm(mine, desc=f"capture rank {rank}", position=rank, file=sys.stderr, unit="shard",
               disable=job.get("progress") is False or not writer)
    for k in bar:
        first = k * job["docs_per_shard"]
        shard_docs = list(range(first, min(first + job["docs_per_shard"], len(docs))))
        aligned = [-(-len(docs[d]) // multiple) * multiple for d in shard_docs]  # slots each takes when placed
        rows = [[shard_docs[i] for i in row] for row in first_fit_decreasing(aligned, job["seq_len"])]
        tensors: dict[str, torch.Tensor] = {}
        entries: list[dict] = []
        for b0 in range(0, len(rows), job["micro_batch_size"]):
            batch = rows[b0 : b0 + job["micro_batch_size"]]
            width = max(sum(len(docs[d]) for d in row) for row in batch)
            ncols = max(len(row) for row in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            seq_lens = torch.full((len(batch), ncols), -1000, dtype=torch.long)
            for b, row in enumerate(batch):
                flat = [t for d in row for t in docs[d].ids]
                ids[b, : len(flat)] = torch.tensor(flat, dtype=torch.long)
                seq_lens[b, : len(row)] = torch.tensor([len(docs[d]) for d in row])
            feats = capture_dspark_features(model, ids, seq_lens, job["layer_ids"], sync_across_ranks=False, cp=cp)
            for doc in feats.documents(seq_lens):
                d = batch[doc["row"]][doc["column"]]
                tensors[f"{d}.hidden_states"] = doc["hidden_states"].to(dtype).contiguous()
                tensors[f"{d}.last_hidden_state"] = doc["last_hidden_state"].to(dtype).contiguous()
                tensors[f"{d}.input_ids"] = torch.tensor(list(docs[d].ids), dtype=torch.long)
                mask = docs[d].loss_mask
                tensors[f"{d}.loss_mask"] = (torch.ones(len(docs[d]), dtype=torch.bool) if mask is None
                                             else torch.tensor(list(mask), dtype=torch.bool))
                entries.append({"document_id": d, "length": len(docs[d]), "source": docs[d].source})
                tokens += len(docs[d])
        entries.sort(key=lambda e: e["document_id"])
        if writer:
            _write_shard(out, k, tensors, entries, job)
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    seconds = time.perf_counter() - start
    if not writer:  # the replica's first CP rank reports its shards and tokens
        return {"shards": [], "tokens": 0, "seconds": seconds}
    log.info("rank %d: %d shards, %d tokens in %.1fs (%.0f tokens/s)", rank, len(mine), tokens, seconds,
             tokens / max(seconds, 1e-9))
    return {"shards": mine, "tokens": tokens, "seconds": seconds}


def write_index(out: Path, n_shards: int, job: dict) -> dict | None:
    """Merge the shard indexes into ``index.json`` when every shard is finished; None otherwise."""
    shard_files = [out / f"{shard_name(k)}.json" for k in range(n_shards)]
    if not all(f.exists() for f in shard_files):
        return None
    shards = [json.loads(f.read_text()) for f in shard_files]
    documents = [{**doc, "shard": s["shard"]} for s in shards for doc in s["documents"]]
    index = {"layer_ids": job["layer_ids"], "dtype": job["dtype"], "hidden_size": job["model"]["hidden_size"],
             "num_documents": len(documents), "num_tokens": sum(d["length"] for d in documents),
             "shards": [s["shard"] for s in shards], "documents": documents, "model": job["model"],
             "model_type": job["model_type"],
             "seed": job["seed"], "checkpoint": job.get("checkpoint")}
    tmp = out / "index.json.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / "index.json")
    return index


def default_layer_ids(config: Any) -> list[int]:
    """``layer_ids=null``: a V4.1 config's ``dspark_target_layer_ids`` (the layers its released DSpark drafter
    reads); a V4 config has none: its last three backbone layers (as V4.1-Flash's 37-39 of 40), one INFO line."""
    targets = getattr(config, "dspark_target_layer_ids", None)
    if targets:
        return [int(i) for i in targets]
    n = config.num_hidden_layers
    ids = list(range(max(0, n - 3), n))
    log.info("capture: layer_ids=null and the %s config names no DSpark targets: its last three layers %s",
             getattr(config, "model_type", "deepseek_v4"), ids)
    return ids


def job_data(data: dict, checkpoint: str | None, config) -> dict:
    """The data group's source keys for :func:`dsv4.data.build_documents` (tokenizer resolved against
    ``checkpoint``, chat template read, checked against ``config``'s vocabulary and Engram classes). The packer's
    and the prepared dataset's keys and held-out settings (``val``, ``val_fraction``) are left out."""
    from dsv4.data.defaults import resolve_data_source
    from dsv4.data.tokenizers import build_tokenizer
    from dsv4.training.options.family import check_engram_tokenizer

    skip = ("overlong", "cache_dir", "num_proc", "val", "val_fraction")
    source = resolve_data_source({k: v for k, v in data.items() if v is not None and k not in skip}, checkpoint,
                                 config.vocab_size)
    check_engram_tokenizer(config, build_tokenizer(source["tokenizer"]), str(source["tokenizer"]))
    return source


def capture_job(cfg: Any, output_dir: str | Path) -> dict:
    """The job every rank of :func:`run_capture` runs (:func:`capture_rank`), from the recipe's config: validated,
    its documents read once (bad data fails here, before any rank starts); creates the output folder."""
    from omegaconf import OmegaConf

    from dsv4.speculative.capture import validate_layer_ids
    from dsv4.training.schema import model_config

    c = OmegaConf.to_container(cfg, resolve=True)
    config = model_config(c["model"])
    layer_ids = validate_layer_ids(default_layer_ids(config) if c["layer_ids"] is None else c["layer_ids"],
                                   config.num_hidden_layers)
    if c["dispatcher"] != "local":
        raise ValueError(f"`dispatcher`={c['dispatcher']!r}: the capture job runs full replicas per rank; use "
                         "dispatcher=local (dspark_packed_forward itself supports uniform-token dispatchers)")
    for key in ("dp", "cp", "seq_len", "micro_batch_size", "docs_per_shard"):
        if int(c[key]) < 1:
            raise ValueError(f"`{key}` must be >= 1, got {c[key]}")
    if c["dtype"] not in _DTYPES:
        raise ValueError(f"`dtype`={c['dtype']!r} must be one of {sorted(_DTYPES)}")
    out = Path(c["output_dir"] or Path(output_dir) / "features")
    out.mkdir(parents=True, exist_ok=True)
    # data.overlong is the training packer's choice; capture keeps whole documents (max_document_tokens caps them)
    # (prepared datasets, cache_dir / num_proc, are the training recipe's); tokenizer and template as in training
    data = job_data(c["data"], c["model"].get("checkpoint"), config)
    job = {"model": config.to_dict(), "model_type": config.model_type, "data": data, "layer_ids": layer_ids, "seed": int(c["seed"]),
           "checkpoint": c["model"].get("checkpoint"),
           "dtype": c["dtype"], "seq_len": int(c["seq_len"]),
           "micro_batch_size": int(c["micro_batch_size"]), "docs_per_shard": int(c["docs_per_shard"]),
           "max_documents": c.get("max_documents"),
           "max_document_tokens": c.get("max_document_tokens"), "max_shards_this_run": c.get("max_shards_this_run"),
           "output_dir": str(out), "progress": c.get("progress", True), "threads": c.get("threads", 1),
           "cp": int(c["cp"]), "dp": int(c["dp"])}
    docs = job_documents(job)  # bad data fails here, before any rank starts
    if not docs:
        raise ValueError("data: no documents")
    too_big = [i for i, d in enumerate(docs) if any(t >= config.vocab_size or t < 0 for t in d.ids)]
    if too_big:
        raise ValueError(f"data: document {too_big[0]} has token ids outside model.vocab_size={config.vocab_size}")
    job["shards_total"] = -(-len(docs) // job["docs_per_shard"])
    return job


def run_capture(cfg: Any, output_dir: str | Path) -> dict:
    """Validate the config, capture every unfinished shard on ``dp`` ranks, write the index; returns a summary."""
    job = capture_job(cfg, output_dir)
    out = Path(job["output_dir"])
    n_shards = job["shards_total"]
    start = time.perf_counter()
    world = job["dp"] * job["cp"]
    if world == 1:
        results = [capture_rank(0, 1, job)]
    else:
        from dsv4.launch import run_on_ranks

        results = run_on_ranks(capture_rank, world_size=world, args=(job,), timeout=3600.0)
    seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    index = write_index(out, n_shards, job)
    summary = {"output_dir": str(out), "shards_total": n_shards,
               "shards_written": sorted(k for r in results for k in r["shards"]), "tokens": tokens,
               "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9), "complete": index is not None}
    log.info("capture: %s", json.dumps(summary))
    print(json.dumps(summary), flush=True)
    return summary
