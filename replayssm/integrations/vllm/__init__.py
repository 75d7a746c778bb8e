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
_HOOKED = False                  # the import hooks are installed once per process


def status() -> dict:
    """What the last `register()` did: `registered` and a `reason`."""
    return dict(_STATUS)


def register(environ=None) -> bool:
    """The entry point vLLM calls in each of its processes. Returns whether the layers are
    patched (each class when vLLM imports its module, in whichever process does: `register()`
    itself imports nothing of vLLM, so a front-end process leaves CUDA uninitialised): False
    (and nothing touched) when `REPLAYSSM_VLLM` is not set, or when vLLM is not installed (with
    a message saying so). Safe to call more than once."""
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
    # nothing of vLLM is imported here (vLLM's front-end process must leave CUDA alone): each
    # class is patched when vLLM imports its module, and the symbols are read on first use
    from . import layers
    ns = _compat.load()

    def layer(name, family, forward, make_forward):
        def patch(module):
            cls = getattr(module, name)
            layers.declare_layer(ns, cls, family, cfg)
            if cfg.spec_blocks == "one":
                layers.one_block_per_request(cls)
            _compat.patch_method(cls, forward, make_forward(ns, cfg))
        return patch

    def runner(module):
        _compat.patch_method(module.GPUModelRunner, "initialize_kv_cache_tensors", layers.bind_states(ns, cfg))

    def worker(module):
        if cfg.prefix_records == "side":
            _compat.patch_method(module.Worker, "determine_available_memory", layers.reserve_side_records(ns, cfg))

    def model(name, family):
        def patch(module):
            cls = getattr(module, name, None)
            if cls is not None:
                layers.declare_model(ns, cls, family, cfg)
        return patch

    global _HOOKED
    if not _HOOKED:
        _compat.when_imported(_compat.MAMBA2_MODULE, layer("MambaMixer2", "mamba2", "conv_ssm_forward",
                                                           layers.mamba2_forward))
        _compat.when_imported(_compat.GDN_MODULE, layer("QwenGatedDeltaNetAttention", "gdn", "_forward_core",
                                                        layers.gdn_forward))
        _compat.when_imported(_compat.RUNNER_MODULE, runner)
        _compat.when_imported(_compat.WORKER_MODULE, worker)
        for module, name, family in _compat.MODEL_CLASSES:
            _compat.when_imported(module, model(name, family))
        _HOOKED = True
    _STATUS.update(registered=True, reason=f"vLLM {version}: Mamba-2 and GDN layers on replayssm ({cfg})")
    log.info("replayssm: %s", _STATUS["reason"])
    return True
