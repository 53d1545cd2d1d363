"""`DSV41Config`: the configuration of a DeepSeek-V4.1 text model (the ``text_config`` of a V4.1 checkpoint).

A dataclass subclass of :class:`dsv4.config.DSV4Config`: every V4 field keeps its meaning, the V4.1 fields carry
the names of the released ``text_config`` (plus ``image_token_id`` from the top level), and the defaults are the
V4.1-Flash values. ``DSV4Config.preset("v41_tiny")`` / ``("v41_flash")`` return this class; code picks the model
family from ``config.model_type`` ("deepseek_v41"), never from field checks.

Invariants enforced by ``__post_init__`` (besides the V4 ones; a violation raises ``ValueError`` naming the field
and the numbers):

* ``compress_ratios`` entries are 0, 1 or 2; ``num_hash_layers`` is 0 (V4.1 has no hash routing).
* ``kv_source_layer_ids``, ``index_source_layer_ids`` and ``engram_layer_ids`` are strictly increasing,
  non-negative and index ``compress_ratios``; every KV source is an index source; a ratio-0 layer is neither;
  every compressed backbone layer follows a KV source ("Full" layer) of its own ratio, with no layer of another
  ratio between them (it reads that source's compressed KV).
* ``candidate_source_layer_id`` is -1 (no two-level top-k) or the last KV source, with positive
  ``candidate_topk_blocks`` and ``candidate_block_size``.
* ``engram_num_embeddings`` has one positive row count per ``engram_layer_ids`` entry; with Engram layers the
  Engram dims are positive, ``engram_max_ngram_size >= 2`` and ``0 <= engram_pad_token_id < vocab_size``.
* ``qk_rope_head_dim <= index_head_dim``; ``dspark_target_layer_ids`` strictly increasing and non-negative;
  ``dspark_num_experts_per_tok <= dspark_n_routed_experts``.

Layer roles (:meth:`DSV41Config.attention_role`): ``window`` (ratio 0), ``full`` (a KV source: owns a compressor
and an indexer), ``reindex`` (an index source that is not a KV source: owns an indexer without keys), ``reuse``
(any other compressed layer: owns neither).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsv4.config import DSV4Config

V41_RATIOS = (0, 1, 2)
ATTENTION_ROLES = ("window", "full", "reindex", "reuse")

# V4.1-Flash text_config values (the released config.json).
FLASH_V41_COMPRESS_RATIOS: list[int] = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]


def _flash_v41_ratios() -> list[int]:
    return list(FLASH_V41_COMPRESS_RATIOS)


def _ids(*values: int):
    return field(default_factory=lambda: list(values))


@dataclass
class DSV41Config(DSV4Config):
    """Hyper-parameters of a DeepSeek-V4.1 text model (defaults: V4.1-Flash ``text_config``)."""

    model_type: ClassVar[str] = "deepseek_v41"

    # V4 fields whose Flash values differ in V4.1
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    q_lora_rank: int = 1280
    n_routed_experts: int = 384
    moe_intermediate_size: int = 2304
    compress_ratios: list[int] = field(default_factory=_flash_v41_ratios)
    num_hash_layers: int = 0
    index_n_heads: int = 32
    num_nextn_predict_layers: int = 3
    rms_norm_eps: float = 1e-20
    # CSA2 roles and two-level top-k
    kv_source_layer_ids: list[int] = _ids(2, 8, 14, 20)
    index_source_layer_ids: list[int] = _ids(2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # Engram
    engram_layer_ids: list[int] = _ids(1, 14)
    engram_num_embeddings: list[int] = _ids(384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark drafter (built apart from the backbone; the backbone only exposes the target features)
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = _ids(37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # top-level config.json
    image_token_id: int = 129264
    # dsv4 additions
    fake_quant: bool = True  # (DSV4Config's field, on by default here) FP8 window KV / FP4 compressed KV / FP4 index q,k
    engram_trainable: bool = False  # Engram tables (engram.embed) train; off: frozen as the peers keep them

    def __post_init__(self) -> None:
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "engram_num_embeddings",
                     "dspark_target_layer_ids"):
            setattr(self, name, [int(v) if isinstance(v, (int, float)) and int(v) == v else v
                                 for v in (getattr(self, name) or [])])
        super().__post_init__()

    def _validate(self) -> None:
        super()._validate()

        def fail(name: str, msg: str) -> None:
            raise ValueError(f"DSV41Config.{name}: {msg}")

        bad = [(i, r) for i, r in enumerate(self.compress_ratios) if r not in V41_RATIOS]
        if bad:
            fail("compress_ratios", f"V4.1 ratios are 0, 1 or 2, got (layer, ratio) {bad}")
        if self.num_hash_layers != 0:
            fail("num_hash_layers", f"V4.1 has no hash-routed layers, got {self.num_hash_layers}")
        for name in ("index_n_heads", "index_head_dim", "candidate_topk_blocks", "candidate_block_size",
                     "dspark_n_routed_experts", "dspark_num_experts_per_tok"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                fail(name, f"must be an integer >= 1, got {value!r}")
        if self.qk_rope_head_dim > self.index_head_dim:
            fail("qk_rope_head_dim", f"{self.qk_rope_head_dim} exceeds index_head_dim={self.index_head_dim}")
        if self.dspark_num_experts_per_tok > self.dspark_n_routed_experts:
            fail("dspark_num_experts_per_tok", f"{self.dspark_num_experts_per_tok} exceeds "
                 f"dspark_n_routed_experts={self.dspark_n_routed_experts}")
        n_ratios = len(self.compress_ratios)
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, name)
            if any(type(i) is not int or i < 0 for i in ids):
                fail(name, f"must hold non-negative integer layer ids, got {ids}")
            if ids != sorted(set(ids)):
                fail(name, f"must be strictly increasing, got {ids}")
            if name != "dspark_target_layer_ids" and ids and ids[-1] >= n_ratios:
                fail(name, f"layer {ids[-1]} is not covered by compress_ratios ({n_ratios} entries)")
        missing = sorted(set(self.kv_source_layer_ids) - set(self.index_source_layer_ids))
        if missing:
            fail("index_source_layer_ids", f"every KV source is an index source; missing {missing} "
                 f"(kv_source_layer_ids={self.kv_source_layer_ids})")
        sources = set(self.kv_source_layer_ids) | set(self.index_source_layer_ids)
        window_sources = sorted(i for i in sources if self.compress_ratios[i] == 0)
        if window_sources:
            fail("kv_source_layer_ids", f"ratio-0 (window-only) layers {window_sources} cannot be KV or index "
                 "sources")
        owner_ratio, owner = None, None
        for i, ratio in enumerate(self.compress_ratios[: self.num_hidden_layers]):
            if ratio == 0:
                continue
            if i in self.kv_source_layer_ids:
                owner_ratio, owner = ratio, i
            if owner_ratio != ratio:
                fail("kv_source_layer_ids", f"compressed layer {i} (ratio {ratio}) needs a preceding KV source of "
                     f"ratio {ratio}; the last KV source before it is "
                     f"{'none' if owner is None else f'layer {owner} (ratio {owner_ratio})'}")
        candidate = self.candidate_source_layer_id
        if type(candidate) is not int or candidate < -1:
            fail("candidate_source_layer_id", f"must be -1 (off) or a layer id, got {candidate!r}")
        if candidate >= 0 and candidate not in self.kv_source_layer_ids:
            fail("candidate_source_layer_id", f"layer {candidate} is not a KV source "
                 f"(kv_source_layer_ids={self.kv_source_layer_ids})")
        later = [i for i in self.kv_source_layer_ids if candidate >= 0 and i > candidate]
        if later:
            fail("candidate_source_layer_id", f"KV sources {later} come after the candidate source {candidate}: their "
                 "fresh shared state has no candidates for the index layers that follow (the last KV source or -1)")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            fail("engram_num_embeddings", f"has {len(self.engram_num_embeddings)} entries, expected one per "
                 f"engram_layer_ids entry ({len(self.engram_layer_ids)}: {self.engram_layer_ids})")
        if any(type(rows) is not int or rows < 1 for rows in self.engram_num_embeddings):
            fail("engram_num_embeddings", f"row counts must be integers >= 1, got {self.engram_num_embeddings}")
        if self.engram_layer_ids:
            for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
                value = getattr(self, name)
                if type(value) is not int or value < 1:
                    fail(name, f"must be an integer >= 1 when engram_layer_ids is set, got {value!r}")
            if self.engram_max_ngram_size < 2:
                fail("engram_max_ngram_size", f"must be >= 2 when engram_layer_ids is set, got "
                     f"{self.engram_max_ngram_size}")
            if not 0 <= self.engram_pad_token_id < self.vocab_size:
                fail("engram_pad_token_id", f"{self.engram_pad_token_id} is outside [0, vocab_size="
                     f"{self.vocab_size})")
        if self.image_token_id < 0:
            fail("image_token_id", f"must be >= 0, got {self.image_token_id}")
        for name in ("dspark_block_size", "dspark_markov_rank"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}")

    # ------------------------------------------------------------------ helpers
    def attention_role(self, layer_idx: int) -> str:
        """The CSA2 role of backbone layer ``layer_idx``: one of :data:`ATTENTION_ROLES`."""
        if self.ratio_for_layer(layer_idx) == 0:
            return "window"
        if layer_idx in self.kv_source_layer_ids:
            return "full"
        if layer_idx in self.index_source_layer_ids:
            return "reindex"
        return "reuse"

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, ignore_unknown: bool = False) -> "DSV41Config":
        """Build from a flat mapping or a nested V4.1 ``config.json`` (``text_config`` + top-level
        ``image_token_id``); unknown keys raise unless ``ignore_unknown``."""
        data = dict(data)
        if isinstance(data.get("text_config"), dict):
            top = data
            data = dict(top["text_config"])
            if "image_token_id" in top:
                data.setdefault("image_token_id", top["image_token_id"])
            if not ignore_unknown:
                extra = sorted(set(top) - {"text_config", "image_token_id"})
                if extra:
                    raise ValueError(f"DSV41Config.from_dict: unknown top-level keys {extra}")
        return super().from_dict(data, ignore_unknown=ignore_unknown)  # type: ignore[return-value]
