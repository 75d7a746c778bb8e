"""Tests of replayssm.formats: rounding to each format's grid, stochastic rounding, storage (NVFP4
in test_formats_nvfp4.py, fp8's scales in test_formats_fp8.py).

References used here are independent of the implementation: torch's own casts, and the full
list of finite values of each small format (built from every bit pattern), searched with
`searchsorted`. fp8 is scaled per last-dim row: its references divide by the row scale and
use the same grids; a row holding ±max_finite has scale exactly 1, which reduces fp8 to the
plain torch cast.
"""
from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings, strategies as st

from replayssm import formats as F
from replayssm.formats import (FORMATS, ROUNDINGS, allocate, bytes_per_element, check_format,
                               decode, encode, max_finite, quantize, uniform)

ELEMENT = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
SMALL = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")  # formats whose whole grid we can list
SCALED = ("fp8_e4m3", "fp8_e5m2")  # one float32 scale per last-dim row
UNSCALED = ("fp32", "bf16", "fp16")
TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
               "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# independent references
# ----------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def positive_grid(fmt: str) -> torch.Tensor:
    """All finite non-negative values of a small format, ascending; index = bit pattern."""
    dt = TORCH_DTYPE[fmt]
    if dt.itemsize == 1:
        bits = torch.arange(0, 128, dtype=torch.int16).to(torch.uint8).view(dt)
    else:
        bits = torch.arange(0, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dt)
    v = bits.to(torch.float64)
    v = v[torch.isfinite(v)]
    assert torch.all(v[1:] > v[:-1])  # positive patterns are monotone
    return v


def grid_neighbours(a: torch.Tensor, grid: torch.Tensor):
    """For magnitudes `a` (float64, clamped to the grid's max): (lo, hi, index of lo)."""
    a = a.clamp(max=grid[-1].item())
    k = torch.searchsorted(grid, a, right=True) - 1
    lo = grid[k]
    hi = torch.where(a == lo, lo, grid[(k + 1).clamp(max=len(grid) - 1)])
    return lo, hi, k


