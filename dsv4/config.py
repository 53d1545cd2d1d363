"""`DSV4Config`: the one configuration dataclass of a DeepSeek-V4-family model.

Field names follow the Hugging Face ``config.json`` of the released checkpoints; the defaults are the V4 Flash
values as released (YaRN compress rope and the 43-entry ``compress_ratios`` of the Flash checkpoint). The named
presets (:data:`PRESETS`, ``DSV4Config.preset(name)``, V4 and V4.1 alike) are defined here and only here:
``conf/model/*.yaml`` select one by name. The model family is the class attribute ``model_type`` ("deepseek_v4";
:class:`dsv4.config_v41.DSV41Config`: "deepseek_v41"); :func:`config_class` maps it back to the class.

Invariants enforced by ``__post_init__`` (a violation raises ``ValueError`` naming the field and the numbers):

* ``compress_ratios`` holds one non-negative int per backbone layer (an empty list means "all 0" and is
  normalised to ``[0] * num_hidden_layers``); it may carry up to ``num_nextn_predict_layers`` extra entries for
  the MTP blocks. A layer beyond the list reads ratio 0 (``ratio_for_layer``).
* ``head_dim`` and ``qk_rope_head_dim`` are even and ``0 < qk_rope_head_dim <= head_dim`` (RoPE acts on the last
  ``qk_rope_head_dim`` dims as interleaved pairs).
* When any layer has ratio 4 (CSA) the indexer dims are usable: ``index_head_dim`` even and
  ``>= qk_rope_head_dim``, ``index_n_heads >= 1``.
* ``num_attention_heads % o_groups == 0``; ``num_experts_per_tok <= n_routed_experts``;
  ``num_hash_layers <= num_hidden_layers``; only a single shared K=V head (``num_key_value_heads == 1``) and untied
  embeddings are supported.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Iterable

SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
TOPK_METHODS = ("noaux_tc", "greedy")
TORCH_DTYPES = ("float32", "bfloat16", "float16")
CHECKPOINTING_MODES = ("none", "block", "selective")  # dsv4.model.recompute

# Flash checkpoint values (its config.json).
FLASH_ROPE_SCALING: dict[str, Any] = {
    "type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
FLASH_COMPRESS_RATIOS: list[int] = [0, 0] + [4, 128] * 20 + [4]


def shard_multiple(compress_ratios: Iterable[int]) -> int:
    """The shard multiple: lcm of the non-zero compress ratios, ratio 4 counted as 8 (1 when there are none).

    Every packed document starts on a multiple of it and every CP shard is a multiple of it, so no compressor
    window straddles a document or a rank boundary. Ratio-4 (CSA) layers pool the previous window too, hence 8.
    V4 Flash (ratios 4 and 128): 128; V4.1-style ratios {2, 1}: 2.
    """
    multiple = 1
    for ratio in compress_ratios:
        r = int(ratio)
        if r > 0:
            multiple = math.lcm(multiple, 2 * r if r == 4 else r)
    return multiple


def check_cp_length(length: int, cp_size: int, multiple: int, what: str = "seq_len") -> None:
    """The one length rule of context parallelism: ``length`` is a positive multiple of ``cp_size * multiple``.

    Raises ``ValueError`` naming ``what``, the numbers and the nearest valid length.
    """
    step = cp_size * multiple
    if length < 1 or length % step:
        nearest = max(1, round(length / step)) * step
        raise ValueError(
            f"`{what}`={length} must be a positive multiple of cp x shard multiple = {cp_size} x {multiple} = "
            f"{step} (the shard multiple is the lcm of model.compress_ratios, ratio 4 counted as 8); e.g. "
            f"{what}={nearest}"
        )


def _flash_rope_scaling() -> dict[str, Any]:
    return dict(FLASH_ROPE_SCALING)


def _flash_compress_ratios() -> list[int]:
    return list(FLASH_COMPRESS_RATIOS)


@dataclass
class DSV4Config:
    """Hyper-parameters of a DSV4 model (defaults: V4 Flash)."""

    # The model family (the ``model_type`` of the checkpoint's config.json); subclasses name theirs.
    model_type: ClassVar[str] = "deepseek_v4"

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = field(default_factory=_flash_rope_scaling)
    compress_ratios: list[int] = field(default_factory=_flash_compress_ratios)
    sliding_window: int = 128
    num_hash_layers: int = 3
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    index_head_dim: int = 128
    index_n_heads: int = 64
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    # dsv4 additions (not in the reference config)
    mtp_loss_weight: float = 0.1  # weight of the MTP loss (the DeepSeek-V3/V4 reports' default)
    # KL of the CSA indexer against the main attention (dsv4.model.indexer_loss); > 0 trains the indexer
    indexer_loss_coeff: float = 0.0
    attention_chunk_size: int = 256
    loss_chunk_size: int = 1024  # rows per [rows, vocab] logits block of the chunked loss (return_logits=False)
    activation_checkpointing: str = "none"  # none | block | selective (dsv4.model.recompute)
    # routed-expert rows per chunk (dsv4.model.moe): > 0 recomputes each chunk's SwiGLU + W2 in backward; 0 = one piece
    moe_chunk_tokens: int = 0
    attention_backend: str = "auto"  # auto or a registered backend: torch | triton (dsv4.model.attention_backend)
    # the served KV / indexer numerics in training, straight-through (dsv4.model.fake_quant): V4 rounds the window and
    # compressed KV to FP8 and the (Hadamard-rotated) indexer queries / keys to FP4; V4.1 (default on) its own formats
    fake_quant: bool = False

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        # Hydra/OmegaConf hand in ListConfig/DictConfig; normalise to plain Python containers.
        self.compress_ratios = [int(r) for r in (self.compress_ratios or [])]
        if not self.compress_ratios:
            self.compress_ratios = [0] * int(self.num_hidden_layers)
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"DSV4Config.{name}: {msg}")

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "max_position_embeddings", "sliding_window", "hc_mult",
            "hc_sinkhorn_iters", "index_topk", "attention_chunk_size", "loss_chunk_size",
        ):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                fail(name, f"must be an integer >= 1, got {value!r}")
        for name in ("n_shared_experts", "num_hash_layers", "num_nextn_predict_layers", "moe_chunk_tokens"):
            value = getattr(self, name)
            if int(value) != value or value < 0:
                fail(name, f"must be an integer >= 0, got {value!r}")
        for name in ("rope_theta", "compress_rope_theta", "rms_norm_eps", "initializer_range", "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                fail(name, f"must be > 0, got {getattr(self, name)!r}")
        if self.hc_eps < 0:
            fail("hc_eps", f"must be >= 0, got {self.hc_eps}")
        if self.mtp_loss_weight < 0:
            fail("mtp_loss_weight", f"must be >= 0, got {self.mtp_loss_weight}")
        if not self.indexer_loss_coeff >= 0:
            fail("indexer_loss_coeff", f"must be >= 0, got {self.indexer_loss_coeff}")
        if not self.swiglu_limit > 0:
            fail("swiglu_limit", f"must be > 0, got {self.swiglu_limit}")

        if self.num_key_value_heads != 1:
            fail("num_key_value_heads", f"only one shared K=V head is supported, got {self.num_key_value_heads}")
        if self.head_dim % 2:
            fail("head_dim", f"must be even (RoPE pairs), got {self.head_dim}")
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            fail("qk_rope_head_dim", f"must be even and in [2, head_dim={self.head_dim}], got {self.qk_rope_head_dim}")
        if self.num_attention_heads % self.o_groups:
            fail("o_groups", f"num_attention_heads={self.num_attention_heads} is not divisible by o_groups={self.o_groups}")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail(
                "num_experts_per_tok",
                f"{self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}",
            )
        if self.num_hash_layers > self.num_hidden_layers:
            fail("num_hash_layers", f"{self.num_hash_layers} exceeds num_hidden_layers={self.num_hidden_layers}")
        if self.scoring_func not in SCORING_FUNCS:
            fail("scoring_func", f"must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.topk_method not in TOPK_METHODS:
            fail("topk_method", f"must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.norm_topk_prob is not True:
            fail("norm_topk_prob", f"must be true, got {self.norm_topk_prob!r}: DeepSeek's reference and transformers "
                 "always renormalise the top-k routing weights (the release sets it true); dsv4 follows them")
        if self.hidden_act != "silu":
            fail("hidden_act", f"only 'silu' (clamped SwiGLU) is supported, got {self.hidden_act!r}")
        if self.activation_checkpointing not in CHECKPOINTING_MODES:
            fail("activation_checkpointing", f"must be one of {CHECKPOINTING_MODES}, got "
                 f"{self.activation_checkpointing!r}")
        from dsv4.model.attention_backend import ATTENTION_BACKENDS, AUTO  # noqa: PLC0415 - beside the kernels

        backends = (AUTO, *ATTENTION_BACKENDS.names())
        if self.attention_backend not in backends:
            fail("attention_backend", f"must be one of {backends}, got {self.attention_backend!r}")
        if self.torch_dtype not in TORCH_DTYPES:
            fail("torch_dtype", f"must be one of {TORCH_DTYPES}, got {self.torch_dtype!r}")
        if not isinstance(self.fake_quant, bool):
            fail("fake_quant", f"must be true or false, got {self.fake_quant!r}")
        if self.tie_word_embeddings:
            fail("tie_word_embeddings", "only untied embeddings are supported (got True)")

        n, mtp, got = self.num_hidden_layers, self.num_nextn_predict_layers, len(self.compress_ratios)
        if not n <= got <= n + mtp:
            fail(
                "compress_ratios",
                f"has {got} entries, expected num_hidden_layers={n} (or up to {n + mtp} with one extra entry per "
                f"MTP layer); an empty list means all 0",
            )
        bad = [(i, r) for i, r in enumerate(self.compress_ratios) if r < 0]
        if bad:
            fail("compress_ratios", f"ratios must be >= 0, got (layer, ratio) {bad}")
        if 4 in self.compress_ratios:
            if self.index_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
                fail(
                    "index_head_dim",
                    f"must be even and >= qk_rope_head_dim={self.qk_rope_head_dim} when a layer has ratio 4, "
                    f"got {self.index_head_dim}",
                )
            if self.index_n_heads < 1:
                fail("index_n_heads", f"must be >= 1 when a layer has ratio 4, got {self.index_n_heads}")
            if self.fake_quant and self.index_head_dim & (self.index_head_dim - 1):
                fail("index_head_dim", f"must be a power of two with fake_quant (the indexer's Hadamard rotation), "
                     f"got {self.index_head_dim}")

        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind != "yarn":
                fail("rope_scaling", f"only YaRN scaling is supported, got type {kind!r}")
            factor = self.rope_scaling.get("factor")
            orig = self.rope_scaling.get("original_max_position_embeddings")
            if factor is None or not factor > 0:
                fail("rope_scaling", f"'factor' must be > 0, got {factor!r}")
            if orig is None or not orig > 0:
                fail("rope_scaling", f"'original_max_position_embeddings' must be > 0, got {orig!r}")

    # ------------------------------------------------------------------ helpers
    def ratio_for_layer(self, layer_idx: int) -> int:
        """Compress ratio of layer ``layer_idx``; MTP layers (index >= num_hidden_layers) beyond the list read 0."""
        if layer_idx < 0:
            raise ValueError(f"DSV4Config.ratio_for_layer: layer_idx must be >= 0, got {layer_idx}")
        if layer_idx < len(self.compress_ratios):
            return self.compress_ratios[layer_idx]
        return 0

    @property
    def active_ratios(self) -> list[int]:
        """Sorted distinct ratios > 0 over the backbone and the MTP layers."""
        total = self.num_hidden_layers + self.num_nextn_predict_layers
        return sorted({self.ratio_for_layer(i) for i in range(total)} - {0})

    @property
    def shard_multiple(self) -> int:
        """Where documents and CP shards start: :func:`shard_multiple` of ``compress_ratios``."""
        return shard_multiple(self.compress_ratios)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, ignore_unknown: bool = False) -> "DSV4Config":
        """Build from a mapping; unknown keys raise unless ``ignore_unknown`` (e.g. for an HF ``config.json``).

        ``compress_rates`` (the transformers built-in spelling) is accepted as an alias of ``compress_ratios``.
        """
        data = dict(data)
        if "compress_rates" in data and "compress_ratios" not in data:
            data["compress_ratios"] = data.pop("compress_rates")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown and not ignore_unknown:
            raise ValueError(f"DSV4Config.from_dict: unknown keys {unknown}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.model_type in CONFIG_CLASSES and not issubclass(cls, CONFIG_CLASSES[cls.model_type]):
            raise TypeError(f"{cls.__name__}: model_type {cls.model_type!r} is already {CONFIG_CLASSES[cls.model_type]}")
        CONFIG_CLASSES.setdefault(cls.model_type, cls)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "DSV4Config":
        """A named configuration of :data:`PRESETS`, as the config class of its family (:data:`PRESET_MODEL_TYPES`):
        ``"tiny"`` (CPU tests), ``"flash"`` (V4 Flash), ``"pro"`` (V4 Pro), ``"v4_ratio2_tiny"`` (the V4 model with
        compress ratios 2 and 1: packing alignment 2) are :class:`DSV4Config`; ``"v41_tiny"`` (CPU) and
        ``"v41_flash"`` (the released V4.1-Flash text config) are :class:`dsv4.config_v41.DSV41Config`.

        ``overrides`` replace preset values; a key the family's config does not have raises ``ValueError``."""
        if name not in PRESETS:
            raise ValueError(f"DSV4Config.preset: unknown preset {name!r}, expected one of {sorted(PRESETS)}")
        target = config_class(PRESET_MODEL_TYPES.get(name, DSV4Config.model_type))
        if not issubclass(target, cls):
            raise ValueError(f"{cls.__name__}.preset: preset {name!r} is a {target.model_type} config "
                             f"({target.__name__}); call DSV4Config.preset({name!r})")
        values = dict(PRESETS[name])
        values.update(overrides)
        names = {f.name for f in fields(target)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"DSV4Config.preset: {unknown} are not fields of {target.__name__} "
                             f"(preset {name!r}, model_type {target.model_type!r})")
        return target(**values)


