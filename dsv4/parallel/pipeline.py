"""Pipeline parallelism for DeepSeek-V4 and V4.1 causal LMs through ``torch.distributed.pipelining`` (its stages and
schedules; no scheduler of our own). The model code knows nothing of it: a stage is a view of a built
:class:`~dsv4.model.model.DSV4ForCausalLM` or :class:`~dsv4.model.v41.model.DSV41ForCausalLM` over a contiguous
range of its decoder blocks.

* **Split** (:func:`stage_layers`): ``pp x virtual`` stages of contiguous blocks, balanced by the FLOP model
  (:func:`dsv4.flops.block_flops_breakdown` per block; the last stage also pays the head: the hyper-head, the final
  norm, ``lm_head``, the MTP depths and the chunked loss). The exact min-max partition of the per-block costs over
  the allowed split points (:func:`split_points`): DeepSeek-V4.1's Reindex and Reuse layers read the shared state
  (:mod:`dsv4.model.v41.shared_state`) of the last Full layer before them, so a stage starts only where the first
  compressed layer at or after it is a Full layer (a ``kv_source_layer_ids`` entry): the state never crosses stages.
* **A stage** (:class:`DSV4PipelineStage`): the first embeds the tokens (and resolves the inputs: the packed
  layout of :func:`dsv4.model.inputs.resolve_inputs`); every stage runs its blocks over the residual streams
  ``[B, L, hc, d]`` and rebuilds the attention metadata of the microbatch from the tokens' positions and document
  ids, which travel with the streams (``input_ids``, ``position_ids``, ``seq_ids`` ``[B, L]`` int64, ``padding``
  ``[B, L]`` bool, ``labels`` ``[B, L]`` int64: small beside the streams; V4.1 adds the single-pass
  hyper-connections' carry ``[B, L, hc]`` fp32 after the streams, and each stage holding Engram layers hashes the
  n-grams of the tokens itself); the last returns the microbatch's loss
  *sum* (main CE + ``mtp_loss_weight`` x the mean of the MTP depths' CE sums), as the model's own loss head does.
* **The loss** (:func:`pipeline_loss`): every microbatch's sum divided by the step's label count (known before the
  step: the labels are data), and the schedule built with ``scale_grads=False``, so the gradients are those of the
  token mean over the whole step, as one process taking the same batch computes them.
* **The tied embedding.** The MTP depths embed the shifted tokens with the model's embedding: with MTP depths the
  last stage holds the embedding too. On one rank both stages share the module (its gradient accumulates); across
  ranks :func:`reduce_embedding_grads` sums the two copies' gradients after the step (the copies start equal and
  take the same update).
* **Context parallelism**: a stage given its CP group's :class:`~dsv4.parallel.cp.context.CPContext` runs its blocks
  on the rank's chunk of each row as the model does (each stage rank of a CP group holds the same blocks; the
  pipeline's sends go between the ranks of one CP index). The stage's parameters are replicated over its CP ranks:
  their gradients are summed over the CP group after the step (FSDP's reduction over ``dp x cp`` does it in the
  recipes' layout).
* **Expert parallelism**: the model's routed experts sharded over a stage's EP group before the stages are built
  (:func:`dsv4.parallel.expert_shard.apply_expert_parallel`); each rank of the group runs its own rows (the
  dispatcher's all-to-alls run inside the stage, in the same microbatch order on every rank of the group: the
  schedule is deterministic), the other gradients summed over the group after the step as for data parallelism.
* **Gradient clipping** (:func:`clip_pipeline_grad_norm_`): the global norm over every stage, each gradient element
  once (the MTP embedding's summed copy on the first stage's rank only, routed-expert slices over the EP group,
  replicas over CP / EP once).
* **Traffic** (:func:`stage_traffic`): the bytes a stage sends and receives per step. Checkpoints:
  :mod:`dsv4.parallel.pipeline_checkpoint`.

* **FSDP2 inside a stage** (:func:`shard_stages`): each stage's units sharded over its ``dp x cp`` ranks, gathered
  once per step.

* **LoRA**: the adapters train, the frozen base is gathered and never reduced (FSDP's units as without stages); the
  embedding, frozen, takes no gradient on either stage.

Not yet composed with the indexer's KL loss (``indexer_loss_coeff > 0``): :func:`check_pipeline` refuses it naming
the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

# pp_schedule: the names of torch.distributed.pipelining's schedules (the last two: virtual stages, looped placement)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")


@dataclass(frozen=True)
class StageSpan:
    """Stage ``index`` of ``count``: decoder blocks ``[start, stop)``; ``cost``: its forward FLOPs per token."""

    index: int
    count: int
    start: int
    stop: int
    cost: float

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def layer_costs(config: Any, seq_len: int) -> tuple[list[float], float]:
    """``(forward FLOPs per token of each decoder block, of the head)``: the head is what the last stage runs after
    its blocks (the MTP depths' blocks and projections, the hyper-heads and ``lm_head`` of the model and each
    depth), from :mod:`dsv4.flops`."""
    from dsv4.flops import block_flops_breakdown, forward_flops_breakdown

    blocks = [sum(block_flops_breakdown(config, seq_len, i).values()) for i in range(config.num_hidden_layers)]
    return blocks, sum(forward_flops_breakdown(config, seq_len).values()) - sum(blocks)


def split_points(config: Any) -> list[int]:
    """The blocks a stage may start at (besides 0): every block for V4; for V4.1 those where the first compressed
    layer at or after it is a Full layer (or none follows), so no Reindex / Reuse layer reads a state built on an
    earlier stage (module docstring)."""
    n = config.num_hidden_layers
    if getattr(config, "model_type", "deepseek_v4") != "deepseek_v41":
        return list(range(1, n))
    sources = set(config.kv_source_layer_ids)
    points = []
    for j in range(1, n):
        compressed = [i for i in range(j, n) if config.ratio_for_layer(i) > 0]
        if not compressed or compressed[0] in sources:
            points.append(j)
    return points


def stage_layers(config: Any, seq_len: int, stages: int) -> list[StageSpan]:
    """The contiguous split of the decoder blocks into ``stages`` stages (at least one block each, each starting at
    one of :func:`split_points`) that minimises the largest stage cost (blocks' FLOPs, the head's on the last stage):
    exact, by dynamic programming over the split points; ties go to the earliest split."""
    blocks, head = layer_costs(config, seq_len)
    n = len(blocks)
    allowed = {0, *split_points(config)}
    if not 1 <= stages <= len(allowed):
        raise ValueError(f"`pp` x virtual stages = {stages} stages for {n} decoder blocks that can start a stage at "
                         f"{sorted(allowed)}: each stage needs at least one block")
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, last: bool) -> float:
        return prefix[j] - prefix[i] + (head if last else 0.0)

    inf = float("inf")
    # best[k][j]: the smallest largest-stage cost of blocks [0, j) in k stages, each starting at an allowed block
    # (the head is counted on stage k = stages ending at j = n, the last)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                if i not in allowed or best[k - 1][i] == inf:
                    continue
                value = max(best[k - 1][i], cost(i, j, last=k == stages and j == n))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    spans, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        spans.append((i, j))
        j = i
    spans.reverse()
    return [StageSpan(k, stages, i, j, cost(i, j, last=k == stages - 1)) for k, (i, j) in enumerate(spans)]


def check_pipeline(config: Any, pp: int) -> None:
    """ValueError naming the key for what the pipeline does not compose with yet (module docstring)."""
    family = getattr(config, "model_type", "deepseek_v4")
    if family not in ("deepseek_v4", "deepseek_v41"):
        raise ValueError(f"`pp`={pp}: pipeline stages are built for DeepSeek-V4 and V4.1 models; "
                         f"model_type={family!r}")
    if getattr(config, "indexer_loss_coeff", 0) > 0:
        raise ValueError(f"`pp`={pp} with `model.indexer_loss_coeff`={config.indexer_loss_coeff}: the indexer's KL "
                         "loss is not carried across stages yet")


class DSV4PipelineStage(nn.Module):
    """Stage ``span`` of ``model`` (a :class:`~dsv4.model.model.DSV4ForCausalLM` or
    :class:`~dsv4.model.v41.model.DSV41ForCausalLM`): its blocks, and the embedding (first stage; the last too when
    the model has MTP depths) and the head (last stage) of the module docstring. The modules are ``model``'s own
    (no copy): stages built from one model on one rank share them. ``cp``: the stage's CP context (rows are then
    this rank's chunks).

    ``forward`` (first stage): ``(input_ids, position_ids, seq_ids, padding, labels)``, the microbatch's rows
    ``[B, L]`` (``padding`` bool, True = pad; ``labels`` pre-shifted, -100 ignored); (the others): the previous
    stage's activations (``streams [B, L, hc, d]``, and for V4.1 ``carry [B, L, hc]``) then those five. Returns the
    activations and the five for the next stage, or (last stage) the microbatch's loss sum, ``[1]``."""

    def __init__(self, model: nn.Module, span: StageSpan, cp: Any = None) -> None:
        super().__init__()
        self.span = span
        self.cp = cp if cp is not None and getattr(cp, "enabled", False) else None  # the stage's CP context
        self.config = model.config
        self.v41 = getattr(model.config, "model_type", "deepseek_v4") == "deepseek_v41"
        self.blocks = nn.ModuleDict({str(i): model.model.layers[i] for i in range(span.start, span.stop)})
        mtp = getattr(model, "mtp", None)
        self.has_mtp = mtp is not None and len(mtp.layers) > 0
        self.embed_tokens = model.model.embed_tokens if span.first or (span.last and self.has_mtp) else None
        if span.last:
            self.norm, self.lm_head = model.model.norm, model.lm_head
            if not self.v41:
                self.hc_head, self.mtp = model.model.hc_head, mtp
        self.engram = any(getattr(b, "engram", None) is not None for b in self.blocks.values())
        object.__setattr__(self, "_model", model)  # for its loss head and Engram hashing; not a submodule

    @property
    def activations(self) -> int:
        """How many float tensors lead a non-first stage's inputs: the streams, and V4.1's carry."""
        return 2 if self.v41 else 1

    def forward(self, *args: torch.Tensor) -> Any:
        from dsv4.model.attention_metadata import build_attention_metadata
        from dsv4.model.inputs import ModelInputs, resolve_inputs

        if self.span.first:
            input_ids, position_ids, seq_ids, padding, labels = args
            inputs = resolve_inputs(self.config, input_ids, position_ids, seq_ids, padding, self.cp, labels, {})
            if inputs.input_ids.shape != input_ids.shape:
                raise ValueError(f"pipeline stage 0: the microbatch's rows {tuple(input_ids.shape)} re-lay out to "
                                 f"{tuple(inputs.input_ids.shape)} (documents not starting on multiples of "
                                 f"{self.config.shard_multiple}); stages exchange fixed shapes: pack the rows aligned "
                                 "(dsv4.data.pack_documents)")
            input_ids, position_ids, seq_ids, labels = (inputs.input_ids, inputs.position_ids, inputs.seq_ids,
                                                        inputs.labels)
            padding = inputs.padding if inputs.padding is not None else torch.zeros_like(input_ids, dtype=torch.bool)
            acts = self._embed(input_ids)
        else:
            acts, (input_ids, position_ids, seq_ids, padding, labels) = args[:self.activations], args[self.activations:]
        rows = (input_ids, position_ids, seq_ids, padding, labels)
        meta = build_attention_metadata(self.config, position_ids, seq_ids, padding, self.cp)
        if self.v41:
            x, carry = acts
            engram = None
            if self.engram:
                engram = self._model.engram_inputs(ModelInputs(*rows, cp=self.cp), meta)
            state = None
            for block in self.blocks.values():
                x, carry, state = block(x, carry, state, meta, engram, self.cp)
            acts = (x, carry)
        else:
            (x,) = acts
            for block in self.blocks.values():
                x = block(x, input_ids, meta, self.cp)
            acts = (x,)
        if not self.span.last:
            return (*acts, *rows)
        return self._loss_sum(acts, input_ids, meta, labels).reshape(1)  # [1]: the schedule concatenates outputs

    def _embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        acts = self._model.model.embed(input_ids)  # V4: the streams; V4.1: the streams and the carry
        return tuple(acts) if self.v41 else (acts,)

    def _loss_sum(self, acts, input_ids, meta, labels) -> torch.Tensor:
        """The model's own loss head on the last block's activations (main CE, MTP depths for V4)."""
        hidden = self._model.model.finish(*acts)
        mtp_hiddens, mtp_labels = [], None
        if not self.v41:
            mtp_hiddens, mtp_labels = self.mtp(acts[0], self.embed_tokens, input_ids, meta, labels=labels, cp=self.cp)
        return self._model._head_and_loss(hidden, mtp_hiddens, labels, mtp_labels, 0, return_logits=False).loss_sum


