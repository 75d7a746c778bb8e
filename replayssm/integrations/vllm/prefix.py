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
it a copied block would keep the previous owner's records and cursor. With the records outside
the page (`side_records`, `REPLAYSSM_VLLM_PREFIX_RECORDS=side`: stock's page, so stock's cache
blocks) vLLM's copy names the page's three tensors and `declare_side_copy` adds the records'.

With speculative decoding, vLLM's own layers keep a state per draft in extra blocks and pick the
accepted one when they copy (`get_temporal_copy_spec` reads block `cur + accepted - 1`); the
plugin keeps one block per request, its verified drafts pending until a commit. So in `align`
mode with drafts the plugin takes over the temporal part of vLLM's step-end copy
(`postprocess_mamba_align_gpu`, patched by `declare_postprocess`): right after the sampler's
accepted counts are known it commits them in every running block (no block ever holds pending
drafts), and where the accepted tokens reached a block boundary behind the running block it
makes that block the state at the boundary (`commit_and_cache`: the running block's tensors
with its cursor moved back over the records past the boundary, which no flush can have folded:
a verify flushes before its first record). vLLM's fused copy still moves the convolution
states (its own tensor and semantics); its copy of the temporal tensors is turned into a copy of
nothing. The copy functions read the running block whatever the accepted count
(`committed_copy`), which without drafts (count 1) is vLLM's own choice. Its GPU test has passed
for NemotronH without CUDA graphs only (the other cases not yet run to the end): it is off unless
`REPLAYSSM_VLLM_PREFIX_SPEC=1`, and refused otherwise.

