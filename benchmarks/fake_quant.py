"""Fake quantisation (``model.fake_quant``): how far the served KV / indexer numerics move the logits.

For each tiny model, two copies with the same weights, ``fake_quant`` off and on, run the same random rows (no
labels, fp32, eval); the measurements compare the on-logits with the off-logits (the exact ones):

* ``fake_quant.max_abs_logit_diff`` / ``fake_quant.mean_abs_logit_diff``: ``max`` / ``mean |on - off|`` over every
  position and vocabulary entry, divided by ``max |off|`` (unit ``of_max_logit``);
* ``fake_quant.kl``: ``KL(softmax(off) || softmax(on))`` per position, averaged (nats);
* ``fake_quant.top1_agreement``: the share of positions whose arg-max token is the same;
* ``fake_quant.max_logit``: ``max |off|`` itself (at a random initialisation the logits are nearly flat, so a
  small absolute change is a large share of it and near-ties flip the arg-max).

Models: ``tiny`` (V4: ratios 0, 4, 128; window / compressed KV FP8, Hadamard + FP4 indexer) and ``v41_tiny`` with
``engram_layer_ids=[]`` (V4.1 without Engram, so no tokenizer is needed; every CSA2 role stays: window KV FP8,
compressed KV FP4, indexer FP4). Weights are each model's random initialisation (seed 0), so the numbers show the
size of the rounding on an untrained model, not on a released checkpoint.

    python benchmarks/fake_quant.py            # 4 rows of 512 tokens
    python benchmarks/fake_quant.py --quick    # 1 row of 128 tokens (the test suite's smoke run)
"""

from __future__ import annotations

import argparse

import torch

from common import emit
from dsv4.config import DSV4Config
from dsv4.model import build_causal_lm

MODELS = {"tiny": {}, "v41_tiny": {"engram_layer_ids": [], "engram_num_embeddings": []}}


def compare(preset: str, overrides: dict, rows: int, seq_len: int) -> dict[str, float]:
    """The measurements of ``preset`` (with ``overrides``) on ``rows`` random rows of ``seq_len`` tokens."""
    torch.manual_seed(0)
    exact = build_causal_lm(DSV4Config.preset(preset, **overrides, fake_quant=False)).eval()
    served = build_causal_lm(DSV4Config.preset(preset, **overrides, fake_quant=True)).eval()
    served.load_state_dict(exact.state_dict())
    config = exact.config
    high = min(config.vocab_size, getattr(config, "image_token_id", config.vocab_size))  # V4.1: text tokens only
    ids = torch.randint(0, high, (rows, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        off, on = exact(ids).logits.double(), served(ids).logits.double()
    top = off.abs().max()
    diff = (on - off).abs()
    log_p, log_q = off.log_softmax(-1), on.log_softmax(-1)
    return {
        "max_abs_logit_diff": (diff.max() / top).item(),
        "mean_abs_logit_diff": (diff.mean() / top).item(),
        "kl": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item(),
        "top1_agreement": (off.argmax(-1) == on.argmax(-1)).double().mean().item(),
        "max_logit": top.item(),
    }


UNITS = {"max_abs_logit_diff": "of_max_logit", "mean_abs_logit_diff": "of_max_logit", "kl": "nats",
         "top1_agreement": "share", "max_logit": "logit"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="1 row of 128 tokens")
    args = parser.parse_args()
    rows, seq_len = (1, 128) if args.quick else (args.rows, args.seq_len)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    for preset, overrides in MODELS.items():
        values = compare(preset, overrides, rows, seq_len)
        shape = {"model": preset, **overrides, "rows": rows, "seq_len": seq_len}
        for key, value in values.items():
            emit(f"fake_quant.{key}", shape, value, UNITS[key])


if __name__ == "__main__":
    main()
