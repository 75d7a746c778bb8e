"""The analytical traffic model of SPEC section 6: bytes of state and records moved per head.

All quantities are per head and per layer. `M_S` is the size of one state in a format
(`4 dv dk` for fp32), `r` the bytes of one buffered record (SPEC: bf16 value and key, fp32
decay: `r = 2 dv + 2 dk + 4`).
"""
from __future__ import annotations

import math

from .formats import bytes_per_element
from .shapes import MODEL_SHAPES as _MODEL_SHAPES


def state_bytes(dv: int, dk: int, fmt: str = "fp32") -> float:
    """`M_S`: bytes of one `[dv, dk]` state stored in `fmt`."""
    return bytes_per_element(fmt) * dv * dk


def record_bytes(dv: int, dk: int, value_bytes: float = 2, key_bytes: float = 2,
                 decay_bytes: float = 4, decay_len: int = 1) -> float:
    """`r`: one record of a head (value `[dv]`, key `[dk]`, decay; KDA: `decay_len = dk`)."""
    return value_bytes * dv + key_bytes * dk + decay_bytes * decay_len


def m_conv(L: int, dv: int, dk: int, fmt: str = "fp32") -> float:
    """Conventional decoding over `L` steps: the state read and written every step, `2 L M_S`."""
    return 2 * L * state_bytes(dv, dk, fmt)


def m_replay(L: int, dv: int, dk: int, fmt: str = "fp32", r: float | None = None,
             lp_format: str | None = None) -> float:
    """ReplaySSM over one window of `L` steps (flush included).

    Single checkpoint: `(L + 1) M_S + (L - 1)(L + 2)/2 r` (L reads, one write; step `i` reads
    `i - 1` records, every step but the flush writes its own). With a low-precision
    checkpoint: `L - 1` reads of `C_LP`, and the flush reads `C_HP` and writes both.
    """
    r = record_bytes(dv, dk) if r is None else r
    rec = (L - 1) * (L + 2) / 2 * r
    hp = state_bytes(dv, dk, fmt)
    if lp_format is None:
        return (L + 1) * hp + rec
    lp = state_bytes(dv, dk, lp_format)
    return (L - 1) * lp + 2 * hp + lp + rec


def f(L: float, dv: int, dk: int, fmt: str = "fp32", r: float | None = None, T: int = 1,
      A: float = 1.0) -> float:
    """Amortised bytes per accepted token with window `L`, draft length `T`, mean acceptance `A`:
    `M_S/A + M_S/L + r L/(2A) - r/2 + r T/A - r T/L` (`A = T = 1`: standard decoding)."""
    r = record_bytes(dv, dk) if r is None else r
    ms = state_bytes(dv, dk, fmt)
    return ms / A + ms / L + r * L / (2 * A) - r / 2 + r * T / A - r * T / L


def l_star(dv: int, dk: int, fmt: str = "fp32", r: float | None = None, T: int = 1,
           A: float = 1.0) -> float:
    """The window minimising `f`: `L* = sqrt(2 A (M_S / r - T))` (0 when replay cannot pay)."""
    r = record_bytes(dv, dk) if r is None else r
    x = state_bytes(dv, dk, fmt) / r - T
    return math.sqrt(2 * A * x) if x > 0 else 0.0


def decode_step_bytes(h: int, window: int, num_heads: int, dv: int, dk: int, num_k_heads: int,
                      *, fmt: str = "fp32", value_bytes: float = 2, key_bytes: float = 2,
                      decay_len: int = 1) -> float:
    """Bytes of state one ReplaySSM decode step moves for a layer whose cursor is `h`.

    The step reads the checkpoint, the `h` buffered records (keys once per key head), and
    writes its own record, or, when it flushes (`h + 1 >= window`), the checkpoint instead.
    """
    ms = state_bytes(dv, dk, fmt) * num_heads
    rec = (value_bytes * dv + 4 * decay_len) * num_heads + key_bytes * dk * num_k_heads
    flush = h + 1 >= window
    return ms + h * rec + (ms if flush else rec)


# Shapes of SPEC section 8 (per SSM layer), unpacking as (family, HV, Hk, dv, dk).
MODEL_SHAPES = _MODEL_SHAPES
