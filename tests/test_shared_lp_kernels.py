"""The shared low-precision checkpoint on the precision decode kernels (issue 18's comparison
design; ops/<family>/precision.py with `ckpt_lp=None`): one checkpoint in fp16, bf16, fp8-e4m3
or NVFP4, read by every step and rewritten at every flush with round-to-nearest or seeded
stochastic rounding (`SlotPool(hp_format=LP, hp_rounding=..., lp_format=None)`).

What is exact and what is not, and why:
* a flush writes `formats.encode(S, fmt, rounding, seed=pool.stream_seed, stream=slot * 2**32 +
  epoch)` of the kernel's own fp32 fold `S`, bit for bit. The fold is observed by running the
  same kernel on a copy of the step's state whose checkpoint is the decoded one in fp32 (the
  `hp_format="fp32"` shared launch: the same arithmetic with no rounding at the end), so every
  checkpoint byte, record and output of the kernel pool is checked for equality, every step, on
  the interpreter; compiled, that observer is other machine code, whose fold can differ in the
  last bit, so the GPU test bounds the codes that differ;
* against the reference pool (re-synchronised to the kernel pool's state before each step, so
  that each step is compared from the same state): outputs within fp32 rounding, and the
  checkpoint's codes equal except where the two folds' fp32 values (einsums against rank-1
  updates: another order) fall on either side of a rounding boundary or, stochastic, of the
  shared uniform: a few elements, by one unit of the format at the row's magnitude.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

from replayssm import SlotPool, formats
from replayssm.pool import backends
from replayssm.pool.layout import Layout
from replayssm.ops.utils.lowp import _f32_scale, lp_views
from replayssm.ops.utils.sround import seed_key, store_nvfp4_rows
from replayssm.testing import make_inputs, make_params

from conftest import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = DEV == "cpu"          # the interpreter: every sum in program order
FORMATS = ["fp16", "bf16", "fp8_e4m3", "nvfp4"]
ROUNDINGS = ["nearest", "stochastic"]
# small and odd shapes (HV, Hk, V, K): V not a power of two, K = 48 padded to 64 (NVFP4: a
# padded block of 16)
SHAPES = {"mamba2": (4, 2, 12, 48), "gdn": (4, 1, 12, 32), "kda": (4, 2, 20, 16)}
# the format's relative spacing at a row's top magnitude (NVFP4: e2m1's, under its block scale)
UNIT = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7, "fp8_e4m3": 2.0 ** -3, "nvfp4": 2.0 ** -1}
N, L = 3, 4


def _bits(parts: dict) -> dict:
    return {k: v.view(torch.uint8) for k, v in parts.items()}


def _slot(parts: dict, s: int) -> dict:
    return {k: v[s:s + 1] for k, v in parts.items()}


def _parts_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(x, y) for x, y in zip(_bits(a).values(), _bits(b).values()))


# ----------------------------------------------------------------------------------------------
# NVFP4 rows under a known tensor scale, alone


@triton.jit
def _nvfp4_rows_kernel(x, ts_out, d, s, stream, key, HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                       BV: tl.constexpr, BK: tl.constexpr, SR: tl.constexpr):
    i_m = tl.program_id(0)
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_v = o_v < V
    b = tl.load(x + i_m * V * K + o_v[:, None] * K + o_k[None, :], mask=m_v[:, None] & (o_k < K)[None, :],
                other=0.)
    # the tensor scale as the kernels take it (lowp.store_nvfp4_head's rule)
    ts = _f32_scale(tl.max(tl.max(tl.abs(b), axis=1), axis=0), 2688.0)
    tl.store(ts_out + i_m, ts)
    store_nvfp4_rows(b, ts, d, s, i_m, i_m % HV, o_v, m_v, o_k, key, tl.load(stream + i_m // HV), V, K, BK, BV,
                     SR)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_nvfp4_rows_bit_exact(rounding):
    """Random magnitudes over 2**+-12 per row, zeros, signed zeros, a zero block, a zero matrix,
    K = 48 (a padded block): `store_nvfp4_rows` under the matrix's tensor scale is
    `formats.encode(x, "nvfp4", rounding, seed=, stream=)` bit for bit, for two seeds."""
    g = torch.Generator().manual_seed(3)
    n, HV, V, K = 2, 3, 12, 48
    x = torch.randn(n, HV, V, K, generator=g) * torch.exp(4 * torch.randn(n, HV, V, 1, generator=g))
    x[0, 0, 0, :5] = -0.0
    x[0, 1, 2, 16:32] = 0
    x[1, 2] = 0
    x = x.to(DEV)
    stream = torch.tensor([7, 5 * 2 ** 32 + 3], device=DEV)
    for seed in (0, 2 ** 63 + 12345):
        parts = formats.allocate("nvfp4", x.shape, DEV)
        d, s, t = lp_views(parts, "nvfp4", n, HV, V, K)
        _nvfp4_rows_kernel[(n * HV,)](x, t, d, s, stream, seed_key(seed), HV=HV, V=V, K=K, BV=16, BK=64,
                                      SR=rounding == "stochastic")
        want = formats.encode(x, "nvfp4", rounding, seed=seed, stream=stream)
        assert _parts_equal(parts, want), (rounding, seed)


def test_nvfp4_rows_stochastic_unbiased():
    """One value 3/8 of the way between the e2m1 grid points 1 and 1.5 (units of its block
    scale) in every element of a [2, 1, 64, 512] tensor (distinct uniforms): the fraction rounded
    up is 3/8 within 5 standard errors, and nothing lands off the two neighbours."""
    n, HV, V, K = 2, 1, 64, 512
    f = 0.375
    x = torch.full((n, HV, V, K), 1.0 + 0.5 * f, device=DEV)
    x[..., ::16] = 6.0           # every block's amax maps to 6: block scale 1 under the tensor scale
    x[0, 0, 0, 0] = 2688.0       # the matrix amax 6 * 448: tensor scale 1
    x[1, 0, 0, 0] = 2688.0
    stream = torch.tensor([1, 2], device=DEV)
    parts = formats.allocate("nvfp4", x.shape, DEV)
    d, s, t = lp_views(parts, "nvfp4", n, HV, V, K)
    _nvfp4_rows_kernel[(n * HV,)](x, t, d, s, stream, seed_key(9), HV=HV, V=V, K=K, BV=64, BK=512, SR=True)
    vals = formats.decode(parts, "nvfp4")
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[..., ::16] = False
    mask[:, 0, 0, :16] = False   # (that block's scale is the matrix amax's)
    v = vals[mask].double()
    assert set(v.unique().tolist()) <= {1.0, 1.5}
    up = (v > 1.0).double().mean().item()
    se = math.sqrt(f * (1 - f) / v.numel())
    assert abs(up - f) < 5 * se, (up, f, se)


# ----------------------------------------------------------------------------------------------
# the pools


def _pools(family, fmt, rounding, shape=None, n=N, window=L, seed=5, layer=2, eager=0):
    HV, Hk, V, K = shape or SHAPES[family]
    params = make_params(family, HV, K, seed=2)
    kw = dict(window=window, max_draft=1, dtype=torch.float32, device=DEV, eager_max_batch=eager,
              hp_format=fmt, hp_rounding=rounding, seed=seed, layer=layer)
    fast = SlotPool(params, n, V, K, Hk, backend="triton", **kw)
    ref = SlotPool(params, n, V, K, Hk, backend="reference", **kw)
    assert fast.backend == "triton" and fast.backend_note is None and ref.backend == "reference"
    assert fast.ckpt_lp is None and "v" not in fast.buf          # one checkpoint, no raw records
    g = torch.Generator().manual_seed(0)
    init = 0.3 * torch.randn(n, HV, V, K, generator=g)
    for p in (fast, ref):
        p.load(torch.arange(n, device=DEV), init.to(DEV))
    return params, fast, ref, g, (HV, Hk, V, K)


def _mirror(pool) -> Layout:
    """A copy of the pool's state with its checkpoint decoded to fp32: the same kernel's shared
    launch on it folds without rounding, so its checkpoint after a flush is the fp32 fold."""
    lay = pool.layout
    return Layout(ckpt={"data": formats.decode(lay.ckpt, pool.hp_format)}, ckpt_lp=None,
                  buf={k: v.clone() for k, v in lay.buf.items()}, cursor=lay.cursor.clone(),
                  pending=lay.pending.clone(), epoch=lay.epoch.clone(),
                  arrive=torch.zeros_like(lay.arrive), stream_seed=lay.stream_seed)


def _sync(dst, src):
    """Give `dst` (the reference pool) `src`'s state, so that a step compares from one state."""
    for store in ("ckpt", "buf"):
        for k, t in getattr(src.layout, store).items():
            getattr(dst.layout, store)[k].copy_(t)
    dst.cursor.copy_(src.cursor)
    dst.epoch.copy_(src.epoch)


