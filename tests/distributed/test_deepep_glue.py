"""``dispatcher=deepep`` glue on 2 gloo ranks against a stand-in for DeepEP's normal kernels (no GPU needed).

Each rank installs a fake ``deep_ep`` module (found by ``importlib.util.find_spec``) and pretends CUDA exists, then
builds the dispatcher through the start-up path (``apply_expert_parallel``). The fake ``Buffer`` follows
``deep_ep.Buffer``'s intranode normal-kernel API as ``DeepEPDispatcher`` uses it (checked against
deepseek-ai/DeepEP ``deep_ep/buffers/legacy.py``): ``get_dispatch_config``/``get_combine_config`` with size hints,
``get_dispatch_layout``, ``dispatch`` (each token once to every rank owning one of its experts; local expert ids,
``-1`` and weight 0 for the other slots; a handle), the cached ``dispatch(x, handle=...)`` and ``combine`` (the
received rows summed back onto their source token). It moves data with plain gloo all-gathers and asserts what
the real kernels require: bf16 activations, fp32 routing weights, ids of ``deep_ep.topk_idx_t``.

Checked against ``LocalDispatcher`` on the full expert set: outputs, gradients of the tokens and routing weights
per rank, expert-weight gradients of each owner against the reference summed over both ranks; the forward's
handle is the one both backward passes use; a second call reuses the buffer; a size-1 group runs no DeepEP.
"""

from __future__ import annotations

import copy
import importlib.machinery
import sys
import types

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

E, D, INTER = 4, 8, 6  # 4 experts, 2 per rank; D * 2 bytes = 16 (DeepEP's hidden alignment)
# The fake reports int32 routing ids (a DeepEP built with EP_NUM_TOPK_IDX_BITS=32): the dispatcher must use
# deep_ep.topk_idx_t, not assume int64.
TOPK_IDX_T = torch.int32
# Routing per call and rank (top-2). Rank 0 holds experts {0, 1}, rank 1 {2, 3}.
ROUTES = [
    {0: [[0, 1], [0, 2], [2, 3], [1, 3], [3, 0]],  # token 2: both experts remote
     1: [[2, 3], [0, 1], [1, 2]]},  # token 1: both experts remote
    {0: [[2, 3], [3, 2], [2, 3], [3, 2]],  # rank 0 receives no rows at all
     1: []},  # rank 1 routes no tokens
]


# ------------------------------------------------------------------------------------------ the fake deep_ep


class _Event:
    """Stands for ``deep_ep.EventOverlap`` (the fake is synchronous)."""


class _Config:
    """Stands for ``deep_ep.Config``: only the buffer size hints."""

    def __init__(self, chunk_tokens: int, log: dict) -> None:
        self.chunk_tokens, self.log = chunk_tokens, log

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        self.log["hint_hidden_bytes"].append(hidden_bytes)
        return self.chunk_tokens * num_ranks * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # as the real hint for <= 8 ranks (intranode)


