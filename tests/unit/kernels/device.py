"""The device the kernel tests put their tensors on: ``DEVICE``.

* ``DSV4_KERNEL_DEVICE=cuda``: CUDA tensors. With ``TRITON_INTERPRET=0`` this checks the COMPILED kernels on a GPU
  (what ``benchmarks/gpu_check.sh`` runs); a machine without a CUDA device is an error, not a silent CPU run.
* ``DSV4_KERNEL_DEVICE=cpu``: CPU tensors, which Triton runs only under its interpreter (``TRITON_INTERPRET=1``).
* unset: ``cuda`` when torch sees a GPU and ``TRITON_INTERPRET`` is not ``1``, else ``cpu`` (the default of the test
  suite, whose ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` unless told otherwise).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (Triton reads it once)

import torch  # noqa: E402


def kernel_device() -> str:
    """``cpu`` or ``cuda``, as the module docstring says; ``ValueError`` / ``RuntimeError`` naming the fix."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    choice = os.environ.get("DSV4_KERNEL_DEVICE", "").strip().lower()
    if not choice:
        return "cuda" if torch.cuda.is_available() and not interpret else "cpu"
    if choice not in ("cpu", "cuda"):
        raise ValueError(f"DSV4_KERNEL_DEVICE must be cpu or cuda, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("DSV4_KERNEL_DEVICE=cuda but torch sees no CUDA device")
    if choice == "cpu" and not interpret:
        raise RuntimeError("DSV4_KERNEL_DEVICE=cpu needs TRITON_INTERPRET=1 (Triton runs CPU tensors only under its "
                           "interpreter)")
    return choice


DEVICE = kernel_device()