`all` (Mamba-2 only, as in vLLM; plain decoding; `REPLAYSSM_VLLM_PREFIX_ALL=1` until its cost
is measured; its GPU test passed on an H100): every block of a request keeps a state. vLLM's
prefill writes the state at each block boundary it crosses into that block's checkpoint and the
last one into the block of its last token (`seed_prefilled`: those blocks' records empty),
reading its initial state from the block of the last computed token (whose records
`batch.before_prefill` folds first). A decode step
reads the block of the last computed token and writes that of its token: where they differ (the
token starts a block) the whole page moves to the new block first (`move_decoding`, a few
Triton programs per row that return at once where nothing moves), and the step runs there;
the block left behind keeps the state at its boundary.

Refused at engine start with a message: `all` without that switch, with drafts, or for GDN
(serve with `--mamba-cache-mode align`), and prefix caching together with speculative decoding
in `align` mode unless switched on as above.
"""
from __future__ import annotations

import os
from typing import Tuple

import torch
from torch import Tensor

from . import _compat, batch
from . import state as S

MODES = ("none", "align", "all")
# the switches for prefix caching with speculative decoding, and for `all` mode (neither yet
# checked on a GPU)
SPEC_SWITCH = "REPLAYSSM_VLLM_PREFIX_SPEC"
ALL_SWITCH = "REPLAYSSM_VLLM_PREFIX_ALL"


def check_cache_mode(mode: str, num_spec: int, family: str = "mamba2") -> None:
    """Refuse, with what to do instead, the prefix-caching settings the plugin does not
    support: `mamba_cache_mode` `mode` with `num_spec` speculative tokens, for a layer of
    `family`."""
    if mode == "none":
        return
    if mode == "all":
        if os.environ.get(ALL_SWITCH) != "1":
            raise NotImplementedError(
                "replayssm's vLLM plugin keeps prefix caching of recurrent state in vLLM's 'all' mode (vLLM's "
                f"default for NemotronH) behind {ALL_SWITCH}=1 (experimental: not yet checked on a GPU): serve "
                "with --mamba-cache-mode align (LLM(..., mamba_cache_mode='align') offline), or set the switch, "
                "or serve without --enable-prefix-caching, or unset REPLAYSSM_VLLM")
        if family != "mamba2":
            raise NotImplementedError(f"replayssm's vLLM plugin: mamba_cache_mode='all' for a {family} layer "
                                      "(vLLM keeps it for Mamba-2): serve with --mamba-cache-mode align")
        if num_spec:
            raise NotImplementedError(
                f"replayssm's vLLM plugin does not combine mamba_cache_mode='all' with speculative decoding "
                f"({num_spec} speculative tokens): serve with --mamba-cache-mode align (and {SPEC_SWITCH}=1), "
                "or without drafts")
        return
    if mode != "align":
        raise NotImplementedError(f"replayssm's vLLM plugin: unknown mamba_cache_mode {mode!r}; it supports "
                                  f"{MODES}")
    if num_spec and os.environ.get(SPEC_SWITCH) != "1":
        raise NotImplementedError(
            "replayssm's vLLM plugin does not yet combine prefix caching of recurrent state with speculative "
            f"decoding ({num_spec} speculative tokens) unless {SPEC_SWITCH}=1 (experimental: not yet checked on "
            "a GPU): serve without --enable-prefix-caching, or without speculative decoding, or unset "
            "REPLAYSSM_VLLM")


def side_records(prefix_records: str, mode: str, num_spec: int) -> bool:
    """Whether a layer keeps its records outside vLLM's page (`state.StateSpec.side_records`):
    asked for (`REPLAYSSM_VLLM_PREFIX_RECORDS=side`) and prefix caching in `align` mode; with
    drafts refused (the step-end commit and boundary copy of `declare_postprocess` write the
    records in the page)."""
    if prefix_records != "side" or mode != "align":
        return False
    if num_spec:
        raise NotImplementedError(
            f"replayssm's vLLM plugin keeps the records outside vLLM's pages (REPLAYSSM_VLLM_PREFIX_RECORDS=side) "
            f"only without speculative decoding ({num_spec} speculative tokens): unset it, or serve without drafts")
    return True


def declare_side_copy(state_of) -> bool:
    """Patch vLLM's `collect_mamba_copy_meta` (`align` mode's copy of a request's previous block
    into its running one, and of a cached block into a new request's, before a step) once per
    process: after vLLM's own entries for the page's tensors, one per records tensor outside
    the page of every layer whose replayssm state `state_of(layer)` keeps them there
    (`StateSpec.side_records`), into the same batched copy. Returns whether it patched now."""
    import importlib
    module = importlib.import_module("vllm.v1.worker.mamba_utils")
    return _compat.patch_method(module, "collect_mamba_copy_meta", lambda orig: _side_copy(orig, state_of))


def _side_copy(orig, state_of):
    def collect_mamba_copy_meta(copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids, src_block_idx,
                                dest_block_idx, accept_token_bias, req_state, forward_context):
        orig(copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids, src_block_idx, dest_block_idx,
             accept_token_bias, req_state, forward_context)
        if src_block_idx == dest_block_idx and accept_token_bias == 0:
            return
        side_copy_entries(copy_bufs, kv_cache_config, mamba_group_ids, req_state.block_ids, src_block_idx,
                          dest_block_idx, forward_context, state_of)
    return collect_mamba_copy_meta


def side_copy_entries(copy_bufs, kv_cache_config, group_ids, block_ids, src_idx: int, dst_idx: int,
                      forward_context, state_of) -> int:
    """Append to vLLM's batched copy (`copy_bufs`: its `src_ptrs`, `dst_ptrs`, `sizes` host
    arrays at `offset`) the records outside the page of block `block_ids[gid][src_idx]` into
    block `block_ids[gid][dst_idx]`, per group and layer; returns the entries added. The
    buffers hold one entry per copy function and layer, six a layer, of which the page's three
    tensors take three."""
    n = 0
    for gid in group_ids:
        src, dst = block_ids[gid][src_idx], block_ids[gid][dst_idx]
        for name in kv_cache_config.kv_cache_groups[gid].layer_names:
            st = state_of(forward_context[name])
            if st is None or not st.spec.side_records:
                continue
            for t in (st.ld, st.w, st.k):
                # (addresses from the base and the block stride: no tensor view per entry)
                i, row = copy_bufs.offset, t.stride(0) * t.element_size()
                copy_bufs.src_ptrs.np[i] = t.data_ptr() + src * row
                copy_bufs.dst_ptrs.np[i] = t.data_ptr() + dst * row
                copy_bufs.sizes.np[i] = row
                copy_bufs.offset = i + 1
                n += 1
    return n


def all_mode(md) -> bool:
    """Whether a step's metadata is vLLM's `all` mode (its per-block indices present)."""
    return getattr(md, "block_idx_last_scheduled_token", None) is not None


def prefill_only(md) -> dict:
    """In `all` mode, the fields to replace, beside the decode rows', when vLLM's own forward
    runs on the prefill rows alone: its per-row block indices cover decodes then prefills and
    are split by the decode count, which the prefill-only metadata sets to 0."""
    nd = md.num_decodes
    tail = {}
    for name in ("block_idx_last_computed_token", "block_idx_last_scheduled_token",
                 "block_idx_last_scheduled_token_prev_step"):
        t = getattr(md, name, None)
        tail[name] = None if t is None else t[nd:]
    return tail


def prefill_sources(md) -> Tensor:
    """`all` mode: each prefill row's block holding its initial state (the last computed
    token's), `[num_prefills]`."""
    nd = md.num_decodes
    return md.state_indices_tensor_p.gather(1, md.block_idx_last_computed_token[nd:, None].long())[:, 0]


