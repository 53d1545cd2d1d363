"""Token-weighted loss reduction: hand-computed cases on one process (the distributed case is in the CP parity test)."""

import torch

from dsv4.training.loss import reduce_token_loss


def test_single_process_is_the_token_mean():
    loss_sum = torch.tensor(6.0, requires_grad=True)
    out = reduce_token_loss(loss_sum, torch.tensor(4))
    assert out.value.item() == 1.5
    out.loss.backward()
    assert loss_sum.grad.item() == 0.25


def test_no_labels_gives_zero_not_nan():
    loss_sum = torch.tensor(0.0, requires_grad=True)
    out = reduce_token_loss(loss_sum, 0)
    assert out.value.item() == 0.0 and torch.isfinite(out.loss)
