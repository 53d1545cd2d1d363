"""The gradient oracle the CP and parallel tests share: a parameter's gradient summed over the ranks that hold it
equals the single-process reference's."""

from __future__ import annotations

import torch


def assert_rank_grads_sum_to(reference: dict[str, torch.Tensor], rank_grads: list[dict[str, torch.Tensor]]) -> None:
    """For every name in ``reference``: the sum of ``rank_grads[r][name]`` over the ranks holding ``name`` is within
    1e-4 relative (Frobenius) of the reference, or within 1e-9 elementwise where the reference is all but zero."""
    for name, ref in reference.items():
        total = sum(grads[name] for grads in rank_grads if name in grads)
        err = ((total - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert err < 1e-4 or (total - ref).abs().max() < 1e-9, f"{name}: relative gradient error {err:.2e}"
