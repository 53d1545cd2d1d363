"""Speculative decoding with a DSpark drafter, to measure real acceptance: the drafter proposes a block from the
target's features, the target verifies it (:mod:`dsv4.speculative.verify`).

One step, for the tokens ``x_0 .. x_a`` emitted so far (``x_a``, the anchor, is the last one; the target has not run
on it yet) and the target features of positions ``< a`` from the target's previous forward:

1. the proposer drafts ``K`` tokens ``d_1 .. d_K`` (:class:`DSparkProposer`: one parallel drafter pass over the
   block anchored at ``a``, then its Markov head left to right: slot ``k``'s bias reads the token drafted for slot
   ``k - 1``, slot 0's the anchor, as serving engines sample a DSpark block; greedy or sampled at the decoding
   temperature; every slot's confidence is recorded);
2. the target runs on ``x_0 .. x_a, d_1 .. d_K`` (:class:`TargetRunner`; on the CPU it recomputes the whole prefix,
   there is no KV cache): its logits at ``a .. a + K`` verify the block, its features of the accepted positions
   feed the next step;
3. ``accepted + 1`` tokens are emitted; the last becomes the next anchor.

``vocab_limit`` (the tokenizer's vocabulary, when the model's is padded beyond it) restricts both the target and
the drafter to ids below it (logits above set to -inf), so the decoding never emits an id the tokenizer cannot
decode (nor one a V4.1 target's Engram cannot hash).

The first token comes from the target's forward over the prompt (the prefill), as in serving. The whole block is
always verified (no confidence cut), so the statistics measure the drafter; tokens past ``max_new_tokens`` (or
after ``eos_token_id``) are dropped from the output, not from the statistics.

:class:`AcceptanceStats` (:meth:`~AcceptanceStats.summary`): ``acceptance_length``, the mean tokens per target
forward of the drafting steps (accepted + 1, the bonus included; the prefill not counted);
``acceptance_per_position`` ``[K]``, the share of steps whose draft ``k`` was accepted (so ``acceptance_length =
1 + sum``); ``conditional_acceptance_per_position``, the same among steps that reached ``k``; the confidence head's
calibration on every verified draft: mean predicted probability and observed acceptance per position, the Brier
score and the expected calibration error over 10 equal-width bins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from dsv4.model.v41.draft_blocks import DraftBlocks
from dsv4.speculative.capture import FeatureCapture
from dsv4.speculative.verify import verify_block

CALIBRATION_BINS = 10


@dataclass(frozen=True)
class Proposal:
    """``tokens [K]`` int64; ``probs [K, V]`` (what each was drawn from; sampled decoding) or None; ``confidence
    [K]`` (the drafter's acceptance probabilities) or None."""

    tokens: Tensor
    probs: Tensor | None = None
    confidence: Tensor | None = None


class Proposer(Protocol):
    """Drafts ``block_size`` tokens after ``tokens [n]`` (the last one the anchor) from the target's features of the
    positions before it, ``features [n - 1, n_targets * d]``."""

    block_size: int

    def propose(self, tokens: Tensor, features: Tensor) -> Proposal: ...


def limit_vocab(logits: Tensor, vocab_limit: int | None) -> Tensor:
    """``logits [..., V]`` with the ids ``>= vocab_limit`` at -inf (unchanged for None)."""
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    return logits.index_fill(-1, torch.arange(vocab_limit, logits.shape[-1], device=logits.device), float("-inf"))


def choose(logits: Tensor, temperature: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """One token per row of ``logits [..., V]``: the argmax (``temperature == 0``; probabilities None), else a draw
    from ``softmax(logits / temperature)`` (returned too)."""
    if temperature == 0:
        return logits.argmax(-1), None
    probs = (logits.float() / temperature).softmax(-1)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.view(probs.shape[:-1]), probs


class DSparkProposer:
    """A :class:`~dsv4.model.v41.drafter.DSparkDrafter` as a :class:`Proposer` (module docstring, step 1). Only the
    ``sliding_window`` positions before the anchor are passed to it (the rest is outside every slot's window)."""

    def __init__(self, drafter, temperature: float = 0.0, generator: torch.Generator | None = None,
                 vocab_limit: int | None = None) -> None:
        self.drafter = drafter
        self.temperature = temperature
        self.generator = generator
        self.vocab_limit = vocab_limit
        self.block_size = drafter.block_size

    @torch.no_grad()
    def propose(self, tokens: Tensor, features: Tensor) -> Proposal:
        drafter = self.drafter
        anchor = tokens.shape[0] - 1
        start = max(0, anchor - drafter.config.sliding_window)
        ids = tokens[start:].unsqueeze(0)
        feats = torch.cat((features[start:anchor], features.new_zeros(1, features.shape[-1]))).unsqueeze(0)
        positions = torch.arange(start, anchor + 1, device=tokens.device).unsqueeze(0)
        blocks = DraftBlocks.from_anchors(torch.tensor([[anchor - start]], device=tokens.device), self.block_size,
                                          ids.shape[1])
        hidden = drafter.draft_hidden(ids, feats.to(drafter.lm_head.weight.dtype), blocks, positions)[0, 0]  # [K, d]
        base = drafter.base_logits(hidden)  # [K, V]
        head = drafter.last
        previous = tokens[anchor]
        drafted, probs, confidence = [], [], []
        for k in range(self.block_size):
            bias, embedding = head.markov_head(previous)
            token, p = choose(limit_vocab(base[k] + bias.float(), self.vocab_limit), self.temperature, self.generator)
            confidence.append(head.confidence_head(hidden[k], embedding).sigmoid())
            drafted.append(token)
            probs.append(p)
            previous = token
        return Proposal(torch.stack(drafted), None if self.temperature == 0 else torch.stack(probs),
                        torch.stack(confidence))


class TargetRunner:
    """The frozen target: ``run(tokens [n], keep) -> (logits [keep, V] of the last positions (ids from
    ``vocab_limit`` on at -inf), features [n, n_targets * d])`` (the DSpark target features of every position, :class:`~dsv4.speculative.FeatureCapture`).
    Every call recomputes the whole sequence (no KV cache)."""

    def __init__(self, model, layer_ids: list[int], vocab_limit: int | None = None) -> None:
        self.model = model
        self.layer_ids = list(layer_ids)
        self.vocab_limit = vocab_limit
        self.forwards = 0

    @torch.no_grad()
    def run(self, tokens: Tensor, keep: int) -> tuple[Tensor, Tensor]:
        self.forwards += 1
        with FeatureCapture(self.model, self.layer_ids) as capture:
            logits = self.model(tokens.unsqueeze(0), logits_to_keep=keep).logits[0]
        return limit_vocab(logits.float(), self.vocab_limit), capture.hidden_states()[0]


@dataclass
class AcceptanceStats:
    """Counts of drafting steps (see the module docstring); :meth:`add` one step, :meth:`summary` the numbers."""

    block_size: int
    steps: int = 0
    emitted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    reached_at: list[int] = field(default_factory=list)
    confidence: list[tuple[int, float, bool]] = field(default_factory=list)  # (position, predicted, accepted)

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.block_size
        self.reached_at = self.reached_at or [0] * self.block_size

    def add(self, accepted: int, confidence: Tensor | None) -> None:
        """One drafting step: ``accepted`` drafts accepted; ``confidence [K]`` the drafter's, or None."""
        self.steps += 1
        self.emitted += accepted + 1
        for k in range(min(accepted + 1, self.block_size)):  # the drafts verified: every one before was accepted
            self.reached_at[k] += 1
            self.accepted_at[k] += int(k < accepted)
            if confidence is not None:
                self.confidence.append((k, float(confidence[k]), k < accepted))

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        out = {
            "acceptance_length": self.emitted / steps if self.steps else float("nan"),
            "acceptance_per_position": [a / steps if self.steps else float("nan") for a in self.accepted_at],
            "conditional_acceptance_per_position": [a / r if r else float("nan")
                                                    for a, r in zip(self.accepted_at, self.reached_at)],
            "drafting_steps": self.steps,
            "block_size": self.block_size,
        }
        if self.confidence:
            out.update(calibration(self.confidence, self.block_size))
        return out


def calibration(records: list[tuple[int, float, bool]], block_size: int) -> dict:
    """The confidence head's calibration over ``(position, predicted, accepted)`` records (module docstring)."""
    predicted = torch.tensor([p for _, p, _ in records], dtype=torch.float64)
    outcome = torch.tensor([float(a) for _, _, a in records], dtype=torch.float64)
    position = torch.tensor([k for k, _, _ in records])
    bins = (predicted * CALIBRATION_BINS).long().clamp(max=CALIBRATION_BINS - 1)
    ece = sum((outcome[bins == i].mean() - predicted[bins == i].mean()).abs().item() * int((bins == i).sum())
              for i in range(CALIBRATION_BINS) if (bins == i).any()) / len(records)
    per = [(predicted[position == k].mean().item(), outcome[position == k].mean().item()) if (position == k).any()
           else (float("nan"), float("nan")) for k in range(block_size)]
    return {"confidence_mean_per_position": [p for p, _ in per],
            "confidence_observed_per_position": [o for _, o in per],
            "confidence_brier": ((predicted - outcome) ** 2).mean().item(),
            "confidence_ece": ece}


@dataclass
class Generation:
    """``tokens [n]`` (the prompt, then the new tokens) and ``new_tokens`` (how many follow the prompt)."""

    tokens: Tensor
    new_tokens: int


def _stop(tokens: list[int], max_new: int, eos_token_id: int | None) -> tuple[list[int], bool]:
    """``tokens`` cut after ``eos_token_id`` or at ``max_new``; and whether generation is over."""
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
        return tokens[:max_new], True
    return tokens[:max_new], len(tokens) >= max_new


@torch.no_grad()
def speculative_generate(target: TargetRunner, proposer: Proposer, prompt: Tensor, max_new_tokens: int, *,
                         temperature: float = 0.0, generator: torch.Generator | None = None,
                         eos_token_id: int | None = None, stats: AcceptanceStats | None = None) -> Generation:
    """Decode ``max_new_tokens`` after ``prompt [P]`` (module docstring); drafting steps are added to ``stats``."""
    if prompt.dim() != 1 or prompt.numel() < 1:
        raise ValueError(f"speculative_generate: prompt must be a non-empty 1-D token tensor, got {list(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"speculative_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    logits, features = target.run(prompt, keep=1)
    first, _ = choose(logits[-1], temperature, generator)
    new, done = _stop([int(first)], max_new_tokens, eos_token_id)
    tokens = torch.cat((prompt, torch.tensor(new, dtype=prompt.dtype, device=prompt.device)))
    while not done:
        proposal = proposer.propose(tokens, features)
        k = proposal.tokens.shape[0]
        logits, features = target.run(torch.cat((tokens, proposal.tokens)), keep=k + 1)
        verdict = verify_block(logits.unsqueeze(0), proposal.tokens.unsqueeze(0),
                               None if proposal.probs is None else proposal.probs.unsqueeze(0), temperature, generator)
        accepted = int(verdict.accepted[0])
        if stats is not None:
            stats.add(accepted, proposal.confidence)
        step = verdict.tokens[0, : accepted + 1].tolist()
        kept, done = _stop(new + step, max_new_tokens, eos_token_id)
        tokens = torch.cat((prompt, torch.tensor(kept, dtype=prompt.dtype, device=prompt.device)))
        features = features[: tokens.shape[0] - 1]
        new = kept
    return Generation(tokens, len(new))


@torch.no_grad()
def greedy_generate(target: TargetRunner, prompt: Tensor, max_new_tokens: int,
                    eos_token_id: int | None = None) -> Generation:
    """The target's own greedy decoding, one forward per token (the reference the speculative decoding equals)."""
    tokens = prompt
    for _ in range(max_new_tokens):
        logits, _ = target.run(tokens, keep=1)
        tokens = torch.cat((tokens, logits[-1].argmax(-1, keepdim=True).to(tokens.dtype)))
        if eos_token_id is not None and int(tokens[-1]) == eos_token_id:
            break
    return Generation(tokens, tokens.shape[0] - prompt.shape[0])
