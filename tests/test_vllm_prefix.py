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

from test_vllm_plugin import HV, K, V, _pair, _prefill, tokens


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
    assert funcs == (_conv_copy,) + (prefix.committed_copy(VLLM),) * (state.N_TENSORS - 1)
    assert prefix.vllm_copy_funcs(VLLM, state.N_TENSORS) == (_conv_copy,) + (_slot_copy,) * (state.N_TENSORS - 1)
    # the running block's slot whatever the accepted count (no per-draft blocks to pick from)
    t = torch.zeros(4, 3)
    assert funcs[1](t, [2, 1, 3], 0, 3).start_addr == t[2].data_ptr() == funcs[1](t, [2, 1, 3], 0, 1).start_addr
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


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_step_end_commits_and_caches_the_boundary_state(family):
    """`align` mode with drafts: at a step's end the accepted tokens are committed in the running
    block, and where they crossed a block boundary the block behind it becomes the state at the
    boundary (the running block's, `back` records earlier). Blocks 1 and 4 carry the same
    sequence; after a verify of 3 tokens, block 1 accepts 3 and caches the state after 2 in block
    6; block 4 accepts 2 with the boundary on itself (nothing copied): blocks 4 and 6 hold the
    state after 2 tokens, block 1 after 3, as the oracle's slots, and decode on like them."""
    g = torch.Generator().manual_seed(5)
    T = 3
    st, ex, oracle, params = _pair(family, T, g)
    A = params.get("A")
    S0 = torch.randn(1, HV, V, K, generator=g).expand(2, HV, V, K) * 0.3
    idx = torch.tensor([1, 4], dtype=torch.int32)
    batch.before_prefill(st, idx, torch.zeros(2, dtype=torch.bool), A)
    st.ckpt[idx.long()] = S0
    batch.after_prefill(st, idx)
    oracle.load(idx, S0.contiguous())
    qsl = torch.tensor([0, T, 2 * T], dtype=torch.int32)
    for step in range(3):                           # verifies of T tokens, window 4: early flushes
        one = tokens(family, T, g)
        flat = {k: torch.cat([v, v]) for k, v in one.items()}
        acc = None if step == 0 else torch.tensor([2, 2], dtype=torch.int32)
        batch.run_decode(ex, st, idx, flat, torch.empty(2 * T, HV, V), spec_tokens=T - 1, query_start_loc=qsl,
                         num_accepted=acc)
        if acc is not None:
            oracle.commit(idx, acc)
        oracle.verify(idx, **{k: v[None].expand(2, *v.shape).contiguous() for k, v in one.items()})
    h = st.cursor[1].clone()
    prefix.commit_and_cache(st, src=torch.tensor([1, 4]), dst=torch.tensor([6, 4]), accepted=torch.tensor([3, 2]),
                            back=torch.tensor([1, 0]), copy=torch.tensor([True, True]))
    oracle.commit(idx, torch.tensor([3, 2], dtype=torch.int32))
    assert int(st.cursor[1]) == int(h) + 3 and int(st.cursor[6]) == int(h) + 2 and int(st.cursor[4]) == int(h) + 2
    assert int(st.pending[1]) == int(st.pending[4]) == int(st.pending[6]) == 0
    for _ in range(5):                              # decode on, past a flush
        one = tokens(family, 1, g)
        three = {k: v.expand(3, *v.shape[1:]).contiguous() for k, v in one.items()}
        out = torch.empty(3, HV, V)
        batch.run_decode(ex, st, torch.tensor([1, 4, 6], dtype=torch.int32), three, out)
        want = oracle.decode(idx, **{k: v[:2] for k, v in three.items()})
        assert torch.allclose(out[:2], want, rtol=1e-5, atol=1e-6)
        assert torch.allclose(out[2], want[1], rtol=1e-5, atol=1e-6)        # the cached block: block 4's state


