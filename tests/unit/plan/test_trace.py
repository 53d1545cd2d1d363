"""AllocationTracer: live / peak / saved bytes of hand-worked cases, attribution, and meta equals CPU."""

import torch
from torch import nn

from dsv4.plan.trace import AllocationTracer


def test_live_peak_and_release_by_hand():
    with AllocationTracer() as t:
        a = torch.empty(1000)  # 4000 bytes
        b = a * 2  # +4000 -> 8000
        assert (t.live, t.peak) == (8000, 8000)
        del a
        assert t.live == 4000
        c = b.view(10, 100)  # a view: no new storage
        b.add_(1)  # in place: no new storage
        assert t.live == 4000
        del b
        assert t.live == 4000  # the view keeps the storage alive
        del c
        assert t.live == 0 and t.peak == 8000
        t.reset_peak()
        assert t.peak == 0


def test_saved_bytes_count_each_storage_once_and_only_activations():
    w = torch.ones(100, requires_grad=True)  # made outside: a parameter, not an activation
    with AllocationTracer() as t:
        x = w * 3  # mul saves w (outside) and the scalar: nothing of ours
        y = x.exp()  # exp saves its output y: 400 bytes
        z = y * y  # mul saves y twice: counted once
        assert t.saved == 400
        z.sum().backward()
    assert w.grad is not None


def test_bytes_are_charged_to_the_innermost_labelled_module():
    class Inner(nn.Module):
        def forward(self, x):
            return x.exp()  # saves its 400-byte output

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x * 2).sin()  # x * 2 is saved by exp? no: exp saves its result; sin saves its input

    model, x = Outer(), torch.ones(100, requires_grad=True)
    with AllocationTracer("elsewhere") as t:
        t.label_modules(model, {Outer: "outer", Inner: "inner"})
        model(x).sum().backward()
    assert dict(t.saved_by_label) == {"inner": 400}
    x2 = torch.ones(100, requires_grad=True)
    with AllocationTracer("elsewhere") as t:  # hooks were removed at exit: nothing is labelled now
        model(x2)
    assert set(t.saved_by_label) == {"elsewhere"}


def test_meta_and_cpu_traces_agree():
    def step(device):
        lin = nn.Linear(64, 32, device=device)
        with AllocationTracer() as t:
            x = torch.empty(128, 64, device=device).normal_() if device == "cpu" else torch.empty(128, 64, device=device)
            lin(x).relu().sum().backward()
        return t.peak, t.saved

    assert step("meta") == step("cpu")


def test_forget_drops_a_storage_from_live():
    with AllocationTracer() as t:
        a = torch.empty(10)
        t.forget(a)
        assert t.live == 0
        del a
        assert t.live == 0