def shard_stages(model: nn.Module, stages: list[DSV4PipelineStage], meshes: Any,
                 compute_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 inside a pipeline rank's ``stages`` (:func:`dsv4.parallel.wrap.apply_fsdp` with the stages as roots):
    their blocks, routed experts and fp32 modules the model's own units, sharded over the stage's ``dp x cp`` ranks
    (``meshes.dp_cp``; experts over ``meshes.edp``; :func:`dsv4.parallel.mesh.build_meshes` with ``pp``), each stage
    the root of its embedding and head, gradients summed over the ranks. Every unit stays gathered after forward:
    ``torch.distributed.pipelining``'s stage keeps an FSDP module gathered, and its gradients unsharded, from the
    first microbatch's backward to the last's (no resharding after backward, no gradient reduction before the last
    microbatch), so gathering once per step costs no memory at the steady state's peak and the step gathers and
    reduce-scatters each unit once (what :mod:`dsv4.plan.stages` plans). Call it after the experts are sharded for
    EP and before the engine's ``PipelineStage`` wraps the stages."""
    from dsv4.parallel.wrap import apply_fsdp

    apply_fsdp(model, meshes, compute_dtype=compute_dtype, roots=list(stages))


def stage_io(stage: DSV4PipelineStage, rows: int, length: int, dtype: torch.dtype
             ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``(input_args, output_args)`` of ``stage`` for microbatches of ``rows x length`` tokens, as ``meta`` tensors:
    the shapes and dtypes :class:`torch.distributed.pipelining.PipelineStage` exchanges (given, the stage skips its
    shape inference, which would run the stage on uninitialised token ids). ``dtype``: the streams' (the compute
    dtype; they carry gradients, the token tensors do not)."""
    c = stage.config

    def tokens(dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.empty(rows, length, dtype=dtype, device="meta")

    rows_in = (tokens(), tokens(), tokens(), tokens(torch.bool), tokens())  # ids, positions, seq ids, padding, labels
    streams = torch.empty(rows, length, c.hc_mult, c.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    carry = torch.empty(rows, length, c.hc_mult, dtype=torch.float32, device="meta", requires_grad=True)
    acts = (streams, carry) if stage.v41 else (streams,)
    inputs = rows_in if stage.span.first else (*acts, *rows_in)
    loss = torch.empty(1, dtype=torch.float32, device="meta", requires_grad=True)
    outputs = (loss,) if stage.span.last else (*acts, *rows_in)
    return inputs, outputs


@torch.no_grad()
def clip_pipeline_grad_norm_(stages: list[DSV4PipelineStage], max_norm: float | None, pp_group: Any = None,
                             ep_group: Any = None, stage_group: Any = None) -> torch.Tensor:
    """The global L2 norm of the model's gradients after a pipeline step, clipped to ``max_norm`` (None or 0: only
    the norm). Each element is counted once: this rank's stages' parameters (a tensor two of them share, once); the
    embedding, which the first and the last stage both hold when the model has MTP depths, on the first stage's
    rank only (after :func:`reduce_embedding_grads` both copies hold the sum); with ``ep_group`` the routed experts'
    slices summed over the EP group, the other gradients (equal on every EP and CP rank) once; under FSDP
    (:func:`shard_stages`: each element of a stage's gradients on one rank of its ``stage_group``) the local shards'
    squares summed over ``stage_group``; then the sum over ``pp_group``. Returns the norm before clipping (fp32
    scalar); a non-finite norm leaves the gradients as they are."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dsv4.model.moe import GroupedExperts

    holds_first = any(s.span.first for s in stages)
    embedding = stages[0]._model.model.embed_tokens.weight
    params = {id(p): p for s in stages for p in s.parameters() if p.grad is not None}
    if not holds_first:
        params.pop(id(embedding), None)
    sliced = {id(p) for s in stages for m in s.modules() if isinstance(m, GroupedExperts) for p in m.parameters()} \
        if ep_group is not None else set()
    own = torch.zeros((), dtype=torch.float32)
    experts = torch.zeros((), dtype=torch.float32)
    for key, p in params.items():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        sq = grad.float().pow(2).sum().cpu()
        if key in sliced:
            experts += sq
        else:
            own += sq
    if ep_group is not None:
        dist.all_reduce(experts, group=ep_group)
    total_sq = own + experts
    if stage_group is not None:
        dist.all_reduce(total_sq, group=stage_group)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm and torch.isfinite(total):
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        for p in {id(p): p for s in stages for p in s.parameters() if p.grad is not None}.values():
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
    return total


def stage_traffic(stage: DSV4PipelineStage, rows: int, length: int, n_microbatches: int, dtype: torch.dtype
                  ) -> dict[str, int]:
    """The bytes ``stage`` sends and receives to its neighbours per step (``{"sent", "received"}``), from its declared
    I/O (:func:`stage_io`): per microbatch of ``rows x length`` tokens, forward its outputs (the streams in ``dtype``,
    V4.1's fp32 carry, the five token tensors) to the next stage, backward the gradients of its inputs that carry
    one (the activations) to the previous one; and once per step the schedule's handshake, a float32 (the stage's index) each
    way to each neighbour. A rank's traffic is the sum over its stages (with virtual stages every neighbour is on
    another rank when ``pp > 1``)."""
    inputs, outputs = stage_io(stage, rows, length, dtype)

    def size(tensors, grads_only: bool = False) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t.requires_grad or not grads_only)

    first, last = stage.span.first, stage.span.last
    sent = (0 if last else size(outputs)) + (0 if first else size(inputs, grads_only=True))
    received = (0 if first else size(inputs)) + (0 if last else size(outputs, grads_only=True))
    handshake = 4 * ((0 if first else 1) + (0 if last else 1))
    return {"sent": n_microbatches * sent + handshake, "received": n_microbatches * received + handshake}


