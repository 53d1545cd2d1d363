"""DSV4 model code (no process groups here; context parallelism arrives as a ``CPContext`` argument)."""

from dsv4.model.model import DSV4ForCausalLM, DSV4Model, DSV4Output, parameter_counts

__all__ = ["DSV4ForCausalLM", "DSV4Model", "DSV4Output", "parameter_counts"]
