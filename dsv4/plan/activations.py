"""Activation memory of one training step on one rank, traced on the ``meta`` device and composed per segment.

The step is cut into the segments it runs in order: the embedding, every decoder block, and the top (hyper-head,
final norm, MTP depths, lm_head and loss). Each distinct segment is traced once, forward and backward, by
:class:`~dsv4.plan.trace.AllocationTracer` with the real model code (parameters cast to the FSDP units' compute
dtypes, :mod:`dsv4.plan.stand_ins` for CP, routing and metadata). A trace yields, for its segment ``s``:

* ``forward_peak`` F_s: the most bytes live during its forward, its input included;
* ``retained`` r_s: live after its forward minus its output (what its backward needs, its input if saved);
* ``backward_peak`` B_s: the most bytes live during its backward, from ``r_s`` plus the incoming gradient, with
  its parameters' unsharded gradients (FSDP reduces them after the unit's backward).

Segments run one after another, so with ``R_s`` the retained bytes of the segments before ``s`` and ``M`` the
attention metadata (built once per forward, kept all step), the phases of the step are ``M + R_s + F_s`` (forward
of ``s``) and ``M + R_s + B_s + H`` (backward of ``s``), where ``H`` is the root unit's lm_head gradient, held
until the end of backward (FSDP reduces the root last). Blocks of the same kind (compress ratio, hash routing, the
first block's broadcast input) share one trace. Tests check the composition against a trace of the whole step.

Each trace also records the bytes the traced rank's CP exchanges and EP dispatches move in that segment's forward,
recomputed forward and backward (:attr:`SegmentTrace.traffic`, counted by the stand-ins: :mod:`dsv4.plan.stand_ins`),
and the metadata exchanges of building the attention metadata once per forward
(:attr:`ActivationPlan.metadata_traffic`); :func:`ActivationPlan.traffic` sums them over the step. And how often the
segment calls each FSDP unit (``unit_modules``) in forward, and how many of those calls backward reaches
(:attr:`SegmentTrace.unit_calls`): FSDP2 gathers a unit resharded after forward at each forward call and again when
backward reaches a call's output (a forward recomputed in backward finds it gathered), which is what the plan's
all-gather bytes count (:mod:`dsv4.plan.comm`). A unit is called more than once where the model calls it so: under
CP an overlap compressor runs a second time on its last window (the boundary its successor receives).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from dsv4.model.attention import DSV4Attention
from dsv4.model.block import DSV4Block
from dsv4.model.hyper_connections import HyperConnection
from dsv4.model.indexer import Indexer
from dsv4.model.model import DSV4ForCausalLM
from dsv4.model.moe import GroupedExperts, MoE, set_dispatcher
from dsv4.model.mtp import MTPLayer
from dsv4.parallel.cp.traffic import TrafficCounter
from dsv4.plan.stand_ins import PlanCP, PlanDispatcher, plan_metadata
from dsv4.plan.states import table_tensors
from dsv4.plan.trace import AllocationTracer

# Labels by module type (the innermost labelled module wins). The sub-modules a recomputed block calls are listed
# too: recompute reruns them, not the block's own forward, so their hooks are what attributes the recomputed bytes.
BLOCK_COMPONENTS: dict[type, str] = {DSV4Block: "hyper_connections", HyperConnection: "hyper_connections",
                                     DSV4Attention: "attention", Indexer: "indexer", MoE: "moe"}
TOP_COMPONENTS: dict[type, str] = {MTPLayer: "mtp", HyperConnection: "mtp", DSV4Attention: "mtp", MoE: "mtp"}
# Recomputed regions that are methods, not modules (torch checkpoint reruns the bound method in backward):
# (module type, method) -> label. A recomputed MTP depth (MTPLayer._depth) runs its projections, norms and
# hyper-head outside any labelled module; a chunk of routed experts recomputes its SwiGLU + W2 (_down).
BLOCK_REGIONS: dict[tuple[type, str], str] = {(GroupedExperts, "_down"): "moe",
                                              (HyperConnection, "_mixing"): "hyper_connections"}
TOP_REGIONS: dict[tuple[type, str], str] = {(MTPLayer, "_depth"): "mtp", (GroupedExperts, "_down"): "mtp",
                                            (HyperConnection, "_mixing"): "mtp"}


@dataclass
class SegmentTrace:
    """One traced segment (bytes; see the module docstring). ``saved_by_component``: bytes saved for backward,
    by the part of the model that created them; ``backward_peak_by_component``: what is live at the backward peak
    (with recompute: the recomputed internals), by the same parts, ``gradients`` for what backward allocates."""

    name: str
    kind: str
    forward_peak: int
    retained: int
    backward_peak: int
    held_gradients: int = 0
    saved_by_component: dict[str, int] = field(default_factory=dict)
    backward_peak_by_component: dict[str, int] = field(default_factory=dict)
    # bytes this segment's CP exchanges and EP dispatches move per step: {kind: {"calls", "bytes_sent",
    # "bytes_received"}} (dsv4.parallel.cp.traffic.TrafficCounter.as_dict)
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)
    # FSDP units called in this segment, by name relative to the traced module (a block; the model otherwise):
    # [forward calls (not the recomputed ones), calls whose output's gradient backward computed]
    unit_calls: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Phase:
    """A moment of the step: its live activation bytes (metadata included) and, in backward, the index of the
    segment running (in forward order: 0 = embedding, 1.. = blocks, last = top); None in forward."""

    name: str
    activations: int
    backward_of: int | None


@dataclass
class ActivationPlan:
    """``metadata``: the per-forward attention metadata kept all step; ``segments``: the traces in forward order
    (blocks of one kind share an object); ``phases``: every forward and backward phase, in execution order;
    ``per_forward`` (V4.1): the per-forward state by part (attention metadata and Engram n-gram ids, which make up
    ``metadata``, and the CSA2 shared state the Full / Reindex blocks publish, which is in their ``retained``)."""

    metadata: int
    segments: list[SegmentTrace]
    phases: list[Phase]
    top_name: str = "top (head, MTP, loss)"
    per_forward: dict[str, int] = field(default_factory=dict)  # V4.1: the parts of ``metadata`` and the shared state
    metadata_traffic: dict[str, dict[str, int]] = field(default_factory=dict)  # building the metadata, once a step

    def traffic(self) -> dict[str, dict[str, int]]:
        """The traced rank's CP and EP bytes of one step by kind: every segment's (each block of a kind counted once
        per block) and the metadata's, ``{kind: {"calls", "bytes_sent", "bytes_received"}}``."""
        return sum_traffic([self.metadata_traffic, *(seg.traffic for seg in self.segments)])

    @property
    def peak(self) -> int:
        return max(p.activations for p in self.phases)

    @property
    def phase(self) -> str:
        return max(self.phases, key=lambda p: p.activations).name

    def block_kinds(self) -> list[tuple[SegmentTrace, int]]:
        """The distinct block traces and how many blocks of each the model has."""
        counts: dict[int, list] = {}
        for seg in self.segments:
            if seg.name.startswith("block"):
                counts.setdefault(id(seg), [seg, 0])[1] += 1
        return [(seg, n) for seg, n in counts.values()]


