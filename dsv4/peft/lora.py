"""LoRA modules: a frozen projection (plain or kept FP8 / FP4, :mod:`dsv4.peft.frozen`) plus an optional adapter.

* :class:`LoRALinear` replaces an ``nn.Linear`` (or the block-diagonal ``wo_a``). State-dict names: ``weight``
  (the frozen base under the base's own name, so checkpoints load unchanged), ``scale`` (kept form only),
  ``lora_A [r, in]``, ``lora_B [out, r]`` (adapter only). ``forward(x [..., in]) -> [..., out]``; with ``groups``
  G > 1, ``x [..., G, in_g] -> [..., G, out_g]`` and the adapter is block-diagonal too: block ``g`` of
  ``W + s B A`` is ``W_g + s B_g A`` (``B_g``: rows of group g), which is what merging writes.
* :class:`LoRAGroupedExperts` replaces a ``GroupedExperts``: ``w1, w3 [E, I, d]`` and ``w2 [E, d, I]`` frozen (or kept
  FP4 ``int8 [E, out, in/2]`` with ``w*_scale``), and per expert ``w*_lora_A [E, r, in]``, ``w*_lora_B [E, out, r]``.
  Every stacked tensor has the expert axis first, so EP sharding slices adapters with their experts.

Output: ``base(x) + (alpha / r) * B A dropout(x)``; ``B`` starts at zero. :meth:`merged_weight` gives ``W + s B A``
in fp32 (the kept base dequantised), the tensor a merged export writes.

A kept base is in the formats of the model's checkpoint family (``scheme``, a
:class:`~dsv4.checkpoint.quant.QuantScheme`: V4's FP8 tiles are 128 x 128, V4.1's 32 x 32), so the loader copies a
release's bytes and scales in as they are and dequantising them gives exactly the values a float model loads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv4.checkpoint.quant import V4_SCHEME, QuantScheme, dequantize_kept, logical_shape, quantize_kept
from dsv4.distributed import full_tensor
from dsv4.model.attention import block_diagonal_linear
from dsv4.model.moe import GroupedExperts, expert_linear
from dsv4.peft.config import LoRAConfig
from dsv4.peft.frozen import frozen_projection

ADAPTER_SUFFIXES = ("lora_A", "lora_B")


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``...lora_A`` / ``...lora_B``, stacked experts included)."""
    return name.endswith(ADAPTER_SUFFIXES)


def _frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach(), requires_grad=False)


