"""`DSV41Model` (embedding -> V4.1 blocks -> final collapse -> norm) and `DSV41ForCausalLM` (+ fp32 lm_head, loss).

``DSV41ForCausalLM`` has the public call signature and output of :class:`dsv4.model.model.DSV4ForCausalLM`
(``input_ids, position_ids, packed_seq_ids, padding_mask, cp, labels``, ``seq_lens=`` rows of back-to-back
documents, ``return_logits``, ``logits_to_keep`` -> :class:`~dsv4.model.model.DSV4Output`), through the shared
:class:`~dsv4.model.model.CausalLM`. Differences from V4:

* blocks are :class:`~dsv4.model.v41.block.DSV41Block`: CSA2 attention roles with a shared per-forward state,
  single-pass hyper-connections (the first block reads stream 0, the final collapse uses the last FFN site's
  ``pre``; no hyper-head), Engram at ``engram_layer_ids``;
* no MTP depths: V4.1's DSpark layers (``mtp.*`` in the release, the last ``compress_ratios`` entries) are a
  separate drafter, not part of this backbone (``mtp_logits`` stays empty);
* text only: a token equal to ``config.image_token_id`` raises ``ValueError`` (no vision tower);
* Engram hashes n-grams through the checkpoint tokenizer's class map: ``DSV41ForCausalLM(config, tokenizer=...)``
  or :meth:`DSV41ForCausalLM.set_engram_tokenizer` before the first forward of a config with Engram layers;
* context parallelism (``cp``, contiguous or balanced layout) through the same
  :class:`~dsv4.model.context_parallel.ContextParallel` seam as V4: the attention metadata plans the forward's
  routes once; every layer's window halo and each Full layer's compressed rows and index keys travel as described
  in :mod:`dsv4.model.v41.attention`; Engram's n-gram history is a halo of ``engram_max_ngram_size - 1`` token ids
  per chunk that continues a document (``engram_ids``, :func:`~dsv4.model.v41.engram_hash.engram_history_tail`),
  never the sequence; a local chunk shorter than that history is refused (ValueError) before any exchange.

Module names follow V4's (``model.embed_tokens``, ``model.layers.{i}``, ``model.norm``, ``lm_head``).
:meth:`DSV41ForCausalLM.feature_modules` names the modules whose first forward input is a DSpark target feature
(the streams entering a layer's attention site, after its Engram update).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.attention_metadata import AttentionMetadata, build_attention_metadata
from dsv4.model.context_parallel import ContextParallel, is_parallel
from dsv4.model.inputs import ModelInputs
from dsv4.model.model import BackboneOutput, CausalLM
from dsv4.model.norm import RMSNorm
from dsv4.model.v41.block import DSV41Block
from dsv4.model.v41.engram_hash import EngramHashing, engram_history_from_tail, engram_history_tail
from dsv4.model.v41.hyper_connections import SinglePassHyperConnection, first_carry


class DSV41Model(nn.Module):
    """Backbone: ``forward(input_ids [B, L], meta, engram_inputs, cp) -> BackboneOutput`` (``streams``: the last
    block's streams ``[B, L, hc, d]``)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DSV41Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, engram_inputs=None,
                cp: ContextParallel | None = None) -> BackboneOutput:
        x, carry = self.embed(input_ids)
        state = None
        for layer in self.layers:
            x, carry, state = layer(x, carry, state, meta, engram_inputs, cp)
        return BackboneOutput(hidden=self.finish(x, carry), streams=x)

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [B, L]`` -> the first block's streams ``[B, L, hc, d]`` (the embedding, hc times) and carry
        ``[B, L, hc]`` (one-hot on stream 0)."""
        h = self.embed_tokens(input_ids)
        x = h.unsqueeze(-2).expand(*h.shape[:-1], self.config.hc_mult, h.shape[-1])
        return x, first_carry(x)

    def finish(self, x: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
        """The last block's streams and carry -> the final-normed hidden ``[B, L, d]``."""
        return self.norm(SinglePassHyperConnection.collapse(x, carry))


