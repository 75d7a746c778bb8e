"""Launch configurations of the Mamba-2 kernels, fixed per shape `("mamba2", HV, Hk, V, K)` (the
field order of `replayssm.shapes.Shape`, the key of every family's tables) and batch size.

Never autotuned: the kernels write state in place, and autotuning would replay them on the
live state. An entry is a config or a list of `(max_batch, config)`, the first whose
`max_batch` >= the batch applies. Keys of a replay config (REPLAY_CONFIGS):
  BV          value rows per program (power of two; ceil(V / BV) blocks per head)
  num_warps, num_stages
  recmask     predicate record loads on the cursor (no traffic for empty positions; the loads
              wait for the cursor) or only on the window (issued at once)
  KS          the checkpoint tile held as KS slices of K per thread (ops/utils/tiles.py; 1: a
              plain [BV, K] tile)
  warpsum     the records' sum over positions inside each warp (`_records_dot`), not across
              warps through shared memory; for record tiles of up to 16 positions (windows up
              to 16): wider tiles take the plain sum, which is faster there
  rows        a program owns BV consecutive rows of the checkpoint seen as [HV * V, K]
              (BV <= V, dividing a group's rows), which may span two heads, instead of a
              BV-row block of one head (`_replay_decode_rows_kernel`)
  gluon       GPU only: the Gluon kernel (gluon_decode.py), the per-head program with the
              checkpoint tile copied asynchronously into shared memory while the records are
              read and formed. Where `gluon_decode.gluon_supported` says no (K other than 128,
              BV other than 16 * num_warps, windows above 32), and on the CPU interpreter, the
              Triton per-head kernel runs with the same keys
  maxnreg     register cap (0: none): more programs per SM, maybe spills
  kq          the Gluon kernel only (ignored where the Triton kernels run): the groups' key
              products k_j . q formed once per (row, group) by a Triton launch before it
              (utils/key_products.py), loaded instead of every program loading the group's key
              records and forming them (the precision kernels' `gluon_kq`)
A flush folds the records into the checkpoint one rank-1 update per record (exact fp32), in
row chunks of min(16, BV).

Keys of a conventional config (CONVENTIONAL_CONFIGS, EAGER_CONFIGS): BV, num_warps,
num_stages as above, except that BV counts rows of the state seen as `[HV * V, K]` (so BV > V
puts several heads in one program) and must divide the `HV // Hk * V` rows of a group; and
perhead (BV <= V: dt, the decay and D formed once for each of the block's at most two heads
and selected per row, rather than once for every row a thread holds).
"""
from __future__ import annotations

from typing import Optional

import triton

from ..utils.launch import eager_reach, table_entry, table_key
from ..utils.tiles import check_slices

__all__ = ["REPLAY_CONFIGS", "LONG_WINDOW_CONFIGS", "EAGER_CONFIGS", "CONVENTIONAL_CONFIGS",
           "resolve_config", "conventional_config", "eager_config", "eager_max_batch", "install", "derived"]

# Small batches are latency-bound: small programs (one warp at batch <= 2), record loads issued
# before the cursor is known.
_TINY = (2, dict(BV=16, num_warps=1, recmask=False, KS=8))
_SMALL = (8, dict(BV=16, num_warps=2, recmask=False, KS=4))
# Super: one-warp row blocks of 32 up to batch 16 (more programs in flight); beyond, the Gluon
# per-head blocks of 64 with the records summed inside each warp.
_SUPER = [_TINY, _SMALL,
          (16, dict(BV=32, num_warps=1, KS=1, recmask=False, rows=True)),
          (1 << 30, dict(BV=64, num_warps=4, recmask=False, warpsum=True, gluon=True))]
REPLAY_CONFIGS = {
    ("mamba2", 128, 8, 64, 128): _SUPER,                                        # Nemotron-3-Super
    # Nano-4B from batch 9 on: the Gluon kernel in one-warp programs of 16 rows of one head
    # (80 = 5 x 16 fills every lane)
    ("mamba2", 96, 8, 80, 128): [_TINY, _SMALL,
                                 (1 << 30, dict(BV=16, num_warps=1, recmask=False, rows=False, gluon=True))],
    ("mamba2", 64, 8, 64, 128): _SUPER,                                         # Nemotron-3-Nano-30B
}

# The Gluon entries above at windows above 16: record tiles of 32 positions take more
# registers; a cap keeps enough programs per SM.
LONG_WINDOW_CONFIGS = {
    ("mamba2", 128, 8, 64, 128): dict(maxnreg=80),                              # Super
    ("mamba2", 96, 8, 80, 128): dict(maxnreg=128),                              # Nano-4B
    ("mamba2", 64, 8, 64, 128): dict(maxnreg=80),                               # Nano-30B
}

