"""Triton decoding and round-to-nearest encoding of the low-precision checkpoint formats
(`replayssm.formats`: fp16, bf16, scaled fp8-e4m3, NVFP4), shared by every family's kernels.

Encoding reproduces `formats.encode(x, fmt, "nearest")` bit for bit: magnitudes are rounded
with integer operations on their IEEE bits (the interpreter's float casts to bf16 and fp8 are
wrong, DESIGN.md, and the H200 has no FP4 instructions), and the scaled formats divide by their
scales in float64, as the reference does, so that a quotient never lands on a rounding tie that
the exact quotient misses. Decoding multiplies exact element values by their scales in fp32,
which rounds once, like the reference's float64 product cast to fp32. The kernels see the parts
as integer views (`lp_views`): fp16/bf16 data as int16, fp8 data and e4m3 scales as uint8.

Format codes (`LP` constexpr): 1 fp16, 2 bf16, 3 fp8-e4m3 (one fp32 scale per row of K),
4 NVFP4 (two e2m1 codes per byte, one e4m3 scale per 16 elements, one fp32 scale per head);
`load_lp_tile` also reads code 0, an fp32 checkpoint.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import capturing

__all__ = ["LP_CODES", "lp_views", "nvfp4_stand_in", "default_bv", "default_gluon_bv", "lowp_config",
           "flush_programs", "head_counter", "scale_scratch", "last_at_head", "flush_rows_chunk", "flush_item_row",
           "load_lp_tile", "store_lp_rows", "store_nvfp4_head"]

LP_CODES = {"fp16": 1, "bf16": 2, "fp8_e4m3": 3, "nvfp4": 4}
_CACHED: dict = {}


def lp_views(parts, fmt: str, N: int, HV: int, V: int, K: int):
    """`(data, scale, tensor_scale)` of a low-precision checkpoint's parts as the kernels take
    them (integer views; None for absent parts), after checking every part's shape, dtype and
    contiguity (ValueError naming the part)."""
    if fmt not in LP_CODES:
        raise ValueError(f"lp_format {fmt!r} has no kernel; expected one of {sorted(LP_CODES)}")
    if not isinstance(parts, dict):
        raise ValueError(f"ckpt_lp must be a dict of parts (formats.allocate), got {type(parts).__name__}")
    if fmt == "nvfp4" and K % 16:
        raise ValueError(f"nvfp4 needs K divisible by 16, got K={K}")
    want = {"fp16": {"data": ((N, HV, V, K), torch.float16)},
            "bf16": {"data": ((N, HV, V, K), torch.bfloat16)},
            "fp8_e4m3": {"data": ((N, HV, V, K), torch.float8_e4m3fn), "scale": ((N, HV, V), torch.float32)},
            "nvfp4": {"data": ((N, HV, V, K // 2), torch.uint8),
                      "scale": ((N, HV, V, K // 16), torch.float8_e4m3fn),
                      "tensor_scale": ((N, HV), torch.float32)}}[fmt]
    if set(parts) != set(want):
        raise ValueError(f"ckpt_lp for {fmt} must hold parts {sorted(want)}, got {sorted(parts)}")
    for key, (shape, dtype) in want.items():
        t = parts[key]
        if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"ckpt_lp[{key!r}] must be a contiguous {dtype} tensor of shape {shape}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    data = parts["data"]
    data = data.view(torch.int16) if fmt in ("fp16", "bf16") else data.view(torch.uint8)
    scale = parts.get("scale")
    if scale is not None and scale.dtype == torch.float8_e4m3fn:
        scale = scale.view(torch.uint8)
    return data, scale, parts.get("tensor_scale")


def nvfp4_stand_in(data, K: int):
    """What the shape checks see of a shared NVFP4 checkpoint's `data` (`[N, HV, V, K / 2]`
    bytes, two codes each): an empty `[N, HV, V, K]` tensor of its dtype and device (`lp_views`
    checks the packed parts themselves); anything that is not a 4-d tensor as it is."""
    if isinstance(data, Tensor) and data.dim() == 4:
        return torch.empty((*data.shape[:3], K), dtype=data.dtype, device=data.device)
    return data


def default_bv(V: int) -> int:
    """The precision kernels' default block of value rows (untuned): a quarter of the padded
    head, 8 to 32 rows, so that small heads too are split over programs."""
    return min(32, max(8, triton.next_power_of_2(V) // 4))


def default_gluon_bv(V: int) -> int:
    """The steady-row Gluon kernels' rows per program (`BV / 16` warps), as the fp32 Gluon
    kernels' tables choose them: 64 where they divide V, else 32, else 16."""
    return next((bv for bv in (64, 32) if V % bv == 0), 16)