class DSV41ForCausalLM(CausalLM):
    """DeepSeek-V4.1 backbone + fp32 lm_head + token-sum CE loss. See the module docstring."""

    def __init__(self, config, tokenizer=None) -> None:
        super().__init__()
        if getattr(config, "model_type", None) != "deepseek_v41":
            raise ValueError(f"DSV41ForCausalLM needs a DSV41Config (model_type 'deepseek_v41'), got "
                             f"{type(config).__name__} ({getattr(config, 'model_type', None)!r})")
        if config.indexer_loss_coeff:
            raise ValueError(f"DSV41ForCausalLM: indexer_loss_coeff={config.indexer_loss_coeff} is not supported for "
                             "V4.1 (its indexer is frozen, as in the released training code); set it to 0")
        self.config = config
        self.model = DSV41Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for layer in self.model.layers:
            if layer.engram is not None:
                layer.engram.reset_parameters()
        self.engram_hashing: EngramHashing | None = None
        self._hashing_on: dict[torch.device, EngramHashing] = {}
        if tokenizer is not None:
            self.set_engram_tokenizer(tokenizer)

    def set_engram_tokenizer(self, tokenizer) -> None:
        """Hash Engram n-grams with ``tokenizer``'s class map (the checkpoint's tokenizer; ValueError when its
        class count is not ``engram_compressed_vocab_size`` or the table rows do not match, naming both)."""
        if self.config.engram_layer_ids:
            self.engram_hashing = EngramHashing.build(self.config, tokenizer)
            self._hashing_on = {}

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)

    def feature_modules(self, layer_ids: list[int]) -> list[nn.Module]:
        """The modules whose first forward input is the DSpark target feature of each of ``layer_ids``: the
        streams ``[B, L, hc, d]`` entering the layer's attention site (``layers[i].attn_hc``), after its Engram."""
        n = len(self.model.layers)
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"feature_modules: layer ids {bad} outside [0, {n})")
        return [self.model.layers[i].attn_hc for i in layer_ids]

    def _hidden_states(self, inputs: ModelInputs) -> tuple[torch.Tensor, list[torch.Tensor], list | None, list]:
        cp = inputs.cp if is_parallel(inputs.cp) else None
        reach = self.config.engram_max_ngram_size - 1
        if cp is not None and self.config.engram_layer_ids and inputs.input_ids.shape[1] < reach:
            raise ValueError(f"DSV41ForCausalLM: each local chunk has {inputs.input_ids.shape[1]} tokens but Engram's "
                             f"history needs the previous engram_max_ngram_size - 1 = {reach} token ids from one chunk; "
                             f"use fewer CP ranks ({cp.size}) or a longer sequence")
        image = inputs.input_ids == self.config.image_token_id
        if image.any():
            raise ValueError(f"DSV41ForCausalLM trains text only: input_ids hold image_token_id="
                             f"{self.config.image_token_id} at {int(image.sum())} positions")
        meta = build_attention_metadata(self.config, inputs.position_ids, inputs.seq_ids, inputs.padding, inputs.cp)
        backbone = self.model(inputs.input_ids, meta, self.engram_inputs(inputs, meta), cp)
        return backbone.hidden, [], None, []

    def engram_inputs(self, inputs: ModelInputs, meta: AttentionMetadata | None = None
                      ) -> tuple[dict[int, torch.Tensor], torch.Tensor] | None:
        """What every Engram layer of this forward reads, hashed once: ``({layer_id: ngram_ids [B, L, n_buckets]},
        active [B, L])`` (history stops at row starts, documents and padding); None without Engram layers. Under
        CP (``meta.routes`` planned) each chunk's history is the last ``engram_max_ngram_size - 1`` token ids of
        the chunk whose document it continues, received through the halo route (kind ``engram_ids``)."""
        if not self.config.engram_layer_ids:
            return None
        if self.engram_hashing is None:
            raise ValueError(f"DSV41ForCausalLM: Engram layers {self.config.engram_layer_ids} hash n-grams through the "
                             "checkpoint tokenizer's class map; pass tokenizer= when building the model or call "
                             "model.set_engram_tokenizer(tokenizer)")
        device = inputs.input_ids.device
        if device not in self._hashing_on:
            self._hashing_on[device] = self.engram_hashing.to(device)
        hashing = self._hashing_on[device]
        history = None
        if meta is not None and meta.routes is not None:
            reach = self.config.engram_max_ngram_size - 1
            tail = engram_history_tail(inputs.input_ids, inputs.seq_ids, inputs.padding, reach)
            received = inputs.cp.halo_exchange(tail, reach, dim=1, kind="engram_ids", route=meta.routes.halo)
            history = engram_history_from_tail(received, inputs.seq_ids)
        return hashing(inputs.input_ids, packed_seq_ids=inputs.seq_ids, padding_mask=inputs.padding, history=history)
