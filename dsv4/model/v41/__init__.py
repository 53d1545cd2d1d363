"""DeepSeek-V4.1 model code: CSA2 attention roles with a shared per-forward state, two-level top-k, single-pass
hyper-connections, the V4.1 MoE gate, Engram; built from a :class:`dsv4.config_v41.DSV41Config` by
:func:`dsv4.model.build_causal_lm`. Everything V4.1 shares with V4 (norms, RoPE/YaRN, the sparse-attention kernels,
the attention metadata, MoE experts and dispatch, packed inputs, the loss) is V4's code in :mod:`dsv4.model`."""
