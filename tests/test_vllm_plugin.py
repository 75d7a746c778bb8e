"""The vLLM plugin (replayssm.integrations.vllm): what runs without vLLM on the CPU (the GPU
checks with vLLM 0.25.0 are in test_vllm_gpu.py).

CPU: the enable switch and settings; `register()` a no-op when off or without vLLM; the
per-block declaration against `Layout.allocate`'s tensors and laid out as vLLM lays pages;
the batch mapping (`batch.run_decode`: state indices with vLLM's null block as padding,
decode, speculative commit + verify with accepted counts, prefill seeding and the flush
before a prefill that continues a state) on page views against a `SlotPool` on the reference
backend holding the same sequences; the staged kernel executor against the reference; two
ranks of a 2-way tensor-parallel head split against the unsplit layer (on the GPU's kernels
where CUDA is present).
"""
from __future__ import annotations

import os

import pytest
import torch

from replayssm import SlotPool
from replayssm.integrations import vllm as plugin
from replayssm.integrations.vllm import _compat, batch, config, state
from replayssm.integrations.vllm.executors import KernelExecutor, ReferenceExecutor, params_for
from replayssm.pool import Layout

HV, Hk, V, K = 4, 2, 8, 16
N = 7                                                   # blocks; block 0 is vLLM's null block


def spec_for(family, T=1, window=4, rec=torch.float32):
    return state.StateSpec(family=family, HV=HV, Hk=Hk, V=V, K=K, window=window, max_draft=T, record_dtype=rec,
                           conv_shape=(3, 2 * Hk * K + HV * V), conv_dtype=torch.bfloat16)


def layer_params(family, g):
    if family == "mamba2":
        return {"A": -torch.rand(HV, generator=g) - 0.5, "dt_bias": torch.randn(HV, generator=g) * 0.1,
                "D": torch.randn(HV, generator=g)}
    return {"A_log": torch.randn(HV, generator=g) * 0.3, "dt_bias": torch.randn(HV, generator=g) * 0.1}


def tokens(family, n, g, T=None):
    lead = (n,) if T is None else (n, T)
    if family == "mamba2":
        return {"x": torch.randn(*lead, HV, V, generator=g), "dt": torch.randn(*lead, HV, generator=g),
                "B": torch.randn(*lead, Hk, K, generator=g), "C": torch.randn(*lead, Hk, K, generator=g)}
    return {"q": torch.randn(*lead, Hk, K, generator=g), "k": torch.randn(*lead, Hk, K, generator=g),
            "v": torch.randn(*lead, HV, V, generator=g), "a": torch.randn(*lead, HV, generator=g),
            "b": torch.randn(*lead, HV, generator=g)}


# ------------------------------------------------------------------------------ switch, register

def test_enable_switch_and_settings():
    assert not config.enabled({})
    assert not config.enabled({"REPLAYSSM_VLLM": "0"})
    assert config.enabled({"REPLAYSSM_VLLM": "1"}) and config.enabled({"REPLAYSSM_VLLM": " ON "})
    s = config.settings({"REPLAYSSM_VLLM_WINDOW": "8", "REPLAYSSM_VLLM_STATE": "staged"})
    assert (s.window, s.records, s.state, s.spec_blocks) == (8, "auto", "staged", "one")
    assert config.settings({"REPLAYSSM_VLLM_SPEC_BLOCKS": " VLLM"}).spec_blocks == "vllm"
    for env in ({"REPLAYSSM_VLLM_WINDOW": "0"}, {"REPLAYSSM_VLLM_WINDOW": "x"},
                {"REPLAYSSM_VLLM_RECORDS": "int8"}, {"REPLAYSSM_VLLM_STATE": "paged"},
                {"REPLAYSSM_VLLM_SPEC_BLOCKS": "4"}):
        with pytest.raises(ValueError, match=next(iter(env))):
            config.settings(env)