def sum_traffic(records: Sequence[dict[str, dict[str, int]]], times: int = 1) -> dict[str, dict[str, int]]:
    """``records`` (each ``{kind: {"calls", "bytes_sent", "bytes_received"}}``) summed by kind, times ``times``."""
    total: dict[str, dict[str, int]] = {}
    for record in records:
        for kind, counts in record.items():
            into = total.setdefault(kind, {"calls": 0, "bytes_sent": 0, "bytes_received": 0})
            for key in into:
                into[key] += counts[key] * times
    return dict(sorted(total.items()))


def trace_segment(name: str, kind: str, run: Callable[[torch.Tensor | None], torch.Tensor], source: torch.Tensor | None,
                  modules: nn.Module, labels: dict[type, str], default_label: str,
                  held: set | frozenset = frozenset(),
                  regions: dict[tuple[type, str], str] | None = None) -> SegmentTrace:
    """Trace ``run(x)`` forward and backward. ``x`` stands for the previous segment's output: made from the
    ``source`` leaf (created outside the trace, so only ``x`` itself counts) by its recorded view op
    (``source._plan_view``), a non-leaf freed when the segment does not save it; None for the embedding.
    ``held``: parameters whose gradients stay until the end of backward (their bytes: ``held_gradients``);
    ``regions``: ``{(module type, method name): label}`` for recomputed regions that are methods. The Engram tables
    of ``modules`` are never counted: the plan has them in ``parameters`` (:func:`~dsv4.plan.states.table_tensors`)."""
    params = [p for p in modules.parameters() if p.requires_grad]
    with AllocationTracer(default_label, untracked=table_tensors(modules)) as tracer:
        tracer.label_modules(modules, labels)
        for module in modules.modules():
            for (owner_type, method), label in (regions or {}).items():
                if isinstance(module, owner_type):
                    tracer.label_method(module, method, label)
        x = None if source is None else source._plan_view(source.clone())
        y = run(x)
        del x
        forward_peak, out_bytes = tracer.peak, y.untyped_storage().nbytes()
        retained = tracer.live - out_bytes
        tracer.forget(y)
        tracer.default_label = "gradients"  # what backward allocates outside the modules' recomputed forwards
        tracer.reset_peak()
        if y.requires_grad:  # a frozen segment (a LoRA model's embedding) has no backward
            y.backward(torch.empty_like(y))
        del y
        backward_peak, at_peak = tracer.peak, dict(tracer.peak_by_label)
        held_bytes = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None and p in held)
    for p in params:
        p.grad = None
    if source is not None:
        source.grad = None
    return SegmentTrace(name, kind, forward_peak, retained, backward_peak, held_bytes, dict(tracer.saved_by_label),
                        at_peak)