@torch.no_grad()
def seed_prefilled(state: S.BlockState, md) -> None:
    """`all` mode, after vLLM's prefill: every block it wrote (those from the first scheduled
    token's to the last's, each holding the state at its end or the last token's) has its
    checkpoint as the state, records empty."""
    nd = md.num_decodes
    idx = md.state_indices_tensor_p
    col = torch.arange(idx.shape[1], device=idx.device)[None, :]
    first = md.block_idx_first_scheduled_token_p.long()[:, None]
    last = md.block_idx_last_scheduled_token[nd:].long()[:, None]
    written = torch.where((col >= first) & (col <= last), idx, torch.full_like(idx, -1))
    S.seed(state, batch.slot_ids(written.reshape(-1)))


@torch.no_grad()
def move_decoding(state: S.BlockState, md) -> Tensor:
    """`all` mode, before a decode step: the decode rows' blocks `(read, written)` are those of
    the last computed and of the scheduled token; where they differ the read block's page (all
    of its tensors) is copied to the written one, whose slot ids `[num_decodes]` the step then
    runs on. Device ops only."""
    from ...ops.utils.pages import copy_pages
    idx = md.state_indices_tensor_d

    def blocks():                  # the same for every layer of the step
        nd = md.num_decodes
        return tuple(batch.slot_ids(idx.gather(1, t[:nd, None].long())[:, 0])
                     for t in (md.block_idx_last_computed_token, md.block_idx_last_scheduled_token))
    src, dst = batch.STEP.get(md, "all_mode_blocks", idx, blocks)
    copy_pages(S.page_view(state), src, dst)
    return dst


_COMMITTED = {}


def committed_copy(ns):
    """vLLM's whole-slot copy from the running block itself, whatever the accepted count: the
    plugin's blocks hold no per-draft states (their accepted drafts are committed in place).
    One function per vLLM copy function, so that declarations compare equal."""
    temporal = ns.get_temporal_copy_spec
    if temporal not in _COMMITTED:
        def copy(state, block_ids, cur_block_idx, num_accepted_tokens):
            return temporal(state, block_ids, cur_block_idx, 1)
        copy.__name__ = "replayssm_committed_temporal_copy"
        _COMMITTED[temporal] = copy
    return _COMMITTED[temporal]


def copy_funcs(ns, n_tensors: int) -> Tuple:
    """The state copy functions for a replayssm block of `n_tensors` tensors (`StateSpec`'s
    order): vLLM's conv-state copy for tensor 0 (vLLM's own conv state), the running block's
    whole slot (`committed_copy`) for every other tensor (checkpoint, record decays, records,
    keys, counters)."""
    if n_tensors < 2:
        raise ValueError(f"a replayssm block has at least a conv state and a checkpoint, got {n_tensors} tensors")
    return (ns.get_conv_copy_spec,) + (committed_copy(ns),) * (n_tensors - 1)


def vllm_copy_funcs(ns, n_tensors: int) -> Tuple:
    """vLLM's own functions for the same tensors, as its fused postprocess insists on them."""
    return (ns.get_conv_copy_spec,) + (ns.get_temporal_copy_spec,) * (n_tensors - 1)


@torch.no_grad()
def commit_and_cache(state: S.BlockState, src: Tensor, dst: Tensor, accepted: Tensor, back: Tensor,
                     copy: Tensor) -> None:
    """One step's end in `align` mode with drafts, per request row: commit `accepted` tokens in
    the running block `src` (`state.commit`: nothing stays pending), then where `copy` (and
    `dst != src`) make block `dst` the state `back` tokens before the running one: the running
    block's checkpoint and records, its cursor `back` records earlier, nothing pending. Block
    ids `[B]`; device ops only (no host sync: vLLM's scheduling runs ahead)."""
    S.commit(state, src, accepted)
    live = copy.to(torch.bool) & (dst != src) & (src >= 0) & (dst >= 0)
    s_idx = src.long()
    # rows that copy nothing write their own block back onto itself
    d_idx = torch.where(live, dst, src).long()
    counters = torch.as_strided(state.cursor, (state.N, 2), (state.cursor.stride(0), 1))
    for t in (state.ckpt, state.ld, state.w, state.k, counters):
        t.index_copy_(0, d_idx, t.index_select(0, s_idx))
    cur = state.cursor.index_select(0, s_idx)
    state.cursor.index_copy_(0, d_idx, torch.where(live, cur - back.to(cur.dtype), cur))


