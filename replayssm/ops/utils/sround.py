"""Seeded stochastic rounding in Triton, bit for bit `formats.encode(x, fmt, "stochastic",
seed=, stream=)`, for high-precision checkpoints in fp16, bf16 or scaled fp8-e4m3.

The uniforms are `formats.uniform`'s counter-based hash, computed in uint32 arithmetic (which
wraps mod 2**32 on the interpreter and the GPU alike), kept as their 53-bit integers: rounding
up when `u < frac` is then the exact integer comparison `bits < rem * 2**(53 - shift)`, with no
float compare that could differ between devices. The seed's two words are mixed on the host
(`seed_key`); the kernels mix in the stream `slot * 2**32 + epoch[slot]` and the element's flat
index within the slot's checkpoint, `(head * V + row) * K + col`.

Format codes (`HP` constexpr): 0 fp32 (no rounding), 1 fp16, 2 bf16, 3 fp8-e4m3 (one fp32 scale
per row of K). The parts are read with `lowp.load_lp_tile` under the same codes.

The shared design (one checkpoint in a low-precision format, read by every step and rewritten
at every flush, `shared_args`) adds code 4, NVFP4, and round-to-nearest writes (`SR` 0):
`store_nvfp4_rows` encodes rows of a head matrix whose tensor scale is already known.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .lowp import LP_CODES, _e4m3_value, _f32_scale, _round_bits64, lp_views

__all__ = ["HP_CODES", "SHARED_CODES", "ROUNDINGS", "seed_key", "hp_views", "checkpoint_args", "shared_args",
           "uniform_bits", "store_sr_rows", "nvfp4_tensor_scale", "store_nvfp4_rows", "kernel_uniform_bits"]

HP_CODES = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8_e4m3": 3}
# the one checkpoint of the shared design (fp32: the same kernels' fold, unrounded)
SHARED_CODES = dict(HP_CODES, nvfp4=4)
ROUNDINGS = ("nearest", "stochastic")
_M32 = 0xFFFFFFFF


def _mix32_host(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The per-seed key of `formats.uniform` (both 32-bit words of `seed` mixed in), `[0, 2**32)`."""
    seed = int(seed)
    k = _mix32_host((seed & _M32) ^ 0x9E3779B9)
    return _mix32_host(k ^ ((seed >> 32) & _M32))


def hp_views(parts, fmt: str, N: int, HV: int, V: int, K: int):
    """`(data, scale)` of a high-precision checkpoint's parts as the kernels take them (fp32: the
    tensor itself and None), checked as `lowp.lp_views` checks a low-precision copy."""
    if fmt not in HP_CODES:
        raise ValueError(f"hp_format {fmt!r} has no kernel; expected one of {sorted(HP_CODES)}")
    if fmt == "fp32":
        t = parts["data"] if isinstance(parts, dict) else parts
        if not isinstance(t, Tensor) or tuple(t.shape) != (N, HV, V, K) or t.dtype != torch.float32 \
                or not t.is_contiguous():
            raise ValueError(f"ckpt must be a contiguous float32 tensor of shape {(N, HV, V, K)}")
        return t, None
    try:
        data, scale, _ = lp_views(parts, fmt, N, HV, V, K)
    except ValueError as e:
        raise ValueError(str(e).replace("ckpt_lp", "ckpt")) from None
    return data, scale


def checkpoint_args(ckpt, ckpt_lp, lp_format, hp_format: str, seed: int, N: int, HV: int, V: int,
                    K: int) -> dict:
    """The precision kernels' checkpoint arguments: the HP parts (`ckpt`: an fp32 tensor, or a
    dict of parts in `hp_format`) and the LP copy (`ckpt_lp` in `lp_format`, or both None:
    non-flush steps then read the HP parts, under the LP code of `hp_format`)."""
    hp_data, hp_scale = hp_views(ckpt, hp_format, N, HV, V, K)
    if ckpt_lp is None and lp_format is None:
        if hp_format == "fp32":
            raise ValueError("an fp32 checkpoint without a low-precision copy is the standard kernel's")
        lp_data, lp_scale, lp_tscale, lp_code = hp_data, hp_scale, hp_scale, HP_CODES[hp_format]
    else:
        if hp_format != "fp32" and lp_format == "nvfp4":
            # its scale per head needs the whole fp32 matrix, which only an fp32 HP keeps
            raise ValueError("an nvfp4 copy needs an fp32 high-precision checkpoint")
        lp_data, lp_scale, lp_tscale = lp_views(ckpt_lp, lp_format, N, HV, V, K)
        lp_code = LP_CODES[lp_format]
    return dict(ckpt=hp_data, hp_scale=hp_scale, sr_key=seed_key(seed), lp_data=lp_data,
                lp_scale=lp_scale, lp_tscale=lp_tscale, LP=lp_code, HP=HP_CODES[hp_format],
                HAS_LP=ckpt_lp is not None)