def test_register_is_a_noop_when_disabled_or_without_vllm(monkeypatch):
    assert plugin.register({}) is False
    assert "REPLAYSSM_VLLM" in plugin.status()["reason"]
    monkeypatch.setattr(_compat, "vllm_version", lambda: None)
    with pytest.warns(RuntimeWarning, match="vLLM is not installed"):
        assert plugin.register({"REPLAYSSM_VLLM": "1"}) is False
    assert plugin.status()["registered"] is False
    assert _compat.version_checked("0.25.0+cu129") and not _compat.version_checked("0.26.0")


def test_entry_point_is_declared():
    text = open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")).read()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'replayssm = "replayssm.integrations.vllm:register"' in text


def test_vllm_extra_pins_the_checked_version():
    # `pip install replayssm[vllm]` brings the one vLLM release the plugin was checked against
    tomllib = pytest.importorskip("tomllib")
    text = open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")).read()
    extras = tomllib.loads(text)["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm=={v}" for v in _compat.CHECKED_VERSIONS]


# ------------------------------------------------------------------------------ declaration

@pytest.mark.parametrize("family,T,rec", [("mamba2", 1, torch.bfloat16), ("gdn", 4, torch.float32)])
def test_declaration_matches_layout(family, T, rec):
    sp = spec_for(family, T=T, rec=rec)
    lay = Layout.allocate(N=N, HV=HV, Hk=Hk, V=V, K=K, Lb=sp.capacity, dtype=torch.float32, record_dtype=rec,
                          vector_decay=False, raw_records=False, hp_format=None, lp_format=None, device="cpu")
    shapes, dtypes = sp.shapes(), sp.dtypes()
    assert shapes[0] == sp.conv_shape and dtypes[0] == torch.bfloat16
    for i, t in zip((1, 2, 3, 4), (lay.ckpt["data"], lay.buf["ld"], lay.buf["w"], lay.buf["k"])):
        assert (shapes[i], dtypes[i]) == (tuple(t.shape[1:]), t.dtype)
    assert (shapes[5], dtypes[5]) == ((2,), lay.cursor.dtype)
    per_slot = sum(t[0].numel() * t.element_size() for t in (lay.ckpt["data"], *lay.buf.values()))
    assert sp.page_bytes() == per_slot + 2 * 4 + 3 * sp.conv_shape[1] * 2


def test_declaration_checks():
    with pytest.raises(ValueError, match="not a multiple"):
        state.StateSpec(family="gdn", HV=HV, Hk=Hk, V=V, K=K, window=4, max_draft=1, record_dtype=torch.float32,
                        conv_shape=(3, 5), conv_dtype=torch.bfloat16).check_alignment()
    with pytest.raises(ValueError, match="1..8"):
        spec_for("gdn", T=9, window=16)
    with pytest.raises(ValueError, match="smaller than max_draft"):
        spec_for("gdn", T=4, window=2)


def test_page_views_do_not_overlap():
    st = state.BlockState.allocate_paged(spec_for("mamba2", T=2, rec=torch.bfloat16), N, pad_bytes=64)
    page = st.pages.numel() // N
    assert st.ckpt.stride(0) * 4 == page and st.cursor.stride(0) * 4 == page and not st.ckpt.is_contiguous()
    fills = [(st.conv, 1.0), (st.ckpt, 2.0), (st.ld, 3.0), (st.w, 4.0), (st.k, 5.0), (st.cursor, 6), (st.pending, 7)]
    for t, v in fills:
        t.fill_(v)
    for t, v in fills:
        assert bool((t == v).all()), v
    assert int(st.pages.view(N, page)[:, -64:].sum()) == 0          # the padding untouched


# ------------------------------------------------------------------------------ batch mapping

def _pair(family, T, g):
    """The plugin's state (page views, reference executor) and an oracle pool, both empty."""
    sp = spec_for(family, T=T)
    params = layer_params(family, g)
    st = state.BlockState.allocate_paged(sp, N)
    oracle = SlotPool(params_for(family, **params), N, V, K, Hk, window=sp.window, max_draft=T,
                      backend="reference", eager_max_batch=0)
    return st, ReferenceExecutor(st, params), oracle, params


