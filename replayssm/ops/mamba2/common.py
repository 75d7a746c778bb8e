"""Pieces both Mamba-2 Triton kernels share: the `@triton.jit` device helpers (so that the
replay and conventional kernels differ only in how the recurrence is organised, not in their
elementwise arithmetic), and the checks at the Python boundary."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..utils.checks import check_slot_ids, check_slot_rows, check_slot_values, check_tensor

__all__ = ["softplus", "load_tile", "token_decay", "record_masks", "group_keys", "records_dot",
           "head_values", "head_weights", "check_tensor", "check_slots", "check_state", "check_token_inputs",
           "given", "OPTIONAL_INPUTS", "FLOAT_DTYPES", "RECORD_DTYPES"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
RECORD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def given(name: str):
    """A `triton.heuristics` rule: whether the kernel argument `name` is a tensor (not None)."""
    return lambda args: args[name] is not None


# the kernels' flags of the optional inputs, from the arguments: an absent D or z is passed as
# None (a constexpr, never read), so a launcher never spells the flags out
OPTIONAL_INPUTS = {"HAS_D": given("D"), "HAS_Z": given("z")}


# ----------------------------------------------------------------------------------------------
# Device helpers

@triton.jit
def softplus(x):
    # max(x, 0) + log1p(exp(-|x|)). log1p by Goldberg's correction log(p) * e / (p - 1): plain
    # log(1 + e) loses all relative accuracy for the small dt that long-memory heads use.
    e = tl.exp(-tl.abs(x))
    p = 1.0 + e
    den = tl.where(p == 1.0, 1.0, p - 1.0)
    l1p = tl.where(p == 1.0, e, tl.log(p) * (e / den))
    return tl.maximum(x, 0.0) + l1p


@triton.jit
def load_tile(p, mask, EVEN: tl.constexpr):
    # a checkpoint tile, streamed once (evict first); EVEN: unmasked, fully vectorised
    if EVEN:
        return tl.load(p, eviction_policy="evict_first")
    else:
        return tl.load(p, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def token_decay(dt, dt_bias, A, off_dt, i_h):
    """The current token's `dt = softplus(dt_raw + dt_bias)`, log decay `dt A` of head i_h, and
    `1 / A` (for the records' `dt_j = ld_j / A`; an approximate division, 2 ulp: the IEEE one's
    slow path costs registers)."""
    b_dt = softplus(tl.load(dt + off_dt + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32))
    b_A = tl.load(A + i_h).to(tl.float32)
    return b_dt, b_dt * b_A, tl.fdiv(1.0, b_A)


@triton.jit
def draft_decays(dt, dt_bias, A, off_dt, stride_dt_t, i_h, o_t, m_t):
    """The verify step's drafts (`o_t`, live where `m_t`) of head i_h: `1 / A`, `dt` (0 for
    drafts that are not live) and log decays `dt A`."""
    b_A = tl.load(A + i_h).to(tl.float32)
    b_rA = tl.fdiv(1.0, b_A)
    b_dt = softplus(tl.load(dt + off_dt + o_t * stride_dt_t + i_h, mask=m_t, other=0.0).to(tl.float32)
                    + tl.load(dt_bias + i_h).to(tl.float32))
    b_dt = tl.where(m_t, b_dt, 0.0)
    return b_rA, b_dt, b_dt * b_A


@triton.jit
def write_shared_drafts(dt, B, A, dt_bias, buf_ld, buf_k, slot, n, off_dt, stride_dt_t, off_B, stride_B_t,
                        stride_B_g, o_k, m_k, HV: tl.constexpr, Hk: tl.constexpr, K: tl.constexpr,
                        LB: tl.constexpr, T: tl.constexpr, HVP: tl.constexpr, HKP: tl.constexpr):
    """After a verify step's early flush, by the slot's last program: the drafts' fields that
    other programs of the slot read as committed records until all arrived (every head's
    decay, every group's key), at positions `0..n-1`, from the inputs."""
    o_hv = tl.arange(0, HVP)
    m_hv = o_hv < HV
    o_g = tl.arange(0, HKP)
    m_gk = (o_g < Hk)[:, None] & m_k[None, :]
    b_As = tl.load(A + o_hv, mask=m_hv, other=0.0).to(tl.float32)
    b_bias = tl.load(dt_bias + o_hv, mask=m_hv, other=0.0).to(tl.float32)
    p_lds = buf_ld + slot * (LB * HV) + o_hv
    p_ks = buf_k + slot * (LB * Hk * K) + o_g[:, None] * K + o_k[None, :]
    for t in tl.static_range(T):
        if t < n:
            b_dts = tl.load(dt + off_dt + t * stride_dt_t + o_hv, mask=m_hv, other=0.0)
            tl.store(p_lds + t * HV, softplus(b_dts.to(tl.float32) + b_bias) * b_As, mask=m_hv)
            b_Ks = tl.load(B + off_B + t * stride_B_t + o_g[:, None] * stride_B_g + o_k[None, :],
                           mask=m_gk, other=0.0)                                        # [HKP, BK]
            tl.store(p_ks + t * (Hk * K), b_Ks.to(tl.float32).to(buf_k.dtype.element_ty), mask=m_gk)


@triton.jit
def verify_row_bounds(cursor, slot, num_drafts, i_b, o_t, o_l, T: tl.constexpr, WINDOW: tl.constexpr,
                      HAS_N: tl.constexpr):
    """A verify row's cursor `h` and draft count `n`, whether it flushes early (`h + n > WINDOW`),
    the committed records its queries see (`hc`: none after an early flush), and the masks of
    its drafts (`o_t < n`), its records (`o_l < h`) and the committed ones (`o_l < hc`)."""
    h = tl.load(cursor + slot)
    if HAS_N:
        # unvalidated counts are clamped to 0..T, so that no draft lands past the buffer
        n = tl.minimum(tl.maximum(tl.load(num_drafts + i_b), 0), T)
    else:
        n = tl.full([], T, tl.int32)
    flush = h + n > WINDOW
    hc = tl.where(flush, 0, h)
    return h, n, flush, hc, o_t < n, o_l < h, o_l < hc


@triton.jit
def record_masks(o_l, h, n_pos, RECMASK: tl.constexpr):
    """Masks of the record lanes at cursor h: `m_j` position j < h holds a record, `m_j1`
    position j + 1 does (the shifted log decays; the current token sits at position h), and
    `m_lj`, `m_lj1` those the loads are predicated on: the same with RECMASK (no traffic for
    empty positions), else only the `n_pos` window positions (issued without waiting for the
    cursor: the small-batch latency path). Positions at or past the cursor are removed by
    selects on `m_j` / `m_j1` after the load either way, so stale or poisoned records never
    enter the arithmetic."""
    m_j = o_l < h
    m_j1 = o_l + 1 < h
    if RECMASK:
        return m_j, m_j1, m_j, m_j1
    else:
        return m_j, m_j1, o_l < n_pos, o_l + 1 < n_pos


@triton.jit
def group_keys(p_K, stride_K, p_kc, p_q, o_l, o_k, m_k, m_j, m_lj):
    """The token's key and query and their products with a group's buffered keys (zero where
    no record): `(k_t, q, K_rec q, k_t . q)`. `p_K` points at position 0
    of the group's keys (positions `stride_K` apart), `p_kc` and `p_q` at the token's key and
    query."""
    b_Kb = tl.load(p_K + o_l[:, None] * stride_K + o_k[None, :], mask=m_lj[:, None] & m_k[None, :], other=0.0)
    b_Kb = tl.where(m_j[:, None], b_Kb.to(tl.float32), 0.0)                             # [BL, BK]
    b_kc = tl.load(p_kc + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(p_q + o_k, mask=m_k, other=0.0).to(tl.float32)
    return b_kc, b_q, tl.sum(b_Kb * b_q[None, :], axis=1), tl.sum(b_kc * b_q, axis=0)


@triton.jit
def records_dot(p_W, stride_l, b_cw, b_cw_b, r_b, v0, h, n_pos, NR: tl.constexpr, BV: tl.constexpr,
                 BL: tl.constexpr, WS: tl.constexpr, RECMASK: tl.constexpr):
    """`sum_j cw_j W[j, r]` for the rows `r = v0 .. v0 + BV - 1` (`[BV]`) over the records
    j < h: `b_cw` the weights of rows below `r_b`, `b_cw_b` those of rows from `r_b` on (the
    row-block kernel's second head); `p_W` points at position 0 of row 0, positions `stride_l`
    apart, rows from `NR` on are masked. The records are read as `[BL, WS, BV // WS]`, WS the
    program's warps: Triton 3.6 lays the positions across lanes and the WS blocks of rows
    across warps, so the sum over positions stays inside each warp. A plain `[BL, BV]` tile
    puts positions across warps too, and its reduction goes through shared memory with bank
    conflicts."""
    RW: tl.constexpr = BV // WS
    o_r = v0 + tl.arange(0, WS)[None, :, None] * RW + tl.arange(0, RW)[None, None, :]    # [1, WS, RW]
    o_l = tl.arange(0, BL)[:, None, None]                                               # [BL, 1, 1]
    m_l = o_l < h if RECMASK else o_l < n_pos
    b_W = tl.load(p_W + o_l * stride_l + o_r, mask=m_l & (o_r < NR), other=0.0)
    b_W = tl.where(o_l < h, b_W.to(tl.float32), 0.0)
    b_c = tl.where(o_r < r_b, b_cw[:, None, None], b_cw_b[:, None, None])               # [BL, WS, RW]
    return tl.reshape(tl.sum(b_W * b_c, axis=0), [BV])


@triton.jit
def head_values(p, o_h, h_a, h_b, in_b, TWO: tl.constexpr):
    """A per-head parameter `p[head]` for each row (`o_h` its head): TWO, the block spans heads
    h_a and h_b only and `in_b` marks h_b's rows, two scalar loads selected per row; else one
    gather per row."""
    if TWO:
        return tl.where(in_b, tl.load(p + h_b).to(tl.float32), tl.load(p + h_a).to(tl.float32))
    else:
        return tl.load(p + o_h).to(tl.float32)


@triton.jit
def head_weights(p_ld, stride_l, b_ld, b_rA, h, o_l, m_j, m_j1, m_lj, m_lj1):
    """Weights of one head at cursor h: record j (lane j < h, its value `x_j`) enters with
    g_{j+1:h} dt_j, g_{j+1:h} = exp(ld_{j+1} + ... + ld_h) and dt_j = ld_j / A (the record keeps
    the layer's input x, exact in the model's dtype, not the rounded product dt x), the
    checkpoint with g_{0:h}; `p_ld` points at the head's log decay at position 0 (positions
    `stride_l` apart), `b_ld` is the current token's (position h), `b_rA` the head's 1 / A. Each
    suffix is summed directly from same-signed terms, never as a difference of prefix sums, so
    weights near 1 keep full precision. Returns (coef [BL], g_{0:h})."""
    b_ld1 = tl.load(p_ld + (o_l + 1) * stride_l, mask=m_lj1, other=0.0)              # ld_{j+1}
    b_ldj = tl.load(p_ld + o_l * stride_l, mask=m_lj, other=0.0)                       # ld_j
    b_ld0 = tl.load(p_ld)
    b_lds = tl.where(m_j1, b_ld1, tl.where(o_l + 1 == h, b_ld, 0.0))                   # [BL]
    b_sfx = tl.sum(tl.where(o_l[None, :] >= o_l[:, None], b_lds[None, :], 0.0), axis=1)
    b_coef = tl.where(m_j, tl.exp(b_sfx) * (b_ldj * b_rA), 0.0)                         # [BL]
    b_g = tl.exp(tl.where(h > 0, b_ld0, b_ld) + tl.sum(b_lds, axis=0))                  # g_{0:h}
    return b_coef, b_g



# ----------------------------------------------------------------------------------------------
# Python boundary


def check_slots(slot_ids: Tensor, N: int) -> None:
    """Range and uniqueness of slot ids: `utils.checks.check_slot_values`, whose policy is every
    family's (checked on the CPU and on the device, a host sync there, except during CUDA-graph
    capture or tracing)."""
    check_slot_values(slot_ids, N)


def check_token_inputs(x, dt, B, C, A, dt_bias, D, z):
    """Shapes of one decode step's inputs; returns (Bt, HV, V, Hk, K)."""
    check_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x: expected [Bt, HV, V], got shape {tuple(x.shape)}")
    if not isinstance(B, torch.Tensor) or B.dim() != 3:
        raise ValueError(f"B: expected [Bt, Hk, K], got {getattr(B, 'shape', type(B).__name__)}")
    Bt, HV, V = x.shape
    Hk, K = B.shape[1], B.shape[2]
    dev = x.device
    check_tensor("x", x, (Bt, HV, V), FLOAT_DTYPES, dev, inner=True)
    if Hk == 0 or HV % Hk:
        raise ValueError(f"B: {Hk} groups do not divide the {HV} heads of x")
    check_tensor("dt", dt, (Bt, HV), FLOAT_DTYPES, dev, inner=True)
    check_tensor("B", B, (Bt, Hk, K), FLOAT_DTYPES, dev, inner=True)
    check_tensor("C", C, (Bt, Hk, K), FLOAT_DTYPES, dev, inner=True)
    check_tensor("A", A, (HV,), FLOAT_DTYPES, dev, contiguous=True)
    check_tensor("dt_bias", dt_bias, (HV,), FLOAT_DTYPES, dev, contiguous=True)
    if D is not None:
        check_tensor("D", D, (HV,), FLOAT_DTYPES, dev, contiguous=True)
    if z is not None:
        check_tensor("z", z, (Bt, HV, V), FLOAT_DTYPES, dev, inner=True)
    if Bt > 65535 or HV > 65535:
        raise ValueError(f"x: batch {Bt} or heads {HV} above the grid limit 65535")
    return Bt, HV, V, Hk, K


def check_state(ckpt, buf_ld, buf_w, buf_k, cursor, epoch, arrive, slot_ids, *, Bt: int, HV: int, V: int,
                Hk: int, K: int, device, ckpt_dtypes=(torch.float32,), pending=None, slot_strided=False):
    """The pool's tensors a kernel reads and writes (docs/state-layout.md): shapes, dtypes, device,
    contiguity; `arrive` and `pending` when given. Returns `(N, Lb)`. `slot_strided`: the
    kernel takes a slot stride (`utils.launch.slot_pads`), so the state tensors other than
    `epoch` and `arrive` need only contiguous rows."""
    if not isinstance(ckpt, torch.Tensor) or ckpt.dim() != 4:
        raise ValueError(f"ckpt: expected [N, HV, V, K], got {getattr(ckpt, 'shape', type(ckpt).__name__)}")
    N = ckpt.shape[0]
    if not isinstance(buf_ld, torch.Tensor) or buf_ld.dim() != 3:
        raise ValueError(f"buf_ld: expected [N, Lb, HV], got {getattr(buf_ld, 'shape', type(buf_ld).__name__)}")
    Lb = buf_ld.shape[1]
    rows = not slot_strided
    check_tensor("ckpt", ckpt, (N, HV, V, K), ckpt_dtypes, device, contiguous=rows)
    check_tensor("buf_ld", buf_ld, (N, Lb, HV), (torch.float32,), device, contiguous=rows)
    check_tensor("buf_w", buf_w, (N, Lb, HV, V), RECORD_DTYPES, device, contiguous=rows)
    check_tensor("buf_k", buf_k, (N, Lb, Hk, K), RECORD_DTYPES, device, contiguous=rows)
    check_tensor("cursor", cursor, (N,), (torch.int32,), device, contiguous=rows)
    if pending is not None:
        check_tensor("pending", pending, (N,), (torch.int32,), device, contiguous=rows)
    if slot_strided:
        check_slot_rows(ckpt=ckpt, buf_ld=buf_ld, buf_w=buf_w, buf_k=buf_k)
    check_tensor("epoch", epoch, (N,), (torch.int64,), device, contiguous=True)
    check_slot_ids(slot_ids, Bt, device)
    if arrive is not None:
        check_tensor("arrive", arrive, (N,), (torch.int32,), device, contiguous=True)
    return N, Lb
