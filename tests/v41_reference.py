"""The independent V4.1 reference for tests: NeMo Automodel 0.7.0's ``deepseek_v41`` built tiny on CPU, well
conditioned, and its weights mapped onto dsv4's module names.

Import this module only from V4.1 reference tests (importing NeMo Automodel costs about 10 CPU-seconds).

Conditioning (the V4.1 forward rounds KV to FP8/FP4 and makes hard top-k choices, so with large random weights a
1e-6 change moves logits by O(1)): input-side projections at std ~0.15, the projections that write into the residual
streams (``wo_b``, expert and shared-expert down projections, Engram's value rows) at std 0.003, norms near 1,
random sinks, router biases and hyper-connection bases, hyper-connection projections at 0.05 (mixing logits of
std ~1: a saturated Sinkhorn gives gradients that fp32 rounding alone moves by 1e-4), embeddings and Engram tables
at std 1. :func:`build_reference` returns the reference in fp32 eval mode;
:func:`dsv4_state_dict` maps its state onto a :class:`dsv4.model.v41.model.DSV41ForCausalLM`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from dsv4.config_v41 import DSV41Config

BACKEND = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope="torch", rope_fusion=False,
                        experts="torch", dispatcher="torch")
# DSV41Config fields that are dsv4's own (training choices), not part of the released text_config
DSV4_ONLY = ("fake_quant", "engram_trainable", "mtp_loss_weight", "indexer_loss_coeff", "attention_chunk_size",
             "loss_chunk_size", "activation_checkpointing", "moe_chunk_tokens", "attention_backend", "torch_dtype",
             "num_hash_layers", "image_token_id")
INPUT_STD = 0.15  # projections reading the residual streams / the attention internals
OUTPUT_STD = 0.003  # projections writing into the residual streams
HC_FN_STD = 0.05  # hyper-connection projections (hc_mult * hidden = 256 inputs)


def reference_config(config: DSV41Config) -> DeepseekV41Config:
    """The NeMo Automodel config of ``config`` (fp32, no vision tower)."""
    text = {k: v for k, v in config.to_dict().items() if k not in DSV4_ONLY}
    return DeepseekV41Config(text_config={**text, "dtype": "float32"}, vision_config={"num_hidden_layers": 0},
                             image_token_id=config.image_token_id, dtype="float32")


@torch.no_grad()
def condition_(model: torch.nn.Module, seed: int) -> None:
    """Draw every weight of the reference ``model`` in place, well conditioned (module docstring)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("engram.wkv.weight"):  # hc_mult key blocks (read the streams' direction), then the value
            hidden = p.shape[0] // (model.config.text_config.hc_mult + 1)
            normal(p[:-hidden], INPUT_STD)
            normal(p[-hidden:], OUTPUT_STD)
        elif name.endswith(("engram.q_weight", "engram.k_weight")):
            normal(p, 0.3, 1.0)
        elif name.endswith("down_projs") or name.endswith("down_proj.weight") or name.endswith("attn.wo_b.weight"):
            normal(p, OUTPUT_STD)
        elif name.endswith("norm.weight"):
            normal(p, 0.1, 1.0)
        elif name.endswith("sinks_param.weight"):
            normal(p, 0.5)
        elif name.endswith(("e_score_correction_bias", "bias_vl")):
            normal(p, 0.05)
        elif name.endswith("hc.fn"):  # mixes of std ~1: a saturated Sinkhorn leaves fp32-noise gradients
            normal(p, HC_FN_STD)
        elif name.endswith("hc.base"):
            normal(p, 0.5)
        elif name.endswith("hc.scale"):
            normal(p, 0.1, 1.0)
        elif name.endswith(("embed_tokens.weight", "engram.embed.weight")):
            normal(p, 1.0)
        elif p.is_floating_point():
            normal(p, INPUT_STD)


def _eager_expert_activations(model: torch.nn.Module) -> None:
    """Run the reference experts' SwiGLU eagerly: the library wraps it in ``torch.compile`` (about 15 CPU-seconds
    of compilation per process); the undecorated function is the same arithmetic."""
    for module in model.modules():
        act = getattr(module, "expert_activation_grouped", None)
        if isinstance(act, functools.partial) and hasattr(act.func, "_torchdynamo_orig_callable"):
            module.expert_activation_grouped = functools.partial(act.func._torchdynamo_orig_callable, *act.args,
                                                                 **act.keywords)


ENGRAM_TEXTS = ["Hello World", "hello world", "HELLO  world", "Café café CAFÉ cafe", "naïve Naive  NAÏVE",
                "résumé Resume", "ﬁne fine", "tab\tnew\nline  ", "Straße strasse", "Ωmega ωmega"]


