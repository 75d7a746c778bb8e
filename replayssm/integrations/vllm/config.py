"""The plugin's settings, read from the environment when `register()` runs (every vLLM
process runs it, so the engine core and its workers agree).

- `REPLAYSSM_VLLM=1` turns the plugin on; unset, empty or `0`, `register()` does nothing.
- `REPLAYSSM_VLLM_WINDOW` (default 16): `L`, records folded into the checkpoint every `L` tokens.
- `REPLAYSSM_VLLM_RECORDS` (`auto` by default, `fp32`, `model`): the records' dtype. `auto`
  keeps Mamba-2 records in the model dtype (they are copies of the layer's inputs, exact) and
  GDN records in fp32 (GDN's `u` is computed, and bf16 would round it).
- `REPLAYSSM_VLLM_STATE` (`auto` by default, `strided`, `staged`): how the kernels reach the
  state in vLLM's blocks. `strided`: directly (the windowed kernels take a slot stride; window
  above 1); `staged`: the batch's rows are gathered into contiguous scratch tensors and written
  back (three times the state traffic, the fallback); `auto`: strided where the kernels' own
  checks accept the views (probed once per layer), else staged.
- `REPLAYSSM_VLLM_SPEC_BLOCKS` (`one` by default, `vllm`): state blocks per request with
  drafts. `one` asks vLLM for one per recurrent layer (rollback is the cursor move, so the
  plugin needs no other), so that vLLM neither allocates nor counts the rest and more
  requests fit the cache; `vllm` keeps vLLM's `1 + num_speculative_tokens`, of which the
  plugin uses the first.
- `REPLAYSSM_VLLM_PREFIX_RECORDS` (`page` by default, `side`): where the records live under
  prefix caching in `align` mode without drafts. `page`: in vLLM's page beside the checkpoint,
  which makes the page, and so vLLM's cache block, larger than stock's (a coarser cache);
  `side`: in tensors of the plugin's own, indexed by block like the pages, so that the page and
  the block are stock's (experimental, not yet run on a GPU; `state.StateSpec.side_records`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

ENV_ENABLE = "REPLAYSSM_VLLM"
ENV_WINDOW = "REPLAYSSM_VLLM_WINDOW"
ENV_RECORDS = "REPLAYSSM_VLLM_RECORDS"
ENV_STATE = "REPLAYSSM_VLLM_STATE"
ENV_SPEC_BLOCKS = "REPLAYSSM_VLLM_SPEC_BLOCKS"
ENV_PREFIX_RECORDS = "REPLAYSSM_VLLM_PREFIX_RECORDS"

RECORD_CHOICES = ("auto", "fp32", "model")
STATE_CHOICES = ("auto", "strided", "staged")
SPEC_BLOCK_CHOICES = ("vllm", "one")
PREFIX_RECORD_CHOICES = ("page", "side")


@dataclass(frozen=True)
class Settings:
    window: int = 16
    records: str = "auto"
    state: str = "auto"
    spec_blocks: str = "one"
    prefix_records: str = "page"


def enabled(environ=None) -> bool:
    """Whether `REPLAYSSM_VLLM` asks for the plugin: `1`, `true`, `yes`, `on` (any case)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_ENABLE, "").strip().lower() in ("1", "true", "yes", "on")


def settings(environ=None) -> Settings:
    """The settings from the environment; ValueError naming the variable on a bad value."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_WINDOW, "16").strip()
    try:
        window = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_WINDOW}={raw!r} is not an integer") from None
    if window < 1:
        raise ValueError(f"{ENV_WINDOW}={window} must be >= 1")
    records = env.get(ENV_RECORDS, "auto").strip().lower()
    if records not in RECORD_CHOICES:
        raise ValueError(f"{ENV_RECORDS}={records!r} must be one of {RECORD_CHOICES}")
    state = env.get(ENV_STATE, "auto").strip().lower()
    if state not in STATE_CHOICES:
        raise ValueError(f"{ENV_STATE}={state!r} must be one of {STATE_CHOICES}")
    spec_blocks = env.get(ENV_SPEC_BLOCKS, "one").strip().lower()
    if spec_blocks not in SPEC_BLOCK_CHOICES:
        raise ValueError(f"{ENV_SPEC_BLOCKS}={spec_blocks!r} must be one of {SPEC_BLOCK_CHOICES}")
    prefix_records = env.get(ENV_PREFIX_RECORDS, "page").strip().lower()
    if prefix_records not in PREFIX_RECORD_CHOICES:
        raise ValueError(f"{ENV_PREFIX_RECORDS}={prefix_records!r} must be one of {PREFIX_RECORD_CHOICES}")
    return Settings(window=window, records=records, state=state, spec_blocks=spec_blocks,
                    prefix_records=prefix_records)
