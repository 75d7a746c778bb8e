"""The kernels' experimental switches by name, for the benchmarks' variants.

A switch is a module attribute that a kernel's launcher reads at each call, set at import from
an environment variable (`REPLAYSSM_GLUON_...`), off by default until a GPU run shows that it
passes its tests and wins. Timed in separate processes, an on/off pair is two runs of a GPU whose
clocks and caches differ between them; as a variant key (`{"switches": {"gdn_verify_lean":
true}}` in `bench verify --variants` or `bench precision --configs`) the switch is set around its
variant's step alone, so its rows are timed beside the default's, interleaved, in one process.

The step is captured in a CUDA graph with the switches set: the graph holds the kernels they
chose, and replaying it needs nothing set. Nothing here changes a default.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, Dict, Iterator, Optional, Tuple


def _flag(v) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{v!r} is not a bool")
    return v


def _power_of_two(*allowed: int) -> Callable:
    def check(v) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v not in allowed:
            raise ValueError(f"{v!r} is not one of {list(allowed)}")
        return v
    return check


# name -> (module, attribute, the environment variable that sets it at import, value check)
SWITCHES: Dict[str, Tuple[str, str, str, Callable]] = {
    "gdn_verify_lean": ("replayssm.ops.gdn.gluon_verify_host", "LEAN", "REPLAYSSM_GLUON_VERIFY_LEAN", _flag),
    "gdn_verify_rows": ("replayssm.ops.gdn.gluon_verify_host", "ROWS", "REPLAYSSM_GLUON_VERIFY_ROWS",
                        _power_of_two(1, 2)),
    "mamba2_verify_keys_global": ("replayssm.ops.mamba2.gluon_verify", "KEYS_GLOBAL",
                                  "REPLAYSSM_GLUON_VERIFY_KEYS_GLOBAL", _flag),
    "lp_read_mma": ("replayssm.ops.utils.gluon_lowp", "READ_MMA", "REPLAYSSM_GLUON_LP_READ_MMA", _flag),
    "lp_rows": ("replayssm.ops.utils.gluon_lowp", "ROWS", "REPLAYSSM_GLUON_LP_ROWS", _power_of_two(1, 2, 4)),
    "lp_heads": ("replayssm.ops.mamba2.gluon_lowp", "HEADS", "REPLAYSSM_GLUON_LP_HEADS", _power_of_two(1, 2, 4)),
    "lp_refold_mma": ("replayssm.ops.gdn.verify_lp", "REFOLD_MMA", "REPLAYSSM_GLUON_LP_REFOLD_MMA", _flag),
    "lp_kda": ("replayssm.ops.gdn.verify_lp", "GLUON_LP_KDA", "REPLAYSSM_GLUON_LP_KDA", _flag),
}


def check(switches) -> dict:
    """`switches` as a dict of known names to valid values; ValueError naming what is not."""
    if not isinstance(switches, dict):
        raise ValueError(f"switches must be an object of switch names to values, got {switches!r}")
    out = {}
    for name, value in switches.items():
        if name not in SWITCHES:
            raise ValueError(f"switches: unknown switch {name!r}; known: {sorted(SWITCHES)}")
        try:
            out[name] = SWITCHES[name][3](value)
        except ValueError as e:
            raise ValueError(f"switches: {name} ({SWITCHES[name][2]}): {e}") from None
    return out


def split(config: Optional[dict]) -> Tuple[Optional[dict], dict]:
    """A variant's launch config without its `switches`, and the switches (checked): the
    kernels' config validation never sees the key."""
    if not config or "switches" not in config:
        return config, {}
    rest = {k: v for k, v in config.items() if k != "switches"}
    return rest or None, check(config["switches"])


@contextlib.contextmanager
def applied(switches: dict) -> Iterator[None]:
    """The module attributes of `switches` set for the block, restored after it (also when it
    raises). The modules are imported here: a switch of a kernel not yet imported is set before
    its first launch reads it."""
    saved = []
    try:
        for name, value in check(switches).items():
            mod, attr = importlib.import_module(SWITCHES[name][0]), SWITCHES[name][1]
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, old in reversed(saved):
            setattr(mod, attr, old)


def summary(docs) -> str:
    """Per result file (`bench verify` / `bench precision` JSON documents) and variant, the
    range of its `ratio_vs_default` over its rows (shape, read format and accepted count; below
    1: faster than the default), the rows that failed, and the card: the table that decides
    whether a switch becomes the default."""
    lines = [f"{'shape':18} {'read':9} {'variant':58} {'time / default':>15}  card"]
    for doc in docs:
        card = doc.get("device", "?")
        groups = {}
        for r in doc.get("rows", []):
            if "config" not in r:
                continue
            key = (r["shape"], r.get("read_format", ""), str(r["config"]))
            groups.setdefault(key, []).append(r)
        for (shape, fmt, cfg), rows in groups.items():
            ok = [r["ratio_vs_default"] for r in rows if r.get("ratio_vs_default") is not None]
            failed = len(rows) - len(ok)
            span = f"{min(ok):.3f}-{max(ok):.3f}x" if ok else "-"
            lines.append(f"{shape:18} {fmt:9} {cfg[:58]:58} {span:>15}  {card}"
                         + (f"  ({failed} of {len(rows)} rows failed)" if failed else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m replayssm.bench.switches",
                                 description="Summarise the variant rows of bench verify / bench precision result "
                                             "files: each variant's time over the default's, per shape.")
    ap.add_argument("files", nargs="+", help="JSON result files")
    args = ap.parse_args(argv)
    docs = []
    for path in args.files:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:
            ap.error(f"{path}: {e}")
    print(summary(docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
