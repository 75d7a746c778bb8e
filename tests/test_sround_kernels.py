"""Seeded stochastic rounding in the kernels (ops/utils/sround.py) and the precision kernels
with an fp16/bf16/fp8-e4m3 high-precision checkpoint (ops/<family>/precision.py, `HP`).

What is exact and what is not, and why:
* the in-kernel uniforms are `formats.uniform`'s bits, and the in-kernel encoding of given fp32
  rows is `formats.encode(..., "stochastic", seed=, stream=)` bit for bit (integer operations);
* the pools' HP parts agree bit for bit except where the two folds' fp32 values differ (the
  reference folds with einsums, the kernels with rank-1 updates) and the shared uniform falls
  between their fractions of an ulp: there the two roundings differ by one unit of the format,
  on a small fraction of the elements (the chance is about the fp32 difference in units of
  the format's ulp, about 2**-13 for bf16 per flush, compounded over flushes as the states then
  diverge by that unit).
"""
import math

import pytest
import torch
import triton
import triton.language as tl

from replayssm import SlotPool, formats
from replayssm.ops.utils.lowp import load_lp_tile
from replayssm.ops.utils.sround import HP_CODES, hp_views, kernel_uniform_bits, seed_key, store_sr_rows
from replayssm.testing import make_inputs, make_params

from conftest import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HP_FORMATS = ["fp16", "bf16", "fp8_e4m3"]
ULP = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7, "fp8_e4m3": 2.0 ** -3}   # relative, at the top


def _bits(parts: dict) -> dict:
    return {k: v.view(torch.uint8) for k, v in parts.items()}


@pytest.mark.parametrize("seed,stream", [(0, 0), (12345, 7), (2 ** 63 + 99, 5 * 2 ** 32 + 3),
                                         (0xDEADBEEFCAFEF00D, 2 ** 40 + 1)])
def test_kernel_uniforms_are_formats_uniform(seed, stream):
    n = 3000
    got = kernel_uniform_bits(n, seed, stream, device=DEV)
    want = formats.uniform((1, n), seed, torch.tensor([stream], device=DEV)) * 2.0 ** 53
    assert torch.equal(got, want.to(torch.int64)[0])
    assert got.min() >= 0 and got.max() < 2 ** 53


@triton.jit
def _sr_kernel(x, d, s, out, stream, key, HV: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
               BV: tl.constexpr, BK: tl.constexpr, HP: tl.constexpr):
    i_m = tl.program_id(0)
    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_v = o_v < V
    m_k = o_k < K
    m = m_v[:, None] & m_k[None, :]
    b = tl.load(x + i_m * V * K + o_v[:, None] * K + o_k[None, :], mask=m, other=0.)
    st = tl.load(stream + i_m // HV)
    store_sr_rows(b, d, s, i_m, i_m % HV, o_v, m_v, o_k, m_k, key, st, V, K, HP)
    tl.debug_barrier()
    tl.store(out + i_m * V * K + o_v[:, None] * K + o_k[None, :],
             load_lp_tile(d, s, s, i_m, o_v, m_v, o_k, m_k, V, K, HP), mask=m)


def _kernel_encode(x, fmt, seed, stream):
    """`formats.encode(x, fmt, "stochastic", seed=, stream=)` of `x` `[N, HV, V, K]` in the
    kernel; returns (parts, decoded)."""
    N, HV, V, K = x.shape
    parts = formats.allocate(fmt, x.shape, DEV)
    d, s = hp_views(parts, fmt, N, HV, V, K)
    out = torch.empty_like(x)
    _sr_kernel[(N * HV,)](x, d, s, out, stream, seed_key(seed), HV=HV, V=V, K=K,
                          BV=triton.next_power_of_2(V), BK=triton.next_power_of_2(K), HP=HP_CODES[fmt])
    return parts, out


def _hard_values(fmt, shape, g):
    """Normal values at magnitudes over the format's whole range and beyond (subnormals,
    saturation), grid points, signed zeros, ±inf (fp16/bf16: saturate)."""
    lo, hi = {"fp16": (-30, 6), "bf16": (-140, 128), "fp8_e4m3": (-40, 40)}[fmt]
    e = torch.randint(lo, hi, shape, generator=g).double()
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2.0 ** e).float()
    flat = x.view(-1)
    flat[0:8] = torch.tensor([0.0, -0.0, 1.0, -1.5, 2.0 ** -20, float("inf"), -float("inf"), 3.0])
    flat[8:16] = formats.quantize(flat[8:16], "bf16")        # on bf16's grid
    return x


