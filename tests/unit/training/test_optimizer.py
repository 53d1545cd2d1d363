"""`optim.state_dtype` (dsv4.training.optimizer): the float32 factory is torch's AdamW step for step; the bf16
moments against a hand-written AdamW reference; torchao's 8-bit state, run eagerly on CPU, with our schedule, skipped
parameters and a state-dict round trip; the config errors."""

import io
import sys
from functools import partial

import pytest
import torch

from dsv4.training.optimizer import BF16AdamW, adamw, optimizer_state_bytes, storage_bytes

KW = dict(lr=1e-2, betas=[0.9, 0.95], weight_decay=0.1)


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (1 + i) for i in range(steps)]


def _run(optimizer, param, grads):
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()


def test_float32_is_torch_adamw_bit_for_bit():
    init = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ours, theirs = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt = adamw([ours], **KW)
    assert type(opt) is torch.optim.AdamW
    _run(opt, ours, _grads((8, 16), 4))
    _run(torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False), theirs,
         _grads((8, 16), 4))
    assert torch.equal(ours, theirs)


def test_bf16_moments_are_the_reference_rounded_each_step():
    """Reference in float64 from the stored (bf16) moments: m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, the
    update from those unrounded m, v; the stored moments are exactly their bf16 rounding, the parameter follows."""
    lr, (b1, b2), wd, eps = 1e-2, (0.9, 0.95), 0.1, 1e-8
    init = torch.randn(64, generator=torch.Generator().manual_seed(2))
    param = torch.nn.Parameter(init.clone())
    opt = adamw([param], lr=lr, betas=[b1, b2], weight_decay=wd, state_dtype="bfloat16")
    assert isinstance(opt, BF16AdamW)
    p, m, v = init.double(), torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    for t, grad in enumerate(_grads(64, 5, seed=3), start=1):
        param.grad = grad.clone()
        opt.step()
        g = grad.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p * (1 - lr * wd) - lr / (1 - b1 ** t) * m / ((v / (1 - b2 ** t)).sqrt() + eps)
        state = opt.state[param]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(state["exp_avg"], m.to(torch.bfloat16)), t
        assert torch.equal(state["exp_avg_sq"], v.to(torch.bfloat16)), t
        torch.testing.assert_close(param.data, p.float(), rtol=1e-6, atol=1e-6)
        m, v = state["exp_avg"].double(), state["exp_avg_sq"].double()  # what the next step starts from
    assert float(opt.state[param]["step"]) == 5
    assert optimizer_state_bytes(opt) == 4 + 2 * 2 * 64


@pytest.mark.parametrize("state_dtype", ["bfloat16", "8bit"])
def test_state_dict_round_trip_continues_identically(state_dtype):
    """Steps 1-2, save (torch.save of state_dict), load into a fresh optimizer, step 3: the same as 3 steps without
    the round trip (and the moments keep their storage type)."""
    init = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))  # 8192 elements: 8-bit codes
    grads = _grads((64, 128), 3, seed=5)
    straight = torch.nn.Parameter(init.clone())
    opt = adamw([straight], **KW, state_dtype=state_dtype)
    _run(opt, straight, grads)
    cut = torch.nn.Parameter(init.clone())
    first = adamw([cut], **KW, state_dtype=state_dtype)
    _run(first, cut, grads[:2])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = adamw([cut], **KW, state_dtype=state_dtype)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    assert type(second.state[cut]["exp_avg"]) is type(first.state[cut]["exp_avg"])
    assert second.state[cut]["exp_avg"].dtype == first.state[cut]["exp_avg"].dtype
    _run(second, cut, grads[2:])
    assert torch.equal(cut, straight)


def test_8bit_runs_eagerly_on_cpu_with_the_schedule_and_skips_parameters_without_gradient():
    from torchao.optim.subclass_8bit import OptimState8bit

    from dsv4.training.schedule import warmup_cosine_schedule

    big, small, idle = (torch.nn.Parameter(torch.randn(*s)) for s in ((16, 256), (10, 10), (4096,)))
    opt = adamw([big, small, idle], **KW, state_dtype="8bit")
    schedule = warmup_cosine_schedule(opt, warmup_steps=2, total_steps=4, min_lr_ratio=0.1)
    before = idle.detach().clone()
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    lrs = []
    for grad_big, grad_small in zip(_grads((16, 256), 3), _grads((10, 10), 3)):
        big.grad, small.grad, idle.grad = grad_big, grad_small, None
        lrs.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        schedule.step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles  # nothing compiled
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert lrs == pytest.approx([1e-2 * f for f in (0.5, 1.0, schedule.multiplier(2))])
    assert isinstance(opt.state[big]["exp_avg"], OptimState8bit)  # >= 4096 elements, a multiple of 256
    assert type(opt.state[small]["exp_avg"]) is torch.Tensor  # 100 elements: fp32
    assert idle not in opt.state and torch.equal(idle, before)
    # a resume under another schedule continues from the saved learning rate, filled into torchao's tensor
    longer = warmup_cosine_schedule(opt, warmup_steps=2, total_steps=8, min_lr_ratio=0.1)
    longer.load_state_dict(schedule.state_dict())
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * schedule.multiplier(3))
    # storage: codes (1 byte) + one fp32 scale per 256 + the 256-entry fp32 map, per moment; the small one fp32
    assert storage_bytes(opt.state[big]["exp_avg"]) == 4096 + 16 * 4 + 256 * 4
    assert optimizer_state_bytes(opt) == 2 * 4 + 2 * (4096 + 16 * 4 + 256 * 4) + 2 * 100 * 4


def test_state_dtype_errors_name_the_key(monkeypatch):
    from omegaconf import OmegaConf

    from dsv4.training.spec import build_optimization

    cfg = OmegaConf.create({"optim": {"_target_": "dsv4.training.optimizer.adamw", "_partial_": True, "lr": 1e-3,
                                      "betas": [0.9, 0.95], "weight_decay": 0.0, "state_dtype": "int4"}})
    with pytest.raises(ValueError, match=r"`optim.state_dtype`='int4' must be one of \['float32', 'bfloat16', "
                                         r"'8bit'\]"):
        build_optimization(cfg)
    cfg.optim.state_dtype = "8bit"
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # as if torchao were not installed
    with pytest.raises(ImportError, match=r"`optim.state_dtype`=8bit needs torchao: pip install 'dsv4\[lowbit\]'"):
        build_optimization(cfg)
    with pytest.raises(ValueError, match="state_dtype"):
        partial(adamw, **KW)([torch.nn.Parameter(torch.zeros(2))], state_dtype="fp16")