def grid_nearest(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Round half to even (even = even bit pattern) on a listed grid, saturating, signed."""
    a = x.abs()
    lo, hi, k = grid_neighbours(a, grid)
    a = a.clamp(max=grid[-1].item())
    pick_lo = (a - lo < hi - a) | ((a - lo == hi - a) & (k % 2 == 0))
    return torch.copysign(torch.where(pick_lo, lo, hi), x)


def fp32_neighbours(x: torch.Tensor):
    """Float32 neighbours (lo, hi) of float64 magnitudes |x| (in float32 range)."""
    a = x.abs()
    f = a.float()
    down = torch.nextafter(f, torch.zeros_like(f)).double()
    up = torch.nextafter(f, torch.full_like(f, math.inf)).double()
    fd = f.double()
    lo = torch.where(fd > a, down, fd)
    hi = torch.where(fd < a, up, fd)
    return lo, hi


def f32_round_up(exact: torch.Tensor) -> torch.Tensor:
    """Smallest float32 >= `exact` (float64 in, float64 out; inf beyond float32's range)."""
    f = exact.float()
    f = torch.where(f.double() < exact, torch.nextafter(f, torch.tensor(math.inf)), f)
    return f.double()


def fp8_scale(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Reference row scale `[...]` of `x` `[..., K]` (float64): finite amax / max rounded up
    to float32, kept within float32's range, 1 for rows without a finite non-zero."""
    x = x.double()
    amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(-1)
    s = f32_round_up(amax / positive_grid(fmt)[-1]).clamp(2.0 ** -149, max_finite("fp32"))
    return torch.where(amax == 0, 1.0, s)


def fp8_reference(x: torch.Tensor, fmt: str):
    """Independent scaled-fp8 nearest for `x` `[..., K]`: (result float64, scale, x / scale)."""
    x = x.double()
    s = fp8_scale(x, fmt)[..., None]
    y = x / s
    return grid_nearest(y, positive_grid(fmt)) * s, s[..., 0], y


def neighbours(x: torch.Tensor, fmt: str):
    """Signed-agnostic neighbours of |x| in `fmt` (float64 x; fp8 in units of its row scale,
    then scaled back)."""
    if fmt == "fp32":
        return fp32_neighbours(x)
    if fmt in SCALED:
        s = fp8_scale(x, fmt)[..., None]
        lo, hi, _ = grid_neighbours((x / s).abs(), positive_grid(fmt))
        return lo * s, hi * s
    lo, hi, _ = grid_neighbours(x.abs(), positive_grid(fmt))
    return lo, hi


def with_unit_scale(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`x` (1-D, |x| <= max_finite) with `max_finite` appended for fp8, so that the row's scale
    is exactly 1 and fp8 rounds on the format's own grid (other formats: `x` as is)."""
    if fmt not in SCALED:
        return x
    return torch.cat([x, torch.tensor([max_finite(fmt)], dtype=x.dtype)])


def test_grid_reference_is_sane():
    assert positive_grid("fp8_e4m3")[-1] == 448 and len(positive_grid("fp8_e4m3")) == 127
    assert positive_grid("fp8_e5m2")[-1] == 57344 and len(positive_grid("fp8_e5m2")) == 124
    assert positive_grid("fp16")[-1] == 65504 and positive_grid("fp16")[1] == 2.0 ** -24
    assert positive_grid("bf16")[1] == 2.0 ** -133


def sample(fmt: str, n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Random normals at scales across `fmt`'s range, subnormals included."""
    g = torch.Generator().manual_seed(seed)
    m, emin, emax, _ = F._ELEMENT[fmt]
    e = torch.randint(emin - m, emax, (n,), generator=g).to(torch.float64)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(e)
    x = x.clamp(-max_finite(fmt), max_finite(fmt))
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------
# names, sizes
# ----------------------------------------------------------------------------------------------

def test_names_and_sizes():
    assert FORMATS == ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4")
    assert ROUNDINGS == ("nearest", "stochastic")
    assert check_format("bf16") == "bf16"
    assert [bytes_per_element(f) for f in FORMATS] == [4, 2, 2, 1, 1, 0.5 + 1 / 16]
    # given the row length, fp8 counts its float32 row scale; the others have none per row
    assert [bytes_per_element(f, 128) for f in FORMATS] == [4, 2, 2, 1 + 4 / 128, 1 + 4 / 128,
                                                           0.5 + 1 / 16]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match=repr(bad)):
            bytes_per_element("fp8_e4m3", bad)
    for f in ELEMENT:
        assert max_finite(f) == torch.finfo(TORCH_DTYPE[f]).max
    assert max_finite("fp8_e4m3") == 448 and max_finite("fp8_e5m2") == 57344
    assert max_finite("fp16") == 65504


@pytest.mark.parametrize("call", [
    lambda: check_format("fp64"), lambda: bytes_per_element("fp64"), lambda: max_finite("fp64"),
    lambda: quantize(torch.zeros(2), "fp64"), lambda: encode(torch.zeros(2), "fp64"),
    lambda: decode({"data": torch.zeros(2)}, "fp64"), lambda: allocate("fp64", (2,)),
])
def test_unknown_format_is_named(call):
    with pytest.raises(ValueError, match="fp64"):
        call()


@pytest.mark.parametrize("fmt", FORMATS)
def test_unknown_rounding_is_named(fmt):
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="floor"):
        quantize(x, fmt, "floor")
    with pytest.raises(ValueError, match="floor"):
        encode(x, fmt, "floor")


# ----------------------------------------------------------------------------------------------
# element formats, round to nearest
# ----------------------------------------------------------------------------------------------

def hard_cases(fmt: str) -> torch.Tensor:
    """Float32 values that stress rounding: every tie between adjacent grid values, points
    just beside ties, quarter points, and values beside powers of two (both signs)."""
    p = positive_grid(fmt)
    lo, hi = p[:-1], p[1:]
    mid = (lo + hi) / 2  # exact in float64 and in float32 for these formats
    f = mid.float()
    beside = torch.cat([torch.nextafter(f, torch.zeros_like(f)),
                        torch.nextafter(f, torch.full_like(f, math.inf))]).double()
    quarters = torch.cat([lo + (hi - lo) / 4, lo + 3 * (hi - lo) / 4])
    e = torch.arange(-30, 16, dtype=torch.float64)
    pow2 = torch.cat([torch.exp2(e) * (1 + d) for d in (-2 ** -5, -2 ** -9, 2 ** -9, 2 ** -5)])
    x = torch.cat([mid, beside, quarters, p, pow2])
    x = x[x.abs() <= max_finite(fmt)]
    x = torch.cat([x, -x])
    assert torch.equal(x.float().double(), x)  # all exactly representable in float32
    return x.float()


@pytest.mark.parametrize("fmt", SMALL)
def test_nearest_matches_torch_cast(fmt):
    # hard_cases holds max_finite: for fp8 the (one) row has scale 1, i.e. the plain cast
    x = torch.cat([hard_cases(fmt), sample(fmt, 20000, seed=1, dtype=torch.float32)])
    q = quantize(x, fmt)
    assert q.dtype == torch.float32
    assert torch.equal(q, x.to(TORCH_DTYPE[fmt]).float())
    assert torch.equal(q.double(), grid_nearest(x.double(), positive_grid(fmt)))
    if fmt in SCALED:
        assert encode(x, fmt)["scale"].item() == 1.0


@pytest.mark.parametrize("fmt", SMALL)
def test_ties_go_to_even(fmt):
    p = positive_grid(fmt)
    mid = (p[:-1] + p[1:]) / 2
    x = with_unit_scale(mid, fmt)  # fp8: ties of the element grid itself
    q = quantize(x, fmt)[:len(mid)]
    even = torch.where(torch.arange(len(mid)) % 2 == 0, p[:-1], p[1:])
    assert torch.equal(q, even)
    assert torch.equal(quantize(-x, fmt)[:len(mid)], -even)


def test_e4m3_examples():
    # A row whose amax is 448 has scale 1: the plain e4m3 grid, subnormals included.
    x = torch.tensor([0.4957, 0.5, 2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.01, 3 * 2.0 ** -10,
                      240.0, 232.0, 448.0, -0.0])
    want = torch.tensor([0.5, 0.5, 2.0 ** -9, 0.0, 2.0 ** -9, 2.0 ** -8, 240.0, 224.0, 448.0,
                         -0.0])
    assert torch.equal(quantize(x, "fp8_e4m3"), want)
    # A power-of-two multiple has the same elements and a power-of-two scale: the same relative
    # rounding at any magnitude, where unscaled e4m3 flushed 2**-40 rows to 0 and saturated
    # 2**20 rows at 448.
    rows = torch.stack([x * 2.0 ** k for k in (-40, -10, 0, 20, 60)])
    assert torch.equal(quantize(rows, "fp8_e4m3"),
                       torch.stack([want * 2.0 ** k for k in (-40, -10, 0, 20, 60)]))
    assert torch.equal(encode(rows, "fp8_e4m3")["scale"],
                       torch.tensor([2.0 ** k for k in (-40, -10, 0, 20, 60)]))
    # No saturation: the row's amax maps to 448 * scale, the scale rounded up to float32.
    big = torch.tensor([1e6, 464.0, -1e6, 0.0], dtype=torch.float64)
    q = quantize(big, "fp8_e4m3")
    s = f32_round_up(torch.tensor(1e6 / 448, dtype=torch.float64))
    assert torch.equal(q[[0, 2]], torch.stack([448 * s, -448 * s]))
    assert 1e6 <= q[0] <= 1e6 * (1 + 2.0 ** -23)
    assert q[1] == 13 * 2.0 ** -6 * s  # 464 / s = 0.2079 -> 0.203125 = 13 * 2**-6


@pytest.mark.parametrize("fmt", SMALL)
def test_nearest_float64_rounds_once(fmt):
    """Float64 inputs round directly (no double rounding through float32)."""
    p = positive_grid(fmt)
    mid = (p[:-1] + p[1:]) / 2
    eps = 2.0 ** -40 * mid
    x = torch.cat([mid - eps, mid + eps, sample(fmt, 20000, seed=2)])
    x = with_unit_scale(torch.cat([x, -x]), fmt)  # fp8: the element grid itself
    q = quantize(x, fmt)
    assert q.dtype == torch.float64
    assert torch.equal(q, grid_nearest(x, p))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), min_size=1,
                max_size=16),
       st.sampled_from(SMALL))
