"""Counting the memory a piece of model code allocates, without running it for real.

:class:`AllocationTracer` is a ``TorchDispatchMode`` that follows every tensor an op creates: its storage's bytes
count as live from the op until the last tensor viewing that storage is gone (PyTorch keeps a tensor's Python
object alive while autograd still holds the tensor, so saved activations stay counted until backward frees
them). It reports the live bytes now, the peak, and the bytes saved for backward (``saved_tensors_hooks``).
Run the code on the ``meta`` device and nothing is allocated: shapes, dtypes and lifetimes are exactly those of
the real run, at any size; an op repeated on the same shapes is not computed again (:mod:`dsv4.plan.meta_ops`).

Only tensors created while the tracer is active count (parameters and inputs made before are the caller's to
add); ``reset_peak()`` restarts the peak from the current live bytes. A view an op makes of an earlier tensor is a
new tensor object on its storage and counts like a new one, except on the storages of ``untracked`` tensors: storage
the caller holds and counts elsewhere (the plan: DeepSeek-V4.1's Engram tables, in its ``parameters``), never an
activation, however it is viewed (the FP8 table's lookup reads its rows through a ``uint8`` view of the whole table).

Attribution: :meth:`AllocationTracer.label_modules` names the model parts (``{module class: label}``); every
storage is charged to the innermost labelled module running when it was created (``default_label`` outside
them, e.g. in backward), and :attr:`AllocationTracer.saved_by_label` splits the saved bytes accordingly,
:attr:`AllocationTracer.peak_by_label` the live bytes at the peak.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.plan.meta_ops import run_meta_op


class AllocationTracer(TorchDispatchMode):
    """``with AllocationTracer() as t: ...``; then ``t.peak``, ``t.live``, ``t.saved`` (bytes). ``untracked``:
    tensors whose storage (and so every view of it) is never counted."""

    def __init__(self, default_label: str = "other", untracked: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.default_label = default_label
        self._untracked = {self._storage_key(t) for t in untracked}
        self.live = 0
        self.peak = 0
        self.saved = 0
        self.saved_by_label: dict[str, int] = defaultdict(int)
        self.live_by_label: dict[str, int] = defaultdict(int)
        self.peak_by_label: dict[str, int] = {}
        self._refs: dict[int, list] = {}  # storage key -> [bytes, tensors alive, label]
        self._saved_keys: set[int] = set()
        self._labels: list[str] = []
        self._hooks: list = []
        self._undo: list = []
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self):
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        for undo in reversed(self._undo):
            undo()
        return self._saved_hooks.__exit__(*exc)

    def label_modules(self, model: nn.Module, labels: dict[type, str]) -> None:
        """Charge what each module of a type in ``labels`` creates to its label (until the tracer exits)."""
        for module in model.modules():
            label = next((name for kind, name in labels.items() if isinstance(module, kind)), None)
            if label is not None:
                self._hooks.append(module.register_forward_pre_hook(lambda *_, name=label: self._labels.append(name)))
                # always_call: a recompute that torch stops early (the saved tensors it needs are back) still pops
                self._hooks.append(module.register_forward_hook(lambda *_: self._labels.pop() and None,
                                                                always_call=True))

    def label_method(self, owner: nn.Module, name: str, label: str) -> None:
        """Charge what ``owner.<name>(...)`` creates to ``label`` (until the tracer exits): the method is shadowed on
        the instance, so a recompute that calls the bound method it captured in forward is labelled too."""
        bound = getattr(owner, name)

        def call(*args, **kwargs):
            self._labels.append(label)
            try:
                return bound(*args, **kwargs)
            finally:
                self._labels.pop()

        owner.__dict__[name] = call
        self._undo.append(lambda: owner.__dict__.pop(name, None))

    def reset_peak(self) -> None:
        self.peak = self.live
        self.peak_by_label = {k: v for k, v in self.live_by_label.items() if v}

    def forget(self, t: torch.Tensor) -> None:
        """Stop counting ``t``'s storage (e.g. a segment's output, which the next segment accounts for)."""
        entry = self._refs.get(self._storage_key(t))
        if entry is not None:
            self.live -= entry[0]
            self.live_by_label[entry[2]] -= entry[0]
            entry[0] = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = self._storage_key(t)
        if key in self._refs and key not in self._saved_keys:  # activations this code made, each storage once
            self._saved_keys.add(key)
            nbytes = t.untyped_storage().nbytes()
            self.saved += nbytes
            self.saved_by_label[self._refs[key][2]] += nbytes
        return t

    @staticmethod
    def _storage_key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            self.live_by_label[entry[2]] -= entry[0]
            del self._refs[key]

    def _track(self, t: torch.Tensor) -> None:
        key = self._storage_key(t)
        if key in self._untracked:
            return
        entry = self._refs.get(key)
        if entry is None:
            label = self._labels[-1] if self._labels else self.default_label
            entry = self._refs[key] = [t.untyped_storage().nbytes(), 0, label]
            self.live += entry[0]
            self.live_by_label[label] += entry[0]
            if self.live > self.peak:
                self.peak = self.live
                self.peak_by_label = {k: v for k, v in self.live_by_label.items() if v}
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            return NotImplemented  # a tensor subclass (DTensor): let it run its local ops, which come back here
        inputs = {id(a) for a in _tensors(args)}
        if kwargs:
            inputs.update(id(a) for a in _tensors(tuple(kwargs.values())))
        out = run_meta_op(func, args, kwargs or {})  # on meta tensors: a repeated op's outputs from a record
        for t in _tensors((out,)):
            if id(t) not in inputs:  # in-place ops return their input
                self._track(t)
        return out


def _tensors(items: tuple | list) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results: ``items`` and the lists / tuples in them (an aten op's
    arguments and results nest no deeper, and hold no dicts), in order. torch's ``tree_flatten`` gives the same
    tensors at several times the cost, and the tracer calls this on every op."""
    found = []
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            found.extend(_tensors(item))
    return found
