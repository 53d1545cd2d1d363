"""Mixture-of-experts FFN: routed experts + shared expert(s), clamped SwiGLU.

Shapes: ``MoE.forward(x [B, L, d], input_ids [B, L] | None, padding_mask [B, L] | None) -> [B, L, d]``.

Routing (:class:`MoEGate`), all in fp32:

* scores ``s = sqrt(softplus(x @ W_g.T))`` (``scoring_func == "sqrtsoftplus"``; ``"sigmoid"``/``"softmax"``
  are also accepted);
* hash layers (``layer_idx < num_hash_layers``): ``topk_ids = tid2eid[input_id]`` (int64 buffer
  ``[vocab, k]``, not trainable, no bias);
* other layers, ``topk_method == "noaux_tc"``: ``topk_ids = topk(s + e_score_correction_bias)`` (no group
  limit). The bias changes *which* experts are picked, never their weights;
* weights ``w = s.gather(topk_ids)``, divided by their sum when ``norm_topk_prob``, times
  ``routed_scaling_factor``.

Load balancing: during training every non-hash gate accumulates ``expert_load [E]`` (tokens routed to each
expert, a non-persistent fp32 buffer, no autograd). After each optimizer step the training loop calls
:func:`update_load_balancing_bias` (optionally summing the loads over ranks with a ``reduce`` callable), which
applies ``bias += rate * sign(mean_load - load_e)`` (``rate`` = 1e-3) and clears the loads. There is no
auxiliary loss.

Padding (our choice; the released model code is silent): tokens flagged in ``padding_mask`` skip the whole FFN. They are not
routed, not counted in ``expert_load`` and their MoE output (routed + shared) is exactly zero. Pad tokens never
carry a label, and real tokens never attend to them, so this only saves work and keeps the load statistics
clean.

Experts use the clamped SwiGLU in fp32: ``gate = min(x W1, limit)``, ``up = clamp(x W3, -limit, limit)``,
``h = silu(gate) * up`` cast back to the activation dtype, then ``W2``. ``swiglu_limit`` of ``None``/``0``
disables the clamp. The SwiGLU keeps only ``x W1`` and ``x W3`` (activation dtype) for backward.

Chunked experts (``moe_chunk_tokens = c > 0``): :class:`GroupedExperts` runs its ``T`` dispatched rows in
chunks of consecutive whole experts of at most ``c`` rows (:func:`expert_chunks`; an expert with more rows is a chunk
of its own, so every expert's GEMMs see exactly the rows they see unchunked); each chunk computes ``x W1`` and ``x W3`` (kept for
backward) and its SwiGLU + ``W2`` is recomputed in backward, so between forward and backward the experts hold
``x W1, x W3`` (two ``[T, I]`` in the activation dtype) and backward holds one chunk's SwiGLU intermediates at a
time. ``0`` runs all rows at once and keeps the SwiGLU output for ``W2``'s backward. The values are the same. The routed expert math goes through a :class:`~dsv4.model.dispatch.TokenDispatcher`
(default :class:`~dsv4.model.dispatch.LocalDispatcher`), so expert parallelism plugs in without touching this
file.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.model.dispatch import LocalDispatcher, TokenDispatcher, expert_counts
from dsv4.model.recompute import is_recomputing, recomputed


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` computed in fp32, returned in ``gate.dtype``.

    Saves ``gate`` and ``up`` as given (the compute dtype) for backward, which forms the fp32 values again: no
    fp32 copy of ``[T, I]`` stays alive between forward and backward."""
    return _ClampedSwiGLU.apply(gate, up, limit)


