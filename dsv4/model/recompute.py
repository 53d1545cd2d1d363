"""Activation recompute (``model.activation_checkpointing``): ``none`` | ``block`` | ``selective``.

* ``block``: each decoder block saves only its input streams ``[B, L, hc, d]``; everything inside is recomputed in
  backward. Each MTP depth saves only its inputs (the streams and the shifted embeddings ``[B, L, d]``); its
  projections, norms, block, hyper-head and final norm are recomputed. The MTP's document shift (a CP exchange)
  runs outside the recomputed depth, once.
* ``selective``: the two large internals of a block are recomputed: the attention sub-layer (projections,
  compressors, indexer, sparse attention) and the MoE FFN (routing, expert hidden ``[T, k, I]``); the
  hyper-connection streams around them are kept.

Recompute is :func:`torch.utils.checkpoint.checkpoint` without re-entry. Under context parallelism a recomputed
attention exchanges its halo / compressed rows again, in backward, with the same data as in forward: every rank
recomputes the same blocks in the same order, so the exchanges pair up. Side effects of the forward that must
happen once (the MoE load statistics) check :func:`is_recomputing`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

from torch.utils.checkpoint import checkpoint

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed region is being recomputed in backward."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _recomputing():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its activations recomputed in backward instead of saved."""
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), _recomputing()))
