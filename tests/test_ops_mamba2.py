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
from torch._dynamo.backends.registry import lookup_backend  # noqa: E402

from replayssm.ops.mamba2 import SHAPES, compare_with_reference, conventional_decode, replay_decode  # noqa: E402
from replayssm.reference import Mamba2Params, replay  # noqa: E402
from replayssm.testing import make_inputs, make_params  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

FLOOR = 2e-8
SMALL = dict(HV=4, G=2, V=16, K=32)

# (shape, window, live slots, windows): at least 64 windows; rows staggered
ACCURACY_CASES = [
    pytest.param(SMALL, 4, 3, 64, id="small-L4"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16, 16, 64,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-super-L16"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-nano-4b"])), 16, 16, 64,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-nano-4b-L16"),
]


def _check_bookkeeping(r):
    assert r["cursor_ok"], "device cursors/epochs diverged from the host model"
    assert r["padding_zero"], "a padding row's output was not exactly 0"
    assert r["arrive_zero"], "arrival counters not reset to 0"


@pytest.mark.parametrize("shape, window, n_slots, windows", ACCURACY_CASES)
def test_replay_error_within_conventional(shape, window, n_slots, windows):
    r = compare_with_reference(shape["HV"], shape["G"], shape["V"], shape["K"], window=window,
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
    # window 2: every other step flushes, on tensor cores
    pytest.param(SMALL, 2, dict(flush="tf32x3", KS=1), id="L2-dot"),
    # V, K not powers of two (masked tiles, two V-blocks per head); rank-1 flush loop
    pytest.param(dict(HV=4, G=2, V=24, K=20), 5, dict(BV=16, flush="fma"), id="odd-L5-fma"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16, dict(flush="fma"),
                 marks=[pytest.mark.gpu, gpu], id="super-fma"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16, dict(flush="tf32x3", KS=1),
                 marks=[pytest.mark.gpu, gpu], id="super-tf32x3"),
    # window 32: record tiles of 32 positions, in the output and in the dot flush
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 32, dict(flush="tf32x3", KS=1),
                 marks=[pytest.mark.gpu, gpu], id="super-L32-tf32x3"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16,
                 dict(BV=16, num_warps=1, HPP=1, recmask=False, prefetch=False, flush="fma", KS=8),
                 marks=[pytest.mark.gpu, gpu], id="super-batch1-config"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16,
                 dict(BV=16, num_warps=2, HPP=1, recmask=False, prefetch=False, flush="fma", KS=4),
                 marks=[pytest.mark.gpu, gpu], id="super-batch8-config"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16,
                 dict(HPP=16, prefetch=True, flush="fma"),
                 marks=[pytest.mark.gpu, gpu], id="super-whole-group"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-nano-4b"])), 16, dict(BV=32),
                 marks=[pytest.mark.gpu, gpu], id="nano4b-BV32-masked"),
    # records summed inside each warp: [L, warps, rows] tiles, masked rows (V = 24, BV = 16)
    pytest.param(dict(HV=4, G=2, V=24, K=20), 5, dict(BV=16, num_warps=2, warpsum=True), id="warpsum-odd"),
    pytest.param(SMALL, 4, dict(BV=16, num_warps=4, warpsum=True, recmask=False), id="warpsum-unmasked"),
    # window 20: record tiles of 32 positions, summed the plain way even with warpsum
    pytest.param(dict(HV=4, G=2, V=24, K=20), 20, dict(BV=16, num_warps=2, warpsum=True), id="warpsum-L20"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16,
                 dict(BV=64, num_warps=4, HPP=1, KS=1, recmask=True, warpsum=True),
                 marks=[pytest.mark.gpu, gpu], id="super-warpsum"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16,
                 dict(BV=64, num_warps=4, HPP=1, KS=1, recmask=True, warpsum=True, flush="tf32x3"),
                 marks=[pytest.mark.gpu, gpu], id="super-warpsum-tf32x3"),
    # the Gluon kernel (GPU only): the tile copied to shared memory, folded there on a flush
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16, dict(BV=64, num_warps=4, HPP=1, KS=1, flush="fma", gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 5,
                 dict(BV=64, num_warps=4, HPP=1, KS=1, flush="fma", recmask=True, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon-L5"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16,
                 dict(BV=32, num_warps=2, HPP=1, KS=1, flush="fma", gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon-BV32"),
    # windows above 16: record tiles of 32 positions (the tables' configs of both shapes)
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 32,
                 dict(BV=64, num_warps=4, HPP=1, KS=1, flush="fma", recmask=False, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon-L32"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-nano-4b"])), 20,
                 dict(BV=16, num_warps=1, HPP=1, KS=1, flush="fma", rows=False, recmask=True, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="nano4b-gluon-L20"),
    # row blocks of [HV * V, K] spanning two heads (V = 24 is no multiple of 16)
    pytest.param(dict(HV=4, G=2, V=24, K=32), 4, dict(BV=16, rows=True, num_warps=2), id="rows-spanning"),
    pytest.param(dict(HV=4, G=2, V=24, K=32), 5, dict(BV=8, rows=True, recmask=False), id="rows-unmasked"),
    pytest.param(dict(HV=4, G=2, V=24, K=32), 4, dict(BV=16, rows=True, num_warps=2, warpsum=True),
                 id="rows-spanning-warpsum"),
    # the flush's fold in chunks of 4 rows (row-block and per-head kernels)
    pytest.param(dict(HV=4, G=2, V=24, K=32), 4, dict(BV=16, rows=True, num_warps=1, flushrows=4),
                 id="rows-flushrows4"),
    pytest.param(dict(HV=4, G=2, V=24, K=20), 5, dict(BV=16, num_warps=2, flushrows=4), id="flushrows4"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-nano-4b"])), 16,
                 dict(BV=32, rows=True, num_warps=1, HPP=1, prefetch=False, KS=1), marks=[pytest.mark.gpu, gpu],
                 id="nano4b-rows32"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-nano-4b"])), 16,
                 dict(BV=64, rows=True, num_warps=4, HPP=1, prefetch=False, KS=1, warpsum=True),
                 marks=[pytest.mark.gpu, gpu], id="nano4b-rows64-warpsum"),
]