def test_nearest_property(xs, fmt):
    x = torch.tensor(xs, dtype=torch.float64)
    want = fp8_reference(x, fmt)[0] if fmt in SCALED else grid_nearest(x, positive_grid(fmt))
    assert torch.equal(quantize(x, fmt), want)


def test_fp32_nearest_from_float64():
    g = torch.Generator().manual_seed(3)
    e = torch.randint(-160, 128, (50000,), generator=g).to(torch.float64)
    x = torch.randn(50000, generator=g, dtype=torch.float64) * torch.exp2(e)
    f = sample("bf16", 2000, seed=4).float()  # float32 ties (including subnormal ones)
    ties = (f.double() + torch.nextafter(f, torch.full_like(f, math.inf)).double()) / 2
    x = torch.cat([x, ties, torch.tensor([2.0 ** -150, 3 * 2.0 ** -150, 1e-46, -1e-40])])
    x = x[x.abs() <= max_finite("fp32")]
    q = quantize(x, "fp32")
    assert q.dtype == torch.float64
    assert torch.equal(q, x.float().double())
    y = torch.randn(1000)
    assert torch.equal(quantize(y, "fp32"), y)


@pytest.mark.parametrize("fmt", UNSCALED)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_saturation_nan_and_zeros(fmt, rounding):
    m = max_finite(fmt)
    big = [m * (1 + 2.0 ** -30), m * 1.5, m * 2, 1e300, math.inf]
    x = torch.tensor(big + [-v for v in big], dtype=torch.float64)
    q = quantize(x, fmt, rounding)
    assert torch.equal(q, torch.sign(x) * m)
    x32 = torch.tensor([3e38, -math.inf], dtype=torch.float32)
    q32 = quantize(x32, fmt, rounding)
    assert torch.isfinite(q32).all() and q32[1] == -torch.tensor(m, dtype=torch.float32)
    z = quantize(torch.tensor([0.0, -0.0, math.nan]), fmt, rounding)
    assert z[0] == 0 and not torch.signbit(z[0])
    assert z[1] == 0 and torch.signbit(z[1])
    assert torch.isnan(z[2])


