"""LoRA fine-tuning on a frozen base that may stay in the released FP8 / FP4 form (``peft=lora``).

* :mod:`~dsv4.peft.config`: :class:`LoRAConfig` (the ``peft`` config group);
* :mod:`~dsv4.peft.frozen`: kept FP8 / FP4 weights, dequantised per layer in forward and backward;
* :mod:`~dsv4.peft.lora`: :class:`LoRALinear`, :class:`LoRAGroupedExperts`;
* :mod:`~dsv4.peft.apply`: :func:`apply_lora`, :func:`merged_tensors`, :func:`keep_base_quantized` (the kept
  FP8 / FP4 base without adapters, for a frozen model);
* :mod:`~dsv4.peft.peft_format`: PEFT-format adapter export / load (``adapter_config.json`` +
  ``adapter_model.safetensors``, in transformers' module names so that PEFT applies it to transformers'
  ``DeepseekV4ForCausalLM``; the release-named layout is read too).
"""

from dsv4.peft.apply import adapter_state, apply_lora, is_lora_model, keep_base_quantized, merged_tensors
from dsv4.peft.config import BASE_DTYPES, TARGET_GROUPS, LoRAConfig
from dsv4.peft.lora import LoRAGroupedExperts, LoRALinear

__all__ = ["BASE_DTYPES", "TARGET_GROUPS", "LoRAConfig", "LoRAGroupedExperts", "LoRALinear", "adapter_state",
           "apply_lora", "is_lora_model", "keep_base_quantized", "merged_tensors"]