def _prefill(st, oracle, blocks, g, A=None):
    """What vLLM's prefill leaves: a final state in the checkpoint; the plugin seeds it."""
    S = torch.randn(len(blocks), HV, V, K, generator=g) * 0.3
    idx = torch.tensor(blocks, dtype=torch.int32)
    batch.before_prefill(st, idx, torch.zeros(len(blocks), dtype=torch.bool), A)
    st.ckpt[idx.long()] = S
    batch.after_prefill(st, idx)
    oracle.load(idx, S)


def _assert_states(st, oracle, blocks, A):
    idx = torch.tensor(blocks, dtype=torch.int32)
    want = oracle.materialize(idx)
    state.flush(st, idx, A)                     # the plugin's fold (what a later prefill reads)
    got = st.ckpt[idx.long()]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    assert bool((st.cursor[idx.long()] == 0).all())


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_decode_rows_match_reference_pool(family):
    g = torch.Generator().manual_seed(1)
    st, ex, oracle, params = _pair(family, 1, g)
    A = params.get("A")
    _prefill(st, oracle, [2, 5, 3], g, A)
    # continuous batching: rows come and go, CUDA-graph padding rows carry the null block
    schedule = [[2, 5, 3], [5, 3, 0, 0], [3, 2], [2, 5, 3, 0], [5], [2, 3, 5]]
    for step, blocks in enumerate(schedule):
        if step == 2:
            _prefill(st, oracle, [6], g, A)
            blocks = blocks + [6]
        idx = torch.tensor(blocks, dtype=torch.int32)
        toks = tokens(family, len(blocks), g)
        out = torch.full((len(blocks), HV, V), float("nan"))
        batch.run_decode(ex, st, idx, toks, out)
        live = idx > 0
        want = oracle.decode(idx[live], **{k: v[live] for k, v in toks.items()})
        assert torch.allclose(out[live], want, rtol=1e-5, atol=1e-6), step
        assert bool((out[~live] == 0).all())
        assert torch.equal(st.cursor[idx[live].long()], oracle.cursor[idx[live].long()])
    assert int(st.cursor[0]) == 0 and float(st.ckpt[0].abs().sum()) == 0       # null block untouched
    _assert_states(st, oracle, [2, 3, 5, 6], A)


@pytest.mark.parametrize("uniform", [False, True], ids=["ragged", "uniform"])
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_speculative_rows_match_reference_pool(family, uniform):
    """Commit of the previous step's accepted counts, then verify of this step's tokens, on rows
    of 1..T tokens with padding tokens at the end ("ragged": gathered into [B, T] and scattered
    back) or on rows of T tokens each (vLLM's uniform decode batches: verified in place)."""
    g = torch.Generator().manual_seed(2)
    T = 3
    st, ex, oracle, params = _pair(family, T, g)
    A = params.get("A")
    _prefill(st, oracle, [1, 4], g, A)
    blocks = torch.tensor([1, 4, 0], dtype=torch.int32)          # one graph padding row
    accepted_prev = None
    ragged = ([1, 1, 0], [3, 2, 0], [3, 3, 0], [2, 3, 0], [3, 1, 0], [1, 3, 0])
    for step, qlen in enumerate([[T] * 3] * 6 if uniform else ragged):
        qlen = torch.tensor(qlen)
        qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlen.cumsum(0)]).to(torch.int32)
        ntok = int(qsl[-1]) + (0 if uniform else 2)              # ragged: two padding tokens at the end
        flat = tokens(family, ntok, g)
        out = torch.full((ntok, HV, V), float("nan"))
        num_acc = None if accepted_prev is None else torch.tensor(accepted_prev + [1], dtype=torch.int32)
        batch.run_decode(ex, st, blocks, flat, out, spec_tokens=T - 1, query_start_loc=qsl, num_accepted=num_acc)
        live = torch.tensor([0, 1])
        if accepted_prev is not None:
            oracle.commit(blocks[live], torch.tensor(accepted_prev, dtype=torch.int32))
        padded, n = batch.pad_tokens(flat, qsl[:3], T)
        want = oracle.verify(blocks[live], num_drafts=n[live], **{k: v[live] for k, v in padded.items()})
        for b in (0, 1):
            lo = int(qsl[b])
            for t in range(int(qlen[b])):
                assert torch.allclose(out[lo + t], want[b, t], rtol=1e-5, atol=1e-6), (step, b, t)
        # the sampler accepts a prefix of each row's tokens (at least the first)
        accepted_prev = [int(torch.randint(1, int(q) + 1, (1,), generator=g)) for q in qlen[:2]]
    oracle.commit(blocks[:2], torch.tensor(accepted_prev, dtype=torch.int32))
    ex.commit(batch.slot_ids(blocks[:2]), torch.tensor(accepted_prev, dtype=torch.int32))
    _assert_states(st, oracle, [1, 4], A)


