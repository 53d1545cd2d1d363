"""verify_block, the acceptance rule of speculative decoding, on hand-made logits (no model).

Asserted: greedy acceptance accepts the drafts up to the first one that differs from the target's argmax, then emits
the target's argmax of that row (the correction) or, after all ``K``, of row ``K`` (the bonus), ``-1`` after the
emitted tokens; sampled acceptance (speculative rejection sampling) emits a first token distributed as the target's
``p_1`` and, after an accepted first draft, a second token distributed as ``p_2`` (chi-square tests over 20000
independent rows of one batched call, drafts drawn from a very different ``q``), accepts every draft when
``q == p`` (the bonus then distributed as ``p_{K+1}``) and never accepts a draft the target gives probability 0; bad
shapes and a sampled call without ``draft_probs`` are ``ValueError`` naming the shapes.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.speculative.verify import verify_block

try:
    from scipy.stats import chi2

    CHI2_999_DF5 = float(chi2.ppf(0.999, 5))
except ImportError:  # the 0.999 quantile of the chi-square distribution with 5 degrees of freedom
    CHI2_999_DF5 = 20.515


def _one_hot_logits(best: list[list[int]], vocab: int) -> torch.Tensor:
    """``[B, K + 1, V]`` logits whose argmax of row ``k`` of batch ``b`` is ``best[b][k]`` (the others random)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(best), len(best[0]), vocab, generator=g)
    for b, row in enumerate(best):
        for k, tok in enumerate(row):
            logits[b, k, tok] = 10.0
    return logits


# --------------------------------------------------------------------------------------------------------- greedy

def test_greedy_accepts_the_matching_prefix_then_corrects_or_adds_the_bonus():
    vocab = 11
    best = [[3, 1, 4, 1, 5],   # drafts all match: 4 accepted, then the bonus 5
            [3, 1, 4, 1, 5],   # mismatch at 0
            [3, 1, 4, 1, 5],   # mismatch at 2 (a later draft that matches again is not accepted)
            [2, 7, 1, 8, 2]]   # mismatch at K - 1
    drafts = torch.tensor([[3, 1, 4, 1],
                           [9, 1, 4, 1],
                           [3, 1, 6, 1],
                           [2, 7, 1, 0]])
    v = verify_block(_one_hot_logits(best, vocab), drafts)
    assert v.accepted.tolist() == [4, 0, 2, 3]
    assert v.emitted.tolist() == [5, 1, 3, 4]
    assert v.tokens.tolist() == [[3, 1, 4, 1, 5],
                                 [3, -1, -1, -1, -1],
                                 [3, 1, 4, -1, -1],
                                 [2, 7, 1, 8, -1]]
    assert v.tokens.dtype == torch.long and v.accepted.dtype == torch.long


def test_greedy_every_mismatch_position():
    vocab, k = 9, 5
    best = torch.tensor([[1, 2, 3, 4, 5, 6]])
    logits = _one_hot_logits(best.tolist(), vocab)
    for j in range(k + 1):  # j == k: no mismatch
        drafts = best[:, :k].clone()
        if j < k:
            drafts[0, j] = 0
        v = verify_block(logits, drafts)
        assert int(v.accepted[0]) == j
        assert v.tokens[0, :j].tolist() == best[0, :j].tolist()
        assert int(v.tokens[0, j]) == int(best[0, j])  # the correction (j < k) or the bonus (j == k)
        assert (v.tokens[0, j + 1:] == -1).all()


# -------------------------------------------------------------------------------------------------------- sampled

