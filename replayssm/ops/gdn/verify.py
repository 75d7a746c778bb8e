"""ReplaySSM speculative verification for Gated DeltaNet (and, through `IS_KDA`, Kimi Delta
Attention): T tokens per row in one launch, output-only (docs/state-layout.md, `verify`; SPEC
section 4).

Each program owns one `(row, value head, V-block)` tile `[BV, K]` of the checkpoint `C`, reads
it once and serves all T drafts. For the row's slot with cursor `h` and `n` drafts, the drafts
follow `h' = h`, or `h' = 0` after an early flush (`h + n > window`: the committed records are
folded into the tile first and it is written back). Draft `t` sits at position `h' + t`; with
`P_t = a_t S_{t-1}` (never materialised) and `G(i..p) = exp(ld_i + ... + ld_p)`:

    P_t k = G(0..h'+t) C k + sum_{j<h'} G(j+1..h'+t) (k_j.k) u_j + sum_{r<t} G(h'+r+1..h'+t) (k_r.k) u_r
    u_t   = beta_t (v_t - P_t k_t)                    (forward substitution over the drafts)
    o_t   = P_t q_t + (k_t.q_t) u_t

The delta rule's `u` of a value row depends on that row of `S` only, so the V-blocks of a head
are independent programs. The drafts are taken in order, one static iteration each: draft t's
matrix-vector products with the tile (`C k_t`, `C q_t`), with the committed keys and with the
earlier drafts' keys (kept in registers), then its `u_t` from the `u` of drafts before it, so a
poisoned later draft cannot reach it. No tensor-core product: padding T to a dot's 16 columns
would multiply the tile's work (T = 2: 8x), and FMA dots hold whole rows of both operands.

Every tile with K columns (the checkpoint, the committed and the drafts' keys) is laid out by
`utils.tiles.tile_offsets` with KS slices of K per thread, and every K-vector (a draft's key,
query, KDA decay) is held in the tiles' shape (`[KS, 1, BK // KS]`): a product with a tile is
mostly in-thread FMAs and adds, no layout change of the vector per tile. KDA's decay is a `[K]`
vector that scales the key columns instead of whole terms.

On a GPU, GDN and KDA run the Gluon kernel of gluon_verify.py instead (config `gluon`, default
on where it applies: K = 128, BV = 16 * num_warps, windows up to 32, T <= window; on the H200 at
Kimi Linear's shape, batch 256, it verifies in 1.19-2.94x a conventional step where this kernel
takes 4.7-14.6x); the CPU interpreter runs this one.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_tensor, may_sync
from ..utils.cursor import slot_bases, verify_hand_off
from ..utils.launch import arrive_counter, gluon_aligned, slot_pads
from ..utils.tiles import check_slices, tile_offsets
from .common import (_FLOATS, _for_store, _interpreting, _load_head, _load_qk, _scale, _write_shared,
                     check_cursor_values, check_devices, check_slot_ids, check_slot_values, check_state)
from .gluon_verify_host import gluon_verify_unsupported, launch_gluon_verify
from .verify_mma import launch_verify_mma, mma_verify_unsupported

__all__ = ["replay_verify", "run_verify", "verify_config"]

MAX_DRAFT = 8

# ---------------------------------------------------------------------------------------------
# The verify kernel.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _kvec(x, KS: tl.constexpr):
    """A `[BK]` vector shaped to broadcast over the rows of a `tile_offsets` tile."""
    if KS == 1:
        return x[None, :]
    else:
        return tl.reshape(x, (KS, x.shape[0] // KS))[:, None, :]


@triton.jit
def _kdot(b_X, x, KS: tl.constexpr):
    """Rows of a `tile_offsets` tile dotted with a `[BK]` vector: `[R]`."""
    if KS == 1:
        return tl.sum(b_X * x[None, :], axis=1)
    else:
        return tl.sum(tl.sum(b_X * _kvec(x, KS), axis=2), axis=0)


@triton.jit
def _rows(x, KS: tl.constexpr):
    """A per-row `[R]` vector shaped to broadcast over the rows of a `tile_offsets` tile."""
    if KS == 1:
        return x[:, None]
    else:
        return x[None, :, None]


@triton.jit
def _tile_zeros(R: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr):
    """A zero `[R, BK]` tile in the shape of `tile_offsets`."""
    if KS == 1:
        return tl.zeros([R, BK], dtype=tl.float32)
    else:
        return tl.zeros([KS, R, BK // KS], dtype=tl.float32)


@triton.jit
def _fold(b_C, h, p_ld, p_w, p_k, stride_ld, stride_w, stride_k, m_w, m_k, KS: tl.constexpr,
          IS_KDA: tl.constexpr):
    """`b_C` after records `0..h-1`, oldest first, one fp32 rank-1 step each (`S <- a_j S +
    u_j k_j^T`, the arithmetic of `utils.cursor.fold_pending`), in the tile's own shape: `p_w`,
    `m_w` `[BV]`, `p_k`, `m_k` (and KDA's `p_ld`) `[BK]`."""
    for j in range(0, h):
        b_w = tl.load(p_w + j * stride_w, mask=m_w, other=0.).to(tl.float32)
        b_k = tl.load(p_k + j * stride_k, mask=m_k, other=0.).to(tl.float32)
        if IS_KDA:
            b_C = b_C * _kvec(tl.exp(tl.load(p_ld + j * stride_ld, mask=m_k, other=0.)), KS)
        else:
            b_C = b_C * tl.exp(tl.load(p_ld + j * stride_ld))
        b_C += _rows(b_w, KS) * _kvec(b_k, KS)
    return b_C


@triton.jit
def _replay_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, o,
    ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts,
    pad_ckpt, pad_ld, pad_w, pad_k, pad_cur, pad_pend,
    scale, window,
    stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
    stride_v_b, stride_v_t, stride_v_h, stride_a_b, stride_a_t, stride_a_h,
    stride_b_b, stride_b_t, stride_b_h,
    T: tl.constexpr, TP: tl.constexpr, HV: tl.constexpr, HK: tl.constexpr, V: tl.constexpr,
    K: tl.constexpr, LBCAP: tl.constexpr, LB: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    KS: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr, IS_KDA: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, HAS_NDRAFT: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    HG: tl.constexpr = HV // HK
    # grid (HV * NV, Bt), V-block fastest: a program owns V-block i_v of value head i_hv
    pid = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_v = pid % NV
    i_hv = pid // NV
    i_hk = i_hv // HG

    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_o = o + (i_b * T * HV + i_hv) * V

    i_s = tl.load(slot_ids + i_b).to(tl.int64)
    if i_s < 0:
        for t in tl.static_range(T):
            tl.store(p_o + t * (HV * V) + o_v, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty),
                     mask=m_v)
        return
    # slot-strided state (vLLM's pages): the bases moved by the slot's padding
    ckpt, buf_ld, buf_w, buf_k, cursor = slot_bases(i_s, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld,
                                                    pad_w, pad_k, pad_cur)
    pending += i_s * pad_pend
    h = tl.load(cursor + i_s).to(tl.int64)
    if HAS_NDRAFT:
        # unvalidated counts are clamped to 0..T, so that no draft lands past the buffer
        n = tl.minimum(tl.maximum(tl.load(num_drafts + i_b).to(tl.int64), 0), T)
    else:
        n = tl.full([], T, tl.int64)
    flush = h + n > window
    keep = h + n <= window
    hc = tl.where(flush, 0, h)              # committed records the drafts follow (h')

    # the tile; int32 offsets added to scalar 64-bit bases
    p_C = ckpt + (i_s * HV + i_hv) * (V * K)
    o_C, m_C = tile_offsets(o_v, m_v, K, BK, KS)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_C = tl.load(p_C + o_C, mask=m_C, other=0., eviction_policy="evict_first")
    RA: tl.constexpr = 0 if KS == 1 else 1                                   # the tiles' row axis

    # Rows j of the record tiles are buffer positions: committed records j < h' (none after a
    # flush), then each draft r at h' + r once solved, so that draft t reads rows < h' + t only
    # (h' + t < h' + n <= max(window, T) <= LB: the tiles are sized by the window). The rows'
    # keys (KDA: weighted by their decay to the current draft), u, and GDN's log weights; rows
    # at or past the cursor are selected away after the load
    o_j = tl.arange(0, LB)
    m_j = o_j < hc
    m_j1 = (o_j + 1) < hc
    o_p0 = i_s * LBCAP
    o_Ka, m_Ka = tile_offsets(o_j * HK, m_j, K, BK, KS)
    b_Ka = tl.load(buf_k + (o_p0 * HK + i_hk) * K + o_Ka, mask=m_Ka, other=0.)
    b_Ka = tl.where(_rows(m_j, KS), b_Ka.to(tl.float32), 0.)
    b_Ua = tl.load(buf_w + (o_p0 * HV + i_hv) * V + (o_j[:, None] * (HV * V) + o_v[None, :]),
                   mask=m_j[:, None] & m_v[None, :], other=0.)
    b_Ua = tl.where(m_j[:, None], b_Ua.to(tl.float32), 0.)                  # [LB, BV]
    # lane j of the shifted decays holds ld_{j+1}: a reverse scan gives each record's suffix sum
    if IS_KDA:
        p_ld = buf_ld + (o_p0 * HV + i_hv) * K
        o_L, m_L = tile_offsets((o_j + 1) * HV, m_j1, K, BK, KS)
        b_LDs = tl.where(_rows(m_j1, KS), tl.load(p_ld + o_L, mask=m_L, other=0.), 0.)
        b_ld0 = tl.load(p_ld + o_k, mask=tl.where(hc > 0, m_k, False), other=0.)
        b_ld0 = tl.where(hc > 0, b_ld0, 0.)
        # weights as products of factors <= 1 (exp of each decay, as the recurrence applies
        # them): rows scaled per draft, the checkpoint's weight a running [BK] product
        b_Ka = b_Ka * tl.exp(tl.cumsum(b_LDs, axis=RA, reverse=True))
        b_g = tl.exp(b_ld0 + tl.reshape(tl.sum(b_LDs, axis=RA), (BK,)))
    else:
        p_ld = buf_ld + o_p0 * HV + i_hv
        b_LDs = tl.where(m_j1, tl.load(p_ld + (o_j + 1) * HV, mask=m_j1, other=0.), 0.)   # [LB]
        b_ld0 = tl.where(hc > 0, tl.load(p_ld, mask=hc > 0, other=0.), 0.)
        b_La = tl.cumsum(b_LDs, axis=0, reverse=True)     # record j: ld_{j+1} + ... + ld_{h'-1}
        b_Lc = b_ld0 + tl.sum(b_LDs, axis=0)              # ld_0 + ... + ld_{h'-1}

    if flush:
        # records 0..h-1 folded into the tile, oldest first (exact fp32, the conventional
        # arithmetic), re-read from L1/L2; the new checkpoint is stored before the drafts start
        b_C = _fold(b_C, h, p_ld + (o_k if IS_KDA else 0), buf_w + (o_p0 * HV + i_hv) * V + o_v,
                    buf_k + (o_p0 * HK + i_hk) * K + o_k, HV * K if IS_KDA else HV, HV * V, HK * K,
                    m_v, m_k, KS, IS_KDA)
        tl.store(p_C + o_C, b_C, mask=m_C)
        # this program's own records 0..n-1, read by all its threads above, are overwritten below
        tl.debug_barrier()

    own_hk = (i_v == 0) & (i_hv % HG == 0)
    # a loop, not unrolled: unrolled, the compiler hoists every draft's loads and K-vectors
    # (each replicated over the tile's rows) to the start, and registers grow with T
    for t in range(0, T):
        b_q, b_k = _load_qk(q + t * stride_q_t, k + t * stride_k_t, i_b, i_hk, o_k, m_k, scale,
                            stride_q_b, stride_q_h, stride_k_b, stride_k_h, USE_QK_L2NORM)
        b_v, b_ld, b_beta = _load_head(v + t * stride_v_t, a + t * stride_a_t, b + t * stride_b_t,
                                       A_log, dt_bias, i_b, i_hv, o_v, m_v, o_k, m_k,
                                       stride_v_b, stride_v_h, stride_a_b, stride_a_h,
                                       stride_b_b, stride_b_h, K, IS_KDA)
        m_a = o_j < hc + t                       # the rows draft t reads
        if IS_KDA:
            b_e = tl.exp(b_ld)
            b_g = b_g * b_e
            b_Ka = b_Ka * _kvec(b_e, KS)
            b_Ck = _kdot(b_C, b_k * b_g, KS)
            b_Cq = _kdot(b_C, b_q * b_g, KS)
            b_ck = _kdot(b_Ka, b_k, KS)                                     # [LB]
            b_cq = _kdot(b_Ka, b_q, KS)
        else:
            b_La += b_ld
            b_Lc += b_ld
            b_gC = tl.exp(b_Lc)
            b_Ck = _kdot(b_C, b_k, KS) * b_gC
            b_Cq = _kdot(b_C, b_q, KS) * b_gC
            b_w = tl.where(m_a, tl.exp(b_La), 0.)
            b_ck = _kdot(b_Ka, b_k, KS) * b_w
            b_cq = _kdot(b_Ka, b_q, KS) * b_w
        b_kq = tl.sum(b_k * b_q)
        b_u = b_beta * (b_v - b_Ck - tl.sum(b_Ua * b_ck[:, None], axis=0))
        b_o = b_Cq + tl.sum(b_Ua * b_cq[:, None], axis=0) + b_kq * b_u
        ok = t < n
        tl.store(p_o + t * (HV * V) + o_v, _for_store(tl.where(ok, b_o, 0.), p_o, EXACT_BF16), mask=m_v)
        # u rows by their owner, at position h' + t (< LBCAP guards other slots against a bad cursor)
        o_pt = o_p0 + hc + t
        p_w = buf_w + (o_pt * HV + i_hv) * V + o_v
        tl.store(p_w, _for_store(b_u, p_w, EXACT_BF16), mask=tl.where(ok & (hc + t < LBCAP), m_v, False))
        # without a flush, the draft's decay and key too (V-block 0 of the head, of the key
        # head's first value head): no program reads positions >= h in this launch
        sole = ok & (hc + t < LBCAP) & keep & (i_v == 0)
        if IS_KDA:
            tl.store(buf_ld + (o_pt * HV + i_hv) * K + o_k, b_ld, mask=tl.where(sole, m_k, False))
        else:
            tl.store(buf_ld + o_pt * HV + i_hv, b_ld, mask=sole)
        p_kh = buf_k + (o_pt * HK + i_hk) * K + o_k
        tl.store(p_kh, _for_store(b_k, p_kh, EXACT_BF16), mask=tl.where(sole & own_hk, m_k, False))
        if t + 1 < T:
            # the draft becomes row h' + t (decay weight 1 so far)
            l_t = o_j == hc + t
            b_Ka = tl.where(_rows(l_t, KS), _kvec(b_k, KS), b_Ka)
            b_Ua = tl.where(l_t[:, None], b_u[None, :], b_Ua)
            if not IS_KDA:
                b_La = tl.where(l_t, 0., b_La)

    last = verify_hand_off(arrive, cursor, pending, epoch, i_s, hc, n, flush, HV * NV)
    if last & flush:
        _write_shared(k, a, A_log, dt_bias, buf_ld, buf_k, i_b, i_s, n, o_k, m_k,
                      stride_k_b, stride_k_t, stride_k_h, stride_a_b, stride_a_t, stride_a_h,
                      T, HV, HK, K, LBCAP, HVP, HKP, IS_KDA, USE_QK_L2NORM, EXACT_BF16)


