"""The patched methods of vLLM's Mamba-2 and GDN layers (installed by `register()`).

Declarations: `get_state_shape` / `get_state_dtype` return replayssm's per-block tensors
(`state.StateSpec`): vLLM's conv state, then the checkpoint where vLLM keeps its SSM state,
records and counters. The model classes' config-time declarations return the same.

Forward (`conv_ssm_forward` of Mamba-2, `_forward_core` of GDN), for a batch with metadata:

- prefill rows: rows that continue from a state fold their records into the checkpoint
  (`batch.before_prefill`); vLLM's own forward then runs on the prefill rows alone (its
  metadata with the decode rows taken out) and writes their final states into the
  checkpoint; `batch.after_prefill` empties their records;
- decode rows: vLLM's `causal_conv1d_update` on its conv state, then `batch.run_decode`
  (replayssm decode, or commit + verify with speculative decoding).

The states are built when the model runner binds its KV cache (`bind_states`), before any
CUDA-graph capture. The profile run (no metadata) and layers in a process where the plugin is
off run stock code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from . import _compat, batch, prefix
from .config import Settings
from .executors import make_executor
from . import state as S
from .state import BlockState, StateSpec

# a child of vLLM's logger, so that its handlers print the plugin's lines with vLLM's own
_LOG = logging.getLogger("vllm.replayssm")

_STATE_ATTR = "_replayssm_state"


def record_dtype(settings: Settings, family: str, model_dtype: torch.dtype) -> torch.dtype:
    if settings.records == "fp32" or (settings.records == "auto" and family == "gdn"):
        return torch.float32
    return model_dtype


def make_spec(settings: Settings, family: str, stock_shapes, stock_dtypes, Hk: int, model_dtype,
              num_spec: int, cache_mode: str = "none") -> StateSpec:
    """The replayssm declaration from vLLM's own (conv shape and dtype; `[HV, V, K]`), the
    records outside the page where prefix caching's `cache_mode` and the settings ask for it."""
    conv_shape, (HV, V, K) = stock_shapes[0], stock_shapes[1]
    spec = StateSpec(family=family, HV=HV, Hk=Hk, V=V, K=K, window=settings.window,
                     max_draft=1 + num_spec, record_dtype=record_dtype(settings, family, model_dtype),
                     conv_shape=tuple(conv_shape), conv_dtype=stock_dtypes[0],
                     side_records=prefix.side_records(settings.prefix_records, cache_mode, num_spec))
    spec.check_alignment()
    return spec


# ------------------------------------------------------------------------------ declarations

def _layer_spec(layer, settings, family, stock_shape, stock_dtype):
    prefix.check_cache_mode(layer.cache_config.mamba_cache_mode, layer.num_spec, family)
    if family == "mamba2":
        Hk = layer.n_groups // layer.tp_size
    else:
        Hk = layer.num_k_heads // layer.tp_size
    return make_spec(settings, family, stock_shape(layer), stock_dtype(layer), Hk,
                     layer.model_config.dtype, layer.num_spec, layer.cache_config.mamba_cache_mode)


def _stock(cls, name: str):
    """vLLM's own method `name` of `cls` (the original under a patch)."""
    fn = getattr(cls, name)
    return getattr(fn, _compat._PATCHED_ATTR, None) or fn


def declare_layer(ns, cls, family: str, settings: Settings) -> None:
    shape, dtype = _stock(cls, "get_state_shape"), _stock(cls, "get_state_dtype")
    _compat.patch_method(cls, "get_state_shape", lambda orig: lambda self: _layer_spec(
        self, settings, family, shape, dtype).shapes())
    _compat.patch_method(cls, "get_state_dtype", lambda orig: lambda self: _layer_spec(
        self, settings, family, shape, dtype).dtypes())


def one_block_per_request(cls) -> None:
    """(`REPLAYSSM_VLLM_SPEC_BLOCKS=one`, the default.) With drafts, vLLM gives each request
    `1 + num_speculative_tokens` state blocks per recurrent layer (its kernels write one state
    per draft, the next step reading the accepted one). replayssm keeps one state per
    request, rollback being the cursor move: the layer's KV-cache spec asks for no
    speculative blocks, so that vLLM neither allocates nor counts them (a request's recurrent
    memory is its one block, records included). The state index tables then have one column
    where vLLM's own builders keep `1 + num_spec` (filled by broadcast): the plugin reads
    column 0 and passes the drafts' query length itself."""
    _compat.patch_method(cls, "get_kv_cache_spec", lambda orig: lambda self, vllm_config: _no_spec_blocks(
        orig(self, vllm_config)))