# The eager step (window 1, see decode.replay_decode) per shape: a list of `(max_batch, launch
# config)`; batches up to the last max_batch take it (the slot pool decodes them with window 1),
# each with the first entry's config whose max_batch >= the batch ({}: the conventional
# table's). Small batches are latency-bound: a window only lengthens each program's chain there.
EAGER_CONFIGS = {
    ("mamba2", 128, 8, 64, 128): [(1, dict(BV=32, num_warps=8)), (2, dict(BV=64, num_warps=8)),   # Super
                                  (4, dict(BV=32, num_warps=1)), (8, dict(BV=8, num_warps=1))],
    ("mamba2", 96, 8, 80, 128): [(1, dict(BV=16, num_warps=2)), (2, dict(BV=32, num_warps=4)),    # Nano-4B
                                 (4, {}), (8, dict(BV=16, num_warps=1))],
    ("mamba2", 64, 8, 64, 128): [(2, dict(BV=32, num_warps=8)), (8, dict(BV=64, num_warps=8))],   # Nano-30B
}

# The conventional kernel: small batches are latency-bound and prefer small programs.
_LARGE = dict(BV=64, num_warps=8, num_stages=1)
CONVENTIONAL_CONFIGS = {
    ("mamba2", 128, 8, 64, 128): [(2, dict(BV=32, num_warps=8)), (4, dict(BV=64, num_warps=2)),   # Super
                                  (8, dict(BV=32, num_warps=1)), (1 << 30, _LARGE)],
    # Nano-4B: per-head scalars at large batch, faster for its 80-row heads (not for Super's)
    ("mamba2", 96, 8, 80, 128): [(2, dict(BV=32, num_warps=4)), (8, dict(BV=32, num_warps=1)),
                                 (1 << 30, dict(_LARGE, perhead=True))],
    ("mamba2", 64, 8, 64, 128): [(1, dict(BV=16, num_warps=8)), (2, dict(BV=32, num_warps=8)),   # Nano-30B
                                 (4, dict(BV=64, num_warps=8)), (8, dict(BV=64, num_warps=2)),
                                 (1 << 30, _LARGE)],
}


def _fit(bv: int, rows: int) -> int:
    """The largest power of two <= bv dividing `rows` (a conventional block within a group)."""
    while bv > 1 and rows % bv:
        bv //= 2
    return bv


