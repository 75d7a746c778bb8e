"""The vLLM plugin's records outside vLLM's pages (`REPLAYSSM_VLLM_PREFIX_RECORDS=side`, prefix
caching in `align` mode): the page holds stock's tensors (so vLLM's cache block is stock's), the
records live in the plugin's own tensors indexed by block, vLLM's copy between blocks carries
them (`prefix.declare_side_copy`, on stand-ins of its buffers), and vLLM's cache memory keeps
their share (`layers.side_memory_share`). What runs without vLLM; the GPU checks with vLLM are
in test_vllm_gpu.py."""
from __future__ import annotations

import ctypes
import os
import types

import numpy as np
import pytest
import torch

from replayssm.integrations.vllm import batch, config, layers, prefix, state
from replayssm.integrations.vllm.executors import KernelExecutor, ReferenceExecutor
from test_vllm_plugin import HV, Hk, K, N, V, layer_params, tokens


def spec_for(family, side, window=4, rec=torch.float32):
    return state.StateSpec(family=family, HV=HV, Hk=Hk, V=V, K=K, window=window, max_draft=1, record_dtype=rec,
                           conv_shape=(3, 2 * Hk * K + HV * V), conv_dtype=torch.bfloat16, side_records=side)


def test_setting_and_when_it_applies():
    assert config.settings({}).prefix_records == "page"
    assert config.settings({"REPLAYSSM_VLLM_PREFIX_RECORDS": " Side"}).prefix_records == "side"
    with pytest.raises(ValueError, match="REPLAYSSM_VLLM_PREFIX_RECORDS"):
        config.settings({"REPLAYSSM_VLLM_PREFIX_RECORDS": "outside"})
    assert prefix.side_records("side", "align", 0)
    assert not prefix.side_records("page", "align", 0) and not prefix.side_records("side", "none", 0)
    with pytest.raises(NotImplementedError, match="without speculative decoding"):
        prefix.side_records("side", "align", 3)


@pytest.mark.parametrize("family,rec", [("mamba2", torch.bfloat16), ("gdn", torch.float32)])
def test_page_is_stocks_and_records_beside_it(family, rec):
    inside, beside = spec_for(family, False, rec=rec), spec_for(family, True, rec=rec)
    conv = 3 * (2 * Hk * K + HV * V) * 2
    assert beside.page_bytes() == conv + HV * V * K * 4 + 2 * 4             # stock's page and the counters
    assert beside.page_bytes() + beside.side_bytes() == inside.page_bytes() and inside.side_bytes() == 0
    assert len(beside.shapes()) == 3 and beside.dtypes()[2] == torch.int32
    beside.check_alignment()
    st = state.BlockState.allocate_paged(beside, N)
    assert st.ld.shape == (N, *beside.record_shapes()[0]) and st.w.is_contiguous() and st.k.dtype == rec
    # the page view covers the page's tensors only
    assert state.page_view(st).numel() * state.page_view(st).element_size() == N * beside.page_bytes()
    def counters(x):
        return torch.as_strided(x.cursor, (N, 2), (x.cursor.stride(0), 1))
    kv = [st.conv, st.ckpt, counters(st)]
    assert state.BlockState.from_kv_cache(beside, kv, (st.ld, st.w, st.k)).w is st.w
    with pytest.raises(ValueError, match="three tensors"):
        state.BlockState.from_kv_cache(beside, kv)
    with pytest.raises(ValueError, match="keys"):
        state.BlockState.from_kv_cache(beside, kv, (st.ld, st.w, st.k[:, :1]))
    ins = state.BlockState.allocate_paged(inside, N)
    with pytest.raises(ValueError, match="keeps them in it"):
        state.BlockState.from_kv_cache(inside, [ins.conv, ins.ckpt, ins.ld, ins.w, ins.k, counters(ins)],
                                       (st.ld, st.w, st.k))
    # vLLM's memory for pages keeps the records' share
    assert layers.side_memory_share([inside]) == 1.0
    share = layers.side_memory_share([inside, beside])
    assert share == pytest.approx(beside.page_bytes() / inside.page_bytes())


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.interpret)])
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_decode_beside_equals_decode_inside(family, kernels):
    """Decode steps through flushes on a state with its records beside the page give the
    outputs and checkpoints of the same state with its records in the page: on the reference
    executor, and on the kernels (strided on the page views and the records' own tensors)."""
    if kernels and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs CUDA or the Triton interpreter")
    g = torch.Generator().manual_seed(6)
    params = layer_params(family, g)
    dev = "cuda" if kernels and torch.cuda.is_available() else "cpu"
    inside = state.BlockState.allocate_paged(spec_for(family, False), N)
    beside = state.BlockState.allocate_paged(spec_for(family, True), N, device=dev)
    S = torch.randn(2, HV, V, K, generator=g) * 0.3
    for st in (inside, beside):
        st.ckpt[torch.tensor([3, 5], device=st.ckpt.device)] = S.to(st.ckpt.device)
    ref = ReferenceExecutor(inside, params)
    ex = KernelExecutor(beside, {k: v.to(dev) for k, v in params.items()}, mode="strided", max_batch=4) \
        if kernels else ReferenceExecutor(beside, params)
    idx = torch.tensor([5, 0, 3], dtype=torch.int32)
    for step in range(6):                                    # window 4: flushes on the way
        toks = tokens(family, 3, g)
        y_in, y_be = torch.empty(3, HV, V), torch.empty(3, HV, V, device=dev)
        batch.run_decode(ref, inside, idx, toks, y_in)
        batch.run_decode(ex, beside, idx.to(dev), {k: v.to(dev) for k, v in toks.items()}, y_be)
        assert torch.allclose(y_be.cpu(), y_in, rtol=1e-4, atol=1e-5), (step, (y_be.cpu() - y_in).abs().max())
    assert torch.equal(beside.cursor.cpu(), inside.cursor)
    assert torch.allclose(beside.ckpt.cpu(), inside.ckpt, rtol=1e-4, atol=1e-5)
    h = int(inside.cursor[3])
    assert h and torch.allclose(beside.w[3, :h].cpu().float(), inside.w[3, :h].float(), rtol=1e-4, atol=1e-5)


