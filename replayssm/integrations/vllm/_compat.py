"""Every vLLM symbol the plugin reads or patches, in one place, with the versions checked.

A newer vLLM should need changes here only. The plugin touches:

- `MambaMixer2` (NemotronH's Mamba-2 mixer): `get_state_shape`, `get_state_dtype` (the state
  replayssm keeps per block), `get_kv_cache_spec` (with `REPLAYSSM_VLLM_SPEC_BLOCKS=one`:
  its `MambaSpec` with no `num_speculative_blocks`, one block per request with drafts too)
  and `conv_ssm_forward` (decode rows on replayssm, prefill rows on vLLM's own path). Reads
  its `A`, `D`, `dt_bias`, `conv_weights`, `conv1d.bias`, `activation`,
  `split_hidden_states_B_C_fn`, `tped_intermediate_size`, `tped_conv_size`,
  `tped_dt_size`, `num_heads`, `head_dim`, `n_groups`, `ssm_state_size`, `tp_size`,
  `num_spec`, `prefix`, `kv_cache`, `cache_config`, `model_config`.
- `QwenGatedDeltaNetAttention` (Qwen3-Next, Qwen3.5): the same three declarations and
  `_forward_core`; reads `A_log`, `dt_bias`, `conv1d.weight`, `conv1d.bias`, `activation`,
  `num_k_heads`, `num_v_heads`, `head_k_dim`, `head_v_dim`, `key_dim`, `value_dim`,
  `tp_size`, `num_spec`.
- the model classes' `get_mamba_state_shape_from_config` / `get_mamba_state_dtype_from_config`
  (vLLM sizes the attention block from them before the layers exist, so they must agree with
  the layers' declarations) and `get_mamba_state_copy_func` (prefix caching in `align` mode:
  one copy function per replayssm tensor, vLLM's `get_conv_copy_spec` /
  `get_temporal_copy_spec`; `prefix.py`), and the layers' `cache_config.mamba_cache_mode`.
- with drafts in `align` mode (`REPLAYSSM_VLLM_PREFIX_SPEC=1`): `vllm.v1.worker.mamba_utils.
  postprocess_mamba_align_gpu` (patched, `prefix.declare_postprocess`) and its context
  `bufs.postprocess_align`: `mamba_group_ids`, `block_size`, `is_initialized`,
  `initialize_from_forward_context`, `state_inner_sizes`, `state_conv_widths`,
  `mamba_state_idx_buf`, `num_computed_tokens_buf`, `num_scheduled_tokens_buf`,
  `num_draft_tokens_buf`; the input batch's `block_table[gid].get_device_tensor`.
- the attention metadata each layer finds in `get_forward_context().attn_metadata[prefix]`
  (`Mamba2AttentionMetadata`, `GDNAttentionMetadata`: fields named in `layers.py`), replaced
  for the prefill-only call with `dataclasses.replace`.
- `causal_conv1d_update` (the decode rows' convolution, vLLM's kernel), `is_conv_state_dim_first`,
  `compute_causal_conv1d_metadata`, `NULL_BLOCK_ID`.
- `LLM.get_metrics()` (the benchmark's draft acceptance and prefix-cache counters, the checks'
  prefix-cache counters: `metric_values`, `prefix_cache_counters`).
- with the records outside the pages (`REPLAYSSM_VLLM_PREFIX_RECORDS=side`):
  `vllm.v1.worker.mamba_utils.collect_mamba_copy_meta` (patched, `prefix.declare_side_copy`) and
  the copy buffers' `src_ptrs`, `dst_ptrs`, `sizes` (`.np`), `offset`; the request's
  `block_ids`; `Worker.determine_available_memory` (patched, `layers.reserve_side_records`) and
  the worker's `model_runner`.
- `GPUModelRunner.initialize_kv_cache_tensors` (patched: the layers' states are built once the
  KV cache is bound) and the runner's `vllm_config`, `speculative_config`, `model_config`,
  `device`, `compilation_config.static_forward_context`, `num_accepted_tokens.gpu`.
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys

CHECKED_VERSIONS = ("0.25.0",)

# vLLM's start-up errors when the GPU's free memory moves under its memory profiling: another
# engine starting beside it, or the one before it not yet gone. A caller starting engines one
# after another (the serving benchmark) or side by side (the GPU suite) tries once more.
START_UP_MEMORY_ERRORS = ("Error in memory profiling", "No available memory for the cache blocks",
                          "is less than desired GPU memory utilization")

_PATCHED_ATTR = "_replayssm_original"


class VLLMUnavailable(ImportError):
    """vLLM is not importable here."""


def vllm_version():
    """vLLM's version string, or None when vLLM is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:                                     # pragma: no cover
        return None
    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def version_checked(v) -> bool:
    """Whether `v` is a release the plugin was written and checked against (a local build
    suffix, `0.25.0+cu129`, counts as its release)."""
    return v is not None and v.split("+")[0] in CHECKED_VERSIONS