def engram_tokenizer():
    """A small byte-level BPE fast tokenizer (300 ids) whose normalised classes merge case / accent variants: the
    tokenizer both implementations derive the Engram class map from."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(ENGRAM_TEXTS * 3, trainers.BpeTrainer(
        vocab_size=300, min_frequency=1, special_tokens=["<s>", "</s>", "<pad>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def tiny_config(tokenizer, **overrides) -> DSV41Config:
    """``v41_tiny`` on ``tokenizer``: its vocabulary and Engram class count."""
    from dsv4.config import DSV4Config
    from dsv4.model.v41.engram_vocab import engram_class_map

    return DSV4Config.preset("v41_tiny", vocab_size=len(tokenizer),
                             engram_compressed_vocab_size=engram_class_map(tokenizer).count, **overrides)


def build_reference(config: DSV41Config, seed: int, tokenizer=None) -> DeepseekV41ForCausalLM:
    """The reference tiny V4.1 (fp32, eval) with conditioned weights drawn from ``seed`` (``tokenizer``: the fast
    tokenizer of Engram's class map, needed with Engram layers)."""
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(reference_config(config), backend=BACKEND, tokenizer=tokenizer).float().eval()
    _eager_expert_activations(model)
    condition_(model, seed)
    return model


def dsv4_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference-named tensors (weights or their gradients) under dsv4's names and layouts (``DSV41ForCausalLM``
    keys; the fused expert ``gate_and_up_projs [E, d, 2I]`` -> ``w1`` / ``w3 [E, I, d]``, ``down_projs [E, I, d]``
    -> ``w2 [E, d, I]``)."""
    out = {}
    for name, t in tensors.items():
        t = t.detach().clone()
        key = name.replace(".attn.", ".self_attn.").replace(".ffn.", ".mlp.")
        key = key.replace(".attn_norm.", ".input_layernorm.").replace(".ffn_norm.", ".post_attention_layernorm.")
        key = key.replace("self_attn.sinks_param.weight", "self_attn.sink.logits")
        key = key.replace("shared_experts.gate_proj", "shared_experts.w1").replace(
            "shared_experts.up_proj", "shared_experts.w3").replace("shared_experts.down_proj", "shared_experts.w2")
        if key.endswith("experts.gate_and_up_projs"):  # [E, d, 2I]: gate | up
            gate, up = t.chunk(2, dim=-1)
            out[key.replace("gate_and_up_projs", "w1")] = gate.transpose(1, 2).contiguous()
            out[key.replace("gate_and_up_projs", "w3")] = up.transpose(1, 2).contiguous()
            continue
        if key.endswith("experts.down_projs"):  # [E, I, d]
            out[key.replace("down_projs", "w2")] = t.transpose(1, 2).contiguous()
            continue
        out[key] = t
    return out


def dsv4_state_dict(reference: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """The reference's weights under dsv4's names (``DSV41ForCausalLM.state_dict()`` keys)."""
    return dsv4_names(reference.state_dict())


def load_into(model: torch.nn.Module, reference: DeepseekV41ForCausalLM) -> None:
    """Copy the reference's weights into the dsv4 ``model``; every parameter and persistent buffer of both is
    matched (ValueError naming the leftovers)."""
    state = dsv4_state_dict(reference)
    own = model.state_dict()
    wanted = {k for k in own if not k.endswith("expert_load")}
    missing, extra = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if missing or extra:
        raise ValueError(f"load_into: dsv4 keys without a reference weight {missing}; reference keys unused {extra}")
    bad = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in wanted if state[k].shape != own[k].shape]
    if bad:
        raise ValueError(f"load_into: shape mismatches {bad}")
    model.load_state_dict(state, strict=False)


# ------------------------------------------------------------------------------------------ the DSpark drafter
def build_drafter_reference(config: DSV41Config, seed: int, num_anchors: int):
    """NeMo Automodel 0.7.0's ``DeepseekV41DSparkModel`` of ``config`` (fp32, eval, confidence head on), its weights
    drawn as :func:`condition_` draws the backbone's, its embedding and head frozen as its trainer freezes them."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel

    torch.manual_seed(seed)
    model = DeepseekV41DSparkModel(reference_config(config).text_config, BACKEND, num_anchors=num_anchors,
                                   enable_confidence_head=True).float().eval()
    _eager_expert_activations(model)
    condition_(model, seed)
    model.initialize_embeddings_and_head(embed_tokens=model.embed_tokens, lm_head=model.lm_head)
    return model


def drafter_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference drafter tensors (weights or gradients) under dsv4's :class:`~dsv4.model.v41.drafter.DSparkDrafter`
    names (``mtp.{i}.`` -> ``layers.{i}.``, the block renames and expert layouts of :func:`dsv4_names`)."""
    return {k.replace("mtp.", "layers.", 1) if k.startswith("mtp.") else k: v for k, v in dsv4_names(tensors).items()}


@contextlib.contextmanager
def fixed_anchors(anchors: torch.Tensor):
    """Make the reference drafter run the blocks ``anchors [B, N]`` (``-1`` = unused) instead of sampling them."""
    import nemo_automodel.components.models.deepseek_v41.dspark as reference

    keep = anchors >= 0
    original = reference.sample_anchor_positions
    reference.sample_anchor_positions = lambda **_: (torch.where(keep, anchors, torch.zeros_like(anchors)), keep)
    try:
        yield
    finally:
        reference.sample_anchor_positions = original
