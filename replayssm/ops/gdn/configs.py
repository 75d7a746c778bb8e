"""Launch configurations of the GDN and KDA kernels: fixed tables per shape and batch (no
autotune: the kernels write state in place), their resolution with a caller's overrides, and the
eager step's batches (`replay_decode` with window 1).

Tables map a shape `(family, HV, Hk, V, K)` (the field order of `replayssm.shapes.Shape`, the
key of every family's tables; `None` for `Hk`, or for `HV` and `Hk`: an entry for every head
count, which an exact key overrides, see `utils.launch.table_key`) to a config, or to a list of
`(max_batch, config)` whose first entry with `max_batch` >= the batch applies. Chosen by
H200 sweeps; the measurements are indexed in benchmarks/results/.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ..utils.launch import eager_reach, table_entry, table_key
from ..utils.tiles import check_slices

__all__ = ["replay_config", "conventional_config", "eager_config", "eager_max_batch", "install", "derived"]

_CONFIG_KEYS = ("BV", "num_warps", "num_stages", "maxnreg")
# replay only: recmask (record loads predicated on the cursor, or issued at once over the
# window, without waiting for it), BC (GDN: records read in chunks of BC up to the cursor; 0:
# one tile covering the window; KDA, on the Gluon kernel only: records folded per iteration of
# a flush, 0 or 1 one at a time), KS (the checkpoint tile held as KS slices of K per thread,
# see ops/utils/tiles.py; 1: a plain [BV, K] tile), mat (GDN: `_replay_decode_mat_kernel`, the
# state tile rebuilt per chunk of BKT key columns by one tensor-core product; recmask, BC and
# KS then do not apply), matprec (its product: "tf32x3", or for bf16 records "bf16x2": exact
# keys, the weighted u in two bf16 terms, about 16 bits, or "bf16": one term, the weighted u
# rounded to bf16 once more), gluon (GDN and KDA, GPU only: the Gluon kernel of gluon_decode.py, the
# record-contracting program with the checkpoint tile copied asynchronously into shared memory
# while the records are read; recmask and maxnreg apply, and KDA's BC, the other replay keys do not; where
# `gluon_unsupported` gives a reason (K other than 128, BV other than 16 * num_warps, windows
# above 32) and on the CPU interpreter the Triton kernels run with the other keys)
_REPLAY_KEYS = ("recmask", "BC", "KS", "mat", "BKT", "matprec", "gluon")
_REPLAY_DEFAULTS = {"recmask": True, "BC": 0, "KS": 1, "mat": False, "BKT": 64, "matprec": "tf32x3",
                    "gluon": False}
_MAT_PRECISIONS = {"tf32x3": 0, "bf16x2": 1, "bf16": 2}

# The GDN Gluon kernel's cap of 80 registers (six programs per SM) spills where the value heads
# per key head are not a power of two (HG = 3, 5 under Triton 3.6: 24 bytes; 2, 4: none); there it
# takes 96 (five programs per SM)
_GLUON_CAP, _GLUON_CAP_ODD_GROUP = 80, 96

# Small batches are latency-bound: small programs, record loads issued without waiting for the
# cursor.
_REPLAY_TABLE = {
    # GDN: one warp per program at small batch; records in chunks of 8 up to the cursor
    ("gdn", None, None, 128, 128): [(2, {"BV": 16, "num_warps": 1, "recmask": False}),
                                    (8, {"BV": 16, "num_warps": 1, "recmask": False, "BC": 8, "KS": 8}),
                                    # from batch 9 the Gluon kernel (GPU only; elsewhere the Triton
                                    # kernel with the same keys): it overlaps the tile's copy with
                                    # the record reads
                                    (1 << 30, {"gluon": True, "BV": 64, "num_warps": 4, "recmask": True,
                                               "maxnreg": _GLUON_CAP})],
    # KDA: the Triton kernel to batch 8 (the eager step runs there, see _EAGER_CONFIGS); beyond,
    # the Gluon kernel (IS_KDA) under the cap of 80 registers, in programs of 128 rows (8 warps)
    # whose flush folds 4 records an iteration (BC): chosen when the flush still re-scanned each
    # record's decay (1.35x the conventional kernel at batch 256 against 1.29x for 64-row programs
    # folding one, in one run: kda_variants_h200.json, in git history at 16d05f1); with the staged
    # decayed keys, 1.48x
    ("kda", None, None, 128, 128): [(8, {"BV": 32, "num_warps": 4, "recmask": False}),
                                    (1 << 30, {"gluon": True, "BV": 128, "num_warps": 8, "recmask": True,
                                               "maxnreg": _GLUON_CAP, "BC": 4})],
}

# With bf16 records (keys exact in bf16) the materialising kernel's two-term bf16 product wins
# at mid batches: one warp per 64-row program, K in two chunks, the chunk loads pipelined.
_BF16_RECORDS_TABLE = {
    ("gdn", None, None, 128, 128): [
        (8, {}),
        (32, {"mat": True, "matprec": "bf16x2", "BV": 64, "num_warps": 1, "BKT": 64,
              "num_stages": 3, "gluon": False, "maxnreg": 0}),
        # the Gluon kernel at large batch: 80 registers fit six programs per SM (as many as its
        # shared memory allows); predicated record loads move half the record bytes on average
        (1 << 30, {"gluon": True, "BV": 64, "num_warps": 4, "recmask": True, "maxnreg": _GLUON_CAP})],
}

# Small batches are latency-bound and prefer small programs (one warp of 4 rows at batches 1-2:
# the most programs in flight); large ones one-warp programs of 32 rows, which keep their
# bandwidth with bf16 token inputs (as the models pass them).
_TINY = {"BV": 4, "num_warps": 1}
_CONVENTIONAL_TABLE = {
    ("gdn", None, None, 128, 128): [(2, _TINY), (8, {"BV": 32, "num_warps": 1}),
                                    (1 << 30, {"BV": 32, "num_warps": 1, "num_stages": 1})],
    ("kda", None, None, 128, 128): [(2, _TINY), (4, {"BV": 8, "num_warps": 1}),
                                    (8, {"BV": 32, "num_warps": 1}),
                                    (1 << 30, {"BV": 32, "num_warps": 1, "num_stages": 1})],
}

# The eager step (window 1, see replay_decode) per value-head count (`Hk` None: for every key-head
# count): batches up to the last max_batch take it (the slot pool decodes them with window 1),
# each with the first entry's launch config whose max_batch >= the batch ({}: the conventional
# table's). At small batches a window only lengthens each program's chain (KDA's Gluon window
# kernel: 0.73x the conventional step at batch 1, 1.06x at 64; batches between not measured).
_EAGER_CONFIGS = {
    ("gdn", 32, None, 128, 128): [(2, _TINY), (8, {"BV": 8, "num_warps": 1}), (16, {})],  # Qwen3.5-4B, Qwen3-Next
    ("gdn", 64, None, 128, 128): [(2, _TINY), (8, {"BV": 8, "num_warps": 1})],            # Qwen3.5-122B
    ("kda", 32, None, 128, 128): [(2, _TINY), (32, {"BV": 8, "num_warps": 1})],           # Kimi-Linear-48B
}


def _eager_entries(reach: int) -> list:
    """The eager step's entries of a shape in no table, up to batch `reach` (0: none): as the
    tuned shapes', one-warp programs of 4 rows at batches 1-2, of 8 beyond."""
    if not reach:
        return []
    return [(min(2, reach), dict(_TINY))] + ([(reach, {"BV": 8, "num_warps": 1})] if reach > 2 else [])