class _Handle:
    """The layout of one dispatch: per received row its source rank and token; the sender's token count."""

    def __init__(self, src_rank: torch.Tensor, src_idx: torch.Tensor, num_tokens: int) -> None:
        self.src_rank, self.src_idx, self.num_tokens = src_rank, src_idx, num_tokens


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` (row counts may differ), in rank order."""
    size = dist.get_world_size(group)
    n = torch.tensor([t.shape[0]])
    counts = [torch.zeros_like(n) for _ in range(size)]
    dist.all_gather(counts, n, group=group)
    rows = max(1, max(int(c) for c in counts))
    padded = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]).contiguous()
    out = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(out, padded, group=group)
    return [o[: int(c)] for o, c in zip(out, counts)]


def _check_activations(x: torch.Tensor) -> None:
    assert x.dtype == torch.bfloat16, f"DeepEP's kernels take bf16 activations, got {x.dtype}"
    assert x.dim() == 2 and x.is_contiguous() and (x.shape[1] * x.element_size()) % 16 == 0


def _make_buffer_class(log: dict, topk_idx_t: torch.dtype):
    class Buffer:
        """Gloo stand-in for ``deep_ep.Buffer`` (intranode normal kernels)."""

        num_sms = 20

        def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                     **_kwargs) -> None:
            assert group is not None and not low_latency_mode
            self.group, self.num_nvl_bytes, self.num_rdma_bytes = group, num_nvl_bytes, num_rdma_bytes
            self.rank, self.group_size = group.rank(), group.size()
            log["buffers"].append(self)

        @staticmethod
        def get_dispatch_config(num_ranks: int) -> _Config:
            assert num_ranks in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160), num_ranks  # as the real map
            return _Config(256, log)

        @staticmethod
        def get_combine_config(num_ranks: int) -> _Config:
            assert num_ranks in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160), num_ranks
            return _Config(256, log)

        def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                                allocate_on_comm_stream=False):
            assert topk_idx.dtype == topk_idx_t and topk_idx.dim() == 2
            per_rank = num_experts // self.group_size
            valid = topk_idx >= 0
            owner = torch.where(valid, topk_idx.long() // per_rank, -1)
            in_rank = torch.stack([(owner == r).any(1) for r in range(self.group_size)], 1)  # [N, P] bool
            per_expert = torch.zeros(num_experts, dtype=torch.int64).index_add_(
                0, topk_idx[valid].long(), torch.ones(int(valid.sum()), dtype=torch.int64))
            return in_rank.sum(0).int(), None, per_expert.int(), in_rank, _Event()

        def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                     expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                     allocate_on_comm_stream=False):
            _check_activations(x)
            xs = _gather(x, self.group)
            if handle is not None:  # cached layout (the backward of a combine): no routing
                assert topk_idx is None and topk_weights is None
                assert x.shape[0] == handle.num_tokens
                log["cached_dispatch"].append(handle)
                recv_x = torch.cat([xs[s][handle.src_idx[handle.src_rank == s]] for s in range(self.group_size)])
                return recv_x, None, None, None, None, _Event()
            assert topk_idx.dtype == topk_idx_t and topk_weights.dtype == torch.float32
            assert num_tokens_per_rank is not None and is_token_in_rank is not None
            assert num_tokens_per_expert is not None and num_tokens_per_rdma_rank is None  # intranode
            assert is_token_in_rank.shape == (x.shape[0], self.group_size)
            ids, weights = _gather(topk_idx, self.group), _gather(topk_weights, self.group)
            in_rank = _gather(is_token_in_rank, self.group)
            per_rank = num_tokens_per_expert.numel() // self.group_size
            lo = self.rank * per_rank
            src_rank, src_idx, recv = [], [], {"x": [], "ids": [], "w": []}
            for s in range(self.group_size):  # rows grouped by source rank, tokens in order
                sel = in_rank[s][:, self.rank].nonzero().squeeze(1)
                src_rank.append(torch.full_like(sel, s))
                src_idx.append(sel)
                recv["x"].append(xs[s][sel])
                recv["ids"].append(ids[s][sel])
                recv["w"].append(weights[s][sel])
            raw_ids, raw_w = torch.cat(recv["ids"]), torch.cat(recv["w"])
            mine = (raw_ids >= lo) & (raw_ids < lo + per_rank)
            recv_ids = torch.where(mine, raw_ids - lo, -1).to(topk_idx_t)
            recv_w = torch.where(mine, raw_w, 0.0)
            counts = [int((recv_ids == e).sum()) for e in range(per_rank)]
            counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
            new = _Handle(torch.cat(src_rank), torch.cat(src_idx), x.shape[0])
            log["dispatch"].append(new)
            return torch.cat(recv["x"]), recv_ids, recv_w, counts, new, _Event()

        def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                    async_finish=False, allocate_on_comm_stream=False):
            _check_activations(x)
            assert bias is None and x.shape[0] == handle.src_idx.numel()
            log["combine"].append((handle, topk_weights is not None))
            parts = [_gather(x, self.group), _gather(handle.src_rank, self.group), _gather(handle.src_idx, self.group)]
            if topk_weights is not None:
                assert topk_weights.dtype == torch.float32 and topk_weights.shape[0] == x.shape[0]
                parts.append(_gather(topk_weights, self.group))
            out_x = torch.zeros(handle.num_tokens, x.shape[1], dtype=torch.float32)
            out_w = None if topk_weights is None else torch.zeros(handle.num_tokens, topk_weights.shape[1])
            for s in range(self.group_size):  # sum in fp32 like the kernel, write bf16
                back = parts[1][s] == self.rank
                out_x.index_add_(0, parts[2][s][back], parts[0][s][back].float())
                if out_w is not None:
                    out_w.index_add_(0, parts[2][s][back], parts[3][s][back])
            return out_x.to(torch.bfloat16), out_w, _Event()

    return Buffer


def _install_fake_deep_ep() -> dict:
    """Put the fake ``deep_ep`` into ``sys.modules``, pretend CUDA exists (this spawned process only); return
    the fake's log."""
    log = {"buffers": [], "dispatch": [], "cached_dispatch": [], "combine": [], "hint_hidden_bytes": []}
    module = types.ModuleType("deep_ep")
    module.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None)
    module.Buffer = _make_buffer_class(log, TOPK_IDX_T)
    module.topk_idx_t = TOPK_IDX_T
    sys.modules["deep_ep"] = module
    torch.cuda.is_available = lambda: True
    return log


# ---------------------------------------------------------------------------------------------------- the test


def _grad(t):
    return (t.grad if t.grad is not None else torch.zeros_like(t)).detach().clone()


def _inputs(call: int, rank: int):
    ids = torch.tensor(ROUTES[call][rank], dtype=torch.int64).reshape(-1, 2)
    g = torch.Generator().manual_seed(100 * call + rank)
    n = ids.shape[0]
    return torch.randn(n, D, generator=g), ids, torch.rand(n, 2, generator=g) + 0.1, torch.randn(n, D, generator=g)


def _run(dispatcher, experts, x, ids, w, proj):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = dispatcher.run(experts, x, ids, w)
    (y * proj).sum().backward()
    return {"y": y.detach(), "x_grad": _grad(x), "w_grad": _grad(w),
            "experts": {n: _grad(getattr(experts, n)) for n in ("w1", "w3", "w2")}}


def _body(rank: int, world_size: int) -> dict:
    log = _install_fake_deep_ep()
    from dsv4.model.dispatch import LocalDispatcher
    from dsv4.model.moe import GroupedExperts
    from dsv4.parallel.dispatch import DeepEPDispatcher
    from dsv4.parallel.expert_shard import apply_expert_parallel

    torch.manual_seed(0)
    full = GroupedExperts(E, D, INTER, swiglu_limit=10.0, init_std=0.3)  # fp32, the same on both ranks
    sharded = copy.deepcopy(full)
    group = dist.new_group([0, 1])
    dispatcher = apply_expert_parallel(sharded, "deepep", group, "cuda")  # start-up check, shard, build
    assert isinstance(dispatcher, DeepEPDispatcher) and not dispatcher.needs_uniform_tokens
    assert (sharded.expert_offset, sharded.num_local_experts) == (2 * rank, 2)
    out: dict = {"calls": []}
    for call in range(len(ROUTES)):
        x, ids, w, proj = _inputs(call, rank)
        for p in sharded.parameters():
            p.grad = None
        first = len(log["dispatch"])
        ep = _run(dispatcher, sharded, x, ids, w, proj)
        assert ep["y"].dtype == x.dtype == ep["x_grad"].dtype
        # The EP path moves bf16 rows (DeepEP's dtype): its experts see x rounded to bf16, so the reference runs
        # on the same rounded tokens; what is left is the bf16 rounding of the per-rank partial sums, the
        # combined output and the gradient rows (relative ~2**-8 each), hence rtol/atol 1e-2 below.
        ref = _run(LocalDispatcher(), copy.deepcopy(full), x.to(torch.bfloat16).float(), ids, w, proj)
        handle = log["dispatch"][first]
        out["calls"].append({
            "ep": ep, "ref": ref,
            "one_dispatch": len(log["dispatch"]) == first + 1,
            # forward combine, then the dispatch backward's combine (with weights), both on the forward's handle
            "combine_handles": [(h is handle, with_w) for h, with_w in log["combine"][2 * call: 2 * call + 2]],
            "cached_dispatch_handles": [h is handle for h in log["cached_dispatch"][call: call + 1]],
        })
    out["buffers"] = len(log["buffers"])
    out["nvl_bytes"] = log["buffers"][0].num_nvl_bytes
    out["hint_hidden_bytes"] = sorted(set(log["hint_hidden_bytes"]))
    # The fake really rejects what DeepEP rejects (so the cast checks above mean something).
    try:
        log["buffers"][0].combine(torch.zeros(0, D), log["dispatch"][0])
        out["fp32_rejected"] = False
    except AssertionError:
        out["fp32_rejected"] = True
    # A size-1 EP group: no DeepEP call (its configs start at 2 ranks), LocalDispatcher numbers.
    singles = [dist.new_group([r]) for r in range(world_size)]
    single = DeepEPDispatcher(singles[rank])
    x, ids, w, proj = _inputs(0, rank)
    n_buffers = len(log["buffers"])
    out["single"] = {"ep": _run(single, copy.deepcopy(full), x, ids, w, proj),
                     "ref": _run(LocalDispatcher(), copy.deepcopy(full), x, ids, w, proj),
                     "no_buffer": len(log["buffers"]) == n_buffers}
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_body, 2)


def test_deepep_glue_matches_local_dispatcher(results):
    tol = {"rtol": 1e-2, "atol": 1e-2}
    for call in range(len(ROUTES)):
        for rank in range(2):
            got, ref = results[rank]["calls"][call]["ep"], results[rank]["calls"][call]["ref"]
            where = f"call {call} rank {rank}"
            assert got["y"].shape == (len(ROUTES[call][rank]), D)
            for key in ("y", "x_grad", "w_grad"):
                torch.testing.assert_close(got[key], ref[key], **tol, msg=f"{where} {key}")
            for name in ("w1", "w3", "w2"):  # owner's slice == reference gradient summed over both ranks
                expected = sum(results[s]["calls"][call]["ref"]["experts"][name] for s in range(2))
                expected = expected[2 * rank: 2 * rank + 2]
                assert got["experts"][name].shape == expected.shape
                torch.testing.assert_close(got["experts"][name], expected, **tol, msg=f"{where} {name}")
        # non-trivial: some gradient reached every expert in call 0
        if call == 0:
            for rank in range(2):
                assert all(torch.count_nonzero(g[e]) for g in results[rank]["calls"][0]["ep"]["experts"].values()
                           for e in range(2))
    # call 1: rank 0 received no rows, so its experts got zero gradient; rank 1 routed no tokens
    assert all(torch.count_nonzero(g) == 0 for g in results[0]["calls"][1]["ep"]["experts"].values())
    assert results[1]["calls"][1]["ep"]["y"].shape == (0, D)


def test_forward_handle_drives_both_backward_passes(results):
    for rank in range(2):
        for call in results[rank]["calls"]:
            assert call["one_dispatch"]
            assert call["combine_handles"] == [(True, False), (True, True)]
            assert call["cached_dispatch_handles"] == [True]


def test_buffer_sized_for_bf16_rows_and_reused(results):
    for rank in range(2):
        assert results[rank]["buffers"] == 1  # the second call fits the first buffer
        assert results[rank]["hint_hidden_bytes"] == [D * 2]  # bf16 rows, whatever x's dtype
        assert results[rank]["nvl_bytes"] == 256 * 2 * D * 2
        assert results[rank]["fp32_rejected"]


def test_size_one_group_runs_local(results):
    for rank in range(2):
        single = results[rank]["single"]
        assert single["no_buffer"]
        for key in ("y", "x_grad", "w_grad"):
            torch.testing.assert_close(single["ep"][key], single["ref"][key], rtol=0, atol=0)