# ----------------------------------------------------------------------------------------------
# stochastic rounding
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ELEMENT)
def test_stochastic_gives_a_neighbour(fmt):
    x = sample(fmt, 20000, seed=5)
    if fmt == "fp32":
        x = x[x.abs() >= 2.0 ** -140]  # keep the float32 nextafter reference simple
    lo, hi = neighbours(x, fmt)
    seen_lo = seen_hi = False
    for seed in range(3):
        q = quantize(x, fmt, "stochastic", seed=seed).abs()
        assert torch.all((q == lo) | (q == hi))
        assert torch.equal(torch.signbit(quantize(x, fmt, "stochastic", seed=seed)),
                           torch.signbit(x))
        off = lo != hi
        seen_lo |= bool((q[off] == lo[off]).any())
        seen_hi |= bool((q[off] == hi[off]).any())
    assert seen_lo and seen_hi


@pytest.mark.parametrize("fmt", ELEMENT)
def test_stochastic_is_unbiased(fmt):
    n, m = 4096, 256
    x = sample(fmt, m, seed=6)
    if fmt == "fp32":
        x = x[x.abs() >= 2.0 ** -140]
    lo, hi = neighbours(x, fmt)
    ulp = hi - lo
    X = x[None].expand(n, -1).contiguous()
    q = quantize(X, fmt, "stochastic", seed=11, stream=torch.arange(n))
    err = q.mean(0) - x
    # Each draw is lo or hi with mean x, so its variance is at most ulp^2 / 4; the mean of n
    # independent draws has standard deviation <= ulp / (2 sqrt(n)). Allow 6 of those.
    bound = 6 * ulp / (2 * math.sqrt(n))
    assert torch.all(err.abs() <= bound), (err.abs() / bound).max()
    # Pooled over the values, the mean error in ulps has std <= 1 / (2 sqrt(n m)): catches a
    # small systematic bias that the per-value bound is too loose to see.
    assert (ulp > 0).all()
    pooled = 6 / (2 * math.sqrt(n * len(x)))
    assert abs((err / ulp).mean().item()) <= pooled  # bias towards +-inf
    assert abs((err * x.sign() / ulp).mean().item()) <= pooled  # bias towards / away from 0
    # and it really is stochastic: nearest would be biased by far more than the bound here
    near = quantize(x, fmt) - x
    assert (near.abs() > bound).float().mean() > 0.5


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_is_reproducible(fmt):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 3, 32, generator=g, dtype=torch.float64)  # float64: fp32 rounds too
    s = torch.tensor([5, 6, 7, 2 ** 40])
    a = quantize(x, fmt, "stochastic", seed=3, stream=s)
    assert torch.equal(a, quantize(x, fmt, "stochastic", seed=3, stream=s.clone()))
    assert not torch.equal(a, quantize(x, fmt, "stochastic", seed=4, stream=s))
    assert not torch.equal(a, quantize(x, fmt, "stochastic", seed=3, stream=s + 1))
    assert not torch.equal(a, quantize(x, fmt, "stochastic", seed=3, stream=s + 2 ** 33))
    # a row depends only on (seed, its stream, index): sub-batches agree
    assert torch.equal(a[2:3], quantize(x[2:3], fmt, "stochastic", seed=3, stream=s[2:3]))
    with pytest.raises(ValueError, match="shape"):
        quantize(x, fmt, "stochastic", stream=torch.arange(3))


