"""What would fit (dsv4.plan.suggest): the search's order and its "planned and fits" property on a case worked by
hand, and the trace reuse of SetupPlanner against fresh plans of the tiny model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsv4.config import DSV4Config
from dsv4.plan.plan import PlanSetup, memory_plan
from dsv4.plan.suggest import Change, NotPlanned, Planned, Refused, SetupPlanner, activation_key, candidates, search

# Base 100, device 80. Each change frees `FREES` units, additively, except A and B, which free the same memory (their
# plan frees max(15, 10)); the estimate is the additive sum (optimistic). Z changes nothing; F is group C's heavier
# alternative (c=2 after c=1).
Z, A, B, C, D, E = (Change(g, ((g.lower(), 1),), cost) for g, cost in
                    (("Z", 0), ("A", 1), ("B", 1), ("C", 2), ("D", 3), ("E", 2)))
F = Change("C", (("c", 2),), 4)
FREES = {Z: 0, A: 15, B: 10, C: 25, D: 30, E: 30, F: 40}


class StandIn:
    """A planner with known totals; records what it planned."""

    device_memory_bytes = 80

    def __init__(self, refuse=(), unplanned=()):
        self.planned: list[tuple[Change, ...]] = []
        self.refuse, self.unplanned = set(refuse), set(unplanned)

    def estimate(self, changes):
        if self.refuse & set(changes):
            raise Refused("the recipe refuses it\nsecond line")
        return 100 - sum(FREES[c] for c in changes)

    def total(self, changes):
        freed = sum(FREES[c] for c in changes if c not in (A, B))
        both = [FREES[c] for c in changes if c in (A, B)]
        return 100 - freed - max(both, default=0)

    def plan(self, changes):
        if self.unplanned & set(changes):
            raise NotPlanned("cap")
        self.planned.append(changes)
        return Planned(self.total(changes), note=f"planned {len(self.planned)}")


def test_candidates_are_ordered_by_cost_then_size_then_list_order():
    order = candidates([Z, A, B, C, D, E], max_changes=3)
    assert order[:8] == [(Z,), (A,), (B,), (Z, A), (Z, B), (C,), (E,), (Z, C)]
    assert all(len({c.group for c in cand}) == len(cand) for cand in order)
    assert len(order) == 6 + 15 + 20  # every set of 1, 2 and 3 of 6 distinct groups
    keys = [(sum(c.cost for c in cand), len(cand)) for cand in order]
    assert keys == sorted(keys)


def test_the_cheapest_planned_fits_worked_by_hand():
    """Walk (cost, changes): Z, A, B, Z+A, Z+B over by the estimate (100, 85, 90, 85, 90); C (75) and E (70) planned:
    fit; Z+C and Z+E hold a fit: skipped; A+B estimated 75 but planned 85: over; Z+A+B the same; D planned 70: the
    third fit, and the search stops. Ranked: E before C (same cost and size, lower total), then D."""
    planner = StandIn()
    result = search([Z, A, B, C, D, E, F], planner, count=3, max_changes=3)
    assert [s.overrides for s in result.suggestions] == [["e=1"], ["c=1"], ["d=1"]]
    assert [(s.total, s.cost, s.note) for s in result.suggestions] == [(70, 2, "planned 2"), (75, 2, "planned 1"),
                                                                       (70, 3, "planned 5")]
    assert planner.planned == [(C,), (E,), (A, B), (Z, A, B), (D,)]
    for s in result.suggestions:  # each one planned as it is, and fits
        assert s.changes in planner.planned and s.total == planner.total(s.changes) <= 80
    assert result.outcomes == {"over by an optimistic estimate": 5, "fits": 3, "over": 2,
                               "skipped (holds a fit or an unplanned candidate)": 2}
    assert "fits with: e=1  -> " in result.report() and result.as_dict()["fits_with"][0]["overrides"] == ["e=1"]


def test_a_suggestion_never_carries_what_it_does_not_need():
    """Asked for 4, the search walks on past D: every other candidate holds a fit (Z + C: a change that frees
    nothing) or goes further than one (F = c=2, where c=1 fits); none is planned, the suggestions stay E, C, D."""
    planner = StandIn()
    result = search([Z, A, B, C, D, E, F], planner, count=4, max_changes=3)
    assert [s.overrides for s in result.suggestions] == [["e=1"], ["c=1"], ["d=1"]]
    assert planner.planned == [(C,), (E,), (A, B), (Z, A, B), (D,)]
    assert sum(result.outcomes.values()) == len(candidates([Z, A, B, C, D, E, F], 3))
    with pytest.raises(ValueError, match="lightest .cheapest. first"):
        search([Z, F, C], planner)


def test_refused_and_unplanned_candidates():
    """E refused, C not planned (trace cap): C + anything is skipped (it could carry a change it does not need), a
    refused change counts as not fitting (E + A is tried: refused again, the reason listed once), D is the only fit."""
    planner = StandIn(refuse={E}, unplanned={C})
    result = search([Z, A, B, C, D, E], planner, count=2, max_changes=2)
    assert [s.overrides for s in result.suggestions] == [["d=1"]] and result.suggestions[0].total == 70
    assert planner.planned == [(A, B), (D,)]
    assert result.refusals == ["e=1: the recipe refuses it"]
    assert result.outcomes["not planned (trace cap)"] == 1 and result.outcomes["refused"] == 4  # E, Z+E, A+E, B+E
    assert "no candidate" not in result.report() and "refused: e=1: the recipe refuses it" in result.report()


@pytest.fixture(scope="module")
def tiny():
    """The tiny model cut to two blocks, 256 tokens, dp 2 x cp 1 (world 2), and its plan."""
    config = DSV4Config.preset("tiny", num_hidden_layers=2, compress_ratios=[0, 4])
    setup = PlanSetup(config, seq_len=256, cp=1, dp=2, ep=1, device_memory_bytes=1024)
    return setup, memory_plan(setup)


def test_setup_planner_reuses_a_trace_only_where_it_is_the_same(tiny):
    """Planned through the shared traces, each candidate's plan equals a fresh plan of its setup (the JSON, byte for
    byte): host offload and the optimizer state reuse the base trace, cp 2 traces once more."""
    from functools import partial

    from dsv4.plan.states import optimizer_profile
    from dsv4.training.optimizer import adamw

    base_setup, base = tiny
    bf16 = optimizer_profile(partial(adamw, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, state_dtype="bfloat16"))
    offload, state, layout, same = (Change("offload", (("trainer.offload", "optimizer"),), 8),
                                    Change("state", (("optim.state_dtype", "bfloat16"),), 1),
                                    Change("layout", (("cp", 2), ("dp", 1)), 3),
                                    Change("seed", (("seed", 5),), 0))

    def setup_of(changes):  # the recipe's keys as PlanSetup fields; a seed is not one
        setup = base_setup
        for key, value in (kv for change in changes for kv in change.settings):
            if key == "optim.state_dtype":
                setup = replace(setup, optimizer=bf16)
            elif key != "seed":
                setup = replace(setup, **{key.removeprefix("trainer."): value})
        return setup

    planner = SetupPlanner(base, setup_of, max_traces=1)
    both = memory_plan(setup_of((offload, state)))  # fresh plans: the oracle
    assert planner.plan((offload, state)) == Planned(both.total, planner.plan((offload, state)).note)
    assert planner.plan((offload, state)).total == both.total != base.total and planner.traced == 0
    assert "host offload" in planner.plan((offload,)).note and planner.plan((state,)).total < base.total
    assert planner.plan((layout,)).total == memory_plan(setup_of((layout,))).total != base.total
    assert planner.traced == 1
    assert planner.plan((layout, state)).total < planner.plan((layout,)).total and planner.traced == 1
    with pytest.raises(NotPlanned):  # a second new trace is over the cap
        planner.plan((Change("layout", (("cp", 2), ("dp", 1), ("ep", 2)), 5),))
    with pytest.raises(Refused, match="changes nothing the memory plan reads"):
        planner.plan((same,))


def test_engram_tables_in_host_memory_share_the_trace():
    """Where the Engram tables are held changes nothing the tracer reads: one trace serves both setups."""
    setup = PlanSetup(DSV4Config.preset("v41_tiny"), seq_len=256, dp=2)
    assert activation_key(replace(setup, engram_on_host=True)) == activation_key(setup)
