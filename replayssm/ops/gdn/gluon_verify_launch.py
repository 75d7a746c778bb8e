"""The host side of GDN's (and KDA's) Gluon verify kernel (gluon_verify.py): its launch."""
from __future__ import annotations

import triton

from ..utils.dots import pieces
from ..utils.gluon import gluon_record_tile
from ..utils.key_products import gdn_verify_key_products
from ..utils.launch import slot_pads
from .gluon_verify import HAVE_GLUON, gluon_verify_constexprs

if HAVE_GLUON:
    from .gluon_verify import _gluon_verify_kernel

__all__ = ["launch_gluon_verify"]


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
                                  mma, max(pieces(q.dtype), pieces(k.dtype)), pieces(buf_k.dtype), lp_code,
                                  refold_rows, refold_mma),
        num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
