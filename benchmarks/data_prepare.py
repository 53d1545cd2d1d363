"""Preparing chat data once (``dsv4.data.prepared``) against tokenizing in memory at every start.

    python benchmarks/data_prepare.py --mb 40 80          # the recorded sizes (seq_len 8192)
    python benchmarks/data_prepare.py                     # a small default (2 MB), as the smoke test runs it
    python benchmarks/data_prepare.py --recipe --mb 40 80 # through recipes/finetune.py, cp=2 dp=2 (issue #23)

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

``--recipe`` measures the same data through the recipe instead (issue #23's acceptance): for each size a tiny model
checkpoint holding the trained tokenizer (so ``data.tokenizer=auto`` picks it) and two starts of
``recipes/finetune.py cp=2 dp=2 seq_len=<--seq-len> trainer.max_steps=1 ... data=jsonl data.cache_dir=<cache>``
(the first prepares, the second maps), each a subprocess whose process tree is polled every ~0.1 s
(``/proc/<pid>/status``):

* ``data_prepare.recipe.first_step_s`` (``start`` = first / second): launch to the ``step 1/1`` progress line (the end
  of the first optimizer step); the shape's ``tokenized`` says whether that start's log has ``data: tokenized``;
* ``data_prepare.recipe.prepare_s``: the prepare inside the first start (its ``data: prepared dataset ... in N s``);
* ``data_prepare.recipe.peak_rss_anon_mib`` / ``data_prepare.recipe.peak_rss_mib`` (``rank`` 0..3): a rank's peak
  private memory (RssAnon: what the data costs the rank; mapped file pages are shared page cache, in RssFile) and
  peak RSS (VmHWM); ``rank`` = ``helpers`` is the largest peak of the ranks' child processes (tokenizing workers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
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
    from dsv4.data.prepared import prepare_dataset
    from dsv4.data.prepared_key import prepared_fingerprint, prepared_path

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


def tiny_checkpoint(directory: Path, tokenizer_dir: Path) -> tuple[Path, int]:
    """A tiny-preset model exported to ``directory`` (embedding rows: the tokenizer's ids rounded up to 128) beside the
    tokenizer files of ``tokenizer_dir``: ``model.checkpoint=<directory>`` with ``data.tokenizer=auto`` uses them.
    Returns the directory and the embedding rows (the recipe's ``model.vocab_size``)."""
    import shutil

    import torch
    from tokenizers import Tokenizer

    from dsv4.checkpoint import export_hf_checkpoint
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    ids = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    vocab = -(-ids // 128) * 128
    torch.manual_seed(0)
    export_hf_checkpoint(DSV4ForCausalLM(DSV4Config.preset("tiny", vocab_size=vocab)), directory, dtype="float32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory, vocab


def _status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of ``pid`` in KiB ({} once it has exited)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0])
    except OSError:
        return {}
    return out


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _local_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"LOCAL_RANK="):
                    return int(item.split(b"=", 1)[1])
    except (OSError, ValueError):
        pass
    return None


class TreeMemory:
    """Polls a launcher process and its descendants every ``interval`` s. The launcher is rank 0; a child of the
    launcher started with ``LOCAL_RANK`` in its environment is that rank (one node); any other descendant is a helper
    (a tokenizing worker, a forked child) of the rank above it. Keeps each rank's peak RssAnon and VmHWM."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.ranks: dict[int, dict[str, int]] = {}
        self.helpers: dict[str, int] = {}
        self.roles: dict[int, int | None] = {pid: 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _role(self, pid: int, parent: int) -> int | None:
        # a child of the launcher is read again until it shows LOCAL_RANK: between its fork and its exec it still
        # has the launcher's environment (a rank seen then would count as a helper)
        if self.roles.get(pid) is None and parent == self.pid:
            self.roles[pid] = _local_rank(pid)
        return self.roles.get(pid)

    def poll(self) -> None:
        stack = [(self.pid, None)]
        while stack:
            pid, parent = stack.pop()
            role = 0 if pid == self.pid else self._role(pid, parent)
            status = _status(pid)
            if status:
                peaks = self.ranks.setdefault(role, {}) if role is not None else self.helpers
                peaks["rss_anon"] = max(peaks.get("rss_anon", 0), status.get("RssAnon", 0))
                peaks["rss_file"] = max(peaks.get("rss_file", 0), status.get("RssFile", 0))
                peaks["hwm"] = max(peaks.get("hwm", 0), status.get("VmHWM", 0))
            stack += [(c, pid) for c in _children(pid)]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def recipe_start(data: Path, ckpt: Path, vocab: int, cache: Path, run_dir: Path, seq_len: int, num_proc: int,
                 timeout: float) -> dict:
    """One start of ``recipes/finetune.py`` (cp=2 dp=2, one optimizer step) on ``data``: seconds from launch to the
    ``step 1/1`` line, whether it tokenized, each rank's memory peaks (KiB), the log."""
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    from tests.e2e.helpers import recipe_env, reserved_port

    cmd = [sys.executable, str(repo / "recipes/finetune.py"), "cp=2", "dp=2", f"seq_len={seq_len}",
           "trainer.max_steps=1", "checkpoint.every_n_steps=0", "logger=csv", "callbacks=none", "plan=false",
           "+callbacks.progress._target_=dsv4.callbacks.TextProgressCallback",
           "+callbacks.progress.every_n_steps=1", "+callbacks.progress.when=always",
           f"model.checkpoint={ckpt}", f"model.vocab_size={vocab}", "data=jsonl", f"data.path={data}", f"data.cache_dir={cache}",
           f"data.num_proc={num_proc}", f"hydra.run.dir={run_dir}"]
    lines: list[str] = []
    first_step = None
    with reserved_port() as port:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=repo, env=recipe_env(port), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        memory = TreeMemory(proc.pid)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        for line in proc.stdout:
            lines.append(line)
            if first_step is None and "step 1/1" in line:
                first_step = time.monotonic() - start
        proc.wait()
        timer.cancel()
        memory.stop()
    log = "".join(lines)
    if proc.returncode or first_step is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log[-6000:]}")
    return {"first_step_s": first_step, "tokenized": "data: tokenized" in log, "ranks": memory.ranks,
            "helpers": memory.helpers, "log": log}


