"""The Gluon verify kernel of GDN and KDA (ops/gdn/gluon_verify.py), which `replay_verify` runs
on a GPU by default for GDN, for KDA with `{"gluon": True}` (config `gluon`).

On the GPU: many rounds of verify + commit mixed with decode steps against the float64
reference, within 1.5x the conventional fp32 kernel's own error (the yardstick and driver of
tests/test_verify_delta.py), at Qwen3.5-4B and -122B shapes and a small one, T in {1, 2, 4, 8}
(KDA: Kimi Linear and a small shape, T in {2, 4, 8}); against the Triton kernel round by round;
poisoned drafts; CUDA-graph replay against eager runs. On the CPU: the config key (validation,
which kernel it selects, per family) and its dispatch, where the interpreter always runs the
Triton kernel.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm.ops.gdn.gluon_verify_host import gluon_verify_unsupported  # noqa: E402
from replayssm.ops.gdn.verify import verify_config  # noqa: E402
from replayssm.ops.utils.commit import commit  # noqa: E402
from replayssm.ops.utils.gluon import HAVE_GLUON  # noqa: E402
from test_verify_delta import _Run, _check_accuracy, _drive  # noqa: E402

GPU = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_gluon = pytest.mark.skipif(not (GPU and HAVE_GLUON), reason="needs a CUDA device and Triton's Gluon")

SHAPES = {"small": dict(HV=4, Hk=2, V=32, K=128),
          "qwen3.5-4b": dict(HV=32, Hk=16, V=128, K=128),
          "qwen3.5-122b": dict(HV=64, Hk=16, V=128, K=128),
          "kimi-linear-48b": dict(HV=32, Hk=32, V=128, K=128)}
GLUON = {"gluon": True}
TRITON = {"gluon": False}
# cursors 0, L-1, L and spread (window 16): flushes and plain rounds in the first launch
CURSORS = (0, 15, 16, 4, 9, 12, 1, 16)


def _uses_gluon(shape, T, L, config, family="gdn"):
    """The resolved config runs the Gluon kernel (so that a test of it cannot pass on Triton)."""
    cfg = verify_config(family, shape["V"], shape["K"], T, config, HV=shape["HV"], Hk=shape["Hk"], window=L,
                        Lb=L + T, gpu=True)
    assert cfg["gluon"], cfg
    return cfg


def _verify(run, st, x, ids, nd, L, config, arrive):
    out = torch.full((ids.numel(), run.T, run.HV, run.V), float("nan"), device="cuda", dtype=run.io)
    run.ops.replay_verify(x["q"], x["k"], x["v"], x["a"], x["b"], run.A_log, run.dt_bias, None, st["ckpt"],
                      st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"], st["pending"], st["epoch"], ids, L,
                      num_drafts=nd, out=out, config=config, arrive=arrive)
    return out


def _round_inputs(run, Bt, T, g):
    x = run._inputs(Bt, steps=T)
    nd = torch.randint(1, T + 1, (Bt,), generator=g).int().cuda()
    acc = ((torch.rand(Bt, generator=g) * nd.cpu()).long() + 1).int().cuda()
    return x, nd, acc


def _poison_past(st, cursor, slots):
    for s in slots:
        h = int(cursor[s])
        for name in ("buf_ld", "buf_w", "buf_k"):
            st[name][s, h:] = float("nan")


def _rel(a, b):
    d = (a.double() - b.double()).norm()
    r = b.double().norm()
    return float(d / r) if r > 0 else float(d)


# ---------------------------------------------------------------------------------------------
# GPU: the float64 reference


def _rounds_against_reference(family, name, T, configs=None, io=torch.float32):
    # 32 verify rounds (random draft counts and acceptance, a padding row, an unused slot, NaN
    # past every cursor), a decode step after every third; fp32 records within 1.5x of the
    # conventional kernel's error, bf16 records at bf16 level
    shape = SHAPES[name]
    if configs is None:
        configs = [GLUON] + ([{"gluon": True, "BV": 16, "num_warps": 1}] if name == "small" else [])
    for config in configs:
        _uses_gluon(shape, T, 16, config, family)
        for rec in (torch.float32, torch.bfloat16):
            run, err = _drive(family, 32, **shape, L=16, T=T, cursors=CURSORS, seed=T, rec=rec, config=config, io=io)
            assert {f for _, f in run.seen} == {True, False}, run.seen
            if rec == torch.float32:
                _check_accuracy(run, err)
            else:
                assert run.problems == [], run.problems[:5]
                assert err["out"] < 1e-2 and err["state"] < 1e-2, (name, config, err)


@gpu
@needs_gluon
@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["small", "qwen3.5-4b", "qwen3.5-122b"])
def test_gpu_gluon_rounds_against_reference(name, T):
    _rounds_against_reference("gdn", name, T)


@gpu
@needs_gluon
@pytest.mark.parametrize("T", [2, 8])
@pytest.mark.parametrize("name", ["small", "qwen3.5-4b"])
def test_gpu_gluon_kq_rounds_against_reference(name, T):
    # the key head's products from the launch before the kernel (`kq`)
    _rounds_against_reference("gdn", name, T, [{"gluon": True, "kq": True}])


@gpu
@needs_gluon
@pytest.mark.parametrize("io", [torch.float32, torch.bfloat16], ids=["fp32-io", "bf16-io"])
@pytest.mark.parametrize("T", [2, 5, 8])
@pytest.mark.parametrize("name", ["small", "qwen3.5-4b", "qwen3.5-122b"])
def test_gpu_gluon_mma_rounds_against_reference(name, T, io):
    # the tile's products with the drafts' keys and queries on the tensor cores, exact
    # (`mma`), and an early flush's fold there too, with and without the key head's products
    # from the launch before; fp32 token inputs (three pieces) and bf16 (one, as served)
    _rounds_against_reference("gdn", name, T, [{"gluon": True, "mma": True},
                                               {"gluon": True, "mma": True, "kq": True}], io=io)


@gpu
@needs_gluon
@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("name", ["small", "kimi-linear-48b"])
def test_gpu_gluon_kda_rounds_against_reference(name, T):
    # KDA (gluon=True: not its default): channel-wise decays, weights per key column
    _rounds_against_reference("kda", name, T)


@gpu
@needs_gluon
@pytest.mark.parametrize("L, T, cursors", [(32, 4, (0, 31, 32, 17, 5)), (32, 8, (0, 31, 32, 24, 9)),
                                           (5, 2, (5, 4, 0))],
                         ids=["window32-T4", "window32-T8", "window5-T2"])
def test_gpu_gluon_windows(L, T, cursors):
    # record tiles of 32 positions (window above 16), a short window; fp32 records. (Windows
    # below T run the Triton kernel: gluon_verify_unsupported.)
    shape = SHAPES["qwen3.5-4b"] if L > 16 else SHAPES["small"]
    _uses_gluon(shape, T, L, GLUON)
    run, err = _drive("gdn", 32, **shape, L=L, T=T, cursors=cursors, seed=L + T, config=GLUON)
    _check_accuracy(run, err)


# ---------------------------------------------------------------------------------------------
# GPU: the Triton kernel, round by round


def _matches_triton(family, name, rec, T, config=GLUON, out_tol=None, io=torch.float32):
    # the same state and inputs through both kernels: outputs and every state tensor agree
    # (integers exactly, floats to rounding: the weights are associated differently), padding
    # rows and drafts past a row's count exactly zero; both then commit the same acceptance
    # and the Gluon state restarts from the Triton one. `out_tol`: the outputs' own tolerance
    # (a launch's outputs follow identical state, so they agree to fp32 rounding even where the
    # bf16 records it writes round apart)
    shape, L = SHAPES[name], 16
    _uses_gluon(shape, T, L, config, family)
    run = _Run(family, **shape, L=L, T=T, cursors=CURSORS, rec=rec, seed=100 + T, io=io)
    st_t = run.st
    st_g = {n: t.clone() for n, t in st_t.items()}
    arr_t = torch.zeros(run.N, dtype=torch.int32, device="cuda")
    arr_g = torch.zeros_like(arr_t)
    g = torch.Generator().manual_seed(T)
    tol = 1e-5 if rec == torch.float32 else 2e-3
    flushed = set()
    for r in range(16):
        ids = run._rows(pad_rows=2)
        Bt = ids.numel()
        ids_d = ids.int().cuda()
        live = ids[ids >= 0].tolist()
        for st in (st_t, st_g):
            _poison_past(st, st_t["cursor"].cpu(), live)
        x, nd, acc = _round_inputs(run, Bt, T, g)
        h0 = st_t["cursor"].cpu()[ids.clamp(min=0)]
        flushed |= set((h0 + nd.cpu() > L)[ids >= 0].tolist())
        o_t = _verify(run, st_t, x, ids_d, nd, L, TRITON, arr_t)
        o_g = _verify(run, st_g, x, ids_d, nd, L, config, arr_g)
        dead = ((torch.arange(T)[None, :] >= nd.cpu()[:, None]) | (ids < 0)[:, None]).cuda()
        assert bool((o_g[dead] == 0).all()) and bool(torch.isfinite(o_g[~dead]).all()), r
        assert _rel(o_g[~dead], o_t[~dead]) < (out_tol or tol), (r, _rel(o_g[~dead], o_t[~dead]))
        for n in ("cursor", "pending", "epoch"):
            assert torch.equal(st_g[n], st_t[n]), (r, n)
        assert bool((arr_g == 0).all())
        for n in ("ckpt", "buf_ld", "buf_w", "buf_k"):
            # the records up to the new cursor plus the drafts written (past them: poison or stale)
            a, b = st_g[n][live], st_t[n][live]
            if n != "ckpt":
                keep = torch.arange(a.shape[1], device="cuda")[None, :] < (st_t["cursor"] + st_t["pending"])[live][:, None]
                a, b = a[keep], b[keep]
            assert _rel(a, b) < tol, (r, n, _rel(a, b))
        for st in (st_t, st_g):
            commit(st["cursor"], st["pending"], ids_d, acc)
        for n in ("ckpt", "buf_ld", "buf_w", "buf_k"):
            st_g[n].copy_(st_t[n])
    assert flushed == {True, False}, flushed


@gpu
@needs_gluon
@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("rec", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["small", "qwen3.5-122b"])
def test_gpu_gluon_matches_triton(name, rec, T):
    _matches_triton("gdn", name, rec, T)


@gpu
@needs_gluon
@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("rec", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["small", "kimi-linear-48b"])
def test_gpu_gluon_kda_matches_triton(name, rec, T):
    _matches_triton("kda", name, rec, T)


@gpu
@needs_gluon
@pytest.mark.parametrize("T, rows", [(5, 1), (8, 1), (8, 2)])
@pytest.mark.parametrize("name", ["qwen3.5-4b", "qwen3.5-122b"])
def test_gpu_gluon_lean(name, T, rows, monkeypatch):
    # REPLAYSSM_GLUON_VERIFY_LEAN where it applies (bf16 inputs and records; asserted to have run in
    # each check): one launch within fp32 rounding of the Triton kernel, rounds against float64, poison
    from replayssm.ops.gdn import gluon_verify_host as gv
    monkeypatch.setattr(gv, "LEAN", True)
    monkeypatch.setattr(gv, "ROWS", rows)                 # REPLAYSSM_GLUON_VERIFY_ROWS
    seen, constexprs = [], gv.gluon_verify_constexprs

    def spy(*a, **k):
        d = constexprs(*a, **k)
        seen.append(d["LEAN"] and d["BV"] == 64 * rows)
        return d
    monkeypatch.setattr(gv, "gluon_verify_constexprs", spy)
    mma, bf = {"gluon": True, "mma": True}, torch.bfloat16
    for what, check in (("one launch", lambda: _matches_triton("gdn", name, bf, T, mma, out_tol=2e-5, io=bf)),
                        ("rounds", lambda: _rounds_against_reference("gdn", name, T, [mma], io=bf)),
                        ("poisoned drafts", lambda: _poisoned_drafts("gdn", name, T, mma, rec=bf, io=bf))):
        seen.clear()
        check()
        assert any(seen), f"{what}: LEAN (at these rows) never applied"


# ---------------------------------------------------------------------------------------------
# GPU: poisoned drafts


@gpu
@needs_gluon
@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("family, name", [("gdn", "qwen3.5-4b"), ("kda", "kimi-linear-48b")], ids=["gdn", "kda"])
def test_gpu_gluon_poisoned_drafts(family, name, T):
    _poisoned_drafts(family, name, T)


def _poisoned_drafts(family, name, T, config=GLUON, **kw):
    # NaN in every input of the drafts past each row's count: outputs and state bit for bit
    # those of clean inputs; NaN in draft t0 < n of one row: that row's earlier outputs bit for
    # bit the clean ones, every other row's outputs untouched
    shape, L = SHAPES[name], 16
    _uses_gluon(shape, T, L, config, family)
    run = _Run(family, **shape, L=L, T=T, cursors=CURSORS, seed=7, **kw)
    g = torch.Generator().manual_seed(1)
    ids = run._rows()
    Bt = ids.numel()
    ids_d = ids.int().cuda()
    x, nd, _ = _round_inputs(run, Bt, T, g)
    r0 = int((ids >= 0).nonzero()[0, 0])                  # a live row, with every draft
    nd[r0] = T
    arr = torch.zeros(run.N, dtype=torch.int32, device="cuda")

    def once(xx):
        st = {n: t.clone() for n, t in run.st.items()}
        return _verify(run, st, xx, ids_d, nd, L, config, arr), st

    o_ref, st_ref = once(x)
    past = (torch.arange(T)[None, :] >= nd.cpu()[:, None]).cuda()
    xp = {n: t.clone() for n, t in x.items()}
    for t in xp.values():
        t[past] = float("nan")
    o_p, st_p = once(xp)
    assert torch.equal(o_p, o_ref)
    for n in st_ref:
        assert torch.equal(st_p[n].view(torch.uint8), st_ref[n].view(torch.uint8)), n
    t0 = T // 2
    xp = {n: t.clone() for n, t in x.items()}
    for t in xp.values():
        t[r0, t0] = float("nan")
    o_p, _ = once(xp)
    assert torch.equal(o_p[r0, :t0], o_ref[r0, :t0]) and bool(torch.isfinite(o_p[r0, :t0]).all())
    assert not bool(torch.isfinite(o_p[r0, t0]).all())     # the poison did reach its own draft
    others = torch.arange(Bt) != r0
    assert torch.equal(o_p[others.cuda()], o_ref[others.cuda()])


# ---------------------------------------------------------------------------------------------
# GPU: CUDA-graph replay


@gpu
@needs_gluon
@pytest.mark.parametrize("T", [2, 8])
@pytest.mark.parametrize("family, name", [("gdn", "qwen3.5-122b"), ("kda", "kimi-linear-48b")], ids=["gdn", "kda"])
def test_gpu_gluon_cuda_graph_matches_eager(family, name, T):
    # verify + commit captured once and replayed over 12 rounds of new inputs, draft counts and
    # acceptance (copied into the captured buffers): outputs and state bit for bit those of the
    # same calls made eagerly
    shape, L = SHAPES[name], 16
    _uses_gluon(shape, T, L, GLUON, family)
    run = _Run(family, **shape, L=L, T=T, cursors=CURSORS, rec=torch.bfloat16, seed=11, io=torch.bfloat16)
    st_e = {n: t.clone() for n, t in run.st.items()}
    st_g = {n: t.clone() for n, t in run.st.items()}
    g = torch.Generator().manual_seed(2)
    ids = run._rows()
    ids_d = ids.int().cuda()
    Bt = ids.numel()
    x_s, nd_s, acc_s = _round_inputs(run, Bt, T, g)
    arr_e = torch.zeros(run.N, dtype=torch.int32, device="cuda")
    arr_g = torch.zeros_like(arr_e)
    o_e = torch.empty(Bt, T, run.HV, run.V, device="cuda", dtype=run.io)
    o_g = torch.empty_like(o_e)

    def step(st, x, nd, acc, o, arr):
        run.ops.replay_verify(x["q"], x["k"], x["v"], x["a"], x["b"], run.A_log, run.dt_bias, None, st["ckpt"],
                              st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"], st["pending"], st["epoch"],
                              ids_d, L, num_drafts=nd, out=o, config=GLUON, arrive=arr, validate=False)
        commit(st["cursor"], st["pending"], ids_d, acc)

    warm = {n: t.clone() for n, t in run.st.items()}
    step(warm, x_s, nd_s, acc_s, o_g, arr_g)              # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(st_g, x_s, nd_s, acc_s, o_g, arr_g)
    # capture records, it does not run: the graph state is still the initial one
    for n in st_g:
        assert torch.equal(st_g[n].view(torch.uint8), st_e[n].view(torch.uint8)), n
    for r in range(12):
        x, nd, acc = _round_inputs(run, Bt, T, g)
        for n in x_s:
            x_s[n].copy_(x[n])
        nd_s.copy_(nd)
        acc_s.copy_(acc)
        step(st_e, x, nd, acc, o_e, arr_e)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_g.view(torch.uint8), o_e.view(torch.uint8)), r
        for n in st_e:
            assert torch.equal(st_g[n].view(torch.uint8), st_e[n].view(torch.uint8)), (r, n)


# ---------------------------------------------------------------------------------------------
# CPU: the config key


def test_verify_config_gluon_key():
    # GDN on a GPU: the Gluon kernel by default, its program size (BV = 64, 4 warps; the
    # largest of 64, 32, 16 rows dividing V) and register cap (128 above T = 4)
    c = verify_config("gdn", 128, 128, 8, HV=32, Hk=16, window=16, Lb=24, gpu=True)
    assert c["gluon"] and (c["BV"], c["num_warps"], c["maxnreg"]) == (64, 4, 128), c
    c = verify_config("gdn", 32, 128, 2, HV=4, Hk=2, window=16, Lb=18, gpu=True)
    assert c["gluon"] and (c["BV"], c["num_warps"], c["maxnreg"]) == (32, 2, 0), c
    assert verify_config("gdn", 128, 128, 4, {"BV": 32, "num_warps": 2}, gpu=True)["gluon"]
    # the CPU interpreter, gluon=False, shapes and configs it does not cover:
    # the Triton kernel with its own defaults and the caller's overrides
    tri = verify_config("gdn", 128, 128, 8, window=16, Lb=24, gpu=False)
    assert not tri["gluon"] and (tri["BV"], tri["num_warps"], tri["maxnreg"]) == (32, 4, 0), tri
    assert verify_config("gdn", 128, 128, 8, {"gluon": True}, gpu=False) == tri
    assert verify_config("gdn", 128, 128, 8, TRITON, gpu=True) == tri
    assert verify_config("kda", 128, 128, 8, TRITON, gpu=True) == tri
    for kw in (dict(K=64), dict(window=40)):
        args = dict(V=128, K=128, T=4, window=16)
        args.update(kw)
        c = verify_config("gdn", args["V"], args["K"], 4, GLUON, window=args["window"], gpu=True)
        assert not c["gluon"], (kw, c)
    c = verify_config("gdn", 128, 128, 4, {"gluon": True, "BV": 32, "num_warps": 4, "KS": 4}, gpu=True)
    assert not c["gluon"] and (c["BV"], c["num_warps"], c["KS"]) == (32, 4, 4), c
    assert gluon_verify_unsupported("gdn", 32, 16, 128, 128, 8, 16, 24, 64, 4) is None
    for args, match in ((("mamba2", 32, 32, 128, 128, 8, 16, 24, 64, 4), "GDN and KDA only"),
                        (("gdn", 32, 16, 128, 128, 9, 16, 25, 64, 4), "T=9"),
                        (("gdn", 32, 16, 128, 64, 8, 16, 24, 64, 4), "K=64"),
                        (("gdn", 32, 16, 128, 128, 8, 16, 24, 32, 4), "BV=32"),
                        (("gdn", 32, 16, 128, 128, 8, 40, 48, 64, 4), "window"),
                        (("gdn", 30, 16, 128, 128, 8, 16, 24, 64, 4), "multiple")):
        assert match in (gluon_verify_unsupported(*args) or ""), (args, match)
    # gluon=True with mma=True: the Gluon kernel's tile products on the tensor cores (GDN only;
    # off the GPU the launch takes the Triton tensor-core kernel)
    c = verify_config("gdn", 128, 128, 8, {"gluon": True, "mma": True}, HV=32, Hk=16, window=16, Lb=24, gpu=True)
    assert c["gluon"] and c["mma"] and not c["kq"] and (c["BV"], c["num_warps"], c["maxnreg"]) == (64, 4, 128), c
    assert verify_config("gdn", 128, 128, 8, {"gluon": True, "mma": True, "kq": True}, gpu=True)["kq"]
    # ... which is GDN's default at 8 drafts (measured faster there), not at 4, not for KDA,
    # and off where the config says so
    assert verify_config("gdn", 128, 128, 8, GLUON, gpu=True)["mma"]
    assert verify_config("gdn", 128, 128, 8, HV=32, Hk=16, window=16, Lb=24, gpu=True)["mma"]
    assert not verify_config("gdn", 128, 128, 4, GLUON, gpu=True)["mma"]
    assert not verify_config("kda", 128, 128, 8, GLUON, gpu=True)["mma"]
    assert not verify_config("gdn", 128, 128, 8, {"mma": False}, gpu=True)["mma"]
    assert not verify_config("gdn", 128, 128, 8, gpu=False)["mma"]                    # the Triton kernel
    for family, config, kw, match in (("kda", {"gluon": True, "mma": True}, {}, "GDN only"),
                                      ("gdn", {"gluon": True, "mma": True}, dict(window=40, Lb=48), "window"),
                                      ("gdn", {"gluon": True, "mma": True, "BV": 32, "num_warps": 4}, {}, "BV=32")):
        with pytest.raises(ValueError, match=match):
            verify_config(family, 128, 128, 8, config, gpu=True, **kw)
    # validation
    for config, match in (({"gluon": 1}, "gluon=1 must be a bool"), ({"maxnreg": -1}, "maxnreg=-1"),
                          ({"maxnreg": True}, "maxnreg=True"), ({"gluon": True, "BV": 48}, "BV=48"),
                          ({"Gluon": True}, "unknown keys")):
        with pytest.raises(ValueError, match=match):
            verify_config("gdn", 128, 128, 4, config, gpu=True)


def test_verify_config_gluon_key_kda():
    # KDA, as GDN: the Gluon kernel by default where it covers the shape, with GDN's program size
    # and register cap; the Triton kernel with gluon=False
    kimi = dict(HV=32, Hk=32, window=16)
    for T in (2, 4, 8):
        assert verify_config("kda", 128, 128, T, gpu=True, Lb=16 + T, **kimi) == \
            verify_config("kda", 128, 128, T, GLUON, gpu=True, Lb=16 + T, **kimi)
        assert not verify_config("kda", 128, 128, T, TRITON, gpu=True, Lb=16 + T, **kimi)["gluon"]
        c = verify_config("kda", 128, 128, T, gpu=True, Lb=16 + T, **kimi)
        assert c["gluon"] and (c["BV"], c["num_warps"], c["maxnreg"]) == (64, 4, 128 if T > 4 else 0), (T, c)
        assert gluon_verify_unsupported("kda", 32, 32, 128, 128, T, 16, 16 + T, 64, 4) is None
    c = verify_config("kda", 32, 128, 2, GLUON, HV=4, Hk=2, window=16, Lb=18, gpu=True)
    assert c["gluon"] and (c["BV"], c["num_warps"]) == (32, 2), c
    assert verify_config("kda", 128, 128, 4, {"gluon": True, "BV": 16, "num_warps": 1}, gpu=True)["gluon"]
    # off a GPU, and where the Gluon layouts do not reach: the Triton kernel, as for GDN
    tri = verify_config("kda", 128, 128, 8, window=16, Lb=24, gpu=False)
    assert not tri["gluon"] and verify_config("kda", 128, 128, 8, GLUON, window=16, Lb=24, gpu=False) == tri
    assert verify_config("kda", 128, 128, 8, TRITON, gpu=True, **kimi) == tri
    assert not verify_config("kda", 128, 64, 4, GLUON, gpu=True)["gluon"]
    assert not verify_config("kda", 128, 128, 4, GLUON, window=40, gpu=True)["gluon"]
    assert "T=8 drafts above the window 4" in gluon_verify_unsupported("kda", 32, 32, 128, 128, 8, 4, 12, 64, 4)
    with pytest.raises(ValueError, match="gluon=1 must be a bool"):
        verify_config("kda", 128, 128, 4, {"gluon": 1}, gpu=True)


@pytest.mark.interpret
@pytest.mark.parametrize("l2norm", [True, False])
def test_gdn_verify_key_products_match_torch(l2norm):
    """`kq`'s first launch (utils/key_products.py, Triton: the interpreter runs it): per row and key
    head, the drafts' keys and queries normalised (and the queries scaled) as the kernel does, their
    Gram products, and the key records below the cursor dotted with both (unweighted); zeros past
    T, past the cursor (NaN records there) and for a padding row; slot-strided state as on
    contiguous. And the key is refused for KDA."""
    from replayssm.ops.utils.key_products import gdn_verify_key_products
    g = torch.Generator().manual_seed(9)
    N, Hk, K, T, Lb, BL, TP = 5, 2, 16, 3, 11, 16, 4
    keys = torch.randn(N, Lb * Hk * K + 3, generator=g)
    buf_k = keys[:, :Lb * Hk * K].view(N, Lb, Hk, K)
    curs = torch.zeros(N, 2, dtype=torch.int32)
    cursor = curs[:, 0]
    h = [0, 4, 9, 2, 7]
    cursor.copy_(torch.tensor(h, dtype=torch.int32))
    for s_, hs in enumerate(h):
        buf_k[s_, hs:] = float("nan")
    slot_ids = torch.tensor([2, -1, 0, 4, 1])
    Bt, scale = slot_ids.shape[0], 0.3
    q = torch.randn(Bt, T, Hk, K, generator=g)
    k = torch.randn(Bt, T, Hk, K, generator=g)
    dev = "cuda" if GPU else "cpu"
    out = gdn_verify_key_products(q.to(dev), k.to(dev), buf_k.to(dev), cursor.to(dev), slot_ids.to(dev), scale, l2norm,
                                  BL, TP, pad_k=3, pad_cur=1).cpu().reshape(Bt, Hk, -1)
    nk = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() if l2norm else k
    nq = (q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() if l2norm else q) * scale
    for b, s_ in enumerate(slot_ids.tolist()):
        want_G = torch.zeros(2, Hk, TP, TP)
        want_Z = torch.zeros(2, Hk, BL, TP)
        if s_ >= 0:
            want_G[0, :, :T, :T] = torch.einsum("tgk,rgk->gtr", nk[b], nk[b])
            want_G[1, :, :T, :T] = torch.einsum("tgk,rgk->gtr", nq[b], nk[b])
            hs = h[s_]
            want_Z[0, :, :hs, :T] = torch.einsum("jgk,tgk->gjt", buf_k[s_, :hs], nk[b])
            want_Z[1, :, :hs, :T] = torch.einsum("jgk,tgk->gjt", buf_k[s_, :hs], nq[b])
        got = out[b]
        G = got[:, :2 * TP * TP].reshape(Hk, 2, TP, TP).transpose(0, 1)
        Z = got[:, 2 * TP * TP:].reshape(Hk, 2, BL, TP).transpose(0, 1)
        assert torch.allclose(G, want_G, rtol=1e-4, atol=1e-5), (b, s_)
        assert torch.allclose(Z, want_Z, rtol=1e-4, atol=1e-5), (b, s_)
    with pytest.raises(ValueError, match="kq"):
        verify_config("kda", 128, 128, 4, {"kq": True}, gpu=True)
    with pytest.raises(ValueError, match="kq"):
        verify_config("gdn", 128, 128, 4, {"kq": 1}, gpu=True)


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_gluon_key_dispatch_off_gpu(family):
    # without a GPU (the interpreter) gluon=True runs the Triton kernel: the same bits as
    # gluon=False, over the op with its two extra arguments
    if GPU:
        pytest.skip("the interpreter's dispatch")
    runs = [_Run(family, HV=2, Hk=1, V=16, K=32, L=4, T=2, cursors=(3, 0), seed=5) for _ in range(2)]
    x = runs[0]._inputs(3, steps=2)
    ids = torch.tensor([runs[0].live[1], -1, runs[0].live[0]], dtype=torch.int32)
    nd = torch.tensor([2, 2, 1], dtype=torch.int32)
    outs = []
    for run, config in zip(runs, (GLUON, {"gluon": False, "maxnreg": 64})):
        st = run.st
        outs.append(run.ops.replay_verify(x["q"], x["k"], x["v"], x["a"], x["b"], run.A_log, run.dt_bias, None,
                                          st["ckpt"], st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"],
                                          st["pending"], st["epoch"], ids, 4, num_drafts=nd, config=config,
                                          arrive=run.arrive))
    assert torch.equal(outs[0], outs[1]) and bool(torch.isfinite(outs[0]).all())
    for n in runs[0].st:
        assert torch.equal(runs[0].st[n].view(torch.uint8), runs[1].st[n].view(torch.uint8)), n


# the offline compile, in a process without the interpreter switch: the kernel's pointer types,
# 16-byte alignment and divisibility hints as the JIT specialises them, sm_90a
_COMPILE = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from replayssm.ops.gdn import gluon_verify as m, gluon_verify_host as h
T, HV, Hk, L, rec, family = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:7]
fn = m._gluon_verify_kernel
ptr = dict({n: "*bf16" for n in ("q", "k", "v", "a", "b", "o")}, A_log="*fp32", dt_bias="*fp32", ckpt="*fp32",
           buf_ld="*fp32", buf_w="*" + rec, buf_k="*" + rec, cursor="*i32", pending="*i32", epoch="*i64",
           arrive="*i32", slot_ids="*i32", num_drafts="*i32", kq="*fp32")
nb = 4 if rec == "fp32" else 2
vals = h.gluon_verify_constexprs(T, HV, Hk, 128, 128, L, L + T, 64, 4, w_bytes=nb, k_bytes=nb, family=family,
                                 kq="kq" in sys.argv[7:], mma="mma" in sys.argv[7:], lean="lean" in sys.argv[7:])
sig, const = {}, {}
for i, n in enumerate(fn.arg_names):
    if n in ptr:
        sig[n] = ptr[n]
    elif n in vals:
        sig[n] = "constexpr"
        const[(i,)] = vals[n]
    else:
        sig[n] = "fp32" if n == "scale" else "i32"
# the slot paddings too: the launcher takes the Gluon kernel only where they divide by 16
hinted = ("window", "pad_ckpt", "pad_ld", "pad_w", "pad_k")
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
         if sig[n].startswith("*") or (sig[n] == "i32" and (n.startswith("stride") or n in hinted))}
k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, **({"maxnreg": 128} if T > 4 else {})))
assert k.asm["cubin"], "no cubin"
print("shared", k.metadata.shared)
"""


