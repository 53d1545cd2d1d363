"""Lightning callbacks of the dsv4 recipes. Each reads ``pl_module.last_step_stats``
(:class:`dsv4.training.stats.StepStats`) and/or the device, and logs through ``pl_module.log``.

* :class:`ThroughputCallback` -- ``perf/tokens_per_s`` (progress bar), ``perf/tokens_per_s_per_device``,
  ``perf/label_tokens_per_s``, ``perf/step_time_s``, ``perf/tflops_per_device``, ``perf/mfu`` (GPU with a known peak).
* :class:`PaddingCallback` -- ``data/padding_fraction``, ``data/pack_padding_fraction``,
  ``data/alignment_padding_fraction`` (+ ``_cumulative``), ``data/tokens_per_step``, ``data/label_tokens_per_step``.
* :class:`CPTrafficCallback` -- ``cp/bytes_received_per_step``, ``cp/bytes_sent_per_step``, ``cp/<kind>_bytes``.
* :class:`MemoryCallback` -- CUDA: ``mem/max_allocated_gib``, ``mem/max_reserved_gib``, ``mem/num_alloc_retries``;
  CPU: ``mem/rss_gib``, ``mem/peak_rss_gib``.
* :class:`TextProgressCallback` -- a plain text line (step, loss, lr, tokens/s, ETA) every N steps for logs that are
  not a terminal.
* :class:`Preemption` -- not a metric: on ``preemption.signals`` stop after the optimizer step with a complete
  checkpoint (wired by :func:`dsv4.training.run.run_finetune`, not a ``callbacks`` entry).
"""

from dsv4.callbacks.cp_traffic import CPTrafficCallback
from dsv4.callbacks.memory import MemoryCallback
from dsv4.callbacks.padding import PaddingCallback
from dsv4.callbacks.preemption import Preemption
from dsv4.callbacks.progress import TextProgressCallback
from dsv4.callbacks.throughput import ThroughputCallback

__all__ = ["CPTrafficCallback", "MemoryCallback", "PaddingCallback", "Preemption", "TextProgressCallback", "ThroughputCallback"]
