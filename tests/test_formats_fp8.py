"""Tests of replayssm.formats, scaled fp8: one float32 scale per last-dim row, so the error is
independent of the magnitude and nothing saturates (references: test_formats.py's grids)."""
from __future__ import annotations

import math

import pytest
import torch

from replayssm.formats import ROUNDINGS, allocate, decode, encode, max_finite, quantize
from test_formats import SCALED, fp8_reference, fp8_scale, grid_nearest, neighbours, positive_grid  # noqa: F401

# ----------------------------------------------------------------------------------------------
# scaled fp8 (one float32 scale per last-dim row)
# ----------------------------------------------------------------------------------------------

F32_MAX = torch.finfo(torch.float32).max
# Worst error relative to the row amax: half an ulp of the top binade over the top (16 / 448,
# 4096 / 57344).
FP8_WORST = {"fp8_e4m3": 1 / 28, "fp8_e5m2": 1 / 14}


def fp8_rows(dtype) -> torch.Tensor:
    """`[5, 6, 64]` normals, every last-dim row at its own magnitude (2**-100 .. 2**100 for
    float64, within float32 for float32), plus zeros, an all-zero row, float32 subnormals and
    rows at the float32 maximum."""
    g = torch.Generator().manual_seed(12)
    lo_e, hi_e = (-100, 100) if dtype == torch.float64 else (-120, 120)
    x = torch.randn(5, 6, 64, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(lo_e, hi_e, (5, 6, 1), generator=g).double())
    x[0, 0, ::3] = 0.0
    x[0, 1] = 0.0
    x[0, 2] *= 2.0 ** -140 / x[0, 2].abs().max()  # subnormal float32 amax (subnormal scale)
    x[0, 3, :3] = torch.tensor([F32_MAX, -F32_MAX, 1.0])
    x[0, 4, :2] = torch.tensor([F32_MAX, 3e38])
    return x.to(dtype)


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_fp8_matches_reference(fmt, dtype):
    x = fp8_rows(dtype)
    q = quantize(x, fmt)
    ref, s, y = fp8_reference(x, fmt)
    assert torch.equal(q, ref.to(dtype))
    assert torch.isfinite(q).all()  # also at the float32 maximum
    parts = encode(x, fmt)
    assert torch.equal(parts["scale"].double(), s)
    assert torch.equal(parts["data"].double(), grid_nearest(y, positive_grid(fmt)))
    # the scale is as tight as float32 allows: the amax lands within 2**-23 below the top,
    # never above it (the subnormal-scale row and the all-zero row, scale 1, excepted)
    top = max_finite(fmt)
    r = x.double().abs().amax(-1) / s
    normal = s >= 2.0 ** -126
    normal[0, 1] = False
    assert s[0, 1] == 1.0 and not normal[0, 2]
    assert torch.all(r <= top) and torch.all(r[normal] >= top * (1 - 2.0 ** -23))


@pytest.mark.parametrize("fmt", SCALED)
def test_fp8_error_independent_of_magnitude(fmt):
    """Rows of order 1e-3, 1 and 1e3 round with the same relative error (unscaled e4m3 had
    about 0.8 mean relative error at 1e-3, in its subnormals, and saturated at 1e3)."""
    g = torch.Generator().manual_seed(13)
    base = torch.randn(256, 64, generator=g, dtype=torch.float64)
    means = []
    for mag in (1e-3, 1.0, 1e3):
        for dtype in (torch.float32, torch.float64):
            x = (base * mag).to(dtype)
            err = (quantize(x, fmt) - x).double().abs()
            amax = x.double().abs().amax(-1, keepdim=True)
            slop = 2.0 ** -24 if dtype == torch.float32 else 0.0  # the final cast to float32
            assert torch.all(err / amax <= FP8_WORST[fmt] * (1 + 2.0 ** -22) + slop)
            means.append((err / x.double().abs()).mean().item())
    limit = {"fp8_e4m3": 3e-2, "fp8_e5m2": 6e-2}[fmt]
    assert max(means) < limit, means
    assert max(means) < 1.05 * min(means), means


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_fp8_power_of_two_rescaling_is_exact(fmt, rounding):
    g = torch.Generator().manual_seed(14)
    x = torch.randn(4, 3, 32, generator=g)
    st_ = torch.arange(4)
    q = quantize(x, fmt, rounding, seed=1, stream=st_)
    for k in (-100, -30, 17, 90):  # scales stay normal float32: same elements, scaled
        qk = quantize(x * 2.0 ** k, fmt, rounding, seed=1, stream=st_)
        assert torch.equal(qk, q * 2.0 ** k), k


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_fp8_no_saturation(fmt, rounding):
    x = torch.tensor([[1e6, -3e5, 7.0, 464.0], [-1e6, 2e5, 0.25, 1e-3],
                      [F32_MAX, -3e38, 1.0, 0.0]], dtype=torch.float32)
    q = quantize(x, fmt, rounding, seed=2)
    amax = x.double().abs().amax(-1, keepdim=True)
    assert torch.isfinite(q).all()
    assert torch.all((q.double() - x.double()).abs() <= 2 * FP8_WORST[fmt] * amax)
    # the amax element keeps its value up to the scale's rounding up to float32 (2**-23) and
    # the final cast to float32 (2**-24)
    assert torch.all((q[:, 0].double() / x[:, 0].double() - 1).abs() <= 1.5 * 2.0 ** -23)
    assert not (q.abs() == max_finite(fmt)).any()