@pytest.mark.parametrize("fmt", HP_FORMATS)
def test_kernel_stochastic_encode_bit_exact(fmt):
    g = torch.Generator().manual_seed(1)
    N, HV, V, K = 3, 2, 12, 48
    x = _hard_values(fmt, (N, HV, V, K), g)
    if fmt == "fp8_e4m3":
        x[x.isinf()] = 1.0   # fp8 rows take their scale from the finite amax; keep rows finite
    stream = torch.tensor([5, 2 ** 32 + 1, 3 * 2 ** 32 + 17], device=DEV)
    x = x.to(DEV)
    for seed in (0, 987654321987):
        parts, dec = _kernel_encode(x, fmt, seed, stream)
        want = formats.encode(x, fmt, "stochastic", seed=seed, stream=stream)
        assert all(torch.equal(_bits(parts)[k], _bits(want)[k]) for k in want), (fmt, seed)
        assert torch.equal(dec, formats.decode(want, fmt))


@pytest.mark.parametrize("fmt", HP_FORMATS)
def test_kernel_stochastic_rounding_unbiased(fmt):
    """Many roundings (every element of a [2, 1, 64, 512] tensor: distinct uniforms) of one value
    3 / 8 of the way between two grid points: the mean is the value within 5 standard errors,
    sqrt(f (1 - f) / n) ulps, and the up-fraction is f within the same bound."""
    N, HV, V, K = 2, 1, 64, 512
    base = 1.0
    ulp = ULP[fmt]
    f = 0.375
    x = torch.full((N, HV, V, K), base + f * ulp, device=DEV)
    if fmt == "fp8_e4m3":
        x[..., 0] = 448.0   # a row amax of 448: scale 1, so the grid is e4m3's own
        x[..., 1] = -448.0
    stream = torch.tensor([11, 12], device=DEV)
    _, dec = _kernel_encode(x, fmt, 42, stream)
    vals = dec[..., 2:].double() if fmt == "fp8_e4m3" else dec.double()
    m = vals.numel()
    assert set(vals.unique().tolist()) <= {base, base + ulp}
    up = (vals > base).double().mean().item()
    se = math.sqrt(f * (1 - f) / m)
    assert abs(up - f) < 5 * se, (up, f, se)
    assert abs(vals.mean().item() - (base + f * ulp)) < 5 * se * ulp


# ----------------------------------------------------------------------------------------------
# the pools


SHAPES = {"mamba2": (4, 2, 12, 48), "gdn": (4, 1, 12, 32), "kda": (4, 2, 20, 16)}


def _run(family, hp, lp, steps=10, n=3, window=4, seed=7, layer=3, ref=True, eager=0):
    HV, Hk, V, K = SHAPES[family]
    params = make_params(family, HV, K, seed=2)
    kw = dict(window=window, max_draft=1, dtype=torch.float32, device=DEV, eager_max_batch=eager,
              hp_format=hp, lp_format=lp, seed=seed, layer=layer)
    pools = [SlotPool(params, n, V, K, Hk, backend="triton", **kw)]
    if ref:
        pools.append(SlotPool(params, n, V, K, Hk, backend="reference", **kw))
    assert pools[0].backend == "triton" and pools[0].backend_note is None
    g = torch.Generator().manual_seed(0)
    init = 0.3 * torch.randn(n, HV, V, K, generator=g)
    for p in pools:
        p.load(torch.arange(n, device=DEV), init.to(DEV))
    log = []
    for step in range(steps):
        rows = list(range(min(step + 1, n))) + [-1]
        ids = torch.tensor(rows, device=DEV)
        x = {k: v.to(DEV) for k, v in make_inputs(params, len(rows), V, K, Hk, dtype=torch.float32,
                                                    generator=g).items()}
        outs = [p.decode(ids, **x) for p in pools]
        if ref:
            fast, slow = pools
            assert torch.equal(fast.cursor, slow.cursor) and torch.equal(fast.epoch, slow.epoch)
            log.append(dict(outs=outs, **_code_distance(fast.ckpt, slow.ckpt, hp)))
        if hp != "fp8_e4m3":   # (re-quantizing fp8 picks a new row scale)
            hp_vals = formats.decode(pools[0].ckpt, hp)
            assert torch.equal(hp_vals, formats.quantize(hp_vals, hp))
    return pools, log


