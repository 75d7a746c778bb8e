"""Number formats for the two checkpoints of SPEC section 5: rounding to a format's grid and real
low-precision storage.

Two layers:

* `quantize(x, fmt, rounding)` returns, in `x`'s dtype, the value that storing `x` in `fmt` and
  reading it back gives. It is the reference for what a kernel must write.
* `allocate` / `encode` / `decode` hold a pool of checkpoints in the real storage dtype
  (`bfloat16`, `float8_e4m3fn` with its scales, packed NVFP4 ...).
  `decode(encode(x)) == quantize(x)` exactly.

Formats (`FORMATS`):

* element formats `fp32`, `bf16`, `fp16`: one sign, exponent and mantissa per element, with
  subnormals, unscaled.
* scaled fp8 `fp8_e4m3` (the "fn" variant: no infinities, max 448) and `fp8_e5m2` (max 57344):
  the same kind of elements, times one float32 scale per row along the last dim (`[..., K]`
  has scales `[...]`), chosen so that the row's amax maps to the top of the element range, as
  serving engines store fp8 states. The relative error is then the same at every magnitude
  (unscaled e4m3 goes subnormal below 2**-6 and saturates at 448). A 1-D tensor is one row;
  a 0-d tensor is one row of one element.
* `nvfp4`: e2m1 elements (`0, 0.5, 1, 1.5, 2, 3, 4, 6`, signed), one fp8-e4m3 block scale per
  16 contiguous elements along the last dim, one fp32 scale per trailing `[R, K]` matrix.

Roundings (`ROUNDINGS`): `nearest` (round half to even, as IEEE) and `stochastic` (round up with
probability equal to the distance from the lower neighbour in ulps: unbiased). Stochastic
rounding draws its uniforms from a counter-based hash of `(seed, stream, element index)`, so
results are reproducible and the same on every device.

All arithmetic is done in float64, which is exact for these grids: a float32 or float64 input
is split into an integer number of ulps and a fraction without any rounding error. (Division
by an fp8 row scale is the one rounded operation; for a float32 input the float64 quotient can
neither reach nor cross a rounding tie, so decisions are still exact.)
Out-of-range magnitudes of the unscaled formats saturate to `max_finite(fmt)` (never inf); the
scaled formats adapt to the data and saturate only ±inf (fp8: to the row's `±max_finite *
scale`). NaN stays NaN, and zeros keep their sign.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4")
ROUNDINGS = ("nearest", "stochastic")

# Element formats: (mantissa bits, minimum normal exponent, maximum exponent, storage dtype).
_ELEMENT = {
    "fp32": (23, -126, 127, torch.float32),
    "bf16": (7, -126, 127, torch.bfloat16),
    "fp16": (10, -14, 15, torch.float16),
    "fp8_e4m3": (3, -6, 8, torch.float8_e4m3fn),
    "fp8_e5m2": (2, -14, 15, torch.float8_e5m2),
}
_MAX_FINITE = {
    "fp32": (2.0 - 2.0 ** -23) * 2.0 ** 127,
    "bf16": (2.0 - 2.0 ** -7) * 2.0 ** 127,
    "fp16": 65504.0,
    "fp8_e4m3": 448.0,  # S.1111.111 is NaN in the "fn" variant, so the top mantissa is 1.75
    "fp8_e5m2": 57344.0,
    "nvfp4": 6.0 * 448.0,  # relative to the tensor scale; see `max_finite`
}
# fp8 elements carry one float32 scale per last-dim row: unscaled e4m3 has normals only in
# 2**-6..448, too narrow for states (coarse subnormals below, saturation above).
_SCALED_FP8 = ("fp8_e4m3", "fp8_e5m2")

# e2m1 (the NVFP4 element): 1 mantissa bit, minimum exponent 0, maximum exponent 2, max 6.
_E2M1 = (1, 0, 2, 6.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # value of code 0..7
NVFP4_BLOCK = 16
# The tensor scale maps the matrix amax to (largest e2m1) * (largest e4m3).
_NVFP4_AMAX = 6.0 * 448.0
_F32_TINY = 2.0 ** -149  # smallest positive float32 (subnormal)
_F32_MAX = _MAX_FINITE["fp32"]

_M32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------
# names and sizes
# ----------------------------------------------------------------------------------------------

def check_format(fmt: str) -> str:
    """Return `fmt` if it is one of `FORMATS`; raise `ValueError` naming it otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    return fmt


