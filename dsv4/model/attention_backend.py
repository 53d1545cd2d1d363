"""Which sparse-attention kernel a layer runs: ``DSV4Config.attention_backend`` = ``auto`` | ``torch`` | ``triton``.

* ``torch``: :func:`dsv4.model.sparse_attention.sparse_attention`, the chunked pure-torch reference (any device).
* ``triton``: :func:`dsv4.kernels.triton_sparse_attention.triton_sparse_attention`, fused forward and backward
  kernels (``pip install -e '.[triton]'``). They run on CUDA tensors, on CPU tensors only under Triton's
  interpreter (``TRITON_INTERPRET=1``, how the tests check them), and on the meta device as shapes only (the memory
  plan traces what they allocate).
* ``auto``: ``triton`` for CUDA tensors when Triton imports, else ``torch``.

The CSA indexer follows the same choice (:func:`indexer_kernel`): on ``triton`` its scoring + top-k runs as
:func:`dsv4.kernels.triton_indexer.triton_indexer_topk` where the installed Triton has ``tl.topk`` and
``tl.bitonic_merge`` (3.9 has them), else in torch.

Both compute the same function (``tests/unit/kernels``); the choice changes speed and memory, never results
beyond floating-point rounding.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Callable

import torch

from dsv4.model.sparse_attention import sparse_attention

TRITON_INSTALL_HINT = "install Triton (pip install -e '.[triton]', Linux) or set model.attention_backend=torch"


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the ``triton`` package is installed."""
    return importlib.util.find_spec("triton") is not None


def resolve_attention_backend(backend: str, device_type: str) -> str:
    """``torch`` or ``triton`` for tensors on ``device_type``; ``ValueError`` naming the fix when ``triton`` cannot
    run there (not installed; CPU tensors without ``TRITON_INTERPRET=1``)."""
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device_type == "cuda" and triton_importable() else "torch"
    if backend != "triton":
        raise ValueError(f"model.attention_backend must be auto, torch or triton, got {backend!r}")
    if not triton_importable():
        raise ValueError(f"model.attention_backend=triton but the `triton` package is not installed: "
                         f"{TRITON_INSTALL_HINT}")
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("model.attention_backend=triton runs on CUDA devices (or on the CPU under Triton's "
                         "interpreter, TRITON_INTERPRET=1, slow: for tests); use model.attention_backend=auto or "
                         "torch on the CPU")
    return "triton"


def attention_kernel(backend: str, device: torch.device) -> Callable[..., torch.Tensor]:
    """The kernel function for ``backend`` on ``device`` (same keyword arguments as ``sparse_attention`` minus
    ``checkpoint``, which only the torch path has)."""
    if resolve_attention_backend(backend, device.type) == "torch":
        return sparse_attention
    from dsv4.kernels.triton_sparse_attention import triton_sparse_attention  # noqa: PLC0415 - optional

    return triton_sparse_attention


@functools.lru_cache(maxsize=None)
def triton_has_topk() -> bool:
    """True when the installed Triton has the sorting primitives the indexer kernel uses."""
    import triton.language as tl  # noqa: PLC0415 - optional

    return hasattr(tl, "topk") and hasattr(tl, "bitonic_merge")


def indexer_kernel(backend: str, device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The Triton indexer top-k for ``backend`` on ``device``, or None for the torch scoring loop."""
    if resolve_attention_backend(backend, device.type) == "torch" or not triton_has_topk():
        return None
    from dsv4.kernels.triton_indexer import triton_indexer_topk  # noqa: PLC0415 - optional

    return triton_indexer_topk