def recipe_main(args: argparse.Namespace, work: str) -> None:
    for mb in args.mb:
        root = Path(work) / f"{mb:g}mb"
        root.mkdir()
        data = root / "chats.jsonl"
        records = write_chats(data, mb)
        ckpt, vocab = tiny_checkpoint(root / "ckpt", train_tokenizer(root / "tokenizer", data, args.vocab))
        shape = {"size_mb": mb, "records": records, "seq_len": args.seq_len, "vocab": vocab, "cp": 2, "dp": 2,
                 "num_proc": args.num_proc}
        for start in ("first", "second"):
            result = recipe_start(data, ckpt, vocab, root / "cache", root / f"run-{start}", args.seq_len, args.num_proc,
                                  args.timeout)
            reused = re.search(r"data: reusing prepared dataset \S+ \((\d+) rows, (\d+) tokens", result["log"])
            if args.keep_logs:
                (Path(args.keep_logs) / f"{mb:g}mb-{start}.log").write_text(result["log"])
            here = {**shape, "start": start, "tokenized": result["tokenized"]}
            if reused:
                here.update(rows=int(reused.group(1)), tokens=int(reused.group(2)))
            emit("data_prepare.recipe.first_step_s", here, round(result["first_step_s"], 1), "s")
            prepared = re.search(r"data: prepared dataset \S+ \(.*\) in ([\d.]+) s", result["log"])
            if prepared:
                emit("data_prepare.recipe.prepare_s", here, float(prepared.group(1)), "s")
            peaks = [(str(rank), p) for rank, p in sorted(result["ranks"].items())]
            if result["helpers"]:
                peaks.append(("helpers", result["helpers"]))
            for rank, p in peaks:
                emit("data_prepare.recipe.peak_rss_anon_mib", {**here, "rank": rank},
                     round(p["rss_anon"] / 1024, 1), "MiB")
                emit("data_prepare.recipe.peak_rss_mib", {**here, "rank": rank, "peak_rss_file_mib":
                     round(p["rss_file"] / 1024, 1)}, round(p["hwm"] / 1024, 1), "MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[2.0], help="JSONL sizes in MB")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--num-proc", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--workdir", default=None, help="default: a temporary directory, removed at the end")
    parser.add_argument("--child", nargs=6, metavar=("MODE", "DATA", "CKPT", "CACHE", "SEQ_LEN", "NUM_PROC"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--recipe", action="store_true",
                        help="two starts of recipes/finetune.py cp=2 dp=2 per size: time to the first step, "
                             "per-rank peak memory")
    parser.add_argument("--timeout", type=float, default=3600, help="--recipe: seconds one start may take")
    parser.add_argument("--keep-logs", default=None, help="--recipe: a directory for the starts' logs")
    args = parser.parse_args()
    if args.recipe:
        with tempfile.TemporaryDirectory(dir=args.workdir) as work:
            recipe_main(args, work)
        return
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
