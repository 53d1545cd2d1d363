"""Activation recompute: block and selective give the same loss and gradients as none, count MoE loads once, and
save less."""

from __future__ import annotations

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.model.moe import MoEGate


def _run(mode: str):
    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny", activation_checkpointing=mode)).train()
    ids = torch.randint(1, 256, (2, 256), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = model(ids, labels=labels, return_logits=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = [m.expert_load.clone() for m in model.modules() if isinstance(m, MoEGate) and m.expert_load is not None]
    return out.loss.detach(), grads, loads, sum(saved)


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_recompute_equals_no_recompute(mode):
    ref_loss, ref_grads, ref_loads, ref_saved = _run("none")
    loss, grads, loads, saved = _run(mode)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=0, msg=name)  # the same math, recomputed
    for load, ref in zip(loads, ref_loads):
        assert torch.equal(load, ref)  # the recompute does not count its tokens again
    assert saved < ref_saved, (saved, ref_saved)


def test_block_saves_less_than_selective_saves_less_than_none():
    saved = {mode: _run(mode)[3] for mode in ("none", "selective", "block")}
    assert saved["block"] < saved["selective"] < saved["none"], saved


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"activation_checkpointing: must be one of .* got 'everything'"):
        DSV4Config.preset("tiny", activation_checkpointing="everything")
