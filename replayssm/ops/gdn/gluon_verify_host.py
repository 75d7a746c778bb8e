"""The host side of GDN's (and KDA's) Gluon verify kernel (gluon_verify.py): what it covers, its
constexpr arguments, its launch."""
from __future__ import annotations

import os
from typing import Optional

import triton

from ..utils.dots import pieces
from ..utils.gluon import gluon_record_tile, gluon_shape_supported
from ..utils.key_products import gdn_verify_key_products
from ..utils.launch import slot_pads
from .gluon_verify import HAVE_GLUON

if HAVE_GLUON:
    from .gluon_verify import _gluon_verify_kernel

__all__ = ["LEAN", "ROWS", "gluon_verify_constexprs", "gluon_verify_unsupported", "launch_gluon_verify",
           "lean_applies"]

# REPLAYSSM_GLUON_VERIFY_LEAN=1 (experimental, off: not yet run on a GPU; `lean_applies`): the
# drafts' Gram products, the key records' products with the drafts and the records' terms
# (U^T Z) on the tensor cores too (gluon_verify_drafts._draft_products_mma,
# utils.gluon_mma._records_weights_mma), the fp32 tile split by truncation
# (utils.gluon_mma._split_bf16_rz), the solve's decays, gates and weights formed once per
# element rather than in every thread (gluon_verify_drafts._solve_weights). The verify step is
# bound by instruction issue (docs/verify.md): time it against the default.
LEAN = os.environ.get("REPLAYSSM_GLUON_VERIFY_LEAN") == "1"
# REPLAYSSM_GLUON_VERIFY_ROWS=2 (experimental, with LEAN where it applies, not yet run on a GPU):
# programs of twice the rows in the same warps (128 rows in 4 at V = 128), so that the drafts'
# setup serves twice the rows and the solve's one-row-per-thread layout holds no row twice.
# Triton 3.6, Qwen3.5-4B, T = 8: about 178 warp-instructions a row against 300, but 87.5 KB of
# shared memory (2 programs per SM against 4); read at each launch; nothing changes where LEAN does not apply
ROWS = 2 if os.environ.get("REPLAYSSM_GLUON_VERIFY_ROWS") == "2" else 1


def lean_applies(family: str, T: int, mma: bool, kq: bool, x_pieces: int, k_pieces: int, w_pieces: int = 1,
                 lp_code: int = 0) -> bool:
    """Whether `lean` changes the kernel: GDN with `mma`, without `kq`, 5..8 drafts (8 padded
    rows), token inputs, key and u records of one bf16 piece each (`dots.pieces`), not on a
    pool's 16-bit copy (`lp_code`: it compiles, but the copy pools' GPU tests take fp32 inputs,
    so nothing would check it there)."""
    return family == "gdn" and bool(mma) and not kq and 5 <= T <= 8 and x_pieces == k_pieces == w_pieces == 1 \
        and not lp_code


# verify.MAX_DRAFT
_MAX_T = 8


def gluon_verify_unsupported(family: str, HV: int, Hk: int, V: int, K: int, T: int, window: int, Lb: int,
                             BV: int, num_warps: int) -> Optional[str]:
    """Why the Gluon verify kernel does not cover this family, shape and launch config; None
    when it does (GDN and KDA; K = 128, BV = 16 * num_warps dividing V, windows up to 32)."""
    if family not in ("gdn", "kda"):
        return f"family {family!r} (GDN and KDA only)"
    if not 1 <= T <= _MAX_T:
        return f"T={T} drafts (1..{_MAX_T})"
    if T > window:
        # Mamba-2's Gluon verify failed its H200 round test with a window below T, and this
        # kernel's test of that case has not run on a GPU yet
        return f"T={T} drafts above the window {window} (the Triton kernel)"
    if HV < 1 or Hk < 1 or HV % Hk:
        return f"HV={HV} is not a multiple of Hk={Hk}"
    return gluon_shape_supported(V, K, window, Lb, BV, num_warps) or None


