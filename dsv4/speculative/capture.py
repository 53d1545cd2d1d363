"""Feature capture for DSpark drafts: hooks that record what a frozen DSV4 target computes.

:class:`FeatureCapture` is a context manager over a :class:`~dsv4.model.DSV4ForCausalLM` (or its backbone
``DSV4Model``). While it is open, every backbone forward records

* ``layers[i]``: the residual streams entering block ``i``'s attention hyper-connection site for each requested
  layer id (a forward pre-hook on the causal LM's ``feature_modules(layer_ids)`` when it has them, else on the
  block: their first input ``X [B, L, hc, d]``), with the ``hc`` hyper-connection streams averaged -> ``[B, L,
  d]``. In V4 that is the block's input; in V4.1 (:class:`~dsv4.model.v41.model.DSV41ForCausalLM`) the streams
  after the layer's Engram update (the released DSpark capture point), on a backbone passed alone the block's
  input;
* ``final``: the final-norm output ``[B, L, d]`` (a forward hook on the backbone's ``norm``; the MTP blocks
  have their own norms and do not fire it).

The hooks see the tensors the backbone sees, i.e. aligned packed rows ``[B, S_al, ...]`` when the model packs;
pass the :class:`~dsv4.packing.PackedSequenceLayout` to :meth:`FeatureCapture.hidden_states` /
:meth:`FeatureCapture.last_hidden_state` to get caller coordinates ``[B, S, ...]`` (caller padding -> 0), and
:func:`split_documents` to cut caller rows into documents. Records are detached; a later forward inside the
same ``with`` replaces them. Hooks are removed on exit, also when the forward raises.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dsv4.packing import SEQ_LENS_PAD


def backbone_of(model: nn.Module) -> nn.Module:
    """The ``DSV4Model`` of a causal LM (``model.model``) or the backbone itself (has ``layers`` and ``norm``)."""
    inner = getattr(model, "model", model)
    if not (hasattr(inner, "layers") and hasattr(inner, "norm")):
        raise TypeError(f"{type(model).__name__} is neither a DSV4ForCausalLM nor a DSV4Model (no layers/norm)")
    return inner


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Non-empty, strictly increasing ints in ``[0, num_layers)``; raises ``ValueError`` naming the ids."""
    ids = [int(i) for i in layer_ids]
    if (not ids or any(i < 0 or i >= num_layers for i in ids) or any(b <= a for a, b in zip(ids, ids[1:]))
            or any(isinstance(i, bool) for i in layer_ids)):
        raise ValueError(f"DSpark target layer ids must be a non-empty, strictly increasing list of ints in "
                         f"[0, {num_layers}) (num_hidden_layers={num_layers}), got {list(layer_ids)}")
    return ids


class FeatureCapture:
    """``with FeatureCapture(model, layer_ids) as cap: model(...)``; then ``cap.hidden_states(layout)``."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        self.backbone = backbone_of(model)
        self.layer_ids = validate_layer_ids(layer_ids, len(self.backbone.layers))
        # the module whose first input is each feature: the block (V4), or its attention site after Engram (V4.1)
        features = getattr(model, "feature_modules", None)
        self.modules = features(self.layer_ids) if features else [self.backbone.layers[i] for i in self.layer_ids]
        self.layers: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self._handles: list = []

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, layer_id: int):
        def hook(_module, args):
            x = args[0]
            if x.dim() != 4:
                raise RuntimeError(f"FeatureCapture: block {layer_id} input has shape {tuple(x.shape)}, expected "
                                   "[B, L, hc, d] residual streams")
            self.layers[layer_id] = x.detach().float().mean(dim=2).to(x.dtype)
        return hook

    def _norm_hook(self, _module, _args, output):
        self.final = output.detach()

    def __enter__(self) -> "FeatureCapture":
        self.layers, self.final = {}, None
        for i, module in zip(self.layer_ids, self.modules):
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(i)))
        self._handles.append(self.backbone.norm.register_forward_hook(self._norm_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ results
    def _check(self) -> None:
        missing = [i for i in self.layer_ids if i not in self.layers]
        if missing or self.final is None:
            raise RuntimeError(f"FeatureCapture: nothing recorded for layers {missing}"
                               f"{' and the final norm' if self.final is None else ''}; run a forward inside "
                               "the `with` block")

    def hidden_states(self, layout=None) -> torch.Tensor:
        """Captured layer streams concatenated over the layer ids: ``[B, S, len(layer_ids) * d]``."""
        self._check()
        out = torch.cat([self.layers[i] for i in self.layer_ids], dim=-1)
        return out if layout is None else layout.restore(out)

    def last_hidden_state(self, layout=None) -> torch.Tensor:
        """The final-norm output ``[B, S, d]``."""
        self._check()
        return self.final if layout is None else layout.restore(self.final)


def split_documents(values: torch.Tensor, seq_lens: torch.Tensor,
                    seq_lens_padded: torch.Tensor | None = None) -> list[tuple[int, int, torch.Tensor]]:
    """Cut caller rows ``values [B, S, ...]`` into documents: ``[(row, document column, tensor [len, ...])]``.

    Document ``d`` of row ``b`` starts after the spans (``seq_lens_padded``, else the lengths) of the present
    documents before it; absent documents (0 or -1000) are skipped.
    """
    lengths = seq_lens if seq_lens.dim() == 2 else seq_lens.unsqueeze(0)
    spans = lengths if seq_lens_padded is None else (seq_lens_padded if seq_lens_padded.dim() == 2
                                                     else seq_lens_padded.unsqueeze(0))
    out = []
    for b, (row_lens, row_spans) in enumerate(zip(lengths.tolist(), spans.tolist())):
        start = 0
        for d, (n, span) in enumerate(zip(row_lens, row_spans)):
            if n in (0, SEQ_LENS_PAD):
                continue
            out.append((b, d, values[b, start:start + n]))
            start += span
    return out
