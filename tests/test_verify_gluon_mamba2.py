"""The Mamba-2 Gluon verify kernel (`ops/mamba2/gluon_verify.py`, config key `gluon`) on the GPU:
many verify rounds mixed with decode steps against the float64 conventional recurrence (within
1.5x the fp32 conventional kernel's own error, `test_verify_mamba2._rounds`), one launch with
every kind of row against the Triton verify kernel (outputs, checkpoints, records, cursors),
padding rows, poisoned later drafts and NaN past the cursors, and CUDA-graph replay against eager
execution. Gluon kernels run on the GPU only; on the CPU the config's `gluon` key is checked,
and the interpreter runs the Triton kernels whatever it says.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from test_verify_mamba2 import KEYS, NAN, _bits, _check, _inputs, _layer, _pool, _rounds  # noqa: E402

from conftest import spy_launches  # noqa: E402

from replayssm.ops.mamba2 import replay_verify  # noqa: E402
from replayssm.ops.mamba2.gluon_verify import HAVE_GLUON, _tiles, gluon_verify_unsupported  # noqa: E402
from replayssm.ops.mamba2 import verify as verify_mod  # noqa: E402
from replayssm.ops.mamba2.verify import verify_config  # noqa: E402
from replayssm.ops.utils.commit import commit  # noqa: E402
from replayssm.testing import make_inputs  # noqa: E402
from replayssm.testing.mamba2_harness import model_shape  # noqa: E402

GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if GPU else "cpu")
gpu = pytest.mark.gpu
needs_gluon = pytest.mark.skipif(not (GPU and HAVE_GLUON), reason="needs a CUDA device and Triton's Gluon")

SUPER, NANO = model_shape("nemotron3-super"), model_shape("nemotron3-nano-4b")
TINY = dict(HV=4, Hk=2, V=32, K=128)      # the smallest shape the Gluon layouts take (K = 128)
GLUON = dict(gluon=True)


def _skip_if_fenced(shape, T, window, config):
    """Skip a case the dispatch fences off to the Triton kernel (T above the window: its GPU
    round test fails there), so that a lifted fence runs the case as written."""
    bv = config.get("BV", next(b for b in (64, 32, 16) if shape["V"] % b == 0))
    nw = config.get("num_warps", bv // 16)
    why = gluon_verify_unsupported(shape["HV"], shape["V"], shape["K"], shape["Hk"], T, window, window + T, bv, nw)
    if why and "Triton kernel" in why:
        pytest.skip(f"fenced: {why}")


# ---------------------------------------------------------------------------------------------
# CPU: the config key, the record tiles


def test_record_copies_cover_every_committed_position():
    # a commit after an early flush leaves the cursor at up to T, above a window below T: the
    # copies issued before the cursor is read (RECMASK off) cover max(window, T) positions
    # (they covered the window's alone, and window 3 with T = 8 folded records 3..7 as zeros)
    for window in (1, 2, 3, 5, 8, 16, 20, 32):
        for T in range(1, 9):
            t = _tiles(T, window, window + T, 1)
            assert t["NPOS"] == max(window, T) <= t["BL"], (window, T, t)
    assert _tiles(8, 3, 11, 4)["NPOS"] == 8 and _tiles(4, 16, 20, 4)["NPOS"] == 16


@pytest.mark.skipif(not HAVE_GLUON, reason="this Triton has no Gluon")
def test_verify_config_gluon_key(monkeypatch):
    S = (SUPER["HV"], SUPER["V"], SUPER["K"], SUPER["Hk"])
    N = (NANO["HV"], NANO["V"], NANO["K"], NANO["Hk"])
    # off the GPU (and in the interpreter) the default is the Triton kernels, as before
    assert verify_config(*S, 4)["gluon"] is False
    assert verify_config(*S, 4, device="cpu") == verify_config(*S, 4, config=dict(gluon=False))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert verify_config(*S, 4, device="cuda")["gluon"] is False
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # on CUDA: Gluon, a warp per 16 rows, the largest block of 64, 32, 16 dividing V
    # a draft count above the window: the Triton kernel (its Gluon round test failed)
    assert verify_config(*S, 8, device="cuda", window=4, Lb=12)["gluon"] is False
    with pytest.raises(ValueError, match="above the window"):
        verify_config(*S, 8, dict(gluon=True), device="cuda", window=4, Lb=12)
    for T in (1, 2, 4, 8):
        # at 8 drafts the tile's products on the tensor cores (measured faster there), with the
        # key products from the launch before
        mma = T == 8
        assert verify_config(*S, T, device="cuda") == dict(BV=64, num_warps=4, num_stages=1, gluon=True, kq=mma,
                                                           mma=mma)
        # Nano-4B's 60 programs a group: the key products' launch from 4 drafts on
        assert verify_config(*N, T, device="cuda") == dict(BV=16, num_warps=1, num_stages=1, gluon=True, kq=T >= 4,
                                                           mma=mma)
    assert not verify_config(*S, 8, dict(BV=32), device="cuda")["mma"]                # 32 rows: not measured
    monkeypatch.setattr(verify_mod, "GLUON_MMA_DEFAULT", False)
    assert not verify_config(*N, 8, device="cuda")["mma"] and not verify_config(*S, 8, device="cuda")["mma"]
    assert verify_config(*N, 8, dict(kq=False, mma=False), device="cuda")["kq"] is False
    assert verify_config(*N, 8, dict(mma=False), device="cuda")["mma"] is False
    assert verify_config(*N, 8, dict(gluon=True))["mma"] is False                      # not on the interpreter
    assert verify_config(*N, 8, dict(BV=64), device="cuda")["kq"] is False          # 24 programs a group
    assert verify_config(*S, 2, dict(num_warps=2), device="cuda")["BV"] == 32
    assert verify_config(*S, 2, dict(BV=32), device="cuda")["num_warps"] == 2
    # a window above 32 or K other than 128: the Triton kernels by default
    assert verify_config(*S, 4, device="cuda", window=40, Lb=44)["gluon"] is False
    assert verify_config(SUPER["HV"], 64, 64, 8, 4, device="cuda")["gluon"] is False
    # a launch pair the Gluon kernel does not take runs the Triton kernels with it (the old
    # variants), unless gluon=True asks for it
    assert verify_config(*S, 4, dict(BV=64, num_warps=2), device="cuda") == dict(BV=64, num_warps=2, num_stages=1,
                                                                                   gluon=False, kq=False, mma=False)
    with pytest.raises(ValueError, match="gluon=True"):
        verify_config(*S, 4, dict(BV=64, num_warps=2, gluon=True), device="cuda")
    with pytest.raises(ValueError, match="gluon=True"):
        verify_config(SUPER["HV"], 64, 64, 8, 4, dict(gluon=True))
    with pytest.raises(ValueError, match="gluon=True"):
        verify_config(*S, 4, dict(gluon=True), window=40, Lb=44)
    with pytest.raises(ValueError, match="gluon must be a bool"):
        verify_config(*S, 4, dict(gluon=1))
    with pytest.raises(ValueError, match="kq must be a bool"):
        verify_config(*S, 4, dict(kq=1))
    assert verify_config(*S, 4, dict(kq=True), device="cuda")["kq"] is True
    with pytest.raises(ValueError, match="BV"):
        verify_config(*S, 4, dict(BV=48), device="cuda")
    with pytest.raises(ValueError, match="unknown"):
        verify_config(*S, 4, dict(glu0n=True))
    # mma with gluon: the Gluon kernel's tile products on the tensor cores, kq on unless asked
    # off; mma alone stays the Triton tensor-core kernel
    assert verify_config(*S, 8, dict(gluon=True, mma=True), device="cuda") == dict(
        BV=64, num_warps=4, num_stages=1, gluon=True, kq=True, mma=True)
    assert verify_config(*S, 8, dict(gluon=True, mma=True, kq=False), device="cuda")["kq"] is False
    assert verify_config(*S, 8, dict(mma=True), device="cuda")["gluon"] is False
    # gluon=True asked for explicitly on the CPU is accepted (the interpreter runs Triton)
    assert verify_config(*S, 8, dict(gluon=True), device="cpu")["gluon"] is True
    assert gluon_verify_unsupported(*S, 9, 16, 25, 64, 4) and gluon_verify_unsupported(*S, 4, 16, 20, 64, 2)
    assert gluon_verify_unsupported(*S, 8, 32, 40, 64, 4) is None


@pytest.mark.interpret
@pytest.mark.skipif(GPU, reason="the CPU interpreter's dispatch")
@pytest.mark.parametrize("with_counts", [True, False])
def test_verify_key_products_match_torch(with_counts):
    """`kq`'s first launch (utils/key_products.py, Triton: the interpreter runs it): per row and
    group, the committed records below h' (the cursor, or 0 where `h + n > window`, the verify's
    early flush) and the drafts' keys dotted with the drafts' queries; zeros past h', past T and
    for a padding row, whatever the records past the cursor hold (NaN here), on slot-strided
    state as on contiguous."""
    from replayssm.ops.utils.key_products import verify_key_products
    g = torch.Generator().manual_seed(5)
    N, Hk, K, T, L = 6, 2, 16, 3, 8
    Lb, BL, TP, PD = L + T, 16, 4, 4
    # slot-strided records and cursors (as vLLM's pages): every slot's row padded by 5 elements
    keys = torch.randn(N, Lb * Hk * K + 5, generator=g)
    buf_k = keys[:, :Lb * Hk * K].view(N, Lb, Hk, K)
    curs = torch.zeros(N, 3, dtype=torch.int32)
    cursor = curs[:, 0]
    h = [0, 3, 7, 8, 5, 2]
    cursor.copy_(torch.tensor(h, dtype=torch.int32))
    for s_, hs in enumerate(h):
        buf_k[s_, hs:] = float("nan")
    slot_ids = torch.tensor([1, 3, -1, 2, 4, 0])
    counts = torch.tensor([3, 1, 2, 2, 9, 0], dtype=torch.int32)      # 9 and 0: clamped to T and 0
    Bt = slot_ids.shape[0]
    C = torch.randn(Bt, T, Hk, K, generator=g)
    B = torch.randn(Bt, T, Hk, K, generator=g)
    kq = verify_key_products(C.to(DEV), B.to(DEV), buf_k.to(DEV) if DEV.type == "cpu" else buf_k.to(DEV),
                             cursor.to(DEV), slot_ids.to(DEV), counts.to(DEV) if with_counts else None, L, BL, TP, PD,
                             pad_k=5, pad_cur=2)
    kq = kq.cpu().reshape(Bt, Hk, BL + PD, TP)
    for b, s_ in enumerate(slot_ids.tolist()):
        want = torch.zeros(Hk, BL + PD, TP)
        if s_ >= 0:
            n = min(max(int(counts[b]), 0), T) if with_counts else T
            hc = 0 if h[s_] + n > L else h[s_]
            want[:, :hc, :T] = torch.einsum("jgk,tgk->gjt", buf_k[s_, :hc], C[b])
            want[:, BL:BL + T, :T] = torch.einsum("rgk,tgk->grt", B[b], C[b])
        assert torch.allclose(kq[b], want, rtol=1e-5, atol=1e-5), (b, s_)


def test_interpreter_runs_triton_whatever_gluon_says():
    # gluon=True on the CPU: the Triton kernel runs, bit for bit the gluon=False result
    shape, L, T = dict(HV=2, Hk=1, V=16, K=128), 4, 2
    g = torch.Generator().manual_seed(7)
    p, (A, dt_bias, D), ref = _layer(shape, 7)
    pools = [_pool(shape, 2, L + T, torch.float32) for _ in range(2)]
    for pool in pools:
        pool["ckpt"].fill_(0.125)
        pool["cursor"][0] = 3
        pool["buf_ld"][0, :3], pool["buf_w"][0, :3], pool["buf_k"][0, :3] = -0.1, 0.5, 0.25
    inp = _inputs(p, shape, 2, T, g, False)
    sid = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    outs = []
    for pool, cfg in zip(pools, (dict(gluon=True, BV=16, num_warps=1), dict(gluon=False, BV=16, num_warps=1))):
        outs.append(replay_verify(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"], pool["ckpt"],
                                  pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"], pool["pending"],
                                  pool["epoch"], sid, L, config=cfg, arrive=pool["arrive"]))
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
    for k in pools[0]:
        assert torch.equal(_bits(pools[0][k]), _bits(pools[1][k])), k


# ---------------------------------------------------------------------------------------------
# GPU: rounds against the float64 reference


ROUND_CASES = [
    pytest.param(SUPER, T, GLUON, id=f"super-T{T}") for T in (1, 2, 4, 8)
] + [
    pytest.param(NANO, T, GLUON, id=f"nano4b-T{T}") for T in (1, 2, 4, 8)
] + [
    pytest.param(SUPER, 4, dict(gluon=True, BV=32, num_warps=2), id="super-BV32-T4"),
    pytest.param(SUPER, 8, dict(gluon=True, BV=32, num_warps=2), id="super-BV32-T8"),
    pytest.param(TINY, 2, GLUON, id="tiny-T2"),
    pytest.param(TINY, 8, dict(gluon=True, BV=16, num_warps=1), id="tiny-BV16-T8"),
    pytest.param(TINY, 3, GLUON, id="tiny-T3"),        # drafts padded to 4 lanes
    pytest.param(TINY, 6, GLUON, id="tiny-T6"),
    # the group's key products from the launch before (`kq`)
    pytest.param(SUPER, 8, dict(gluon=True, kq=True), id="super-kq-T8"),
    pytest.param(NANO, 4, dict(gluon=True, kq=True), id="nano4b-kq-T4"),
    pytest.param(NANO, 8, dict(gluon=True, kq=True), id="nano4b-kq-T8"),
    pytest.param(TINY, 3, dict(gluon=True, kq=True), id="tiny-kq-T3"),
    # the tile's products on the tensor cores (`mma`; kq with it unless off)
    pytest.param(SUPER, 8, dict(gluon=True, mma=True), id="super-mma-T8"),
    pytest.param(SUPER, 2, dict(gluon=True, mma=True), id="super-mma-T2"),
    pytest.param(NANO, 8, dict(gluon=True, mma=True), id="nano4b-mma-T8"),
    pytest.param(TINY, 3, dict(gluon=True, mma=True), id="tiny-mma-T3"),          # 8 MMA columns, 3 used
    pytest.param(SUPER, 8, dict(gluon=True, mma=True, kq=False), id="super-mma-nokq-T8"),
]


@gpu
@needs_gluon
@pytest.mark.parametrize("shape, T, config", ROUND_CASES)
def test_gluon_rounds(shape, T, config):
    # >= 32 verify rounds per row of random draft and accepted counts, every fourth step a
    # decode step, NaN past every cursor and past every row's count, a padding row, a spare slot.
    # At T = 1 no verify flushes here: every cursor moves by one a step and the decode's flush
    # at h = 15 comes first (the H200's T = 1 failures were this count, for any kernel; the
    # window-2 cases below flush at T = 1)
    _skip_if_fenced(shape, T, 16, config)
    res = _rounds(shape, window=16, T=T, rounds=48, n_slots=12, seed=T, config=config)
    assert res["verifies"] >= 32 and (res["flushes"] > 0 or T == 1), res
    _check(res)
    # bf16 records of bf16-valued inputs (exact copies), fewer slots
    res = _rounds(shape, window=16, T=T, rounds=16, n_slots=6, seed=T + 1, record_dtype=torch.bfloat16,
                  bf16_values=True, config=config)
    _check(res)


@gpu
@needs_gluon
@pytest.mark.parametrize("shape, T", [pytest.param(SUPER, 2, id="super-T2"), pytest.param(NANO, 8, id="nano4b-T8")])
def test_triton_rounds_with_gluon_off(shape, T):
    # the Triton kernels, no longer the default on the GPU, stay covered at real shapes
    res = _rounds(shape, window=16, T=T, rounds=40, n_slots=8, seed=T + 5, config=dict(gluon=False))
    assert res["verifies"] >= 30 and res["flushes"] > 0, res
    _check(res)


@gpu
@needs_gluon
@pytest.mark.parametrize("shape, window, T", [
    pytest.param(SUPER, 32, 8, id="super-L32"),          # record tiles of 32 positions
    pytest.param(NANO, 20, 4, id="nano4b-L20"),
    pytest.param(TINY, 5, 4, id="tiny-L5"),              # a flush at almost every verify
    pytest.param(SUPER, 2, 1, id="super-L2-T1"),         # one draft: a verify at h = 2 flushes
    pytest.param(NANO, 2, 1, id="nano4b-L2-T1"),
    # a window below T: most verifies flush, and commits leave cursors up to T above the window
    # (the decode steps need RECMASK there too: docs/state-layout.md says cursors stay <= L)
    pytest.param(TINY, 3, 8, id="tiny-L3-T8"),
])
def test_gluon_rounds_other_windows(shape, window, T):
    _skip_if_fenced(shape, T, window, GLUON)
    res = _rounds(shape, window=window, T=T, rounds=40, n_slots=6, seed=window + T, config=GLUON)
    assert res["verifies"] >= 30 and res["flushes"] >= 6, res
    _check(res)


# ---------------------------------------------------------------------------------------------
# GPU: one launch against the Triton kernel


def _every_kind_of_row(shape, L, T, record_dtype, seed):
    """A pool of 8 slots at cursors 0, 1, L - 1, L, L // 2, 2, 3 (T when T > L: as a commit after
    an early flush leaves it), 5 with random committed records
    (NaN past each cursor), random checkpoints and epochs, and a launch over 7 of them (slot 7
    left out) plus a padding row: draft counts that flush some rows and not others, one of 0 and
    one above T (both clamped on the device), inputs past each count NaN, a poisoned last draft."""
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    g = torch.Generator().manual_seed(seed)
    p, layer, ref = _layer(shape, seed)
    pool = _pool(shape, 8, L + T, record_dtype)
    cursors = [0, 1, L - 1, L, L // 2, 2, 3 if T <= L else T, 5]
    for s, h in enumerate(cursors):
        pool["ckpt"][s] = 0.1 * torch.randn(HV, V, K, generator=g).to(DEV)
        if h:
            rec = make_inputs(p, h, V, K, Hk, generator=g)
            pr = p.prepare(rec["x"], rec["dt"], rec["B"], rec["C"])
            pool["buf_ld"][s, :h] = pr["ld"].float().to(DEV)
            pool["buf_w"][s, :h] = pr["w"].to(record_dtype).to(DEV)
            pool["buf_k"][s, :h] = pr["k"].to(record_dtype).to(DEV)
        pool["cursor"][s] = h
        pool["epoch"][s] = 3 * s
    slots = [3, 0, -1, 2, 4, 1, 6, 5]
    nd = [T, 1, 2, max(1, T // 2), T, 0, T + 3, min(2, T)]
    Bt = len(slots)
    inp = _inputs(p, shape, Bt, T, g, False)
    for b in range(Bt):
        for k in KEYS:
            inp[k][b, max(0, min(nd[b], T)):] = NAN
    inp["x"][0, T - 1] = NAN                # row 0's last draft poisoned: earlier drafts must not see it
    return p, layer, pool, dict(slots=slots, nd=nd, cursors=cursors, inp=inp)


@gpu
@needs_gluon
@pytest.mark.parametrize("shape, T, config, record_dtype, L", [
    pytest.param(SUPER, 8, GLUON, torch.bfloat16, 16, id="super-T8-bf16"),
    pytest.param(SUPER, 2, dict(gluon=True, BV=32, num_warps=2), torch.float32, 16, id="super-BV32-T2-fp32"),
    pytest.param(NANO, 4, GLUON, torch.bfloat16, 16, id="nano4b-T4-bf16"),
    pytest.param(NANO, 2, GLUON, torch.float32, 16, id="nano4b-T2-fp32"),
    pytest.param(NANO, 1, GLUON, torch.float32, 16, id="nano4b-T1-fp32"),
    pytest.param(TINY, 5, GLUON, torch.float32, 16, id="tiny-T5-fp32"),
    pytest.param(TINY, 3, dict(gluon=True, BV=16, num_warps=1), torch.float16, 16, id="tiny-BV16-T3-fp16"),
    # window 3, T = 8: cursors 3 and 5 of the pool's rows, at and above the window (verify only)
    pytest.param(TINY, 8, GLUON, torch.float32, 3, id="tiny-L3-T8-fp32"),
    pytest.param(SUPER, 8, dict(gluon=True, kq=True), torch.bfloat16, 16, id="super-kq-T8-bf16"),
    pytest.param(NANO, 2, dict(gluon=True, kq=True), torch.float32, 16, id="nano4b-kq-T2-fp32"),
    pytest.param(SUPER, 8, dict(gluon=True, mma=True), torch.bfloat16, 16, id="super-mma-T8-bf16"),
    pytest.param(TINY, 5, dict(gluon=True, mma=True), torch.float32, 16, id="tiny-mma-T5-fp32"),
    pytest.param(NANO, 2, dict(gluon=True, mma=True), torch.float32, 16, id="nano4b-mma-T2-fp32"),
])
def test_gluon_matches_triton_one_launch(shape, T, config, record_dtype, L):
    _skip_if_fenced(shape, T, L, config)
    p, (A, dt_bias, D), pool, case = _every_kind_of_row(shape, L, T, record_dtype, seed=T)
    slots, nd, cursors, inp = case["slots"], case["nd"], case["cursors"], case["inp"]
    before = {k: v.clone() for k, v in pool.items()}
    sid = torch.tensor(slots, dtype=torch.int32, device=DEV)
    counts = torch.tensor(nd, dtype=torch.int32, device=DEV)
    res = {}
    for name, cfg in (("gluon", config), ("triton", dict(gluon=False))):
        st = {k: v.clone() for k, v in before.items()}
        out = torch.full((len(slots), T, shape["HV"], shape["V"]), NAN, device=DEV)
        replay_verify(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"], st["ckpt"], st["buf_ld"],
                      st["buf_w"], st["buf_k"], st["cursor"], st["pending"], st["epoch"], sid, L, num_drafts=counts,
                      out=out, config=cfg, arrive=st["arrive"])
        res[name] = (out, st)
    (yg, sg), (yt, s_t) = res["gluon"], res["triton"]
    torch.cuda.synchronize()
    assert (yg[2] == 0).all(), "padding row not zero"
    for b, s in enumerate(slots):
        if s < 0:
            continue
        n, h = max(0, min(nd[b], T)), cursors[s]
        flush = h + n > L
        h1 = 0 if flush else h
        assert (yg[b, n:] == 0).all(), f"row {b}: outputs past its {n} drafts not zero"
        m = n - 1 if b == 0 else n
        assert torch.isfinite(yg[b, :m]).all(), f"row {b}: a later draft or a stale record reached an output"
        if m:
            err = float((yg[b, :m].double() - yt[b, :m].double()).norm() / yt[b, :m].double().norm())
            assert err < 2e-6, f"row {b} (h={h}, n={n}): gluon vs triton outputs rel {err:.2e}"
        assert int(sg["cursor"][s]) == h1 and int(sg["pending"][s]) == n, f"slot {s}: cursor/pending"
        assert int(sg["epoch"][s]) == 3 * s + flush, f"slot {s}: epoch"
        if flush:
            e = float((sg["ckpt"][s].double() - s_t["ckpt"][s].double()).norm() / s_t["ckpt"][s].double().norm())
            assert e < 1e-6, f"slot {s}: flushed checkpoint vs triton rel {e:.2e}"
        else:
            assert torch.equal(sg["ckpt"][s], before["ckpt"][s]), f"slot {s}: checkpoint written without a flush"
            for k in ("buf_ld", "buf_w", "buf_k"):
                assert torch.equal(sg[k][s, :h], before[k][s, :h]), f"slot {s}: committed {k} changed"
        # the drafts' records at h1..h1+n-1 (x and B as given, ld as the Triton kernel's), nothing past
        for k in ("buf_w", "buf_k"):
            assert torch.equal(_bits(sg[k][s, h1:h1 + n]), _bits(s_t[k][s, h1:h1 + n])), f"slot {s}: draft {k}"
        torch.testing.assert_close(sg["buf_ld"][s, h1:h1 + n], s_t["buf_ld"][s, h1:h1 + n], rtol=1e-6, atol=0)
        for k in ("buf_ld", "buf_w", "buf_k"):
            tail = slice(max(h1 + n, h), None)
            assert torch.equal(sg[k][s, tail].isnan(), before[k][s, tail].isnan()), f"slot {s}: {k} past the drafts"
    for k in before:
        assert torch.equal(_bits(sg[k][7]), _bits(before[k][7])), f"{k} of the slot outside the batch"
    assert torch.equal(sg["cursor"], s_t["cursor"]) and torch.equal(sg["epoch"], s_t["epoch"])
    assert (sg["arrive"] == 0).all(), "arrival counters not re-armed"


# ---------------------------------------------------------------------------------------------
# GPU: CUDA-graph replay


@gpu
@needs_gluon
@pytest.mark.parametrize("shape, T, config", [pytest.param(SUPER, 4, GLUON, id="super-T4"),
                                              pytest.param(NANO, 8, GLUON, id="nano4b-T8"),
                                              pytest.param(NANO, 8, dict(gluon=True, kq=True), id="nano4b-kq-T8"),
                                              pytest.param(SUPER, 8, dict(gluon=True, mma=True), id="super-mma-T8")])
def test_gluon_cuda_graph_equals_eager(shape, T, config):
    # verify + commit, allocation-free and unvalidated, captured once and replayed over enough
    # steps that every row flushes; the replayed pool and outputs equal the eager ones bit for bit
    L, Bt = 16, 16
    g = torch.Generator().manual_seed(21)
    p, (A, dt_bias, D), _ = _layer(shape, 21)
    pools = [_pool(shape, Bt + 1, L + T, torch.bfloat16) for _ in range(3)]
    init = (0.1 * torch.randn(Bt + 1, shape["HV"], shape["V"], shape["K"], generator=g)).to(DEV)
    inp = {k: v.to(torch.bfloat16) for k, v in _inputs(p, shape, Bt, T, g, True).items()}
    sid = torch.randperm(Bt + 1, generator=g)[:Bt].to(torch.int32).to(DEV)
    sid[3] = -1
    nd = torch.randint(1, T + 1, (Bt,), generator=g, dtype=torch.int32).to(DEV)
    acc = torch.minimum(torch.randint(1, T + 1, (Bt,), generator=g, dtype=torch.int32).to(DEV), nd)
    outs = [torch.empty(Bt, T, shape["HV"], shape["V"], device=DEV, dtype=torch.bfloat16) for _ in pools]

    def step(pool, out):
        replay_verify(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"], pool["ckpt"], pool["buf_ld"],
                      pool["buf_w"], pool["buf_k"], pool["cursor"], pool["pending"], pool["epoch"], sid, L,
                      num_drafts=nd, out=out, config=config, arrive=pool["arrive"], validate=False)
        commit(pool["cursor"], pool["pending"], sid, acc)

    for pool in pools:
        pool["ckpt"].copy_(init)
        pool["buf_ld"].fill_(-0.05)
        pool["buf_w"].fill_(0.25)
        pool["buf_k"].fill_(0.125)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(pools[2], outs[2])                  # warm-up: compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(pools[0], outs[0])
    e0 = pools[0]["epoch"].clone()
    for _ in range(L + 2):
        graph.replay()
        step(pools[1], outs[1])
        torch.cuda.synchronize()
        assert torch.equal(_bits(outs[0]), _bits(outs[1]))
        for k in pools[0]:
            assert torch.equal(_bits(pools[0][k]), _bits(pools[1][k])), k
    live = sid[sid >= 0].long()
    assert int((pools[0]["epoch"][live] - e0[live]).min()) > 0, "some row never flushed"
    assert torch.isfinite(outs[0].float()).all()


# ---------------------------------------------------------------------------------------------
# GPU: REPLAYSSM_GLUON_VERIFY_KEYS_GLOBAL (the flush's keys from global memory, none staged)


@gpu
@needs_gluon
@pytest.mark.parametrize("shape, T", [pytest.param(SUPER, 8, id="super-T8"), pytest.param(NANO, 8, id="nano4b-T8"),
                                      pytest.param(TINY, 3, id="tiny-T3")])
def test_gluon_keys_global(shape, T, monkeypatch):
    from replayssm.ops.mamba2 import gluon_verify

    monkeypatch.setattr(gluon_verify, "KEYS_GLOBAL", True)
    config = dict(gluon=True, mma=True)
    cfg = verify_config(shape["HV"], shape["V"], shape["K"], shape["Hk"], T, config, device="cuda")
    assert cfg["mma"] and cfg["kq"], cfg                  # where KEYS_GLOBAL applies
    # rounds against the float64 reference (NaN past every cursor: the masked loads must not
    # carry it into the fold), then one launch of every kind of row against the Triton kernel
    test_gluon_rounds(shape, T, config)
    test_gluon_matches_triton_one_launch(shape, T, config, torch.bfloat16, 16)


@gpu
@needs_gluon
@pytest.mark.parametrize("shape, T, L", [pytest.param(SUPER, 8, 16, id="super-T8"),
                                         pytest.param(NANO, 8, 16, id="nano4b-T8"),
                                         pytest.param(SUPER, 8, 32, id="super-T8-L32"),   # two key tiles
                                         pytest.param(NANO, 4, 32, id="nano4b-T4-L32")])
def test_gluon_keys_global_equals_staged_bit_for_bit(shape, T, L, monkeypatch):
    # The fold's MMA takes the same keys whether staged or loaded: rounds of verify + commit on
    # two copies of a pool (committed records below each cursor, NaN past it), KEYS_GLOBAL off
    # on one and on on the other, outputs and every pool tensor equal bit for bit after each
    # round, rows flushing; and the switch asserted to have reached the kernel (KG) each time
    from replayssm.ops.mamba2 import gluon_verify

    seen = []
    spy_launches(monkeypatch, gluon_verify, "_gluon_verify_kernel", lambda kw: seen.append(kw["KG"]))
    config = dict(gluon=True, mma=True, kq=True)
    Bt = 12
    g = torch.Generator().manual_seed(33)
    p, (A, dt_bias, D), _ = _layer(shape, 33)
    pools = [_pool(shape, Bt, L + T, torch.bfloat16) for _ in range(2)]
    init = (0.1 * torch.randn(Bt, shape["HV"], shape["V"], shape["K"], generator=g)).to(DEV)
    cur = torch.randint(0, L, (Bt,), generator=g, dtype=torch.int32)
    ld, w, k = (-0.1 * torch.rand(Bt, L, shape["HV"], generator=g),
                torch.randn(Bt, L, shape["HV"], shape["V"], generator=g),
                torch.randn(Bt, L, shape["Hk"], shape["K"], generator=g))
    for pool in pools:
        pool["ckpt"].copy_(init)
        pool["cursor"].copy_(cur.to(DEV))
        for s_, h in enumerate(cur.tolist()):
            pool["buf_ld"][s_, :h] = ld[s_, :h].to(DEV)
            pool["buf_w"][s_, :h] = w[s_, :h].to(DEV, torch.bfloat16)
            pool["buf_k"][s_, :h] = k[s_, :h].to(DEV, torch.bfloat16)
    sid = torch.randperm(Bt, generator=g).to(torch.int32).to(DEV)
    e0 = pools[0]["epoch"].clone()
    for r in range(L + 2):
        inp = {k_: v.to(torch.bfloat16) for k_, v in _inputs(p, shape, Bt, T, g, True).items()}
        acc = torch.randint(1, T + 1, (Bt,), generator=g, dtype=torch.int32).to(DEV)
        outs = []
        for pool, on in zip(pools, (False, True)):
            monkeypatch.setattr(gluon_verify, "KEYS_GLOBAL", on)
            outs.append(replay_verify(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"], pool["ckpt"],
                                      pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"], pool["pending"],
                                      pool["epoch"], sid, L, config=config, arrive=pool["arrive"]))
            commit(pool["cursor"], pool["pending"], sid, acc)
        assert seen[-2:] == [False, True], seen[-2:]
        assert torch.isfinite(outs[0].float()).all()
        assert torch.equal(_bits(outs[0]), _bits(outs[1])), f"round {r}"
        for k_ in pools[0]:
            assert torch.equal(_bits(pools[0][k_]), _bits(pools[1][k_])), (r, k_)
    assert int((pools[0]["epoch"] - e0).min()) > 0, "some row never flushed"