def declare_copy(ns, cls, n_tensors: int) -> bool:
    """Patch `cls.get_mamba_state_copy_func` (a classmethod defined on `cls`; inherited ones
    are patched on the class that defines them) to copy all `n_tensors` of a block."""
    return _compat.patch_classmethod(cls, "get_mamba_state_copy_func",
                                     lambda orig: lambda kls: copy_funcs(ns, n_tensors))


def declare_postprocess(ns, state_of) -> bool:
    """Patch vLLM's step-end copy in `align` mode with drafts (`postprocess_mamba_align_gpu`, the
    V1 model runner's, which calls it through its module) once per process: the plugin's
    `commit_and_cache` on every layer whose replayssm state `state_of(layer)` returns, then
    vLLM's fused copy for the convolution states alone. Called in the worker, where the runner
    has imported the module. Returns whether it patched now."""
    import importlib
    module = importlib.import_module("vllm.v1.worker.mamba_utils")
    return _compat.patch_method(module, "postprocess_mamba_align_gpu",
                                lambda orig: _postprocess(ns, orig, state_of))


def _postprocess(ns, orig, state_of):
    def postprocess_mamba_align_gpu(*, bufs, num_reqs, num_accepted_tokens_gpu, input_batch, kv_cache_config,
                                    forward_context, mamba_state_copy_funcs, **more):
        ctx = bufs.postprocess_align
        groups = [(gid, state_of(forward_context[name])) for gid in ctx.mamba_group_ids
                  for name in kv_cache_config.kv_cache_groups[gid].layer_names]
        kw = dict(bufs=bufs, num_reqs=num_reqs, num_accepted_tokens_gpu=num_accepted_tokens_gpu,
                  input_batch=input_batch, kv_cache_config=kv_cache_config, forward_context=forward_context, **more)
        if all(st is None for _, st in groups):                   # not a model the plugin serves
            return orig(mamba_state_copy_funcs=mamba_state_copy_funcs, **kw)
        theirs = vllm_copy_funcs(ns, len(mamba_state_copy_funcs))
        tables = {gid: input_batch.block_table[gid].get_device_tensor(num_reqs) for gid in ctx.mamba_group_ids}
        if not ctx.is_initialized:
            ctx.initialize_from_forward_context(kv_cache_config, forward_context, theirs,
                                                [tables[gid] for gid in ctx.mamba_group_ids])
            # vLLM's fused copy of a temporal tensor reads the accepted draft's own block, which
            # the plugin does not keep: its byte count 0, it copies nothing (the conv states keep
            # vLLM's copy, shifted by the accepted drafts as vLLM's conv kernels expect)
            ctx.state_inner_sizes.masked_fill_(ctx.state_conv_widths == 0, 0)
        # the fused kernel's decisions (postprocess_mamba_fused_kernel), per request row
        acc = num_accepted_tokens_gpu[:num_reqs]
        col = ctx.mamba_state_idx_buf.gpu[:num_reqs].long()
        running = (ctx.num_computed_tokens_buf.gpu[:num_reqs] + ctx.num_scheduled_tokens_buf.gpu[:num_reqs]
                   - ctx.num_draft_tokens_buf.gpu[:num_reqs]).long()
        new = running + acc.long() - 1
        aligned = new // ctx.block_size * ctx.block_size
        copy = (aligned >= running) & (col >= 0)
        dest = (aligned // ctx.block_size - 1).clamp(min=0)
        for gid, st in groups:
            if st is None:
                continue
            bt = tables[gid].long()
            src = bt.gather(1, col.clamp(min=0)[:, None])[:, 0]
            dst = bt.gather(1, dest[:, None])[:, 0]
            commit_and_cache(st, src, dst, acc, new - aligned, copy)
        return orig(mamba_state_copy_funcs=theirs, **kw)
    return postprocess_mamba_align_gpu
