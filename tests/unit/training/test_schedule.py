"""The warm-up + cosine schedule: hand-worked values, and resuming with a different ``total_steps``
(``trainer.max_steps``) continues from the checkpoint's learning rate instead of jumping."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.training.schedule import WarmupCosineLR, warmup_cosine_schedule


def _schedule(total, warmup=1, min_lr_ratio=0.1, lr=1.0):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return optimizer, warmup_cosine_schedule(optimizer, warmup, total, min_lr_ratio)


def _lrs(optimizer, scheduler, steps):
    """The learning rate each of the next ``steps`` optimizer steps uses (the scheduler steps after each)."""
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_hand_worked_values():
    optimizer, scheduler = _schedule(total=5, warmup=1)
    # step 0 warm-up 1/1; then progress (s - 1) / 4: cos(0), cos(pi/4), cos(pi/2), cos(3pi/4), end
    expected = [1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * p / 4)) for p in range(4)] + [0.1]
    assert _lrs(optimizer, scheduler, 6) == pytest.approx(expected)


def test_resume_with_more_steps_continues_from_the_saved_learning_rate():
    # the first run: total 3, checkpointed after 2 steps (the LR of step 2 is next: 0.55)
    optimizer, scheduler = _schedule(total=3)
    assert _lrs(optimizer, scheduler, 2) == pytest.approx([1.0, 1.0])
    state, opt_state = scheduler.state_dict(), optimizer.state_dict()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.55)
    # resumed with total 5: re-stretching the cosine would give step 2 0.1 + 0.45 (1 + cos(pi/4)) = 0.868 (a jump of
    # 1.58x); instead the phase pi/2 of step 2 moves linearly to pi at step 5: pi/2, 2pi/3, 5pi/6, pi
    optimizer, scheduler = _schedule(total=5)
    optimizer.load_state_dict(opt_state)
    scheduler.load_state_dict(state)
    expected = [0.1 + 0.45 * (1 + math.cos(phase)) for phase in (math.pi / 2, 2 * math.pi / 3, 5 * math.pi / 6)]
    assert _lrs(optimizer, scheduler, 4) == pytest.approx([*expected, 0.1])
    assert expected[0] == pytest.approx(0.55)
    # and a second resume, with the same total, keeps the continued schedule (the anchor travels in the state)
    state, opt_state = scheduler.state_dict(), optimizer.state_dict()
    optimizer, scheduler = _schedule(total=5)
    optimizer.load_state_dict(opt_state)
    scheduler.load_state_dict(state)
    assert scheduler.last_epoch == 6 and _lrs(optimizer, scheduler, 1) == pytest.approx([0.1])


def test_resume_after_the_end_stays_at_the_floor():
    optimizer, scheduler = _schedule(total=3)
    _lrs(optimizer, scheduler, 3)
    state = scheduler.state_dict()
    optimizer, scheduler = _schedule(total=6)
    scheduler.load_state_dict(state)
    assert _lrs(optimizer, scheduler, 3) == pytest.approx([0.1, 0.1, 0.1])


def test_resume_with_the_same_schedule_or_inside_the_same_warm_up_changes_nothing():
    optimizer, scheduler = _schedule(total=10, warmup=4)
    _lrs(optimizer, scheduler, 2)
    state, opt_state = scheduler.state_dict(), optimizer.state_dict()
    optimizer, scheduler = _schedule(total=20, warmup=4)
    optimizer.load_state_dict(opt_state)
    scheduler.load_state_dict(state)
    assert scheduler.anchor is None  # warm-up steps 2, 3 as before, then the cosine over 16 steps
    assert _lrs(optimizer, scheduler, 4) == pytest.approx([0.75, 1.0, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 16))])


@pytest.mark.parametrize("kwargs, message", [
    ({"warmup_steps": -1, "total_steps": 5}, "warmup_steps must be >= 0 and total_steps >= 1, got -1 and 5"),
    ({"warmup_steps": 1, "total_steps": 5, "min_lr_ratio": 2.0}, r"min_lr_ratio must be in \[0, 1\], got 2.0"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupCosineLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), **kwargs)
