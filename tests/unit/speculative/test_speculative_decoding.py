"""Speculative decoding with the tiny V4.1 target (no Engram) on the CPU.

Asserted: greedy speculative decoding equals the target's own greedy decoding token for token, with a random-init
DSpark drafter and with a proposer that is right except one token per step (at a position that moves from step to
step: every step accepts exactly the drafts before it); a proposer that always drafts the target's greedy
continuation is accepted in full (every step emits ``K + 1``, acceptance per position all 1) and the features it gets
are the target's of the positions before the anchor; a proposer that is always wrong has acceptance length exactly 1;
``max_new_tokens`` is exact and ``eos_token_id`` ends the output right after the eos token, even inside an accepted
block; with ``vocab_limit`` no id at or above it is drafted or emitted; sampled decoding is reproducible with a
seeded generator; :class:`AcceptanceStats` arithmetic on hand-made steps.
"""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model import build_causal_lm
from dsv4.model.v41.drafter import DSparkDrafter
from dsv4.speculative.decoding import (
    AcceptanceStats,
    DSparkProposer,
    Proposal,
    TargetRunner,
    greedy_generate,
    speculative_generate,
)

MAX_NEW = 12


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = DSV4Config.preset("v41_tiny", engram_layer_ids=[], engram_num_embeddings=[])
    target = build_causal_lm(cfg).eval()
    drafter = DSparkDrafter(cfg)
    drafter.copy_target_embeddings(target)
    drafter.eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g) for n in (12, 16, 20)]
    layers = cfg.dspark_target_layer_ids
    # the target's greedy continuation, long enough for every proposer below (a runner of its own)
    reference = TargetRunner(target, layers)
    greedy = [greedy_generate(reference, p, MAX_NEW + cfg.dspark_block_size + 1).tokens for p in prompts]
    return {"cfg": cfg, "target": target, "drafter": drafter, "prompts": prompts, "greedy": greedy,
            "layers": layers, "k": cfg.dspark_block_size}


class OracleProposer:
    """Drafts the target's greedy continuation ``greedy`` (``[P + n]``) after ``tokens``, with the token at
    ``wrong(step)`` (None: none) replaced by another one; records what it was called with."""

    def __init__(self, greedy: torch.Tensor, block_size: int, vocab: int, wrong=lambda step: None) -> None:
        self.greedy, self.block_size, self.vocab, self.wrong = greedy, block_size, vocab, wrong
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def propose(self, tokens: torch.Tensor, features: torch.Tensor) -> Proposal:
        n = tokens.shape[0]
        assert tokens.equal(self.greedy[:n]), "the decoding left the target's greedy path"
        assert features.shape[0] == n - 1, "features are the target's of the positions before the anchor"
        drafts = self.greedy[n: n + self.block_size].clone()
        assert drafts.shape[0] == self.block_size
        j = self.wrong(len(self.calls))
        if j is not None:
            drafts[j] = (drafts[j] + 1) % self.vocab
        self.calls.append((tokens.clone(), features.clone()))
        return Proposal(drafts)


class WrongProposer:
    """Drafts a token other than the target's argmax at every position (its argmax + 1)."""

    def __init__(self, target: TargetRunner, block_size: int) -> None:
        self.target, self.block_size = target, block_size

    def propose(self, tokens: torch.Tensor, features: torch.Tensor) -> Proposal:
        drafts = []
        for _ in range(self.block_size):
            logits, _ = self.target.run(torch.cat((tokens, torch.tensor(drafts, dtype=tokens.dtype))), keep=1)
            drafts.append((int(logits[-1].argmax()) + 1) % logits.shape[-1])
        return Proposal(torch.tensor(drafts))


class Recording:
    """Wraps a proposer; keeps every proposal."""

    def __init__(self, inner) -> None:
        self.inner, self.block_size, self.proposals = inner, inner.block_size, []

    def propose(self, tokens, features):
        out = self.inner.propose(tokens, features)
        self.proposals.append(out)
        return out


def test_greedy_with_a_random_drafter_equals_greedy(setup):
    runner = TargetRunner(setup["target"], setup["layers"])
    stats = AcceptanceStats(setup["k"])
    for prompt, greedy in zip(setup["prompts"], setup["greedy"]):
        out = speculative_generate(runner, DSparkProposer(setup["drafter"]), prompt, MAX_NEW, stats=stats)
        assert out.new_tokens == MAX_NEW
        assert out.tokens.tolist() == greedy[: prompt.numel() + MAX_NEW].tolist()
    summary = stats.summary()
    assert 1 <= summary["acceptance_length"] <= setup["k"] + 1
    assert len(summary["confidence_mean_per_position"]) == setup["k"]  # the drafter's confidence was recorded
    assert runner.forwards == len(setup["prompts"]) + summary["drafting_steps"]