def check_rounding(rounding: str) -> str:
    """Return `rounding` if it is one of `ROUNDINGS`; raise `ValueError` naming it otherwise."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {ROUNDINGS}")
    return rounding


def bytes_per_element(fmt: str, k: Optional[int] = None) -> float:
    """Storage bytes per state element: fp32 4, bf16/fp16 2, fp8 1 (`1 + 4/k` given `k`),
    nvfp4 `0.5 + 1/16`.

    `k` is the length of the last dim (a row). fp8 stores one float32 scale per row, which is
    counted only when `k` is given. NVFP4 counts its half-byte element and its share of one e4m3
    scale per 16 elements; its one fp32 scale per matrix is always ignored.
    """
    check_format(fmt)
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"k must be a positive int (the last dim), got {k!r}")
    if fmt == "nvfp4":
        return 0.5 + 1.0 / NVFP4_BLOCK
    size = float(torch.empty((), dtype=_ELEMENT[fmt][3]).element_size())
    if fmt in _SCALED_FP8 and k is not None:
        size += 4.0 / k
    return size


def max_finite(fmt: str) -> float:
    """Largest finite magnitude of `fmt`'s elements, in units of its scale where it has one.

    fp16 65504, bf16 and fp32 their maxima: the saturation points of `quantize`. e4m3 ("fn",
    no infinities) 448 and e5m2 57344 are the largest elements, in units of the row scale; for
    `nvfp4` this is `6 * 448`, the largest value in units of the tensor scale. The scales adapt
    to the data, so the representable range does too: the scaled formats never saturate a
    finite float32 input (fp8 saturates ±inf to `±max_finite * scale`).
    """
    return _MAX_FINITE[check_format(fmt)]


def storage_dtype(fmt: str) -> torch.dtype:
    """Torch dtype of the `"data"` part of `fmt` (`uint8` for nvfp4, two codes per byte)."""
    check_format(fmt)
    return torch.uint8 if fmt == "nvfp4" else _ELEMENT[fmt][3]


# ----------------------------------------------------------------------------------------------
# reproducible uniforms
# ----------------------------------------------------------------------------------------------

def _mul32(x: Tensor, c: int) -> Tensor:
    """`(x * c) mod 2**32` for `0 <= x < 2**32` in int64 without overflow (c split in halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit avalanche mix (a bijection of `[0, 2**32)`), on int64 tensors or Python ints."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _as_stream(stream, rows: int, device) -> Tensor:
    """Validate `stream` (`[rows]` int tensor, a Python int, or None) -> int64 `[rows]`."""
    if stream is None:
        return torch.zeros(rows, dtype=torch.int64, device=device)
    if isinstance(stream, int):
        return torch.full((rows,), stream, dtype=torch.int64, device=device)
    if not isinstance(stream, Tensor) or stream.is_floating_point() or stream.is_complex():
        raise TypeError(f"stream must be an integer tensor of shape [{rows}], got {stream!r}")
    if tuple(stream.shape) != (rows,):
        raise ValueError(f"stream must have shape [{rows}] (one per leading row), "
                         f"got {tuple(stream.shape)}")
    return stream.to(device=device, dtype=torch.int64)


def uniform(shape, seed: int, stream: Optional[Tensor] = None, device=None) -> Tensor:
    """Reproducible uniforms in `[0, 1)`, float64, of shape `shape` (`[B, ...]`).

    Element `u[b, ...]` is a function of `(seed, stream[b], i)` only, where `i` is the element's
    flat index within its row (`u[b].flatten()[i]`): the same triple gives the same value on any
    device and for any `B`. `stream` is an int64 tensor `[B]` (e.g. one per pool slot and flush
    count), a Python int for all rows, or None (zeros). A 0-d `shape` is one row of one element.

    Each uniform has 53 random bits (two chained 32-bit mixes per half), so
    `P(u < f) = f` for every `f` that is a multiple of `2**-53`.
    """
    shape = tuple(int(s) for s in shape)
    if device is None and isinstance(stream, Tensor):
        device = stream.device
    rows = shape[0] if shape else 1
    n = 1
    for s in shape[1:]:
        n *= s
    if 2 * n > 2 ** 32:
        raise ValueError(f"rows of {n} elements are too long for the 32-bit counter")
    st = _as_stream(stream, rows, device)

    # Per-row keys: a chain of mixes through the seed and stream words (every bit matters).
    seed = int(seed)
    # the seed's words mixed as Python ints: no tensor from host data (a CUDA graph can capture it)
    k = _mix32((seed & _M32) ^ 0x9E3779B9)
    k = _mix32(k ^ ((seed >> 32) & _M32))
    k1 = _mix32(k ^ (st & _M32))
    k1 = _mix32(k1 ^ ((st >> 32) & _M32))[:, None]  # [B, 1]
    k2 = _mix32(k1 ^ 0x85EBCA6B)

    # Per-element counters 2i and 2i+1; each word is two chained keyed mixes.
    c = 2 * torch.arange(n, dtype=torch.int64, device=device)[None, :]  # [1, n]
    h0 = _mix32(_mix32(c ^ k1) ^ k2)
    h1 = _mix32(_mix32((c + 1) ^ k1) ^ k2)
    bits = ((h0 >> 6) << 27) | (h1 >> 5)  # 26 + 27 = 53 bits
    u = bits.to(torch.float64) * 2.0 ** -53
    return u.reshape(shape)


# ----------------------------------------------------------------------------------------------
# rounding to a grid
# ----------------------------------------------------------------------------------------------

def _pow2(e: Tensor) -> Tensor:
    """Exact `2.0 ** e` in float64 for an integer tensor `e` in `[-1022, 1023]` (bit-built)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _round_magnitude(a: Tensor, mbits: int, emin: int, emax: int, maxval: float, mode: str,
                     u: Optional[Tensor] = None) -> Tensor:
    """Round float64 magnitudes `a >= 0` (any shape; NaN allowed) to a floating grid.

    The grid has `mbits` mantissa bits, normal exponents `emin..emax` and subnormals below
    `2**emin`; magnitudes above `maxval` (a grid point) saturate to it. `mode` is `"nearest"`
    (half to even), `"stochastic"` (up with probability = fraction of an ulp, from `u`) or
    `"up"` (towards +inf).
    """
    a = torch.clamp(a, max=maxval)  # saturation (NaN passes through)
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1): floor(log2 a) = e - 1
    e = torch.clamp(e - 1, min=emin, max=emax)  # subnormals share the ulp of 2**emin
    ulp = _pow2(e - mbits)
    t = a / ulp  # exact: division by a power of two
    lo = torch.floor(t)
    frac = t - lo  # exact
    if mode == "nearest":
        up = (frac > 0.5) | ((frac == 0.5) & (torch.fmod(lo, 2.0) == 1.0))
    elif mode == "stochastic":
        up = u < frac
    elif mode == "up":
        up = frac > 0
    else:  # pragma: no cover - internal
        raise ValueError(mode)
    return (lo + up.to(lo.dtype)) * ulp


def _check_float(x: Tensor) -> None:
    if not isinstance(x, Tensor) or x.dtype not in (torch.float32, torch.float64):
        got = x.dtype if isinstance(x, Tensor) else type(x)
        raise TypeError(f"x must be a float32 or float64 tensor, got {got}")


def _uniforms_like(x: Tensor, seed: int, stream) -> Tensor:
    shape = x.shape if x.dim() > 0 else (1,)
    return uniform(shape, seed, stream, device=x.device).reshape(x.shape)


def _f32_scale(amax: Tensor, top: float) -> Tensor:
    """The float32 scale (as float64) mapping `amax` to `top`: `amax / top` rounded UP to
    float32, within float32's range, 1 where `amax == 0` (NaN amax gives NaN)."""
    exact = amax / top
    s32 = exact.to(torch.float32)
    # Rounded up so that amax / scale <= top: round-to-nearest could put it a hair below and
    # make the largest element saturate.
    s32 = torch.where(s32.to(torch.float64) < exact,
                      torch.nextafter(s32, torch.full_like(s32, float("inf"))), s32)
    s = s32.to(torch.float64).clamp(min=_F32_TINY, max=_F32_MAX)
    return torch.where(amax == 0, torch.ones_like(s), s)


def _row_scale(s: Tensor, value: Tensor) -> Tensor:
    """A per-row scale `[...]` broadcastable against `value` `[..., K]` (both 0-d: as is)."""
    return s[..., None] if value.dim() else s


def _fp8_split(x: Tensor, fmt: str, rounding: str, seed: int, stream):
    """Core of scaled fp8: `x` `[..., K]` -> (signed element on `fmt`'s grid `[..., K]`
    float64, row scale `[...]` float64 holding a float32 value)."""
    m, emin, emax, _ = _ELEMENT[fmt]
    top = _MAX_FINITE[fmt]
    x64 = x.to(torch.float64)
    # NaN and inf are left out of the amax so that one of them does not spoil its row; an
    # empty row (K = 0) sums to an amax of 0 where amax() would raise.
    a = torch.where(torch.isfinite(x64), x64.abs(), torch.zeros_like(x64))
    a = a if x.dim() else a[None]  # a 0-d x: one row of one element
    amax = a.amax(dim=-1) if a.shape[-1] else a.sum(dim=-1)
    scale = _f32_scale(amax, top)
    y = x64 / _row_scale(scale, x64)  # |y| <= top: the scale was rounded up
    u = _uniforms_like(x, seed, stream) if rounding == "stochastic" else None
    mag = _round_magnitude(y.abs(), m, emin, emax, top, rounding, u)  # clamp: ±inf only
    return torch.copysign(mag, x64), scale


def _fp8_value(v: Tensor, scale: Tensor) -> Tensor:
    """`v * scale` in float64 (exact: at most 4 x 24 significant bits), `[..., K]`."""
    return v * _row_scale(scale, v)


def _nvfp4_split(x: Tensor, rounding: str, seed: int, stream):
    """Core of NVFP4: `x` `[..., R, K]` -> (signed e2m1 value `[..., R, K//16, 16]` float64,
    block scale `sb` `[..., R, K//16]` float64 on the e4m3 grid, tensor scale `ts` `[...]`
    float64 holding a float32 value)."""
    if x.dim() < 2:
        raise ValueError(f"nvfp4 needs x of shape [..., R, K], got {tuple(x.shape)}")
    K = x.shape[-1]
    if K % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs the last dim K divisible by {NVFP4_BLOCK}, got K={K}")
    x64 = x.to(torch.float64)
    amax = x64.abs().amax(dim=(-2, -1))  # [...]
    ts = _f32_scale(amax, _NVFP4_AMAX)  # so that amax / (6 * ts) <= 448
    ts_b = ts[..., None, None]  # [..., 1, 1]

    xb = x64.reshape(*x.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    bmax = xb.abs().amax(dim=-1)  # [..., R, K//16]
    # Block scale rounded UP to e4m3 so that |x / (sb * ts)| <= 6 (no saturation); max 448.
    m, emin, emax, _ = _ELEMENT["fp8_e4m3"]
    sb = _round_magnitude(bmax / (6.0 * ts_b), m, emin, emax, 448.0, "up")
    denom = sb * ts_b
    y = xb / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]

    u = _uniforms_like(x, seed, stream).reshape(xb.shape) if rounding == "stochastic" else None
    # (the e2m1 clamp at 6 only guards against float rounding of ts/sb; NaN passes through)
    mag = _round_magnitude(y.abs(), *_E2M1, rounding, u)
    return torch.copysign(mag, xb), sb, ts


def _nvfp4_value(v: Tensor, sb: Tensor, ts: Tensor) -> Tensor:
    """`v * sb * ts` in float64 (exact: 2 x 4 x 24 significant bits), `[..., R, K]`."""
    out = (v * sb[..., None]) * ts[..., None, None, None]
    return out.reshape(*out.shape[:-2], -1)


def quantize(x: Tensor, fmt: str, rounding: str = "nearest", *, seed: int = 0,
             stream: Optional[Tensor] = None) -> Tensor:
    """Round `x` to `fmt`'s grid: the value storing `x` in `fmt` and reading it back gives.

    Args:
        x: float32 or float64 tensor. Any shape for element formats (fp8: one scale per row
            `x[i, ..., j, :]` along the last dim); `[..., R, K]` with `K % 16 == 0` for
            `nvfp4` (one tensor scale per trailing `[R, K]` matrix).
        fmt: one of `FORMATS`.
        rounding: `"nearest"` (half to even; equals `x.to(bfloat16 / float16)` on in-range
            float32 inputs, and `x.to(float8_*)` on rows whose amax is `max_finite(fmt)`, whose
            scale is 1) or `"stochastic"` (unbiased: `E[quantize(x)] = x`).
        seed, stream: select the uniforms of stochastic rounding (see `uniform`): `stream` is an
            int64 tensor `[x.shape[0]]`, one per leading row (None: zeros). The element index is
            the flat index within `x[b]`; note that for a 1-D `x` each row is one element, so
            all elements of one stream share index 0.

    Returns: a tensor of `x`'s dtype and shape. fp32/bf16/fp16 saturate to `±max_finite(fmt)`
    (also for ±inf), keep NaN and signed zeros. fp8 computes per row the scale
    `s = amax / max_finite(fmt)` rounded up to float32 (amax over the row's finite elements; 1
    for a row without non-zero finite ones), so `|x / s| <= max_finite`, rounds `x / s`
    (computed in float64) to the element grid and returns `element * s` computed in float64,
    then cast: NaN stays NaN (its row unaffected), ±inf saturate to `±max_finite * s`, zeros
    keep their sign. Scales are float32, which only float64 input can exceed: a row beyond
    `max_finite * float32 max` saturates there, and one whose amax is below
    `max_finite * 2**-149` takes the scale `2**-149` (elements under float32's range lose
    precision). NVFP4 computes the tensor scale
    `ts = amax(|matrix|) / (6 * 448)` rounded up to float32 (1 for an all-zero matrix), block
    scales `sb = e4m3 round-up(amax(|block|) / (6 * ts))`, so `|x / (sb * ts)| <= 6`, and rounds
    `x / (sb * ts)` to e2m1; the result is `e2m1 * sb * ts` computed in float64, then cast.
    NVFP4 needs finite input: a NaN or inf in a matrix spoils the whole matrix.
    """
    check_format(fmt)
    check_rounding(rounding)
    _check_float(x)
    if fmt == "nvfp4":
        v, sb, ts = _nvfp4_split(x, rounding, seed, stream)
        return _nvfp4_value(v, sb, ts).to(x.dtype)
    if fmt in _SCALED_FP8:
        return _fp8_value(*_fp8_split(x, fmt, rounding, seed, stream)).to(x.dtype)
    m, emin, emax, _ = _ELEMENT[fmt]
    x64 = x.to(torch.float64)
    u = _uniforms_like(x, seed, stream) if rounding == "stochastic" else None
    mag = _round_magnitude(x64.abs(), m, emin, emax, _MAX_FINITE[fmt], rounding, u)
    return torch.copysign(mag, x64).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# storage
# ----------------------------------------------------------------------------------------------

def _nvfp4_shapes(shape: tuple) -> dict:
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"nvfp4 needs a shape [..., R, K], got {shape}")
    if shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs the last dim K divisible by {NVFP4_BLOCK}, "
                         f"got K={shape[-1]}")
    K = shape[-1]
    return {"data": shape[:-1] + (K // 2,), "scale": shape[:-1] + (K // NVFP4_BLOCK,),
            "tensor_scale": shape[:-2]}


_NVFP4_DTYPES = {"data": torch.uint8, "scale": torch.float8_e4m3fn, "tensor_scale": torch.float32}


_PART_NAMES = {"nvfp4": tuple(_NVFP4_DTYPES), "fp8_e4m3": ("data", "scale"),
               "fp8_e5m2": ("data", "scale")}


def _layout(fmt: str, shape: tuple) -> dict:
    """`{part: (shape, dtype)}` of the storage of a logical `shape` in `fmt`."""
    shape = tuple(int(s) for s in shape)
    if fmt == "nvfp4":
        return {k: (s, _NVFP4_DTYPES[k]) for k, s in _nvfp4_shapes(shape).items()}
    out = {"data": (shape, _ELEMENT[fmt][3])}
    if fmt in _SCALED_FP8:
        out["scale"] = (shape[:-1], torch.float32)
    return out


def allocate(fmt: str, shape: tuple, device=None, dtype=torch.float32) -> dict:
    """Zero-filled storage for a tensor of logical shape `shape` in `fmt`.

    Element formats: `{"data": shape}` in the format's dtype (`float32` for fp32 whatever
    `dtype`, `bfloat16`, `float16`). fp8: `{"data": float8_e4m3fn / float8_e5m2 [shape],
    "scale": float32 [shape[:-1]]}` (a zero scale decodes to zeros like any zero part).
    NVFP4 (`shape = [..., R, K]`, `K % 16 == 0`): `{"data": uint8 [..., R, K//2],
    "scale": float8_e4m3fn [..., R, K//16], "tensor_scale": float32 [...]}`.
    Every part starts with `shape`'s leading dims, so a pool can assign
    `parts[key][slot_ids] = new[key]` key by key. `dtype` is the logical (compute) dtype,
    float32 or float64; it does not change the storage.
    """
    check_format(fmt)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    return {k: torch.zeros(s, dtype=dt, device=device)
            for k, (s, dt) in _layout(fmt, shape).items()}


def encode(x: Tensor, fmt: str, rounding: str = "nearest", *, seed: int = 0,
           stream: Optional[Tensor] = None) -> dict:
    """Store `x` (float32/float64, shapes as in `quantize`) in `fmt`; parts as in `allocate`.

    Rounding, `seed` and `stream` act as in `quantize`, and `decode(encode(x, ...)) ==
    quantize(x, ...)` exactly. fp8 stores the element (`x / scale` rounded) and the float32 row
    scale. NVFP4 packs two e2m1 codes per byte: element `2i` of a row in the low nibble, `2i+1`
    in the high nibble; nibble = `sign << 3 | code` where `code` indexes `E2M1_VALUES`.
    """
    check_format(fmt)
    check_rounding(rounding)
    _check_float(x)
    if fmt in _SCALED_FP8:
        v, scale = _fp8_split(x, fmt, rounding, seed, stream)
        # exact: v lies on the element grid, scale holds a float32 value
        return {"data": v.to(_ELEMENT[fmt][3]), "scale": scale.to(torch.float32)}
    if fmt != "nvfp4":
        q = quantize(x, fmt, rounding, seed=seed, stream=stream)
        return {"data": q.to(_ELEMENT[fmt][3])}  # exact: q lies on the grid
    v, sb, ts = _nvfp4_split(x, rounding, seed, stream)
    mag = v.abs()
    code = torch.where(mag < 2, 2 * mag, torch.where(mag < 4, mag + 2, mag / 2 + 4))
    nib = code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)
    nib = nib.reshape(x.shape)
    data = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return {"data": data, "scale": sb.to(torch.float8_e4m3fn),
            "tensor_scale": ts.to(torch.float32)}