def _staggered(step, n):
    """Rows join one per step and stay (their cursors stay staggered, so rows flush in
    different steps), a padding row last."""
    return list(range(min(step + 1, n))) + [-1]


def _code_gap(a: dict, b: dict, fmt: str):
    """Two checkpoints' parts: the fraction of element codes that differ and the largest value
    difference in units of the format at the row's top magnitude."""
    ca, cb = _bits(a)["data"], _bits(b)["data"]
    va, vb = formats.decode(a, fmt).double(), formats.decode(b, fmt).double()
    top = torch.maximum(va.abs(), vb.abs()).amax(dim=-1, keepdim=True).clamp(min=1e-30)
    return (ca != cb).double().mean().item(), ((va - vb).abs() / (UNIT[fmt] * top)).max().item()


def _run(family, fmt, rounding, steps=14, **kw):
    """`steps` decode steps of the kernel pool; per step the checks of the module docstring.
    Returns the pools and the largest gaps to the reference pool."""
    params, fast, ref, g, (HV, Hk, V, K) = _pools(family, fmt, rounding, **kw)
    worst = dict(out=0.0, frac=0.0, units=0.0, flushes=0, mirror_frac=0.0)
    for step in range(steps):
        rows = _staggered(step, fast.N)
        ids = torch.tensor(rows, device=DEV)
        x = {k: v.to(DEV) for k, v in make_inputs(params, len(rows), V, K, Hk, dtype=torch.float32,
                                                    generator=g).items()}
        _sync(ref, fast)
        mirror = _mirror(fast)
        before = {k: v.clone() for k, v in fast.ckpt.items()}
        epoch0 = fast.epoch.clone()
        out = torch.full((len(rows), HV, V), float("nan"), device=DEV)        # poisoned
        y = fast.decode(ids, out=out, **x)
        y_ref = ref.decode(ids, **x)
        window = 1 if len(rows) <= fast.eager_max_batch else fast.window
        y_mir = backends.get(family, "decode_lp")(fast.params, mirror, ids, {k: v.contiguous() for k, v in x.items()},
                                                  window, torch.full_like(out, float("nan")), None, rounding)
        assert y is out and torch.isfinite(y).all() and torch.equal(y[-1], torch.zeros_like(y[-1]))
        # the same arithmetic: outputs, records, cursors bit-identical to the fp32 launch's. (Compiled,
        # the tile's layout follows its load's dtype, and with it the order of the sums over K: the
        # outputs and GDN/KDA's u then agree within fp32 rounding, and through u their folds)
        assert torch.equal(fast.cursor, mirror.cursor) and torch.equal(fast.epoch, mirror.epoch)
        assert torch.equal(fast.cursor, ref.cursor) and torch.equal(fast.epoch, ref.epoch)
        if EXACT:
            assert torch.equal(y, y_mir), step
        else:
            assert rel_err(y, y_mir) < 1e-5, step
        for k in fast.buf:
            # GDN/KDA's u records, and their keys where the steady rows' Gluon kernel (fp16/bf16
            # reads, the default on CUDA) sums the key's norm in another order: fp32 rounding
            if EXACT or family == "mamba2" or k not in ("w", "k"):
                assert torch.equal(fast.buf[k], mirror.buf[k]), (step, k)
            else:
                assert rel_err(fast.buf[k], mirror.buf[k]) < 1e-5, (step, k)
        flushed = (fast.epoch != epoch0).nonzero().flatten().tolist()
        expect = {k: v.clone() for k, v in before.items()}
        for s in flushed:
            stream = torch.tensor([s * 2 ** 32 + int(epoch0[s])], device=DEV)
            for k, v in formats.encode(mirror.ckpt["data"][s:s + 1], fmt, rounding, seed=fast.stream_seed,
                                       stream=stream).items():
                expect[k][s] = v[0]
        if EXACT:
            assert _parts_equal(fast.ckpt, expect), step
        elif flushed:
            # compiled, the fp32 launch is other machine code than the LP launch: the compiler
            # contracts the fold's products into FMAs its own way in each, so the two folds can
            # differ in the last bit (on the H200, Mamba-2 fp8: 4% of the row scales one fp32
            # ulp apart, no element code apart; Mamba-2's codes within 0.1%, GDN/KDA's 1%)
            frac, units = _code_gap(fast.ckpt, expect, fmt)
            worst["mirror_frac"] = max(worst["mirror_frac"], frac)
            assert frac < (0.001 if family == "mamba2" else 0.01) and units <= 1.0, (step, frac, units)
        worst["flushes"] += len(flushed)
        worst["out"] = max(worst["out"], rel_err(y, y_ref))
        if flushed:
            frac, units = _code_gap(fast.ckpt, ref.ckpt, fmt)
            worst["frac"], worst["units"] = max(worst["frac"], frac), max(worst["units"], units)
    return fast, ref, worst


