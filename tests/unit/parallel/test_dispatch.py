"""Dispatcher registry, start-up checks, expert sharding and single-rank EP == LocalDispatcher (no process group)."""

import copy

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model.dispatch import LocalDispatcher
from dsv4.model.moe import GroupedExperts, MoE
from dsv4.parallel.dispatch import (
    DISPATCHERS,
    AllGatherDispatcher,
    AllToAllDispatcher,
    build_dispatcher,
    check_dispatcher_available,
    dispatcher_needs_uniform_tokens,
    resolve_dispatcher,
)
from dsv4.parallel.expert_shard import apply_expert_parallel, shard_experts


def _experts(n=4, d=8, inter=6):
    return GroupedExperts(n, d, inter, swiglu_limit=10.0, init_std=0.3)


def test_registry_names_and_types():
    assert DISPATCHERS == ("local", "alltoall", "allgather", "deepep")
    assert isinstance(build_dispatcher("local"), LocalDispatcher)
    assert isinstance(build_dispatcher("alltoall"), AllToAllDispatcher)
    assert isinstance(build_dispatcher("allgather"), AllGatherDispatcher)
    assert build_dispatcher("alltoall").size == 1  # no process group: a single EP rank


def test_unknown_name_lists_the_valid_ones():
    for call in (lambda: build_dispatcher("nccl"), lambda: dispatcher_needs_uniform_tokens("nccl"),
                 lambda: check_dispatcher_available("nccl", "cpu")):
        with pytest.raises(ValueError) as info:
            call()
        for name in DISPATCHERS:
            assert name in str(info.value)
        assert "'nccl'" in str(info.value)


def test_uniform_token_requirement():
    assert {n: dispatcher_needs_uniform_tokens(n) for n in DISPATCHERS} == {
        "local": False, "alltoall": False, "allgather": True, "deepep": False,
    }


def test_unknown_dispatcher_names_the_key_and_the_choices():
    for call in (lambda: resolve_dispatcher("fast", 2), lambda: build_dispatcher("fast"),
                 lambda: check_dispatcher_available("fast", "cuda"), lambda: dispatcher_needs_uniform_tokens("fast")):
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert "unknown MoE dispatcher 'fast'; expected one of " in msg and all(name in msg for name in DISPATCHERS)
    with pytest.raises(ValueError, match=r"^`dispatcher`: unknown MoE dispatcher 'fast'; expected one of auto, "
                                         r"local, alltoall, allgather, deepep$"):
        resolve_dispatcher("fast", 1)


def test_resolve_dispatcher():
    assert resolve_dispatcher("auto", 1) == "local" and resolve_dispatcher("auto", 2) == "alltoall"
    assert resolve_dispatcher("deepep", 2) == "deepep"
    with pytest.raises(ValueError, match="expected one of auto, local, alltoall, allgather, deepep$"):
        resolve_dispatcher("nccl", 2)


@pytest.mark.parametrize("name", ["local", "alltoall", "allgather"])
def test_torch_dispatchers_are_available_on_cpu(name):
    assert check_dispatcher_available(name, "cpu") is None


def test_deepep_fails_at_start_up_with_install_hint():
    name = "deepep"
    with pytest.raises(RuntimeError) as info:
        check_dispatcher_available(name, "cpu")
    msg = str(info.value)
    assert f"dispatcher={name!r}" in msg and "CUDA" in msg and "device_type='cpu'" in msg
    assert "deep_ep" in msg and "DeepEP" in msg and "pip install" in msg and "alltoall" in msg
    if not torch.cuda.is_available():  # this machine: the CUDA branch of the check and the registry fail too
        with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
            check_dispatcher_available(name, "cuda")
        with pytest.raises(RuntimeError, match="deep_ep"):
            build_dispatcher(name)


def _grad(t):
    return t.grad if t.grad is not None else torch.zeros_like(t)  # LocalDispatcher leaves None when N == 0


def _routing(n, k, n_experts, seed, blocked=()):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, n_experts, generator=g)
    scores[:, list(blocked)] = -1.0
    ids = scores.topk(k, dim=-1).indices
    weights = torch.rand(n, k, generator=g)
    return ids, weights


@pytest.mark.parametrize("cls", [AllToAllDispatcher, AllGatherDispatcher])
@pytest.mark.parametrize("n", [0, 1, 13])
def test_single_rank_ep_dispatcher_equals_local(cls, n):
    experts = _experts()
    ids, weights = _routing(n, 2, 4, seed=n, blocked=(2,))  # expert 2 gets no tokens
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(1))
    proj = torch.randn(n, 8, generator=torch.Generator().manual_seed(2))
    results = []
    for dispatcher in (LocalDispatcher(), cls(None)):
        ex = copy.deepcopy(experts)
        xi, wi = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        y = dispatcher.run(ex, xi, ids, wi)
        (y * proj).sum().backward()
        results.append((y.detach(), _grad(xi), _grad(wi), [_grad(p) for p in (ex.w1, ex.w3, ex.w2)]))
    (y0, gx0, gw0, ge0), (y1, gx1, gw1, ge1) = results
    assert y1.shape == (n, 8)
    torch.testing.assert_close(y1, y0, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gx1, gx0, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gw1, gw0, atol=1e-6, rtol=1e-6)
    for a, b in zip(ge1, ge0):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(ge1[0][2]) == 0  # the blocked expert got no gradient


def test_shard_experts_keeps_exact_slices():
    config = DSV4Config.preset("tiny")
    torch.manual_seed(0)
    full = MoE(config, 1)
    shards = []
    for rank in range(2):
        moe = copy.deepcopy(full)
        assert shard_experts(moe, ep_rank=rank, ep_size=2) == 1
        ex = moe.experts
        assert (ex.num_experts, ex.num_local_experts, ex.expert_offset) == (8, 4, 4 * rank)
        assert ex.w1.shape == (4, 32, 64) and ex.w2.shape == (4, 64, 32)
        assert isinstance(ex.w1, torch.nn.Parameter) and ex.w1.requires_grad
        shards.append(ex)
    for name in ("w1", "w3", "w2"):
        assert torch.equal(torch.cat([getattr(s, name) for s in shards]), getattr(full.experts, name))
    # slices are copies, not views of the full tensor
    assert shards[0].w1.data_ptr() != full.experts.w1.data_ptr()


def test_shard_experts_errors():
    config = DSV4Config.preset("tiny")
    moe = MoE(config, 1)
    with pytest.raises(ValueError, match="n_routed_experts=8 is not divisible by ep=3"):
        shard_experts(moe, ep_rank=0, ep_size=3)
    shard_experts(moe, ep_rank=1, ep_size=2)
    with pytest.raises(ValueError, match="already holds experts \\[4, 8\\) of 8"):
        shard_experts(moe, ep_rank=1, ep_size=2)
    # a sharded expert group on a single-rank EP dispatcher is a configuration error
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="shard_experts"):
        AllToAllDispatcher(None).run(moe.experts, x, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


def test_apply_expert_parallel_installs_the_dispatcher():
    config = DSV4Config.preset("tiny")
    moe = MoE(config, 1)
    model = torch.nn.Sequential(moe)
    dispatcher = apply_expert_parallel(model, "alltoall", None, "cpu")
    assert moe.dispatcher is dispatcher and isinstance(dispatcher, AllToAllDispatcher)
    assert moe.experts.num_local_experts == 8  # single rank: nothing to shard
    with pytest.raises(RuntimeError, match="deep_ep"):
        apply_expert_parallel(model, "deepep", None, "cpu")