def _code_distance(a: dict, b: dict, hp: str) -> dict:
    """How two HP checkpoints differ: the fraction of element codes that differ; the largest
    difference in units of the format's ulp at the row's top magnitude (one where only a
    rounding went the other way: once the states differ, the recurrence spreads that unit over
    the row, which small elements would show as many of their own units); fp8, the largest
    relative row-scale gap."""
    int_dtype = torch.uint8 if hp == "fp8_e4m3" else torch.int16
    ca, cb = a["data"].view(int_dtype), b["data"].view(int_dtype)
    va, vb = formats.decode(a, hp).double(), formats.decode(b, hp).double()
    top = torch.maximum(va.abs(), vb.abs()).amax(dim=-1, keepdim=True).clamp(min=1e-30)
    units = ((va - vb).abs() / (ULP[hp] * top)).max().item()
    out = dict(frac=(ca != cb).double().mean().item(), units=units, scale=0.0)
    if hp == "fp8_e4m3":
        out["scale"] = rel_err(a["scale"], b["scale"])
    return out


@pytest.mark.parametrize("family,hp,lp", [("mamba2", "bf16", "fp8_e4m3"), ("mamba2", "fp16", "bf16"),
                                          ("mamba2", "fp8_e4m3", "fp16"), ("gdn", "bf16", "fp16"),
                                          ("kda", "fp16", "fp8_e4m3")])
def test_sr_hp_pool_matches_reference_pool(family, hp, lp):
    """10 steps, window 4, staggered cursors: after every step the HP parts of the kernel pool
    and the reference pool (same seed and layer) agree on all but a few elements, and those
    differ by at most one unit of the format at their row's top magnitude (fp8: a row scale may
    differ in its last fp32 bit where the two folds' row amax do); outputs close."""
    pools, log = _run(family, hp, lp)
    worst_frac = max(e["frac"] for e in log)
    worst_units = max(e["units"] for e in log)
    worst_scale = max(e["scale"] for e in log)
    out_err = max(rel_err(e["outs"][0], e["outs"][1]) for e in log)
    print(f"{family} hp={hp} lp={lp}: codes differing {worst_frac:.4f}, by at most {worst_units:.3f} "
          f"row unit(s); fp8 scales {worst_scale:.1e}; outputs {out_err:.1e}")
    assert worst_frac < 0.02, worst_frac
    assert worst_units <= 1, worst_units
    assert worst_scale < 2.0 ** -20, worst_scale
    assert out_err < 40 * ULP[hp], out_err
    # at least one flush happened and rewrote the HP parts
    assert int(pools[0].epoch.min()) >= 2


@pytest.mark.parametrize("family,hp,lp", [("mamba2", "bf16", "fp16"), ("gdn", "fp16", "bf16")])
def test_sr_hp_pool_eager_steps(family, hp, lp):
    """Every batch takes the eager step (window 1: a flush of every row, each a write with its
    own stream): the same agreement with the reference pool."""
    pools, log = _run(family, hp, lp, steps=4, eager=8)
    assert max(e["frac"] for e in log) < 0.02 and max(e["units"] for e in log) <= 1
    assert max(rel_err(e["outs"][0], e["outs"][1]) for e in log) < 40 * ULP[hp]
    assert int(pools[0].epoch[0]) == 5   # the load and four flushes


def test_sr_hp_pool_reproducible_from_seed():
    (a,), _ = _run("mamba2", "bf16", "fp16", steps=8, ref=False)
    (b,), _ = _run("mamba2", "bf16", "fp16", steps=8, ref=False)
    (c,), _ = _run("mamba2", "bf16", "fp16", steps=8, ref=False, seed=8)
    assert torch.equal(_bits(a.ckpt)["data"], _bits(b.ckpt)["data"])
    assert not torch.equal(_bits(a.ckpt)["data"], _bits(c.ckpt)["data"])


def test_hp_without_copy_or_nearest_stays_on_reference():
    HV, Hk, V, K = SHAPES["mamba2"]
    params = make_params("mamba2", HV, K, seed=2)
    kw = dict(window=4, dtype=torch.float32, device=DEV)
    # (a narrow HP alone, the shared design, has kernels: tests/test_shared_lp_kernels.py)
    for extra in (dict(hp_format="bf16", lp_format="nvfp4"),
                  dict(hp_format="fp16", hp_rounding="nearest", lp_format="bf16")):
        with pytest.raises(ValueError, match="stochastic rounding"):
            SlotPool(params, 2, V, K, Hk, backend="triton", **kw, **extra)