def test_greedy_with_partial_acceptance_equals_greedy(setup):
    k, vocab = setup["k"], setup["cfg"].vocab_size
    wrong = [2, 0, 4, 1, 3, None]  # step s drafts a wrong token at wrong[(s + offset) % 6] (None: all right)
    runner = TargetRunner(setup["target"], setup["layers"])
    stats = AcceptanceStats(k)
    expected_accepted = []
    # offsets per prompt such that the steps cover every position and the full block: 2 0 4 1 | 1 3 - | 3 - 2
    for offset, prompt, greedy in zip((0, 3, 4), setup["prompts"], setup["greedy"]):
        proposer = OracleProposer(greedy, k, vocab, lambda s, offset=offset: wrong[(s + offset) % len(wrong)])
        out = speculative_generate(runner, proposer, prompt, MAX_NEW, stats=stats)
        assert out.tokens.tolist() == greedy[: prompt.numel() + MAX_NEW].tolist()
        # each step emitted exactly the drafts before the wrong one, then the target's correction (or the bonus)
        lengths = [c[0].shape[0] for c in proposer.calls]
        steps = [k if (j := wrong[(s + offset) % len(wrong)]) is None else j for s in range(len(lengths))]
        assert [b - a for a, b in pairwise(lengths)] == [a + 1 for a in steps[:-1]]
        expected_accepted += steps
        if prompt is setup["prompts"][0]:  # the features each step got: the target's over the tokens before the anchor
            for tokens, features in proposer.calls:
                torch.testing.assert_close(features, runner.run(tokens[:-1], keep=1)[1], atol=1e-5, rtol=0)
    summary = stats.summary()
    assert sorted(set(expected_accepted)) == list(range(k + 1))
    assert stats.steps == len(expected_accepted)
    assert summary["acceptance_length"] == pytest.approx(1 + sum(expected_accepted) / len(expected_accepted))
    assert 1 < summary["acceptance_length"] < k + 1  # partial acceptance
    assert summary["acceptance_per_position"] == pytest.approx(
        [sum(a > i for a in expected_accepted) / len(expected_accepted) for i in range(k)])


def test_the_target_own_continuation_is_accepted_in_full(setup):
    k, vocab = setup["k"], setup["cfg"].vocab_size
    runner = TargetRunner(setup["target"], setup["layers"])
    stats = AcceptanceStats(k)
    prompt, greedy = setup["prompts"][0], setup["greedy"][0]
    proposer = OracleProposer(greedy, k, vocab)
    out = speculative_generate(runner, proposer, prompt, MAX_NEW, stats=stats)
    assert out.tokens.tolist() == greedy[: prompt.numel() + MAX_NEW].tolist()
    lengths = [c[0].shape[0] for c in proposer.calls]
    assert lengths == [prompt.numel() + 1 + s * (k + 1) for s in range(math.ceil((MAX_NEW - 1) / (k + 1)))]
    summary = stats.summary()
    assert summary["acceptance_length"] == k + 1
    assert summary["acceptance_per_position"] == [1.0] * k
    assert summary["conditional_acceptance_per_position"] == [1.0] * k
    assert runner.forwards == 1 + len(lengths)  # the prefill, then one forward per block
    # the features a step gets are the target's of every position before the anchor
    ref = TargetRunner(setup["target"], setup["layers"])
    for tokens, features in proposer.calls:
        assert features.shape[0] == tokens.shape[0] - 1
        _, direct = ref.run(tokens[:-1], keep=1)
        torch.testing.assert_close(features, direct, atol=1e-5, rtol=0)


def test_an_always_wrong_proposer_has_acceptance_length_one(setup):
    runner = TargetRunner(setup["target"], setup["layers"])
    stats = AcceptanceStats(setup["k"])
    prompt, greedy = setup["prompts"][1], setup["greedy"][1]
    out = speculative_generate(runner, WrongProposer(TargetRunner(setup["target"], setup["layers"]), setup["k"]),
                               prompt, 4, stats=stats)
    assert out.tokens.tolist() == greedy[: prompt.numel() + 4].tolist()
    summary = stats.summary()
    assert summary["drafting_steps"] == 3 and summary["acceptance_length"] == 1
    assert summary["acceptance_per_position"] == [0.0] * setup["k"]
    assert summary["conditional_acceptance_per_position"][0] == 0
    assert all(math.isnan(x) for x in summary["conditional_acceptance_per_position"][1:])  # never reached


