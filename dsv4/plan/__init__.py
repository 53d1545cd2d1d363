"""The memory plan: what one rank of a configuration needs, before anything is allocated.

* ``plan.py``: :func:`~dsv4.plan.plan.memory_plan` adds the terms up and says whether they fit.
* ``states.py``: parameters, gradients and optimizer state per rank, under the real sharding.
* ``trace.py`` / ``activations.py``: the step's activations, traced with the real model code on ``meta``.
* ``offload.py``: what host offload moves off the device.
* ``comm.py``: the bytes each rank sends and receives per step by kind, their time at stated link speeds, the
  compute time.
* ``stand_ins.py``: shape-true stand-ins for the parts of a step that depend on data or on other ranks.
* ``suggest.py``: for a plan that does not fit, the cheapest overrides that do.
"""