# model_type -> config class; filled by DSV4Config and its family subclasses as they are defined.
CONFIG_CLASSES: dict[str, type[DSV4Config]] = {DSV4Config.model_type: DSV4Config}


def config_class(model_type: str) -> type[DSV4Config]:
    """The config class of a model family by its ``model_type`` ("deepseek_v4", "deepseek_v41"; a family registers
    itself by subclassing :class:`DSV4Config` with its own ``model_type``, and ``dsv4/__init__.py`` imports every
    family's config module)."""
    if model_type not in CONFIG_CLASSES:
        raise ValueError(f"config_class: unknown model_type {model_type!r}, expected one of {sorted(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[model_type]

_TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "o_groups": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 1024,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "compress_ratios": [0, 4, 128, 4],
    "sliding_window": 16,
    "num_hash_layers": 1,
    "hc_mult": 4,
    "index_head_dim": 32,
    "index_n_heads": 2,
    "index_topk": 8,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "float32",
    "attention_chunk_size": 64,
}


PRESETS: dict[str, dict[str, Any]] = {
    "flash": {},
    # Pro: the model card states only 384 routed / 1 shared / 6 per token; every other value below comes
    # from third-party descriptions (not authoritative, not verified against a released config.json). "Layers 0-1 HCA then CSA/HCA interleaved" -> [128, 128] + [4, 128, 4, ...].
    "pro": {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "head_dim": 512,
        "q_lora_rank": 1536,
        "o_lora_rank": 1024,
        "o_groups": 16,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 3072,
        "index_topk": 1024,
        "num_nextn_predict_layers": 1,
        "compress_ratios": [128, 128] + [4 if i % 2 == 0 else 128 for i in range(59)],
    },
    # Trains on a 2-core CPU: every layer kind (SWA 0, CSA 4, HCA 128) and the CP shard multiple
    # lcm(8, 128) = 128 are exercised; sliding_window 16 keeps the band small.
    "tiny": _TINY,
    # The V4 model with V4.1-style compress ratios on the tiny shapes: ratio 2 and ratio 1 layers (V4's
    # non-overlapping compressors, no CSA indexer), so the document alignment / CP shard multiple is lcm(2, 1) = 2
    # instead of 128. Not V4.1 (that is "v41_tiny"): no CSA2 roles, Engram or single-pass hyper-connections.
    "v4_ratio2_tiny": {**_TINY, "compress_ratios": [0, 2, 2, 1], "num_hash_layers": 0},
    # DeepSeek-V4.1 (DSV41Config): the released V4.1-Flash text config (its defaults); meta device / plan only.
    "v41_flash": {},
    # DeepSeek-V4.1 on CPU (DSV41Config): the tiny public V4.1 fixture's shapes. Roles: window-only 0, 1;
    # Full 2, 4, 6 (6 is the candidate source: 3 blocks of 2 compressed positions); Reindex 8, 10 (inside the
    # candidates); Reuse 3, 5 (ratio 2) and 7, 9, 11 (ratio 1); Engram at 1 and 4 (its rows: 6 primes > 50 each; its
    # classes those of the byte tokenizer, 227, so the recipe trains it on the default data);
    # the last three ratio entries are the DSpark layers (targets 9, 10, 11).
    "v41_tiny": {
        "vocab_size": 384,
        "hidden_size": 64,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 16,
        "o_lora_rank": 8,
        "o_groups": 2,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "max_position_embeddings": 1024,
        "rope_scaling": dict(_TINY["rope_scaling"]),
        "sliding_window": 4,
        "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        "rms_norm_eps": 1e-6,
        "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8, 10],
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 4,
        "candidate_source_layer_id": 6,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 2,
        "engram_layer_ids": [1, 4],
        "engram_num_embeddings": [384, 552],
        "engram_vocab_size": 50,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_compressed_vocab_size": 227,  # dsv4's byte tokenizer (the recipe's default data)
        "num_nextn_predict_layers": 3,
        "dspark_target_layer_ids": [9, 10, 11],
        "dspark_noise_token_id": 382,
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 8,
        "dspark_num_experts_per_tok": 2,
        "image_token_id": 383,
        "torch_dtype": "float32",
        "attention_chunk_size": 64,
    },
}

# The family of each preset that is not a V4 config (dsv4.config.config_class).
PRESET_MODEL_TYPES: dict[str, str] = {"v41_flash": "deepseek_v41", "v41_tiny": "deepseek_v41"}