def _check(family, fmt, rounding, worst):
    print(f"{family} {fmt} {rounding}: outputs {worst['out']:.1e} from the reference pool's; codes "
          f"differing after a flush {worst['frac']:.4f}, by at most {worst['units']:.2f} unit(s); "
          f"{worst['flushes']} row flushes")
    assert worst["flushes"] >= 3 * N - 1
    assert worst["out"] < 1e-4, worst["out"]
    assert worst["frac"] < 0.01, worst["frac"]
    assert worst["units"] <= 1.0, worst["units"]


# the cases run by default (with the eager test's fp8 ones: fp16, fp8 and NVFP4 with both
# roundings across Mamba-2 and GDN, KDA's NVFP4 head); the rest slow
FAST = {("mamba2", "fp16", "nearest"), ("mamba2", "nvfp4", "stochastic"),
        ("gdn", "fp16", "stochastic"), ("gdn", "nvfp4", "nearest"),
        ("kda", "nvfp4", "stochastic")}
CASES = [pytest.param(f, fmt, r, marks=() if (f, fmt, r) in FAST else pytest.mark.slow)
         for f in ("mamba2", "gdn", "kda") for fmt in FORMATS for r in ROUNDINGS]


@pytest.mark.parametrize("family,fmt,rounding", CASES)
def test_shared_pool_matches_reference_pool(family, fmt, rounding):
    """14 steps, window 4 (three windows and more per row), staggered cursors, a padding row,
    poisoned outputs. Every step: outputs, records and cursors equal to the unrounded fp32 launch
    of the same kernel on the same state, the flushed rows' checkpoint bytes equal to
    `formats.encode` of its fold with the pool's rounding, seed and stream, the other rows'
    untouched; from the same state as the reference pool, outputs within 1e-4 (measured here:
    1.6e-7 .. 3.0e-7, fp32 rounding in another order), codes equal but for under 1% of the
    elements (measured: 0 .. 4e-4) by at most one unit (measured: 0.52)."""
    fast, ref, worst = _run(family, fmt, rounding)
    _check(family, fmt, rounding, worst)