def _no_spec_blocks(spec):
    if spec is None or not getattr(spec, "num_speculative_blocks", 0):
        return spec
    return dataclasses.replace(spec, num_speculative_blocks=0)


def _config_spec(ns, settings, family, vllm_config, shapes, dtypes):
    tp = vllm_config.parallel_config.tensor_parallel_size
    if family == "mamba2":
        ng = vllm_config.model_config.hf_config.n_groups
        Hk = (ng + ns.extra_groups(ng, tp)) // tp
    else:
        Hk = vllm_config.model_config.hf_text_config.linear_num_key_heads // tp
    return make_spec(settings, family, shapes, dtypes, Hk, vllm_config.model_config.dtype,
                     vllm_config.num_speculative_tokens or 0, vllm_config.cache_config.mamba_cache_mode)


def declare_model(ns, cls, family: str, settings: Settings) -> None:
    # prefix caching ('align'): vLLM's copy between blocks must carry every tensor of a block
    prefix.declare_copy(ns, cls, S.N_TENSORS)
    raw_shape = cls.__dict__.get("get_mamba_state_shape_from_config")
    raw_dtype = cls.__dict__.get("get_mamba_state_dtype_from_config")
    if not (isinstance(raw_shape, classmethod) and isinstance(raw_dtype, classmethod)):
        return                     # inherited: the class that defines them is patched
    shape = getattr(raw_shape.__func__, _compat._PATCHED_ATTR, None) or raw_shape.__func__
    dtype = getattr(raw_dtype.__func__, _compat._PATCHED_ATTR, None) or raw_dtype.__func__

    def spec(kls, vllm_config):
        return _config_spec(ns, settings, family, vllm_config, shape(kls, vllm_config), dtype(kls, vllm_config))

    _compat.patch_classmethod(cls, "get_mamba_state_shape_from_config",
                              lambda orig: lambda kls, vllm_config: spec(kls, vllm_config).shapes())
    _compat.patch_classmethod(cls, "get_mamba_state_dtype_from_config",
                              lambda orig: lambda kls, vllm_config: spec(kls, vllm_config).dtypes())


# ------------------------------------------------------------------------------ state binding

_BIND_ATTR = "_replayssm_bind"


def _family(ns, layer):
    if isinstance(layer, ns.MambaMixer2):
        return "mamba2"
    if isinstance(layer, ns.GDN):
        return "gdn"
    return None


def _params_probe(layer, family: str, dtype, device):
    if family == "mamba2":
        return _mamba2_params(layer), _mamba2_probe(layer, dtype, device)
    return _gdn_params(layer), _gdn_probe(layer, dtype, device)


def bind_states(ns, settings: Settings):
    """Patch of the model runner's `initialize_kv_cache_tensors`: right after vLLM binds a KV
    cache (the profiling one, then the real one) each Mamba-2 / GDN layer's replayssm state and
    executor are built. vLLM runs no eager forward before its first CUDA-graph capture, and
    its config is not current at forward time: both are at hand here. Each layer also keeps the
    runner's per-row accepted counts (`num_accepted_tokens`, refreshed every step, in batch
    order), which vLLM passes to the layers only on steps where some row has drafts."""
    def make(orig):
        def initialize_kv_cache_tensors(self, *args, **kwargs):
            # vLLM frees the KV cache it bound for CUDA-graph memory profiling (a block per
            # captured token) before it allocates the real one; the states built over it hold
            # views of those blocks, which would keep them alive: the real cache's allocation
            # then ran out of memory with n-gram drafts (2048-token captures)
            release_states(self.compilation_config.static_forward_context.values())
            kv_caches = orig(self, *args, **kwargs)
            max_batch = self.vllm_config.scheduler_config.max_num_seqs
            accepted = self.num_accepted_tokens.gpu if self.speculative_config is not None else None
            state_of = lambda layer: (getattr(layer, _STATE_ATTR, None) or (None, None))[1]   # noqa: E731
            if accepted is not None and self.cache_config.mamba_cache_mode == "align":
                # prefix caching with drafts: the plugin commits and caches at each step's end
                prefix.declare_postprocess(ns, state_of)
            if settings.prefix_records == "side" and self.cache_config.mamba_cache_mode == "align":
                # records outside the pages: vLLM's copy between blocks carries them too
                prefix.declare_side_copy(state_of)
            for layer in self.compilation_config.static_forward_context.values():
                family = _family(ns, layer)
                if family is None:
                    continue
                layer.__dict__[_BIND_ATTR] = {
                    "max_batch": max_batch, "accepted": accepted,
                    "rows": torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)}
                bound_state(ns, layer, settings, family, self.model_config.dtype, self.device)
            return kv_caches
        return initialize_kv_cache_tensors
    return make