# The tables' Gluon entries at windows above 16 (record tiles of 32 positions): their register
# cap of 80 spills there (and programs of more than 64 rows fall back to 64, below)
_GLUON_LONG_WINDOW = {"maxnreg": 0}


def derived(family: str, HV: int, V: int, K: int) -> dict:
    """Table entries for a shape the tables do not name, derived from its dimensions as the
    tuned shapes' entries are: the eager step in one-warp programs (`_eager_entries`) up to the
    batch `utils.launch.eager_reach` gives; the Gluon program beyond (GDN and KDA), in blocks of
    16 rows per warp dividing V (the Triton kernel where Gluon does not apply); small batches in
    one-warp programs of 16 rows (KDA: 32 rows of 4 warps). `replayssm tune` measures a shape's
    own."""
    bv = next((b for b in (64, 32, 16) if V % b == 0), 16)
    conventional = [(2, dict(_TINY)), (8, {"BV": 32, "num_warps": 1}),
                    (1 << 30, {"BV": 32, "num_warps": 1, "num_stages": 1})]
    large = {"gluon": True, "BV": bv, "num_warps": bv // 16, "recmask": True, "maxnreg": _GLUON_CAP if bv == 64 else 0}
    if family == "kda":
        # KDA's flush folds 4 records an iteration (BC), as the tuned shape's
        return {"replay": [(8, {"BV": 32, "num_warps": 4, "recmask": False}), (1 << 30, dict(large, BC=4))],
                "conventional": conventional,
                "eager": _eager_entries(eager_reach(HV, V, K))}
    return {"replay": [(2, {"BV": 16, "num_warps": 1, "recmask": False}),
                       (8, {"BV": 16, "num_warps": 1, "recmask": False, "BC": 8}), (1 << 30, large)],
            "bf16_records": [(8, {}), (1 << 30, large)],
            "conventional": conventional,
            "eager": _eager_entries(eager_reach(HV, V, K))}


_TABLES = {"replay": _REPLAY_TABLE, "bf16_records": _BF16_RECORDS_TABLE,
           "conventional": _CONVENTIONAL_TABLE, "eager": _EAGER_CONFIGS}


def install(family: str, HV: Optional[int], V: int, K: int, Hk: Optional[int] = None, **entries) -> None:
    """Put a shape's entries into the tables (`replay=`, `bf16_records=`, `conventional=`,
    `eager=`: lists of `(max_batch, config)`), e.g. those `replayssm tune` wrote, under the key
    `(family, HV, Hk, V, K)`: exact for the head counts given, `None` for `Hk` (or `HV` and
    `Hk`) an entry for every key-head count (every head count) that an exact one overrides.
    `eager=[]`: never the eager step."""
    unknown = set(entries) - set(_TABLES)
    if unknown:
        raise ValueError(f"install: unknown tables {sorted(unknown)}; expected {sorted(_TABLES)}")
    for name, entry in entries.items():
        _TABLES[name][(family, HV, Hk, V, K)] = [(int(b), dict(c)) for b, c in entry]


def _known(family: str, HV: Optional[int], Hk: Optional[int], V: int, K: int) -> tuple:
    """The tables' key of a shape, after installing derived entries for a shape they lack (`HV`
    None: the replay, bf16-record and conventional tables only). Derived entries serve every head
    count (the eager step's: every key-head count), as they depend on `HV` at most."""
    key = (family, HV, Hk, V, K)
    d = None
    if table_key(_REPLAY_TABLE, key) is None:
        d = derived(family, HV or 1, V, K)
        install(family, None, V, K, **{k: v for k, v in d.items() if k != "eager"})
    if HV is not None and table_key(_EAGER_CONFIGS, key) is None:
        # a tuned shape keeps its head counts' eager entries; other head counts take the
        # derived one
        d = d or derived(family, HV, V, K)
        install(family, HV, V, K, eager=d["eager"])
    return key


def eager_config(family: str, HV: int, V: int, K: int, batch: int, Hk: Optional[int] = None) -> dict:
    """The eager step's launch-config overrides at this shape and batch ({}: none)."""
    return dict(table_entry(_EAGER_CONFIGS, _known(family, HV, Hk, V, K), batch) or {})


def eager_max_batch(HV: int, V: int, K: int, family: str = "gdn", Hk: Optional[int] = None) -> int:
    """The largest batch for which the tables prefer the eager step (window 1) at this shape
    (0: never). The slot pool decodes such batches with window 1."""
    found = table_key(_EAGER_CONFIGS, _known(family, HV, Hk, V, K))
    entry = _EAGER_CONFIGS[found] if found is not None else None
    return entry[-1][0] if entry else 0


def _default_config(table: dict, key: tuple, batch: Optional[int] = None) -> dict:
    entry = table_entry(table, key, batch)
    V, K = key[3], key[4]
    if entry is not None:
        return dict({"num_stages": 1, "maxnreg": 0}, **entry)
    BV = min(32, triton.next_power_of_2(V))
    return {"BV": BV, "num_warps": 4 if BV * triton.next_power_of_2(K) >= 4096 else 2,
            "num_stages": 1, "maxnreg": 0}


def _resolve_config(table: dict, family: str, V: int, K: int, config: Optional[dict], *,
                    replay: bool = False, batch: Optional[int] = None,
                    bf16_records: bool = False, window: Optional[int] = None,
                    HV: Optional[int] = None, Hk: Optional[int] = None) -> dict:
    """Launch config from the table (or defaults) and `config`; `replay`: a replay config, with
    the replay-only keys (and, for bf16 records, the overrides of `_BF16_RECORDS_TABLE`; for a
    Gluon entry at a `window` above 16, `_GLUON_LONG_WINDOW`; for GDN's Gluon entries at a head
    ratio `HV // Hk` that is not a power of two, the higher register cap). `HV`, `Hk`: the head
    counts, for entries installed for them and that ratio (None: the entries that serve every
    head count)."""
    key = _known(family, HV, Hk, V, K)
    cfg = _default_config(table, key, batch)
    if replay and bf16_records:
        cfg.update(table_entry(_BF16_RECORDS_TABLE, key, batch) or {})
    if replay and cfg.get("gluon") and window is not None and window > 16:
        cfg.update(_GLUON_LONG_WINDOW)
        if cfg.get("BV", 0) > 64:
            # uncapped with 32-position record tiles, KDA's 128-row programs compile to 164
            # registers (one program of 8 warps per SM; Triton 3.6), 64-row ones to 136 (three)
            cfg.update(BV=64, num_warps=4)
    if (replay and family == "gdn" and cfg.get("gluon") and cfg.get("maxnreg") == _GLUON_CAP
            and HV and Hk and (HV // Hk) & (HV // Hk - 1)):
        cfg.update(maxnreg=_GLUON_CAP_ODD_GROUP)
    keys = _CONFIG_KEYS
    if replay:
        keys = _CONFIG_KEYS + _REPLAY_KEYS
        cfg = dict(_REPLAY_DEFAULTS, **cfg)
    else:
        cfg = {key: val for key, val in cfg.items() if key in keys}
    if config:
        unknown = set(config) - set(keys)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}; allowed {list(keys)}")
        cfg.update(config)
    BV, nw, ns = cfg["BV"], cfg["num_warps"], cfg["num_stages"]
    if not isinstance(BV, int) or BV < 1 or BV & (BV - 1):
        raise ValueError(f"config BV={BV!r} must be a power of two")
    if nw not in (1, 2, 4, 8, 16):
        raise ValueError(f"config num_warps={nw!r} must be one of 1, 2, 4, 8, 16")
    if not isinstance(ns, int) or ns < 1:
        raise ValueError(f"config num_stages={ns!r} must be a positive int")
    if not isinstance(cfg["maxnreg"], int) or cfg["maxnreg"] < 0:
        raise ValueError(f"config maxnreg={cfg['maxnreg']!r} must be a non-negative int (0: no cap)")
    if replay:
        bc = cfg["BC"]
        if isinstance(bc, bool) or not isinstance(bc, int) or bc < 0 or (bc and bc & (bc - 1)):
            raise ValueError(f"config BC={bc!r} must be 0 (one tile of the window) or a power of two")
        if bc and family == "kda" and not cfg["gluon"]:
            raise ValueError(f"config BC={bc!r}: KDA takes BC on the Gluon kernel only (records "
                             "folded per iteration of a flush)")
        check_slices(cfg["KS"], triton.next_power_of_2(K))
        if cfg["mat"]:
            bkt, bk = cfg["BKT"], triton.next_power_of_2(K)
            if isinstance(bkt, bool) or not isinstance(bkt, int) or bkt < 16 or bkt & (bkt - 1) or bk % bkt:
                raise ValueError(f"config BKT={bkt!r} must be a power of two >= 16 dividing {bk}")
            if family != "gdn":
                raise ValueError("config mat=True: the materialising kernel is implemented for GDN only")
            if min(BV, triton.next_power_of_2(V)) < 16:
                raise ValueError(f"config mat=True needs BV >= 16 (the smallest tl.dot tile), got {BV}")
            if cfg["matprec"] not in _MAT_PRECISIONS:
                raise ValueError(f"config matprec={cfg['matprec']!r} must be one of {sorted(_MAT_PRECISIONS)}")
        if not isinstance(cfg["gluon"], bool):
            raise ValueError(f"config gluon={cfg['gluon']!r} must be a bool")
    return cfg


def replay_config(V: int, K: int, config: Optional[dict] = None, family: str = "gdn", *,
                  HG: int = 1, batch: Optional[int] = None, records: torch.dtype = torch.float32,
                  window: Optional[int] = None, G: Optional[int] = None, HV: Optional[int] = None,
                  Hk: Optional[int] = None) -> dict:
    """The launch config `replay_decode` uses for value dim `V`, key dim `K`, `HG` value heads
    per key head (`G`: its former name, still accepted; the tables do not depend on it), a
    batch of `batch` rows, records of dtype `records` and window `window` (None: as for windows
    up to 16), with overrides. `HV`, `Hk`: the head counts, for entries installed for them
    (None: the entries that serve every head count)."""
    return _resolve_config(_REPLAY_TABLE, family, V, K, config, replay=True, batch=batch,
                           bf16_records=records == torch.bfloat16, window=window, HV=HV, Hk=Hk)


def conventional_config(V: int, K: int, config: Optional[dict] = None, family: str = "gdn", *,
                        batch: Optional[int] = None, HV: Optional[int] = None,
                        Hk: Optional[int] = None) -> dict:
    """The launch config `conventional_decode` (and the eager step) uses for `V`, `K` and a
    batch of `batch` rows (with overrides); `HV`, `Hk` as for `replay_config`."""
    return _resolve_config(_CONVENTIONAL_TABLE, family, V, K, config, batch=batch, HV=HV, Hk=Hk)