def shared_args(ckpt, hp_format: str, hp_rounding: str, seed: int, N: int, HV: int, V: int, K: int) -> dict:
    """The precision kernels' checkpoint arguments for the shared design: one checkpoint `ckpt`
    in `hp_format` (`SHARED_CODES`; an fp32 tensor, else a dict of parts), read by every step
    and rewritten by a flush with `hp_rounding` (`ROUNDINGS`; none for fp32). The LP arguments
    are the same parts under the same code, and `HAS_LP` is False."""
    if hp_format not in SHARED_CODES:
        raise ValueError(f"hp_format {hp_format!r} has no shared-checkpoint kernel; expected one of "
                         f"{sorted(SHARED_CODES)}")
    if hp_rounding not in ROUNDINGS:
        raise ValueError(f"hp_rounding must be one of {ROUNDINGS}, got {hp_rounding!r}")
    if hp_format == "fp32":
        data, scale, tscale = hp_views(ckpt, "fp32", N, HV, V, K) + (None,)
    else:
        try:
            data, scale, tscale = lp_views(ckpt, hp_format, N, HV, V, K)
        except ValueError as e:
            raise ValueError(str(e).replace("ckpt_lp", "ckpt")) from None
    return dict(ckpt=data, hp_scale=scale, sr_key=seed_key(seed), lp_data=data, lp_scale=scale,
                lp_tscale=tscale, LP=SHARED_CODES[hp_format], HP=SHARED_CODES[hp_format], HAS_LP=False,
                SR=int(hp_rounding == "stochastic" and hp_format != "fp32"))


