"""Mamba-2 Triton decode kernels (replayssm.ops.mamba2) against the float64 reference.

Without CUDA the kernels run under TRITON_INTERPRET=1 on the CPU at small shapes; tests marked
`gpu` repeat them at real model shapes and are skipped without CUDA.

Tolerances. The yardstick of the replay kernel is the conventional fp32 kernel's own error
on the same inputs, against the same float64 reference: the replay kernel must stay within
1.5x of it, plus an absolute floor of 2e-8 (a third of fp32's unit roundoff 6e-8): both errors
sit near 1e-7, a few roundings, and at that level their ratio is noise, not a property of
the kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from replayssm.ops.mamba2 import conventional_decode, replay_decode  # noqa: E402
from replayssm.reference import Mamba2Params  # noqa: E402
from replayssm.testing import make_inputs, make_params  # noqa: E402
from replayssm.testing.mamba2_harness import SMALL, compare_with_reference, model_shape as _shape  # noqa: E402
from conftest import ci_subset, interpreter_windows  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

FLOOR = 2e-8

ACCURACY_CASES = [
    # 64 windows (16 in CI's subset, about 30 s of interpreter: still 16 flushes a slot, as
    # test_ops_delta's GDN 64-window case there; the GPU cases run 64 at the real shapes)
    pytest.param(SMALL, 4, 3, interpreter_windows(64, 4), id="small-L4"),
    pytest.param(_shape("nemotron3-super"), 16, 16, 64,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-super-L16"),
    pytest.param(_shape("nemotron3-nano-4b"), 16, 16, 64,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-nano-4b-L16"),
]


def _check_bookkeeping(r):
    assert r["cursor_ok"], "device cursors/epochs diverged from the host model"
    assert r["padding_zero"], "a padding row's output was not exactly 0"
    assert r["arrive_zero"], "arrival counters not reset to 0"


@pytest.mark.parametrize("shape, window, n_slots, windows", ACCURACY_CASES)
def test_replay_error_within_conventional(shape, window, n_slots, windows):
    r = compare_with_reference(shape["HV"], shape["Hk"], shape["V"], shape["K"], window=window,
                               n_slots=n_slots, windows=windows, device=DEV)
    print(r)
    _check_bookkeeping(r)
    # every live slot flushes once per window after it joined
    assert r["flushes"] >= n_slots * windows
    for what in ("out", "ckpt"):
        rep, conv = r[f"{what}_replay"], r[f"{what}_conventional"]
        assert conv < 1e-5, f"conventional {what} error {conv}: the yardstick itself is broken"
        assert rep <= 1.5 * conv + FLOOR, f"{what}: replay {rep:.3e} vs conventional {conv:.3e}"


EDGE_CASES = [
    # V, K not powers of two (masked tiles, two V-blocks per head); rank-1 flush loop
    pytest.param(dict(HV=4, Hk=2, V=24, K=20), 5, dict(BV=16), id="odd-L5"),
    pytest.param(_shape("nemotron3-super"), 16, dict(),
                 marks=[pytest.mark.gpu, gpu], id="super-fma"),
    pytest.param(_shape("nemotron3-super"), 16,
                 dict(BV=16, num_warps=1, recmask=False, KS=8),
                 marks=[pytest.mark.gpu, gpu], id="super-batch1-config"),
    pytest.param(_shape("nemotron3-super"), 16,
                 dict(BV=16, num_warps=2, recmask=False, KS=4),
                 marks=[pytest.mark.gpu, gpu], id="super-batch8-config"),
    pytest.param(_shape("nemotron3-nano-4b"), 16, dict(BV=32),
                 marks=[pytest.mark.gpu, gpu], id="nano4b-BV32-masked"),
    # records summed inside each warp: [L, warps, rows] tiles, masked rows (V = 24, BV = 16)
    pytest.param(dict(HV=4, Hk=2, V=24, K=20), 5, dict(BV=16, num_warps=2, warpsum=True), id="warpsum-odd"),
    pytest.param(SMALL, 4, dict(BV=16, num_warps=4, warpsum=True, recmask=False), id="warpsum-unmasked"),
    # window 20: record tiles of 32 positions, summed the plain way even with warpsum
    pytest.param(dict(HV=4, Hk=2, V=24, K=20), 20, dict(BV=16, num_warps=2, warpsum=True), id="warpsum-L20"),
    pytest.param(_shape("nemotron3-super"), 16,
                 dict(BV=64, num_warps=4, KS=1, recmask=True, warpsum=True),
                 marks=[pytest.mark.gpu, gpu], id="super-warpsum"),
    # the Gluon kernel (GPU only): the tile copied to shared memory, folded there on a flush
    pytest.param(_shape("nemotron3-super"), 16, dict(BV=64, num_warps=4, KS=1, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon"),
    pytest.param(_shape("nemotron3-super"), 5,
                 dict(BV=64, num_warps=4, KS=1, recmask=True, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon-L5"),
    pytest.param(_shape("nemotron3-super"), 16,
                 dict(BV=32, num_warps=2, KS=1, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon-BV32"),
    # windows above 16: record tiles of 32 positions (the tables' configs of both shapes)
    pytest.param(_shape("nemotron3-super"), 32,
                 dict(BV=64, num_warps=4, KS=1, recmask=False, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon-L32"),
    pytest.param(_shape("nemotron3-nano-4b"), 20,
                 dict(BV=16, num_warps=1, KS=1, rows=False, recmask=True, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="nano4b-gluon-L20"),
    # the groups' key products formed by a launch before the Gluon kernel (config kq)
    pytest.param(_shape("nemotron3-super"), 16, dict(BV=64, num_warps=4, KS=1, gluon=True, kq=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon-kq"),
    pytest.param(_shape("nemotron3-nano-4b"), 16, dict(BV=16, num_warps=1, KS=1, gluon=True, kq=True),
                 marks=[pytest.mark.gpu, gpu], id="nano4b-gluon-kq"),
    pytest.param(_shape("nemotron3-nano-4b"), 20,
                 dict(BV=16, num_warps=1, KS=1, recmask=True, gluon=True, kq=True),
                 marks=[pytest.mark.gpu, gpu], id="nano4b-gluon-kq-L20"),
    # row blocks of [HV * V, K] spanning two heads (V = 24 is no multiple of 16)
    pytest.param(dict(HV=4, Hk=2, V=24, K=32), 4, dict(BV=16, rows=True, num_warps=2), id="rows-spanning"),
    pytest.param(dict(HV=4, Hk=2, V=24, K=32), 5, dict(BV=8, rows=True, recmask=False), id="rows-unmasked"),
    pytest.param(dict(HV=4, Hk=2, V=24, K=32), 4, dict(BV=16, rows=True, num_warps=2, warpsum=True),
                 id="rows-spanning-warpsum"),
    pytest.param(_shape("nemotron3-nano-4b"), 16,
                 dict(BV=32, rows=True, num_warps=1, KS=1), marks=[pytest.mark.gpu, gpu],
                 id="nano4b-rows32"),
    pytest.param(_shape("nemotron3-nano-4b"), 16,
                 dict(BV=64, rows=True, num_warps=4, KS=1, warpsum=True),
                 marks=[pytest.mark.gpu, gpu], id="nano4b-rows64-warpsum"),
]


def test_long_window_overrides_of_the_gluon_entries():
    # windows above 16 (32-position record tiles) cap the Gluon entries' registers per shape;
    # other entries, windows up to 16 and explicit keys are left as they are
    from replayssm.ops.mamba2.configs import REPLAY_CONFIGS, resolve_config

    def cfg(name, batch, window, config=None):
        s = _shape(name)
        return resolve_config(REPLAY_CONFIGS, s["HV"], s["V"], s["K"], s["Hk"], config, with_flush=True,
                              batch=batch, window=window)

    assert cfg("nemotron3-super", 256, 32)["maxnreg"] == 80
    assert cfg("nemotron3-nano-4b", 256, 32)["maxnreg"] == 128
    for name in ("nemotron3-super", "nemotron3-nano-4b"):
        assert cfg(name, 256, 32)["gluon"]
        assert cfg(name, 256, 16)["maxnreg"] == 0
        assert cfg(name, 256, None)["maxnreg"] == 0
        assert cfg(name, 2, 32)["maxnreg"] == 0 and not cfg(name, 2, 32)["gluon"]
        assert cfg(name, 256, 32, {"maxnreg": 0})["maxnreg"] == 0


@pytest.mark.parametrize("shape, window, config", EDGE_CASES)
def test_replay_edge_configs(shape, window, config):
    windows = 3
    if window > 16 and ci_subset() and not HAS_CUDA:
        # CI's subset: 2 windows of warpsum-L20 (about 0.8 s a step on the interpreter); every
        # slot still flushes twice through the 32-position record tiles
        windows = 2
    r = compare_with_reference(shape["HV"], shape["Hk"], shape["V"], shape["K"], window=window,
                               n_slots=3, windows=windows, device=DEV, config=config,
                               conv_config=dict(BV=config.get("BV", 16)))
    print(r)
    _check_bookkeeping(r)
    for what in ("out", "ckpt"):
        rep, conv = r[f"{what}_replay"], r[f"{what}_conventional"]
        assert conv < 1e-5
        assert rep <= 1.5 * conv + FLOOR, f"{what}: replay {rep:.3e} vs conventional {conv:.3e}"


BF16_CASES = [
    pytest.param(SMALL, 4, 3, 8, id="small"),
    pytest.param(_shape("nemotron3-super"), 16, 16, 16,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-super"),
]


@pytest.mark.parametrize("shape, window, n_slots, windows", BF16_CASES)
def test_bf16_records(shape, window, n_slots, windows):
    """bf16 `w` and `k` records: their rounding enters the outputs and, at each flush, the
    checkpoint. Measured (CPU interpreter, which truncates instead of rounding to nearest):
    output and checkpoint relative errors about 2e-3 and 3e-3, against 1e-7 with fp32 records.
    Bound: a few bf16 roundings (2^-8 = 3.9e-3 each)."""
    r = compare_with_reference(shape["HV"], shape["Hk"], shape["V"], shape["K"], window=window,
                               n_slots=n_slots, windows=windows, device=DEV,
                               record_dtype=torch.bfloat16)
    print(r)
    _check_bookkeeping(r)
    assert r["out_replay"] < 1e-2 and r["ckpt_replay"] < 1e-2
    # the records were really rounded: far above the fp32 error, near bf16 precision
    assert r["out_replay"] > 1e-4 and r["ckpt_replay"] > 1e-4


BF16_INPUT_CASES = [
    # 64 windows (16 in CI's subset, as ACCURACY_CASES' small-L4)
    pytest.param(SMALL, 4, 3, interpreter_windows(64, 4), None, id="small-L4"),
    # the row-block kernel over 64 windows (its poison and cursor cases run in CI)
    pytest.param(SMALL, 3, 3, 64, dict(BV=8, rows=True), marks=pytest.mark.slow, id="small-rows-L3"),
    pytest.param(_shape("nemotron3-super"), 16, 16, 64, None,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-super-L16"),
    pytest.param(_shape("nemotron3-nano-4b"), 16, 16, 64, None,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-nano-4b-L16"),
]


@pytest.mark.parametrize("shape, window, n_slots, windows, config", BF16_INPUT_CASES)
def test_bf16_records_exact_on_bf16_inputs(shape, window, n_slots, windows, config):
    """The records keep `x` (and `B`) as given, not `dt x`: on inputs that are bf16 values (a
    bf16 model's activations, passed as fp32 here so that the outputs keep fp32 precision) bf16
    records are exact copies, and the replay kernel's errors stay within 1.5x the conventional
    fp32 kernel's, as with fp32 records. Records of `dt x` would round every buffered value:
    about 2e-3 (test_bf16_records)."""
    r = compare_with_reference(shape["HV"], shape["Hk"], shape["V"], shape["K"], window=window,
                               n_slots=n_slots, windows=windows, device=DEV, config=config,
                               record_dtype=torch.bfloat16, inputs_on=torch.bfloat16)
    print(r)
    _check_bookkeeping(r)
    for what in ("out", "ckpt"):
        rep, conv = r[f"{what}_replay"], r[f"{what}_conventional"]
        assert conv < 1e-5, f"conventional {what} error {conv}: the yardstick itself is broken"
        assert rep <= 1.5 * conv + FLOOR, f"{what}: replay {rep:.3e} vs conventional {conv:.3e}"


@pytest.mark.parametrize("cfg", [
    dict(BV=16, recmask=True, KS=4),
    dict(BV=8, recmask=False, KS=2),
    dict(BV=16, num_warps=1, recmask=False, gluon=True),
    dict(BV=16, num_warps=1, recmask=False, gluon=True, kq=True),
], ids=["k-slices-4", "k-slices-2-unmasked", "gluon-key-runs-triton-here", "gluon-kq-runs-triton-here"])
def test_program_variants(cfg):
    """The checkpoint tile in K slices, record loads issued before the cursor is known: each
    against the reference. A
    `gluon` entry (and its `kq`) runs the Triton kernel with its other keys where Gluon cannot run
    (the CPU interpreter; on a GPU, shapes other than K = 128)."""
    shape = dict(HV=4, Hk=2, V=16, K=32)
    r = compare_with_reference(shape["HV"], shape["Hk"], shape["V"], shape["K"], window=5,
                               n_slots=3, windows=4, device=DEV, config=cfg)
    _check_bookkeeping(r)
    assert r["out_replay"] <= 1.5 * r["out_conventional"] + 2e-8, (cfg, r)
    assert r["ckpt_replay"] <= 1.5 * r["ckpt_conventional"] + 2e-8, (cfg, r)


@pytest.mark.parametrize("shape, n_slots", [
    pytest.param(SMALL, 3, id="small"),
    pytest.param(_shape("nemotron3-super"), 8, marks=[pytest.mark.gpu, gpu],
                 id="nemotron3-super"),
])
def test_eager_step_error_within_conventional(shape, n_slots):
    # 64 windows of one step (window 1) on staggered slots: the eager step is the
    # conventional arithmetic, so its error is the conventional kernel's
    r = compare_with_reference(shape["HV"], shape["Hk"], shape["V"], shape["K"], window=1,
                               n_slots=n_slots, windows=64, device=DEV)
    _check_bookkeeping(r)
    assert r["flushes"] >= n_slots * 64
    for what in ("out", "ckpt"):
        rep, conv = r[f"{what}_replay"], r[f"{what}_conventional"]
        assert conv < 1e-5 and rep <= 1.5 * conv + FLOOR, (what, rep, conv)


@pytest.mark.parametrize("variant", ["no-D-no-z-strided", "bf16-inputs"])
def test_optional_inputs_and_dtypes(variant):
    """D and z absent (HAS_D / HAS_Z off) with token inputs that are strided views, as a fused
    projection hands them over; and bf16 token inputs (output in x's dtype)."""
    HV, Hk, V, K = SMALL["HV"], SMALL["Hk"], SMALL["V"], SMALL["K"]
    L, N, Bt = 4, 3, 3
    bare = variant.startswith("no-D")
    dtype = torch.float32 if bare else torch.bfloat16
    p = make_params("mamba2", HV, K, seed=11, with_D=not bare)
    A, dt_bias = p.A.float().to(DEV), p.dt_bias.float().to(DEV)
    D = None if bare else p.D.float().to(DEV)
    ref = Mamba2Params(A=p.A.float().double(), dt_bias=p.dt_bias.float().double(),
                       D=None if bare else p.D.float().double())
    g = torch.Generator().manual_seed(11)
    S0 = 0.1 * torch.randn(N, HV, V, K, generator=g)
    ckpt, state, S_ref = S0.clone().to(DEV), S0.clone().to(DEV), S0.double()
    buf = dict(buf_ld=torch.zeros(N, L, HV, device=DEV), buf_w=torch.zeros(N, L, HV, V, device=DEV),
               buf_k=torch.zeros(N, L, Hk, K, device=DEV),
               cursor=torch.zeros(N, dtype=torch.int32, device=DEV),
               epoch=torch.zeros(N, dtype=torch.int64, device=DEV))
    slot_ids = torch.tensor([2, 0, 1], device=DEV)
    for t in range(L + 1):
        inp = make_inputs(p, Bt, V, K, Hk, generator=g, gate=not bare, dtype=dtype)
        dinp = {k: v.to(DEV) for k, v in inp.items()}
        if bare:
            # views with a row stride larger than the row: x, B, C inside wider buffers
            wide = torch.zeros(Bt, HV, 2 * V, device=DEV)
            wide[..., :V] = dinp["x"]
            dinp["x"] = wide[..., :V]
            wide = torch.zeros(Bt, 2 * Hk, K, device=DEV)
            wide[:, ::2] = dinp["B"]
            dinp["B"] = wide[:, ::2]
            assert not dinp["x"].is_contiguous() and not dinp["B"].is_contiguous()
        args = (dinp["x"], dinp["dt"], dinp["B"], dinp["C"], A, dt_bias, D, dinp.get("z"))
        y_rep = replay_decode(*args, ckpt, buf["buf_ld"], buf["buf_w"], buf["buf_k"], buf["cursor"],
                              buf["epoch"], slot_ids, L)
        y_conv = conventional_decode(*args, state, slot_ids)
        assert y_rep.dtype == dtype and y_conv.dtype == dtype
        sl = slot_ids.tolist()
        y_ref, S_new = ref.step(S_ref[sl], *(inp[k].double() if k in inp else None
                                             for k in ("x", "dt", "B", "C", "z")))
        S_ref[sl] = S_new
        tol = 1e-5 if dtype == torch.float32 else 1e-2      # bf16 output: 2^-8 rounding
        for y in (y_rep, y_conv):
            err = (y.cpu().double() - y_ref).norm() / y_ref.norm()
            assert err < tol, f"step {t}: rel err {err:.2e}"
    assert buf["epoch"].tolist() == [1, 1, 1] and buf["cursor"].tolist() == [1, 1, 1]


@pytest.mark.gpu
@gpu
def test_gluon_kq_captured_without_warmup_equals_eager():
    """Config `kq` (the groups' key products formed by a launch before the Gluon kernel) in a
    CUDA graph captured at a batch size never run before, so that the products' scratch is
    allocated inside the capture, as under vLLM, which warms up no size before capturing it
    (the kernels themselves compiled at another batch size first). Replayed over more than a
    window with staggered cursors: outputs and checkpoints equal the eager steps without `kq`
    to rounding (the products are summed in another order; the folds are the same), cursors,
    epochs and records exactly."""
    from replayssm.ops.mamba2.gluon_decode import HAVE_GLUON
    if not HAVE_GLUON:
        pytest.skip("needs Triton's Gluon")
    sh = _shape("nemotron3-nano-4b")
    HV, Hk, V, K = sh["HV"], sh["Hk"], sh["V"], sh["K"]
    L, N, Bt = 16, 24, 19
    p = make_params("mamba2", HV, K, seed=5)
    A, dt_bias, D = (t.float().to(DEV) for t in (p.A, p.dt_bias, p.D))
    g = torch.Generator().manual_seed(5)
    init = dict(ckpt=0.1 * torch.randn(N, HV, V, K, generator=g), buf_ld=-0.05 * torch.rand(N, L, HV, generator=g),
                buf_w=torch.randn(N, L, HV, V, generator=g).to(torch.bfloat16),
                buf_k=torch.randn(N, L, Hk, K, generator=g).to(torch.bfloat16),
                cursor=torch.randint(0, L, (N,), generator=g, dtype=torch.int32),
                epoch=torch.zeros(N, dtype=torch.int64), arrive=torch.zeros(N, dtype=torch.int32))
    states = [{k: v.to(DEV) for k, v in init.items()} for _ in range(3)]
    inp = {k: v.to(DEV, torch.bfloat16) for k, v in make_inputs(p, Bt, V, K, Hk, generator=g).items()}
    sid = torch.randperm(N, generator=g)[:Bt].to(torch.int32).to(DEV)
    sid[4] = -1
    outs = [torch.empty(Bt, HV, V, device=DEV, dtype=torch.bfloat16) for _ in range(2)]

    def step(st, out, kq, rows=Bt):
        replay_decode(**{k: v[:rows] for k, v in inp.items()}, A=A, dt_bias=dt_bias, D=D,
                      **{k: st[k] for k in ("ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "epoch")},
                      slot_ids=sid[:rows], window=L, out=out[:rows],
                      # small batches default to row programs, which the Gluon kernel does not take
                      config=dict(gluon=True, kq=kq, rows=False, KS=1),
                      arrive=st["arrive"], validate=False)

    step(states[2], outs[1], True, rows=3)       # compiles both launches (the batch is no constexpr)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(states[0], outs[0], True)
    e0 = states[0]["epoch"].clone()
    for _ in range(L + 2):
        graph.replay()
        step(states[1], outs[1], False)
        torch.cuda.synchronize()
        assert torch.allclose(outs[0].float(), outs[1].float(), rtol=1e-2, atol=1e-3)   # bf16 outputs
        # a flush folds the same records with the same weights either way
        assert torch.allclose(states[0]["ckpt"], states[1]["ckpt"], rtol=1e-6, atol=1e-7)
        for k in ("cursor", "epoch", "buf_ld", "buf_w", "buf_k", "arrive"):
            assert torch.equal(states[0][k], states[1][k]), k
    live = sid[sid >= 0].long()
    assert int((states[0]["epoch"][live] - e0[live]).min()) > 0, "some row never flushed"
    assert torch.isfinite(outs[0].float()).all()