def _py_mix32(x: int) -> int:
    M = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M
    x ^= x >> 15
    x = (x * 0x846CA68B) & M
    return x ^ (x >> 16)


def _py_uniform(seed: int, stream: int, i: int) -> float:
    """Plain-Python statement of the hash (for kernels that must reproduce it)."""
    M = 0xFFFFFFFF
    k = _py_mix32((seed & M) ^ 0x9E3779B9)
    k = _py_mix32(k ^ ((seed >> 32) & M))
    k1 = _py_mix32(k ^ (stream & M))
    k1 = _py_mix32(k1 ^ ((stream >> 32) & M))
    k2 = _py_mix32(k1 ^ 0x85EBCA6B)
    h0 = _py_mix32(_py_mix32((2 * i) ^ k1) ^ k2)
    h1 = _py_mix32(_py_mix32((2 * i + 1) ^ k1) ^ k2)
    return (((h0 >> 6) << 27) | (h1 >> 5)) * 2.0 ** -53


def test_uniform_matches_python_statement():
    streams = [0, 1, 12345, 2 ** 40 + 3, -7]
    u = uniform((5, 2, 3), seed=2 ** 35 + 99, stream=torch.tensor(streams))
    for b, s in enumerate(streams):
        for i in range(6):
            assert u[b].flatten()[i].item() == _py_uniform(2 ** 35 + 99, s, i)


def test_uniform_statistics():
    B, n = 64, 16384
    u = uniform((B, n), seed=9, stream=torch.arange(B))
    assert u.dtype == torch.float64 and u.shape == (B, n)
    assert u.min() >= 0 and u.max() < 1
    N = u.numel()
    assert abs(u.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / N)
    counts = torch.histc(u, bins=16, min=0, max=1)
    p = 1 / 16
    assert torch.all((counts - N * p).abs() < 6 * math.sqrt(N * p * (1 - p)))
    # neighbours in index and in stream are uncorrelated: E[u v] = 1/4 (1/3 if equal)
    for a, b in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1])):
        assert abs((a * b).mean().item() - 0.25) < 6 * math.sqrt(7 / 144 / a.numel())
    # None = stream 0, seed matters, 0-d shape
    assert torch.equal(uniform((3, 4), 1), uniform((3, 4), 1, torch.zeros(3, dtype=torch.long)))
    assert (uniform((3, 4), 1) == uniform((3, 4), 2)).sum() == 0
    assert uniform((), 1).shape == ()


# ----------------------------------------------------------------------------------------------
# storage
# ----------------------------------------------------------------------------------------------

