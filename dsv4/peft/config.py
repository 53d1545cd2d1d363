"""`LoRAConfig`: what a LoRA fine-tune adapts and how the frozen base is held (the ``peft`` config group).

* ``rank`` ``r >= 1``, ``alpha > 0``: each adapted projection computes ``W x + (alpha / r) * B A dropout(x)`` with
  ``A [r, in]`` (Kaiming-uniform init) and ``B [out, r]`` (zero init), so a fresh adapter leaves the model exactly
  as it was.
* ``dropout`` in ``[0, 1)``: on the adapter's input only.
* ``targets``: any of :data:`TARGET_GROUPS`: ``attention`` (``wq_a, wq_b, wkv, wo_a, wo_b`` of every attention
  layer, MTP blocks included; ``wo_a`` is block-diagonal, its adapter too), ``shared_experts`` (``w1, w2, w3``),
  ``routed_experts`` (``w1, w2, w3`` of every routed expert, one ``A``/``B`` pair per expert, stacked like the
  expert weights and sharded with them under EP). Never adapted: compressors, the indexer, routers, norms,
  hyper-connections, embeddings, the head, MTP's ``e_proj``/``h_proj``.
* ``base_dtype``: ``bf16`` keeps the frozen base as ordinary (frozen) parameters; ``fp8`` keeps every tensor the
  release stores in FP8 (e4m3, e8m0 scales per tile of the family: 128 x 128 in V4, 32 x 32 in V4.1) or FP4
  (packed e2m1, e8m0 per 32 columns) in that form, the release's bytes as they are, as
  frozen buffers dequantised one layer at a time in forward and again in backward
  (:mod:`dsv4.peft.frozen`), so the whole model never exists in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TARGET_GROUPS = ("attention", "shared_experts", "routed_experts")
# each group's modules, by their released names (after the block prefix ``layers.{i}.`` / ``mtp.{k}.``)
TARGET_MODULE_PATTERNS = {
    "attention": r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b)",
    "shared_experts": r"ffn\.shared_experts\.(w1|w2|w3)",
    "routed_experts": r"ffn\.experts\.\d+\.(w1|w2|w3)",
}
BASE_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGET_GROUPS
    base_dtype: str = "bf16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"`peft.rank` must be an integer >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"`peft.alpha` must be > 0, got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`peft.dropout` must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in TARGET_GROUPS]
        if unknown or not self.targets:
            raise ValueError(f"`peft.targets`={list(self.targets)}: each must be one of {list(TARGET_GROUPS)} "
                             f"(and at least one), unknown: {unknown}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"`peft.targets`={list(self.targets)} names a group twice")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"`peft.base_dtype`={self.base_dtype!r} must be one of {list(BASE_DTYPES)}")

    @property
    def scaling(self) -> float:
        """``alpha / rank``: the factor on ``B A x``."""
        return self.alpha / self.rank

    @classmethod
    def from_mapping(cls, values: dict[str, Any] | None) -> "LoRAConfig | None":
        """The ``peft`` group as composed (``name: none`` -> None, ``name: lora`` -> a LoRAConfig)."""
        values = dict(values or {})
        name = values.pop("name", "none")
        if name == "none":
            return None
        if name != "lora":
            raise ValueError(f"`peft.name`={name!r} must be none or lora")
        return cls(**{k: v for k, v in values.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "base_dtype": self.base_dtype}