class _ClampedSwiGLU(torch.autograd.Function):
    """See :func:`clamped_swiglu`. Backward in fp32: with ``g = min(gate, limit)``, ``u = clamp(up)``:
    ``dgate = silu'(g) * grad * u`` where ``gate <= limit``, ``dup = grad * silu(g)`` where ``-limit <= up <= limit``
    (torch's clamp passes the gradient at the bounds)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        g, u = gate.float(), up.float()
        if limit:
            g = g.clamp(max=limit)
            u = u.clamp(min=-limit, max=limit)
        return (F.silu(g) * u).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        limit = ctx.limit
        grad = grad.float()
        g, u = gate.float(), up.float()
        if limit:
            g = g.clamp(max=limit)
            u = u.clamp(min=-limit, max=limit)
        dgate = dup = None
        if ctx.needs_input_grad[0]:  # the kernel autograd uses for F.silu
            dgate = torch.ops.aten.silu_backward(grad * u, g)
            if limit:
                dgate = dgate.masked_fill_(gate.float() > limit, 0.0)
            dgate = dgate.to(gate.dtype)
        if ctx.needs_input_grad[1]:
            dup = grad * F.silu(g)
            if limit:
                dup = dup.masked_fill_((up.float() < -limit) | (up.float() > limit), 0.0)
            dup = dup.to(up.dtype)
        return dgate, dup, None


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Router scores from router logits (fp32)."""
    logits = logits.float()
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {scoring_func!r}; expected sqrtsoftplus, sigmoid or softmax")


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether :func:`grouped_linear` can run ``x`` against ``weights``: torch has ``F.grouped_mm`` (2.13 has), and on
    CUDA the inputs are bf16 (its kernels' dtype); on CPU every row stride is a multiple of 16 bytes (the CPU
    kernel's rule). Meta tensors (the memory plan) follow the CPU rule."""
    if not hasattr(F, "grouped_mm") or any(w.dtype != x.dtype for w in weights):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):  # the kernel's dtypes (float64: the loop)
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16
    if x.device.type not in ("cpu", "meta"):
        return False
    dims = {x.shape[-1]} | {d for w in weights for d in w.shape[1:]}
    return all(d * x.element_size() % 16 == 0 for d in dims)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[r] @ weight[g].T`` for the rows ``r`` of group ``g`` (``offs[g-1] <= r < offs[g]``, ``offs``
    int32 group ends): ``x [T, in]``, ``weight [G, out, in]`` -> ``[T, out]``, one grouped GEMM, no host sync.

    On the meta device torch has the grouped kernel's shape function for bf16 only; other dtypes get one dense
    GEMM against expert 0 (the same output, the same saved input and a full-size weight gradient), so the memory
    plan traces the same bytes."""
    if x.device.type == "meta" and x.dtype != torch.bfloat16:
        return x @ weight[0].t()
    return F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)


def expert_chunks(tokens_per_expert: list[int], chunk_tokens: int) -> list[tuple[int, int]]:
    """Consecutive local experts grouped into chunks of at most ``chunk_tokens`` rows: ``[(first, end), ...]``
    (experts ``first .. end - 1``), covering every expert in order. An expert with more rows than ``chunk_tokens`` is
    a chunk of its own: a chunk never splits an expert, so each expert's GEMMs see exactly its rows, as unchunked."""
    chunks: list[tuple[int, int]] = []
    first, rows = 0, 0
    for e, n in enumerate(tokens_per_expert):
        if rows and rows + n > chunk_tokens:
            chunks.append((first, e))
            first, rows = e, 0
        rows += n
    chunks.append((first, len(tokens_per_expert)))
    return chunks


def expert_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                  offs: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in]`` rows grouped by expert (``tokens_per_expert [G]`` rows each) times each group's
    ``weight[g].T`` (``weight [G, out, in]``) -> ``[T, out]``: one grouped GEMM when ``offs`` (the int32 group ends
    on the device) is given, else one GEMM per expert (reads the counts on the host)."""
    if offs is not None:
        return grouped_linear(x, weight, offs)
    chunks = torch.split(x, tokens_per_expert.tolist(), dim=0)
    return torch.cat([chunk @ weight[e].t() for e, chunk in enumerate(chunks)], dim=0)


class MLP(nn.Module):
    """Dense clamped-SwiGLU MLP (the shared expert): ``w2(swiglu(w1 x, w3 x))``. ``[..., d] -> [..., d]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.swiglu_limit))