def lowp_config(V: int, config: Optional[dict], split: bool = False) -> dict:
    """The precision kernels' launch config with a caller's overrides: `BV`, `num_warps` (the
    Triton kernel's), and for `lowp_decode` on CUDA the split of a step into two launches
    (ops/<family>/gluon_lowp.py): `gluon` (default True: where the Gluon kernel covers the read
    format and shape, the flush rows on the Triton kernel, then the other rows on the Gluon
    kernel), `gluon_BV` (its rows per program, `gluon_BV / 16` warps; `default_gluon_bv`),
    `gluon_maxnreg` (its register cap, 0 none), `gluon_recmask` (whether its record loads wait for
    the cursor and skip positions past it; None: the family's default, Mamba-2 no, GDN/KDA yes),
    `gluon_kq` (the records' key products with the token's query (Mamba-2) or key and query (GDN)
    formed once per row and key head by a launch before the Gluon kernel, `utils.key_products`,
    instead of by each of its programs; None: the family's default, Mamba-2 yes, GDN no; KDA,
    whose record weights are per value head, ignores it),
    `split` (the two launches even without Gluon, the second the Triton kernel: the split's test
    on the interpreter), `flush_programs` (the
    flush launch's programs, None: 8 per SM, 8 off CUDA, at most one per (row, head, V-block)).
    The split's keys are returned where given, all of them (defaults filled) with `split=True`."""
    split_keys = {"gluon": True, "gluon_BV": default_gluon_bv(V), "gluon_maxnreg": 0, "gluon_recmask": None,
                  "gluon_kq": None, "split": False, "flush_programs": None}
    cfg = dict({"BV": default_bv(V), "num_warps": 4}, **split_keys)
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; expected a subset of {sorted(cfg)}")
        cfg.update(config)
    BV, nw = cfg["BV"], cfg["num_warps"]
    if isinstance(BV, bool) or not (isinstance(BV, int) and BV >= 1 and BV & (BV - 1) == 0):
        raise ValueError(f"config: BV must be a power of two, got {BV!r}")
    if isinstance(nw, bool) or not isinstance(nw, int) or nw not in (1, 2, 4, 8, 16):
        raise ValueError(f"config: num_warps must be one of 1, 2, 4, 8, 16, got {nw!r}")
    for key in ("gluon", "split"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"config: {key} must be a bool, got {cfg[key]!r}")
    if isinstance(cfg["gluon_BV"], bool) or cfg["gluon_BV"] not in (16, 32, 64, 128):
        raise ValueError(f"config: gluon_BV must be one of 16, 32, 64, 128 (16 rows per warp), "
                         f"got {cfg['gluon_BV']!r}")
    nreg = cfg["gluon_maxnreg"]
    if isinstance(nreg, bool) or not isinstance(nreg, int) or not (nreg == 0 or 24 <= nreg <= 255):
        raise ValueError(f"config: gluon_maxnreg must be 0 (none) or in 24..255, got {nreg!r}")
    for key in ("gluon_recmask", "gluon_kq"):
        if cfg[key] is not None and not isinstance(cfg[key], bool):
            raise ValueError(f"config: {key} must be None or a bool, got {cfg[key]!r}")
    fp = cfg["flush_programs"]
    if fp is not None and (isinstance(fp, bool) or not isinstance(fp, int) or not 1 <= fp <= 65535):
        raise ValueError(f"config: flush_programs must be None or an int in 1..65535, got {fp!r}")
    return cfg if split else {k: v for k, v in cfg.items() if k not in split_keys or k in (config or {})}


