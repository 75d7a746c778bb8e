"""The precision decode kernels (ops/<family>/precision.py, ops/utils/lowp.py) through the slot
pool: an fp32 high-precision checkpoint and a low-precision copy (fp16, bf16, fp8-e4m3, NVFP4)
read by non-flush steps, on the Triton backend (interpreted on the CPU) against the same pool on
the reference and against the one-checkpoint fp32 pool on the standard kernels.

What is exact and what is not, and why:
* the in-kernel encoding is `formats.encode(..., "nearest")` bit for bit, and the decoding is
  `formats.decode` bit for bit (integer rounding on the IEEE bits; scaled formats divide in
  float64 as the reference does), so at every step `ckpt_lp == encode(ckpt)` exactly;
* the fp32 checkpoint equals the reference pool's within fp32 rounding only (the reference
  folds with einsums, the kernels with rank-1 updates: another summation order), hence the LP
  copies of the two pools may differ where a value sits next to a rounding boundary (a unit
  of the format on a few elements); the outputs then differ by far less than the format's
  precision;
* Mamba-2's flush is the standard kernel's arithmetic: its fp32 checkpoint is bit-identical to
  the one-checkpoint pool's, whatever the LP format; GDN/KDA recompute `u` sequentially along
  the HP path (bit-identical across LP formats, within fp32 rounding of the standard kernel).
"""
import pytest
import torch
import triton
import triton.language as tl

from replayssm import SlotPool, formats
from replayssm.ops.utils.lowp import LP_CODES, load_lp_tile, lp_views, store_lp_rows, store_nvfp4_head
from replayssm.testing import make_inputs, make_params

from conftest import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LP_FORMATS = ["fp16", "bf16", "fp8_e4m3", "nvfp4"]
# unit roundoff of each format's elements (nvfp4: e2m1's one mantissa bit)
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8, "fp8_e4m3": 2.0 ** -4, "nvfp4": 2.0 ** -2}
# small and odd shapes (HV, Hk, V, K): V not a power of two, K = 48 padded to 64
SHAPES = {"mamba2": (4, 2, 12, 48), "gdn": (4, 1, 12, 32), "kda": (4, 2, 20, 16)}
N, L = 3, 4


def _parts_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


# ----------------------------------------------------------------------------------------------
# the format helpers alone


@triton.jit
def _roundtrip_kernel(x, out, d, s, t, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr,
                      BK: tl.constexpr, LP: tl.constexpr):
    i_m = tl.program_id(0)
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_v = o_v < V
    m_k = o_k < K
    m = m_v[:, None] & m_k[None, :]
    b = tl.load(x + i_m * V * K + o_v[:, None] * K + o_k[None, :], mask=m, other=0.)
    if LP == 4:
        store_nvfp4_head(x + i_m * V * K, d, s, t, i_m, V, K, BK, 4)
    else:
        store_lp_rows(b, d, s, i_m, o_v, m_v, o_k, m_k, V, K, LP)
    tl.debug_barrier()
    tl.store(out + i_m * V * K + o_v[:, None] * K + o_k[None, :],
             load_lp_tile(d, s, t, i_m, o_v, m_v, o_k, m_k, V, K, LP), mask=m)


@pytest.mark.parametrize("fmt", LP_FORMATS)
def test_kernel_encode_decode_bit_exact(fmt):
    """Random magnitudes over 2**+-9, zeros, signed zeros, float32 subnormals, rows of tiny
    values, half-way ties of fp16 and bf16, values past fp16's range: the kernel's parts are
    `formats.encode`'s bit for bit, and its decoded tile is `formats.decode`'s."""
    g = torch.Generator().manual_seed(1)
    M, V, K = 6, 12, 48
    x = torch.randn(M, V, K, generator=g) * torch.exp(3 * torch.randn(M, V, 1, generator=g))
    x[0, 0] = 0
    x[0, 1, :5] = -0.0
    x[1, 2, :3] = torch.tensor([1e-41, -3e-45, 2e-39])
    x[1, 3] = 1e-30 * torch.randn(K, generator=g)
    x[2, 0, :8] = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1 + 3 * 2 ** -8,
                                65519.0, -70000.0, 2 ** -25, 3 * 2 ** -25])
    x[3, 0, 0] = 1e38
    x = x.to(DEV)
    parts = formats.allocate(fmt, (M, 1, V, K), DEV)
    d, s, t = lp_views(parts, fmt, M, 1, V, K)
    out = torch.full_like(x, float("nan"))
    _roundtrip_kernel[(M,)](x, out, d, s, t, V=V, K=K, BV=16, BK=64, LP=LP_CODES[fmt])
    assert _parts_equal(parts, formats.encode(x[:, None], fmt, "nearest"))
    assert torch.equal(out, formats.decode(parts, fmt)[:, 0])
    assert torch.equal(out, formats.quantize(x, fmt))


# ----------------------------------------------------------------------------------------------
# the pool