def _sampled_case(temperature: float, rows: int = 20000, vocab: int = 6, k: int = 3):
    """Target logits shared by every row (``p_k`` fixed), a draft distribution ``q`` far from ``p`` and the drafts
    drawn from it (independently per row and position)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -0.5],
                           [-1.0, 0.0, 2.5, 0.3, 0.0, 1.0],
                           [0.0, 0.0, 0.0, 1.0, 1.0, 1.0],
                           [1.0, -2.0, 0.0, 0.0, 2.0, 0.0]])[: k + 1, :vocab]
    q = torch.tensor([[0.02, 0.05, 0.40, 0.30, 0.03, 0.20],
                      [0.50, 0.20, 0.02, 0.08, 0.15, 0.05],
                      [0.30, 0.30, 0.30, 0.04, 0.03, 0.03]])[:k, :vocab]
    q = q / q.sum(-1, keepdim=True)
    target_logits = logits.expand(rows, k + 1, vocab).contiguous()
    draft_probs = q.expand(rows, k, vocab).contiguous()
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).view(rows, k)
    p = (logits / temperature).softmax(-1)
    return target_logits, drafts, draft_probs, p


def _chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_first_and_second_tokens_follow_the_target(temperature):
    target_logits, drafts, draft_probs, p = _sampled_case(temperature)
    v = verify_block(target_logits, drafts, draft_probs, temperature, torch.Generator().manual_seed(2))
    k = drafts.shape[1]
    # rejections do happen (q is far from p), and so do full acceptances
    assert 0.2 < float((v.accepted == 0).double().mean()) < 0.9 and bool((v.accepted == k).any())
    assert (v.emitted == v.accepted + 1).all()
    positions = torch.arange(k + 1)
    assert ((v.tokens >= 0) == (positions < v.emitted[:, None])).all()
    assert (v.tokens[:, :k][positions[:k] < v.accepted[:, None]] == drafts[positions[:k] < v.accepted[:, None]]).all()
    first = v.tokens[:, 0]
    assert _chi_square(first, p[0]) < CHI2_999_DF5
    # given the first draft was accepted, the second emitted token (draft 2 accepted, or the correction) is p_2
    second = v.tokens[v.accepted >= 1, 1]
    assert second.numel() > 2000
    assert _chi_square(second, p[1]) < CHI2_999_DF5


def test_sampled_accepts_every_draft_when_q_equals_p_then_draws_the_bonus_from_the_last_row():
    temperature, rows = 0.8, 20000
    target_logits, _, _, p = _sampled_case(temperature, rows=rows)
    q = (target_logits[:, :-1].float() / temperature).softmax(-1)  # exactly the target's p: ratio 1
    drafts = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=torch.Generator().manual_seed(3)).view(rows, -1)
    v = verify_block(target_logits, drafts, q, temperature, torch.Generator().manual_seed(4))
    assert (v.accepted == drafts.shape[1]).all()
    assert v.tokens[:, :-1].equal(drafts)
    assert _chi_square(v.tokens[:, -1], p[-1]) < CHI2_999_DF5  # the bonus: p_{K+1}, the target's row K


def test_sampled_never_accepts_a_draft_the_target_excludes():
    temperature, rows, k = 1.0, 2000, 3
    target_logits, _, draft_probs, _ = _sampled_case(temperature, rows=rows)
    target_logits[:, 0, 2] = float("-inf")  # p_1(2) = 0 while q_1(2) = 0.4
    drafts = torch.full((rows, k), 2, dtype=torch.long)
    v = verify_block(target_logits, drafts, draft_probs, temperature, torch.Generator().manual_seed(5))
    assert (v.accepted == 0).all()
    assert (v.tokens[:, 0] != 2).all() and (v.tokens[:, 1:] == -1).all()


def test_sampled_is_reproducible_with_a_seeded_generator():
    target_logits, drafts, draft_probs, _ = _sampled_case(1.0, rows=500)
    a, b = (verify_block(target_logits, drafts, draft_probs, 1.0, torch.Generator().manual_seed(6)) for _ in range(2))
    assert a.tokens.equal(b.tokens) and a.accepted.equal(b.accepted)


# --------------------------------------------------------------------------------------------------------- errors

def test_shape_errors_name_the_shapes():
    logits = torch.zeros(2, 4, 7)
    with pytest.raises(ValueError, match=r"\[2, 5, 7\].*\[2, 3\]"):  # K + 1 rows expected for K = 3 drafts
        verify_block(torch.zeros(2, 5, 7), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[2, 4, 7\].*\[3, 3\]"):  # batch mismatch
        verify_block(logits, torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[2, 3, 6\]"):  # draft_probs over another vocabulary
        verify_block(logits, torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3, 6), 1 / 6), 1.0)


def test_sampled_without_draft_probs_is_refused():
    with pytest.raises(ValueError, match="draft_probs"):
        verify_block(torch.zeros(2, 4, 7), torch.zeros(2, 3, dtype=torch.long), None, 1.0)


def test_a_draft_its_own_distribution_excludes_is_rejected():
    """``q(d) = 0``: ``d`` cannot have come from ``q`` (another proposer's token, or one outside a vocabulary limit):
    rejected, so the target never emits a token it excludes."""
    logits = torch.tensor([[[0.0, 1.0, 2.0, float("-inf")], [0.0, 0.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]])
    for seed in range(20):
        verdict = verify_block(logits, torch.tensor([[3]]), q, 1.0, torch.Generator().manual_seed(seed))
        assert verdict.accepted.tolist() == [0] and verdict.tokens[0, 0].item() != 3


def test_bad_temperature_and_draft_shapes_are_refused():
    with pytest.raises(ValueError, match="temperature must be >= 0.*-1"):
        verify_block(torch.zeros(1, 2, 4), torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1, 4), 0.25), -1.0)
    with pytest.raises(ValueError, match=r"int64 \[B, K\].*\[3\]"):
        verify_block(torch.zeros(1, 4, 4), torch.zeros(3, dtype=torch.long))