def test_long_window_overrides_of_the_gluon_entries():
    # windows above 16 (32-position record tiles) cap the Gluon entries' registers per shape;
    # other entries, windows up to 16 and explicit keys are left as they are
    from replayssm.ops.mamba2.decode import REPLAY_CONFIGS, resolve_config

    def cfg(name, batch, window, config=None):
        HV, V, K, G = SHAPES[name]
        return resolve_config(REPLAY_CONFIGS, HV, V, K, G, config, with_flush=True, batch=batch, window=window)

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
    r = compare_with_reference(shape["HV"], shape["G"], shape["V"], shape["K"], window=window,
                               n_slots=3, windows=3, device=DEV, config=config,
                               conv_config=dict(BV=config.get("BV", 16)))
    print(r)
    _check_bookkeeping(r)
    for what in ("out", "ckpt"):
        rep, conv = r[f"{what}_replay"], r[f"{what}_conventional"]
        assert conv < 1e-5
        assert rep <= 1.5 * conv + FLOOR, f"{what}: replay {rep:.3e} vs conventional {conv:.3e}"


BF16_CASES = [
    pytest.param(SMALL, 4, 3, 8, id="small"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16, 16, 16,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-super"),
]


@pytest.mark.parametrize("shape, window, n_slots, windows", BF16_CASES)
def test_bf16_records(shape, window, n_slots, windows):
    """bf16 `w` and `k` records: their rounding enters the outputs and, at each flush, the
    checkpoint. Measured (CPU interpreter, which truncates instead of rounding to nearest):
    output and checkpoint relative errors about 2e-3 and 3e-3, against 1e-7 with fp32 records.
    Bound: a few bf16 roundings (2^-8 = 3.9e-3 each)."""
    r = compare_with_reference(shape["HV"], shape["G"], shape["V"], shape["K"], window=window,
                               n_slots=n_slots, windows=windows, device=DEV,
                               record_dtype=torch.bfloat16)
    print(r)
    _check_bookkeeping(r)
    assert r["out_replay"] < 1e-2 and r["ckpt_replay"] < 1e-2
    # the records were really rounded: far above the fp32 error, near bf16 precision
    assert r["out_replay"] > 1e-4 and r["ckpt_replay"] > 1e-4


BF16_INPUT_CASES = [
    pytest.param(SMALL, 4, 3, 64, None, id="small-L4"),
    pytest.param(SMALL, 3, 3, 64, dict(BV=8, rows=True), id="small-rows-L3"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16, 16, 64, None,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-super-L16"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-nano-4b"])), 16, 16, 64, None,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-nano-4b-L16"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16, 16, 64,
                 dict(gluon=False, flush="tf32x3", KS=1), marks=[pytest.mark.gpu, gpu],
                 id="super-triton-dot"),
]


