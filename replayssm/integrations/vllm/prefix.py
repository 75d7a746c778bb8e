"""Prefix caching of replayssm state in vLLM 0.25 (`--enable-prefix-caching`, plain decoding).

vLLM keeps the recurrent state of a hybrid model's prefix in its blocks in one of two modes
(`cache_config.mamba_cache_mode`):

- `align`: each request computes in one running block; when a step starts in a new block,
  the model runner first copies the previous block into it, tensor by tensor, with the model
  class's `get_mamba_state_copy_func()` (one function per state tensor). A block whose last
  token ended a step exactly on a block boundary keeps the state there and becomes a cache
  entry; a later request that shares the prefix gets that block copied into its running block
  and prefills (or decodes) the rest from it.
- `all`: the layers themselves read the state from one block and write intermediate states
  into every block a prefill chunk crosses (Mamba-2 only; vLLM's default for NemotronH).

replayssm supports `align`. A block's state is its checkpoint folded with the records behind
its cursor, so a byte copy of all of the block's tensors (vLLM's conv state, checkpoint, record
decays, records, keys, counters) carries the exact state, and nothing has to be written at a
boundary: the block a step leaves holds `fold(ckpt, records[:cursor])` at the boundary, and the
prefill that continues from a copied block folds its records first (`batch.before_prefill`), as
after any chunk. vLLM's own copy functions cover its two tensors only (conv, SSM state), so the
model classes' `get_mamba_state_copy_func` is patched to name one per replayssm tensor: without
it a copied block would keep the previous owner's records and cursor.

Not supported, refused at engine start with a message: `all` (serve with `--mamba-cache-mode
align`), and prefix caching together with speculative decoding (vLLM's align-mode copies after a
verify read the per-draft state blocks that the plugin does not keep).
"""
from __future__ import annotations

from typing import Tuple

from . import _compat

MODES = ("none", "align")


def check_cache_mode(mode: str, num_spec: int) -> None:
    """Refuse, with what to do instead, the prefix-caching settings the plugin does not
    support: `mamba_cache_mode` `mode` with `num_spec` speculative tokens."""
    if mode == "none":
        return
    if mode == "all":
        raise NotImplementedError(
            "replayssm's vLLM plugin supports prefix caching of recurrent state in vLLM's 'align' mode only "
            "(mamba_cache_mode='all' is vLLM's default for NemotronH): serve with --mamba-cache-mode align "
            "(LLM(..., mamba_cache_mode='align') offline), or without --enable-prefix-caching, or unset "
            "REPLAYSSM_VLLM")
    if mode != "align":
        raise NotImplementedError(f"replayssm's vLLM plugin: unknown mamba_cache_mode {mode!r}; it supports "
                                  f"{MODES}")
    if num_spec:
        raise NotImplementedError(
            "replayssm's vLLM plugin does not yet combine prefix caching of recurrent state with speculative "
            f"decoding ({num_spec} speculative tokens): serve without --enable-prefix-caching, or without "
            "speculative decoding, or unset REPLAYSSM_VLLM")


def copy_funcs(ns, n_tensors: int) -> Tuple:
    """vLLM's state copy functions for a replayssm block of `n_tensors` tensors (`StateSpec`'s
    order): its conv-state copy for tensor 0 (vLLM's own conv state), the whole-slot copy
    for every other tensor (checkpoint, record decays, records, keys, counters)."""
    if n_tensors < 2:
        raise ValueError(f"a replayssm block has at least a conv state and a checkpoint, got {n_tensors} tensors")
    return (ns.get_conv_copy_spec,) + (ns.get_temporal_copy_spec,) * (n_tensors - 1)


def declare_copy(ns, cls, n_tensors: int) -> bool:
    """Patch `cls.get_mamba_state_copy_func` (a classmethod defined on `cls`; inherited ones
    are patched on the class that defines them) to copy all `n_tensors` of a block."""
    return _compat.patch_classmethod(cls, "get_mamba_state_copy_func",
                                     lambda orig: lambda kls: copy_funcs(ns, n_tensors))
