"""Repeated meta ops made from a record of their first run: the same outputs as running the op (shapes, strides,
dtypes, fresh storages), never for an op whose outputs share an input's storage, and the same plan either way."""

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model.model import DSV4ForCausalLM
from dsv4.plan import meta_ops, trace
from dsv4.plan.activations import StepTracer, plan_activations

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def no_records():
    meta_ops._records.clear()
    yield
    meta_ops._records.clear()


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _storage(t):
    return t.untyped_storage()._cdata


def test_a_repeated_op_gets_fresh_outputs_like_the_ops_own():
    x, y = _meta(4, 6), _meta(6, 3)
    first = meta_ops.run_meta_op(aten.mm.default, (x, y), {})
    again = meta_ops.run_meta_op(aten.mm.default, (x, y), {})
    assert len(meta_ops._records) == 1 and None not in meta_ops._records.values()  # the second: from the record
    for out in (first, again):
        assert (out.shape, out.stride(), out.dtype, out.is_meta) == ((4, 3), (3, 1), torch.float32, True)
    assert _storage(first) != _storage(again)
    rows, cols = _meta(4, 6), _meta(6, 4).t()  # one shape, two layouts: an elementwise op keeps its input's
    for x in (rows, cols, rows, cols):
        assert meta_ops.run_meta_op(aten.mul.Scalar, (x, 2.0), {}).stride() == x.stride()
    values, indices = meta_ops.run_meta_op(aten.topk.default, (cols, 2), {})  # several outputs
    values2, indices2 = meta_ops.run_meta_op(aten.topk.default, (cols, 2), {})
    assert (values2.shape, values2.stride(), indices2.dtype) == (values.shape, values.stride(), torch.int64)
    assert len({_storage(v) for v in (values, indices, values2, indices2)}) == 4


def test_outputs_on_an_input_storage_always_run_the_op():
    """A view (its schema says so) and ``_unsafe_view`` (a fresh-looking schema, the input's storage) are run every
    time: a copy on a storage of its own would count as a new allocation."""
    x = _meta(4, 6)
    for func, args in ((aten.view.default, (x, [24])), (aten.transpose.int, (x, 0, 1)),
                       (aten._unsafe_view.default, (x, [6, 4]))):
        for _ in range(2):
            assert _storage(meta_ops.run_meta_op(func, args, {})) == _storage(x), func


def test_python_scalars_of_another_type_are_another_record():
    """``1``, ``1.0`` and ``True`` are equal and hash alike but promote differently."""
    x = _meta(3, dtype=torch.int32)
    assert meta_ops.run_meta_op(aten.mul.Scalar, (x, 2), {}).dtype == torch.int32
    assert meta_ops.run_meta_op(aten.mul.Scalar, (x, 2.0), {}).dtype == torch.float32
    assert meta_ops.run_meta_op(aten.mul.Scalar, (x, True), {}).dtype == torch.int32


def test_a_factory_op_without_a_dtype_follows_the_default_dtype():
    meta = {"device": torch.device("meta")}
    assert meta_ops.run_meta_op(aten.full.default, ([2], 1.5), meta).dtype == torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert meta_ops.run_meta_op(aten.full.default, ([2], 1.5), meta).dtype == torch.float64
    finally:
        torch.set_default_dtype(default)


def test_tensors_off_meta_run_the_op():
    x = torch.arange(4.0)
    for _ in range(2):
        assert meta_ops.run_meta_op(aten.mul.Scalar, (x, 2.0), {}).tolist() == [0.0, 2.0, 4.0, 6.0]
    assert not meta_ops._records


def test_a_plan_is_the_same_with_and_without_the_records(monkeypatch):
    """The tiny model's step with block recompute on 2 CP ranks (segments, phases, saved bytes by component)."""

    def segments():
        config = DSV4Config.preset("tiny", activation_checkpointing="block")
        with torch.device("meta"):
            model = DSV4ForCausalLM(config)
        plan = plan_activations(StepTracer(model, 1, 512, 2, expert_parallel=False))
        return plan.metadata, plan.phases, [vars(s) for s in plan.segments]

    recorded = segments()
    assert meta_ops._records
    monkeypatch.setattr(trace, "run_meta_op", lambda func, args, kwargs: func(*args, **kwargs))
    assert segments() == recorded
