"""What would fit: when a plan exceeds the device, plan candidate changes of the run's options and keep the cheapest
that fit.

A :class:`Change` is one option set to another value (one or more Hydra overrides, e.g. ``cp=16 dp=4``), in an
option group (one change per group in a candidate), with a throughput cost rank (an integer: 0 costs nothing, more
costs more; the recipe's table is in :mod:`dsv4.training.planning` and docs/memory.md). A candidate is a set of
changes from distinct groups, at most ``max_changes`` of them.

**Order ("cheapest").** Candidates are ranked by the sum of their changes' costs, then by the number of changes,
then by the per-rank total of their plan (lower first). :func:`search` walks the candidates in that order (the
total breaks ties among the ones found) and stops once it has ``count`` suggestions and the next candidate ranks
lower than the last one found. With ``rank_by="step_time"`` it walks every candidate within its bounds instead and
keeps the ``count`` fits with the shortest estimated step (:attr:`Planned.seconds`, the plan's
:attr:`~dsv4.plan.comm.CommPlan.step_seconds`; then the cheapest).

**Fits.** A plan fits when its total is at most the planner's ``device_memory_bytes``: for :class:`SetupPlanner`
the device memory less the plan's reserve (:attr:`~dsv4.plan.plan.PlanSetup.usable_memory_bytes`).

**What is suggested.** A candidate is suggested only when its own plan fits: ``planner.plan`` (a full memory plan
of that candidate's setup) returns a per-rank total at most the device memory. Never an extrapolation: an estimate
only decides whether to plan. A candidate is also suggested only when each candidate one step less than it (one
change left out, or replaced by the lighter alternative of its group) is known not to fit (its plan is over, its
optimistic estimate is over, or the recipe refuses it): a suggestion never carries a change, or a part of one, that it
does not need. Candidates that go further than a suggestion are not planned.

**Bounds.** At most ``max_changes`` changes per candidate and ``max_candidates`` candidates evaluated;
:class:`SetupPlanner` traces at most ``max_traces`` new activation setups (a trace is the expensive part of a plan:
about 7 s for V4 Flash at 16K tokens per rank on a CPU). Options that do not change what is traced (the
optimizer state, host offload, Engram tables in host memory, dp) reuse a trace (:func:`activation_key`); a candidate whose activations are not
traced yet is first estimated optimistically (:func:`optimistic_activations`), and planned only when that estimate
fits.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

from dsv4.plan.activations import ActivationPlan
from dsv4.plan.comm import LinkSpeeds
from dsv4.plan.plan import GIB, MemoryPlan, PlanSetup, memory_plan
from dsv4.plan.states import OptimizerProfile

log = logging.getLogger("dsv4")

# what the search records for each candidate it walked
FITS, OVER, OVER_ESTIMATE, REFUSED, NOT_PLANNED, REDUNDANT, NOT_EVALUATED = (
    "fits", "over", "over by an optimistic estimate", "refused", "not planned (trace cap)",
    "skipped (holds a fit or an unplanned candidate)", "not evaluated (candidate cap)")
_KNOWN_NOT_TO_FIT = (OVER, OVER_ESTIMATE, REFUSED)


@dataclass(frozen=True)
class Change:
    """One option changed: ``settings`` (config key, new value) pairs, printed as the Hydra overrides ``key=value``;
    its option ``group`` (a candidate changes each group at most once) and ``cost`` (throughput cost rank, >= 0).
    The changes of one group are listed lightest first: each goes further than the one before it (e.g. bf16, then
    8-bit moments) and costs more."""

    group: str
    settings: tuple[tuple[str, Any], ...]
    cost: int

    def __post_init__(self) -> None:
        if self.cost < 0 or not self.settings:
            raise ValueError(f"Change {self.group}: cost must be >= 0 and settings non-empty, got {self.cost}, "
                             f"{self.settings}")

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.settings]


class Refused(Exception):
    """The candidate is not a valid run (the recipe's own checks refuse it), or changes nothing the plan reads."""


class NotPlanned(Exception):
    """The candidate was not planned: it needs a new trace and the trace cap is reached."""


RANK_BY = ("cost", "step_time")


@dataclass(frozen=True)
class Planned:
    """A candidate's plan: its per-rank ``total``, a ``note`` for the report (e.g. host memory) and its estimated
    step time in seconds (``seconds``; None: not estimated)."""

    total: int
    note: str = ""
    seconds: float | None = field(default=None, compare=False)


class CandidatePlanner(Protocol):
    """What :func:`search` plans with. ``device_memory_bytes``: what a plan's total must fit (a planner may also name
    ``reserve_bytes``, kept free beside it, for the report). ``estimate``: a lower estimate of the candidate's
    per-rank total (cheap; it decides only whether to plan), or its :class:`Planned` plan when planning it is as
    cheap; ``plan``: the candidate's plan. Both raise :class:`Refused`; ``plan`` may raise :class:`NotPlanned`."""

    device_memory_bytes: int

    def estimate(self, changes: tuple[Change, ...]) -> int | Planned: ...

    def plan(self, changes: tuple[Change, ...]) -> Planned: ...


@dataclass(frozen=True)
class Suggestion:
    """A candidate whose plan fits: its changes (in the order of the change list), its planned per-rank total."""

    changes: tuple[Change, ...]
    total: int
    note: str = ""
    seconds: float | None = None  # the estimated step time (dsv4.plan.comm), None when not estimated

    @property
    def overrides(self) -> list[str]:
        return [o for c in self.changes for o in c.overrides]

    @property
    def cost(self) -> int:
        return sum(c.cost for c in self.changes)

    def rank(self) -> tuple[int, int, int]:
        return (self.cost, len(self.changes), self.total)

    def time_rank(self) -> tuple:
        """The order of ``rank_by="step_time"``: the shortest estimated step first (unestimated last), then
        :meth:`rank`."""
        return (self.seconds is None, self.seconds or 0.0, *self.rank())

    def line(self) -> str:
        note = f"  ({self.note})" if self.note else ""
        step = "" if self.seconds is None else f", step about {_time(self.seconds)}"
        return f"  fits with: {' '.join(self.overrides)}  -> {_gib(self.total)}{step}{note}"

    def as_dict(self) -> dict[str, Any]:
        return {"overrides": self.overrides, "per_rank_total_bytes": self.total, "cost": self.cost,
                "changes": len(self.changes), "note": self.note, "step_seconds": self.seconds}


@dataclass
class SearchResult:
    """The suggestions (cheapest first) and what the search did: ``outcomes`` counts the candidates walked by
    outcome, ``refusals`` the distinct reasons candidates were refused, ``traced`` the new traces planned."""

    suggestions: list[Suggestion]
    device_memory_bytes: int
    max_changes: int
    outcomes: Counter = field(default_factory=Counter)
    refusals: list[str] = field(default_factory=list)
    traced: int = 0
    reserve_bytes: int = 0  # kept free beside device_memory_bytes (the plan's reserve), for the report
    rank_by: str = "cost"

    def report(self) -> str:
        """The lines ``plan=true`` prints after the plan."""
        device = _gib(self.device_memory_bytes)
        if self.reserve_bytes:
            device += f" ({_gib(self.device_memory_bytes + self.reserve_bytes)} less the {_gib(self.reserve_bytes)} reserve)"
        if self.suggestions:
            order = ("cheapest first: summed throughput cost, then fewest changes, then the lowest total"
                     if self.rank_by == "cost" else
                     "fastest first: the estimated step time, then the cheapest")
            lines = [f"what would fit {device} per rank ({order}; each one planned):"]
            lines += [s.line() for s in self.suggestions]
        else:
            lines = [f"what would fit {device} per rank: no candidate of at most {self.max_changes} changes was "
                     "planned to fit"]
        walked = ", ".join(f"{n} {what}" for what, n in self.outcomes.most_common())
        lines.append(f"  searched {sum(self.outcomes.values())} candidates of at most {self.max_changes} changes "
                     f"({walked}; {self.traced} new activation traces)")
        lines += [f"  refused: {reason}" for reason in self.refusals[:3]]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """``memory_plan.json``'s ``suggestions``."""
        return {"device_memory_bytes": self.device_memory_bytes, "reserve_bytes": self.reserve_bytes,
                "max_changes": self.max_changes, "rank_by": self.rank_by,
                "fits_with": [s.as_dict() for s in self.suggestions], "outcomes": dict(self.outcomes),
                "refusals": list(self.refusals), "new_traces": self.traced}


def candidates(changes: Sequence[Change], max_changes: int) -> list[tuple[Change, ...]]:
    """Every set of at most ``max_changes`` changes from distinct groups, in the search order: summed cost, then
    number of changes, then the order of ``changes``."""
    out = []
    for size in range(1, max_changes + 1):
        for combo in itertools.combinations(range(len(changes)), size):
            groups = [changes[i].group for i in combo]
            if len(set(groups)) == size:
                out.append(combo)
    out.sort(key=lambda combo: (sum(changes[i].cost for i in combo), len(combo), combo))
    return [tuple(changes[i] for i in combo) for combo in out]


def search(changes: Sequence[Change], planner: CandidatePlanner, *, count: int = 3, max_changes: int = 3,
           max_candidates: int = 64, rank_by: str = "cost") -> SearchResult:
    """The cheapest (module docstring) ``count`` candidates whose plan fits ``planner.device_memory_bytes``; with
    ``rank_by="step_time"`` the ``count`` fits with the shortest estimated step among every candidate walked.

    Invariants: every suggestion's ``total`` is what ``planner.plan`` returned for exactly its changes, and is at
    most the device memory; every candidate one step less than a suggestion (a change left out, or replaced by the
    lighter alternative of its group) is known not to fit."""
    if count < 1 or max_changes < 1 or max_candidates < 1:
        raise ValueError(f"search: count, max_changes and max_candidates must be >= 1, got {count}, {max_changes}, "
                         f"{max_candidates}")
    if rank_by not in RANK_BY:
        raise ValueError(f"search: rank_by must be one of {', '.join(RANK_BY)}, got {rank_by!r}")
    for i, c in enumerate(changes):
        if any(p.group == c.group and p.cost > c.cost for p in changes[:i]):
            raise ValueError(f"search: the changes of group {c.group!r} must be listed lightest (cheapest) first: "
                             f"{' '.join(c.overrides)} (cost {c.cost}) follows a costlier one")
    device = planner.device_memory_bytes
    lighter = {c: next((p for p in reversed(changes[:i]) if p.group == c.group), None) for i, c in enumerate(changes)}
    status: dict[frozenset[Change], str] = {}
    found: list[Suggestion] = []
    result = SearchResult(found, device, max_changes, reserve_bytes=getattr(planner, "reserve_bytes", 0),
                          rank_by=rank_by)
    evaluated = 0
    last_found: tuple[int, int] | None = None
    walk = candidates(changes, max_changes)
    for n, cand in enumerate(walk):
        rank = (sum(c.cost for c in cand), len(cand))
        if rank_by == "cost" and len(found) >= count and rank != last_found:
            break
        ids = frozenset(cand)
        # one step less: a change left out, or replaced by the lighter alternative of its group (none: the base)
        less = [ids - {c} | ({lighter[c]} if lighter[c] else set()) for c in cand]
        if any(s and status.get(s) not in _KNOWN_NOT_TO_FIT for s in less):
            outcome = REDUNDANT
        elif evaluated == max_candidates:
            result.outcomes[NOT_EVALUATED] += len(walk) - n
            break
        else:
            evaluated += 1
            outcome = _evaluate(cand, planner, device, result)
            if outcome == FITS:
                last_found = rank
        log.debug("what would fit: %s: %s", " ".join(o for c in cand for o in c.overrides), outcome)
        status[ids] = outcome
        result.outcomes[outcome] += 1
    found.sort(key=Suggestion.rank if rank_by == "cost" else Suggestion.time_rank)
    del found[count:]
    return result


def _evaluate(cand: tuple[Change, ...], planner: CandidatePlanner, device: int, result: SearchResult) -> str:
    try:
        estimate = planner.estimate(cand)
        if isinstance(estimate, Planned):  # planned already (cheaply): the estimate is the plan
            planned = estimate
        elif estimate > device:
            return OVER_ESTIMATE
        else:
            planned = planner.plan(cand)
    except Refused as err:
        reason = str(err).splitlines()[0]
        if not any(r.endswith(f": {reason}") for r in result.refusals):
            result.refusals.append(f"{' '.join(o for c in cand for o in c.overrides)}: {reason}")
        return REFUSED
    except NotPlanned:
        return NOT_PLANNED
    if planned.total > device:
        return OVER
    result.suggestions.append(Suggestion(cand, planned.total, planned.note, planned.seconds))
    return FITS


def activation_key(setup: PlanSetup) -> str:
    """What the traced activations of ``setup`` depend on: the setup less the fields :func:`memory_plan` does not pass
    to the tracer (``dp``, the optimizer, the device memory and its reserve, the checkpoint staging, host offload,
    where the Engram tables are held, the link speeds). Setups with equal
    keys have equal :class:`~dsv4.plan.activations.ActivationPlan`, so one trace serves them all (pipeline stages
    compose theirs from the whole step's trace: ``pp``, the schedule and the microbatches are not in the key)."""
    return repr(replace(setup, dp=1, optimizer=OptimizerProfile(), device_memory_bytes=GIB, async_checkpoint=True,
                        offload="none", engram_on_host=False, reserve_bytes=0, links=LinkSpeeds(), pp=1,
                        pp_schedule="1f1b", pp_virtual=1, microbatches=1))


def optimistic_activations(base: MemoryPlan, setup: PlanSetup) -> ActivationPlan:
    """An optimistic (low) estimate of ``setup``'s activation phases from ``base``'s traced ones, for deciding whether
    ``setup`` is worth a trace. Every phase of ``base`` is scaled by the ratio of rows per rank (micro batch x
    tokens per CP rank: cp and micro batch changes), less what the changed options could free at most:

    * routed experts in chunks (``moe_chunk_tokens``) or another ``ep``: the largest MoE part of a block's backward;
    * a smaller loss chunk: the logits block and its gradient, ``2 x rows x vocab x 4`` bytes fewer;
    * another recompute mode: every block's saved bytes besides its input.

    A setup that differs from ``base`` in anything else the trace reads, or has pipeline stages (which compose their
    activations from the segments, :mod:`dsv4.plan.stages`), is estimated with no activations at all."""
    b, acts = base.setup, base.traced
    c, bc = setup.config, b.config
    known = replace(setup, micro_batch_size=b.micro_batch_size, seq_len=b.seq_len, cp=b.cp, ep=b.ep,
                    config=replace(c, moe_chunk_tokens=bc.moe_chunk_tokens, loss_chunk_size=bc.loss_chunk_size,
                                   activation_checkpointing=bc.activation_checkpointing))
    if activation_key(known) != activation_key(b) or setup.pipelined:
        return replace(acts, metadata=0, phases=[replace(p, activations=0) for p in acts.phases],
                       segments=[replace(seg, forward_peak=0, retained=0, backward_peak=0) for seg in acts.segments])
    ratio = (setup.micro_batch_size * setup.seq_len / setup.cp) / (b.micro_batch_size * b.seq_len / b.cp)
    blocks = [seg for seg in acts.segments if seg.name.startswith("block")]
    freed = 0
    if c.moe_chunk_tokens != bc.moe_chunk_tokens or setup.ep != b.ep:
        freed += max((seg.backward_peak_by_component.get("moe", 0) for seg in blocks), default=0)
    tokens = b.micro_batch_size * b.seq_len // b.cp
    if c.loss_chunk_size < bc.loss_chunk_size:
        freed += 2 * (min(bc.loss_chunk_size, tokens) - min(c.loss_chunk_size, tokens)) * c.vocab_size * 4
    if c.activation_checkpointing != bc.activation_checkpointing:
        freed += sum(max(seg.retained - seg.saved_by_component.get("block input", 0), 0) for seg in blocks)
    return replace(acts, phases=[replace(p, activations=max(int(p.activations * ratio - freed * ratio), 0))
                                 for p in acts.phases])


class SetupPlanner:
    """Plans candidates of the run ``base`` was planned for (a :class:`CandidatePlanner`).

    ``setup_of(changes)``: the candidate's :class:`PlanSetup` (raises :class:`Refused` for a candidate the recipe
    refuses); it must keep the world size of ``base``. Traces are shared by :func:`activation_key` (``base``'s is
    known); at most ``max_traces`` new ones. ``note(setup, plan)``: the line's note (the host memory of host offload
    and of Engram tables held there is added to it). A candidate whose setup equals ``base``'s is refused: its overrides change nothing the plan reads."""

    def __init__(self, base: MemoryPlan, setup_of: Callable[[tuple[Change, ...]], PlanSetup], max_traces: int = 3,
                 note: Callable[[PlanSetup, MemoryPlan], str] | None = None) -> None:
        self.base, self.setup_of, self.max_traces, self.note = base, setup_of, max_traces, note
        self.device_memory_bytes = base.setup.usable_memory_bytes  # what a candidate's total must fit
        self.reserve_bytes = base.setup.reserve_bytes
        self.traces: dict[str, ActivationPlan] = {activation_key(base.setup): base.traced}
        self.traced = 0
        self._setups: dict[tuple[Change, ...], PlanSetup] = {}
        self._plans: dict[tuple[Change, ...], Planned] = {}

    def setup(self, changes: tuple[Change, ...]) -> PlanSetup:
        if changes not in self._setups:
            base = self.base.setup
            setup = replace(self.setup_of(changes), device_memory_bytes=base.device_memory_bytes,
                            reserve_bytes=base.reserve_bytes, links=base.links)
            if setup == base:
                raise Refused("changes nothing the memory plan reads")
            if setup.gpus != base.gpus:
                raise Refused(f"world size {setup.gpus} is not the run's {base.gpus}")
            self._setups[changes] = setup
        return self._setups[changes]

    def estimate(self, changes: tuple[Change, ...]) -> int | Planned:
        setup = self.setup(changes)
        if activation_key(setup) in self.traces:  # no new trace: plan it
            return self.plan(changes)
        return memory_plan(setup, optimistic_activations(self.base, setup)).total

    def plan(self, changes: tuple[Change, ...]) -> Planned:
        if changes not in self._plans:
            setup = self.setup(changes)
            key = activation_key(setup)
            if key not in self.traces:
                if self.traced >= self.max_traces:
                    raise NotPlanned(f"{self.max_traces} new traces planned already")
                self.traced += 1
            plan = memory_plan(setup, self.traces.get(key))
            self.traces[key] = plan.traced
            note = self.note(setup, plan) if self.note is not None else ""
            if plan.host_offload_bytes:
                note = ", ".join(n for n in (note, f"host offload {_gib(plan.host_offload_bytes)} per rank") if n)
            if plan.engram_host_bytes:
                note = ", ".join(n for n in (note, f"Engram tables in host memory {_gib(plan.engram_host_bytes)} per "
                                                   "rank") if n)
            self._plans[changes] = Planned(plan.total, note, plan.step_seconds)
        return self._plans[changes]


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _time(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"