def gluon_verify_constexprs(T: int, HV: int, Hk: int, V: int, K: int, window: int, Lb: int, BV: int,
                            num_warps: int, use_qk_l2norm: bool = True, has_ndraft: bool = True,
                            w_bytes: int = 2, k_bytes: int = 2, family: str = "gdn", kq: bool = False,
                            mma: bool = False, x_pieces: int = 1, k_pieces: int = 1, lp_code: int = 0,
                            refold_rows: int = 0, refold_mma: bool = False,
                            lean: Optional[bool] = None, w_pieces: int = 1) -> dict:
    """The kernel's constexpr arguments for a launch (offline compiles use them too); `w_bytes`,
    `k_bytes`: the element sizes of the u and key records (16-byte copies); `family` "gdn" or
    "kda"; `mma` (GDN): the tile's products with the drafts' raw keys and queries (of
    `x_pieces` bf16 pieces, `dots.pieces`) on the tensor cores, and an early flush's fold too,
    the key records of `k_pieces` pieces. `lp_code`: a pool's 16-bit copy (1 fp16, 2
    bf16), verify_lp.py's contract, whose refold takes `refold_rows` rows of the tile at a time
    (0: 4 per warp), or with `refold_mma` (GDN) runs on the tensor cores (`_refold_lp_mma`).
    `lean` (None: the module's `LEAN` as it is at the call): where it applies (`lean_applies`; the u
    records of `w_pieces` pieces), every product of the drafts on the tensor cores, the fp32
    tile split by truncation, the solve's factors formed once per element."""
    TP = max(2, triton.next_power_of_2(T))
    lean = LEAN if lean is None else lean
    return dict(T=T, TP=TP, TL=min(TP, 4), HV=HV, HK=Hk, V=V, K=K, LBCAP=Lb, BV=BV,
                BL=gluon_record_tile(window, Lb), RC=2 * num_warps, RCF=4 * num_warps,
                HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(Hk), VW=16 // w_bytes,
                VK=16 // k_bytes, USE_QK_L2NORM=bool(use_qk_l2norm), HAS_NDRAFT=bool(has_ndraft),
                NW=num_warps, IS_KDA=family == "kda", KQ=bool(kq) and family == "gdn",
                MMA=bool(mma) and family == "gdn", XP=x_pieces, SWZ=min(8, 4 * num_warps),
                KP=k_pieces, LPT=int(lp_code), RFL=refold_rows or 4 * num_warps, RFM=bool(refold_mma) and family == "gdn",
                LEAN=bool(lean) and lean_applies(family, T, mma, kq, x_pieces, k_pieces, w_pieces, lp_code))


def launch_gluon_verify(q, k, v, a, b, A_log, dt_bias, scale: float, ckpt, buf_ld, buf_w, buf_k, cursor,
                        pending, epoch, arrive, slot_ids, num_drafts, window: int, o, use_qk_l2norm: bool,
                        BV: int, num_warps: int, maxnreg: int = 0, family: str = "gdn", kq: bool = False,
                        mma: bool = False, ckpt_lp=None, lp_code: int = 0, buf_v=None, buf_beta=None,
                        refold_rows: int = 0, refold_mma: bool = False) -> None:
    """Launch `_gluon_verify_kernel` (grid `(HV * V / BV, Bt)`) for `family` "gdn" or "kda"; inputs
    validated, and the caller checked `gluon_verify_unsupported`. `maxnreg`: a register cap (0:
    none). `kq` (GDN): the drafts' Gram products and the records' products with the drafts'
    vectors formed first, once per (row, key head), by `utils.key_products.gdn_verify_key_products`
    instead of by every program of the key head's value heads and V-blocks. `mma` (GDN): the
    tile's products with the drafts' keys and queries on the tensor cores, exact. `ckpt_lp`,
    `lp_code` (1 fp16, 2 bf16; contiguous unpadded state), `buf_v`, `buf_beta`: a pool's
    16-bit copy as int16 bits and the raw records, verify_lp.py's contract (rows without an
    early flush read the copy, with `mma` as one or two bf16 pieces; a flush refolds `ckpt`
    along the HP path and writes both, `refold_rows` of the tile at a time, 0: 4 per warp, or on
    the tensor cores with `refold_mma`)."""
    Bt, T, Hk, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if Bt == 0:
        return
    pads = slot_pads(ckpt, buf_ld, buf_w, buf_k, cursor, pending)
    if lp_code and (lp_code not in (1, 2) or ckpt_lp is None or buf_v is None or buf_beta is None
                    or any(pads.values())):
        raise ValueError("a low-precision copy: fp16 or bf16 (lp_code 1, 2), with the raw records, on "
                         "contiguous unpadded state")
    if refold_rows and (BV % refold_rows or refold_rows % num_warps):
        raise ValueError(f"refold_rows {refold_rows} must divide BV {BV} and be a multiple of num_warps {num_warps}")
    kq = bool(kq) and family == "gdn"
    xp, kp, wp = max(pieces(q.dtype), pieces(k.dtype)), pieces(buf_k.dtype), pieces(buf_w.dtype)
    lean = LEAN and lean_applies(family, T, mma, kq, xp, kp, wp, lp_code)
    if ROWS > 1 and lean and V % (2 * BV) == 0:
        BV *= 2                                      # (the same warps: two rows a thread)
    kqs = gdn_verify_key_products(q, k, buf_k, cursor, slot_ids, scale, use_qk_l2norm,
                                  gluon_record_tile(window, buf_w.shape[1]), max(2, triton.next_power_of_2(T)),
                                  pads["pad_k"], pads["pad_cur"]) if kq else slot_ids
    _gluon_verify_kernel[(HV * (V // BV), Bt)](
        q, k, v, a, b, A_log, dt_bias, o,
        ckpt, buf_ld, buf_w, buf_k, cursor, pending, epoch, arrive, slot_ids,
        num_drafts if num_drafts is not None else slot_ids, kqs,
        ckpt_lp if lp_code else ckpt, buf_v if lp_code else buf_w, buf_beta if lp_code else buf_ld,
        *pads.values(),
        scale, window,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        **gluon_verify_constexprs(T, HV, Hk, V, K, window, buf_w.shape[1], BV, num_warps, use_qk_l2norm,
                                  num_drafts is not None, buf_w.element_size(), buf_k.element_size(), family, kq,
                                  mma, xp, kp, lp_code, refold_rows, refold_mma, lean=lean, w_pieces=wp),
        num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