class GroupedExperts(nn.Module):
    """The routed experts held by this rank, stacked: ``w1, w3 [E_local, I, d]``, ``w2 [E_local, d, I]``.

    Implements :class:`~dsv4.model.dispatch.ExpertGroup`: ``forward(x_sorted [T, d], tokens_per_expert
    [E_local]) -> [T, d]`` where rows are grouped by local expert in order. Global expert ids held here are
    ``[expert_offset, expert_offset + num_local_experts)``. The experts run as three grouped GEMMs
    (:func:`grouped_linear`; no host sync) where :func:`grouped_mm_supported`, else one GEMM per expert.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        swiglu_limit: float | None,
        expert_offset: int = 0,
        num_local_experts: int | None = None,
        init_std: float = 0.02,
        chunk_tokens: int = 0,
    ) -> None:
        super().__init__()
        if int(chunk_tokens) != chunk_tokens or chunk_tokens < 0:
            raise ValueError(f"GroupedExperts: chunk_tokens must be an integer >= 0, got {chunk_tokens!r}")
        self.chunk_tokens = int(chunk_tokens)
        self.num_experts = num_experts
        self.expert_offset = expert_offset
        self.num_local_experts = num_experts if num_local_experts is None else num_local_experts
        self.swiglu_limit = swiglu_limit
        self.init_std = init_std
        n = self.num_local_experts
        self.w1 = nn.Parameter(torch.empty(n, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(n, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(n, hidden_size, intermediate_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=self.init_std)

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if x_sorted.shape[0] == 0:
            # Zero rows still run the (empty) per-expert GEMMs, so the output stays in the autograd graph of
            # ``x_sorted`` and the weights: the backward hooks of this module (FSDP's pre-/post-backward of an
            # expert unit) then run on every rank, and under expert parallelism a rank whose experts received no
            # rows issues the same collectives in the same order as the others.
            return self._expert_loop(x_sorted, tokens_per_expert)
        if not grouped_mm_supported(x_sorted, *self.expert_weights(x_sorted.dtype)):
            return self._expert_loop(x_sorted, tokens_per_expert)
        offs = tokens_per_expert.to(device=x_sorted.device).cumsum(0).to(torch.int32)  # group ends, on device
        return self._ffn(x_sorted, tokens_per_expert, offs)

    def _expert_loop(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """One GEMM per expert (reads the counts on the host): where grouped GEMMs are unavailable."""
        return self._ffn(x_sorted, tokens_per_expert, None)

    def _ffn(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        """``x [T, d]`` grouped by local expert -> ``[T, d]``; in chunks of ``chunk_tokens`` rows when > 0 (see the
        module docstring)."""
        c = self.chunk_tokens
        if not c:
            return self._down(self.project("w1", x, tokens_per_expert, offs),
                              self.project("w3", x, tokens_per_expert, offs), tokens_per_expert, offs)
        counts = tokens_per_expert.tolist()  # chunk bounds are whole experts: known on the host
        row_starts = list(itertools.accumulate(counts, initial=0))  # expert e's rows: [row_starts[e], row_starts[e + 1])
        outs = []
        for first, end in expert_chunks(counts, c):
            start, stop = row_starts[first], row_starts[end]
            xc = x[start:stop]
            counts_c = torch.zeros_like(tokens_per_expert)
            counts_c[first:end] = tokens_per_expert[first:end]
            offs_c = None if offs is None else counts_c.to(device=x.device).cumsum(0).to(torch.int32)
            gate, up = self.project("w1", xc, counts_c, offs_c), self.project("w3", xc, counts_c, offs_c)
            if torch.is_grad_enabled():
                outs.append(recomputed(self._down, gate, up, counts_c, offs_c))
            else:
                outs.append(self._down(gate, up, counts_c, offs_c))
        return torch.cat(outs)

    def _down(self, gate: torch.Tensor, up: torch.Tensor, tokens_per_expert: torch.Tensor,
              offs: torch.Tensor | None) -> torch.Tensor:
        """``W2(clamped_swiglu(gate, up))`` for rows grouped by local expert: ``[T, I]`` x 2 -> ``[T, d]``."""
        return self.project("w2", clamped_swiglu(gate, up, self.swiglu_limit), tokens_per_expert, offs)

    def expert_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """The weights the projections multiply by for inputs of ``dtype`` (what decides between grouped GEMMs
        and the loop)."""
        return self.w1, self.w3, self.w2

    def stacked_names(self) -> tuple[str, ...]:
        """Names of every tensor with one row per local expert (what expert parallelism slices)."""
        return "w1", "w3", "w2"

    def project(self, name: str, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                offs: torch.Tensor | None) -> torch.Tensor:
        """``x [T, in]`` (rows grouped by local expert) through each row's expert weight ``name`` (w1 / w3 / w2)
        -> ``[T, out]``. A subclass (LoRA, a frozen quantized base: :mod:`dsv4.peft`) changes only this."""
        return expert_linear(x, getattr(self, name), tokens_per_expert, offs)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local=[{self.expert_offset}, "
            f"{self.expert_offset + self.num_local_experts}), hidden={self.w1.shape[2]}, inter={self.w1.shape[1]}"
        )


class MoEGate(nn.Module):
    """Router of one layer: ``forward(x [N, d], input_ids [N] | None) -> (topk_ids [N, k] int64,
    topk_weights [N, k] fp32)``. Hash gates hold ``tid2eid``; score gates hold ``e_score_correction_bias``."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.topk_method = config.topk_method
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.init_std = config.initializer_range
        self.layer_idx = layer_idx
        self.is_hash = layer_idx < config.num_hash_layers
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        if self.is_hash:
            self.register_buffer("tid2eid", torch.empty(config.vocab_size, self.top_k, dtype=torch.long))
            self.e_score_correction_bias = None
            self.expert_load = None
        else:
            if self.topk_method not in ("noaux_tc", "greedy"):
                raise ValueError(f"unknown topk_method {self.topk_method!r}; expected noaux_tc or greedy")
            self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
            self.register_buffer("expert_load", torch.zeros(self.num_experts, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        if self.is_hash and self.tid2eid.device.type != "meta":
            # Deterministic per layer: top_k distinct random experts per token id (a checkpoint overrides it).
            gen = torch.Generator(device="cpu").manual_seed(1000 + self.layer_idx)
            noise = torch.rand(self.tid2eid.shape[0], self.num_experts, generator=gen, device="cpu")
            self.tid2eid.copy_(noise.argsort(dim=-1)[:, : self.top_k])
        if not self.is_hash:
            self.e_score_correction_bias.zero_()
            self.expert_load.zero_()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = expert_scores(F.linear(x.float(), self.weight.float()), self.scoring_func)
        if self.is_hash:
            if input_ids is None:
                raise ValueError(f"layer {self.layer_idx} uses hash routing and needs input_ids")
            topk_ids = self.tid2eid[input_ids]
        elif self.topk_method == "noaux_tc":
            topk_ids = torch.topk(scores.detach() + self.e_score_correction_bias, self.top_k, dim=-1).indices
        else:
            topk_ids = torch.topk(scores.detach(), self.top_k, dim=-1).indices
        weights = scores.gather(-1, topk_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        weights = weights * self.routed_scaling_factor
        if self.expert_load is not None and self.training and not is_recomputing():  # count each token once
            with torch.no_grad():
                self.expert_load += expert_counts(topk_ids, self.num_experts).float()
        return topk_ids, weights

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None, rate: float = 1e-3) -> None:
        """``bias += rate * sign(mean(load) - load)``: under-loaded experts become more likely to be picked.

        ``load`` defaults to the accumulated ``expert_load`` (already summed over ranks by the caller if
        needed). The accumulated load is cleared afterwards.
        """
        if self.e_score_correction_bias is None:
            return
        load = self.expert_load if load is None else load.to(self.expert_load)
        self.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()


def non_padding_tokens(padding_mask: torch.Tensor) -> torch.Tensor:
    """Flat (row-major) indices ``[N]`` of the tokens ``padding_mask`` does not flag (a host sync on GPUs)."""
    return (~padding_mask.reshape(-1)).nonzero().squeeze(-1)


class MoE(nn.Module):
    """Routed experts (through a dispatcher) + ``n_shared_experts`` shared experts; see the module docstring."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = MoEGate(config, layer_idx)
        self.experts = GroupedExperts(
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            config.swiglu_limit,
            init_std=config.initializer_range,
            chunk_tokens=config.moe_chunk_tokens,
        )
        n_shared = config.n_shared_experts or 0
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * n_shared, config.swiglu_limit) if n_shared else None
        )
        self.dispatcher: TokenDispatcher = LocalDispatcher()

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
        *, real_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``real_tokens [N]``: flat indices of the non-padding tokens (``AttentionMetadata.real_tokens``, found
        once per forward); given, ``padding_mask`` is not read. Finding them here costs a host sync on GPUs."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids = None if input_ids is None else input_ids.reshape(-1)
        keep = real_tokens
        if keep is None and padding_mask is not None:
            keep = non_padding_tokens(padding_mask)
        if keep is not None:
            flat = flat.index_select(0, keep)
            ids = None if ids is None else ids.index_select(0, keep)
        topk_ids, topk_weights = self.gate(flat, ids)
        y = self.dispatcher.run(self.experts, flat, topk_ids, topk_weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        if keep is not None:
            y = torch.zeros(shape[:-1].numel(), shape[-1], dtype=y.dtype, device=y.device).index_copy(0, keep, y)
        return y.reshape(shape)


def set_dispatcher(model: nn.Module, dispatcher: TokenDispatcher) -> None:
    """Use ``dispatcher`` for every MoE layer in ``model`` (e.g. an expert-parallel one)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.dispatcher = dispatcher


@torch.no_grad()
def update_load_balancing_bias(
    model: nn.Module, rate: float = 1e-3, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    """Apply the noaux_tc bias update to every score-routed gate of ``model`` and clear the loads.

    Call after each optimizer step. ``reduce`` (e.g. an all-reduce SUM over the data/context/expert ranks that
    share the router) maps the stacked local loads ``[num_gates, E]`` to the global ones; it is called once, so
    the trainer pays one collective per step.
    """
    gates = [m for m in model.modules() if isinstance(m, MoEGate) and m.expert_load is not None]
    if not gates:
        return
    loads = torch.stack([g.expert_load for g in gates])
    if reduce is not None:
        loads = reduce(loads)
    for gate, load in zip(gates, loads):
        gate.update_bias(load, rate)
