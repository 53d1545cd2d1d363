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

Expert data parallelism (edp = 2): one Lightning training step with ``DSV4Strategy(ep=2)`` on 4 ranks, each rank a
different row of one global batch; every gradient the optimizer step would apply (each routed expert's from its EP
rank's slice) equals one process's on the whole global batch: the edp replicas' gradients are summed, not averaged.
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


# ------------------------------------------------------------------------------- expert data parallelism (edp > 1)
# One training step through the Lightning path on 4 gloo ranks: DSV4Strategy(ep=2, dispatcher="alltoall") (dp=4,
# so the expert mesh is (edp=2, ep=2): EP groups [0, 1], [2, 3]; each expert slice replicated on edp ranks [0, 2]
# and [1, 3]), DSV4LightningModule.training_step on this dp rank's row of a 4-row global batch (rows of different
# label counts), FSDP2's reduce-scatter of the routed experts over edp, and an SGD of lr 0 that records the
# gradients the optimizer step would apply. Oracle: one process, the whole global batch as one batch.
EDP_SEQ = 256
EDP_DOCS = (250, 200, 120, 100, 180)  # packed into 4 rows of 256 with 249, 199, 179, 218 labels


def _edp_dataset():
    from dsv4.config import DSV4Config
    from dsv4.data import build_packed_dataset

    config = DSV4Config.preset("tiny")
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, config.vocab_size, (n,), generator=g).tolist() for n in EDP_DOCS]
    return build_packed_dataset(docs, EDP_SEQ, config.shard_multiple)


def _edp_rank_body(rank, world_size):
    import os

    import lightning as L
    from torch.utils.data import DataLoader

    from dsv4.batch import TokenBatch
    from dsv4.config import DSV4Config
    from dsv4.data import DistributedPackedSampler
    from dsv4.model.moe import GroupedExperts
    from dsv4.training.module import DSV4LightningModule
    from dsv4.training.spec import RunSpec
    from dsv4.training.strategy import DSV4Strategy

    # Lightning runs inside the already initialised gloo group as if launched by torchrun (it does not relaunch)
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    record = {}

    class RecordingSGD(torch.optim.SGD):  # lr 0: records the gradients its step is asked to apply
        def step(self, closure=None):
            with torch.enable_grad():
                loss = closure() if closure is not None else None
            for name, p in module.model.named_parameters():
                if p.grad is not None:  # experts: this EP rank's slice (gathered over edp); the rest: whole
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    record[name] = g.detach().clone()
            return loss

    class SeededModule(DSV4LightningModule):
        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(0)  # the reference's initial weights
            super().configure_model()

    spec = RunSpec(DSV4Config.preset("tiny"), optimizer=lambda params: RecordingSGD(params, lr=0.0),
                   bias_update_rate=0.0, seq_len=EDP_SEQ, micro_batch_size=1, global_batch_size=world_size)
    module = SeededModule(spec)
    dataset = _edp_dataset()
    loader = DataLoader(dataset, batch_size=1, sampler=DistributedPackedSampler(len(dataset), rank, world_size,
                                                                                 shuffle=False),
                        collate_fn=TokenBatch.stack)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=DSV4Strategy(ep=2, dispatcher="alltoall"),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=loader)
    meshes = trainer.strategy.meshes
    return {"grads": record, "loss": float(trainer.callback_metrics["train/loss"]),
            "edp": meshes.edp.size(), "ep_rank": meshes.ep.get_local_rank(),
            "offsets": {n: m.expert_offset for n, m in module.model.named_modules() if isinstance(m, GroupedExperts)},
            "local_rows": {n: p.to_local().shape[0] for n, p in module.model.named_parameters()
                           if ".experts.w" in n}}


def _edp_reference():
    """The loss and every gradient of the token mean over the 4 rows as one batch, in one process."""
    from dsv4.batch import TokenBatch
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.training.step import forward_outputs

    torch.set_num_threads(1)
    dataset = _edp_dataset()
    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    out = forward_outputs(model, TokenBatch.stack([dataset[i] for i in range(len(dataset))]))
    loss = out.loss_sum / out.label_count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, [int(dataset[i].label_count()) for i in range(len(dataset))]


# Tolerances, of each tensor's largest |gradient|. Routed experts and every other tensor but the hyper-connections':
# 1e-5 (measured: below 7e-7, the size of the fp32 reference's own distance to a float64 run, below 8e-7).
# Hyper-connection parameters (sums over every token and stream with much cancellation): their fp32 gradients are
# good to ~3e-4 only (the one-process fp32 reference is 2.9e-4 from a float64 run of it; the 4 ranks' sums in
# another order, 8.4e-5 from the reference), so 1e-3; a lost or doubled share of the batch still moves them by O(1).
EDP_TOL = 1e-5
EDP_HC_TOL = 1e-3


def _hyper_connection(name: str) -> bool:
    return any(part in name for part in ("attn_hc.", "ffn_hc.", "hc_head."))


def test_dp4_ep2_edp2_training_step_gradients_equal_one_process_on_the_global_batch():
    """edp = 2: each routed expert's gradient is the sum over the 4 ranks' rows (its EP group's dispatch brings the
    group's 2 rows, the edp reduce-scatter adds the other group's 2), neither averaged over edp nor over the world.
    Every routed expert of every MoE layer (backbone and MTP, all 8 experts, each with a non-zero gradient), and
    every other gradient, against one process on the whole global batch."""
    ref_loss, ref, label_counts = _edp_reference()
    assert len(label_counts) == 4 and len(set(label_counts)) == 4  # per-rank means would weigh the rows wrongly
    results = run_on_ranks(_edp_rank_body, 4, timeout=300)
    expert_names = [n for n in ref if ".experts.w" in n]
    assert len(expert_names) == 5 * 3  # w1, w3, w2 of 4 layers + MTP
    for name in expert_names:  # every expert received rows: each compared slice means something
        assert (ref[name].flatten(1).abs().amax(dim=1) > 0).all(), name
    for rank, res in enumerate(results):
        assert res["edp"] == 2 and res["ep_rank"] == rank % 2
        assert res["loss"] == pytest.approx(ref_loss, rel=1e-6), rank
        assert set(res["grads"]) == set(ref), sorted(set(res["grads"]) ^ set(ref))
        assert set(res["offsets"].values()) == {4 * (rank % 2)}
        for name in expert_names:
            assert res["local_rows"][name] == 2  # FSDP's edp shard: 2 of the EP slice's 4 experts
        errors = {}
        for name, want in ref.items():
            if name in expert_names:
                off = res["offsets"][name.rsplit(".", 1)[0]]
                want = want[off: off + 4]
            got = res["grads"][name]
            assert got.shape == want.shape, (rank, name, got.shape, want.shape)
            errors[name] = ((got - want).abs().max() / want.abs().max()).item()
        bad = {n: e for n, e in errors.items() if not e <= (EDP_HC_TOL if _hyper_connection(n) else EDP_TOL)}
        assert not bad, f"rank {rank}: gradients off by more than the tolerance (of their largest entry): {bad}"
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                     "model.layers.1.mlp.shared_experts.w2.weight", "mtp.layers.0.self_attn.wo_b.weight"):
            assert not _hyper_connection(name) and errors[name] <= EDP_TOL, (rank, name)  # named: held to 1e-5
