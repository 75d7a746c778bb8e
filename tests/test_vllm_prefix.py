"""Prefix caching of replayssm state in vLLM's 'align' mode (replayssm.integrations.vllm.prefix),
on the CPU without vLLM: the settings the plugin refuses, and vLLM's copy between blocks as its
model runner makes it (`collect_mamba_copy_meta`: one byte copy per (state tensor, copy
function) pair, zipped; `batch_memcpy`), with the copy functions the plugin declares, on page
views laid out as vLLM lays them. A block copied so continues the sequence of the block it was
copied from exactly (a cache hit: the copied records and cursor carry the state); with vLLM's
own two copy functions it does not (the records and cursor of the block's previous owner stay).
The GPU checks against stock vLLM are in test_vllm_gpu.py.
"""
from __future__ import annotations

import ctypes
from types import SimpleNamespace as NS

import pytest
import torch

from replayssm.integrations.vllm import batch, prefix, state

from test_vllm_plugin import HV, V, _pair, _prefill, tokens


def test_cache_modes_refused_with_what_to_do():
    prefix.check_cache_mode("none", 0)
    prefix.check_cache_mode("none", 3)
    prefix.check_cache_mode("align", 0)
    with pytest.raises(NotImplementedError, match="--mamba-cache-mode align"):
        prefix.check_cache_mode("all", 0)
    with pytest.raises(NotImplementedError, match="speculative"):
        prefix.check_cache_mode("align", 3)
    with pytest.raises(NotImplementedError, match="unknown mamba_cache_mode"):
        prefix.check_cache_mode("every", 0)


def _conv_copy(st, block_ids, cur, accepted):
    # vLLM 0.25's get_conv_copy_spec without drafts (offset accepted - 1 = 0)
    assert accepted == 1
    src = st[block_ids[cur]]
    return NS(start_addr=src.data_ptr(), num_elements=src.numel())


def _slot_copy(st, block_ids, cur, accepted):
    # vLLM 0.25's get_temporal_copy_spec: the whole slot of block cur + accepted - 1
    src = st[block_ids[cur + accepted - 1]]
    return NS(start_addr=src.data_ptr(), num_elements=src.numel())


VLLM = NS(get_conv_copy_spec=_conv_copy, get_temporal_copy_spec=_slot_copy)


def _kv(st):
    """The layer's tensors as vLLM binds them (`layer.kv_cache`), counters whole."""
    counters = torch.as_strided(st.cursor, (st.N, 2), (st.cursor.stride(0), 1))
    return [st.conv, st.ckpt, st.ld, st.w, st.k, counters]


def _vllm_copy(kv, funcs, block_ids, src, dst):
    """The model runner's copy from the request's block `src` to `dst` (indices into
    `block_ids`): vLLM zips the layer's tensors with the copy functions."""
    for t, fn in zip(kv, funcs):
        spec = fn(t, block_ids, src, 1)
        ctypes.memmove(t[block_ids[dst]].data_ptr(), spec.start_addr, spec.num_elements * t.element_size())


def test_copy_functions_name_every_tensor():
    funcs = prefix.copy_funcs(VLLM, state.N_TENSORS)
    assert funcs == (_conv_copy,) + (_slot_copy,) * (state.N_TENSORS - 1)
    with pytest.raises(ValueError):
        prefix.copy_funcs(VLLM, 1)

    class Model:
        @classmethod
        def get_mamba_state_copy_func(cls):
            return _conv_copy, _slot_copy

    class Sub(Model):
        pass

    assert prefix.declare_copy(VLLM, Model, state.N_TENSORS)
    assert not prefix.declare_copy(VLLM, Model, state.N_TENSORS)          # once
    assert not prefix.declare_copy(VLLM, Sub, state.N_TENSORS)            # inherited: patched above
    assert Sub.get_mamba_state_copy_func() == funcs == Model().get_mamba_state_copy_func()


def _hit(family, funcs, seed):
    """Block 2 decodes past its prefill (records pending a fold); block 5, last used by another
    request, gets block 2 copied into it (a cache hit, or a step entering a new block); then both
    decode the same tokens. Returns the outputs of both rows and the oracle's, and the states."""
    g = torch.Generator().manual_seed(seed)
    st, ex, oracle, params = _pair(family, 1, g)
    A = params.get("A")
    _prefill(st, oracle, [2, 5], g, A)
    for n in range(3):                              # window 4: records at cursor 3, no flush yet
        toks = tokens(family, 2, g)
        idx = torch.tensor([2, 5], dtype=torch.int32)
        batch.run_decode(ex, st, idx, toks, torch.empty(2, HV, V))
        oracle.decode(idx, **toks)
    for _ in range(2):                              # block 5's owner goes on: other records, cursor 1
        toks = tokens(family, 1, g)
        batch.run_decode(ex, st, torch.tensor([5], dtype=torch.int32), toks, torch.empty(1, HV, V))
    before = st.pages.clone()
    _vllm_copy(_kv(st), funcs, [2, 5], 0, 1)
    page = st.pages.numel() // st.N
    assert torch.equal(st.pages.view(st.N, page)[2], before.view(st.N, page)[2])      # the source untouched
    outs, want = [], []
    for _ in range(6):                              # past the window's flush
        one = tokens(family, 1, g)
        both = {k: v.expand(2, *v.shape[1:]).contiguous() for k, v in one.items()}
        out = torch.full((2, HV, V), float("nan"))
        batch.run_decode(ex, st, torch.tensor([2, 5], dtype=torch.int32), both, out)
        outs.append(out)
        want.append(oracle.decode(torch.tensor([2], dtype=torch.int32), **one)[0])
    return st, oracle, A, torch.stack(outs), torch.stack(want)


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_copied_block_continues_the_sequence(family):
    st, oracle, A, outs, want = _hit(family, prefix.copy_funcs(VLLM, state.N_TENSORS), seed=11)
    assert torch.equal(outs[:, 0], outs[:, 1])                      # the copy decodes as its source
    assert torch.allclose(outs[:, 0], want, rtol=1e-5, atol=1e-6)
    # a prefill continuing from the copied block reads the folded checkpoint: the source's state
    idx = torch.tensor([2, 5], dtype=torch.int32)
    batch.before_prefill(st, idx, torch.tensor([False, True]), A)
    assert torch.allclose(st.ckpt[5], oracle.materialize(torch.tensor([2], dtype=torch.int32))[0],
                          rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_vllms_own_copy_functions_leave_the_old_records(family):
    # vLLM's copy functions name its two tensors (conv, SSM state): the zip stops there, and the
    # block keeps the records and cursor of its previous owner
    _, _, _, outs, want = _hit(family, (_conv_copy, _slot_copy), seed=11)
    assert torch.allclose(outs[:, 0], want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(outs[:, 1], want, rtol=1e-3, atol=1e-3)