def release_states(layers) -> int:
    """Drop the states (and their executors) that `layers` built over a KV cache, so that its
    memory is freed once vLLM lets go of it; returns how many were dropped."""
    n = 0
    for layer in layers:
        if layer.__dict__.pop(_STATE_ATTR, None) is not None:
            n += 1
    _SIDE.clear()
    return n


# the records outside the pages (`StateSpec.side_records`), one set per vLLM memory pool: the
# layers that share a pool (one from each KV-cache group) never hold the same block at once
_SIDE = {}


def side_tensors(spec: StateSpec, kv) -> tuple:
    """The records' tensors outside the page for the layer bound to `kv` (vLLM's views), shared
    with the other layers of its memory pool (allocated at binding, never inside a capture)."""
    key = (kv[0].untyped_storage().data_ptr(), spec)
    if key not in _SIDE:
        _SIDE[key] = BlockState.allocate_side(spec, kv[0].shape[0], kv[0].device)
    return _SIDE[key]


def side_memory_share(specs) -> float:
    """The share of vLLM's KV-cache memory its pages may take when records live beside them:
    page / (page + records) of the layer that needs most (1.0 without side records). A
    block's records go with every pool's page of it, so the same share of each is reserved."""
    shares = [sp.page_bytes() / (sp.page_bytes() + sp.side_bytes()) for sp in specs if sp.side_records]
    return min(shares, default=1.0)


def reserve_side_records(ns, settings: Settings):
    """Patch of the worker's `determine_available_memory`, installed with
    `REPLAYSSM_VLLM_PREFIX_RECORDS=side`: vLLM sizes its KV cache from the memory this returns,
    so the records' tensors, which the plugin allocates beside the cache, get their share of
    it (`side_memory_share`)."""
    def make(orig):
        def determine_available_memory(self, *args, **kwargs):
            got = orig(self, *args, **kwargs)
            specs = []
            for layer in self.model_runner.compilation_config.static_forward_context.values():
                family = _family(ns, layer)
                if family is not None:
                    specs.append(_layer_spec(layer, settings, family, _stock(type(layer), "get_state_shape"),
                                             _stock(type(layer), "get_state_dtype")))
            share = side_memory_share(specs)
            if share < 1.0:
                _LOG.info("replayssm: %.1f%% of the KV-cache memory kept for the records beside the pages",
                          100 * (1 - share))
            return int(got * share)
        return determine_available_memory
    return make


def bound_state(ns, layer, settings: Settings, family: str, dtype, device):
    """`(BlockState, executor)` of `layer` over the tensors vLLM bound to it (built by
    `bind_states` when the KV cache is bound; it allocates, so never inside a capture). Every
    forward looks it up here: nothing is allocated unless the KV cache changed."""
    kv = layer.kv_cache
    key = kv[1].data_ptr()
    cached = getattr(layer, _STATE_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    bind = layer.__dict__.get(_BIND_ATTR)
    if bind is None:
        raise RuntimeError(f"replayssm: no state bound for {layer.prefix}: the plugin builds it when the "
                           "model runner initialises the KV cache (initialize_kv_cache_tensors)")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"replayssm: state of {layer.prefix} first seen inside a CUDA-graph capture")
    spec = _layer_spec(layer, settings, family, _stock(type(layer), "get_state_shape"),
                       _stock(type(layer), "get_state_dtype"))
    st = BlockState.from_kv_cache(spec, kv, side_tensors(spec, kv) if spec.side_records else None)
    mode = settings.state
    if st.ckpt.device.type != "cuda":
        mode = "reference"
    params, probe = _params_probe(layer, family, dtype, device)
    ex = make_executor(st, params, mode=mode, max_batch=bind["max_batch"], probe_inputs=probe["inputs"],
                       probe_out=probe["out"])
    setattr(layer, _STATE_ATTR, (key, st, ex))
    # `replayssm bench vllm` reads the executor from this line ("KernelExecutor (strided)")
    _LOG.info("replayssm: %s keeps %s state in vLLM's blocks, window %d, through %s%s", layer.prefix, family,
              spec.window, type(ex).__name__, f" ({ex.mode})" if hasattr(ex, "mode") else "")
    return st, ex


