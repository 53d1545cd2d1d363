"""The indexer loss (``model.indexer_loss_coeff``): what it costs per step and what an indexer-only warm-up buys.

* ``indexer_loss.step_tokens_per_s``: forward + backward tokens/s of the tiny model (``index_topk`` 8, so the
  selection is a strict subset of the visible windows) with the indexer frozen (coefficient 0) and trained
  (coefficient 0.01, the torch attention path that returns the teacher); ``indexer_loss.step_overhead`` their ratio.
* ``indexer_loss.kl``: the indexer's KL (token mean, :mod:`dsv4.model.indexer_loss`) on a held-out row before and
  after ``--steps`` indexer-only AdamW steps (the main model frozen, as ``indexer_warmup_steps`` runs them);
* ``indexer_loss.selected_mass``: the share of the main attention (head mean, per query, averaged over queries with
  a selection) that falls on the rows the indexer selects, on the held-out row, before and after: the indexer's
  job is to pick the compressed rows the attention wants, so this rises as it learns.

Tokens are the bundled corpus's bytes (the byte tokenizer); the model is the tiny preset at its random init, so
the numbers show the mechanism, not a trained model's quality.

    python benchmarks/indexer_loss.py                  # S = 1024, 30 steps
    python benchmarks/indexer_loss.py --quick          # S = 256, 3 steps (the test suite's smoke run)
"""

from __future__ import annotations

import argparse
import time

import torch

from common import emit
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM


def _rows(seq_len: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from dsv4.data import build_documents

    docs = build_documents(kind="stdlib", max_documents=256)
    tokens = torch.tensor([t for doc in docs for t in doc.ids][: seq_len * count])
    rows = []
    for i in range(count):
        ids = tokens[i * seq_len:(i + 1) * seq_len][None]
        labels = ids.roll(-1, dims=1)
        labels[:, -1] = -100
        rows.append((ids, labels))
    return rows


def _selected_mass(model: DSV4ForCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(indexer KL token mean, mean selected attention mass) on one row, the teacher read from the layers."""
    import dsv4.model.attention as attention_module

    masses = []

    original_kl = attention_module.indexer_kl_sum

    def recording(teacher, scores):
        mass = teacher.sum(-1)
        masses.append(mass[mass > 0])
        return original_kl(teacher, scores)

    attention_module.indexer_kl_sum = recording
    try:
        with torch.enable_grad():
            out = model(ids, labels=labels, return_logits=False)
    finally:
        attention_module.indexer_kl_sum = original_kl
    kl = (out.indexer_loss_sum / out.label_count).item()
    return kl, torch.cat(masses).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.seq_len, args.steps, args.repeats = 256, 3, 1
    rows = _rows(args.seq_len, args.steps + 1)
    held_out, train = rows[0], rows[1:]
    shape = {"model": "tiny", "seq_len": args.seq_len, "index_topk": 8, "threads": torch.get_num_threads()}

    speeds = {}
    for coeff in (0.0, 0.01):
        torch.manual_seed(0)
        model = DSV4ForCausalLM(DSV4Config.preset("tiny", index_topk=8, indexer_loss_coeff=coeff,
                                                  attention_backend="torch"))
        ids, labels = train[0]
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            model(ids, labels=labels, return_logits=False).loss_sum.backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        speeds[coeff] = args.seq_len / sorted(times[1:])[len(times[1:]) // 2]
        emit("indexer_loss.step_tokens_per_s", {**shape, "indexer_loss_coeff": coeff}, round(speeds[coeff], 1),
             "tokens/s")
    emit("indexer_loss.step_overhead", shape, round(speeds[0.0] / speeds[0.01], 3), "ratio")

    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny", index_topk=8, indexer_loss_coeff=0.01,
                                              attention_backend="torch"))
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n]
    optimizer = torch.optim.AdamW(indexer, lr=1e-2)
    before = _selected_mass(model, *held_out)
    for ids, labels in train:  # the warm-up: only the indexer's loss, only its parameters
        optimizer.zero_grad(set_to_none=True)
        out = model(ids, labels=labels, return_logits=False)
        (out.indexer_loss_sum / out.label_count).backward()
        optimizer.step()
    after = _selected_mass(model, *held_out)
    for name, index in (("kl", 0), ("selected_mass", 1)):
        emit(f"indexer_loss.{name}", {**shape, "when": "before", "steps": 0}, round(before[index], 4), "nats" if
             name == "kl" else "fraction")
        emit(f"indexer_loss.{name}", {**shape, "when": "after", "steps": len(train)}, round(after[index], 4),
             "nats" if name == "kl" else "fraction")


if __name__ == "__main__":
    main()
