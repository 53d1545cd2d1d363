"""DSV4 model code (no process groups here; context parallelism arrives as a ``CPContext`` argument).

:func:`build_causal_lm` builds the causal LM of a config's family (``config.model_type``): ``DSV4ForCausalLM`` for
"deepseek_v4", ``dsv4.model.v41.DSV41ForCausalLM`` for "deepseek_v41".
"""

from __future__ import annotations

import torch.nn as nn

from dsv4.model.model import DSV4ForCausalLM, DSV4Model, DSV4Output, parameter_counts


def causal_lm_class(config) -> type[nn.Module]:
    """The causal-LM class of ``config``'s family (``config.model_type``; ValueError naming an unknown one)."""
    family = getattr(config, "model_type", "deepseek_v4")
    if family == "deepseek_v4":
        return DSV4ForCausalLM
    if family == "deepseek_v41":
        from dsv4.model.v41.model import DSV41ForCausalLM  # noqa: PLC0415 - V4.1 code loads on first use

        return DSV41ForCausalLM
    raise ValueError(f"build_causal_lm: unknown config.model_type {family!r}, expected 'deepseek_v4' or "
                     "'deepseek_v41'")


def build_causal_lm(config, **options) -> nn.Module:
    """A freshly initialised causal LM of ``config``'s family (DSV4ForCausalLM or DSV41ForCausalLM); both take
    the same forward arguments and return :class:`DSV4Output`. ``options`` go to the class (V4.1: ``tokenizer``,
    the checkpoint's, for Engram hashing)."""
    return causal_lm_class(config)(config, **options)


__all__ = ["DSV4ForCausalLM", "DSV4Model", "DSV4Output", "build_causal_lm", "causal_lm_class", "parameter_counts"]
