"""Mamba-2 kernels (replayssm.ops.mamba2) on poisoned pools: every output written, nothing else
touched, cursors and epochs advancing as in the contract; the eager step folding pending
records; the conventional kernel's per-head path equal to its per-row path.

Without CUDA the kernels run under TRITON_INTERPRET=1 on the CPU at small shapes; tests marked
`gpu` repeat them at real model shapes and are skipped without CUDA.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from replayssm.ops.mamba2 import conventional_decode, replay_decode  # noqa: E402
from replayssm.reference import Mamba2Params, replay  # noqa: E402
from replayssm.testing import make_inputs, make_params  # noqa: E402
from replayssm.testing.mamba2_harness import SMALL, model_shape as _shape  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _pool(N, Lb, HV, V, K, Hk, fill):
    return dict(
        ckpt=torch.full((N, HV, V, K), fill, device=DEV),
        buf_ld=torch.full((N, Lb, HV), fill, device=DEV),
        buf_w=torch.full((N, Lb, HV, V), fill, device=DEV),
        buf_k=torch.full((N, Lb, Hk, K), fill, device=DEV),
        cursor=torch.full((N,), 12345, dtype=torch.int32, device=DEV),
        epoch=torch.full((N,), 777, dtype=torch.int64, device=DEV),
    )


def _reference_step(ref, S_ref, s, inp, i):
    """Advance slot s's float64 state `S_ref[s]` by row i of the token inputs `inp`; returns
    the reference output `[1, HV, V]`."""
    y_ref, S_new = ref.step(S_ref[s][None], *(inp[k][i:i + 1].double() for k in ("x", "dt", "B", "C", "z")))
    S_ref[s] = S_new[0]
    return y_ref


def _live_pool(shape, N, Lb, used, start, *, seed, sentinel_from=None):
    """A pool of sentinel-filled slots (`_pool`) whose slots `used` hold a random checkpoint
    and `start[i]` records each (positions past the cursor NaN: any read the kernel should not
    make carries into the outputs; from `sentinel_from` on, the sentinel again), epoch 10 * s.
    Returns the layer parameters, their fp32 copies on the device `(A, dt_bias, D)`, the
    float64 reference, the pool, each used slot's float64 state, and the generator."""
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    g = torch.Generator().manual_seed(seed)
    p = make_params("mamba2", HV, K, seed=seed)
    A, dt_bias, D = (t.float() for t in (p.A, p.dt_bias, p.D))
    ref = Mamba2Params(A=A.double(), dt_bias=dt_bias.double(), D=D.double())
    pool = _pool(N, Lb, HV, V, K, Hk, 1e30)
    S_ref = {}
    for s, h in zip(used, start):
        C0 = 0.1 * torch.randn(HV, V, K, generator=g)
        inp = make_inputs(p, h, V, K, Hk, generator=g)
        pr = p.prepare(inp["x"], inp["dt"], inp["B"], inp["C"])
        ld, w, k = pr["ld"].float(), pr["w"].float(), pr["k"].float()
        pool["ckpt"][s] = C0.to(DEV)
        for name, rec in (("buf_ld", ld), ("buf_w", w), ("buf_k", k)):
            pool[name][s] = float("nan")
            pool[name][s, :h] = rec.to(DEV)
            if sentinel_from is not None:
                pool[name][s, sentinel_from:] = 1e30
        pool["cursor"][s] = h
        pool["epoch"][s] = 10 * s
        # the buffer holds x; the values folded are dt x, dt = ld / A (the kernels' fp32 A)
        S_ref[s] = replay(C0.double(), ld.double(), ref.record_values(ld.double(), w.double()),
                          k.double())
    return p, tuple(t.to(DEV) for t in (A, dt_bias, D)), ref, pool, S_ref, g