EXPECTED_PARTS = {
    "fp32": {"data": ((3, 4, 32), torch.float32)},
    "bf16": {"data": ((3, 4, 32), torch.bfloat16)},
    "fp16": {"data": ((3, 4, 32), torch.float16)},
    "fp8_e4m3": {"data": ((3, 4, 32), torch.float8_e4m3fn), "scale": ((3, 4), torch.float32)},
    "fp8_e5m2": {"data": ((3, 4, 32), torch.float8_e5m2), "scale": ((3, 4), torch.float32)},
    "nvfp4": {"data": ((3, 4, 16), torch.uint8), "scale": ((3, 4, 2), torch.float8_e4m3fn),
              "tensor_scale": ((3,), torch.float32)},
}


def storage_input(dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(10)
    x = torch.randn(3, 4, 32, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-12, 12, (3, 4, 32), generator=g).double())
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e6, -1e6])  # zeros; for fp8 a row of amax 1e6
    x[1, 2, :16] = 0.0  # an all-zero nvfp4 block
    x[2] = 0.0  # an all-zero nvfp4 matrix
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_encode_decode_equals_quantize(fmt, rounding, dtype):
    x = storage_input(dtype)
    stream = torch.tensor([3, 1, 4])
    parts = encode(x, fmt, rounding, seed=5, stream=stream)
    q = quantize(x, fmt, rounding, seed=5, stream=stream)
    assert {k: (tuple(v.shape), v.dtype) for k, v in parts.items()} == EXPECTED_PARTS[fmt]
    back = decode(parts, fmt, dtype)
    assert back.dtype == dtype
    assert torch.equal(back, q)
    assert torch.equal(torch.signbit(back), torch.signbit(q))
    if fmt != "fp32":
        assert not torch.equal(q, x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_allocate_and_pool_assignment(fmt, dtype):
    pool = allocate(fmt, (5, 4, 32), dtype=dtype)
    want = {k: ((5,) + s[1:], dt) for k, (s, dt) in EXPECTED_PARTS[fmt].items()}
    assert {k: (tuple(v.shape), v.dtype) for k, v in pool.items()} == want
    assert all(torch.all(v.view(torch.uint8) == 0) for v in pool.values())
    assert torch.equal(decode(pool, fmt, dtype), torch.zeros(5, 4, 32, dtype=dtype))
    x = storage_input(dtype)
    new = encode(x, fmt, "stochastic", seed=1, stream=torch.tensor([7, 8, 9]))
    slots = torch.tensor([4, 0, 2])
    for k in pool:
        pool[k][slots] = new[k]
    out = decode(pool, fmt, dtype)
    assert torch.equal(out[slots], quantize(x, fmt, "stochastic", seed=1,
                                            stream=torch.tensor([7, 8, 9])))
    assert torch.all(out[[1, 3]] == 0)


def test_bad_dtypes():
    with pytest.raises(TypeError):
        quantize(torch.zeros(2, dtype=torch.float16), "fp8_e4m3")
    with pytest.raises(TypeError):
        allocate("bf16", (2,), dtype=torch.float16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_names_missing_and_wrong_parts(fmt):
    parts = encode(storage_input(torch.float32), fmt)
    for key in parts:  # each part missing in turn
        partial = {k: v for k, v in parts.items() if k != key}
        with pytest.raises(ValueError, match=rf"{fmt}.*missing \['{key}'\]"):
            decode(partial, fmt)
    with pytest.raises(ValueError, match="unexpected \\['extra'\\]"):
        decode({**parts, "extra": parts["data"]}, fmt)
    with pytest.raises(TypeError, match="tuple"):
        decode(tuple(parts.values()), fmt)
    for key, v in parts.items():  # a part of the wrong shape or dtype is named
        if key != "data":  # (data sets the logical shape: the other parts are then named)
            with pytest.raises(ValueError, match=rf"{fmt} part '{key}'.*shape"):
                decode({**parts, key: v[..., :1] if v.dim() else v[None]}, fmt)
        elif len(parts) > 1:
            with pytest.raises(ValueError, match=rf"{fmt} part"):
                decode({**parts, key: v[:1]}, fmt)
        with pytest.raises(ValueError, match=rf"{fmt} part '{key}'"):
            decode({**parts, key: v.view(torch.int8) if v.element_size() == 1 else v.double()},
                   fmt)
    assert torch.equal(decode(parts, fmt), quantize(storage_input(torch.float32), fmt))
