"""Peak memory of the output head with and without ``[L, vocab]`` logits (``return_logits=False``).

Each measurement runs in a fresh process; the RSS high-water mark is reset right before the measured work, so the
value is what that work adds on top of the model and its inputs:

* ``loss_memory.head``: the loss head alone, ``hidden [L, d] -> lm_head [vocab, d] -> cross-entropy`` forward +
  backward, as the logits path computes it (fp32 logits, ``F.cross_entropy``) and chunked
  (:func:`dsv4.model.chunked_loss.linear_cross_entropy`);
* ``loss_memory.model_step``: one forward + backward of the tiny model with the release vocabulary (MTP off, so
  one head), ``model(..., labels=...)`` versus ``model(..., labels=..., return_logits=False)``;
* ``loss_memory.*.reduction``: logits-path peak / chunked peak.

    python benchmarks/loss_memory.py                         # vocab 129280, L 8192 (needs ~14 GiB of RAM)
    python benchmarks/loss_memory.py --length 2048 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import current_rss_kib, emit, peak_rss_kib, reset_peak_rss


def _child(what: str, mode: str, length: int, vocab: int, chunk: int) -> None:
    import torch
    import torch.nn.functional as F

    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.model.chunked_loss import linear_cross_entropy

    torch.manual_seed(0)
    config = DSV4Config.preset("tiny", vocab_size=vocab, num_nextn_predict_layers=0, loss_chunk_size=chunk,
                               max_position_embeddings=max(length, 1024))
    labels = torch.randint(0, vocab, (1, length))
    if what == "head":
        hidden = torch.randn(1, length, config.hidden_size, requires_grad=True)
        weight = torch.nn.Parameter(torch.randn(vocab, config.hidden_size) * 0.02)
        base = current_rss_kib()
        reset_peak_rss()
        if mode == "logits":
            loss = F.cross_entropy((hidden.float() @ weight.float().t()).reshape(-1, vocab), labels.reshape(-1),
                                   reduction="sum")
        else:
            loss, _ = linear_cross_entropy(hidden, weight, labels, chunk)
        loss.backward()
    else:
        model = DSV4ForCausalLM(config)
        ids = torch.randint(1, vocab, (1, length))
        base = current_rss_kib()
        reset_peak_rss()
        model(ids, labels=labels, return_logits=(mode == "logits")).loss.backward()
    print(json.dumps({"peak_mib": (peak_rss_kib() - base) / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child, args.length, args.vocab, args.chunk)
        return
    for what in ("head", "model_step"):
        peaks = {}
        for mode in ("logits", "chunked"):
            out = subprocess.run([sys.executable, __file__, "--child", what, mode, "--length", str(args.length),
                                  "--vocab", str(args.vocab), "--chunk", str(args.chunk)],
                                 check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            peaks[mode] = json.loads(out)["peak_mib"]
            shape = {"preset": "tiny", "length": args.length, "vocab": args.vocab, "loss_chunk_size": args.chunk,
                     "mode": mode, "step": "forward+backward"}
            emit(f"loss_memory.{what}.peak_rss_delta", shape, round(peaks[mode], 1), "MiB")
        emit(f"loss_memory.{what}.reduction", {"length": args.length, "vocab": args.vocab, "chunk": args.chunk},
             round(peaks["logits"] / max(peaks["chunked"], 1e-9), 2), "x")


if __name__ == "__main__":
    main()
