"""DSV4 model code (no process groups here; context parallelism arrives as a ``CPContext`` argument).

``DSV4ForCausalLM``, ``DSV4Model`` and ``DSV4Output`` are imported lazily so that the leaf modules (rope,
compressor, norm, ...) can be imported on their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["DSV4ForCausalLM", "DSV4Model", "DSV4Output", "parameter_counts"]

if TYPE_CHECKING:
    from dsv4.model.model import DSV4ForCausalLM, DSV4Model, DSV4Output, parameter_counts


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dsv4.model import model as _model

        return getattr(_model, name)
    raise AttributeError(f"module 'dsv4.model' has no attribute {name!r}")