POISON_CASES = [
    pytest.param(SMALL, 4, None, id="small"),
    pytest.param(dict(HV=4, Hk=2, V=24, K=32), 4, dict(BV=16, rows=True), id="rows-spanning"),
    pytest.param(dict(HV=4, Hk=2, V=24, K=32), 4, dict(BV=16, num_warps=2, warpsum=True, recmask=False),
                 id="warpsum-unmasked"),
    pytest.param(dict(HV=4, Hk=2, V=24, K=32), 4, dict(BV=16, rows=True, num_warps=2, warpsum=True, recmask=False),
                 id="rows-warpsum-unmasked"),
    pytest.param(_shape("nemotron3-nano-4b"), 16, None,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-nano-4b"),
    pytest.param(_shape("nemotron3-super"), 16, dict(BV=64, num_warps=4, KS=1, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon"),
    pytest.param(_shape("nemotron3-super"), 20,
                 dict(BV=64, num_warps=4, KS=1, recmask=False, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon-L20"),
]


@pytest.mark.parametrize("shape, L, config", POISON_CASES)
def test_poison_and_cursors(shape, L, config):
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    N, Lb = 6, L + 2
    used, start = [0, 1, 2], [0, L - 1, 2]     # slot 0 at cursor 0; slot 1 flushes on its first step
    # beyond the window the buffer is never touched in standard decode: a sentinel from L on
    p, (A, dt_bias, D), ref, pool, S_ref, g = _live_pool(shape, N, Lb, used, start, seed=3, sentinel_from=L)
    unused = [s for s in range(N) if s not in used]
    frozen = {name: t[unused].clone() for name, t in pool.items()}
    tail = {name: pool[name][used, L:].clone() for name in ("buf_ld", "buf_w", "buf_k")}

    h_model = dict(zip(used, start))
    e_model = {s: 10 * s for s in used}
    batches = [[1, -1, 0, 2], [2, 0, -1, 1], [-1, 1, 2, 0]]
    for t in range(2 * L + 1):
        rows = batches[t % len(batches)]
        slot_ids = torch.tensor(rows, dtype=torch.int64 if t % 2 else torch.int32, device=DEV)
        inp = make_inputs(p, len(rows), V, K, Hk, generator=g, dtype=torch.float32)
        dinp = {k: v.to(DEV) for k, v in inp.items()}
        out = torch.full((len(rows), HV, V), float("nan"), device=DEV)
        y = replay_decode(dinp["x"], dinp["dt"], dinp["B"], dinp["C"], A, dt_bias, D, dinp["z"],
                          pool["ckpt"], pool["buf_ld"], pool["buf_w"], pool["buf_k"],
                          pool["cursor"], pool["epoch"], slot_ids, L, out=out, config=config)
        assert y is out
        y = y.cpu()
        assert torch.isfinite(y).all(), f"step {t}: output left unwritten or poisoned"
        for i, s in enumerate(rows):
            if s < 0:
                assert (y[i] == 0).all(), f"step {t}: padding row {i} not zero"
                continue
            y_ref = _reference_step(ref, S_ref, s, inp, i)
            err = (y[i].double() - y_ref[0]).norm() / y_ref.norm()
            assert err < 1e-5, f"step {t}, slot {s} (cursor {h_model[s]}): rel err {err:.2e}"
            h = h_model[s]
            if h + 1 >= L:
                h_model[s], e_model[s] = 0, e_model[s] + 1
                err = (pool["ckpt"][s].cpu().double() - S_ref[s]).norm() / S_ref[s].norm()
                assert err < 1e-5, f"step {t}: checkpoint of slot {s} after flush, rel err {err:.2e}"
            else:
                h_model[s] = h + 1
                # the record was appended at position h: ld = dt*A, w = dt*x, and the group's B
                pr = p.prepare(*(inp[k][i:i + 1].double() for k in ("x", "dt", "B", "C")))
                torch.testing.assert_close(pool["buf_ld"][s, h].cpu().double(), pr["ld"][0], rtol=1e-5, atol=0)
                torch.testing.assert_close(pool["buf_w"][s, h].cpu().double(), pr["w"][0], rtol=1e-5, atol=1e-9)
                assert torch.equal(pool["buf_k"][s, h].cpu(), inp["B"][i])
        assert pool["cursor"][used].tolist() == [h_model[s] for s in used], f"step {t}"
        assert pool["epoch"][used].tolist() == [e_model[s] for s in used], f"step {t}"
    for name, t in pool.items():
        assert torch.equal(t[unused], frozen[name]), f"{name} of an unused slot changed"
    for name, t in tail.items():
        assert torch.equal(pool[name][used, L:], t), f"{name} beyond the window changed"


EAGER_CASES = [
    pytest.param(SMALL, None, id="small"),                       # programs of 32 rows: two heads
    pytest.param(SMALL, {"BV": 8, "num_warps": 1}, id="small-BV8"),
    pytest.param(_shape("nemotron3-nano-4b"), None,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-nano-4b"),
]


@pytest.mark.parametrize("shape, config", EAGER_CASES)
def test_eager_step_folds_pending_records(shape, config):
    # Window 1 (the eager step) on slots that still hold records from a window of 4 (cursors
    # 0, 3, 2): the first step folds them and the token, every step flushes, no record is
    # written; unused slots (sentinels) and the padding row stay as they must.
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    N, Lb = 5, 6
    used, start = [0, 1, 3], [0, 3, 2]
    p, (A, dt_bias, D), ref, pool, S_ref, g = _live_pool(shape, N, Lb, used, start, seed=5)
    unused = [s for s in range(N) if s not in used]
    frozen = {name: t[unused].clone() for name, t in pool.items()}
    records = {name: pool[name].clone() for name in ("buf_ld", "buf_w", "buf_k")}
    arrive = torch.zeros(N, dtype=torch.int32, device=DEV)
    batches = [[1, -1, 0, 3], [3, 0, -1, 1], [0, 1, 3, -1]]
    for t, rows in enumerate(batches):
        slot_ids = torch.tensor(rows, dtype=torch.int32, device=DEV)
        inp = make_inputs(p, len(rows), V, K, Hk, generator=g, dtype=torch.float32)
        dinp = {k: v.to(DEV) for k, v in inp.items()}
        out = torch.full((len(rows), HV, V), float("nan"), device=DEV)
        replay_decode(dinp["x"], dinp["dt"], dinp["B"], dinp["C"], A, dt_bias, D, dinp["z"],
                      pool["ckpt"], pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"],
                      pool["epoch"], slot_ids, 1, out=out, config=config, arrive=arrive)
        y = out.cpu()
        for i, s in enumerate(rows):
            if s < 0:
                assert (y[i] == 0).all(), f"step {t}: padding row not zero"
                continue
            y_ref = _reference_step(ref, S_ref, s, inp, i)
            err = (y[i].double() - y_ref[0]).norm() / y_ref.norm()
            assert err < 1e-5, f"step {t}, slot {s}: output rel err {err:.2e}"
            err = (pool["ckpt"][s].cpu().double() - S_ref[s]).norm() / S_ref[s].norm()
            assert err < 1e-5, f"step {t}, slot {s}: checkpoint rel err {err:.2e}"
        assert pool["cursor"][used].tolist() == [0, 0, 0], f"step {t}"
        assert pool["epoch"][used].tolist() == [10 * s + t + 1 for s in used], f"step {t}"
        assert (arrive == 0).all(), "arrival counters not re-armed"
    for name, t in pool.items():
        assert torch.equal(t[unused], frozen[name]), f"{name} of an unused slot changed"
    for name, t in records.items():
        assert torch.equal(pool[name].view(torch.uint8), t.view(torch.uint8)), f"the eager step wrote {name}"



@pytest.mark.parametrize("shape", [pytest.param(SMALL, id="small"), pytest.param(
    _shape("nemotron3-super"), marks=[pytest.mark.gpu, gpu],
    id="nemotron3-super")])
def test_conventional_poison(shape):
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    p = make_params("mamba2", HV, K, seed=5)
    A, dt_bias, D = (t.float().to(DEV) for t in (p.A, p.dt_bias, p.D))
    ref = Mamba2Params(A=p.A.float().double(), dt_bias=p.dt_bias.float().double(), D=p.D.float().double())
    state = torch.full((5, HV, V, K), 1e30, device=DEV)
    state[[3, 1]] = 0.1 * torch.randn(2, HV, V, K, device=DEV)
    S0 = state.clone()
    inp = make_inputs(p, 3, V, K, Hk, dtype=torch.float32)
    dinp = {k: v.to(DEV) for k, v in inp.items()}
    out = torch.full((3, HV, V), float("nan"), device=DEV)
    conventional_decode(dinp["x"], dinp["dt"], dinp["B"], dinp["C"], A, dt_bias, D, dinp["z"],
                        state, torch.tensor([3, -1, 1], device=DEV), out=out)
    y_ref, S_new = ref.step(S0[[3, 1]].cpu().double(), *(inp[k][[0, 2]].double() for k in ("x", "dt", "B", "C", "z")))
    assert (out[1] == 0).all()
    torch.testing.assert_close(out[[0, 2]].cpu().double(), y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[[3, 1]].cpu().double(), S_new, rtol=1e-5, atol=1e-6)
    assert torch.equal(state[[0, 2, 4]], S0[[0, 2, 4]])


@pytest.mark.parametrize("shape, BV, num_warps", [
    pytest.param(dict(HV=4, Hk=2, V=24, K=32), 16, 2, id="spanning"),    # blocks across two heads
    pytest.param(_shape("nemotron3-nano-4b"), 64, 8,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-nano-4b")])
def test_conventional_perhead_equals_per_row(shape, BV, num_warps):
    """perhead (dt, decay and D formed once per head, selected per row) computes the same
    arithmetic as the per-row path, for the conventional step and for the eager step folding
    pending records (FOLD): outputs and states equal bit for bit on the CPU interpreter, and
    within 1e-6 relative (some ulp) on the GPU, where the compiler may fuse (FMA contraction) or reorder
    floating-point operations differently in the two kernel variants. Cursors and epochs are
    equal exactly everywhere, and both paths leave the same entries NaN or untouched (the
    sentinel of unused slots), exactly."""
    from replayssm.ops.mamba2.conventional import _launch_conventional
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    N, Lb = 5, 6
    used, start = [0, 1, 3], [0, 3, 2]
    p, (A, dt_bias, D), _, pool, _, g = _live_pool(shape, N, Lb, used, start, seed=7, sentinel_from=4)
    for s in used:                                     # no NaN: the fold reads positions < cursor
        for name in ("buf_ld", "buf_w", "buf_k"):
            pool[name][s, start[used.index(s)]:] = 0.0
    inp = {k: v.to(DEV) for k, v in make_inputs(p, 4, V, K, Hk, generator=g, dtype=torch.float32).items()}
    slot_ids = torch.tensor([1, -1, 0, 3], dtype=torch.int32, device=DEV)
    tok = (inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"])
    res = {}
    for perhead in (False, True):
        for fold in (False, True):
            st = {k: v.clone() for k, v in pool.items()}
            out = torch.full((4, HV, V), float("nan"), device=DEV)
            arrive = torch.zeros(N, dtype=torch.int32, device=DEV)
            pending = (st["buf_ld"], st["buf_w"], st["buf_k"], st["cursor"], st["epoch"], arrive) if fold else None
            _launch_conventional(*tok, st["ckpt"], slot_ids, out, BV, num_warps, 1, perhead, pending=pending)
            res[perhead, fold] = (out, st["ckpt"], st["cursor"], st["epoch"])
    for fold in (False, True):
        for name, a, b in zip(("out", "ckpt", "cursor", "epoch"), res[False, fold], res[True, fold]):
            what = f"{name}, fold={fold}"
            if not a.is_floating_point() or not HAS_CUDA:
                # integers everywhere, and every tensor on the CPU interpreter: bit for bit
                assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{what}: not bit-exact"
                continue
            # entries neither path may change (NaN, the 1e30 sentinel of untouched slots)
            # sit at the same positions in both and are equal exactly
            odd_a, odd_b = ~a.isfinite() | (a.abs() >= 1e29), ~b.isfinite() | (b.abs() >= 1e29)
            assert torch.equal(odd_a, odd_b), (f"{what}: NaN/sentinel entries at different positions "
                                               f"({int((odd_a != odd_b).sum())} differ)")
            assert torch.equal(a[odd_a].nan_to_num(7.0), b[odd_b].nan_to_num(7.0)), \
                f"{what}: NaN/sentinel entries differ"
            a, b = a[~odd_a].double(), b[~odd_b].double()
            diff = (a - b).abs()
            scale = a.abs().max().item() if a.numel() else 0.0
            max_abs = diff.max().item() if a.numel() else 0.0
            max_rel = (diff / a.abs()).nan_to_num(0.0, posinf=float("inf")).max().item() if a.numel() else 0.0
            # 1e-6: some ulp of fp32 (6e-8), relative and at the scale of the tensor's written entries
            torch.testing.assert_close(
                b, a, rtol=1e-6, atol=1e-6 * scale,
                msg=lambda m: (f"{what}: perhead differs from the per-row path beyond 1e-6: "
                               f"max abs diff {max_abs:.3e}, max rel diff {max_rel:.3e} "
                               f"(max |per-row| {scale:.3e})\n{m}"))
    assert (res[True, True][2][used] == 0).all()              # the eager step flushed every row