def _accepted(layer, given, rows: int):
    """The accepted counts of the step before for the first `rows` decode rows: vLLM's
    (`given`) where it passes them, else the runner's buffer (steps without any drafts), else
    None (no speculation configured: nothing is pending)."""
    if given is not None:
        return given
    buf = layer.__dict__.get(_BIND_ATTR, {}).get("accepted")
    return None if buf is None else buf[:rows]


@contextlib.contextmanager
def _stock_forward(layer):
    """Around a call of vLLM's own forward: that code unpacks `get_state_dtype()` as its two
    states (conv, SSM) for its kernels' autotune keys, while the patched declaration lists all
    of replayssm's parts. The first two of those are the tensors the stock forward reads and
    writes (vLLM's conv state, the checkpoint where it keeps its SSM state), so the layer
    answers with them while the call lasts."""
    parts = tuple(type(layer).get_state_dtype(layer))
    layer.__dict__["get_state_dtype"] = lambda: parts[:2]
    try:
        yield
    finally:
        layer.__dict__.pop("get_state_dtype", None)


def _conv_view(ns, conv):
    # vLLM's conv kernels take (..., dim, width - 1); the SD layout stores it transposed
    return conv if ns.is_conv_state_dim_first() else conv.transpose(-1, -2)


# ------------------------------------------------------------------------------ Mamba-2

def _mamba2_params(layer) -> dict:
    return {"A": layer.A, "dt_bias": layer.dt_bias, "D": layer.D}


def _mamba2_probe(layer, dtype, device) -> dict:
    HV, V = layer.num_heads // layer.tp_size, layer.head_dim
    Hk, K = layer.n_groups // layer.tp_size, layer.ssm_state_size
    z = dict(dtype=dtype, device=device)
    return {"inputs": {"x": torch.zeros(1, HV, V, **z), "dt": torch.zeros(1, HV, **z),
                       "B": torch.zeros(1, Hk, K, **z), "C": torch.zeros(1, Hk, K, **z)},
            "out": torch.zeros(1, HV, V, **z)}


def mamba2_forward(ns, settings: Settings):
    def make(orig):
        def conv_ssm_forward(self, projected_states, output):
            md = _compat.metadata_for(ns, self.prefix)
            if md is None:
                with _stock_forward(self):
                    return orig(self, projected_states, output)
            st, ex = bound_state(ns, self, settings, "mamba2", projected_states.dtype, projected_states.device)
            nd, ndt = md.num_decodes, md.num_decode_tokens
            every_block = prefix.all_mode(md)          # prefix caching, 'all' mode
            if md.num_prefills > 0:
                if _compat.prefill_continues_a_state(md):
                    sources = prefix.prefill_sources(md) if every_block else md.state_indices_tensor_p
                    batch.before_prefill(st, sources, md.has_initial_states_p, self.A)
                only_p = dataclasses.replace(md, num_decodes=0, num_decode_tokens=0, state_indices_tensor_d=None,
                                             query_start_loc_d=None, num_accepted_tokens=None,
                                             **(prefix.prefill_only(md) if every_block else {}))
                end = ndt + md.num_prefill_tokens
                with _compat.swapped_metadata(ns, self.prefix, only_p), _stock_forward(self):
                    orig(self, projected_states[ndt:end], output[ndt:end])
                if every_block:
                    prefix.seed_prefilled(st, md)
                else:
                    batch.after_prefill(st, md.state_indices_tensor_p)
            if nd > 0:
                _mamba2_decode(ns, self, md, st, ex, projected_states[:ndt], output[:ndt])
        return conv_ssm_forward
    return make