@pytest.mark.parametrize("shape, window, n_slots, windows, config", BF16_INPUT_CASES)
def test_bf16_records_exact_on_bf16_inputs(shape, window, n_slots, windows, config):
    """The records keep `x` (and `B`) as given, not `dt x`: on inputs that are bf16 values (a
    bf16 model's activations, passed as fp32 here so that the outputs keep fp32 precision) bf16
    records are exact copies, and the replay kernel's errors stay within 1.5x the conventional
    fp32 kernel's, as with fp32 records. Records of `dt x` would round every buffered value:
    about 2e-3 (test_bf16_records)."""
    r = compare_with_reference(shape["HV"], shape["G"], shape["V"], shape["K"], window=window,
                               n_slots=n_slots, windows=windows, device=DEV, config=config,
                               record_dtype=torch.bfloat16, inputs_on=torch.bfloat16)
    print(r)
    _check_bookkeeping(r)
    for what in ("out", "ckpt"):
        rep, conv = r[f"{what}_replay"], r[f"{what}_conventional"]
        assert conv < 1e-5, f"conventional {what} error {conv}: the yardstick itself is broken"
        assert rep <= 1.5 * conv + FLOOR, f"{what}: replay {rep:.3e} vs conventional {conv:.3e}"


@pytest.mark.parametrize("cfg", [
    dict(BV=8, HPP=2, recmask=True, prefetch=True, flush="fma"),
    dict(BV=16, HPP=2, recmask=False, prefetch=False, flush="tf32x3"),
    dict(BV=8, HPP=1, recmask=False, prefetch=True, flush="fma"),
    dict(BV=16, HPP=2, recmask=True, prefetch=True, flush="fma", KS=4),
    dict(BV=8, HPP=1, recmask=False, prefetch=False, flush="fma", KS=2),
    dict(BV=16, num_warps=1, HPP=1, recmask=False, gluon=True),
], ids=["hpp2-prefetch", "hpp2-unmasked-dot", "hpp1-unmasked-prefetch", "k-slices-4-prefetch",
        "k-slices-2-unmasked", "gluon-key-runs-triton-here"])
def test_program_variants(cfg):
    """Several heads per program (shared group keys), the next head's tile prefetched, record
    loads issued before the cursor is known, both flush paths: each against the reference. A
    `gluon` entry runs the Triton kernel with its other keys where Gluon cannot run (the CPU
    interpreter; on a GPU, shapes other than K = 128)."""
    shape = dict(HV=4, G=2, V=16, K=32)
    r = compare_with_reference(shape["HV"], shape["G"], shape["V"], shape["K"], window=5,
                               n_slots=3, windows=4, device=DEV, config=cfg)
    _check_bookkeeping(r)
    assert r["out_replay"] <= 1.5 * r["out_conventional"] + 2e-8, (cfg, r)
    assert r["ckpt_replay"] <= 1.5 * r["ckpt_conventional"] + 2e-8, (cfg, r)


