"""Triton helpers for the checkpoint tiles of the replay kernels (every family).

A program's tile is `[BV, K]` rows of one head's checkpoint, K contiguous, reduced over K
(matrix-vector products). Laid out plainly, the compiler spreads K over a warp's 32 lanes and
each row's reduction ends in five shuffles. With KS > 1 the tile is held as `[KS, BV, BK // KS]`,
the K slices first: the compiler then gives each thread KS slices of a row (still 16-byte
loads) and spreads rows over the lanes, so that a reduction is mostly in-thread adds.
"""
import triton
import triton.language as tl


@triton.jit
def tile_offsets(o_v, m_v, K: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr):
    """Offsets and mask of the rows `o_v` (valid where `m_v`) of a `[V, K]` tile."""
    if KS == 1:
        o_k = tl.arange(0, BK)
        return o_v[:, None] * K + o_k[None, :], m_v[:, None] & (o_k < K)[None, :]
    else:
        KC: tl.constexpr = BK // KS
        o_k3 = tl.arange(0, KS)[:, None, None] * KC + tl.arange(0, KC)[None, None, :]
        return o_v[None, :, None] * K + o_k3, m_v[None, :, None] & (o_k3 < K)


@triton.jit
def tile_dot(b_C, x, BK: tl.constexpr, KS: tl.constexpr):
    """`C x` (`[BV]`) for a tile laid out by `tile_offsets` and a `[BK]` vector x."""
    if KS == 1:
        return tl.sum(b_C * x[None, :], axis=1)
    else:
        KC: tl.constexpr = BK // KS
        return tl.sum(tl.sum(b_C * tl.reshape(x, (KS, KC))[:, None, :], axis=2), axis=0)


def check_slices(KS, BK: int) -> None:
    """ValueError unless KS is a power of two dividing BK (the padded key dim)."""
    if isinstance(KS, bool) or not isinstance(KS, int) or KS < 1 or KS & (KS - 1) or BK % KS:
        raise ValueError(f"config KS={KS!r} must be a power of two dividing {BK}")