def cast_for_compute(model: nn.Module, dtypes: dict[nn.Parameter, torch.dtype]) -> None:
    """Give every parameter of a ``meta`` model the dtype its FSDP unit all-gathers it in."""
    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            dtype = dtypes.get(p, p.dtype)
            if dtype != p.dtype:
                setattr(module, pname, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))


class StepTracer:
    """Traces the segments of a training step of ``model`` (on ``meta``, cast with :func:`cast_for_compute`)
    for ``rows`` rows of ``local_len`` tokens per rank on the CP rank that receives the most earlier rows of a
    document spanning the sequence: ``cp_size - 1`` of the contiguous split, rank 0 under ``cp_balance="full"``
    (it holds the last chunk, and its first chunk's keys are padded to that length; the rank's ``2 rows`` local rows
    are chunks of ``local_len / 2``)."""

    def __init__(self, model: DSV4ForCausalLM, rows: int, local_len: int, cp_size: int,
                 expert_parallel: bool, return_logits: bool = False, root_parameters: set | frozenset = frozenset(),
                 cp_balance: str = "none", ep: int = 1, dispatcher: str = "alltoall",
                 unit_modules: Sequence[nn.Module] = ()) -> None:
        self.model, self.config = model, model.config
        self.root_parameters = root_parameters
        self.unit_modules = list(unit_modules)
        self.cp = PlanCP(0 if cp_balance == "full" else cp_size - 1, cp_size, cp_balance)
        k = self.cp.layout.chunks_per_rank
        rows, local_len = rows * k, local_len // k
        self.rows, self.local_len = rows, local_len
        self.return_logits = return_logits
        self.cp_arg = self.cp if cp_size > 1 else None
        self.dispatcher = PlanDispatcher(expert_parallel, ep, dispatcher)
        set_dispatcher(model, self.dispatcher)
        model.eval()  # no expert-load statistics (a bincount over routed ids, which meta tensors do not have)
        with self._counting() as counter:  # the model builds its metadata once per forward
            self.meta = plan_metadata(self.config, rows, local_len, self.cp)
        self.metadata_traffic = counter.as_dict()
        self.ids = torch.zeros(rows, local_len, dtype=torch.long, device="meta")
        dtype, hc, d = model.model.embed_tokens.weight.dtype, self.config.hc_mult, self.config.hidden_size
        # a block's input streams; the first block's are the embedding broadcast over hc (one [B, L, d] storage)
        self.streams = _leaf((rows, local_len, hc, d), dtype, lambda x: x)
        self.embedded = _leaf((rows, local_len, d), dtype,
                              lambda h: h.unsqueeze(-2).expand(rows, local_len, hc, d))

    @contextmanager
    def _counting(self) -> Iterator[TrafficCounter]:
        """A fresh byte counter on the CP and EP stand-ins for the duration."""
        counter = TrafficCounter()
        self.cp.traffic = self.dispatcher.traffic = counter
        try:
            yield counter
        finally:
            self.cp.traffic = self.dispatcher.traffic = None

    def _trace(self, *args, scope: nn.Module | None = None, **kwargs) -> SegmentTrace:
        """:func:`trace_segment`, with the bytes the segment's exchanges move (:attr:`SegmentTrace.traffic`) and its
        calls of the FSDP units inside ``scope`` (the model when None; :attr:`SegmentTrace.unit_calls`)."""
        names = {m: n for n, m in (scope if scope is not None else self.model).named_modules()}
        calls: dict[str, list[int]] = {}

        def called(module, _args, output) -> None:
            if torch._C._current_graph_task_id() != -1:  # a forward recomputed in backward: the unit is gathered
                return
            record = calls.setdefault(names[module], [0, 0])
            record[0] += 1
            outputs = [t for t in _tensors(output) if t.requires_grad]
            reached: list[bool] = []

            def backward_reached(_grad) -> None:  # FSDP's pre-backward hook fires on the same gradients
                if not reached:
                    reached.append(True)
                    record[1] += 1

            for t in outputs:
                t.register_hook(backward_reached)

        handles = [m.register_forward_hook(called) for m in self.unit_modules if m in names]
        try:
            with self._counting() as counter:
                trace = trace_segment(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        trace.traffic = counter.as_dict()
        trace.unit_calls = calls
        return trace

    def metadata_bytes(self) -> int:
        seen, total = set(), 0
        for t in _tensors(self.meta):
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def embed(self) -> SegmentTrace:
        model = self.model.model
        return self._trace("embedding", "embedding", lambda _: model.embed(self.ids), None, model.embed_tokens, {},
                           "embedding")

    top_name = "top (head, MTP, loss)"

    def per_forward(self) -> dict[str, int]:
        """The parts of the per-forward state (none besides the metadata in V4)."""
        return {}

    def block_traces(self) -> list[SegmentTrace]:
        """One trace per block, in order; blocks of one kind share a trace object."""
        kinds: dict[tuple, SegmentTrace] = {}
        blocks = []
        for i, layer in enumerate(self.model.model.layers):
            kind = (i == 0, *_block_kind(layer))  # the first block's input is the broadcast embedding
            if kind not in kinds:
                kinds[kind] = self.block(i)
            blocks.append(kinds[kind])
        return blocks

    def block(self, index: int) -> SegmentTrace:
        layer = self.model.model.layers[index]
        kind = f"ratio {layer.compress_ratio}{', hash' if layer.mlp.gate.is_hash else ''}{', first' if index == 0 else ''}"
        return self._trace(f"block {index} ({kind})", kind,
                           lambda x: layer(x, self.ids, self.meta, self.cp_arg),
                           self.embedded if index == 0 else self.streams, layer, BLOCK_COMPONENTS, "block input",
                           regions=BLOCK_REGIONS, scope=layer)

    def top(self) -> SegmentTrace:
        model, labels = self.model, self.ids

        outputs = []

        def run(x):  # the order of DSV4ForCausalLM.forward after the last block
            hidden = model.model.finish(x)
            mtp_hiddens, mtp_labels = model.mtp(x, model.model.embed_tokens, self.ids, self.meta, labels=labels,
                                                cp=self.cp_arg)
            out = model._head_and_loss(hidden, mtp_hiddens, labels, mtp_labels, 0, self.return_logits)
            outputs.append(out)  # the step holds its output (logits, when returned) until backward is done
            return out.loss_sum

        top_modules = nn.ModuleList([model.model.hc_head, model.model.norm, model.mtp, model.lm_head])
        trace = self._trace("top (head, MTP, loss)", "top", run, self.streams, top_modules, TOP_COMPONENTS,
                            "head and loss", held=self.root_parameters, regions=TOP_REGIONS)
        outputs.clear()
        return trace

    def whole_step(self) -> int:
        """The activation peak of one forward + backward of the whole model, traced at once (the oracle of the
        composition; slow for deep models)."""
        model = self.model
        with AllocationTracer() as tracer:
            backbone = model.model(self.ids, self.meta, self.cp_arg)
            mtp_hiddens, mtp_labels = model.mtp(backbone.streams, model.model.embed_tokens, self.ids, self.meta,
                                                labels=self.ids, cp=self.cp_arg)
            out = model._head_and_loss(backbone.hidden, mtp_hiddens, self.ids, mtp_labels, 0, self.return_logits)
            del backbone, mtp_hiddens, mtp_labels
            out.loss_sum.backward(torch.empty_like(out.loss_sum))
            peak = tracer.peak
        for p in model.parameters():
            p.grad = None
        return peak


def _leaf(shape, dtype, view: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    leaf = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
    leaf._plan_view = view
    return leaf


def _storage_bytes(*values) -> int:
    """Bytes of the distinct storages of the tensors in ``values`` (nested lists, dicts, dataclasses)."""
    seen, total = set(), 0
    for value in values:
        for t in _tensors(value):
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from _tensors(getattr(value, name))


def _block_kind(layer: DSV4Block) -> tuple:
    return (type(layer), layer.compress_ratio, layer.mlp.gate.is_hash)


def plan_activations(tracer: "StepTracer | V41StepTracer") -> ActivationPlan:
    """Trace each distinct segment once and compose the step's activation phases (see the module docstring)."""
    blocks = tracer.block_traces()
    segments = [tracer.embed(), *blocks, tracer.top()]
    names = ["embedding", *(f"block {i} ({seg.kind})" for i, seg in enumerate(blocks)), tracer.top_name]
    metadata = tracer.metadata_bytes()
    held = segments[-1].held_gradients  # the root unit's lm_head gradient, kept until backward ends
    phases = []
    before = 0
    for i, seg in enumerate(segments):
        phases.append(Phase(f"forward of {names[i]}", metadata + before + seg.forward_peak, None))
        before += seg.retained
    for i in reversed(range(len(segments))):
        seg = segments[i]
        before -= seg.retained
        extra = 0 if i == len(segments) - 1 else held
        phases.append(Phase(f"backward of {names[i]}", metadata + before + seg.backward_peak + extra, i))
    return ActivationPlan(metadata=metadata, segments=segments, phases=phases, top_name=tracer.top_name,
                          per_forward=tracer.per_forward(), metadata_traffic=tracer.metadata_traffic)


# V4.1 (dsv4.model.v41): labels of its block parts; the Engram update counts as "engram".
def _v41_labels() -> dict[type, str]:
    from dsv4.model.v41.attention import CSA2Attention
    from dsv4.model.v41.block import DSV41Block
    from dsv4.model.v41.engram import Engram
    from dsv4.model.v41.indexer import CSA2Indexer

    return {DSV41Block: "hyper_connections", HyperConnection: "hyper_connections", CSA2Attention: "attention",
            CSA2Indexer: "indexer", MoE: "moe", Engram: "engram"}


def _grad_leaves(state):
    """``state`` (a V4.1 SharedState or None) with its floating tensors as new ``meta`` leaves that take gradients
    (what the consumers backpropagate into belongs to the owner's graph)."""
    import dataclasses

    if state is None:
        return None
    leaf = lambda t: t.detach().requires_grad_(True) if t.is_floating_point() and t.requires_grad else t.detach()  # noqa: E731
    return dataclasses.replace(state, **{f.name: leaf(getattr(state, f.name)) for f in dataclasses.fields(state)
                                         if isinstance(getattr(state, f.name), torch.Tensor)})


class V41StepTracer(StepTracer):
    """:class:`StepTracer` for a DeepSeek-V4.1 model (:class:`~dsv4.model.v41.model.DSV41ForCausalLM`, one CP rank).

    The segments are V4's (embedding, blocks, top: final collapse, norm, lm_head and loss); what differs:

    * a block reads and returns the single-pass carry (the previous FFN site's mix, fp32 ``[B, L, hc]``) and the
      CSA2 :class:`~dsv4.model.v41.shared_state.SharedState`. What a Full or Reindex block publishes (compressed
      KV, index keys, top-k, candidates) stays live after its forward: it is in that block's ``retained`` bytes,
      held until its backward, as in the step. A consumer reads the state of the blocks before it, obtained by a
      forward of those blocks without gradients (on ``meta``: shapes only), as leaves taking gradients (a
      consumer's gradient flows back to the owner).
    * the per-forward Engram inputs (the hashed n-gram ids of every Engram layer and the active mask, built once
      per forward from the token ids) are counted with the attention metadata (kept all step); the ids are
      stand-ins of the real shapes (hashing needs the tokenizer and real ids).
    * block kinds: (first, attention role, ratio, Engram, candidate source, after the candidate source).
    """

    top_name = "top (head, loss)"

    def __init__(self, model, rows: int, local_len: int, cp_size: int, expert_parallel: bool,
                 return_logits: bool = False, root_parameters: set | frozenset = frozenset(),
                 cp_balance: str = "none", ep: int = 1, dispatcher: str = "alltoall",
                 unit_modules: Sequence[nn.Module] = ()) -> None:
        super().__init__(model, rows, local_len, cp_size, expert_parallel, return_logits, root_parameters, cp_balance,
                         ep, dispatcher, unit_modules)
        c = self.config
        buckets = (c.engram_max_ngram_size - 1) * c.engram_n_heads
        self.engram_inputs = None if not c.engram_layer_ids else (
            {i: torch.zeros(self.rows, self.local_len, buckets, dtype=torch.long, device="meta")
             for i in c.engram_layer_ids},
            torch.ones(self.rows, self.local_len, dtype=torch.bool, device="meta"))
        self.carry = _leaf((self.rows, self.local_len, c.hc_mult), torch.float32, lambda x: x)
        self.shared_state_bytes = 0  # set by block_traces

    def metadata_bytes(self) -> int:
        return _storage_bytes(self.meta, self.engram_inputs)

    def per_forward(self) -> dict[str, int]:
        return {"attention metadata": _storage_bytes(self.meta), "Engram n-gram ids": _storage_bytes(self.engram_inputs),
                "CSA2 shared state": self.shared_state_bytes}

    def embed(self) -> SegmentTrace:
        model = self.model.model
        return self._trace("embedding", "embedding", lambda _: model.embed_tokens(self.ids), None,
                           model.embed_tokens, {}, "embedding")

    def _kind(self, index: int) -> tuple:
        c, layer = self.config, self.model.model.layers[index]
        cand = c.candidate_source_layer_id
        return (index == 0, layer.self_attn.role, c.ratio_for_layer(index), layer.engram is not None,
                index == cand, cand is not None and index > cand)

    def block_traces(self) -> list[SegmentTrace]:
        from dsv4.model.v41.hyper_connections import first_carry

        kinds: dict[tuple, SegmentTrace] = {}
        blocks, published = [], []
        with torch.no_grad():
            x = self.embedded._plan_view(self.embedded.detach())
            carry, state = first_carry(x), None
        for i, layer in enumerate(self.model.model.layers):
            kind = self._kind(i)
            if kind not in kinds:
                kinds[kind] = self._block(i, _grad_leaves(state))
            blocks.append(kinds[kind])
            with torch.no_grad():  # the next block's input state (shapes only)
                x, carry, new = layer(x, carry, state, self.meta, self.engram_inputs, self.cp_arg)
            if new is not state:
                published.append(new)
            state = new
        self.shared_state_bytes = _storage_bytes(published)
        return blocks

    def _block(self, index: int, state) -> SegmentTrace:
        from dsv4.model.v41.hyper_connections import first_carry

        layer = self.model.model.layers[index]
        c = self.config
        kind = (f"{layer.self_attn.role}, ratio {c.ratio_for_layer(index)}"
                f"{', engram' if layer.engram is not None else ''}{', first' if index == 0 else ''}")
        held = []  # the carry and the state a block passes on stay live after its forward

        def run(x):
            carry = first_carry(x) if index == 0 else self.carry._plan_view(self.carry.clone())
            y, carry, out_state = layer(x, carry, state, self.meta, self.engram_inputs, self.cp_arg)
            held.append((carry, out_state))
            return y

        trace = self._trace(f"block {index} ({kind})", kind, run, self.embedded if index == 0 else self.streams,
                            layer, _v41_labels(), "block input", regions=BLOCK_REGIONS, scope=layer)
        held.clear()
        self.carry.grad = None
        return trace

    def top(self) -> SegmentTrace:
        from dsv4.model.v41.hyper_connections import SinglePassHyperConnection

        model, outputs = self.model, []

        def run(x):  # DSV41Model's final collapse and norm, then the head and the loss
            hidden = model.model.norm(SinglePassHyperConnection.collapse(x, self.carry))
            out = model._head_and_loss(hidden, [], self.ids, [], 0, self.return_logits)
            outputs.append(out)
            return out.loss_sum

        top_modules = nn.ModuleList([model.model.norm, model.lm_head])
        trace = self._trace(self.top_name, "top", run, self.streams, top_modules, {}, "head and loss",
                            held=self.root_parameters)
        outputs.clear()
        self.carry.grad = None
        return trace

    def whole_step(self) -> int:
        model = self.model
        with AllocationTracer(untracked=table_tensors(model)) as tracer:
            backbone = model.model(self.ids, self.meta, self.engram_inputs, self.cp_arg)
            out = model._head_and_loss(backbone.hidden, [], self.ids, [], 0, self.return_logits)
            del backbone
            out.loss_sum.backward(torch.empty_like(out.loss_sum))
            peak = tracer.peak
        for p in model.parameters():
            p.grad = None
        return peak


def step_tracer(model, *args, **kwargs) -> StepTracer:
    """The :class:`StepTracer` of ``model``'s family (:class:`V41StepTracer` for a DeepSeek-V4.1 model)."""
    cls = V41StepTracer if getattr(model.config, "model_type", None) == "deepseek_v41" else StepTracer
    return cls(model, *args, **kwargs)
