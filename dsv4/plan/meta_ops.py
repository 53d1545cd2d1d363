"""Running aten ops on ``meta`` tensors, the outputs of a repeated op made from a record of its first run.

On the ``meta`` device an op's outputs (shape, strides, dtype) depend only on its inputs' metadata, its other
arguments and the default dtype, yet torch computes them afresh on every call, most of them through Python meta
functions (about 100 us an op). The plan's traces repeat the same ops on the same shapes many times (every query
chunk of a sparse attention, every block of a kind, forward again in recompute), so :func:`run_meta_op` keeps, per
``(op, input metadata, other arguments, default dtype)``, what the op returned, and makes those outputs again with
``torch.empty_strided``, a new storage each, exactly as the op would.

Only ops whose outputs are fresh storages are repeated this way: an op whose schema says it aliases or writes an
input (views, in-place and ``out=`` ops) always runs, and so does one whose first run returned a tensor on an
input's storage, on another output's storage, at a storage offset or on a storage larger than its strides need
(each of which an ``empty_strided`` copy would get wrong). Anything but ``meta`` tensors runs the op itself.
"""

from __future__ import annotations

import torch

_MAX_ENTRIES = 100_000  # the records are small (a shape and strides per output); a bound, not a tuning knob
# key -> (one tensor returned?, ((shape, stride, dtype) | None per output), the container's type), or None: always run
_records: dict[tuple, tuple | None] = {}
_never: set = set()  # ops whose schema aliases or writes an argument


def _schema_aliases(func) -> bool:
    schema = func._schema
    return any(r.alias_info is not None for r in schema.returns) or any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _key_of(item, tensors: list) -> object:
    """A hashable description of one argument: tensors by their metadata (collected in ``tensors``), Python
    scalars with their type (``1``, ``1.0`` and ``True`` are equal and hash alike, but promote differently)."""
    if isinstance(item, torch.Tensor):
        tensors.append(item)
        return (item.dtype, item.shape, item.stride())
    if isinstance(item, (list, tuple)):
        return tuple(_key_of(i, tensors) for i in item)
    return (type(item), item)


def _minimal_storage_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _record(out, inputs: list[torch.Tensor]) -> tuple | None:
    """What ``empty_strided`` needs to make ``out`` again, or None when a copy could not stand for it."""
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else out
    if not isinstance(outs, (tuple, list)):
        return None
    storages = {t.untyped_storage()._cdata for t in inputs}
    entries = []
    for t in outs:
        if t is None:
            entries.append(None)
            continue
        if type(t) is not torch.Tensor or not t.is_meta:  # a subclass, a number, another device
            return None
        key = t.untyped_storage()._cdata
        if (key in storages or t.storage_offset() != 0
                or t.untyped_storage().nbytes() != _minimal_storage_bytes(t) or t.is_conj() or t.is_neg()):
            return None
        storages.add(key)
        entries.append((tuple(t.shape), tuple(t.stride()), t.dtype))
    return single, tuple(entries), type(out)


def run_meta_op(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)``; for an op on ``meta`` tensors seen before with the same metadata and arguments, its
    outputs made from the record of that first run (fresh storages of the same shapes, strides and dtypes)."""
    if func in _never:
        return func(*args, **kwargs)
    tensors: list[torch.Tensor] = []
    try:
        # the default dtype too: a factory op without a dtype (``arange``, ``full``) reads it
        key = (func, _key_of(args, tensors), _key_of(tuple(sorted(kwargs.items())), tensors),
               torch.get_default_dtype())
        hash(key)
    except TypeError:  # an unhashable argument: not recorded
        return func(*args, **kwargs)
    if not tensors and str(kwargs.get("device")) != "meta":
        return func(*args, **kwargs)
    if any(type(t) is not torch.Tensor or not t.is_meta for t in tensors):
        return func(*args, **kwargs)
    record = _records.get(key, False)
    if record is False:
        if _schema_aliases(func):
            _never.add(func)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if len(_records) >= _MAX_ENTRIES:
            _records.clear()
        _records[key] = _record(out, tensors)
        return out
    if record is None:
        return func(*args, **kwargs)
    single, entries, kind = record
    made = [None if e is None else torch.empty_strided(e[0], e[1], dtype=e[2], device="meta") for e in entries]
    return made[0] if single else kind(made)