# ---------------------------------------------------------------------------------------------
# Launcher, launch configs, custom ops, public function.
# ---------------------------------------------------------------------------------------------

_CONFIG_KEYS = ("BV", "num_warps", "num_stages", "KS", "gluon", "maxnreg", "kq", "mma")


def _check_config(cfg: dict, BK: int) -> dict:
    BV, nw, ns, reg = cfg["BV"], cfg["num_warps"], cfg["num_stages"], cfg["maxnreg"]
    if isinstance(BV, bool) or not isinstance(BV, int) or BV < 1 or BV & (BV - 1):
        raise ValueError(f"config BV={BV!r} must be a power of two")
    if nw not in (1, 2, 4, 8, 16):
        raise ValueError(f"config num_warps={nw!r} must be one of 1, 2, 4, 8, 16")
    if isinstance(ns, bool) or not isinstance(ns, int) or ns < 1:
        raise ValueError(f"config num_stages={ns!r} must be a positive int")
    if isinstance(reg, bool) or not isinstance(reg, int) or reg < 0:
        raise ValueError(f"config maxnreg={reg!r} must be a non-negative int (0: no cap)")
    check_slices(cfg["KS"], BK)
    return cfg


def verify_config(family: str, V: int, K: int, T: int, config: Optional[dict] = None, *,
                  batch: Optional[int] = None, HV: Optional[int] = None, Hk: Optional[int] = None,
                  window: Optional[int] = None, Lb: Optional[int] = None, gpu: Optional[bool] = None) -> dict:
    """The launch config of `replay_verify` for value dim `V`, key dim `K`, `T` tokens (with a
    caller's overrides of `BV`, `num_warps`, `num_stages`, `KS`: the Triton kernel's tiles held
    as KS slices of K per thread, see ops/utils/tiles.py; `maxnreg`: a register cap, 0 none;
    `gluon`: the Gluon kernel of gluon_verify.py; `kq`, GDN's Gluon kernel only, default off, not
    yet timed: the drafts' Gram products and the records' products with the drafts' keys and
    queries formed once per (row, key head) by a launch before it,
    `utils.key_products.gdn_verify_key_products`, instead of by every program of the key head;
    `mma`, GDN only: the kernel of verify_mma.py, its products on 16-bit tensor cores at fp32
    accuracy, windows up to 32, BV at least 16 (defaults: the largest of 64, 32, 16 dividing V,
    in BV / 16 warps); not with `kq`; with `gluon=True` asked for, the Gluon kernel with the
    tile's products on the tensor cores, exact, `kq` as asked. That Gluon variant is the default
    where the Gluon kernel runs at T = 8 (`gluon_mma_default`); elsewhere `mma` is off unless asked).

    `gluon` (default True) applies on a GPU (`gpu`; None: CUDA present and not the CPU interpreter) where
    `gluon_verify_unsupported` has no objection to the shape, window (`window`, `Lb`; None: 16
    and window + T) and config; the Gluon defaults are then BV = 64
    (the largest of 64, 32, 16 dividing V) in BV / 16 warps, registers capped at 128 for T > 4
    (uncapped they take about 150). Elsewhere the Triton kernel runs, with its own defaults and
    the caller's overrides. The result's `gluon` says which kernel runs.

    Chosen offline from the code compiled for sm_90a (registers, spills, instruction counts;
    benchmarks/tools/regcount.py `gdn-verify` / `kda-verify`); timed on the H200 in
    verify_gluon_gdn_h200.json and verify_gluon_kda_h200.json (in git history at 16d05f1)."""
    BK = triton.next_power_of_2(K)
    user = dict(config or {})
    unknown = set(user) - set(_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}; allowed {list(_CONFIG_KEYS)}")
    want = user.pop("gluon", True)
    if not isinstance(want, bool):
        raise ValueError(f"config gluon={want!r} must be a bool")
    kq = user.pop("kq", False)
    if not isinstance(kq, bool):
        raise ValueError(f"config kq={kq!r} must be a bool")
    mma = user.pop("mma", False)
    if not isinstance(mma, bool):
        raise ValueError(f"config mma={mma!r} must be a bool")
    if mma and want and "gluon" in (config or {}):
        if family != "gdn":
            raise ValueError("config gluon=True, mma=True: GDN only (KDA's per-channel decays are inside the "
                             "products' operands, not raw 16-bit inputs)")
        # the Gluon kernel with the tile's products on the tensor cores; off the GPU the launch
        # runs the Triton tensor-core kernel (verify_mma.py) instead, as exact
        cfg, why = _gluon_config(family, HV, Hk, V, K, T, user, BK, window, Lb)
        if why is not None:
            raise ValueError(f"config gluon=True, mma=True: {why}")
        return dict(cfg, gluon=True, kq=kq, mma=True)
    if mma:
        return _mma_config(family, V, K, T, user, BK, kq, 16 if window is None else window, Lb)
    if kq and family != "gdn":
        raise ValueError("config kq=True: the key head's shared products are GDN's (KDA's draft vectors carry "
                         "each value head's decays)")
    if gpu is None:
        gpu = torch.cuda.is_available() and not _interpreting()
    ks = min(8, max(1, BK // 4))
    if want and gpu:
        cfg, why = _gluon_config(family, HV, Hk, V, K, T, user, BK, window, Lb)
        if why is None:
            return dict(cfg, gluon=True, kq=kq, mma=gluon_mma_default(family, T, config))
    BV = min(32, triton.next_power_of_2(V))
    cfg = {"BV": BV, "num_warps": 4 if BV * BK >= 4096 else 1, "num_stages": 1, "KS": ks, "maxnreg": 0}
    return dict(_check_config(dict(cfg, **user), BK), gluon=False, kq=False, mma=False)


# GDN's Gluon kernel forms the tile's products on the tensor cores by default at this many
# drafts. H100, batch 256, window 16, drafts all rejected .. all accepted, over a conventional
# step (verify_gluon_mma_gdn_h100.json): Qwen3.5-4B T=8 1.22-1.53x against the FMA kernel's
# 1.28-1.60x, Qwen3.5-122B 1.21-1.50x against 1.23-1.56x; at T=4 slower (0.83-0.97x against
# 0.81-0.94x, 0.81-0.96x against 0.76-0.89x). The H200 is not measured. Its GPU tests:
# tests/test_verify_gluon_gdn.py -k mma
GLUON_MMA_T = 8


def gluon_mma_default(family: str, T: int, config: Optional[dict]) -> bool:
    """Whether the Gluon verify kernel takes the tensor-core tile products when the config does
    not say: GDN at `GLUON_MMA_T` drafts."""
    return family == "gdn" and T == GLUON_MMA_T and "mma" not in (config or {})


def _gluon_config(family: str, HV, Hk, V: int, K: int, T: int, user: dict, BK: int, window: Optional[int],
                  Lb: Optional[int]):
    """The Gluon kernel's launch config (its defaults under the caller's overrides) and why the
    kernel does not cover it (None when it does)."""
    bv = next((c for c in (64, 32, 16) if V % c == 0), 16)
    cfg = _check_config(dict({"BV": bv, "num_warps": bv // 16, "num_stages": 1, "KS": min(8, max(1, BK // 4)),
                              "maxnreg": 128 if T > 4 else 0}, **user), BK)
    L = 16 if window is None else window
    return cfg, gluon_verify_unsupported(family, HV or 1, Hk or 1, V, K, T, L, L + T if Lb is None else Lb,
                                         cfg["BV"], cfg["num_warps"])


def _mma_config(family: str, V: int, K: int, T: int, user: dict, BK: int, kq: bool, window: int,
                Lb: Optional[int]) -> dict:
    """`verify_config` for `mma=True`: the kernel of verify_mma.py or a ValueError saying why not."""
    if kq:
        raise ValueError("config mma=True is a kernel of its own: not with kq=True")
    bv = next((c for c in (64, 32, 16) if V % c == 0), 16)
    cfg = _check_config(dict({"BV": bv, "num_warps": max(1, bv // 16), "num_stages": 1,
                              "KS": min(8, max(1, BK // 4)), "maxnreg": 0}, **user), BK)
    why = mma_verify_unsupported(family, V, K, T, window, window + T if Lb is None else Lb, cfg["BV"])
    if why is not None:
        raise ValueError(f"config mma=True: {why}")
    return dict(cfg, gluon=False, kq=False, mma=True)


def launch_verify(family: str, q, k, v, a, b, A_log, dt_bias, scale: float, ckpt, buf_ld, buf_w,
                  buf_k, cursor, pending, epoch, arrive, slot_ids, num_drafts, window: int, o,
                  use_qk_l2norm: bool, BV: int, num_warps: int, num_stages: int, KS: int,
                  gluon: bool = False, maxnreg: int = 0, kq: bool = False, mma: bool = False) -> None:
    """Launch the Gluon kernel (`gluon`, where it applies: a GPU, the shape and config that
    `gluon_verify_unsupported` accepts), the tensor-core kernel of verify_mma.py (`mma`, GDN
    only) or `_replay_verify_kernel`; inputs already validated.
    `kq`: the Gluon kernel takes the key head's products from a launch before it."""
    Bt, T, Hk, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    Lb = buf_w.shape[1]
    gluon_ok = gluon and Bt > 0 and q.is_cuda and not _interpreting() and \
        gluon_verify_unsupported(family, HV, Hk, V, K, T, window, Lb, BV, num_warps) is None and \
        gluon_aligned(ckpt, buf_ld, buf_w, buf_k)
    if mma and not gluon_ok:
        launch_verify_mma(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch,
                          arrive, slot_ids, num_drafts, window, o, use_qk_l2norm, BV, num_warps, num_stages, family)
        return
    if Bt == 0:
        return
    if gluon_ok:
        launch_gluon_verify(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, pending,
                            epoch, arrive, slot_ids, num_drafts, window, o, use_qk_l2norm, BV, num_warps, maxnreg,
                            family, kq, mma)
        return
    BV = min(BV, triton.next_power_of_2(V))
    NV = triton.cdiv(V, BV)
    _replay_verify_kernel[(HV * NV, Bt)](
        q, k, v, a, b, A_log, dt_bias, o,
        ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids,
        num_drafts if num_drafts is not None else slot_ids,
        *slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor, pending).values(),
        scale, window,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        T=T, TP=max(2, triton.next_power_of_2(T)), HV=HV, HK=Hk, V=V, K=K, LBCAP=Lb,
        # rows: committed records and earlier drafts, h' + t < max(window, T): sized by the
        # window, not the capacity
        LB=max(2, triton.next_power_of_2(max(min(window, Lb), T))), BV=BV, BK=triton.next_power_of_2(K), KS=KS,
        HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(Hk),
        IS_KDA=family == "kda", USE_QK_L2NORM=bool(use_qk_l2norm),
        HAS_NDRAFT=num_drafts is not None, EXACT_BF16=_interpreting(),
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg and not _interpreting() else {}),
    )


_MUTATED = ("o", "ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "pending", "epoch", "arrive")


def _register_verify_op(family: str):
    """The custom op `replayssm::{family}_replay_verify` (GDN and KDA share the kernel)."""

    @torch.library.custom_op(f"replayssm::{family}_replay_verify", mutates_args=_MUTATED)
    def op(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
           dt_bias: Tensor, scale: float, ckpt: Tensor, buf_ld: Tensor, buf_w: Tensor,
           buf_k: Tensor, cursor: Tensor, pending: Tensor, epoch: Tensor, arrive: Tensor,
           slot_ids: Tensor, num_drafts: Optional[Tensor], window: int, o: Tensor,
           use_qk_l2norm: bool, BV: int, num_warps: int, num_stages: int, KS: int,
           gluon: bool = False, maxnreg: int = 0, kq: bool = False, mma: bool = False) -> None:
        launch_verify(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                      cursor, pending, epoch, arrive, slot_ids, num_drafts, window, o,
                      use_qk_l2norm, BV, num_warps, num_stages, KS, gluon, maxnreg, kq, mma)

    @op.register_fake
    def _(q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch,
          arrive, slot_ids, num_drafts, window, o, use_qk_l2norm, BV, num_warps, num_stages, KS,
          gluon=False, maxnreg=0, kq=False, mma=False) -> None:
        return None

    return op


_VERIFY_OPS = {family: _register_verify_op(family) for family in ("gdn", "kda")}


def check_verify_inputs(family: str, q, k, v, a, b, A_log, dt_bias, out, num_drafts) -> tuple:
    """Shapes, dtypes and strides of a verify call's inputs; returns `(Bt, T, Hk, K, HV, V)`."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [Bt, T, Hk, K] tensor, got shape {getattr(q, 'shape', None)}")
    Bt, T, Hk, K = q.shape
    if not 1 <= T <= MAX_DRAFT:
        raise ValueError(f"q has T={T} tokens per row, expected 1..{MAX_DRAFT}")
    check_tensor("k", k, (Bt, T, Hk, K))
    if not isinstance(v, Tensor) or v.dim() != 4 or tuple(v.shape[:2]) != (Bt, T):
        raise ValueError(f"v must be a [Bt={Bt}, T={T}, HV, V] tensor, got shape {getattr(v, 'shape', None)}")
    HV, V = v.shape[2], v.shape[3]
    if Hk < 1 or HV % Hk:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads Hk={Hk}")
    if family == "kda":
        check_tensor("a", a, (Bt, T, HV, K))
        check_tensor("dt_bias", dt_bias, (HV, K))
    else:
        check_tensor("a", a, (Bt, T, HV))
        check_tensor("dt_bias", dt_bias, (HV,))
    check_tensor("b", b, (Bt, T, HV))
    check_tensor("A_log", A_log, (HV,))
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", A_log),
                    ("dt_bias", dt_bias)):
        check_tensor(name, t, dtypes=_FLOATS)
    for name, t in (("q", q), ("k", k), ("v", v)) + ((("a", a),) if family == "kda" else ()):
        check_tensor(name, t, inner=True)
    check_tensor("A_log", A_log, contiguous=True)
    check_tensor("dt_bias", dt_bias, contiguous=True)
    if out is not None:
        check_tensor("out", out, (Bt, T, HV, V), _FLOATS, contiguous=True)
    if num_drafts is not None:
        check_tensor("num_drafts", num_drafts, (Bt,), (torch.int32,), contiguous=True)
    return Bt, T, Hk, K, HV, V


def _check_draft_counts(num_drafts, T: int) -> None:
    """`1 <= num_drafts[b] <= T` (a host sync: skipped where `may_sync` says no)."""
    if num_drafts is None or not may_sync() or num_drafts.numel() == 0:
        return
    n = num_drafts.detach().cpu()
    bad = (n < 1) | (n > T)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"num_drafts[{i}]={int(n[i])} is outside 1..T={T}")


def run_verify(family, q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k, cursor,
               pending, epoch, slot_ids, window, num_drafts=None, out=None, use_qk_l2norm=True,
               config=None, arrive=None, validate=True) -> Tensor:
    """Validate, resolve the config and launch the family's verify op (GDN and KDA wrappers)."""
    if validate:
        Bt, T, Hk, K, HV, V = check_verify_inputs(family, q, k, v, a, b, A_log, dt_bias, out, num_drafts)
        if arrive is None:
            arrive = arrive_counter(ckpt.device, ckpt.shape[0]) if isinstance(ckpt, Tensor) \
                and ckpt.dim() == 4 else None
        N, Lb = check_state(family, ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive,
                            HV, Hk, V, K, window, slot_strided=True)
        check_tensor("pending", pending, (N,), (torch.int32,))
        if Lb < window + T:
            raise ValueError(f"buffer capacity Lb={Lb} must be at least window + T = {window} + {T}")
        check_slot_ids(slot_ids, Bt)
        check_devices(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ckpt=ckpt,
                      buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k, cursor=cursor, pending=pending,
                      epoch=epoch, arrive=arrive, slot_ids=slot_ids, num_drafts=num_drafts, out=out)
        check_slot_values(slot_ids, N)
        check_cursor_values(cursor, slot_ids, Lb, window)
        _check_draft_counts(num_drafts, T)
    elif arrive is None:
        arrive = arrive_counter(ckpt.device, ckpt.shape[0])
    K, V, T = q.shape[-1], v.shape[-1], q.shape[1]
    cfg = verify_config(family, V, K, T, config, batch=q.shape[0], HV=v.shape[2], Hk=q.shape[2],
                        window=int(window), Lb=buf_w.shape[1], gpu=q.is_cuda and not _interpreting())
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    _VERIFY_OPS[family](
        q, k, v, a, b, A_log, dt_bias, _scale(scale, K), ckpt, buf_ld, buf_w, buf_k, cursor,
        pending, epoch, arrive, slot_ids, num_drafts, int(window), out, bool(use_qk_l2norm),
        cfg["BV"], cfg["num_warps"], cfg["num_stages"], cfg["KS"], cfg["gluon"], cfg["maxnreg"], cfg["kq"],
        cfg["mma"])
    return out


def replay_verify(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                  dt_bias: Tensor, scale: Optional[float], ckpt: Tensor, buf_ld: Tensor,
                  buf_w: Tensor, buf_k: Tensor, cursor: Tensor, pending: Tensor, epoch: Tensor,
                  slot_ids: Tensor, window: int, num_drafts: Optional[Tensor] = None,
                  out: Optional[Tensor] = None, use_qk_l2norm: bool = True,
                  config: Optional[dict] = None, *, arrive: Optional[Tensor] = None,
                  validate: bool = True) -> Tensor:
    """Output-only verification of `T` tokens per row of a GDN layer, in one launch
    (docs/state-layout.md, `verify`; SPEC section 4).

    Args:
        q, k: `[Bt, T, Hk, K]` raw queries and keys (L2-normalised in the kernel when
            `use_qk_l2norm`; `q` then scaled by `scale`, None: `K ** -0.5`), `1 <= T <= 8`.
        v: `[Bt, T, HV, V]`. a: `[Bt, T, HV]` raw decay input; b: `[Bt, T, HV]` raw beta input.
            Inner-contiguous; any batch and draft strides.
        A_log, dt_bias: `[HV]`; `log a = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`.
        ckpt: `[N, HV, V, K]` fp32; buf_ld: `[N, Lb, HV]` fp32; buf_w: `[N, Lb, HV, V]` (`u`);
            buf_k: `[N, Lb, Hk, K]` (fp32, bf16 or fp16 records); cursor, pending: `[N]` int32;
            epoch: `[N]` int64; `Lb >= window + T`. Updated in place.
        slot_ids: `[Bt]` int; negative ids are padding rows (zero output, no state touched).
        window: `L`; a row with cursor `h` (`0 <= h <= L`) and `n` drafts flushes first when
            `h + n > L` (records `0..h-1` folded into `ckpt`, `epoch += 1`, drafts from 0).
        num_drafts: `[Bt]` int32, `1 <= n_b <= T` drafts per row (None: T). Drafts `t >= n_b`
            are not written and their outputs are zero.
        out: optional `[Bt, T, HV, V]` contiguous output (default: new tensor of `v`'s dtype).
        config: overrides of `BV`, `num_warps`, `num_stages`, `KS`, `maxnreg`, `gluon` (the Gluon
            kernel on a GPU where it applies, default True), `mma` (tensor-core products, default
            False; see `verify_config`).
        arrive: `[N]` int32 zeroed counters (default: a cached buffer, see `arrive_counter`).
        validate: check shapes, dtypes, devices, slot ids, cursors and draft counts (the last
            three read device values back, skipped during CUDA-graph capture). False: no check.

    Returns:
        `out`: `[Bt, T, HV, V]`, `out[b, t] = S_{h'+t} q_t` (the conventional recurrence from
        the committed state through drafts `0..t`). Afterwards `cursor = h'`, `pending = n`.
    """
    return run_verify("gdn", q, k, v, a, b, A_log, dt_bias, scale, ckpt, buf_ld, buf_w, buf_k,
                      cursor, pending, epoch, slot_ids, window, num_drafts, out, use_qk_l2norm,
                      config, arrive, validate)
