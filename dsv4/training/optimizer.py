"""The recipe's optimizer (``conf/optim/adamw.yaml``): AdamW with its two moments kept in fp32, bf16 or 8 bits.

:func:`adamw` is the Hydra ``_partial_`` factory ``params -> torch.optim.Optimizer``; ``state_dtype``
(``optim.state_dtype``) chooses what the moments ``exp_avg`` / ``exp_avg_sq`` are stored in between steps:

* ``float32``: ``torch.optim.AdamW`` itself (8 bytes per trainable element).
* ``bfloat16``: :class:`BF16AdamW`, our own small AdamW. Each step loads the moments into fp32, applies the AdamW
  recurrence and the update in fp32 (the update uses the fp32 moments of this step), then stores the moments rounded
  to the nearest bf16 (4 bytes per element). Our own rather than torchao's: torchao has no bf16-state AdamW for fp32
  parameters (its ``_AdamW`` is for bf16 / quantized parameters), and a plain eager loop of tensor ops runs on
  FSDP2's DTensor shards, on CPU and CUDA alike, with no compile.
* ``8bit``: torchao's ``AdamW8bit`` (block-wise dynamic-quantized moments: a uint8 code per element and an fp32
  scale per 256-element block, ~2.03 bytes per element for both moments; a state tensor with fewer than 4096 elements
  or a size not a multiple of 256 stays fp32), through :func:`adamw8bit_class`. torchao compiles each parameter's update
  (``torch.compile(fullgraph=True, dynamic=False)``, one compile per distinct shape: ~40 s each on a small CPU);
  :func:`adamw8bit_class` runs the step under ``torch.compiler.set_stance("force_eager")`` when a parameter lives on the
  CPU (the same update code, eagerly), and compiled on CUDA. torchao keeps ``group["lr"]`` as a 0-dim tensor:
  torch's LR schedulers ``fill_`` it in place (so does :class:`~dsv4.training.schedule.WarmupCosineLR`).

Every variant skips a parameter whose ``grad`` is None (its parameter and state unchanged). Checkpoints (DCP,
``get_optimizer_state_dict``): the bf16 moments are saved as bf16; the 8-bit moments as torchao's ``OptimState8bit``
(codes and scales, never dequantised), also inside the DTensors of FSDP2 and of expert parallelism; an asynchronous
save stages them through ``new_empty`` (:func:`_stageable`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

STATE_DTYPES = ("float32", "bfloat16", "8bit")
LOWBIT_INSTALL = "pip install 'dsv4[lowbit]' (or pip install torchao==0.18.0)"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def check_state_dtype(state_dtype: str) -> None:
    """ValueError naming ``optim.state_dtype`` unless it is one of :data:`STATE_DTYPES`; ImportError naming the key
    and the install command when ``8bit`` is chosen and torchao is not installed."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"`optim.state_dtype`={state_dtype!r} must be one of {list(STATE_DTYPES)}")
    if state_dtype == "8bit":
        try:
            import torchao.optim  # noqa: F401
        except ImportError as err:
            raise ImportError(f"`optim.state_dtype`=8bit needs torchao: {LOWBIT_INSTALL} ({err})") from None


