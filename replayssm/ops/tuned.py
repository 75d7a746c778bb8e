"""Launch-table entries measured by `replayssm tune`, installed into the kernels' tables.

    import replayssm.ops.tuned
    replayssm.ops.tuned.install("tuned_mamba2_112_8_64_128.json")   # before building pools

A pool reads its shape's eager-step reach when it is built, so install first.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union


def install(entry: Union[str, Path, dict]) -> dict:
    """Install one tuned shape (a file written by `replayssm tune`, or its `"tuned"` dict) and
    return that dict."""
    doc = entry if isinstance(entry, dict) else json.loads(Path(entry).read_text())
    t = doc.get("tuned", doc)
    try:
        family, HV, Hk, V, K = t["family"], int(t["HV"]), int(t["Hk"]), int(t["V"]), int(t["K"])
        tables = {name: t[name] for name in ("replay", "eager", "conventional")}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a tuned entry of `replayssm tune`: missing or bad {e}") from None
    if family == "mamba2":
        from .mamba2 import configs
        configs.install(HV, V, K, Hk, **tables)
    elif family in ("gdn", "kda"):
        from .gdn import configs
        if family == "gdn" and t.get("record_dtype") == "bfloat16":
            tables["bf16_records"] = tables["replay"]    # measured with the records it serves
        configs.install(family, HV, V, K, Hk=Hk, **tables)   # exact for its head counts
    else:
        raise ValueError(f"tuned entry of unknown family {family!r}")
    return t