def _mamba2_decode(ns, layer, md, st, ex, proj, out):
    ndt = proj.shape[0]
    xbc, dt = torch.split(proj[..., layer.tped_intermediate_size:], [layer.tped_conv_size, layer.tped_dt_size],
                          dim=-1)
    idx = md.state_indices_tensor_d
    blocks = {}
    if prefix.all_mode(md):
        # each row reads the block of its last computed token and writes that of its token:
        # the recurrent state moves there first; vLLM's conv update moves its own
        slots = prefix.move_decoding(st, md)
        nd = idx.shape[0]
        blocks = dict(block_idx_last_scheduled_token=md.block_idx_last_scheduled_token[:nd],
                      initial_state_idx=md.block_idx_last_computed_token[:nd])
    else:
        slots = idx[:, 0]
    xbc = ns.causal_conv1d_update(xbc, _conv_view(ns, st.conv), layer.conv_weights, layer.conv1d.bias,
                                  layer.activation, conv_state_indices=idx,
                                  num_accepted_tokens=md.num_accepted_tokens, query_start_loc=md.query_start_loc_d,
                                  max_query_len=1 + layer.num_spec, **blocks)
    HV, Hk = layer.num_heads // layer.tp_size, layer.n_groups // layer.tp_size

    def inputs(rows_of):
        # gather the conv output and dt into the kernels' rows first, then split: two gathers
        # on steps with unequal rows rather than one per input
        x, B, C = layer.split_hidden_states_B_C_fn(rows_of(xbc))
        return {"x": x.unflatten(-1, (HV, layer.head_dim)), "dt": rows_of(dt),
                "B": B.unflatten(-1, (Hk, layer.ssm_state_size)), "C": C.unflatten(-1, (Hk, layer.ssm_state_size))}
    qsl, acc = md.query_start_loc_d, md.num_accepted_tokens
    if layer.num_spec and qsl is None:
        # a step in which no row has drafts: vLLM passes neither; one token per row
        qsl = layer.__dict__[_BIND_ATTR]["rows"][:ndt + 1]
        acc = _accepted(layer, None, ndt)
    batch.run_decode(ex, st, slots, inputs, out.view(ndt, HV, layer.head_dim), spec_tokens=layer.num_spec,
                     query_start_loc=qsl, num_accepted=acc, step=md)


# ------------------------------------------------------------------------------ GDN

def _gdn_params(layer) -> dict:
    return {"A_log": layer.A_log, "dt_bias": layer.dt_bias}


def _gdn_dims(layer):
    tp = layer.tp_size
    return layer.num_v_heads // tp, layer.num_k_heads // tp, layer.head_v_dim, layer.head_k_dim


def _gdn_probe(layer, dtype, device) -> dict:
    HV, Hk, V, K = _gdn_dims(layer)
    z = dict(dtype=dtype, device=device)
    return {"inputs": {"q": torch.zeros(1, Hk, K, **z), "k": torch.zeros(1, Hk, K, **z),
                       "v": torch.zeros(1, HV, V, **z), "a": torch.zeros(1, HV, **z), "b": torch.zeros(1, HV, **z)},
            "out": torch.zeros(1, HV, V, **z)}


def _gdn_inputs(layer, qkv, a, b):
    """GDN's inputs for `batch.run_decode` from the packed conv output and gates: a function
    that gathers them into the kernels' rows first and then splits q, k, v (three gathers on
    steps with unequal rows rather than five)."""
    HV, Hk, V, K = _gdn_dims(layer)

    def inputs(rows_of):
        q, k, v = torch.split(rows_of(qkv), [Hk * K, Hk * K, HV * V], dim=-1)
        return {"q": q.unflatten(-1, (Hk, K)), "k": k.unflatten(-1, (Hk, K)), "v": v.unflatten(-1, (HV, V)),
                "a": rows_of(a), "b": rows_of(b)}
    return inputs


