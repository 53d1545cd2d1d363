"""Preparing chat data once (``dsv4.data.prepared``) against tokenizing in memory at every start.

    python benchmarks/data_prepare.py --mb 40 80          # the recorded sizes (seq_len 8192)
    python benchmarks/data_prepare.py                     # a small default (2 MB), as the smoke test runs it

For each size: a synthetic multi-turn chat JSONL (assistant turns with ``reasoning_content``, seeded) and a BPE
tokenizer trained on it by the ``tokenizers`` library (``--vocab`` ids at most, DeepSeek-V4's special tokens
added, so the DeepSeek-V4 chat format applies). Every start runs in a fresh process, so time and peak RSS (VmHWM)
are that start's own:

* ``data_prepare.prepare_s``: the first start's prepare (tokenize ``--num-proc`` processes, pack, write);
* ``data_prepare.first_batch_s`` (``start`` = first / second): from the start of the data step to the first batch
  (the second start maps the directory and tokenizes nothing: ``tokenized`` in the shape says so);
* ``data_prepare.peak_rss_mib`` (``mode`` = mapped / in_memory): peak RSS of a process that maps the prepared
  dataset and reads every row, against one that tokenizes and packs in memory and reads every row;
* ``data_prepare.in_memory_build_s``: the in-memory tokenize + pack of the same data.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, peak_rss_kib  # noqa: E402

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "ex", "or", "an", "il", "um"]


def write_chats(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSONL of multi-turn chats (system, user / assistant turns with reasoning) of about ``megabytes`` MB; returns
    the number of records."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(4000)]

    def sentence(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)) + "."

    target, written, count = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            messages = [{"role": "system", "content": sentence(12)}]
            for _ in range(rng.randint(1, 4)):
                messages.append({"role": "user", "content": sentence(rng.randint(10, 120))})
                messages.append({"role": "assistant", "content": sentence(rng.randint(20, 400)),
                                 "reasoning_content": sentence(rng.randint(20, 300))})
            line = json.dumps({"messages": messages}) + "\n"
            f.write(line)
            written += len(line.encode())
            count += 1
    return count


def train_tokenizer(directory: Path, data: Path, vocab: int, sample_bytes: int = 4_000_000) -> Path:
    """A byte-level BPE of at most ``vocab`` ids trained on the first ``sample_bytes`` of ``data``, with DeepSeek-V4's
    special tokens, saved as ``tokenizer.json`` + ``tokenizer_config.json`` (a checkpoint's tokenizer files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dsv4.data.deepseek_v4_chat import BOS, EOS, SPECIAL_TOKENS

    directory.mkdir(parents=True, exist_ok=True)
    with open(data, encoding="utf-8") as f:
        sample = f.read(sample_bytes).splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", *SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return directory


def _source(data: str, ckpt: str) -> dict:
    from dsv4.data.defaults import resolve_data_source

    return resolve_data_source({"kind": "jsonl", "path": data, "tokenizer": "auto"}, ckpt, 129280)


def child(mode: str, data: str, ckpt: str, cache: str, seq_len: int, num_proc: int) -> dict:
    """One start in this process: ``prepared`` (prepare or map, read every row) or ``in_memory``."""
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    from dsv4.data import build_documents, build_packed_dataset
    from dsv4.data.prepared import prepare_dataset, prepared_fingerprint, prepared_path

    source = _source(data, ckpt)
    start = time.perf_counter()
    if mode == "prepared":
        existed = (prepared_path(cache, prepared_fingerprint(source, seq_len, 128, "truncate_left")) /
                   "meta.json").is_file()
        rows = prepare_dataset(source, seq_len, 128, cache, overlong="truncate_left", num_proc=num_proc)
        prepared = time.perf_counter() - start
    else:
        existed = False
        rows = build_packed_dataset(build_documents(**source), seq_len, 128, overlong="truncate_left")
        prepared = time.perf_counter() - start
    rows[0]
    first_batch = time.perf_counter() - start
    tokens = 0
    for i in range(len(rows)):
        tokens += int((rows[i].seq_ids > 0).sum())
    return {"prepare_s": prepared, "first_batch_s": first_batch, "rows": len(rows), "tokens": tokens,
            "tokenized": not existed, "peak_rss_mib": peak_rss_kib() / 1024}


def _run_child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[2.0], help="JSONL sizes in MB")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--num-proc", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--workdir", default=None, help="default: a temporary directory, removed at the end")
    parser.add_argument("--child", nargs=6, metavar=("MODE", "DATA", "CKPT", "CACHE", "SEQ_LEN", "NUM_PROC"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, data, ckpt, cache, seq_len, num_proc = args.child
        print(json.dumps(child(mode, data, ckpt, cache, int(seq_len), int(num_proc))))
        return
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        for mb in args.mb:
            root = Path(work) / f"{mb:g}mb"
            root.mkdir()
            data = root / "chats.jsonl"
            records = write_chats(data, mb)
            ckpt = train_tokenizer(root / "ckpt", data, args.vocab)
            shape = {"mb": mb, "records": records, "seq_len": args.seq_len, "vocab": args.vocab,
                     "num_proc": args.num_proc}
            common = (str(data), str(ckpt), str(root / "cache"), str(args.seq_len), str(args.num_proc))
            first = _run_child("prepared", *common)
            second = _run_child("prepared", *common)
            memory = _run_child("in_memory", *common)
            shape = {**shape, "rows": first["rows"], "tokens": first["tokens"]}
            emit("data_prepare.prepare_s", shape, round(first["prepare_s"], 2), "s")
            for start, result in (("first", first), ("second", second)):
                emit("data_prepare.first_batch_s", {**shape, "start": start, "tokenized": result["tokenized"]},
                     round(result["first_batch_s"], 3), "s")
            emit("data_prepare.in_memory_build_s", shape, round(memory["prepare_s"], 2), "s")
            for mode, result in (("mapped", second), ("in_memory", memory)):
                emit("data_prepare.peak_rss_mib", {**shape, "mode": mode, "rows_read": result["rows"]},
                     round(result["peak_rss_mib"], 1), "MiB")


if __name__ == "__main__":
    main()
