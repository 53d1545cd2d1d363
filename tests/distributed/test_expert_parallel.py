"""Expert parallelism on gloo: ``alltoall`` and ``allgather`` give the same numbers as ``local``.

Every rank builds the tiny preset with the same seed and its own tokens. Reference: LocalDispatcher on the full
expert set, per rank, in the same process. EP run: ``shard_experts`` + the EP dispatcher over consecutive-rank
EP groups (ep 2 on 2 ranks; ep 2 (two groups) and ep 4 on 4 ranks). Asserted: outputs, loss, token-input
gradients, router and shared-expert gradients equal per rank; each owner's expert-weight gradient equals the
matching slice of the reference gradient summed over the ranks of its EP group.

Routing corner cases: per-rank gate biases block experts so that an odd EP rank sends nothing to EP rank 0 and
expert 7 receives no rows at all; ranks hold different token counts; one rank is all padding (N = 0).

Through the training path (``apply_expert_parallel`` + ``apply_fsdp``, dp=2 ep=2 on 2 ranks, per-rank tokens, 2
backward passes): EP rank 1's experts receive no rows in one layer, every rank still issues the same collectives in
the same order (a mismatch hangs, which the spawn's timeout turns into a failure), and the loss and gradients equal
one process's on both ranks' tokens.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

ATOL = 1e-5
_EXPERT_W = ("w1", "w3", "w2")


def _grad(p):
    return (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()


def _ep_group(world_size, ep):
    """New groups of ``ep`` consecutive ranks (every rank creates every group); returns this rank's."""
    groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world_size, ep)]
    return groups[dist.get_rank() // ep]


def _moe_run(base, dispatcher, group, x, padding_mask, proj):
    from dsv4.model.moe import set_dispatcher
    from dsv4.parallel.expert_shard import shard_experts

    moe = copy.deepcopy(base)
    if group is not None:
        shard_experts(moe, group)
    set_dispatcher(moe, dispatcher)
    x = x.clone().requires_grad_(True)
    y = moe(x, None, padding_mask)
    loss = (y.float() * proj).sum()
    loss.backward()
    return {
        "y": y.detach(), "loss": loss.detach(), "x_grad": _grad(x), "gate_grad": _grad(moe.gate.weight),
        "shared_grad": _grad(moe.shared_experts.w1.weight), "offset": moe.experts.expert_offset,
        "experts": {w: _grad(getattr(moe.experts, w)) for w in _EXPERT_W},
    }


def _moe_inputs(rank, world_size, case):
    d = 64
    length = 48 if case.startswith("allgather") else 40 + 8 * rank  # alltoall: different token counts
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(1, length, d, generator=g)
    proj = torch.randn(1, length, d, generator=g)
    padding_mask = None
    if case in ("alltoall_pad", "allgather_pad"):
        padding_mask = torch.rand(1, length, generator=g) < 0.25  # different real counts per rank
        if case == "alltoall_pad" and rank == world_size - 1:
            padding_mask[:] = True  # a rank with zero routed tokens
    return x, padding_mask, proj


def _moe_body(rank, world_size, eps):
    from dsv4.config import DSV4Config
    from dsv4.model.dispatch import LocalDispatcher
    from dsv4.model.moe import MoE, set_dispatcher
    from dsv4.parallel.dispatch import AllGatherDispatcher, build_dispatcher
    from dsv4.parallel.expert_shard import shard_experts

    torch.manual_seed(0)
    config = DSV4Config.preset("tiny")
    base = MoE(config, layer_idx=1)  # score-routed (noaux_tc) layer
    with torch.no_grad():  # per-rank routing corner cases (the bias only changes which experts are picked)
        blocked = [0, 1, 2, 3, 7] if rank % 2 else [5, 7]
        base.gate.e_score_correction_bias[blocked] = -100.0
    out = {}
    for ep in eps:
        group = _ep_group(world_size, ep)
        for case in ("alltoall", "alltoall_pad", "allgather", "allgather_pad"):
            x, padding_mask, proj = _moe_inputs(rank, world_size, case)
            ref = _moe_run(base, LocalDispatcher(), None, x, padding_mask, proj)
            ep_run = _moe_run(base, build_dispatcher(case.split("_")[0], group), group, x, padding_mask, proj)
            out[(ep, case)] = {"ref": ref, "ep": ep_run}
        # strict uniform all-gather: unequal counts raise on every rank, naming them
        x, _, _ = _moe_inputs(rank, world_size, "alltoall")
        moe = copy.deepcopy(base)
        shard_experts(moe, group)
        set_dispatcher(moe, AllGatherDispatcher(group, strict_uniform=True))
        try:
            moe(x)
            out[(ep, "strict")] = "no error"
        except ValueError as err:
            out[(ep, "strict")] = str(err)
    return out


def _check_moe(results, world_size, eps):
    for ep in eps:
        for case in ("alltoall", "alltoall_pad", "allgather", "allgather_pad"):
            for rank in range(world_size):
                ref, got = results[rank][(ep, case)]["ref"], results[rank][(ep, case)]["ep"]
                where = f"ep={ep} {case} rank {rank}"
                for key in ("y", "loss", "x_grad", "gate_grad", "shared_grad"):
                    torch.testing.assert_close(got[key], ref[key], atol=ATOL, rtol=1e-5, msg=f"{where} {key}")
                local = 8 // ep
                assert got["offset"] == (rank % ep) * local
                members = range(rank - rank % ep, rank - rank % ep + ep)
                sl = slice(got["offset"], got["offset"] + local)
                for w in _EXPERT_W:
                    expected = sum(results[s][(ep, case)]["ref"]["experts"][w][sl] for s in members)
                    assert got["experts"][w].shape == expected.shape
                    torch.testing.assert_close(got["experts"][w], expected, atol=ATOL, rtol=1e-5, msg=f"{where} {w}")
                if case == "alltoall_pad" and rank == world_size - 1:
                    assert got["y"].abs().max() == 0 and ref["y"].shape == (1, 40 + 8 * rank, 64)
                if case == "alltoall":  # blocked expert 7 received no rows anywhere: zero gradient on its owner
                    if got["offset"] <= 7 < got["offset"] + local:
                        assert torch.count_nonzero(got["experts"]["w1"][7 - got["offset"]]) == 0
        counts = [40 + 8 * r for r in range(world_size)]
        for rank in range(world_size):
            msg = results[rank][(ep, "strict")]
            group_counts = counts[rank - rank % ep: rank - rank % ep + ep]
            assert "same number of routed tokens" in msg and str(group_counts) in msg, msg


def test_moe_layer_ep2_and_ep4_on_4_ranks():
    results = run_on_ranks(_moe_body, 4, args=((2, 4),))
    _check_moe(results, 4, (2, 4))


def _model_body(rank, world_size):
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.model.moe import GroupedExperts, set_dispatcher
    from dsv4.parallel.dispatch import build_dispatcher
    from dsv4.parallel.expert_shard import shard_experts

    torch.manual_seed(0)
    base = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 256, (1, 128), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    group = _ep_group(world_size, world_size)
    out = {}
    for name in ("local", "alltoall", "allgather"):
        model = copy.deepcopy(base)
        if name != "local":
            shard_experts(model, group)
            set_dispatcher(model, build_dispatcher(name, group))
        res = model(ids, labels=labels)
        res.loss.backward()
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        out[name] = {
            "logits": res.logits.detach(),
            "loss": res.loss.detach(),
            "embed_grad": _grad(model.model.embed_tokens.weight),
            "offsets": [e.expert_offset for e in experts],
            "experts": [{w: _grad(getattr(e, w)) for w in _EXPERT_W} for e in experts],
        }
    return out


FSDP_STEPS, FSDP_SEQ = 2, 64


def _tokens(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 256, (1, FSDP_SEQ), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return ids, labels


def _fsdp_body(rank, world_size):
    """dp=2 ep=2 with FSDP2 (``apply_expert_parallel`` + ``apply_fsdp``, the training path), per-rank tokens;
    layer 1 blocks experts 4..7 on both ranks, so EP rank 1 receives no rows there while EP rank 0 gets every
    pair. Reference: the unsharded model in this process on both ranks' tokens."""
    from torch.distributed.tensor import DTensor

    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.parallel.expert_shard import apply_expert_parallel
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp

    torch.manual_seed(0)
    base = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    gate = base.model.layers[1].mlp.gate
    assert not gate.is_hash
    with torch.no_grad():
        gate.e_score_correction_bias[4:] = -100.0  # EP rank 1 (experts 4..7) receives no rows in layer 1
    ref = copy.deepcopy(base)
    meshes = build_meshes(ParallelDims(world_size=world_size, dp=2, ep=2), "cpu")
    model = copy.deepcopy(base)
    apply_expert_parallel(model, "alltoall", meshes.ep.get_group(), "cpu")
    apply_fsdp(model, meshes)
    losses, ref_losses = [], []
    for step in range(FSDP_STEPS):
        ids, labels = _tokens(rank, step)
        loss = model(ids, labels=labels).loss  # equal label counts per rank: the global mean is the rank mean / 2
        (loss / world_size).backward()
        losses.append(loss.detach())
        both = [_tokens(r, step) for r in range(world_size)]
        ref_loss = ref(torch.cat([b[0] for b in both]), labels=torch.cat([b[1] for b in both])).loss
        ref_loss.backward()
        ref_losses.append(ref_loss.detach())

    def local(p):
        return (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()

    experts = model.model.layers[1].mlp.experts
    return {
        "losses": torch.stack(losses), "ref_losses": torch.stack(ref_losses),
        "embed": local(model.model.embed_tokens.weight), "ref_embed": ref.model.embed_tokens.weight.grad.clone(),
        "offset": experts.expert_offset,
        "w1": {name: local(model.model.layers[i].mlp.experts.w1) for i, name in enumerate("0123")},
        "ref_w1": {name: ref.model.layers[i].mlp.experts.w1.grad.clone() for i, name in enumerate("0123")},
    }


def _two_rank_body(rank, world_size):
    return {"moe": _moe_body(rank, world_size, (2,)), "model": _model_body(rank, world_size),
            "fsdp": _fsdp_body(rank, world_size)}


@pytest.fixture(scope="module")
def two_ranks():
    """One 2-rank spawn serves the MoE-layer, whole-model and FSDP checks (spawning costs more than the math).
    A collective-order bug is a hang: the timeout turns it into a failure."""
    return run_on_ranks(_two_rank_body, 2, timeout=300)


def test_moe_layer_ep2_on_2_ranks(two_ranks):
    _check_moe([r["moe"] for r in two_ranks], 2, (2,))


def test_whole_model_loss_and_gradients_ep2(two_ranks):
    results = [r["model"] for r in two_ranks]
    for name in ("alltoall", "allgather"):
        for rank in range(2):
            ref, got = results[rank]["local"], results[rank][name]
            for key in ("logits", "loss", "embed_grad"):
                torch.testing.assert_close(got[key], ref[key], atol=ATOL, rtol=1e-5, msg=f"{name} rank {rank} {key}")
            assert got["offsets"] == [4 * rank] * len(ref["experts"]) and len(ref["experts"]) == 5  # 4 layers + MTP
            for layer, (mine, off) in enumerate(zip(got["experts"], got["offsets"])):
                for w in _EXPERT_W:
                    expected = sum(results[s]["local"]["experts"][layer][w][off: off + 4] for s in range(2))
                    torch.testing.assert_close(mine[w], expected, atol=ATOL, rtol=1e-5, msg=f"{name} {layer} {w}")


def test_dp2_ep2_fsdp_with_an_idle_expert_rank_matches_single_process(two_ranks):
    """FSDP2 + EP through the training path; EP rank 1's experts get no rows in layer 1 (see ``_fsdp_body``)."""
    results = [r["fsdp"] for r in two_ranks]
    for rank, res in enumerate(results):
        where = f"rank {rank}"
        global_mean = (results[0]["losses"] + results[1]["losses"]) / 2
        torch.testing.assert_close(global_mean, res["ref_losses"], atol=1e-5, rtol=1e-5, msg=where)
        torch.testing.assert_close(res["embed"], res["ref_embed"], atol=1e-5, rtol=1e-4, msg=where)
        off = res["offset"]
        assert off == 4 * rank
        for layer in "0123":
            torch.testing.assert_close(res["w1"][layer], res["ref_w1"][layer][off: off + 4], atol=1e-5, rtol=1e-4,
                                       msg=f"{where} layer {layer}")
        if rank == 1:  # blocked experts: no rows, zero gradient
            assert torch.count_nonzero(res["w1"]["1"]) == 0
        else:
            assert torch.count_nonzero(res["w1"]["1"]) > 0