@triton.jit
def _mix32(x):
    """`formats._mix32` on uint32 tensors (products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def uniform_bits(key, st, idx):
    """The 53-bit integers (int64) of `formats.uniform(seed, stream=st)` at flat indices `idx`
    (int tensor, < 2**31): `u = bits * 2**-53`. `key` is `seed_key(seed)`, `st` the stream
    (int64 scalar)."""
    k0 = (tl.cast(key, tl.int64) & 0xFFFFFFFF).to(tl.uint32)   # (a key of 1 arrives as a constexpr)
    st = st.to(tl.int64)
    k1 = _mix32(k0 ^ (st & 0xFFFFFFFF).to(tl.uint32))
    k1 = _mix32(k1 ^ ((st >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k2 = _mix32(k1 ^ tl.full([], 0x85EBCA6B, tl.uint32))
    c = idx.to(tl.uint32) * 2
    h0 = _mix32(_mix32(c ^ k1) ^ k2)
    h1 = _mix32(_mix32((c + 1) ^ k1) ^ k2)
    return ((h0 >> 6).to(tl.int64) << 27) | (h1 >> 5).to(tl.int64)


@triton.jit
def _sr_up(rem, shift, r):
    """Whether to round up: `r * 2**-53 < rem * 2**-shift` exactly, in int64 (`rem < 2**shift`,
    `rem < 2**53`, `shift >= 1`)."""
    one = tl.zeros_like(rem) + 1
    lo = rem << tl.maximum(53 - shift, 0)                     # shift <= 53: exact, below 2**53
    d = tl.minimum(tl.maximum(shift - 53, 0), 60)             # else compare with ceil(rem / 2**d)
    hi = (rem + (one << d) - 1) >> d
    return r < tl.where(shift <= 53, lo, hi)


@triton.jit
def _sr_bits32(a, r, M: tl.constexpr, E: tl.constexpr):
    """fp32 magnitudes `a` (>= 0, at most the format's largest value) rounded stochastically
    (53-bit uniforms `r`) onto M mantissa bits, minimum normal exponent E; the format's bits
    without sign as int64 (a carry out of the mantissa moves into the exponent by itself)."""
    b = a.to(tl.int32, bitcast=True)
    ef = b >> 23
    mant = (b & 0x7FFFFF).to(tl.int64)
    sig = tl.where(ef > 0, mant | 0x800000, mant)
    e = tl.maximum(ef - 127, E)
    shift = ((e - M) - (tl.maximum(ef, 1) - 150)).to(tl.int64)
    shc = tl.minimum(shift, 31)                               # beyond 24 every bit is dropped
    q = sig >> shc
    rem = sig - (q << shc)
    return ((e - E).to(tl.int64) << M) + q + _sr_up(rem, shift, r).to(tl.int64)


@triton.jit
def _sr_bits64(a, r, M: tl.constexpr, E: tl.constexpr):
    """`_sr_bits32` for float64 magnitudes (the fp8 quotients)."""
    b = a.to(tl.int64, bitcast=True)
    ef = b >> 52
    mant = b & 0xFFFFFFFFFFFFF
    sig = tl.where(ef > 0, mant | 0x10000000000000, mant)
    e = tl.maximum(ef - 1023, E)
    shift = (e - M) - (tl.maximum(ef, 1) - 1075)
    shc = tl.minimum(shift, 62)
    q = sig >> shc
    rem = sig - (q << shc)
    return ((e - E) << M) + q + _sr_up(rem, shift, r).to(tl.int64)


@triton.jit
def store_sr_rows(b_S, hp_data, hp_scale, i_m, i_h, o_r, m_r, o_k, m_k, key, st, V: tl.constexpr,
                  K: tl.constexpr, HP: tl.constexpr):
    """Encode fp32 rows `b_S` (`[RC, BK]`, rows `o_r` of head `i_h`, matrix `i_m` of the pool)
    with seeded stochastic rounding into fp16/bf16 (HP 1, 2) or scaled fp8-e4m3 (HP 3, a row is
    all of K so its scale is local), as `formats.encode(S[None], fmt, "stochastic", seed,
    stream=st)` of the slot's `[HV, V, K]` checkpoint."""
    m = m_r[:, None] & m_k[None, :]
    p = hp_data + i_m * (V * K) + o_r[:, None] * K + o_k[None, :]
    r = uniform_bits(key, st, (i_h * V + o_r)[:, None] * K + o_k[None, :])
    xb = b_S.to(tl.int32, bitcast=True)
    a = (xb & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    neg = xb < 0
    if HP == 1 or HP == 2:
        if HP == 1:
            a = tl.where(a > 65504.0, 65504.0, a)                            # saturate (NaN kept)
            bits = tl.where(a != a, 0x7E00, _sr_bits32(a, r, 10, -14).to(tl.int32))
        else:
            a = tl.where(a > 3.3895313892515355e38, 3.3895313892515355e38, a)
            bits = tl.where(a != a, 0x7FC0, _sr_bits32(a, r, 7, -126).to(tl.int32))
        bits = tl.where(neg, bits | 0x8000, bits)
        tl.store(p, bits.to(tl.int16), mask=m)
    else:
        fin = (a == a) & (a < float("inf")) & m
        amax = tl.max(tl.where(fin, a, 0.), axis=1)                              # [RC]
        s = _f32_scale(amax, 448.0)
        y = a.to(tl.float64) / s.to(tl.float64)[:, None]
        y = tl.where(y > 448.0, 448.0, y)
        bits = tl.where(y != y, 0x7F, _sr_bits64(y, r, 3, -6).to(tl.int32))
        bits = tl.where(neg, bits | 0x80, bits)
        tl.store(p, bits.to(tl.uint8), mask=m)
        tl.store(hp_scale + i_m * V + o_r, s, mask=m_r)


@triton.jit
def nvfp4_tensor_scale(amax):
    """An NVFP4 matrix's fp32 tensor scale from its amax (NaN counted as inf by the caller), as
    `formats.encode`'s for finite matrices; NaN for a non-finite one, whose every element then
    decodes to NaN (formats.decode gives NaN, or inf where the element was inf: non-finite either
    way, so a state that overflowed is not laundered into finite codes)."""
    return tl.where(amax < float("inf"), _f32_scale(amax, 2688.0), float("nan"))     # 6 * 448


@triton.jit
def store_nvfp4_rows(b_S, ts, lp_data, lp_scale, i_m, i_h, o_r, m_r, o_k, key, st, V: tl.constexpr,
                     K: tl.constexpr, BK: tl.constexpr, RC: tl.constexpr, SR: tl.constexpr):
    """Encode fp32 rows `b_S` (`[RC, BK]`, zero in padded columns; rows `o_r` of head `i_h`,
    matrix `i_m`) to NVFP4 under the matrix's fp32 tensor scale `ts`: block scales rounded up,
    elements round-to-nearest (SR 0) or stochastically (SR 1, the uniforms of
    `formats.encode(S[None], "nvfp4", "stochastic", seed, stream=st)` of the slot's `[HV, V, K]`
    checkpoint). `ts` (`nvfp4_tensor_scale`) is the caller's to store."""
    NB: tl.constexpr = BK // 16
    BH: tl.constexpr = BK // 2
    ts64 = ts.to(tl.float64)
    bmax = tl.max(tl.reshape(tl.abs(b_S), [RC, NB, 16]), axis=2)                      # [RC, NB]
    qs = bmax.to(tl.float64) / (6.0 * ts64)
    qs = tl.where(qs > 448.0, 448.0, qs)
    sbits = _round_bits64(qs, 3, -6, True).to(tl.int32)      # rounded up: |x / denom| <= 6
    den = _e4m3_value(sbits).to(tl.float64) * ts64           # exact
    den = tl.where(den > 0, den, 1.0)
    dp = tl.reshape(tl.broadcast_to(den[:, :, None], [RC, NB, 16]), [RC, BK])
    xb = b_S.to(tl.int32, bitcast=True)
    y = (xb & 0x7FFFFFFF).to(tl.float32, bitcast=True).to(tl.float64) / dp
    y = tl.where(y > 6.0, 6.0, y)
    if SR:
        r = uniform_bits(key, st, (i_h * V + o_r)[:, None] * K + o_k[None, :])
        code = _sr_bits64(y, r, 1, 0).to(tl.int32)
    else:
        code = _round_bits64(y, 1, 0, False).to(tl.int32)
    nib = tl.where(xb < 0, code | 8, code)
    # element 2i in the low nibble: the pair's bits are disjoint, so their sum is the byte
    byte = tl.sum(tl.reshape(nib << ((o_k & 1) * 4)[None, :], [RC, BH, 2]), axis=2)     # [RC, BH]
    o_i = tl.arange(0, BH)
    o_b = tl.arange(0, NB)
    tl.store(lp_data + i_m * (V * (K // 2)) + o_r[:, None] * (K // 2) + o_i[None, :], byte.to(tl.uint8),
             mask=m_r[:, None] & (o_i < K // 2)[None, :])
    tl.store(lp_scale + i_m * (V * (K // 16)) + o_r[:, None] * (K // 16) + o_b[None, :], sbits.to(tl.uint8),
             mask=m_r[:, None] & (o_b < K // 16)[None, :])


@triton.jit
def _uniform_kernel(out, key, st, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + o, uniform_bits(key, tl.load(st), o), mask=o < n)


def kernel_uniform_bits(n: int, seed: int, stream: int, device=None) -> Tensor:
    """`uniform_bits` of one stream at indices `0..n-1`, int64 `[n]` (for tests: equals
    `formats.uniform((1, n), seed, stream) * 2**53`)."""
    out = torch.empty(n, dtype=torch.int64, device=device)
    st = torch.tensor([int(stream)], dtype=torch.int64, device=device)
    if n:
        _uniform_kernel[(triton.cdiv(n, 256),)](out, seed_key(seed), st, n, BLOCK=256)
    return out