def test_timing_ablations_leave_out_what_they_say():
    """`ablate` (timing only): bit 0 drops the buffered records from the flush's fold (the
    flushed checkpoint changes, the outputs do not), bit 1 reads none for the outputs (they
    change)."""
    shape = dict(HV=4, G=2, V=16, K=32)
    N, Lb, L = 4, 5, 5
    used, start = [0, 1, 2], [2, 4, 3]                       # slot 1 flushes in this step
    res = {}
    for ablate in (0, 1, 2):
        p, (A, dt_bias, D), _, pool, _, g = _live_pool(shape, N, Lb, used, start, seed=11)
        for s, h in zip(used, start):
            for name in ("buf_ld", "buf_w", "buf_k"):
                pool[name][s, h:] = 0.0
        inp = {k: v.to(DEV) for k, v in make_inputs(p, 3, 16, 32, 2, generator=g, dtype=torch.float32).items()}
        out = replay_decode(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"], pool["ckpt"],
                            pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"], pool["epoch"],
                            torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV), L,
                            config=dict(BV=8, ablate=ablate))
        res[ablate] = (out, pool["ckpt"][1].clone())
    assert torch.equal(res[1][0], res[0][0]) and not torch.equal(res[1][1], res[0][1])
    assert not torch.equal(res[2][0], res[0][0])


# ----------------------------------------------------------------------------------------------
# Poison: every output written, nothing else touched, cursors advance as in the contract


def _pool(N, Lb, HV, V, K, G, fill):
    return dict(
        ckpt=torch.full((N, HV, V, K), fill, device=DEV),
        buf_ld=torch.full((N, Lb, HV), fill, device=DEV),
        buf_w=torch.full((N, Lb, HV, V), fill, device=DEV),
        buf_k=torch.full((N, Lb, G, K), fill, device=DEV),
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
    HV, G, V, K = shape["HV"], shape["G"], shape["V"], shape["K"]
    g = torch.Generator().manual_seed(seed)
    p = make_params("mamba2", HV, K, seed=seed)
    A, dt_bias, D = (t.float() for t in (p.A, p.dt_bias, p.D))
    ref = Mamba2Params(A=A.double(), dt_bias=dt_bias.double(), D=D.double())
    pool = _pool(N, Lb, HV, V, K, G, 1e30)
    S_ref = {}
    for s, h in zip(used, start):
        C0 = 0.1 * torch.randn(HV, V, K, generator=g)
        inp = make_inputs(p, h, V, K, G, generator=g)
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
    pytest.param(dict(HV=4, G=2, V=24, K=32), 4, dict(BV=16, rows=True), id="rows-spanning"),
    pytest.param(dict(HV=4, G=2, V=24, K=32), 4, dict(BV=16, num_warps=2, warpsum=True, recmask=False),
                 id="warpsum-unmasked"),
    pytest.param(dict(HV=4, G=2, V=24, K=32), 4, dict(BV=16, rows=True, num_warps=2, warpsum=True, recmask=False),
                 id="rows-warpsum-unmasked"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-nano-4b"])), 16, None,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-nano-4b"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 16, dict(BV=64, num_warps=4, HPP=1, KS=1, flush="fma", gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 20,
                 dict(BV=64, num_warps=4, HPP=1, KS=1, flush="fma", recmask=False, gluon=True),
                 marks=[pytest.mark.gpu, gpu], id="super-gluon-L20"),
]


@pytest.mark.parametrize("shape, L, config", POISON_CASES)
def test_poison_and_cursors(shape, L, config):
    HV, G, V, K = shape["HV"], shape["G"], shape["V"], shape["K"]
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
        inp = make_inputs(p, len(rows), V, K, G, generator=g, dtype=torch.float32)
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
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-nano-4b"])), None,
                 marks=[pytest.mark.gpu, gpu], id="nemotron3-nano-4b"),
]


@pytest.mark.parametrize("shape, config", EAGER_CASES)
def test_eager_step_folds_pending_records(shape, config):
    # Window 1 (the eager step) on slots that still hold records from a window of 4 (cursors
    # 0, 3, 2): the first step folds them and the token, every step flushes, no record is
    # written; unused slots (sentinels) and the padding row stay as they must.
    HV, G, V, K = shape["HV"], shape["G"], shape["V"], shape["K"]
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
        inp = make_inputs(p, len(rows), V, K, G, generator=g, dtype=torch.float32)
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


