"""What a worker started by torchrun (``torch.distributed.run``) needs to survive ``--max-restarts``.

torchrun's c10d rendezvous by default shares one TCP store with its workers (``TORCHELASTIC_USE_AGENT_STORE=True``):
node rank 0's agent hosts it, and it lives as long as the agent, across every restart of the worker group. The
workers' process group keys (``default_pg/...``: each rank's gloo address, NCCL's unique id) are written into it
without a per-restart prefix, so the keys of the round before a restart are still there when the restarted workers
form their group. A restarted rank that reads a peer's key before that peer wrote its new one gets the dead round's
address, and the group fails to form (gloo: ``connectFullMesh ... Connection refused``), depending on which rank is
first: a race. With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment the agent does not share its
store: every round's rank 0 worker hosts a fresh store on a port the agent picks for that round, which holds no key
of an earlier round. The variable is read by the agent, not by the workers, so a worker can only detect its absence
(:func:`restart_store_warning`).
"""

from __future__ import annotations

from typing import Mapping

SHARE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def restart_store_warning(env: Mapping[str, str]) -> str | None:
    """The warning for a torchrun worker (``env``: its environment) whose agent may restart it
    (``TORCHELASTIC_MAX_RESTARTS`` > 0) while sharing its TCP store with the workers; None otherwise."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts <= 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (f"torchrun --max-restarts={restarts} with its TCP store shared with the workers: a restarted group can "
            f"read the previous round's process-group keys and fail to form (gloo: connectFullMesh ... Connection "
            f"refused). Set {SHARE_STORE_VAR}=1 in torchrun's environment (docs/scale.md#a-lost-rank)")