def same_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN where the other has NaN, same signs of zeros."""
    return (torch.equal(torch.isnan(a), torch.isnan(b))
            and torch.equal(a.nan_to_num(), b.nan_to_num())
            and torch.equal(torch.signbit(a), torch.signbit(b)))


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_fp8_nan_inf_and_zeros(fmt, rounding):
    nan, inf, m = math.nan, math.inf, max_finite(fmt)
    x = torch.tensor([[nan, 2.0, -1.0, 0.0, -0.0],
                      [inf, -inf, 1.0, 0.5, 0.0],
                      [nan, inf, -inf, 0.0, -0.0],
                      [0.0, -0.0, 0.0, -0.0, 0.0]], dtype=torch.float64)
    q = quantize(x, fmt, rounding, seed=3, stream=torch.arange(4))
    s = encode(x, fmt, rounding, seed=3, stream=torch.arange(4))["scale"].double()
    # NaN stays NaN and does not spoil its row: the rest rounds as with a zero in its place
    # (same stream and indices, so the same uniforms)
    assert torch.isnan(q[0, 0]) and torch.isnan(q[2, 0])
    x0 = x[:1].clone()
    x0[0, 0] = 0.0
    q0 = quantize(x0, fmt, rounding, seed=3, stream=torch.tensor([0]))
    assert torch.equal(q[0, 1:], q0[0, 1:])
    assert s[0] == fp8_scale(torch.tensor([2.0]), fmt)
    # ±inf saturate to ±max_finite * scale, the scale from the finite amax (1 if none)
    assert s[1] == fp8_scale(torch.tensor([1.0]), fmt) and s[2] == 1.0 and s[3] == 1.0
    assert q[1, 0] == m * s[1] and q[1, 1] == -m * s[1] and q[1, 2] == m * s[1]
    assert q[2, 1] == m and q[2, 2] == -m
    # zeros keep their sign, an all-zero row decodes to its signed zeros
    z = x == 0
    assert torch.all(q[z] == 0) and torch.equal(torch.signbit(q[z]), torch.signbit(x[z]))
    back = decode(encode(x, fmt, rounding, seed=3, stream=torch.arange(4)), fmt, torch.float64)
    assert same_with_nan(back, q)


@pytest.mark.parametrize("fmt", SCALED)
def test_fp8_stochastic_unbiased_with_scale(fmt):
    """Stochastic rounding on the scaled grid: each value is a scaled neighbour of x, and the
    mean over many streams is x, for rows whose scales are not powers of two."""
    n = 4096
    g = torch.Generator().manual_seed(15)
    x = torch.randn(3, 32, generator=g, dtype=torch.float64) * torch.tensor([[1e-3], [1.0],
                                                                              [1e3]])
    X = x[None].expand(n, -1, -1).contiguous()
    q = quantize(X, fmt, "stochastic", seed=4, stream=torch.arange(n) * 5)
    lo, hi = neighbours(x, fmt)
    assert torch.all((q.abs() == lo) | (q.abs() == hi))
    step = hi - lo
    assert (step > 0).all() and (torch.frexp(fp8_scale(x, fmt))[0] != 0.5).all()
    err = q.mean(0) - x
    assert torch.all(err.abs() <= 6 * step / (2 * math.sqrt(n)))
    pooled = 6 / (2 * math.sqrt(n * x.numel()))
    assert abs((err / step).mean().item()) <= pooled
    assert abs((err * x.sign() / step).mean().item()) <= pooled
    assert ((quantize(x, fmt) - x).abs() > 6 * step / (2 * math.sqrt(n))).float().mean() > 0.5


@pytest.mark.parametrize("fmt", SCALED)
def test_fp8_rows_of_0d_1d_and_empty(fmt):
    """A 1-D tensor is one row (one scale), a 0-d tensor one row of one element."""
    v = torch.tensor([3.0, -0.01, 100.0])
    parts = encode(v, fmt)
    assert parts["scale"].shape == () and parts["scale"] == fp8_scale(v, fmt)
    assert torch.equal(quantize(v, fmt), quantize(v[None], fmt)[0])
    assert torch.equal(decode(parts, fmt), quantize(v, fmt))
    z = torch.tensor(3.0, dtype=torch.float64)
    pz = encode(z, fmt, "stochastic", seed=1)
    assert pz["data"].shape == () and pz["scale"].shape == ()
    assert torch.equal(quantize(z, fmt), quantize(z[None], fmt)[0])
    assert abs(quantize(z, fmt).item() / 3 - 1) <= 2.0 ** -23  # the amax maps to the top
    assert torch.equal(decode(pz, fmt, torch.float64), quantize(z, fmt, "stochastic", seed=1))
    assert {k: t.shape for k, t in allocate(fmt, ()).items()} == {"data": (), "scale": ()}
    e = encode(torch.zeros(3, 0), fmt)
    assert e["data"].shape == (3, 0) and torch.equal(e["scale"], torch.ones(3))
    assert decode(e, fmt).shape == (3, 0)