@pytest.mark.skipif(not HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("family, T, HV, Hk, L, rec, kb", [
    pytest.param("gdn", 1, 32, 16, 16, "bf16", 48, id="4b-T1"),
    # KDA's branches (the Gram loop, the weighted keys in shared memory, its flush writer)
    pytest.param("kda", 4, 32, 32, 16, "bf16", 56, id="kimi-kda-T4"),
    # more compiles of the same kernel: outside CI's representative subset
    pytest.param("gdn", 8, 64, 16, 16, "bf16", 48, id="122b-T8", marks=pytest.mark.slow),
    pytest.param("gdn", 4, 32, 16, 32, "fp32", 64, id="4b-T4-window32-fp32", marks=pytest.mark.slow),
    pytest.param("kda", 8, 32, 32, 16, "bf16", 56, id="kimi-kda-T8", marks=pytest.mark.slow),
    pytest.param("kda", 4, 32, 32, 32, "fp32", 80, id="kimi-kda-T4-window32-fp32", marks=pytest.mark.slow),
    # the key head's products loaded (`kq`)
    pytest.param("gdn-kq", 8, 32, 16, 16, "bf16", 48, id="4b-T8-kq", marks=pytest.mark.slow),
    # the tile's products on the tensor cores (`mma`): the swizzled tile, the staged raw keys
    # and queries (4 KB more); with `lean`, the drafts' own products there too
    pytest.param("gdn-mma", 8, 32, 16, 16, "bf16", 49, id="4b-T8-mma"),
    pytest.param("gdn-mma-lean", 8, 32, 16, 16, "bf16", 49, id="4b-T8-mma-lean")])
def test_gluon_verify_compiles_for_sm90(family, T, HV, Hk, L, rec, kb):
    # the Gluon kernel cannot run on the CPU: that it builds with this Triton (3.6 on the H200
    # machine, newer elsewhere: the shims of utils/gluon.py and _rows_view) is checked here
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    family, *extra = family.split("-")
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(T), str(HV), str(Hk), str(L), rec,
                        family, *extra], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("no CUDA toolchain bundled with this Triton")
    assert r.returncode == 0, r.stderr[-3000:]
    # shared memory: the 32 KB tile, the records (window 32, fp32: 24 KB), small buffers
    assert int(r.stdout.split()[-1]) <= kb * 1024, r.stdout


def test_truncation_split_is_exact():
    # utils.gluon_mma._split_bf16_rz's arithmetic on the CPU (the Gluon kernel cannot run here):
    # the leading 8 significant bits by masking, twice, leave a rest that bf16 holds exactly,
    # so the three pieces sum to x for normal fp32 values of every magnitude and sign
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 16, generator=g) * torch.exp2(torch.randint(-90, 90, (1 << 16,), generator=g).float())
    x = torch.cat([x, torch.tensor([1.0, -1.0, 3.0, 1.0 + 2.0 ** -23, -(2.0 - 2.0 ** -23)])])

    def trunc(v):
        return (v.view(torch.int32) & -65536).view(torch.float32)

    p0 = trunc(x)
    r = x - p0
    p1 = trunc(r)
    r2 = r - p1
    for p in (p0, p1, r2):
        assert torch.equal(p.to(torch.bfloat16).float(), p)                     # each piece is a bf16
    assert torch.equal(p0.double() + p1.double() + r2.double(), x.double())
    assert bool((r.abs() <= x.abs() * 2.0 ** -7).all()) and bool((r2.abs() <= x.abs() * 2.0 ** -15).all())