@pytest.mark.parametrize("shape, n_slots", [
    pytest.param(SMALL, 3, id="small"),
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), 8, marks=[pytest.mark.gpu, gpu],
                 id="nemotron3-super"),
])
def test_eager_step_error_within_conventional(shape, n_slots):
    # 64 windows of one step (window 1) on staggered slots: the eager step is the
    # conventional arithmetic, so its error is the conventional kernel's
    r = compare_with_reference(shape["HV"], shape["G"], shape["V"], shape["K"], window=1,
                               n_slots=n_slots, windows=64, device=DEV)
    _check_bookkeeping(r)
    assert r["flushes"] >= n_slots * 64
    for what in ("out", "ckpt"):
        rep, conv = r[f"{what}_replay"], r[f"{what}_conventional"]
        assert conv < 1e-5 and rep <= 1.5 * conv + FLOOR, (what, rep, conv)


@pytest.mark.parametrize("shape", [pytest.param(SMALL, id="small"), pytest.param(
    dict(zip("HV V K G".split(), SHAPES["nemotron3-super"])), marks=[pytest.mark.gpu, gpu],
    id="nemotron3-super")])
def test_conventional_poison(shape):
    HV, G, V, K = shape["HV"], shape["G"], shape["V"], shape["K"]
    p = make_params("mamba2", HV, K, seed=5)
    A, dt_bias, D = (t.float().to(DEV) for t in (p.A, p.dt_bias, p.D))
    ref = Mamba2Params(A=p.A.float().double(), dt_bias=p.dt_bias.float().double(), D=p.D.float().double())
    state = torch.full((5, HV, V, K), 1e30, device=DEV)
    state[[3, 1]] = 0.1 * torch.randn(2, HV, V, K, device=DEV)
    S0 = state.clone()
    inp = make_inputs(p, 3, V, K, G, dtype=torch.float32)
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
    pytest.param(dict(HV=4, G=2, V=24, K=32), 16, 2, id="spanning"),    # blocks across two heads
    pytest.param(dict(zip("HV V K G".split(), SHAPES["nemotron3-nano-4b"])), 64, 8,
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
    HV, G, V, K = shape["HV"], shape["G"], shape["V"], shape["K"]
    N, Lb = 5, 6
    used, start = [0, 1, 3], [0, 3, 2]
    p, (A, dt_bias, D), _, pool, _, g = _live_pool(shape, N, Lb, used, start, seed=7, sentinel_from=4)
    for s in used:                                     # no NaN: the fold reads positions < cursor
        for name in ("buf_ld", "buf_w", "buf_k"):
            pool[name][s, start[used.index(s)]:] = 0.0
    inp = {k: v.to(DEV) for k, v in make_inputs(p, 4, V, K, G, generator=g, dtype=torch.float32).items()}
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


@pytest.mark.parametrize("variant", ["no-D-no-z-strided", "bf16-inputs"])
def test_optional_inputs_and_dtypes(variant):
    """D and z absent (HAS_D / HAS_Z off) with token inputs that are strided views, as a fused
    projection hands them over; and bf16 token inputs (output in x's dtype)."""
    HV, G, V, K = SMALL["HV"], SMALL["G"], SMALL["V"], SMALL["K"]
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
               buf_k=torch.zeros(N, L, G, K, device=DEV),
               cursor=torch.zeros(N, dtype=torch.int32, device=DEV),
               epoch=torch.zeros(N, dtype=torch.int64, device=DEV))
    slot_ids = torch.tensor([2, 0, 1], device=DEV)
    for t in range(L + 1):
        inp = make_inputs(p, Bt, V, K, G, generator=g, gate=not bare, dtype=dtype)
        dinp = {k: v.to(DEV) for k, v in inp.items()}
        if bare:
            # views with a row stride larger than the row: x, B, C inside wider buffers
            wide = torch.zeros(Bt, HV, 2 * V, device=DEV)
            wide[..., :V] = dinp["x"]
            dinp["x"] = wide[..., :V]
            wide = torch.zeros(Bt, 2 * G, K, device=DEV)
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