def derived(HV: int, V: int, K: int, Hk: int) -> dict:
    """Table entries for a shape the tables do not name, derived from its dimensions as the
    tuned shapes' entries are: the eager step in small programs up to the batch
    `utils.launch.eager_reach` gives (latency-bound steps), the Gluon per-head program beyond,
    in blocks of 16 rows per warp dividing V (every lane busy; the Triton per-head kernel where
    Gluon does not apply). `replayssm tune` measures a shape's own."""
    rows = HV // Hk * V
    bv = next((b for b in (64, 32, 16) if V % b == 0), 16)
    small = [(1, dict(BV=_fit(32, rows), num_warps=8)), (2, dict(BV=_fit(64, rows), num_warps=8)),
             (4, dict(BV=_fit(32, rows), num_warps=1)), (8, dict(BV=_fit(16, rows), num_warps=1)),
             (16, dict(BV=_fit(16, rows), num_warps=1))]
    reach = eager_reach(HV, V, K)
    # one windowed entry: model-sized states take the eager step at small batches
    return {"replay": [(1 << 30, dict(BV=bv, num_warps=bv // 16, recmask=False, gluon=True))],
            "long_window": dict(maxnreg=80 if bv == 64 else 128),
            "eager": [(b, c) for b, c in small if b <= reach],
            "conventional": small[:2] + [(4, dict(BV=_fit(16, rows), num_warps=2)),
                                         (8, dict(BV=_fit(32, rows), num_warps=1)),
                                         (1 << 30, dict(_LARGE, BV=_fit(64, rows)))]}


_TABLES = {"replay": REPLAY_CONFIGS, "long_window": LONG_WINDOW_CONFIGS, "eager": EAGER_CONFIGS,
           "conventional": CONVENTIONAL_CONFIGS}


def install(HV: int, V: int, K: int, Hk: int, **entries) -> None:
    """Put a shape's entries into the tables (`replay=`, `eager=`, `conventional=`: lists of
    `(max_batch, config)`; `long_window=`: a config), e.g. those `replayssm tune` wrote.
    `eager=[]` means never the eager step."""
    unknown = set(entries) - set(_TABLES)
    if unknown:
        raise ValueError(f"install: unknown tables {sorted(unknown)}; expected {sorted(_TABLES)}")
    for name, entry in entries.items():
        if isinstance(entry, list):
            entry = [(int(b), dict(c)) for b, c in entry]
        _TABLES[name][_key(HV, V, K, Hk)] = entry


def _key(HV: int, V: int, K: int, Hk: int) -> tuple:
    return ("mamba2", HV, Hk, V, K)


def _known(HV: int, V: int, K: int, Hk: int) -> tuple:
    """The tables' key of a shape, after installing derived entries for a shape they lack."""
    key = _key(HV, V, K, Hk)
    if table_key(REPLAY_CONFIGS, key) is None and table_key(CONVENTIONAL_CONFIGS, key) is None:
        install(HV, V, K, Hk, **derived(HV, V, K, Hk))
    return key


def eager_config(HV: int, V: int, K: int, Hk: int, batch: int) -> dict:
    """The eager step's launch-config overrides at this shape and batch ({}: none)."""
    return dict(table_entry(EAGER_CONFIGS, _known(HV, V, K, Hk), batch) or {})


def eager_max_batch(HV: int, V: int, K: int, Hk: int) -> int:
    """The largest batch for which the tables prefer the eager step (window 1) at this shape
    (0: never). The slot pool decodes such batches with window 1."""
    found = table_key(EAGER_CONFIGS, _known(HV, V, K, Hk))
    entry = EAGER_CONFIGS[found] if found is not None else None
    return entry[-1][0] if entry else 0


def _default_bv(V: int) -> int:
    for bv in (32, 16):
        if V % bv == 0:
            return bv
    return min(32, max(16, triton.next_power_of_2(V)))


def _default_rows(HV: int, V: int, Hk: int) -> int:
    rows = HV // Hk * V
    bv = 1
    while bv < 64 and rows % (2 * bv) == 0:
        bv *= 2
    return bv


def _check_bool(cfg: dict, key: str) -> None:
    if not isinstance(cfg[key], bool):
        raise ValueError(f"config: {key} must be a bool, got {cfg[key]!r}")


def resolve_config(table: dict, HV: int, V: int, K: int, Hk: int, config: Optional[dict],
                   *, with_flush: bool, batch: Optional[int] = None, window: Optional[int] = None) -> dict:
    """The launch config for a shape and batch: the table's entry (or a default; for a Gluon
    entry at a `window` above 16, with `LONG_WINDOW_CONFIGS`), updated by `config`; raises
    ValueError for unknown keys or values. `with_flush`: a replay config, else a conventional one."""
    key = _known(HV, V, K, Hk)
    cfg = dict(BV=_default_bv(V), num_warps=4, num_stages=1)
    if not with_flush:
        cfg.update(perhead=False)
    else:
        cfg.update(recmask=True, KS=1, rows=False, warpsum=False, gluon=False, maxnreg=0, kq=False)
    cfg.update(table_entry(table, key, batch) or {})
    if with_flush and cfg["gluon"] and window is not None and window > 16:
        cfg.update(table_entry(LONG_WINDOW_CONFIGS, key) or {})
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; expected a subset of {sorted(cfg)}")
        cfg.update(config)
        if with_flush and "gluon" not in config and (cfg["rows"] or cfg["KS"] != 1):
            cfg["gluon"] = False     # asking for a Triton kernel's option overrides a Gluon entry
    bv, nw, ns = cfg["BV"], cfg["num_warps"], cfg["num_stages"]
    if not (isinstance(bv, int) and bv >= 1 and bv & (bv - 1) == 0):
        raise ValueError(f"config: BV must be a power of two, got {bv!r}")
    if not (isinstance(nw, int) and nw >= 1 and nw & (nw - 1) == 0):
        raise ValueError(f"config: num_warps must be a power of two, got {nw!r}")
    if not (isinstance(ns, int) and ns >= 1):
        raise ValueError(f"config: num_stages must be a positive int, got {ns!r}")
    if not with_flush:
        _check_bool(cfg, "perhead")
        return cfg
    check_slices(cfg["KS"], triton.next_power_of_2(K))
    if cfg["rows"]:
        if not (bv <= V and (HV // Hk * V) % bv == 0):
            raise ValueError(f"config: rows=True needs BV={bv} <= V={V} dividing the {HV // Hk * V} "
                             "state rows of a group")
        if cfg["KS"] != 1:
            raise ValueError("config: rows=True takes KS=1")
    if cfg["warpsum"] and (bv % nw or cfg["KS"] != 1):
        raise ValueError(f"config: warpsum=True needs KS=1 and num_warps={nw} dividing BV={bv}")
    _check_bool(cfg, "gluon")
    _check_bool(cfg, "kq")
    if cfg["gluon"] and (cfg["rows"] or cfg["KS"] != 1):
        raise ValueError("config: gluon=True takes rows=False, KS=1")
    if isinstance(cfg["maxnreg"], bool) or not isinstance(cfg["maxnreg"], int) or cfg["maxnreg"] < 0:
        raise ValueError(f"config: maxnreg must be a non-negative int, got {cfg['maxnreg']!r}")
    return cfg


def conventional_config(HV: int, V: int, K: int, Hk: int, config: Optional[dict] = None, *,
                        batch: Optional[int] = None) -> dict:
    """The launch config of the conventional kernel (and of the eager step) for a shape and a
    batch of `batch` rows: CONVENTIONAL_CONFIGS's entry or a default, updated by `config`."""
    key = _known(HV, V, K, Hk)
    table = CONVENTIONAL_CONFIGS
    if table_key(table, key) is None:
        table = {key: dict(BV=_default_rows(HV, V, Hk))}
    cfg = resolve_config(table, HV, V, K, Hk, config, with_flush=False, batch=batch)
    if (HV // Hk * V) % cfg["BV"]:
        raise ValueError(f"config: BV={cfg['BV']} must divide the {HV // Hk * V} state rows of a group")
    return cfg
