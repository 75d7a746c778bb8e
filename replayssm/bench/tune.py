"""`replayssm tune`: time candidate launch configs of one shape's kernels on this GPU and write
the table entries that won, for the user to keep and install (`replayssm.ops.tuned.install`).

At each batch it times, over whole windows replayed from CUDA graphs with rows at staggered
window positions: the conventional kernel's candidates (the baseline, and the eager step's
table), the eager step's candidates (the conventional kernel on the checkpoint, folding
pending records) and the windowed replay kernel's candidates. The eager step keeps the
batches up to the first one where the window wins; larger batches take the window.
"""
from __future__ import annotations

import argparse
import json

import torch

from .. import shapes
from .common import graph_time_us, header, write_results
from .decode import Case

# Windowed candidates per family: the Gluon programs (16 rows per warp) and the Triton kernels.
_WINDOWED = {
    "mamba2": [dict(BV=bv, num_warps=bv // 16, recmask=False, warpsum=bv >= 32, gluon=True) for bv in (16, 32, 64)]
              + [dict(BV=16, num_warps=1, recmask=False, KS=8), dict(BV=16, num_warps=2, recmask=False, KS=4),
                 dict(BV=32, num_warps=1, recmask=False, rows=True), dict(BV=64, num_warps=4, warpsum=True)],
    "gdn": [dict(BV=bv, num_warps=bv // 16, recmask=True, gluon=True, maxnreg=r)
            for bv in (16, 32, 64) for r in (0, 80, 96)]
           + [dict(BV=16, num_warps=1, recmask=False), dict(BV=16, num_warps=1, recmask=False, BC=8, KS=8)],
    "kda": [dict(BV=32, num_warps=4, recmask=False), dict(BV=64, num_warps=4, recmask=True),
            dict(BV=128, num_warps=4, recmask=True, KS=8)],
}


def _pow2_upto(n: int, top: int = 128):
    b = 4
    while b <= min(n, top):
        yield b
        b *= 2


def conventional_candidates(s: shapes.Shape):
    """Blocks of rows and warps: Mamba-2's blocks count rows of `[HV * V, K]` within a group."""
    rows = s.HG * s.V if s.family == "mamba2" else s.V
    bvs = [b for b in _pow2_upto(max(rows, 4)) if s.family != "mamba2" or rows % b == 0]
    return [dict(BV=b, num_warps=w) for b in bvs for w in (1, 2, 4, 8)]


def windowed_candidates(s: shapes.Shape):
    return [c for c in _WINDOWED[s.family] if c["BV"] <= max(16, 2 * s.V)]


def _best(case: Case, run, cands, reps: int, rows: list, point: dict, kind: str):
    best = None
    for cfg in cands:
        try:
            t = graph_time_us(lambda: run(cfg), reps=reps) / case.window
        except Exception as e:  # a config that does not compile or launch at this shape is skipped
            rows.append(dict(point, scheme=kind, config=cfg, error=repr(e)[:200]))
            continue
        rows.append(dict(point, scheme=kind, config=cfg, us_per_step=t))
        if best is None or t < best[1]:
            best = (cfg, t)
    return best


def tune(spec: str, batches, *, window: int = 16, record_dtype=torch.bfloat16,
         input_dtype=torch.bfloat16, reps: int = 10, windowed_from: int = 2, log=print) -> dict:
    """Time the candidates of `spec` (a model name or family/HV/Hk/V/K) at each batch; returns
    `{"tuned": entry, "rows": timings}` (the entry as `replayssm.ops.tuned.install` takes it)."""
    s = shapes.parse(spec)
    conv_c, win_c = conventional_candidates(s), windowed_candidates(s)
    eager_c = [{k: v for k, v in c.items() if k in ("BV", "num_warps")} for c in conv_c]
    rows, per_batch = [], []
    for batch in sorted(set(batches)):
        case = Case(spec, batch, window, "staggered", record_dtype, input_dtype=input_dtype)
        point = dict(shape=spec, family=s.family, batch=batch, window=window)
        conv = _best(case, case.conventional_window, conv_c, reps, rows, point, "conventional")
        eager = _best(case, lambda c: case.replay_window(dict(c, eager=True)), eager_c, reps, rows,
                      point, "eager")
        win = None
        if batch >= windowed_from:
            win = _best(case, lambda c: case.replay_window(dict(c, eager=False)), win_c, reps, rows,
                        point, "windowed")
        per_batch.append((batch, conv, eager, win))
        log(f"{spec} B={batch}: conventional {conv[1]:.2f} us {conv[0]}; eager {eager[1]:.2f} us "
            f"{eager[0]}" + (f"; windowed {win[1]:.2f} us {win[0]}" if win else ""))
        case = None       # free this point's tensors before the next one is allocated
        torch.cuda.empty_cache()
    return {"tuned": choose(s, spec, per_batch, window=window, record_dtype=record_dtype,
                            input_dtype=input_dtype), "rows": rows}


def choose(s: shapes.Shape, spec: str, per_batch, *, window: int, record_dtype, input_dtype) -> dict:
    """The table entry from per-batch bests `(batch, conventional, eager, windowed)`, each a
    `(config, us)` (windowed None where not timed): the eager step up to the first batch where
    the window wins, the window beyond."""
    eager_max = 0
    for batch, _, eager, win in per_batch:
        if win is not None and win[1] < eager[1]:
            break
        eager_max = batch
    last = 1 << 30
    entry = dict(family=s.family, shape=spec, HV=s.HV, Hk=s.Hk, V=s.V, K=s.K, window=window,
                 record_dtype=str(record_dtype).replace("torch.", ""),
                 input_dtype=str(input_dtype).replace("torch.", ""), eager_max_batch=eager_max,
                 eager=[[b, e[0]] for b, _, e, _ in per_batch if b <= eager_max],
                 replay=[[b, w[0]] for b, _, _, w in per_batch if b > eager_max and w is not None],
                 conventional=[[b, c[0]] for b, c, _, _ in per_batch])
    for name in ("replay", "conventional"):
        if entry[name]:
            entry[name][-1][0] = last
    if not entry["replay"] and entry["eager"]:
        entry["eager"][-1][0] = last       # the eager step won at every batch measured
    return entry


def main(argv=None):
    ap = argparse.ArgumentParser(prog="replayssm tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True,
                    help="a model name or family/HV/Hk/V/K, e.g. mamba2/112/8/64/128")
    ap.add_argument("--batches", default="1,2,4,8,16,64,256", help="batches to time (default: %(default)s)")
    ap.add_argument("--window", type=int, default=16, help="replay window (default: %(default)s)")
    ap.add_argument("--record-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--input-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=10, help="graph replays per timing (default: %(default)s)")
    ap.add_argument("--out", default=None, help="the JSON file to write (default: tuned_<shape>.json)")
    args = ap.parse_args(argv)
    try:
        shapes.parse(args.shape)
        batches = [int(b) for b in args.batches.split(",")]
        if min(batches) < 1 or args.window < 1 or args.reps < 1:
            raise ValueError("batches, --window and --reps must be positive")
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit(f"{ap.prog}: error: tuning times kernels on a CUDA device "
                         "(torch.cuda.is_available() is False on this machine)")
    res = tune(args.shape, batches, window=args.window, record_dtype=getattr(torch, args.record_dtype),
               input_dtype=getattr(torch, args.input_dtype), reps=args.reps)
    doc = header("tune")
    doc.update(res)
    out = args.out or "tuned_" + args.shape.replace("/", "_") + ".json"
    write_results(out, doc)
    print(json.dumps(res["tuned"], indent=1))
    print(f"wrote {out}; keep it and call replayssm.ops.tuned.install({out!r}) before building pools")
    return doc


if __name__ == "__main__":
    main()