@pytest.mark.parametrize("family,rounding", [("mamba2", "nearest"), ("gdn", "stochastic")])
def test_shared_pool_eager_steps(family, rounding):
    """fp8_e4m3; batches of at most 2 rows take the eager step (window 1: every row flushes,
    folding the records it holds), larger ones the window: the same checks."""
    fast, ref, worst = _run(family, "fp8_e4m3", rounding, steps=6, eager=2)
    assert worst["flushes"] >= 4
    assert worst["out"] < 1e-4 and worst["frac"] < 0.01 and worst["units"] <= 1.0, worst


@pytest.mark.parametrize("fmt", ["nvfp4", pytest.param("bf16", marks=pytest.mark.slow)])
def test_shared_stochastic_reproducible_from_seed(fmt):
    """The same seed and layer give the same checkpoint bytes; another seed other bytes (and
    round-to-nearest does not depend on the seed)."""
    def final(rounding, seed):
        params, fast, _, g, (HV, Hk, V, K) = _pools("mamba2", fmt, rounding, seed=seed)
        for step in range(6):
            rows = _staggered(step, fast.N)
            x = make_inputs(params, len(rows), V, K, Hk, dtype=torch.float32, generator=g)
            fast.decode(torch.tensor(rows, device=DEV), **{k: v.to(DEV) for k, v in x.items()})
        assert int(fast.epoch.sum()) > fast.N
        return _bits(fast.ckpt)

    a, b, c = final("stochastic", 5), final("stochastic", 5), final("stochastic", 6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["data"], c["data"])
    d, e = final("nearest", 5), final("nearest", 6)
    assert all(torch.equal(d[k], e[k]) for k in d)


