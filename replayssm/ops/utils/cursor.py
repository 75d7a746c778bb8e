"""Triton helpers for a slot's cursor, shared by the kernels of every family.

`hand_off` moves the cursor once every program of a slot has read it; `fold_pending` applies
the records a slot still holds (positions `0..h-1`) to a state tile, which is what the eager
step (`replay_decode` with window 1: the conventional kernels with `FOLD`) does before its
conventional update; `eager_bookkeeping` is that step's cursor and epoch.
"""
import triton
import triton.language as tl


@triton.jit
def slot_bases(slot, ckpt, buf_ld, buf_w, buf_k, cursor, pad_ckpt, pad_ld, pad_w, pad_k, pad_cur):
    """The state's base pointers moved by the slot's padding (`utils.launch.slot_pads`): for
    slot-strided state (vLLM's pages) the kernels' `slot * rowsize` addressing then lands on
    `slot * stride`; for the pool's contiguous tensors the paddings are 0."""
    return (ckpt + slot * pad_ckpt, buf_ld + slot * pad_ld, buf_w + slot * pad_w, buf_k + slot * pad_k,
            cursor + slot * pad_cur)


@triton.jit
def hand_off(arrive, cursor, epoch, i_s, h, flush, NPROG: tl.constexpr):
    """Cursor hand-off: every program of slot s reads cursor[s], and it may only change once
    all NPROG of them have. Each arrives on a per-slot counter at its end, after a barrier
    over its threads, with a relaxed atomic whose operand depends on the loaded cursor (so it
    cannot be performed before the read); the last to arrive writes cursor and epoch and
    re-arms the counter for the next launch. No second launch, no host sync."""
    tl.debug_barrier()
    n_arrived = tl.atomic_add(arrive + i_s, (h >= 0).to(tl.int32), sem="relaxed")
    if n_arrived == NPROG - 1:
        if flush:
            tl.store(cursor + i_s, 0)
            tl.store(epoch + i_s, tl.load(epoch + i_s) + 1)
        else:
            tl.store(cursor + i_s, (h + 1).to(tl.int32))
        tl.store(arrive + i_s, 0)


@triton.jit
def fold_pending(b_S, h, p_ld, p_w, p_k, stride_ld, stride_w, stride_k, m_w, m_k,
                 DECAY: tl.constexpr, b_A=None):
    """`b_S` (`[BV, BK]` fp32) after records `0..h-1`, oldest first, one step of the
    recurrence each: `S <- a_j S + w_j k_j^T` in fp32, the arithmetic of a conventional step.

    Record j's log decay is read at `p_ld + j * stride_ld`, its stored value (`[BV]`) at
    `p_w + j * stride_w` (valid where `m_w`), its key (`[BK]`) at `p_k + j * stride_k` (valid
    where `m_k`). DECAY 0: one log decay for the tile (GDN, a scalar pointer), the value is
    `u_j`; 1: Mamba-2, one per row (programs spanning heads, `[BV]` pointers), the value is
    `x_j` and `w_j = (ld_j / A) x_j` with `b_A` the rows' A (`[BV]`); 2: one per key column
    (KDA, `[BK]` pointers), the value is `u_j`."""
    if DECAY == 1:
        b_rA = 1.0 / b_A
    for j in range(0, h):
        b_w = tl.load(p_w + j * stride_w, mask=m_w, other=0.).to(tl.float32)
        b_k = tl.load(p_k + j * stride_k, mask=m_k, other=0.).to(tl.float32)
        if DECAY == 0:
            b_S = b_S * tl.exp(tl.load(p_ld + j * stride_ld))
        elif DECAY == 1:
            b_ldj = tl.load(p_ld + j * stride_ld, mask=m_w, other=0.)
            b_S = b_S * tl.exp(b_ldj)[:, None]
            b_w = b_w * (b_ldj * b_rA)
        else:
            b_S = b_S * tl.exp(tl.load(p_ld + j * stride_ld, mask=m_k, other=0.))[None, :]
        b_S += b_w[:, None] * b_k[None, :]
    return b_S


@triton.jit
def eager_bookkeeping(arrive, cursor, epoch, i_s, h, e0, first, NPROG: tl.constexpr):
    """The eager step's cursor and epoch: it flushes every row. A slot that held records
    (h > 0; every program of the slot saw the same h) hands its cursor back to 0 through
    `hand_off`; otherwise the cursor stays 0 and the slot's `first` program stores the epoch
    it loaded at its start (`e0`) plus one. A plain store, not an atomic: the compiler waits
    for an atomic's reply, a latency the conventional step does not have, and no other
    program writes this epoch in this launch."""
    if h > 0:
        hand_off(arrive, cursor, epoch, i_s, h, True, NPROG)
    elif first:
        tl.store(epoch + i_s, e0 + 1)


@triton.jit
def verify_hand_off(arrive, cursor, pending, epoch, i_s, h_new, n, flush, NPROG: tl.constexpr):
    """The verify step's cursor hand-off (docs/state-layout.md, `verify`): once all NPROG
    programs of slot s have arrived, the last one sets `cursor = h_new` (the position the
    drafts follow), `pending = n` (drafts written) and, on an early flush, `epoch += 1`.
    Returns whether this program is the last, so that the caller can write what the slot's
    other programs may still have been reading (on an early flush the drafts overwrite the
    committed records at positions 0..n-1, and a group's key or a head's decay is read by
    programs other than its writer). The arrival is acq_rel: every other program's loads are
    done before the last one stores."""
    tl.debug_barrier()
    n_arrived = tl.atomic_add(arrive + i_s, 1, sem="acq_rel")
    last = n_arrived == NPROG - 1
    if last:
        if flush:
            tl.store(epoch + i_s, tl.load(epoch + i_s) + 1)
        tl.store(cursor + i_s, h_new.to(tl.int32))
        tl.store(pending + i_s, n.to(tl.int32))
        tl.store(arrive + i_s, 0)
    return last