# ----------------------------------------------------------------------------------------------
# The custom ops under torch.compile


def test_custom_ops_compile():
    HV, G, V, K = SMALL["HV"], SMALL["G"], SMALL["V"], SMALL["K"]
    L, N = 4, 3
    p = make_params("mamba2", HV, K, seed=7)
    A, dt_bias, D = (t.float().to(DEV) for t in (p.A, p.dt_bias, p.D))
    g = torch.Generator().manual_seed(7)
    pools = []
    for _ in range(2):
        pool = dict(ckpt=torch.zeros(N, HV, V, K), buf_ld=torch.zeros(N, L, HV),
                    buf_w=torch.zeros(N, L, HV, V), buf_k=torch.zeros(N, L, G, K),
                    cursor=torch.tensor([0, 3, 1], dtype=torch.int32),
                    epoch=torch.zeros(N, dtype=torch.int64), arrive=torch.zeros(N, dtype=torch.int32),
                    state=torch.zeros(N, HV, V, K))
        pools.append({k: v.to(DEV) for k, v in pool.items()})
    slot_ids = torch.tensor([2, -1, 0, 1], dtype=torch.int32, device=DEV)

    def step(inp, pool, out_r, out_c):
        replay_decode(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"],
                      pool["ckpt"], pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"],
                      pool["epoch"], slot_ids, L, out=out_r, arrive=pool["arrive"])
        # an eager step (window 1) on the same pool, output discarded
        replay_decode(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"],
                      pool["ckpt"], pool["buf_ld"], pool["buf_w"], pool["buf_k"], pool["cursor"],
                      pool["epoch"], slot_ids, 1, out=torch.empty_like(out_r), arrive=pool["arrive"],
                      validate=False)
        conventional_decode(inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"],
                            pool["state"], slot_ids, out=out_c, validate=False)
        return out_r * 2, out_c * 2

    seen = set()

    def backend(gm, example_inputs):
        # the custom ops must appear in the traced graph (not be run eagerly by the tracer);
        # then aot_eager functionalises them through their fake implementations
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for t in range(3):
        inp = {k: v.to(DEV) for k, v in make_inputs(p, 4, V, K, G, generator=g, dtype=torch.float32).items()}
        outs = [torch.empty(4, HV, V, device=DEV) for _ in range(4)]
        a = step(inp, pools[0], outs[0], outs[1])
        b = compiled(inp, pools[1], outs[2], outs[3])
        for u, v in zip(a + tuple(outs[:2]), b + tuple(outs[2:])):
            assert torch.equal(u, v)
        for k in pools[0]:
            assert torch.equal(pools[0][k], pools[1][k]), k
    assert {"replayssm.mamba2_replay_decode", "replayssm.mamba2_conventional_decode",
            "replayssm.mamba2_eager_decode"} <= seen, seen


def test_custom_op_registration():
    """Schema (declared mutations match the real ones) and fake-tensor implementations."""
    HV, G, V, K = SMALL["HV"], SMALL["G"], SMALL["V"], SMALL["K"]
    L, N, Bt = 4, 2, 3
    p = make_params("mamba2", HV, K, seed=8)
    A, dt_bias, D = (t.float().to(DEV) for t in (p.A, p.dt_bias, p.D))
    inp = {k: v.to(DEV) for k, v in make_inputs(p, Bt, V, K, G, dtype=torch.float32).items()}
    slot_ids = torch.tensor([1, -1, 0], dtype=torch.int32, device=DEV)
    tok = (inp["x"], inp["dt"], inp["B"], inp["C"], A, dt_bias, D, inp["z"])
    replay_args = tok + (torch.randn(N, HV, V, K, device=DEV), torch.zeros(N, L, HV, device=DEV),
                         torch.zeros(N, L, HV, V, device=DEV), torch.zeros(N, L, G, K, device=DEV),
                         torch.tensor([0, 3], dtype=torch.int32, device=DEV),
                         torch.zeros(N, dtype=torch.int64, device=DEV),
                         torch.zeros(N, dtype=torch.int32, device=DEV), slot_ids,
                         torch.empty(Bt, HV, V, device=DEV), L, 16, 4, 1, "tf32x3", 2, True, True, 1, 0, 1, False,
                         False, 16, 0, False)
    conv_args = tok + (torch.randn(N, HV, V, K, device=DEV), slot_ids,
                       torch.empty(Bt, HV, V, device=DEV), 16, 4, 1, True)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.replayssm.mamba2_replay_decode.default, replay_args, test_utils=tests)
    torch.library.opcheck(torch.ops.replayssm.mamba2_conventional_decode.default, conv_args, test_utils=tests)
    # the eager step (window 1): the replay state, the conventional launch config; cursor 3
    # makes it fold records and hand the cursor back
    eager_args = replay_args[:17] + (32, 2, 1, False)
    torch.library.opcheck(torch.ops.replayssm.mamba2_eager_decode.default, eager_args, test_utils=tests)