def flush_programs(cfg: dict, n_items: int, device) -> int:
    """Programs of a split step's flush launch (`ROWS=1`): `cfg["flush_programs"]`, else 8 per SM
    on CUDA (a wave or two: its programs loop over the flush rows' items, and on a step without
    a flush each only scans the cursors), 8 elsewhere; never more than `n_items`."""
    g = cfg.get("flush_programs")
    if g is None:
        dev = torch.device(device)
        g = 8 * (torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1)
    return max(1, min(int(g), int(n_items)))


def _cached(kind: str, device, n: int, make, first_call: str) -> Tensor:
    """A device tensor of `n` elements made by `make(n)`, cached per (kind, device, n): a
    captured CUDA graph replays its address, so it is made before capture (outside it)."""
    key = (kind, torch.device(device), int(n))
    t = _CACHED.get(key)
    if t is None:
        if capturing():
            raise ValueError(f"{kind} not allocated yet: {first_call} once before capturing a CUDA graph")
        t = _CACHED[key] = make(max(n, 1))
    return t


def head_counter(device, n: int) -> Tensor:
    """A zeroed `[n]` int32 per-(slot, head) arrival counter, cached per (device, n); the
    kernels leave it zeroed. Allocate before CUDA-graph capture (first call outside it)."""
    return _cached("head counter", device, n, lambda m: torch.zeros(m, dtype=torch.int32, device=device),
                   "decode")


def scale_scratch(device, n: int) -> Tensor:
    """An `[n]` fp32 scratch for per-(row, head) tensor scales that one launch writes and the next
    reads (a shared NVFP4 checkpoint's early flush, ops/gdn/verify_lp.py), cached per
    (device, n) as `head_counter`: allocate before CUDA-graph capture (first call outside it)."""
    return _cached("scale scratch", device, n, lambda m: torch.empty(m, dtype=torch.float32, device=device),
                   "verify")


@triton.jit
def last_at_head(head_arrive, i_m, n_programs):
    """This program's arrival at head matrix `i_m`'s counter (`head_counter`), once every thread
    has finished its stores and its reads of the head's rows: True for the last of the head's
    `n_programs`, which sees the others' stores (acq_rel), may rewrite the whole head, and has
    taken the counter back to zero for the next launch (every program has arrived)."""
    tl.debug_barrier()
    last = tl.atomic_add(head_arrive + i_m, 1, sem="acq_rel") == n_programs - 1
    if last:
        tl.store(head_arrive + i_m, 0)
    tl.debug_barrier()
    return last


@triton.jit
def flush_rows_chunk(slot_ids, cursor, c0, n_rows, seen, WINDOW: tl.constexpr, BT: tl.constexpr):
    """A split step's flush launch (`ROWS=1`), rows `c0 .. c0 + BT`: their positions, slots,
    cursors, which of them flush this step (`h + 1 >= WINDOW`) and each one's rank among the
    step's flush rows (`seen` of them in the chunks before), and how many flush here."""
    o_b = c0 + tl.arange(0, BT)
    b_sl = tl.load(slot_ids + o_b, mask=o_b < n_rows, other=-1).to(tl.int64)
    b_h = tl.load(cursor + tl.where(b_sl >= 0, b_sl, 0), mask=b_sl >= 0, other=0)
    b_fl = (b_sl >= 0) & (b_h + 1 >= WINDOW)
    b_rank = seen + tl.cumsum(b_fl.to(tl.int32), axis=0) - 1
    return o_b, b_sl, b_h, b_fl, b_rank, tl.sum(b_fl.to(tl.int32), axis=0)