def _adapter_pair(lead: tuple[int, ...], out: int, inp: int, rank: int, like: Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    """``A [*lead, r, in]`` Kaiming-uniform (as ``nn.Linear`` initialises a weight) and ``B [*lead, out, r]`` zero."""
    a = torch.empty(*lead, rank, inp, dtype=like.dtype, device=like.device)
    if a.device.type != "meta":
        bound = 1.0 / math.sqrt(inp)  # kaiming_uniform_(a=sqrt(5)) on an [r, in] matrix
        a.uniform_(-bound, bound)
    return nn.Parameter(a), nn.Parameter(torch.zeros(*lead, out, rank, dtype=like.dtype, device=like.device))


def _linear_input_grad(grad: Tensor, weight: Tensor) -> Tensor:
    return grad @ weight


class LoRALinear(nn.Module):
    """See the module docstring. ``keep``: ``"fp8"`` to hold the base in the kept FP8 form, None for a frozen
    parameter; ``lora`` None = a frozen projection without an adapter (a kept base that is not a target);
    ``scheme``: the checkpoint family's formats (the kept FP8 tiles)."""

    def __init__(self, base: nn.Linear, lora: LoRAConfig | None, keep: str | None = None,
                 scheme: QuantScheme = V4_SCHEME) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.groups = getattr(base, "groups", 1)
        self.keep = keep
        self.scheme = scheme
        if keep:
            q, s = quantize_kept(base.weight, keep, scheme)
            self.register_buffer("weight", q)
            self.register_buffer("scale", s)
        else:
            self.weight = _frozen(base.weight)
        self.rank = lora.rank if lora is not None else 0
        self.scaling = lora.scaling if lora is not None else 0.0
        if lora is not None:
            out_rows = self.out_features
            self.lora_A, self.lora_B = _adapter_pair((), out_rows, self.in_features, lora.rank, base.weight)
            self.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()

    def _base(self, x: Tensor) -> Tensor:
        if self.groups == 1:
            if self.keep:
                return frozen_projection(x, self.weight, self.scale, F.linear, _linear_input_grad, self.scheme)
            return F.linear(x, self.weight.to(x.dtype))
        g = self.groups
        if self.keep:
            return frozen_projection(
                x, self.weight, self.scale, lambda inp, w: block_diagonal_linear(inp, w, g),
                lambda grad, w: torch.einsum("...go,goi->...gi", grad, w.view(g, -1, w.shape[-1])), self.scheme)
        return block_diagonal_linear(x, self.weight, g)

    def forward(self, x: Tensor) -> Tensor:
        y = self._base(x)
        if not self.rank:
            return y
        a = F.linear(self.dropout(x), self.lora_A.to(x.dtype))  # [..., (G,) r]
        b = self.lora_B.to(x.dtype)
        delta = F.linear(a, b) if self.groups == 1 else block_diagonal_linear(a, b, self.groups)
        return y + delta * self.scaling

    @torch.no_grad()
    def base_weight(self) -> Tensor:
        """The frozen base weight as fp32 ``[out, in]`` (dequantised when kept), a full tensor."""
        if self.keep:
            return dequantize_kept(full_tensor(self.weight), full_tensor(self.scale), torch.float32, self.scheme)
        return full_tensor(self.weight).float()

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """``W + (alpha / r) B A`` in fp32, full (gathers sharded adapters: a collective under FSDP)."""
        w = self.base_weight()
        if self.rank:
            w = w + self.scaling * (full_tensor(self.lora_B).float() @ full_tensor(self.lora_A).float())
        return w

    def extra_repr(self) -> str:
        base = f"{self.keep} {'x'.join(map(str, self.scheme.fp8_block))}" if self.keep else "frozen"
        return (f"in={self.in_features}, out={self.out_features}, groups={self.groups}, base={base}, "
                f"rank={self.rank}")


class LoRAGroupedExperts(GroupedExperts):
    """A ``GroupedExperts`` with frozen (or kept FP4) expert weights and optional per-expert adapters; see the
    module docstring. Built from an existing ``GroupedExperts`` (:meth:`from_experts`; ``scheme``: the checkpoint
    family's formats, whose E8M0 byte 0 the kept FP4 scales decode as)."""

    WEIGHTS = ("w1", "w3", "w2")

    @classmethod
    def from_experts(cls, experts: GroupedExperts, lora: LoRAConfig | None, keep: str | None,
                     scheme: QuantScheme = V4_SCHEME) -> "LoRAGroupedExperts":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for attr in ("num_experts", "expert_offset", "num_local_experts", "swiglu_limit", "init_std", "chunk_tokens"):
            setattr(new, attr, getattr(experts, attr))
        new.keep = keep
        new.scheme = scheme
        new.rank = lora.rank if lora is not None else 0
        new.scaling = lora.scaling if lora is not None else 0.0
        for name in cls.WEIGHTS:
            w = getattr(experts, name)
            if keep:
                q, s = quantize_kept(w, keep, scheme)
                new.register_buffer(name, q)
                new.register_buffer(f"{name}_scale", s)
            else:
                setattr(new, name, _frozen(w))
            if lora is not None:
                a, b = _adapter_pair((w.shape[0],), w.shape[1], w.shape[2], lora.rank, w)
                setattr(new, f"{name}_lora_A", a)
                setattr(new, f"{name}_lora_B", b)
        if lora is not None:
            new.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        return new

    def stacked_names(self) -> tuple[str, ...]:
        names = list(self.WEIGHTS)
        if self.keep:
            names += [f"{n}_scale" for n in self.WEIGHTS]
        if self.rank:
            names += [f"{n}_lora_{ab}" for n in self.WEIGHTS for ab in "AB"]
        return tuple(names)

    def expert_weights(self, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
        weights = [getattr(self, n) for n in self.WEIGHTS]
        if self.keep:  # what the projections multiply by: the dequantised weight, in the input's dtype
            weights = [torch.empty(logical_shape(w), dtype=dtype or torch.float32, device="meta") for w in weights]
        if self.rank:
            weights += [getattr(self, f"{n}_lora_{ab}") for n in self.WEIGHTS for ab in "AB"]
        return tuple(weights)

    def project(self, name: str, x: Tensor, tokens_per_expert: Tensor, offs: Tensor | None) -> Tensor:
        weight = getattr(self, name)
        if self.keep:
            y = frozen_projection(
                x, weight, getattr(self, f"{name}_scale"),
                lambda inp, w: expert_linear(inp, w, tokens_per_expert, offs),
                lambda grad, w: expert_linear(grad.contiguous(), w.transpose(-2, -1), tokens_per_expert, offs),
                self.scheme)
        else:
            y = expert_linear(x, weight.to(x.dtype), tokens_per_expert, offs)
        if not self.rank:
            return y
        a = expert_linear(self.dropout(x), getattr(self, f"{name}_lora_A").to(x.dtype), tokens_per_expert, offs)
        return y + expert_linear(a, getattr(self, f"{name}_lora_B").to(x.dtype), tokens_per_expert, offs) * self.scaling

    @torch.no_grad()
    def base_weight(self, name: str) -> Tensor:
        """The frozen ``W_e`` of every local expert, fp32 ``[E_local, out, in]`` (dequantised when kept)."""
        weight = getattr(self, name)
        if self.keep:
            return dequantize_kept(full_tensor(weight), full_tensor(getattr(self, f"{name}_scale")), torch.float32,
                                   self.scheme)
        return full_tensor(weight).float()

    @torch.no_grad()
    def merged_weight(self, name: str) -> Tensor:
        """``W_e + (alpha / r) B_e A_e`` for every local expert, fp32 ``[E_local, out, in]`` (full tensors)."""
        w = self.base_weight(name)
        if self.rank:
            w = w + self.scaling * (full_tensor(getattr(self, f"{name}_lora_B")).float()
                                    @ full_tensor(getattr(self, f"{name}_lora_A")).float())
        return w

    def extra_repr(self) -> str:
        inter, hidden = logical_shape(self.w1)[1:]
        return (f"num_experts={self.num_experts}, local=[{self.expert_offset}, "
                f"{self.expert_offset + self.num_local_experts}), hidden={hidden}, inter={inter}, "
                f"base={self.keep or 'frozen'}, rank={self.rank}")