@pytest.mark.parametrize("family,poison", [("mamba2", float("inf")), ("gdn", float("nan"))])
def test_shared_nvfp4_nonfinite_head_stays_nonfinite(family, poison):
    """A flush whose fold holds an inf or a NaN (such an input at one value row of head 1)
    stores that head with a NaN tensor scale: it decodes to NaN everywhere, non-finite as the
    reference pool's (formats: inf or NaN), so an overflowed shared NVFP4 state is not laundered
    into finite codes (compiled, a max reduction drops NaN); the other heads stay finite."""
    params, fast, ref, g, (HV, Hk, V, K) = _pools(family, "nvfp4", "nearest", n=1, window=2)
    ids = torch.tensor([0], device=DEV)
    for step in range(2):
        x = {k: v.to(DEV) for k, v in make_inputs(params, 1, V, K, Hk, dtype=torch.float32, generator=g).items()}
        if step == 1:
            x["x" if family == "mamba2" else "v"][0, 1, 0] = poison
        for p in (fast, ref):
            p.decode(ids, **x)
    assert int(fast.epoch[0]) == 2
    got, want = formats.decode(fast.ckpt, "nvfp4")[0], formats.decode(ref.ckpt, "nvfp4")[0]
    assert torch.isnan(got[1]).all() and not torch.isfinite(want[1]).all()
    others = [h for h in range(HV) if h != 1]
    assert torch.isfinite(got[others]).all() and torch.isfinite(want[others]).all()


def test_shared_pool_backend_rules():
    """Shared pools of every format and rounding take the kernels; a narrow HP beside a copy
    still needs stochastic rounding and no NVFP4 on either side."""
    HV, Hk, V, K = SHAPES["mamba2"]
    params = make_params("mamba2", HV, K, seed=2)
    kw = dict(window=4, dtype=torch.float32, device=DEV)
    for fmt in FORMATS:
        for r in ROUNDINGS:
            pool = SlotPool(params, 2, V, K, Hk, backend="triton", hp_format=fmt, hp_rounding=r, **kw)
            assert pool.backend == "triton" and pool.backend_note is None
    for extra in (dict(hp_format="nvfp4", lp_format="fp16"), dict(hp_format="bf16", lp_format="nvfp4"),
                  dict(hp_format="fp16", hp_rounding="nearest", lp_format="bf16")):
        with pytest.raises(ValueError, match="stochastic rounding"):
            SlotPool(params, 2, V, K, Hk, backend="triton", **kw, **extra)


# ----------------------------------------------------------------------------------------------
# real shapes, on the GPU