def gdn_forward(ns, settings: Settings):
    def make(orig):
        def _forward_core(self, mixed_qkv, b, a, core_attn_out):
            md = _compat.metadata_for(ns, self.prefix)
            if md is None:
                with _stock_forward(self):
                    return orig(self, mixed_qkv, b, a, core_attn_out)
            st, ex = bound_state(ns, self, settings, "gdn", mixed_qkv.dtype, mixed_qkv.device)
            n = md.num_actual_tokens
            spec = md.spec_sequence_masks is not None
            mixed = md.num_prefills > 0 or md.num_decodes > 0
            if md.num_prefills > 0:
                _gdn_prefill(ns, orig, self, md, st, mixed_qkv, b, a, core_attn_out, spec)
            w = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
            conv = _conv_view(ns, st.conv)
            if spec:
                tok = md.spec_token_indx if mixed else None
                sel = (lambda t: t.index_select(0, tok)) if tok is not None else (lambda t: t[:n])
                sidx = md.spec_state_indices_tensor
                qkv = ns.causal_conv1d_update(sel(mixed_qkv), conv, w, self.conv1d.bias, self.activation,
                                              conv_state_indices=sidx[:, 0][:md.num_spec_decodes],
                                              num_accepted_tokens=md.num_accepted_tokens,
                                              query_start_loc=md.spec_query_start_loc,
                                              max_query_len=1 + self.num_spec, validate_data=False)
                HV, _, V, _ = _gdn_dims(self)
                y = torch.zeros(qkv.shape[0], HV, V, dtype=core_attn_out.dtype, device=core_attn_out.device)
                batch.run_decode(ex, st, sidx[:, 0], _gdn_inputs(self, qkv, sel(a), sel(b)), y,
                                 spec_tokens=self.num_spec, query_start_loc=md.spec_query_start_loc,
                                 num_accepted=md.num_accepted_tokens, step=md)
                if tok is not None:
                    core_attn_out.index_copy_(0, tok, y)
                else:
                    core_attn_out[:n] = y
            elif md.num_decodes > 0:
                nd = md.num_decodes
                idx = md.non_spec_state_indices_tensor[:nd]
                qkv = ns.causal_conv1d_update(mixed_qkv[:nd], conv, w, self.conv1d.bias, self.activation,
                                              conv_state_indices=idx, validate_data=False)
                batch.run_decode(ex, st, idx, _gdn_inputs(self, qkv, a[:nd], b[:nd]), core_attn_out[:nd],
                                 spec_tokens=self.num_spec, query_start_loc=md.non_spec_query_start_loc[:nd + 1],
                                 num_accepted=_accepted(self, None, nd), step=md)
        return _forward_core
    return make


def _any_row(flags) -> bool:
    """Whether any prefill row continues a state (GDN's metadata has no host-side flag, unlike
    Mamba-2's): one host read, which a prefill step makes anyway (its `qsl.cpu()` below), so
    that steps of fresh prompts skip the records' fold; inside a graph capture, assume so."""
    if flags is None:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    return bool(flags.any())


def _gdn_prefill(ns, orig, layer, md, st, mixed_qkv, b, a, core_attn_out, spec):
    """vLLM's own forward on the prefill rows only (with speculation, the rows without drafts,
    which vLLM's metadata already counts as prefills)."""
    if spec:
        tok = md.non_spec_token_indx
    else:
        tok = torch.arange(md.num_decode_tokens, md.num_actual_tokens, device=mixed_qkv.device)
    if spec:
        # rows without drafts in a step with drafts come here as prefills, possibly with the
        # previous step's verified tokens pending: commit those first (rows in ~mask order;
        # the boolean index syncs with the host, as prefill steps do anyway)
        acc = _accepted(layer, None, md.spec_sequence_masks.numel())
        if acc is not None:
            S.commit(st, batch.slot_ids(md.prefill_state_indices), acc[~md.spec_sequence_masks])
    if _any_row(md.prefill_has_initial_state):
        batch.before_prefill(st, md.prefill_state_indices, md.prefill_has_initial_state)
    qsl = md.prefill_query_start_loc
    nums, bptr, tptr = ns.compute_conv_metadata(qsl.cpu(), device=qsl.device)
    only_p = dataclasses.replace(
        md, num_decodes=0, num_decode_tokens=0, num_spec_decodes=0, num_spec_decode_tokens=0,
        num_actual_tokens=md.num_prefill_tokens, has_initial_state=md.prefill_has_initial_state,
        spec_query_start_loc=None, non_spec_query_start_loc=qsl, spec_state_indices_tensor=None,
        non_spec_state_indices_tensor=md.prefill_state_indices, spec_sequence_masks=None,
        spec_token_indx=None, non_spec_token_indx=None, num_accepted_tokens=None,
        nums_dict=nums, batch_ptr=bptr, token_chunk_offset_ptr=tptr)
    y = torch.zeros((tok.shape[0], *core_attn_out.shape[1:]), dtype=core_attn_out.dtype, device=core_attn_out.device)
    with _compat.swapped_metadata(ns, layer.prefix, only_p), _stock_forward(layer):
        orig(layer, mixed_qkv.index_select(0, tok), b.index_select(0, tok), a.index_select(0, tok), y)
    core_attn_out.index_copy_(0, tok, y)
    batch.after_prefill(st, md.prefill_state_indices)