# ----------------------------------------------------------------------------------------------
# Validation at the Python boundary


def _valid_call_args():
    HV, G, V, K = SMALL["HV"], SMALL["G"], SMALL["V"], SMALL["K"]
    Bt, N, Lb = 3, 4, 6
    f = dict(device=DEV)
    return dict(
        x=torch.zeros(Bt, HV, V, **f), dt=torch.zeros(Bt, HV, **f), B=torch.zeros(Bt, G, K, **f),
        C=torch.zeros(Bt, G, K, **f), A=-torch.ones(HV, **f), dt_bias=torch.zeros(HV, **f),
        D=torch.zeros(HV, **f), z=torch.zeros(Bt, HV, V, **f),
        ckpt=torch.zeros(N, HV, V, K, **f), buf_ld=torch.zeros(N, Lb, HV, **f),
        buf_w=torch.zeros(N, Lb, HV, V, **f), buf_k=torch.zeros(N, Lb, G, K, **f),
        cursor=torch.zeros(N, dtype=torch.int32, **f), epoch=torch.zeros(N, dtype=torch.int64, **f),
        slot_ids=torch.tensor([0, -1, 2], **f), window=4,
    )


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEV)


# (argument replaced, new value, what the message must say after naming the argument)
REPLAY_ERRORS = [
    ("x", _t(3, 4 * 16), "expected"),
    ("x", _t(3, 4, 16, dtype=torch.float64), "dtype"),
    ("x", _t(3, 4, 32)[:, :, ::2], "contiguous"),
    ("dt", _t(3, 5), "shape"),
    ("B", _t(3, 3, 32), "groups do not divide"),
    ("B", _t(3, 2), "expected"),
    ("C", _t(3, 2, 16), "shape"),
    ("A", _t(5), "shape"),
    ("A", torch.zeros(4, device="meta"), "device"),
    ("dt_bias", _t(4, dtype=torch.int32), "dtype"),
    ("D", _t(4, 1), "shape"),
    ("z", _t(2, 4, 16), "shape"),
    ("ckpt", _t(4, 4, 16, 32, dtype=torch.bfloat16), "dtype"),
    ("ckpt", _t(4, 4, 32, 16), "shape"),
    ("ckpt", _t(4, 4, 32, 16).transpose(2, 3), "contiguous"),
    ("buf_ld", _t(4, 6, 4, dtype=torch.bfloat16), "dtype"),
    ("buf_ld", _t(4, 6), "expected"),
    ("buf_w", _t(4, 6, 4, 8), "shape"),
    ("buf_w", _t(4, 5, 4, 16), "shape"),
    ("buf_k", _t(4, 6, 4, 32), "shape"),
    ("buf_k", _t(4, 6, 2, 32, dtype=torch.float64), "dtype"),
    ("cursor", _t(4, dtype=torch.int64), "dtype"),
    ("epoch", _t(4, dtype=torch.int32), "dtype"),
    ("epoch", _t(3, dtype=torch.int64), "shape"),
    ("slot_ids", _t(3), "dtype"),
    ("slot_ids", _t(2, dtype=torch.int32), "shape"),
    ("slot_ids", torch.tensor([0, 4, -1], device=DEV), "out of range"),
    ("slot_ids", torch.tensor([2, -1, 2], device=DEV), "more than once"),
    ("window", 0, "int in"),
    ("window", 7, "int in"),
    ("window", 4.0, "int in"),
    ("window", True, "int in"),
    ("out", _t(3, 4, 16, dtype=torch.bfloat16), "dtype"),
    ("out", _t(3, 4, 8), "shape"),
    ("arrive", _t(4, dtype=torch.int64), "dtype"),
    ("config", dict(BV=12), "BV must be a power of two"),
    ("config", dict(BV=8, flush="tf32x3"), "BV=8 is below 16"),
    ("config", dict(HPP=3), "HPP=3 must divide"),
    ("config", dict(sync=5), "sync"),
    ("config", dict(num_warps=3), "num_warps"),
    ("config", dict(flush="tf32"), "flush"),
    ("config", dict(KS=3), "KS=3 must be a power of two"),
    ("config", dict(KS=2, flush="tf32x3"), "needs KS=1"),
    ("config", dict(block=16), "unknown"),
    ("config", dict(rows=True, BV=32), "rows=True needs BV=32 <= V=16"),
    ("config", dict(rows=True, BV=16, HPP=2), "rows=True takes HPP=1"),
    ("config", dict(warpsum=True, BV=2, num_warps=4), "warpsum=True needs"),
    ("config", dict(warpsum=True, KS=2), "warpsum=True needs"),
    ("config", dict(flushrows=3), "flushrows must be a power of two"),
    ("config", dict(ablate=4), "ablate must be 0, 1, 2 or 3"),
    ("config", dict(ablate=True), "ablate must be 0, 1, 2 or 3"),
    ("config", dict(ablate=1, rows=True, BV=16), "ablate applies to the per-head kernel"),
    ("config", dict(gluon=1), "gluon must be a bool"),
    ("config", dict(gluon=True, HPP=2), "gluon=True takes HPP=1"),
]


