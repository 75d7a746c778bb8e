"""vLLM plugin: NemotronH (Mamba-2) and Qwen3-Next / Qwen3.5 (GDN) on ReplaySSM state.

Registered as a `vllm.general_plugins` entry point (`replayssm = replayssm.integrations.vllm:register`),
so every vLLM process calls `register()` at start-up. Off unless `REPLAYSSM_VLLM=1`:

    REPLAYSSM_VLLM=1 vllm serve MODEL                      # no prefix caching (one state block per request)
    REPLAYSSM_VLLM=1 vllm serve MODEL --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'

Where enabled, each recurrent layer declares its per-request state as replayssm's checkpoint,
records and counters inside the blocks vLLM allocates (`state.StateSpec`), decodes through
`replayssm.ops.<family>.replay_decode`, verifies drafts through `replay_verify` and commits
the accepted counts vLLM passes to the next step; prefill stays on vLLM's kernels and seeds
the checkpoint. Settings: `config.py`. Every vLLM symbol touched: `_compat.py` (checked
against vLLM `_compat.CHECKED_VERSIONS`).
"""
from __future__ import annotations

import logging
import warnings

from . import _compat
from .config import ENV_ENABLE, enabled, settings

__all__ = ["register", "enabled", "settings", "status"]

log = logging.getLogger(__name__)

_STATUS = {"registered": False, "reason": "register() not called"}


def status() -> dict:
    """What the last `register()` did: `registered` and a `reason`."""
    return dict(_STATUS)


def register(environ=None) -> bool:
    """The entry point vLLM calls in each of its processes. Returns whether the layers were
    patched: False (and nothing touched) when `REPLAYSSM_VLLM` is not set, or when vLLM is not
    importable (with a message saying so). Safe to call more than once."""
    if not enabled(environ):
        _STATUS.update(registered=False, reason=f"{ENV_ENABLE} is not set to 1")
        return False
    cfg = settings(environ)
    version = _compat.vllm_version()
    if version is None:
        msg = (f"replayssm: {ENV_ENABLE}=1 but vLLM is not installed here; the vLLM plugin does nothing "
               "(install vLLM 0.25.0 beside replayssm)")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        _STATUS.update(registered=False, reason=msg)
        return False
    if not _compat.version_checked(version):
        warnings.warn(f"replayssm: vLLM {version} is not one of the checked versions {_compat.CHECKED_VERSIONS}; "
                      "the plugin's touch points (replayssm/integrations/vllm/_compat.py) may need an update",
                      RuntimeWarning, stacklevel=2)
    from . import layers
    ns = _compat.load()
    layers.declare_layer(ns, ns.MambaMixer2, "mamba2", cfg)
    layers.declare_layer(ns, ns.GDN, "gdn", cfg)
    if cfg.spec_blocks == "one":
        layers.one_block_per_request(ns.MambaMixer2)
        layers.one_block_per_request(ns.GDN)
    for family, cls in ns.models:
        layers.declare_model(ns, cls, family, cfg)
    _compat.patch_method(ns.MambaMixer2, "conv_ssm_forward", layers.mamba2_forward(ns, cfg))
    _compat.patch_method(ns.GDN, "_forward_core", layers.gdn_forward(ns, cfg))
    _compat.patch_method(ns.GPUModelRunner, "initialize_kv_cache_tensors", layers.bind_states(ns, cfg))
    _STATUS.update(registered=True, reason=f"vLLM {version}: Mamba-2 and GDN layers on replayssm ({cfg})")
    log.info("replayssm: %s", _STATUS["reason"])
    return True