def adamw(params: Iterable[Any], *, lr: float, betas: tuple[float, float] | list[float], weight_decay: float,
          eps: float = 1e-8, state_dtype: str = "float32", foreach: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``params`` with its moments stored in ``state_dtype`` (see the module docstring). ``foreach``
    applies to ``float32`` only (the other two update one tensor at a time)."""
    check_state_dtype(state_dtype)
    betas = (float(betas[0]), float(betas[1]))
    if state_dtype == "float32":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, foreach=foreach)
    if state_dtype == "bfloat16":
        return BF16AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
    return adamw8bit_class()(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose moments are stored in bf16; the arithmetic is fp32.

    Per parameter ``p`` with gradient ``g`` at step ``t`` (``m``, ``v`` the stored bf16 moments)::

        m32 = beta1 * m + (1 - beta1) * g          v32 = beta2 * v + (1 - beta2) * g * g      (fp32)
        p  <- p * (1 - lr * weight_decay) - lr / (1 - beta1^t) * m32 / (sqrt(v32 / (1 - beta2^t)) + eps)
        m  <- bf16(m32)                            v  <- bf16(v32)                 (round to nearest even)

    State per parameter: ``step`` (a 0-dim fp32 tensor, as torch's AdamW), ``exp_avg`` / ``exp_avg_sq`` (bf16, the
    parameter's shape; a DTensor parameter gets DTensor moments of the same placements). Loading a state dict keeps
    the moments bf16 (``torch.optim.Optimizer.load_state_dict`` casts state to the parameter's dtype; the cast back
    is exact)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW needs lr, eps, weight_decay >= 0 and betas in [0, 1): got lr={lr}, eps={eps}, "
                             f"weight_decay={weight_decay}, betas={tuple(betas)}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.register_load_state_dict_post_hook(BF16AdamW._moments_to_bf16)

    @staticmethod
    def _moments_to_bf16(optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            for key in _MOMENTS:
                if key in state and state[key].dtype != torch.bfloat16:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("BF16AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                grad = _local(p.grad).float()
                param, m_store, v_store = _local(p), _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                m = m_store.float().mul_(beta1).add_(grad, alpha=1 - beta1)
                v = v_store.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_store.copy_(m)
                v_store.copy_(v)
                denom = v.div_(1 - beta2 ** t).sqrt_().add_(eps)
                param.mul_(1 - lr * decay)
                param.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
                del grad, m, v, denom  # free this tensor's fp32 moments before the next tensor's are made
        return loss


@functools.cache
def adamw8bit_class() -> type:
    """torchao's ``AdamW8bit`` (block size 256; moments as ``OptimState8bit`` for state tensors of >= 4096 elements
    and a multiple of 256, else fp32) whose step runs eagerly (``torch.compiler.set_stance("force_eager")``) when a
    parameter is on the CPU, compiled otherwise. Constructed like torchao's class; torchao is imported on the first
    call (it takes seconds)."""
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit
    except ImportError as err:  # check_state_dtype names the key first; this is for direct use
        raise ImportError(f"`optim.state_dtype`=8bit needs torchao: {LOWBIT_INSTALL} ({err})") from None

    from torchao.optim.subclass_8bit import OptimState8bit

    _stageable(OptimState8bit)

    class AdamW8bit(TorchaoAdamW8bit):
        __doc__ = adamw8bit_class.__doc__

        @torch.no_grad()
        def step(self, closure=None):
            with _eager_on_cpu(self):
                return super().step(closure)

    AdamW8bit.__module__ = __name__
    return AdamW8bit


def _stageable(state_cls: type) -> None:
    """Let DCP's asynchronous save stage ``state_cls`` (torchao's ``OptimState8bit``): its stager allocates each
    tensor's host copy with ``new_empty`` and then copies the tensor's attributes (codes, scales, map) into it, an op
    torchao 0.18 does not implement. Registered through torchao's own op table (``implements``), unless torchao has
    one."""
    op = torch.ops.aten.new_empty.default
    if op in getattr(state_cls, "_ATEN_OP_TABLE", {}).get(state_cls, {}):
        return

    @state_cls.implements(op)
    def _new_empty(func, types, args, kwargs):
        x, size = args[0], args[1]
        device = kwargs.get("device") or x.device
        codes = torch.empty(size, dtype=torch.uint8, device=device)
        scale = torch.empty(codes.numel() // x.block_size, dtype=x.scale.dtype, device=device)
        return state_cls(codes, scale, x.qmap.to(device), x.signed, dtype=x.dtype)


def _eager_on_cpu(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    on_cpu = any(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"])
    return torch.compiler.set_stance("force_eager") if on_cpu else contextlib.nullcontext()


def storage_bytes(t: Any) -> int:
    """Bytes of real storage behind ``t``: a DTensor's local tensor, a tensor subclass's inner tensors
    (``__tensor_flatten__``, e.g. torchao's codes, scales and quantization map), recursively; a plain tensor's
    ``numel x element_size``; 0 for anything else. (``element_size()`` of a subclass reports its appearance
    dtype, not what it stores.)"""
    if isinstance(t, DTensor):
        return storage_bytes(t.to_local())
    if not isinstance(t, torch.Tensor):
        return 0
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(storage_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Real storage bytes of every tensor in ``optimizer.state`` (:func:`storage_bytes`; this rank's shards)."""
    return sum(storage_bytes(v) for state in optimizer.state.values() for v in state.values())