def _pattern(name, text):
    return rf"^{name}\b.*{text}"


@pytest.mark.parametrize("name, value, text", REPLAY_ERRORS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(REPLAY_ERRORS)])
def test_replay_validation(name, value, text):
    args = _valid_call_args()
    args[name] = value
    before = args["ckpt"].clone()
    with pytest.raises(ValueError, match=_pattern(name, text)):
        replay_decode(**args, check_slots_on_device=True)   # slot checks sync off the CPU
    assert torch.equal(args["ckpt"], before)


def test_replay_valid_args_pass():
    # the baseline of the cases above is itself valid (and runs)
    args = _valid_call_args()
    y = replay_decode(**args)
    assert (y[1] == 0).all() and args["cursor"].tolist() == [1, 0, 1, 0]


CONV_ERRORS = [
    ("state", _t(4, 4, 16, 32, dtype=torch.float16), "dtype"),
    ("state", _t(4, 4, 16), "expected"),
    ("state", _t(4, 2, 16, 32), "shape"),
    ("slot_ids", torch.tensor([1, 1, -1], device=DEV), "more than once"),
    ("slot_ids", torch.tensor([0, 9, -1], device=DEV), "out of range"),
    ("x", _t(3, 4, 16, dtype=torch.int32), "dtype"),
    ("out", _t(3, 4, 16, dtype=torch.float16), "dtype"),
    ("config", dict(flush="ieee"), "unknown"),
    ("config", dict(BV=64), "must divide"),
    ("config", dict(perhead=1), "perhead must be a bool"),
]


@pytest.mark.parametrize("name, value, text", CONV_ERRORS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CONV_ERRORS)])
def test_conventional_validation(name, value, text):
    a = _valid_call_args()
    args = {k: a[k] for k in ("x", "dt", "B", "C", "A", "dt_bias", "D", "z", "slot_ids")}
    args["state"] = a["ckpt"]
    args[name] = value
    with pytest.raises(ValueError, match=_pattern(name, text)):
        conventional_decode(**args, check_slots_on_device=True)