def test_flush_before_a_continuing_prefill():
    """A row that vLLM prefills from its state (chunked prefill after decoding, or GDN's
    draft-less rows in a speculative batch) first gets its records folded; fresh rows keep
    what they have (vLLM overwrites them)."""
    g = torch.Generator().manual_seed(3)
    st, ex, oracle, params = _pair("mamba2", 1, g)
    _prefill(st, oracle, [1, 2], g, params["A"])
    for _ in range(3):
        idx = torch.tensor([1, 2], dtype=torch.int32)
        toks = tokens("mamba2", 2, g)
        batch.run_decode(ex, st, idx, toks, torch.empty(2, HV, V))
        oracle.decode(idx, **toks)
    before2 = st.ckpt[2].clone()
    batch.before_prefill(st, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([True, False]), params["A"])
    assert torch.allclose(st.ckpt[1], oracle.materialize(torch.tensor([1]))[0], rtol=1e-4, atol=1e-5)
    assert int(st.cursor[1]) == 0 and int(st.cursor[2]) == 3 and torch.equal(st.ckpt[2], before2)


def test_pad_unpad_round_trip():
    qsl = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    x = torch.arange(8.0)[:, None, None].expand(8, 1, 1).contiguous()
    padded, n = batch.pad_tokens({"x": x}, qsl, 3)
    assert n.tolist() == [2, 3, 1]
    assert padded["x"][:, :, 0, 0].tolist() == [[0, 1, 0], [2, 3, 4], [5, 0, 0]]
    out = torch.empty(8, 1, 1)
    batch.unpad_outputs(padded["x"], qsl, out)
    assert out[:6, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert batch.slot_ids(torch.tensor([0, 3, -1, 5])).tolist() == [-1, 3, -1, 5]


@pytest.mark.interpret
@pytest.mark.parametrize("mode", ["strided", "staged"])
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_kernel_executors_match_reference(family, mode):
    """The kernel executor, decode (through a flush) then speculative verify, against the
    reference executor on a copy of the same pages: mode "strided" runs the kernels on the page
    views with their slot strides, "staged" on contiguous scratch rows gathered from and
    written back to the pages."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs CUDA or the Triton interpreter")
    g = torch.Generator().manual_seed(4)
    T = 2
    sp = spec_for(family, T=T)
    params = layer_params(family, g)
    # the kernels on CUDA where present (the reference executor stays on the CPU)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = state.BlockState.allocate_paged(sp, N, device=dev)
    b = state.BlockState.allocate_paged(sp, N)
    S = torch.randn(2, HV, V, K, generator=g) * 0.3
    for st in (a, b):
        st.ckpt[torch.tensor([3, 5], device=st.ckpt.device)] = S.to(st.ckpt.device)
    ka = KernelExecutor(a, {k: v.to(dev) for k, v in params.items()}, mode=mode, max_batch=4)
    rb = ReferenceExecutor(b, params)
    idx = torch.tensor([5, 0, 3], dtype=torch.int32)

    def on(t):
        return {k: v.to(dev) for k, v in t.items()}
    for step in range(5):
        toks = tokens(family, 3, g)
        ya, yb = torch.empty(3, HV, V, device=dev), torch.empty(3, HV, V)
        batch.run_decode(ka, a, idx.to(dev), on(toks), ya)
        batch.run_decode(rb, b, idx, toks, yb)
        assert torch.allclose(ya.cpu(), yb, rtol=1e-4, atol=1e-5), (step, (ya.cpu() - yb).abs().max())
    qsl = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    for step in range(2):
        flat = tokens(family, 3, g)
        ya, yb = torch.empty(3, HV, V, device=dev), torch.empty(3, HV, V)
        acc = torch.tensor([2, 1, 1], dtype=torch.int32)
        batch.run_decode(ka, a, idx.to(dev), on(flat), ya, spec_tokens=T - 1, query_start_loc=qsl.to(dev),
                         num_accepted=acc.to(dev))
        batch.run_decode(rb, b, idx, flat, yb, spec_tokens=T - 1, query_start_loc=qsl, num_accepted=acc)
        assert torch.allclose(ya.cpu(), yb, rtol=1e-4, atol=1e-5), (step, (ya.cpu() - yb).abs().max())
    qsl = torch.arange(0, 3 * T + 1, T, dtype=torch.int32)                  # every row T tokens: in place
    for step in range(2):
        flat = tokens(family, 3 * T, g)
        ya, yb = torch.empty(3 * T, HV, V, device=dev), torch.empty(3 * T, HV, V)
        acc = torch.tensor([1, 1, 2], dtype=torch.int32)
        batch.run_decode(ka, a, idx.to(dev), on(flat), ya, spec_tokens=T - 1, query_start_loc=qsl.to(dev),
                         num_accepted=acc.to(dev))
        batch.run_decode(rb, b, idx, flat, yb, spec_tokens=T - 1, query_start_loc=qsl, num_accepted=acc)
        live = torch.tensor([0, 1, 4, 5])                                    # the padding row's are not read
        assert torch.allclose(ya.cpu()[live], yb[live], rtol=1e-4, atol=1e-5), (step, (ya.cpu() - yb).abs().max())
    for name in ("cursor", "pending"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name)), name
    assert torch.allclose(a.ckpt.cpu(), b.ckpt, rtol=1e-4, atol=1e-5)
    assert int(a.cursor[0]) == 0 and float(a.ckpt[0].abs().sum()) == 0          # null block untouched
    if mode == "strided":
        assert torch.equal(a.conv.cpu(), b.conv)                             # the page's other tensors too


@pytest.mark.interpret
def test_staged_layers_share_scratch_and_stay_apart():
    """Two layers of one shape share one set of staging rows (not one per layer), and calls
    alternating between them still equal the reference executor of each layer."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs CUDA or the Triton interpreter")
    g = torch.Generator().manual_seed(6)
    sp = spec_for("gdn", T=2)
    params = [layer_params("gdn", g) for _ in range(2)]
    pages = [state.BlockState.allocate_paged(sp, N) for _ in range(4)]
    for i, st in enumerate(pages):
        st.ckpt[torch.tensor([1, 4])] = torch.randn(2, HV, V, K, generator=torch.Generator().manual_seed(i % 2)) * 0.3
    kernels = [KernelExecutor(pages[i], params[i], mode="staged", max_batch=4) for i in (0, 1)]
    refs = [ReferenceExecutor(pages[2 + i], params[i]) for i in (0, 1)]
    assert all(kernels[0].scratch[n] is kernels[1].scratch[n] for n in kernels[0].scratch)
    idx = torch.tensor([4, 1], dtype=torch.int32)
    for step in range(3):
        for layer in (0, 1):
            toks = tokens("gdn", 2, g)
            ya, yb = torch.empty(2, HV, V), torch.empty(2, HV, V)
            batch.run_decode(kernels[layer], pages[layer], idx, toks, ya)
            batch.run_decode(refs[layer], pages[2 + layer], idx, toks, yb)
            assert torch.allclose(ya, yb, rtol=1e-4, atol=1e-5), (step, layer, (ya - yb).abs().max())
    for layer in (0, 1):
        assert torch.allclose(pages[layer].ckpt, pages[2 + layer].ckpt, rtol=1e-4, atol=1e-5)
        assert torch.equal(pages[layer].cursor, pages[2 + layer].cursor)