def _check_parts(parts, fmt: str) -> None:
    """Raise unless `parts` holds exactly `fmt`'s parts, with the shapes and dtypes that
    `allocate` gives for the logical shape implied by `parts["data"]`."""
    if not isinstance(parts, dict):
        raise TypeError(f"parts must be a dict of tensors (from encode / allocate), "
                        f"got {type(parts).__name__}")
    want = _PART_NAMES.get(fmt, ("data",))
    missing = [k for k in want if k not in parts]
    extra = [k for k in parts if k not in want]
    if missing or extra:
        raise ValueError(f"{fmt} parts must be {list(want)}; missing {missing}, "
                         f"unexpected {extra}")
    bad = [k for k in want if not isinstance(parts[k], Tensor)]
    if bad:
        raise TypeError(f"{fmt} parts {bad} are not tensors")
    shape = data_shape = tuple(parts["data"].shape)
    try:
        if fmt == "nvfp4":  # two codes per byte
            shape = data_shape[:-1] + (2 * data_shape[-1],) if data_shape else ()
        layout = _layout(fmt, shape)
    except ValueError as e:
        raise ValueError(f"{fmt} part 'data' of shape {data_shape} holds no valid tensor: "
                         f"{e}") from None
    for k, (s, dt) in layout.items():
        if tuple(parts[k].shape) != s or parts[k].dtype != dt:
            raise ValueError(f"{fmt} part {k!r} must be {dt} of shape {s} (logical shape "
                             f"{shape}), got {parts[k].dtype} of shape {tuple(parts[k].shape)}")


