"""What a run of a DeepSeek-V4.1 model (``model=v41_*``, :class:`~dsv4.config_v41.DSV41Config`) needs beyond V4's
checks, resolved in the launching process before any rank starts:

* **the run's tokenizer is Engram's**: Engram hashes n-grams of the tokenizer's classes
  (:mod:`dsv4.model.v41.engram_vocab`), so the tokenizer the data is tokenized with (``data.tokenizer``, resolved:
  the checkpoint's ``tokenizer.json``, else the byte tokenizer) is the one the model hashes with
  (:meth:`~dsv4.model.v41.model.DSV41ForCausalLM.set_engram_tokenizer` in every rank). Its class count must be
  ``model.engram_compressed_vocab_size`` (ValueError naming both numbers; the byte tokenizer has 227 classes, which
  ``v41_tiny`` is built for). A plan-only run (``plan.only``) hashes nothing and is not checked.
* **text only**: a packed row holding ``model.image_token_id`` is refused (:func:`refuse_image_tokens`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

V41 = "deepseek_v41"


def is_v41(config: Any) -> bool:
    """True for a DeepSeek-V4.1 config (``model_type`` "deepseek_v41")."""
    return getattr(config, "model_type", None) == V41


def check_engram_tokenizer(config: Any, tokenizer: Any, name: str) -> None:
    """ValueError naming both counts when ``tokenizer``'s Engram class count is not the config's
    ``engram_compressed_vocab_size`` (V4.1 configs with Engram layers only)."""
    if not is_v41(config) or not config.engram_layer_ids:
        return
    from dsv4.model.v41.engram_vocab import engram_class_map

    count = engram_class_map(tokenizer).count
    if count != config.engram_compressed_vocab_size:
        raise ValueError(
            f"`data.tokenizer`={name!r} has {count} Engram classes but `model.engram_compressed_vocab_size` is "
            f"{config.engram_compressed_vocab_size}: Engram layers {list(config.engram_layer_ids)} hash n-grams of the "
            f"tokenizer's classes, so the model needs the tokenizer it was trained with (the checkpoint's); for a "
            f"model trained from scratch on this tokenizer set model.engram_compressed_vocab_size={count}")


def refuse_image_tokens(rows: Any, config: Any, what: str = "training data") -> None:
    """ValueError when a V4.1 run's packed ``rows`` (:class:`~dsv4.data.packer.PackedRows` or
    :class:`~dsv4.data.prepared.PreparedRows`) hold ``config.image_token_id`` (dsv4 trains V4.1 on text only)."""
    if rows is None or not is_v41(config):
        return
    ids = rows.arrays["input_ids"] if hasattr(rows, "arrays") else rows.batch.input_ids.numpy()
    hits = int(np.count_nonzero(np.asarray(ids) == config.image_token_id))
    if hits:
        raise ValueError(f"the {what} holds {hits} image tokens (model.image_token_id={config.image_token_id}): "
                         "DeepSeek-V4.1 trains on text only here (no vision tower); remove the images from the data "
                         "or use a tokenizer without that id")
