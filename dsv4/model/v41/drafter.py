"""The DSpark drafter of DeepSeek-V4.1 (``mtp.0`` - ``mtp.{n-1}`` of a release): one forward drafts a block of
``K`` tokens per anchor in parallel from the frozen target's features.

    context = main_norm(main_proj(features))                  # stage 0 owns the projection, [B, S, n*d] -> [B, S, d]
    X = embed(slot inputs) copied into hc streams              # anchor token, then noise tokens (frozen target embed)
    carry = one-hot on stream 0
    for stage in layers:                                       # num_nextn_predict_layers stages
        mix_a = attn_hc(X);  y = attn(input_layernorm(collapse(X, carry)), context)
        X = expand(X, y, mix_a.post, mix_a.comb)
        mix_f = ffn_hc(X);   y = mlp(post_attention_layernorm(collapse(X, mix_a.pre)))
        X = expand(X, y, mix_f.post, mix_f.comb);  carry = mix_f.pre
    h = norm(collapse(X, carry))                               # [B, N, K, d], the last stage's norm
    draft_logits = lm_head(h) + markov(previous token)         # fp32; lm_head: frozen copy of the target head
    confidence_logits = confidence_head(h, markov embedding)   # fp32

Every piece is the V4.1 backbone's: single-pass hyper-connections (:mod:`dsv4.model.v41.hyper_connections`), the
window attention's parameters and projections with the sparse-attention kernel
(:mod:`dsv4.model.v41.drafter_attention`), the V4.1 MoE (:class:`~dsv4.model.v41.moe.V41MoE`: routed experts
through the ``TokenDispatcher`` seam, a shared expert, the selection bias) sized by ``dspark_n_routed_experts`` /
``dspark_num_experts_per_tok``, RMSNorm; what is the drafter's own is the block layout
(:mod:`dsv4.model.v41.draft_blocks`), the heads (:mod:`dsv4.model.v41.drafter_heads`) and this orchestration.

Sizes come from the :class:`~dsv4.config_v41.DSV41Config`: ``num_nextn_predict_layers`` stages (built as layers
``num_hidden_layers + i``, whose ``compress_ratios`` entries must be 0), ``dspark_block_size`` K,
``dspark_noise_token_id``, ``dspark_markov_rank``, ``len(dspark_target_layer_ids)`` feature streams, the window
``sliding_window``. State-dict names mirror the release's (:mod:`dsv4.speculative.drafter_checkpoint` maps them):
``embed_tokens``, ``lm_head`` (frozen: ``requires_grad`` False), ``layers.{i}`` with the backbone block's names,
``layers.0.main_proj`` / ``main_norm``, and on the last stage ``norm``, ``markov_head.{embed,head}``,
``confidence_head.proj``. Each release tensor is one parameter, as it is (routed experts stacked per stage).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from dsv4.model.hyper_connections import HyperConnection
from dsv4.model.moe import GroupedExperts, MoEGate
from dsv4.model.norm import RMSNorm
from dsv4.model.upcast_linear import upcast_linear
from dsv4.model.v41.block import make_site
from dsv4.model.v41.draft_blocks import DraftBlocks
from dsv4.model.v41.drafter_attention import DraftAttentionLayout, DSparkAttention
from dsv4.model.v41.drafter_heads import ConfidenceHead, MarkovHead
from dsv4.model.v41.hyper_connections import SinglePassHyperConnection, first_carry
from dsv4.model.v41.moe import V41MoE


@dataclass
class DSparkOutput:
    """A drafter forward: ``draft_logits [B, N, K, V]`` fp32 (slot ``k`` of the block anchored at ``a`` predicts token
    ``a + k + 1``; teacher-forced Markov bias), ``confidence_logits [B, N, K]`` fp32, ``hidden [B, N, K, d]`` (the
    final-norm output), ``blocks`` (the anchors' layout) and ``head_weight [V, d]`` (the frozen head, which
    :func:`dsv4.speculative.dspark_loss` projects the target's final hidden states with)."""

    draft_logits: Tensor
    confidence_logits: Tensor
    hidden: Tensor
    blocks: DraftBlocks
    head_weight: Tensor


def drafter_moe_config(config):
    """``config`` with the drafter MoE's expert count and top-k in the backbone's fields."""
    return dataclasses.replace(config, n_routed_experts=config.dspark_n_routed_experts,
                               num_experts_per_tok=config.dspark_num_experts_per_tok)


class StageOutput(NamedTuple):
    """What a stage hands on: the streams ``[B, T, hc, d]``, the ``carry`` ``[B, T, hc]``, the projected
    ``context`` ``[B, S, d]``; the last stage adds its final-norm output ``hidden [B, T, d]`` and, given previous
    tokens, the Markov bias ``[B, T, V]``, its embedding ``[B, T, r]`` and the confidence logits ``[B, T]``."""

    streams: Tensor
    carry: Tensor
    context: Tensor
    hidden: Tensor | None = None
    markov_bias: Tensor | None = None
    markov_embedding: Tensor | None = None
    confidence: Tensor | None = None


class DSparkStage(nn.Module):
    """Stage ``stage`` of the drafter: ``forward(X [B, T, hc, d], carry [B, T, hc], context, layout, previous=None)
    -> StageOutput``. Stage 0 also holds the feature projection (its ``context`` input is the raw features ``[B, S,
    n * d]``, its output the projected ``[B, S, d]``), the last stage the final norm and the heads (applied to
    ``previous [B, T]`` when given). Each stage's own tensors are used inside its forward only, so a stage can be a
    unit of its own under FSDP."""

    def __init__(self, config, stage: int, last: bool) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        layer_idx = config.num_hidden_layers + stage
        self.attn_hc = make_site(config)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = DSparkAttention(config, layer_idx)
        self.ffn_hc = make_site(config)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = V41MoE(drafter_moe_config(config), layer_idx)
        if stage == 0:
            self.main_proj = nn.Linear(len(config.dspark_target_layer_ids) * d, d, bias=False)
            self.main_norm = RMSNorm(d, eps)
        if last:
            self.norm = RMSNorm(d, eps)
            self.markov_head = MarkovHead(config.vocab_size, config.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d, config.dspark_markov_rank)

    def forward(self, x: Tensor, carry: Tensor, context: Tensor, layout: DraftAttentionLayout,
                previous: Tensor | None = None) -> StageOutput:
        if hasattr(self, "main_proj"):
            proj = self.main_proj  # the target's features in the projection's compute dtype (bf16 under FSDP2's
            context = self.main_norm(proj(context.detach().to(proj.weight.dtype)))  # mixed precision)
        mix_a = self.attn_hc(x)
        y = self.self_attn(self.input_layernorm(self.attn_hc.collapse(x, carry)), context, layout)
        x = self.attn_hc.expand(x, y, mix_a.post, mix_a.comb)
        mix_f = self.ffn_hc(x)
        y = self.mlp(self.post_attention_layernorm(self.ffn_hc.collapse(x, mix_a.pre)))
        x, carry = self.ffn_hc.expand(x, y, mix_f.post, mix_f.comb), mix_f.pre
        if not hasattr(self, "norm"):
            return StageOutput(x, carry, context)
        hidden = self.norm(SinglePassHyperConnection.collapse(x, carry))
        if previous is None:
            return StageOutput(x, carry, context, hidden)
        bias, embedding = self.markov_head(previous)
        return StageOutput(x, carry, context, hidden, bias, embedding, self.confidence_head(hidden, embedding))


def check_drafter_config(config) -> None:
    """``ValueError`` naming the field when ``config`` cannot build a drafter."""
    if getattr(config, "model_type", None) != "deepseek_v41":
        raise ValueError(f"DSparkDrafter needs a DSV41Config (model_type 'deepseek_v41'), got {type(config).__name__}")
    stages = config.num_nextn_predict_layers
    if stages < 1:
        raise ValueError(f"DSparkDrafter: num_nextn_predict_layers (the drafter's stages) must be >= 1, got {stages}")
    need = config.num_hidden_layers + stages
    ratios = config.compress_ratios
    if len(ratios) < need or any(ratios[config.num_hidden_layers:need]):
        raise ValueError(f"DSparkDrafter: compress_ratios needs {need} entries whose last {stages} (the drafter's "
                         f"stages) are 0, got {ratios}")
    if not config.dspark_target_layer_ids:
        raise ValueError("DSparkDrafter: dspark_target_layer_ids is empty (the drafter reads at least one feature)")
    if config.dspark_block_size < 1:
        raise ValueError(f"DSparkDrafter: dspark_block_size must be >= 1, got {config.dspark_block_size}")
    if not 0 <= config.dspark_noise_token_id < config.vocab_size:
        raise ValueError(f"DSparkDrafter: dspark_noise_token_id={config.dspark_noise_token_id} is outside "
                         f"[0, vocab_size={config.vocab_size})")
    if config.dspark_markov_rank < 1:
        raise ValueError(f"DSparkDrafter: dspark_markov_rank must be >= 1, got {config.dspark_markov_rank}")


class DSparkDrafter(nn.Module):
    """The drafter (module docstring): ``forward(input_ids [B, S], target_hidden_states [B, S, n*d], anchors [B, N],
    position_ids=None, packed_seq_ids=None) -> DSparkOutput``."""

    checkpoint_family = "deepseek_v41_dspark"  # its keys in a release: dsv4.checkpoint.keys.DSPARK

    def __init__(self, config) -> None:
        super().__init__()
        check_drafter_config(config)
        self.config = config
        stages = config.num_nextn_predict_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DSparkStage(config, i, i == stages - 1) for i in range(stages))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A fresh drafter: linear, embedding and expert weights ~ N(0, initializer_range), norms 1, sinks and
        router biases 0, hyper-connections as the backbone's (NeMo Automodel's random initialisation)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, (RMSNorm, GroupedExperts, MoEGate, HyperConnection)):
                module.reset_parameters()
        for stage in self.layers:
            stage.self_attn.sink.logits.zero_()
            stage.mlp.gate.bias_vl.zero_()

    @property
    def block_size(self) -> int:
        return self.config.dspark_block_size

    @property
    def last(self) -> DSparkStage:
        return self.layers[-1]

    def copy_target_embeddings(self, target: nn.Module) -> None:
        """Copy the target causal LM's embedding and head into the drafter's frozen copies."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            self.lm_head.weight.copy_(target.lm_head.weight)

    def _check_inputs(self, input_ids: Tensor, target_hidden_states: Tensor) -> None:
        width = len(self.config.dspark_target_layer_ids) * self.config.hidden_size
        if input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"DSparkDrafter: input_ids must be int64 [B, S], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        if tuple(target_hidden_states.shape) != (*input_ids.shape, width):
            raise ValueError(f"DSparkDrafter: target_hidden_states must be [B, S, {width}] (B, S of input_ids "
                             f"{list(input_ids.shape)}; {len(self.config.dspark_target_layer_ids)} feature streams x "
                             f"hidden {self.config.hidden_size}), got {list(target_hidden_states.shape)}")

    def _stages(self, input_ids: Tensor, target_hidden_states: Tensor, blocks: DraftBlocks,
                position_ids: Tensor | None, packed_seq_ids: Tensor | None, previous: Tensor | None,
                context_halo=None) -> StageOutput:
        """Every stage over the blocks; the last stage's output (``previous [B, N, K]``: its heads' input)."""
        self._check_inputs(input_ids, target_hidden_states)
        b, s = input_ids.shape
        n, k = blocks.anchors.shape[1], blocks.block_size
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        layout = DraftAttentionLayout.build(self.config, blocks, position_ids, packed_seq_ids, context_halo)
        h = self.embed_tokens(blocks.input_tokens(input_ids, self.config.dspark_noise_token_id))  # [B, N*K, d]
        x = h.unsqueeze(-2).expand(b, n * k, self.config.hc_mult, h.shape[-1])
        out = StageOutput(x, first_carry(x), target_hidden_states)
        for i, stage in enumerate(self.layers):
            last = i == len(self.layers) - 1
            out = stage(out.streams, out.carry, out.context, layout,
                        previous.view(b, n * k) if last and previous is not None else None)
        return out

    def draft_hidden(self, input_ids: Tensor, target_hidden_states: Tensor, blocks: DraftBlocks,
                     position_ids: Tensor | None = None, packed_seq_ids: Tensor | None = None) -> Tensor:
        """The last stage's final-norm output of every slot, ``[B, N, K, d]`` (the target features are detached)."""
        out = self._stages(input_ids, target_hidden_states, blocks, position_ids, packed_seq_ids, None)
        b, n = blocks.anchors.shape
        return out.hidden.view(b, n, blocks.block_size, -1)

    def base_logits(self, hidden: Tensor) -> Tensor:
        """The frozen head over ``hidden [..., d]`` in fp32 -> ``[..., V]`` (a bf16 head upcast a block of rows at a
        time: :func:`~dsv4.model.upcast_linear.upcast_linear`)."""
        return upcast_linear(hidden, self.lm_head.weight)

    def forward(self, input_ids: Tensor, target_hidden_states: Tensor, anchors: Tensor, *,
                position_ids: Tensor | None = None, packed_seq_ids: Tensor | None = None,
                context_halo=None) -> DSparkOutput:
        """Teacher-forced drafts of the blocks at ``anchors`` (:mod:`dsv4.model.v41.draft_blocks`).

        Args:
            input_ids: ``[B, S]`` int64 target tokens.
            target_hidden_states: ``[B, S, n * d]``: the target's residual streams entering each of
                ``dspark_target_layer_ids``' attention site, hyper-connection streams averaged, concatenated.
            anchors: ``[B, N]`` int64, ``-1`` = no block in that slot.
            position_ids: ``[B, S]`` positions of the target tokens (default ``arange(S)``; packed rows:
                document-local).
            packed_seq_ids: ``[B, S]`` document ids of packed rows: a block's context stays in its anchor's document.
            context_halo: under context parallelism, the rows are this rank's chunk extended on both sides and the
                :class:`~dsv4.model.v41.drafter_attention.ContextHalo` completes the context before it
                (:mod:`dsv4.parallel.dspark_cp` builds both); None on one rank.
        """
        blocks = DraftBlocks.from_anchors(anchors, self.block_size, input_ids.shape[1])
        out = self._stages(input_ids, target_hidden_states, blocks, position_ids, packed_seq_ids,
                           blocks.previous_tokens(input_ids), context_halo)
        b, n, k = *blocks.anchors.shape, blocks.block_size
        hidden = out.hidden.view(b, n, k, -1)
        return DSparkOutput(
            draft_logits=self.base_logits(hidden) + out.markov_bias.float().view(b, n, k, -1),
            confidence_logits=out.confidence.view(b, n, k),
            hidden=hidden,
            blocks=blocks,
            head_weight=self.lm_head.weight,
        )