def pipeline_loss(label_count: int) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """The schedule's ``loss_fn``: a microbatch's loss sum over the step's ``label_count`` (module docstring)."""
    denominator = float(max(int(label_count), 1))

    def loss_fn(loss_sum: torch.Tensor, _target: Any) -> torch.Tensor:
        return loss_sum.sum() / denominator

    return loss_fn


def stage_indices(rank: int, pp: int, virtual: int) -> list[int]:
    """The stages rank ``rank`` of ``pp`` holds: ``rank, rank + pp, ...`` (``virtual`` of them: the looped order of
    the interleaved schedules)."""
    return [rank + v * pp for v in range(virtual)]


def build_schedule(stages: list[Any], n_microbatches: int, name: str, loss_fn: Callable) -> Any:
    """The ``torch.distributed.pipelining`` schedule ``name`` (:data:`SCHEDULES`) over this rank's ``stages``
    (:class:`torch.distributed.pipelining.PipelineStage`), ``scale_grads=False`` (the loss is normalised by
    :func:`pipeline_loss`)."""
    from torch.distributed import pipelining

    if name not in SCHEDULES:
        raise ValueError(f"`pp_schedule`={name!r} must be one of {', '.join(SCHEDULES)}")
    if name in ("interleaved_1f1b", "interleaved_zero_bubble"):
        schedule = (pipelining.ScheduleInterleaved1F1B if name == "interleaved_1f1b"
                    else pipelining.ScheduleInterleavedZeroBubble)
        return schedule(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ValueError(f"`pp_schedule`={name} runs one stage per rank, got {len(stages)} (virtual stages need "
                         "interleaved_1f1b or interleaved_zero_bubble)")
    schedule = pipelining.ScheduleGPipe if name == "gpipe" else pipelining.Schedule1F1B
    return schedule(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def embedding_pair(model: nn.Module, stages: int, pp: int) -> list[int] | None:
    """The pipeline ranks (of ``pp``) whose stages both hold the embedding: the first stage's (rank 0) and the last
    stage's, when the model has MTP depths and they differ; None otherwise (no gradient to sum)."""
    last = (stages - 1) % pp
    mtp = getattr(model, "mtp", None)
    return [0, last] if mtp is not None and len(mtp.layers) and last != 0 else None


def reduce_embedding_grads(model: nn.Module, pair_group: Any) -> None:
    """Sum the embedding's gradient over ``pair_group`` (the ranks of :func:`embedding_pair`, made by
    ``torch.distributed.new_group`` on every rank; call this on those two ranks only) after the step's backward.
    Under FSDP the pair is the two stages' ranks of one (dp, cp) index, whose shards match."""
    import torch.distributed as dist

    from torch.distributed.tensor import DTensor

    weight = model.model.embed_tokens.weight
    if not weight.requires_grad:  # frozen (a LoRA base): nothing to sum, on either rank
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad
    dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=pair_group)  # FSDP: the shards