# The modules whose classes the plugin patches. `register()` imports none of them: vLLM's
# front-end process must not initialise CUDA, or vLLM spawns its workers instead of forking
# them, which breaks a user's script without an `if __name__ == "__main__":` guard. Importing
# these modules there did (vLLM itself imports model modules in its front-end only in a
# subprocess, for that reason). Each patch is applied when vLLM itself imports the module
# (`when_imported`), in whichever process does.
MAMBA2_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
GDN_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
# model classes whose state declarations vLLM reads from the config: (module, class, family)
MODEL_CLASSES = (("vllm.model_executor.models.nemotron_h", "NemotronHForCausalLM", "mamba2"),
                 ("vllm.model_executor.models.qwen3_next", "Qwen3NextForCausalLM", "gdn"),
                 ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForConditionalGeneration", "gdn"))

# the symbols the patched methods read at run time: (module, attribute)
_SYMBOLS = {
    "MambaMixer2": (MAMBA2_MODULE, "MambaMixer2"),
    "GDN": (GDN_MODULE, "QwenGatedDeltaNetAttention"),
    "get_forward_context": ("vllm.forward_context", "get_forward_context"),
    "GPUModelRunner": (RUNNER_MODULE, "GPUModelRunner"),
    "causal_conv1d_update": ("vllm.model_executor.layers.mamba.ops.causal_conv1d", "causal_conv1d_update"),
    "is_conv_state_dim_first": ("vllm.model_executor.layers.mamba.mamba_utils", "is_conv_state_dim_first"),
    "extra_groups": ("vllm.model_executor.layers.mamba.mamba_utils",
                     "MambaStateShapeCalculator.extra_groups_for_head_shards"),
    "compute_conv_metadata": ("vllm.v1.attention.backends.utils", "compute_causal_conv1d_metadata"),
    "NULL_BLOCK_ID": ("vllm.v1.attention.backends.utils", "NULL_BLOCK_ID"),
    "get_conv_copy_spec": ("vllm.model_executor.layers.mamba.mamba_utils", "get_conv_copy_spec"),
    "get_temporal_copy_spec": ("vllm.model_executor.layers.mamba.mamba_utils", "get_temporal_copy_spec"),
}


class Symbols:
    """vLLM's symbols, each imported on first use (in a worker, at forward or binding time,
    where vLLM has imported its module already), never at `register()`."""

    def __getattr__(self, name: str):
        if name not in _SYMBOLS:
            raise AttributeError(name)
        module, path = _SYMBOLS[name]
        value = importlib.import_module(module)
        for part in path.split("."):
            value = getattr(value, part)
        setattr(self, name, value)
        return value


def load() -> Symbols:
    """The vLLM symbols the plugin reads, resolved lazily (see `Symbols`)."""
    if vllm_version() is None:
        raise VLLMUnavailable("vLLM is not installed")
    return Symbols()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks on a module right after its first import: the spec found by the other
    finders, its loader wrapped so that `exec_module` is followed by the callbacks."""

    def __init__(self):
        self.waiting = {}                        # module name -> [callback]

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenCall(spec.loader, self, fullname)
        return spec


class _ThenCall(importlib.abc.Loader):
    # the callbacks are taken when the module runs, not when its spec is found: a lookup
    # without an import (`importlib.util.find_spec`) must leave them for the import itself
    def __init__(self, loader, hook, name):
        self.loader, self.hook, self.name = loader, hook, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        for callback in self.hook.waiting.pop(self.name, []):
            callback(module)

    def __getattr__(self, name):                 # get_source, get_filename, is_package, ...
        return getattr(self.loader, name)


_HOOK = _AfterImport()


def when_imported(module: str, callback) -> None:
    """`callback(module object)` now if `module` is imported already, else right after vLLM
    (or anything) first imports it, in this process."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        callback(loaded)
        return
    _HOOK.waiting.setdefault(module, []).append(callback)
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def patch_method(cls, name: str, make):
    """Replace `cls.name` by `make(original)` once (plugins may be loaded more than once per
    process); `make` gets the original function. Returns whether it patched now."""
    current = cls.__dict__.get(name)
    if current is None:
        current = getattr(cls, name)
    if getattr(current, _PATCHED_ATTR, None) is not None:
        return False
    new = make(current)
    setattr(new, _PATCHED_ATTR, current)
    setattr(cls, name, new)
    return True


def patch_classmethod(cls, name: str, make):
    """As `patch_method` for a classmethod defined on `cls` itself (skipped when inherited:
    the class that defines it is patched instead). `make` gets the bound original's function."""
    raw = cls.__dict__.get(name)
    if not isinstance(raw, classmethod):
        return False
    if getattr(raw.__func__, _PATCHED_ATTR, None) is not None:
        return False
    new = make(raw.__func__)
    setattr(new, _PATCHED_ATTR, raw.__func__)
    setattr(cls, name, classmethod(new))
    return True


def metric_values(llm, keep) -> dict:
    """`{name: value}` of an offline engine's metrics (`LLM.get_metrics()`, names without vLLM's
    `vllm:` prefix) whose name `keep(name)` accepts; empty where the engine reports none
    (`disable_log_stats`), since callers print them beside results that stand without them."""
    try:
        metrics = llm.get_metrics()
    except Exception:                  # noqa: BLE001 - metrics are optional to every caller
        return {}
    got = {}
    for m in metrics:
        name = getattr(m, "name", "").split(":")[-1]
        if keep(name):
            got[name] = getattr(m, "value", None)
    return got


def prefix_cache_counters(llm) -> dict:
    """vLLM's prefix-cache counters (`prefix_cache_hits`, `prefix_cache_queries`, in tokens),
    where its metrics report them (`metric_values`)."""
    return metric_values(llm, lambda name: name in ("prefix_cache_hits", "prefix_cache_queries"))


def prefill_continues_a_state(md) -> bool:
    """Whether a Mamba-2 step's prefill rows may start from a state (chunked prefill after a
    first chunk): vLLM's host-side flag `prep_initial_states` (0.25.0's Mamba2AttentionMetadata,
    computed by vLLM's builder anyway), so that steps of fresh prompts skip the records' fold
    before the prefill. True where the flag is absent (the fold then runs, masked per row)."""
    return bool(getattr(md, "prep_initial_states", True))


def metadata_for(ns, prefix: str):
    """This layer's attention metadata in the current forward, or None (profile run)."""
    md = ns.get_forward_context().attn_metadata
    if md is None:
        return None
    if isinstance(md, list):
        # vLLM's micro-batching (DBO) hands one metadata dict per micro-batch
        raise NotImplementedError("replayssm's vLLM plugin does not support micro-batching (dual-batch overlap); "
                                  "serve without it, or unset REPLAYSSM_VLLM")
    return md[prefix]


class swapped_metadata:
    """Within the block, the forward context's metadata of layer `prefix` is `replacement`
    (for a call of vLLM's own forward on part of the batch)."""

    def __init__(self, ns, prefix: str, replacement):
        self.md = ns.get_forward_context().attn_metadata
        self.prefix, self.replacement = prefix, replacement

    def __enter__(self):
        self.saved = self.md[self.prefix]
        self.md[self.prefix] = self.replacement

    def __exit__(self, *exc):
        self.md[self.prefix] = self.saved
        return False
