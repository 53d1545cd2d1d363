"""Single-pass hyper-connections (V4.1's mHC): the mix a site computes collapses the *next* site's input.

V4 (:class:`dsv4.model.hyper_connections.HyperConnection`) computes ``pre, post, comb`` from a site's input and
uses all three at that site. V4.1 computes the same three from the site's input ``X`` with the same parameters
(``fn``, ``base``, ``scale``; fp32), but the collapse of a site reads the ``pre`` carried from the site before:

    attention site of block i:  mix_a = attn_hc(X);  y = attn(norm(collapse(X, carried)))
                                X = expand(X, y, mix_a.post, mix_a.comb)
    FFN site:                   mix_f = ffn_hc(X);   y = ffn(norm(collapse(X, mix_a.pre)))
                                X = expand(X, y, mix_f.post, mix_f.comb);  carried = mix_f.pre

The first block's ``carried`` is one-hot on stream 0 (it reads the embedding); the final collapse before the model's
norm uses the last FFN site's ``pre``; there is no hyper-head. ``carried`` stays fp32 between blocks (mixed
precision must not cast it). ``forward(X)`` returns the mix, so a forward hook on a block's ``attn_hc`` sees the
streams entering its attention site (the DSpark target features).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsv4.model.hyper_connections import HyperConnection


class Mix(NamedTuple):
    """fp32 coefficients of one site: ``pre``/``post`` ``[B, L, hc]``, ``comb`` ``[B, L, hc, hc]`` (in, out)."""

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


class SinglePassHyperConnection(HyperConnection):
    """A V4.1 site: ``forward(X [B, L, hc, d]) -> Mix`` (the same parameters and mixing math as V4's site)."""

    def forward(self, x: torch.Tensor) -> Mix:  # type: ignore[override]
        return Mix(*self.mixing(x))


def first_carry(streams: torch.Tensor) -> torch.Tensor:
    """The ``pre`` the first block's attention collapse reads: one-hot on stream 0, ``[B, L, hc]`` fp32."""
    carry = torch.zeros(streams.shape[:-1], dtype=torch.float32, device=streams.device)
    carry[..., 0] = 1.0
    return carry