def test_max_new_tokens_is_exact_and_eos_stops_right_after_it(setup):
    k, vocab = setup["k"], setup["cfg"].vocab_size
    prompt, greedy = setup["prompts"][2], setup["greedy"][2]
    p = prompt.numel()
    runner = TargetRunner(setup["target"], setup["layers"])
    for n in (1, 2, 7, MAX_NEW):  # a full block accepted at every step overshoots 7 and 12 (1 + 6 + 6)
        out = speculative_generate(runner, OracleProposer(greedy, k, vocab), prompt, n)
        assert out.new_tokens == n and out.tokens.tolist() == greedy[: p + n].tolist()
    new = greedy[p: p + MAX_NEW].tolist()
    for at in (0, 4):  # eos as the prefill's token; eos inside an accepted block (its drafts after it dropped)
        eos = new[at]
        stop = new.index(eos)  # its first occurrence
        out = speculative_generate(runner, OracleProposer(greedy, k, vocab), prompt, MAX_NEW, eos_token_id=eos)
        assert out.tokens.tolist() == greedy[: p + stop + 1].tolist() and out.new_tokens == stop + 1
        assert greedy_generate(runner, prompt, MAX_NEW, eos_token_id=eos).tokens.tolist() == out.tokens.tolist()
    random = speculative_generate(runner, DSparkProposer(setup["drafter"]), prompt, 5)
    assert random.new_tokens == 5 and random.tokens.tolist() == greedy[: p + 5].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_vocab_limit_bounds_every_drafted_and_emitted_id(setup, temperature):
    limit = 256
    assert any(t >= limit for g, p in zip(setup["greedy"], setup["prompts"]) for t in g[p.numel():].tolist())
    runner = TargetRunner(setup["target"], setup["layers"], vocab_limit=limit)
    generator = torch.Generator().manual_seed(3)
    proposer = Recording(DSparkProposer(setup["drafter"], temperature, generator, vocab_limit=limit))
    for prompt in setup["prompts"][:2]:
        out = speculative_generate(runner, proposer, prompt, MAX_NEW, temperature=temperature, generator=generator)
        assert out.new_tokens == MAX_NEW
        assert int(out.tokens[prompt.numel():].max()) < limit
    assert all(int(p.tokens.max()) < limit for p in proposer.proposals)
    if temperature:
        assert all(float(p.probs[:, limit:].sum()) == 0 for p in proposer.proposals)


def test_sampled_decoding_is_reproducible_with_a_seeded_generator(setup):
    runner = TargetRunner(setup["target"], setup["layers"])

    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        proposer = DSparkProposer(setup["drafter"], 1.0, generator)
        stats = AcceptanceStats(setup["k"])
        outs = [speculative_generate(runner, proposer, p, 10, temperature=1.0, generator=generator, stats=stats)
                for p in setup["prompts"][:2]]
        assert all(o.new_tokens == 10 for o in outs)
        return [o.tokens.tolist() for o in outs], stats.summary()

    (a, sa), (b, sb), (c, _) = run(7), run(7), run(8)
    assert a == b and sa["acceptance_per_position"] == sb["acceptance_per_position"]
    assert a != c  # another seed draws other tokens (the target is close to uniform: 384 ids)
    # sampled, not greedy (the prefill's token included): the random-init target is close to uniform (its argmax has
    # probability < 0.005), so of the 20 new tokens at most one is the target's argmax (about 1 in 200 such runs has 2)
    argmax = 0
    for tokens in a:
        logits, _ = runner.run(torch.tensor(tokens[:-1]), keep=10)
        assert float(logits.softmax(-1).max()) < 0.01
        argmax += int((logits.argmax(-1) == torch.tensor(tokens[-10:])).sum())
    assert argmax <= 1


def test_acceptance_stats_arithmetic():
    stats = AcceptanceStats(5)
    confidence = [torch.tensor([0.92, 0.8, 0.7, 0.6, 0.5]),
                  torch.tensor([0.96, 0.15, 0.35, 0.6, 0.5]),
                  torch.tensor([0.55, 0.85, 0.25, 0.65, 0.05])]
    for accepted, conf in zip((0, 2, 5), confidence):
        stats.add(accepted, conf)
    s = stats.summary()
    assert s["drafting_steps"] == 3 and s["block_size"] == 5
    assert s["acceptance_length"] == pytest.approx((1 + 3 + 6) / 3)
    assert s["acceptance_per_position"] == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert s["acceptance_length"] == pytest.approx(1 + sum(s["acceptance_per_position"]))
    # reached: position 0 by all three steps, 1 and 2 by the last two, 3 and 4 by the last one
    assert s["conditional_acceptance_per_position"] == pytest.approx([2 / 3, 1, 1 / 2, 1, 1])
    # calibration over the verified drafts only: (position, predicted, accepted)
    records = [(0, 0.92, 0), (0, 0.96, 1), (1, 0.15, 1), (2, 0.35, 0),
               (0, 0.55, 1), (1, 0.85, 1), (2, 0.25, 1), (3, 0.65, 1), (4, 0.05, 1)]
    assert s["confidence_mean_per_position"] == pytest.approx([(0.92 + 0.96 + 0.55) / 3, 0.5, 0.3, 0.65, 0.05])
    assert s["confidence_observed_per_position"] == pytest.approx([2 / 3, 1, 1 / 2, 1, 1])
    assert s["confidence_brier"] == pytest.approx(sum((p - a) ** 2 for _, p, a in records) / 9)
    # bins of width 0.1 (no value near an edge: float32 confidences): {0.05}, {0.15}, {0.25}, {0.35}, {0.55},
    # {0.65}, {0.85}, {0.92, 0.96} (observed 1/2)
    ece = (0.95 + 0.85 + 0.75 + 0.35 + 0.45 + 0.35 + 0.15 + 2 * abs(0.5 - 0.94)) / 9
    assert s["confidence_ece"] == pytest.approx(ece)
    empty = AcceptanceStats(3).summary()
    assert math.isnan(empty["acceptance_length"]) and all(math.isnan(v) for v in empty["acceptance_per_position"])
    assert "confidence_brier" not in empty
