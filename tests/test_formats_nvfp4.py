"""Tests of replayssm.formats' NVFP4 (e2m1 codes packed two per byte, an e4m3 scale per 16
elements rounded up, an fp32 tensor scale per matrix): grid values round-trip, random values
within half a spacing of an independent reference, ties to the even code, the packed layout,
shape errors, unbiased stochastic rounding. References as in test_formats.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from replayssm.formats import ROUNDINGS, allocate, decode, encode, quantize
from test_formats import E2M1, grid_nearest, grid_neighbours, positive_grid


def e4m3_round_up(s: torch.Tensor) -> torch.Tensor:
    p = positive_grid("fp8_e4m3")
    k = torch.searchsorted(p, s.clamp(max=448.0), right=False)
    return p[k]


def nvfp4_reference(x: torch.Tensor):
    """Independent NVFP4 nearest: (result in float64, sb, ts) for x `[..., R, K]`."""
    x = x.double()
    amax = x.abs().amax(dim=(-2, -1))
    exact = amax / 2688  # rounded up to float32
    f = exact.float()
    f = torch.where(f.double() < exact, torch.nextafter(f, torch.tensor(math.inf)), f)
    ts = torch.where(amax == 0, 1.0, f.double())
    xb = x.reshape(*x.shape[:-1], -1, 16)
    sb = e4m3_round_up(xb.abs().amax(-1) / (6 * ts[..., None, None]))
    scale = (sb * ts[..., None, None])[..., None]
    y = xb / torch.where(scale > 0, scale, 1.0)
    q = grid_nearest(y, E2M1) * scale
    return q.reshape(x.shape), sb, ts, y.reshape(x.shape)


def grid_matrix(seed: int) -> torch.Tensor:
    """`[3, 4, 64]` float32 values exactly on NVFP4 grids: per matrix a power-of-two tensor
    scale, per block a random e4m3 scale (448 in one block, 0 in another) and codes, each
    non-zero block holding a ±6."""
    g = torch.Generator().manual_seed(seed)
    p = positive_grid("fp8_e4m3")[1:]
    ts = torch.exp2(torch.tensor([-10.0, 0.0, 5.0]))
    sb = p[torch.randint(len(p), (3, 4, 4), generator=g)]
    sb[:, 0, 0] = 448.0
    sb[:, 1, 1] = 0.0
    codes = E2M1[torch.randint(8, (3, 4, 4, 16), generator=g)]
    codes[..., 3] = 6.0
    sign = torch.where(torch.rand(3, 4, 4, 16, generator=g) < 0.5, -1.0, 1.0)
    v = sign * codes * sb[..., None] * ts[:, None, None, None]
    return v.reshape(3, 4, 64).float(), sb, ts


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_nvfp4_grid_values_round_trip(rounding, dtype):
    x, sb, ts = grid_matrix(seed=1)
    x = x.to(dtype)
    assert torch.equal(quantize(x, "nvfp4", rounding, seed=2), x)
    parts = encode(x, "nvfp4", rounding, seed=2)
    assert torch.equal(parts["scale"].double(), sb)
    assert torch.equal(parts["tensor_scale"].double(), ts)
    assert torch.equal(decode(parts, "nvfp4", dtype), x)


def half_spacing(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_nvfp4_random_within_bound(dtype):
    g = torch.Generator().manual_seed(4)
    scale = torch.exp2(torch.randint(-20, 20, (6, 1, 1), generator=g).double())
    x = torch.randn(6, 8, 64, generator=g, dtype=torch.float64) * scale
    x[:, :, 16:32] *= 1e-4  # blocks much smaller than the matrix amax (small block scales)
    x[0, 0, 32:48] = 0.0
    x = x.to(dtype)
    q = quantize(x, "nvfp4")
    ref, sb, ts, y = nvfp4_reference(x)
    sbts = (sb * ts[..., None, None]).repeat_interleave(16, dim=-1)
    # float32 results are the float64 value rounded once more: allow 2^-24 relative
    slop = x.double().abs() * (2.0 ** -23 if dtype == torch.float32 else 0.0)
    assert torch.all((x.double() - q.double()).abs() <= half_spacing(y) * sbts + slop)
    assert torch.all(y.abs() <= 6)
    assert torch.equal(q, ref.to(dtype))  # and it is exactly the reference (ties to even)
    parts = encode(x, "nvfp4")
    assert torch.equal(parts["scale"].double(), sb)
    assert torch.equal(parts["tensor_scale"].double(), ts)


def test_nvfp4_ties_to_even_code():
    ts = 2.0 ** -1  # matrix amax 1344 = 6 * 448 * ts in the first block
    first = torch.zeros(16, dtype=torch.float64)
    first[0] = 6 * 448 * ts
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0,
                         -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0], dtype=torch.float64)
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0,
                         -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, -6.0], dtype=torch.float64)
    x = torch.cat([first, ties * ts])[None]  # [1, 32]; second block has sb = 1
    q = quantize(x, "nvfp4")
    assert torch.equal(q[0, 16:], want * ts)
    assert torch.equal(q[0, :16], first)


def test_nvfp4_packed_layout():
    ts = 2.0 ** -6
    r0b0 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]  # sb 448
    r0b1 = [-6, 6] + [0.5] * 14  # sb 2
    r1b0 = [3, -2] + [0] * 13 + [6]  # sb 2^-6 (smallest normal e4m3)
    r1b1 = [0] * 16  # sb 0
    y = torch.tensor([r0b0 + r0b1, r1b0 + r1b1], dtype=torch.float64)
    sb = torch.tensor([[448.0, 2.0], [2.0 ** -6, 0.0]], dtype=torch.float64)
    x = (y * sb.repeat_interleave(16, dim=-1) * ts).float()  # [R=2, K=32]
    parts = encode(x, "nvfp4")
    want = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE,
                          0x7F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11],
                         [0xC5, 0, 0, 0, 0, 0, 0, 0x70, 0, 0, 0, 0, 0, 0, 0, 0]],
                        dtype=torch.uint8)
    assert parts["data"].dtype == torch.uint8
    assert torch.equal(parts["data"], want)
    assert parts["scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(parts["scale"].view(torch.uint8),
                       torch.tensor([[0x7E, 0x40], [0x08, 0x00]], dtype=torch.uint8))
    assert parts["tensor_scale"].dtype == torch.float32 and parts["tensor_scale"].shape == ()
    assert parts["tensor_scale"].view(torch.int32).item() == 0x3C800000
    back = decode(parts, "nvfp4")
    assert torch.equal(back, x) and torch.equal(quantize(x, "nvfp4"), x)
    assert torch.equal(torch.signbit(back), torch.signbit(x))  # -0 kept


def test_nvfp4_shape_errors():
    for call in (lambda: quantize(torch.zeros(2, 24), "nvfp4"),
                 lambda: encode(torch.zeros(3, 2, 8), "nvfp4"),
                 lambda: allocate("nvfp4", (2, 24))):
        with pytest.raises(ValueError, match="16"):
            call()
    with pytest.raises(ValueError, match="R, K"):
        quantize(torch.zeros(32), "nvfp4")


def test_nvfp4_stochastic_unbiased():
    n = 4096
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 32, generator=g, dtype=torch.float64)
    x[1, 16:] *= 0.01
    X = x[None].expand(n, -1, -1).contiguous()  # n copies of one matrix, one stream each
    q = quantize(X, "nvfp4", "stochastic", seed=1, stream=torch.arange(n) * 3)
    _, sb, ts, y = nvfp4_reference(x)
    sbts = (sb * ts).repeat_interleave(16, dim=-1)
    lo, hi, _ = grid_neighbours(y.abs(), E2M1)
    qy = (q / sbts).abs()  # exact: q = code * sb * ts was computed exactly in float64
    assert torch.all((qy == lo) | (qy == hi))
    step = (hi - lo) * sbts
    bound = 6 * step / (2 * math.sqrt(n))  # per-draw variance <= step^2 / 4, as for elements
    err = q.mean(0) - x
    assert torch.all(err.abs() <= bound)
    pooled = 6 / (2 * math.sqrt(n * x.numel()))
    assert abs((err / step).mean().item()) <= pooled
    assert abs((err * x.sign() / step).mean().item()) <= pooled
    assert ((quantize(x, "nvfp4") - x).abs() > bound).float().mean() > 0.5