def _pools(family, lp, eager=0, shape=None, n=N, window=L):
    HV, Hk, V, K = shape or SHAPES[family]
    params = make_params(family, HV, K, seed=2)
    kw = dict(window=window, max_draft=1, dtype=torch.float32, device=DEV, eager_max_batch=eager)
    fast = SlotPool(params, n, V, K, Hk, backend="triton", lp_format=lp, **kw)
    ref = SlotPool(params, n, V, K, Hk, backend="reference", lp_format=lp, **kw)
    std = SlotPool(params, n, V, K, Hk, backend="triton", **kw)
    assert fast.backend == "triton" and fast.backend_note is None and ref.backend == "reference"
    g = torch.Generator().manual_seed(0)
    init = 0.3 * torch.randn(n, HV, V, K, generator=g)
    for p in (fast, ref, std):
        p.load(torch.arange(n, device=DEV), init.to(DEV))
    return params, (fast, ref, std), g, (HV, Hk, V, K)


def _staggered(step, n):
    """Live rows of a step: rows join one per step and then stay, so their cursors stay
    staggered (rows at different window positions flush in different steps); a padding row."""
    return list(range(min(step + 1, n))) + [-1]


def _alternating(step, n):
    """All rows, then one row alone (a batch the eager step takes, with records pending)."""
    return (list(range(n)) if step % 2 == 0 else [(step // 2) % n]) + [-1]


def _run(family, lp, steps, eager=0, shape=None, n=N, window=L, schedule=_staggered):
    params, pools, g, (HV, Hk, V, K) = _pools(family, lp, eager, shape, n, window)
    fast, ref, std = pools
    log = []
    for step in range(steps):
        rows = schedule(step, n)
        ids = torch.tensor(rows, device=DEV)
        live = torch.tensor([r >= 0 for r in rows], device=DEV)
        h0 = fast.cursor[ids.clamp(min=0).long()]
        eager_step = len(rows) <= fast.eager_max_batch
        flush = (h0 + 1 >= (1 if eager_step else fast.window)) & live
        x = {k: v.to(DEV) for k, v in make_inputs(params, len(rows), V, K, Hk, dtype=torch.float32,
                                                    generator=g).items()}
        outs = [p.decode(ids, **x) for p in pools]
        assert torch.equal(outs[0][-1], torch.zeros_like(outs[0][-1]))           # padding row
        assert torch.equal(fast.cursor, ref.cursor) and torch.equal(fast.epoch, ref.epoch)
        # the LP copy is the round-to-nearest encoding of the fp32 checkpoint, bit for bit
        assert _parts_equal(fast.ckpt_lp, formats.encode(fast.ckpt["data"], lp, "nearest")), step
        log.append(dict(outs=outs, flush=flush, live=live))
    return pools, log


def _errors(pools, log, lp):
    fast, ref, std = pools
    out_ref = max(rel_err(e["outs"][0], e["outs"][1]) for e in log)
    # outputs of rows that read C_LP against the same rows reading the fp32 checkpoint
    nf = [(e["outs"][0][e["live"] & ~e["flush"]], e["outs"][2][e["live"] & ~e["flush"]]) for e in log]
    lp_read = rel_err(torch.cat([a for a, _ in nf]), torch.cat([b for _, b in nf]))
    fl = [(e["outs"][0][e["flush"]], e["outs"][2][e["flush"]]) for e in log]
    flush_read = rel_err(torch.cat([a for a, _ in fl]), torch.cat([b for _, b in fl]))
    hp_ref = rel_err(fast.ckpt["data"], ref.ckpt["data"])
    lp_ref = rel_err(formats.decode(fast.ckpt_lp, lp), formats.decode(ref.ckpt_lp, lp))
    return out_ref, lp_read, flush_read, hp_ref, lp_ref


# CI's representative subset: every format once, every family once; the rest slow
_POOL_FAST = {("mamba2", "fp16"), ("mamba2", "nvfp4"), ("gdn", "fp8_e4m3"), ("kda", "bf16")}


@pytest.mark.parametrize("family,lp", [pytest.param(f, lp, marks=() if (f, lp) in _POOL_FAST else pytest.mark.slow)
                                       for f in ("mamba2", "gdn", "kda") for lp in LP_FORMATS])
def test_lowp_pool_matches_reference_pool(family, lp):
    """14 steps with window 4 (three windows per row), rows at staggered cursors, a padding
    row. Bounds (measured here): the fp32 checkpoint within 1e-5 of the reference pool's (2e-7:
    fp32 rounding in another order); outputs within 0.1 unit of the format of the reference
    pool's (2e-7 .. 1.3e-5 = 0.03 units for fp16, where a value next to a rounding boundary
    of the LP copy went the other way); decoded LP copies within 0.1 unit (0 .. 0.02); outputs
    of LP reads 0.1 .. 1 unit from fp32 reads (0.29 .. 0.38: the LP path is taken); flush
    outputs equal to fp32 reads (the HP path: Mamba-2 bit-identical, GDN/KDA 1.7e-7)."""
    pools, log = _run(family, lp, 14)
    fast, ref, std = pools
    out_ref, lp_read, flush_read, hp_ref, lp_ref = _errors(pools, log, lp)
    u = UNIT[lp]
    assert int(fast.epoch.min()) >= 1 + 3                    # the load, then >= 3 windows per row
    assert hp_ref < 1e-5, hp_ref
    assert out_ref < 0.1 * u, out_ref
    assert lp_ref < 0.1 * u, lp_ref
    assert 0.1 * u < lp_read < u, lp_read
    if family == "mamba2":
        # the standard kernel's fold: the fp32 checkpoint and the flush outputs bit-identical
        assert torch.equal(fast.ckpt["data"], std.ckpt["data"])
        assert flush_read == 0.0
    else:
        assert rel_err(fast.ckpt["data"], std.ckpt["data"]) < 1e-5
        assert flush_read < 1e-5, flush_read


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_delta_hp_path_independent_of_lp_format(family):
    """GDN/KDA: the fp32 checkpoint after every step is bit-identical whether the LP copy is
    fp16 or NVFP4 (u recomputed from the raw v, beta along C_HP), the outputs are not."""
    runs = {lp: _run(family, lp, 8) for lp in ("fp16", "nvfp4")}
    (pa, la), (pb, lb) = runs["fp16"], runs["nvfp4"]
    assert torch.equal(pa[0].ckpt["data"], pb[0].ckpt["data"])
    assert int(pa[0].epoch.sum()) >= N
    assert not torch.equal(la[-1]["outs"][0], lb[-1]["outs"][0])


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_lowp_pool_eager_steps(family):
    """Batches of at most 2 rows take the eager step (window 1: every row flushes, folding the
    records it holds), larger ones the window: the kernels against the reference pool."""
    pools, log = _run(family, "fp8_e4m3", 9, eager=2, schedule=_alternating)
    fast, ref, _ = pools
    assert rel_err(fast.ckpt["data"], ref.ckpt["data"]) < 1e-5
    assert max(rel_err(e["outs"][0], e["outs"][1]) for e in log) < 0.1 * UNIT["fp8_e4m3"]
    ids = torch.arange(N, device=DEV)
    assert rel_err(fast.materialize(ids), ref.materialize(ids)) < 1e-5


def test_lowp_pool_verify_then_decode_matches_reference():
    """A two-checkpoint pool verifies (on the verify_lp kernels), commits, then decodes on the
    kernels again: it stays equal to the reference pool."""
    params, pools, g, (HV, Hk, V, K) = _pools("gdn", "bf16")
    fast, ref, _ = pools
    ids = torch.arange(N, device=DEV)
    x = {k: v.to(DEV) for k, v in make_inputs(params, N, V, K, Hk, steps=1, dtype=torch.float32,
                                                generator=g).items()}
    outs = [p.verify(ids, **x) for p in (fast, ref)]
    for p in (fast, ref):
        p.commit(ids, torch.ones(N, dtype=torch.int32, device=DEV))
    assert rel_err(outs[0], outs[1]) < 1e-6
    for _ in range(4):
        x = {k: v.to(DEV) for k, v in make_inputs(params, N, V, K, Hk, dtype=torch.float32,
                                                    generator=g).items()}
        outs = [p.decode(ids, **x) for p in (fast, ref)]
        assert rel_err(outs[0], outs[1]) < 0.1 * UNIT["bf16"]
    assert torch.equal(fast.cursor, ref.cursor) and int(fast.epoch.sum()) >= 2 * N
    assert rel_err(fast.ckpt["data"], ref.ckpt["data"]) < 1e-5


def test_unsupported_lp_format_falls_back():
    params = make_params("mamba2", 4, 32)
    pool = SlotPool(params, 2, 8, 32, 2, dtype=torch.float32, lp_format="fp8_e5m2", device=DEV)
    if DEV == "cpu":
        assert pool.backend == "reference"
    else:
        assert pool.backend == "reference" and "fp8_e5m2" in pool.backend_note


# ----------------------------------------------------------------------------------------------
# real shapes, on the GPU


GPU_SHAPES = {"mamba2": (128, 8, 64, 128), "gdn": (32, 16, 128, 128), "kda": (32, 16, 128, 128)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lp", LP_FORMATS)
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_lowp_pool_real_shapes_gpu(family, lp):
    """SPEC shapes (Nemotron-3-Super, Qwen3.5-4B; KDA at 128 x 128), window 16, 8 slots, 40
    steps: the checks of the interpreter test (the LP copy bit-exact from the fp32 checkpoint
    compiled, the bounds the same)."""
    pools, log = _run(family, lp, 40, shape=GPU_SHAPES[family], n=8, window=16)
    fast, ref, std = pools
    out_ref, lp_read, flush_read, hp_ref, lp_ref = _errors(pools, log, lp)
    u = UNIT[lp]
    assert int(fast.epoch.min()) >= 3
    assert hp_ref < 1e-5 and out_ref < 0.1 * u and lp_ref < 0.1 * u, (hp_ref, out_ref, lp_ref)
    assert 0.1 * u < lp_read < u, lp_read
    assert rel_err(fast.ckpt["data"], std.ckpt["data"]) < 1e-5 and flush_read < 1e-5