GPU_SHAPES = {"mamba2": (128, 8, 64, 128), "gdn": (32, 16, 128, 128), "kda": (32, 16, 128, 128)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_shared_pool_real_shapes_gpu(family, fmt, rounding):
    """SPEC shapes (Nemotron-3-Super, Qwen3.5-4B; KDA at 128 x 128), window 16, 8 slots, 40
    steps: the checks of the interpreter test, compiled: the checkpoint within one unit of the
    encoding of the fp32 launch's fold, on at most 0.1% of the codes for Mamba-2 (its fold and
    the fp32 launch's are the same sums, contracted into FMAs by the compiler in each its own
    way) and 1% for GDN/KDA (their u, from sums over K, follow the tile's layout); the gaps to
    the reference pool the same."""
    fast, ref, worst = _run(family, fmt, rounding, steps=40, shape=GPU_SHAPES[family], n=8, window=16)
    print(f"{family} {fmt} {rounding}: outputs {worst['out']:.1e}, codes {worst['frac']:.4f}, "
          f"units {worst['units']:.2f}; codes off the fp32 launch's encoding {worst['mirror_frac']:.5f}")
    assert worst["flushes"] >= 8
    assert worst["out"] < 1e-4 and worst["frac"] < 0.01 and worst["units"] <= 1.0, worst


# ----------------------------------------------------------------------------------------------
# bench precision's shared rows


@pytest.mark.parametrize("shape", ["mamba2/4/2/16/32", "gdn/4/2/16/32"])
def test_precision_benchmark_shared_rows(monkeypatch, shape):
    """`measure(shared=True)` with the kernels interpreted and the timing stubbed (each timing
    runs its function once): shared-nvfp4 and shared-nvfp4-sr rows after the separate ones, each
    window rewriting the shared NVFP4 checkpoint (which the separate windows leave alone), the
    rows staggered and back at their cursors; the bytes of a shared step: the checkpoint in its
    format read, and written at the flush."""
    from replayssm.bench import precision

    cases, snaps = [], []

    class Recorded(precision.PrecisionCase):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            cases.append(self)

    def snap(case):
        return case.cursor.clone(), case.epoch.clone(), {k: v.clone() for k, v in _bits(case.ckpt_shared["nvfp4"]).items()}

    def stub(fn, reps=20, warmup=2):
        (case,) = cases
        before = snap(case)
        fn()
        snaps.append((before, snap(case)))
        return 6.0 * 3

    monkeypatch.setattr(precision, "PrecisionCase", Recorded)
    monkeypatch.setattr(precision, "graph_time_us", stub)
    rows = precision.measure(shape, 2, 3, ["nvfp4"], 1, device="cpu", shared=True)
    assert [r["scheme"] for r in rows if r["timing"] == "window"][-4:] == [
        "replay", "separate", "shared-nvfp4", "shared-nvfp4-sr"]
    case = cases[0]
    for r, ((c0, e0, p0), (c1, e1, p1)) in zip(rows[-2:], snaps[-2:]):
        assert r["read_format"] == r["hp_format"] == "nvfp4" and r["finite"]
        assert r["rounding"] == ("stochastic" if r["scheme"].endswith("-sr") else "nearest")
        assert r["us_per_step"] == 6.0 and r["ratio_vs_conventional"] == 1.0
        assert c0.tolist() == [0, 1] and torch.equal(c1, c0) and torch.equal(e1, e0 + 1)
        assert not torch.equal(p0["data"], p1["data"])
    # the separate windows before them left the shared checkpoint alone
    assert all(torch.equal(a, b) for a, b in zip(snaps[-3][0][2].values(), snaps[-3][1][2].values()))
    L = case.window
    lp = formats.bytes_per_element("nvfp4", case.K) * case.V * case.K * case.HV * case.batch
    fp32 = 4 * case.V * case.K * case.HV * case.batch
    assert case.step_bytes("nvfp4", 0, shared=True) == case.step_bytes("fp32", 0) - fp32 + lp
    assert case.step_bytes("nvfp4", L - 1, shared=True) == case.step_bytes("fp32", L - 1) - 2 * fp32 + 2 * lp