def decode(parts: dict, fmt: str, dtype=torch.float32) -> Tensor:
    """Read stored parts (from `encode` / `allocate`) back as a `dtype` tensor of the logical
    shape: `data`'s shape for element formats, `[..., R, K]` (K = 2 * `data.shape[-1]`) for
    nvfp4. fp8 and NVFP4 values are computed in float64 and then cast, as in `quantize`.
    Parts missing, unexpected, or of the wrong shape or dtype raise `ValueError` (a non-dict
    `TypeError`).
    """
    check_format(fmt)
    _check_parts(parts, fmt)
    if fmt in _SCALED_FP8:
        return _fp8_value(parts["data"].to(torch.float64),
                          parts["scale"].to(torch.float64)).to(dtype)
    if fmt != "nvfp4":
        return parts["data"].to(dtype)
    data, scale, ts = parts["data"], parts["scale"], parts["tensor_scale"]
    nib = torch.stack((data & 0xF, data >> 4), dim=-1)  # [..., R, K//2, 2]
    nib = nib.reshape(*data.shape[:-1], scale.shape[-1], NVFP4_BLOCK)  # [..., R, K//16, 16]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=data.device)
    mag = table[(nib & 7).long()]
    v = torch.where((nib >> 3).bool(), -mag, mag)
    return _nvfp4_value(v, scale.to(torch.float64), ts.to(torch.float64)).to(dtype)