@triton.jit
def flush_item_row(o_b, b_sl, b_h, b_fl, b_rank, t, NP: tl.constexpr):
    """Item `t` of the flush launch (`NP` items per row: its heads' V-blocks) in the chunk of
    `flush_rows_chunk`: the row's position, slot and cursor."""
    m_r = b_fl & (b_rank == t // NP)
    return (tl.sum(tl.where(m_r, o_b, 0), axis=0).to(tl.int64), tl.sum(tl.where(m_r, b_sl, 0), axis=0),
            tl.sum(tl.where(m_r, b_h, 0), axis=0))


# ----------------------------------------------------------------------------------------------
# rounding on the bits


@triton.jit
def _round_bits32(a, M: tl.constexpr, E: tl.constexpr):
    """fp32 magnitudes `a` (>= 0, at most the format's largest value) rounded half-to-even onto
    a grid of M mantissa bits and minimum normal exponent E (subnormals below); returns the
    format's bits without sign, `(exponent field << M) + mantissa`, as int32."""
    b = a.to(tl.int32, bitcast=True)
    ef = b >> 23
    mant = b & 0x7FFFFF
    sig = tl.where(ef > 0, mant | 0x800000, mant)
    e = tl.maximum(ef - 127, E)                   # the target's exponent (subnormals share E)
    shift = tl.minimum((e - M) - (tl.maximum(ef, 1) - 150), 30)
    q = sig >> shift
    rem = sig - (q << shift)
    half = (tl.zeros_like(sig) + 1) << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    # a carry out of the mantissa moves into the exponent field by itself
    return ((e - E) << M) + q + up.to(tl.int32)


@triton.jit
def _round_bits64(a, M: tl.constexpr, E: tl.constexpr, UP: tl.constexpr):
    """`_round_bits32` for float64 magnitudes (the scaled formats' quotients), int64 bits;
    UP rounds towards +inf instead (NVFP4's block scales)."""
    b = a.to(tl.int64, bitcast=True)
    ef = b >> 52
    mant = b & 0xFFFFFFFFFFFFF
    sig = tl.where(ef > 0, mant | 0x10000000000000, mant)
    e = tl.maximum(ef - 1023, E)
    shift = tl.minimum((e - M) - (tl.maximum(ef, 1) - 1075), 62)
    q = sig >> shift
    rem = sig - (q << shift)
    if UP:
        up = rem > 0
    else:
        half = (tl.zeros_like(sig) + 1) << (shift - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return ((e - E) << M) + q + up.to(tl.int64)


@triton.jit
def _f32_scale(amax, TOP: tl.constexpr):
    """`amax / TOP` in float64 rounded UP to fp32 (1 where amax is 0), as `formats._f32_scale`:
    the largest element then maps at most to TOP."""
    ex = amax.to(tl.float64) / TOP
    s = ex.to(tl.float32)
    s = tl.where(s.to(tl.float64) < ex, (s.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), s)
    return tl.where(amax == 0, 1.0, s)


@triton.jit
def _e4m3_value(bits):
    """fp32 value of e4m3 ("fn") bits (int32, 0..255)."""
    e = (bits >> 3) & 15
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)       # subnormals: m * 2^-9
    mag = tl.where((bits & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((bits & 0x80) != 0, -mag, mag)


@triton.jit
def _e2m1_value(nib):
    """fp32 value of an e2m1 nibble `sign << 3 | code` (int32): 0, .5, 1, 1.5, 2, 3, 4, 6."""
    code = nib & 7
    e = code >> 1
    bits = tl.where(e > 0, ((e + 126) << 23) | ((code & 1) << 22), tl.where(code == 1, 126 << 23, 0))
    mag = bits.to(tl.float32, bitcast=True)
    return tl.where((nib & 8) != 0, -mag, mag)


# ----------------------------------------------------------------------------------------------
# tiles


@triton.jit
def load_lp_tile(lp_data, lp_scale, lp_tscale, i_m, o_v, m_v, o_k, m_k, V: tl.constexpr,
                 K: tl.constexpr, LP: tl.constexpr):
    """Rows `o_v` (`[BV]`, valid where `m_v`) of head matrix `i_m` (= slot * HV + head) of the
    low-precision checkpoint, decoded to fp32: `[BV, BK]`, zero where masked, equal to
    `formats.decode` of those parts. LP 0 reads an fp32 checkpoint as it is."""
    m = m_v[:, None] & m_k[None, :]
    if LP == 0:
        return tl.load(lp_data + i_m * (V * K) + o_v[:, None] * K + o_k[None, :], mask=m, other=0.,
                       eviction_policy="evict_first")
    elif LP == 1:
        p = lp_data + i_m * (V * K) + o_v[:, None] * K + o_k[None, :]
        b = tl.load(p, mask=m, other=0, eviction_policy="evict_first")
        return b.to(tl.float16, bitcast=True).to(tl.float32)
    elif LP == 2:
        p = lp_data + i_m * (V * K) + o_v[:, None] * K + o_k[None, :]
        b = tl.load(p, mask=m, other=0, eviction_policy="evict_first")
        return (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif LP == 3:
        p = lp_data + i_m * (V * K) + o_v[:, None] * K + o_k[None, :]
        b = tl.load(p, mask=m, other=0, eviction_policy="evict_first").to(tl.int32)
        s = tl.load(lp_scale + i_m * V + o_v, mask=m_v, other=0.)
        return _e4m3_value(b) * s[:, None]
    else:
        # two codes per byte (element 2i low nibble), each byte read by both of its lanes
        p = lp_data + i_m * (V * (K // 2)) + o_v[:, None] * (K // 2) + (o_k // 2)[None, :]
        b = tl.load(p, mask=m, other=0, eviction_policy="evict_first").to(tl.int32)
        nib = (b >> ((o_k & 1) * 4)[None, :]) & 15
        ps = lp_scale + i_m * (V * (K // 16)) + o_v[:, None] * (K // 16) + (o_k // 16)[None, :]
        sb = _e4m3_value(tl.load(ps, mask=m, other=0).to(tl.int32))
        ts = tl.load(lp_tscale + i_m)
        # (v * sb) is exact; one rounding for the tensor scale, as the reference's cast
        return tl.where(m, (_e2m1_value(nib) * sb) * ts, 0.)


@triton.jit
def store_lp_rows(b_S, lp_data, lp_scale, i_m, o_r, m_r, o_k, m_k, V: tl.constexpr, K: tl.constexpr,
                  LP: tl.constexpr):
    """Encode fp32 rows `b_S` (`[RC, BK]`, rows `o_r` of head matrix `i_m`) round-to-nearest
    into the element formats (LP 1, 2) or scaled fp8 (LP 3: a row is all of K, so its scale is
    local); NVFP4 needs the whole matrix (`store_nvfp4_head`)."""
    m = m_r[:, None] & m_k[None, :]
    p = lp_data + i_m * (V * K) + o_r[:, None] * K + o_k[None, :]
    xb = b_S.to(tl.int32, bitcast=True)
    a = (xb & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    neg = xb < 0
    if LP == 1 or LP == 2:
        if LP == 1:
            a = tl.where(a > 65504.0, 65504.0, a)                            # saturate (NaN kept)
            bits = tl.where(a != a, 0x7E00, _round_bits32(a, 10, -14))
        else:
            a = tl.where(a > 3.3895313892515355e38, 3.3895313892515355e38, a)
            bits = tl.where(a != a, 0x7FC0, _round_bits32(a, 7, -126))
        bits = tl.where(neg, bits | 0x8000, bits)
        tl.store(p, bits.to(tl.int16), mask=m)
    else:
        # scaled fp8: row scale from the row's finite amax, elements from the float64 quotient
        fin = (a == a) & (a < float("inf")) & m
        amax = tl.max(tl.where(fin, a, 0.), axis=1)                              # [RC]
        s = _f32_scale(amax, 448.0)
        y = a.to(tl.float64) / s.to(tl.float64)[:, None]
        y = tl.where(y > 448.0, 448.0, y)
        bits = tl.where(y != y, 0x7F, _round_bits64(y, 3, -6, False).to(tl.int32))
        bits = tl.where(neg, bits | 0x80, bits)
        tl.store(p, bits.to(tl.uint8), mask=m)
        tl.store(lp_scale + i_m * V + o_r, s, mask=m_r)


@triton.jit
def _nvfp4_nibbles(x, dp):
    """e2m1 nibbles (int32) of fp32 elements `x` divided by their float64 block denominators."""
    xb = x.to(tl.int32, bitcast=True)
    y = (xb & 0x7FFFFFFF).to(tl.float32, bitcast=True).to(tl.float64) / dp
    y = tl.where(y > 6.0, 6.0, y)
    code = _round_bits64(y, 1, 0, False).to(tl.int32)
    return tl.where(xb < 0, code | 8, code)


@triton.jit
def store_nvfp4_head(p_hp, lp_data, lp_scale, lp_tscale, i_m, V: tl.constexpr, K: tl.constexpr,
                     BK: tl.constexpr, RC: tl.constexpr):
    """Encode head matrix `i_m` to NVFP4 from its fp32 checkpoint `p_hp` (`[V, K]`, already
    written: it is read back, in row chunks of RC, twice: the matrix amax, then the blocks)."""
    BH: tl.constexpr = BK // 2
    NB: tl.constexpr = BK // 16
    o_i = tl.arange(0, BH)                                  # pairs (2i, 2i + 1)
    m_i = o_i < K // 2
    o_b = tl.arange(0, NB)
    m_b = o_b < K // 16
    o_k = tl.arange(0, BK)
    amax = tl.zeros([RC], dtype=tl.float32)
    for r0 in tl.static_range(0, V, RC):
        o_r = r0 + tl.arange(0, RC)
        m = (o_r < V)[:, None] & (o_k < K)[None, :]
        x = tl.load(p_hp + o_r[:, None] * K + o_k[None, :], mask=m, other=0.)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    amax = tl.max(amax, axis=0)
    ts = _f32_scale(amax, 2688.0)                           # 6 * 448
    ts64 = ts.to(tl.float64)
    tl.store(lp_tscale + i_m, ts)
    for r0 in tl.static_range(0, V, RC):
        o_r = r0 + tl.arange(0, RC)
        m_r = o_r < V
        m = m_r[:, None] & m_i[None, :]
        p_x = p_hp + o_r[:, None] * K + 2 * o_i[None, :]
        x_e = tl.load(p_x, mask=m, other=0.)                # [RC, BH] elements 2i
        x_o = tl.load(p_x + 1, mask=m, other=0.)            # elements 2i + 1
        bmax = tl.maximum(tl.max(tl.reshape(tl.abs(x_e), [RC, NB, 8]), axis=2),
                          tl.max(tl.reshape(tl.abs(x_o), [RC, NB, 8]), axis=2))   # [RC, NB]
        qs = bmax.to(tl.float64) / (6.0 * ts64)
        qs = tl.where(qs > 448.0, 448.0, qs)
        sbits = _round_bits64(qs, 3, -6, True).to(tl.int32)  # rounded up: |x / denom| <= 6
        den = _e4m3_value(sbits).to(tl.float64) * ts64       # exact
        den = tl.where(den > 0, den, 1.0)
        dp = tl.reshape(tl.broadcast_to(den[:, :, None], [RC, NB, 8]), [RC, BH])
        byte = _nvfp4_nibbles(x_e, dp) | (_nvfp4_nibbles(x_o, dp) << 4)
        tl.store(lp_data + i_m * (V * (K // 2)) + o_r[:, None] * (K // 2) + o_i[None, :],
                 byte.to(tl.uint8), mask=m)
        tl.store(lp_scale + i_m * (V * (K // 16)) + o_r[:, None] * (K // 16) + o_b[None, :],
                 sbits.to(tl.uint8), mask=m_r[:, None] & m_b[None, :])