class _Buf:
    def __init__(self, n, dtype):
        self.np = np.zeros(n, dtype=dtype)


def test_vllms_copy_carries_the_records_beside():
    """`align` mode's copy of a request's previous block into its running one (vLLM's
    `collect_mamba_copy_meta` then its batched copy, emulated byte for byte): with the patch,
    the records beside the pages go with the page's tensors, for every layer of the group
    whose state keeps them there, into the buffers' room of six entries a layer."""
    g = torch.Generator().manual_seed(2)
    sts = [state.BlockState.allocate_paged(spec_for("gdn", True), N) for _ in range(2)]
    for st in sts:
        for t in (st.ld, st.w, st.k, st.ckpt):
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    layer_names = ["a", "b", "attn"]
    forward_context = {"a": sts[0], "b": sts[1], "attn": None}
    kv_cache_config = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(layer_names=layer_names)])
    bufs = types.SimpleNamespace(src_ptrs=_Buf(6 * 3, np.uint64), dst_ptrs=_Buf(6 * 3, np.uint64),
                                 sizes=_Buf(6 * 3, np.int32), offset=0)
    calls = []

    def vllm_collect(copy_bufs, *args):
        # vLLM's own entries for the pages' tensors (the checkpoint's only, here)
        calls.append(args)
        src, dst = args[6].block_ids[0][args[3]], args[6].block_ids[0][args[4]]
        for st in sts:
            i = copy_bufs.offset
            copy_bufs.src_ptrs.np[i], copy_bufs.dst_ptrs.np[i] = st.ckpt[src].data_ptr(), st.ckpt[dst].data_ptr()
            copy_bufs.sizes.np[i] = st.ckpt[src].numel() * 4
            copy_bufs.offset += 1

    collect = prefix._side_copy(vllm_collect, lambda x: x)
    req = types.SimpleNamespace(block_ids=[[0, 2, 6]])
    collect(bufs, kv_cache_config, (), [0], 1, 2, 0, req, forward_context)
    assert len(calls) == 1 and bufs.offset == 2 + 2 * 3
    for i in range(bufs.offset):                                    # vLLM's batch_memcpy
        ctypes.memmove(int(bufs.dst_ptrs.np[i]), int(bufs.src_ptrs.np[i]), int(bufs.sizes.np[i]))
    for st in sts:
        for t in (st.ckpt, st.ld, st.w, st.k):
            assert torch.equal(t[6], t[2])
        assert not torch.equal(st.w[6], st.w[1])
    # a block copied onto itself adds nothing
    collect(bufs, kv_cache_config, (), [0], 2, 2, 0, req, forward_context)
    assert bufs.offset == 2 + 2 * 3 + 2
    # a state that keeps its records in the page adds no entry of its own
    inside = state.BlockState.allocate_paged(spec_for("gdn", False), N)
    assert prefix.side_copy_entries(bufs, kv_cache_config, [0], req.block_ids, 1, 2,
                                    {"a": inside, "b": None, "attn": None}, lambda x: x) == 0