def test_prefix_caching_with_drafts_is_a_switch(monkeypatch):
    monkeypatch.setenv(prefix.SPEC_SWITCH, "1")
    prefix.check_cache_mode("align", 3)
    with pytest.raises(NotImplementedError, match="--mamba-cache-mode align"):
        prefix.check_cache_mode("all", 3)


def test_step_end_patch_decides_as_vllm_and_leaves_it_the_conv_states(monkeypatch):
    """The patched `postprocess_mamba_align_gpu` on stand-ins of vLLM's runner objects: blocks of
    4 tokens; request 0 had 2 tokens and verified 3 (2 drafts) in its running block 11 (column
    1), accepted 2: 4 tokens, the boundary behind block 11, so block 10 caches the state after
    token 4 (0 records back); request 1 (2 + 3, block 21 at column 1) accepted 1: 3 tokens,
    no boundary. vLLM's fused copy then runs with its own copy functions and the temporal
    tensors' byte counts zeroed."""
    seen = {}
    monkeypatch.setattr(prefix, "commit_and_cache",
                        lambda st, src, dst, acc, back, copy: seen.update(st=st, src=src, dst=dst, acc=acc, back=back,
                                                                          copy=copy))

    def buf(*v):
        return NS(gpu=torch.tensor(v, dtype=torch.int32))

    class Ctx:
        mamba_group_ids, block_size, is_initialized = [0], 4, False
        mamba_state_idx_buf, num_computed_tokens_buf = buf(1, 1), buf(2, 2)
        num_scheduled_tokens_buf, num_draft_tokens_buf = buf(3, 3), buf(2, 2)
        state_conv_widths = torch.tensor([3, 0, 0, 0, 0, 0])
        state_inner_sizes = torch.tensor([8, 5, 5, 5, 5, 5])

        def initialize_from_forward_context(self, cfg, fc, funcs, tables):
            seen["init_funcs"] = funcs
            self.is_initialized = True

    ctx = Ctx()
    table = torch.tensor([[10, 11, 0], [20, 21, 0]], dtype=torch.int32)
    batch_ = NS(block_table=[NS(get_device_tensor=lambda n: table[:n])])
    layer = NS()
    cfg = NS(kv_cache_groups=[NS(layer_names=["mixer"])])
    orig_calls = []
    wrapped = prefix._postprocess(VLLM, lambda **kw: orig_calls.append(kw), lambda lay: "ST" if lay is layer else None)
    funcs = prefix.copy_funcs(VLLM, 6)
    wrapped(bufs=NS(postprocess_align=ctx), num_reqs=2, num_accepted_tokens_gpu=torch.tensor([2, 1, 7]),
            num_accepted_tokens_cpu_tensor=torch.zeros(3), input_batch=batch_, kv_cache_config=cfg,
            forward_context={"mixer": layer}, mamba_state_copy_funcs=funcs)
    assert seen["st"] == "ST"
    assert seen["src"].tolist() == [11, 21] and seen["dst"].tolist()[0] == 10
    assert seen["copy"].tolist() == [True, False] and seen["back"].tolist()[0] == 0
    assert seen["acc"].tolist() == [2, 1]
    assert seen["init_funcs"] == prefix.vllm_copy_funcs(VLLM, 6)
    assert ctx.state_inner_sizes.tolist() == [8, 0, 0, 0, 0, 0]
    assert len(orig_calls) == 1 and orig_calls[0]["mamba_state_copy_funcs"] == prefix.vllm_copy_funcs(VLLM, 6)
    assert "num_accepted_tokens_cpu_tensor" in orig_calls[0]
    # a model the plugin does not serve: vLLM's own postprocess, untouched
    other = prefix._postprocess(VLLM, lambda **kw: orig_calls.append(kw), lambda lay: None)
    other(bufs=NS(postprocess_align=ctx), num_reqs=2, num_accepted_tokens_gpu=torch.tensor([2, 1]),
          input_batch=batch_, kv_cache_config=cfg, forward_context={"mixer": layer}, mamba_state_copy_funcs=funcs)
    assert orig_calls[-1]["mamba_state_copy_funcs"] == funcs