# ------------------------------------------------------------------------------ tensor parallelism

_HEAD_KEYS = {"mamba2": ({"x", "dt"}, {"B", "C"}), "gdn": ({"v", "a", "b"}, {"q", "k"})}


def _rank_slice(family, toks, r, tp):
    """Rank r's share of a batch's token inputs: its value heads and its key heads (groups),
    contiguous blocks of each, as tensor parallelism shards a layer's heads."""
    heads, keys = _HEAD_KEYS[family]
    out = {}
    for k, v in toks.items():
        n = HV if k in heads else Hk
        w = n // tp
        out[k] = v.narrow(1, r * w, w).contiguous()
    return out


@pytest.mark.parametrize("executor", ["reference", "staged"])
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_tensor_parallel_ranks_concatenate_to_the_unsplit_layer(family, executor):
    """Two ranks of a 2-way head split, each with the plugin's state for its heads (HV / 2 value
    heads, Hk / 2 key heads per block), decoding and verifying the same batch (rows joining,
    a padding row, speculative rounds with the same accepted counts on both ranks): the ranks'
    outputs concatenated over heads equal the unsplit layer's, and so do their states."""
    if executor == "staged" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs CUDA or the Triton interpreter")
    tp, T = 2, 3
    dev = "cuda" if torch.cuda.is_available() and executor == "staged" else "cpu"
    g = torch.Generator().manual_seed(8)
    params = {k: v.to(dev) for k, v in layer_params(family, g).items()}
    full = state.BlockState.allocate_paged(spec_for(family, T=T), N, device=dev)
    ranks = []
    for r in range(tp):
        sp = state.StateSpec(family=family, HV=HV // tp, Hk=Hk // tp, V=V, K=K, window=4, max_draft=T,
                             record_dtype=torch.float32, conv_shape=(3, 2 * (Hk // tp) * K + (HV // tp) * V),
                             conv_dtype=torch.bfloat16)
        ranks.append(state.BlockState.allocate_paged(sp, N, device=dev))
    rank_params = [{k: v[r * (HV // tp):(r + 1) * (HV // tp)] for k, v in params.items()} for r in range(tp)]
    make = (lambda st, p: ReferenceExecutor(st, p)) if executor == "reference" else (
        lambda st, p: KernelExecutor(st, p, mode="staged", max_batch=4))
    ex_full = make(full, params)
    ex_ranks = [make(st, p) for st, p in zip(ranks, rank_params)]
    S = (torch.randn(3, HV, V, K, generator=g) * 0.3).to(dev)
    blocks = torch.tensor([2, 5, 3], dtype=torch.int32, device=dev)
    full.ckpt[blocks.long()] = S
    for r, st in enumerate(ranks):
        st.ckpt[blocks.long()] = S[:, r * (HV // tp):(r + 1) * (HV // tp)]

    def both(idx, toks, nout, **kw):
        y = torch.full((nout, HV, V), float("nan"), device=dev)
        batch.run_decode(ex_full, full, idx, toks, y, **kw)
        parts = []
        for r, (ex, st) in enumerate(zip(ex_ranks, ranks)):
            yr = torch.full((nout, HV // tp, V), float("nan"), device=dev)
            batch.run_decode(ex, st, idx, _rank_slice(family, toks, r, tp), yr, **kw)
            parts.append(yr)
        return y, torch.cat(parts, dim=1)

    for step, idx in enumerate(([2, 5, 3], [5, 3, 0], [3, 2, 5])):
        idx = torch.tensor(idx, dtype=torch.int32, device=dev)
        toks = {k: v.to(dev) for k, v in tokens(family, 3, g).items()}
        y, y2 = both(idx, toks, 3)
        assert torch.allclose(y2, y, rtol=1e-5, atol=1e-6), (step, (y2 - y).abs().max())
    qsl = torch.tensor([0, 3, 5, 6], dtype=torch.int32, device=dev)
    acc = None
    for step in range(3):
        flat = {k: v.to(dev) for k, v in tokens(family, 6, g).items()}
        y, y2 = both(blocks, flat, 6, spec_tokens=T - 1, query_start_loc=qsl, num_accepted=acc)
        assert torch.allclose(y2, y, rtol=1e-5, atol=1e-6), ("verify", step, (y2 - y).abs().max())
        # the same accepted counts on every rank (as vLLM broadcasts the sampler's)
        acc = torch.tensor([1 + step % 3, 2, 1], dtype=torch.int32, device=dev)
    for r, st in enumerate(ranks):
        for name in ("cursor", "pending"):
            assert torch.equal(getattr(st, name), getattr(full, name)), (r, name)
        assert torch.allclose(st.ckpt, full.ckpt[:, r * (HV // tp):(r + 1) * (HV // tp)], rtol=1e-5, atol=1e-6)


def test_metadata_lookup_refuses_micro_batches():
    # the forward context's metadata: None in the profile run, a dict per step, and a list per
    # micro-batch under vLLM's dual-batch overlap, which the plugin refuses by name
    from types import SimpleNamespace
    ctx = SimpleNamespace(attn_metadata=None)
    ns = SimpleNamespace(get_forward_context=lambda: ctx)
    assert _compat.metadata_for(ns, "layer.0") is None
    ctx.attn_metadata = {"layer.0": "md"}
    assert _compat.metadata_for(ns, "layer.0") == "md"
    ctx.attn_metadata = [{"layer.0": "a"}, {"layer.0": "b"}]
    with pytest.raises(NotImplementedError, match="micro-batching"):
        _compat.metadata_for(ns, "layer.0")


def test_rebinding_the_kv_cache_releases_the_old_states_first():
    # vLLM binds a small KV cache to profile CUDA-graph memory, frees it, then allocates the
    # real one: the states the plugin built over the first must be gone before that allocation
    import weakref
    from types import SimpleNamespace as NS
    from replayssm.integrations.vllm import layers

    class Held:                                     # stands for the old cache's views
        pass

    layer, held = NS(), Held()
    setattr(layer, layers._STATE_ATTR, (0, held, None))
    ref = weakref.ref(held)
    del held
    seen = []

    def orig(runner):
        seen.append(ref() is None)
        return "kv"

    ns = NS(MambaMixer2=type("M", (), {}), GDN=type("G", (), {}))      # nothing to bind after
    runner = NS(compilation_config=NS(static_forward_context={"l": layer}),
                vllm_config=NS(scheduler_config=NS(max_num_seqs=4)), speculative_config=None,
                device="cpu", model_config=NS(dtype=torch.float32))
    assert ref() is not None
    assert layers.bind_states(ns, config.Settings())(orig)(runner) == "kv"
    assert seen == [True] and not hasattr(layer, layers._STATE_ATTR)
    assert layers.release_states([layer, NS()]) == 0


def test_one_state_block_per_request_with_drafts():
    # vLLM's spec asks for 1 + num_speculative_tokens blocks per request with drafts; the
    # patched layer asks for one (rollback is the cursor move), everything else kept
    import dataclasses
    from replayssm.integrations.vllm import layers

    @dataclasses.dataclass(frozen=True)
    class Spec:
        block_size: int
        num_speculative_blocks: int = 0

    class Base:
        def get_kv_cache_spec(self, vllm_config):
            return None if vllm_config is None else Spec(block_size=vllm_config, num_speculative_blocks=3)

    class Layer(Base):
        pass

    layers.one_block_per_request(Layer)
    layers.one_block_per_request(Layer)                             # a second register() call
    assert Layer().get_kv_cache_spec(7) == Spec(block_size=7, num_speculative_blocks=0)
    assert Layer().get_kv_cache_spec(None) is None
    assert Base().get_kv_cache_spec(7).num_speculative_blocks == 3    # the base class untouched


def test_fold_before_prefill_follows_vllms_host_flag():
    from types import SimpleNamespace as NS
    assert not _compat.prefill_continues_a_state(NS(prep_initial_states=False))      # fresh prompts only
    assert _compat.prefill_continues_a_state(NS(prep_initial_states=True))
    assert _compat.prefill_continues_a_state(NS())                                   # no flag: fold
