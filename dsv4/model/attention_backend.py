"""Which sparse-attention kernel a layer runs: ``DSV4Config.attention_backend`` = ``auto`` or a name registered in
:data:`ATTENTION_BACKENDS` (built in: ``torch``, ``triton``).

* ``torch``: :func:`dsv4.model.sparse_attention.sparse_attention`, the chunked pure-torch reference (any device).
* ``triton``: :func:`dsv4.kernels.triton_sparse_attention.triton_sparse_attention`, fused forward and backward
  kernels (``pip install -e '.[triton]'``). They run on CUDA tensors, on CPU tensors only under Triton's
  interpreter (``TRITON_INTERPRET=1``, how the tests check them), and on the meta device as shapes only (the memory
  plan traces what they allocate).
* ``auto``: the first registered backend whose :attr:`AttentionBackend.auto` accepts the device type (``triton``
  for CUDA tensors when Triton imports), else ``torch``.

The CSA indexer follows the same choice (:func:`indexer_kernel`): on ``triton`` its scoring + top-k runs as
:func:`dsv4.kernels.triton_indexer.triton_indexer_topk` where the installed Triton has ``tl.topk`` and
``tl.bitonic_merge`` (3.9 has them), else in torch.

Every backend computes the same function as ``torch`` (``tests/unit/kernels``); the choice changes speed and
memory, never results beyond floating-point rounding. A new backend is one module with its kernel and one
:class:`AttentionBackend` registration (``docs/extending.md``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4.model.sparse_attention import sparse_attention
from dsv4.registry import Registry

TRITON_INSTALL_HINT = "install Triton (pip install -e '.[triton]', Linux) or set model.attention_backend=torch"

AUTO = "auto"  # the policy name (not an entry): see resolve_attention_backend
FALLBACK = "torch"  # what ``auto`` picks when no backend claims the device

AttentionKernel = Callable[..., torch.Tensor]
"""``kernel(q, kv, sink, *, window, query_seq_ids, ...)``: the keyword arguments of
:func:`~dsv4.model.sparse_attention.sparse_attention` minus ``checkpoint`` (which only the torch path has)."""
IndexerKernel = Callable[..., torch.Tensor]
"""``kernel(q, w, keys, query_seq_ids, query_positions, key_seq_ids, key_positions, k, local_windows)`` -> top-k
indices, as :func:`dsv4.kernels.triton_indexer.triton_indexer_topk`."""


def _runs_everywhere(device_type: str) -> None:
    return None


def _never(device_type: str) -> bool:
    return False


def _no_indexer() -> IndexerKernel | None:
    return None


@dataclass(frozen=True)
class AttentionBackend:
    """One registered attention backend.

    Attributes:
        attention: returns the sparse-attention kernel (:data:`AttentionKernel`); called when a layer runs, so an
            optional dependency is imported there, not at registration.
        indexer: returns the CSA indexer top-k kernel (:data:`IndexerKernel`), or None for the torch scoring loop.
        check: raises ``ValueError`` naming the fix when the backend cannot run on tensors of ``device_type``
            (``"cuda"``, ``"cpu"``, ``"meta"``: the memory plan traces shapes on meta); returns None otherwise.
        auto: True when ``auto`` should choose this backend for ``device_type`` (registration order decides
            between several; none: ``torch``). It must not raise.
    """

    attention: Callable[[], AttentionKernel]
    indexer: Callable[[], IndexerKernel | None] = _no_indexer
    check: Callable[[str], None] = _runs_everywhere
    auto: Callable[[str], bool] = _never


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry(
    "model.attention_backend", "attention backend", reserved=(AUTO,))


def resolve_attention_backend(backend: str, device_type: str) -> str:
    """The registered backend that runs tensors on ``device_type`` (``auto`` resolved); ``ValueError`` naming the
    fix when ``backend`` cannot run there (``triton``: not installed; CPU tensors without ``TRITON_INTERPRET=1``)
    or is not registered."""
    if ATTENTION_BACKENDS.check(backend, allow=(AUTO,)) == AUTO:
        return next((name for name in ATTENTION_BACKENDS if ATTENTION_BACKENDS.get(name).auto(device_type)),
                    FALLBACK)
    ATTENTION_BACKENDS.get(backend).check(device_type)
    return backend


def attention_kernel(backend: str, device: torch.device) -> AttentionKernel:
    """The kernel function for ``backend`` on ``device`` (same keyword arguments as ``sparse_attention`` minus
    ``checkpoint``, which only the torch path has)."""
    return ATTENTION_BACKENDS.get(resolve_attention_backend(backend, device.type)).attention()


def attend(config, q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, meta, *, ratio: int,
           compressed: torch.Tensor | None = None, topk: torch.Tensor | None = None, local_windows: int | None = None,
           **tuning):
    """One layer's attention through ``config.attention_backend``: the sliding window over ``kv`` and, for
    ``ratio > 0``, the ``compressed`` rows of ``meta.key_windows[ratio]`` (restricted to ``topk`` when given), with
    the per-head ``sink``. ``meta`` is the forward's :class:`~dsv4.model.attention_metadata.AttentionMetadata`;
    ``tuning`` passes further kernel options (e.g. ``compressed_probs``). Returns what the kernel returns."""
    key_windows = meta.key_windows[ratio] if ratio and compressed is not None else None
    kernel = attention_kernel(config.attention_backend, q.device)
    return kernel(
        q, kv, sink,
        window=config.sliding_window,
        query_seq_ids=meta.seq_ids,
        query_positions=meta.position_ids,
        kv_seq_ids=meta.kv_seq_ids,
        kv_padding=meta.kv_padding,
        query_offset=meta.halo,
        compressed=compressed,
        compressed_seq_ids=None if key_windows is None else key_windows.seq_ids,
        compressed_positions=None if key_windows is None else key_windows.positions,
        ratio=ratio,
        topk_indices=topk,
        chunk_size=config.attention_chunk_size,  # both kernels visit a query's document rows only
        compressed_local_rows=local_windows,
        key_floors=meta.key_floors.get(ratio),
        **tuning,
    )


def indexer_kernel(backend: str, device: torch.device) -> IndexerKernel | None:
    """The indexer top-k kernel of ``backend`` on ``device``, or None for the torch scoring loop."""
    return ATTENTION_BACKENDS.get(resolve_attention_backend(backend, device.type)).indexer()


# ----------------------------------------------------------------------------------------------------- torch

ATTENTION_BACKENDS.register("torch", AttentionBackend(attention=lambda: sparse_attention))


# ---------------------------------------------------------------------------------------------------- triton


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the ``triton`` package is installed."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def triton_has_topk() -> bool:
    """True when the installed Triton has the sorting primitives the indexer kernel uses."""
    import triton.language as tl  # noqa: PLC0415 - optional

    return hasattr(tl, "topk") and hasattr(tl, "bitonic_merge")


def _triton_check(device_type: str) -> None:
    if not triton_importable():
        raise ValueError(f"model.attention_backend=triton but the `triton` package is not installed: "
                         f"{TRITON_INSTALL_HINT}")
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("model.attention_backend=triton runs on CUDA devices (or on the CPU under Triton's "
                         "interpreter, TRITON_INTERPRET=1, slow: for tests); use model.attention_backend=auto or "
                         "torch on the CPU")


def _triton_auto(device_type: str) -> bool:
    return device_type == "cuda" and triton_importable()


def _triton_attention() -> AttentionKernel:
    from dsv4.kernels.triton_sparse_attention import triton_sparse_attention  # noqa: PLC0415 - optional

    return triton_sparse_attention


def _triton_indexer() -> IndexerKernel | None:
    if not triton_has_topk():
        return None
    from dsv4.kernels.triton_indexer import triton_indexer_topk  # noqa: PLC0415 - optional

    return triton_indexer_topk


ATTENTION_BACKENDS.register("triton", AttentionBackend(
    attention=_triton_attention, indexer=_triton_indexer, check=_triton_check, auto=_triton_auto))
