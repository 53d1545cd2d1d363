"""Chunked linear + cross-entropy: values and gradients equal the unchunked fp32 path; no [L, vocab] tensor is
ever created with return_logits=False (forward and backward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.model.chunked_loss import linear_cross_entropy


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a whole tensor, ||a - b|| / ||b|| (elementwise ratios are meaningless near zero)."""
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 1000])
def test_equals_unchunked_fp32(chunk_rows):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 50, 16, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(300, 16, generator=g, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, 300, (2, 50), generator=g)
    labels[0, :7] = -100
    loss, count = linear_cross_entropy(hidden, weight, labels, chunk_rows)
    (loss * 0.7).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy((h2.float() @ w2.float().t()).reshape(-1, 300), labels.reshape(-1), reduction="sum")
    (ref * 0.7).backward()
    assert count.item() == 93
    assert rel_err(loss, ref) <= 1e-6
    assert rel_err(hidden.grad, h2.grad) <= 1e-5 and rel_err(weight.grad, w2.grad) <= 1e-5


def test_all_rows_unlabelled_gives_zero_loss_and_zero_grads():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    loss, count = linear_cross_entropy(hidden, weight, torch.full((4,), -100), 2)
    loss.backward()
    assert loss.item() == 0.0 and count.item() == 0
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0


def test_bad_arguments_name_the_shapes():
    with pytest.raises(ValueError, match=r"chunk_rows must be >= 1, got 0"):
        linear_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match=r"hidden \(2, 4\), weight \(5, 3\) and labels \(2,\) do not fit"):
        linear_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long), 1)


def _model(**overrides):
    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset("tiny", **overrides))


def test_model_loss_without_logits_equals_the_logits_path():
    model = _model(loss_chunk_size=96)
    ids = torch.randint(1, 256, (2, 256), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    params = [p for p in model.parameters() if p.requires_grad]  # the frozen indexer is not differentiated
    full = model(ids, labels=labels)
    grads = torch.autograd.grad(full.loss, params, allow_unused=True)
    chunked = model(ids, labels=labels, return_logits=False)
    assert chunked.logits is None and chunked.mtp_logits == []
    assert rel_err(chunked.loss, full.loss) <= 1e-6 and torch.equal(chunked.label_count, full.label_count)
    assert rel_err(torch.stack(chunked.mtp_loss_sums), torch.stack(full.mtp_loss_sums)) <= 1e-6
    chunked_grads = torch.autograd.grad(chunked.loss, params, allow_unused=True)
    assert [g is None for g in chunked_grads] == [g is None for g in grads]
    full_vec = torch.cat([g.reshape(-1) for g in grads if g is not None])
    chunk_vec = torch.cat([g.reshape(-1) for g in chunked_grads if g is not None])
    # the head's own gradients match to 1e-5 (test above); through the network fp32 rounding of d(hidden) reaches
    # every parameter, so each parameter's error is measured against the scale of the whole gradient
    assert rel_err(chunk_vec, full_vec) <= 1e-5
    for g_full, g_chunk in zip(grads, chunked_grads):
        if g_full is not None:
            assert (g_chunk - g_full).norm() <= 1e-5 * full_vec.norm()
    with pytest.raises(ValueError, match="return_logits=False computes only the loss: pass labels"):
        model(ids, return_logits=False)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_a_quarter_of_length_times_vocab_with_return_logits_false():
    model = _model(vocab_size=4096, loss_chunk_size=64)
    length = 512
    ids = torch.randint(1, 4096, (1, length), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(ids, -1, 1)
    mode = _LargestTensor()
    with mode:
        model(ids, labels=labels, return_logits=False).loss.backward()
    assert mode.largest < length * 4096 // 4, mode.largest
    with _LargestTensor() as with_logits:  # the oracle: the logits path does build [L, vocab]
        model(ids, labels=labels).loss.backward()
    assert with_logits.largest >= length * 4096
