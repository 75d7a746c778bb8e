"""Small-batch sweep: the eager step (window 1) against the window, and the launch configs of
the conventional kernel that the eager step shares, all against the conventional kernel timed
in the same run (window 16, staggered rows, bf16 records, token inputs of `--input-dtype`
(default bf16), CUDA graphs of whole windows).

    python benchmarks/tools/sweep_eager.py --shapes a,b --batches 1,2,4,8,16 --conv-batches 1,8 \
        --out scratch/eager_sweep.json

For each shape and batch: the conventional kernel with its table config, the windowed replay
step (`eager` off) and the eager step (`eager` on), both with the tables. At `--conv-batches`,
each candidate conventional config is timed for both kernels (conventional, eager), so that a
config better at small batch is found for both, not only for ReplaySSM. Prints a table, writes
JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from replayssm import shapes
from replayssm.bench.common import graph_time_us, header, write_results
from replayssm.bench.decode import SHAPES, Case


def _candidates(family: str, V: int) -> list:
    if family == "mamba2":
        return [dict(BV=bv, num_warps=w) for bv, w in itertools.product((16, 32, 64, 128), (1, 2, 4, 8))
                if bv // 16 >= w // 2]
    return [dict(BV=bv, num_warps=w) for bv, w in itertools.product((4, 8, 16, 32, 64), (1, 2, 4))
            if bv <= V]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="model names or family/HV/Hk/V/K specs")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--conv-batches", default="1,8")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--input-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the token inputs and outputs of both kernels")
    ap.add_argument("--out", default="scratch/eager_sweep.json")
    args = ap.parse_args(argv)
    doc = header("eager_sweep")
    doc["record_dtype"], doc["input_dtype"] = "bfloat16", args.input_dtype
    idt = getattr(torch, args.input_dtype)
    doc["rows"] = []
    conv_batches = {int(b) for b in args.conv_batches.split(",") if b}
    W = args.window

    def timed(fn):
        try:
            return graph_time_us(fn, reps=args.reps) / W
        except Exception as e:       # a config that does not apply to a shape is skipped
            return repr(e)[:160]

    for shape in args.shapes.split(","):
        fam, _, _, V, _ = shapes.parse(shape)
        for batch in map(int, args.batches.split(",")):
            case = Case(shape, batch, W, input_dtype=idt)
            t_conv = timed(case.conventional_window)
            rows = [("conventional", None, t_conv), ("windowed", None, timed(lambda: case.replay_window({"eager": False}))),
                    ("eager", None, timed(lambda: case.replay_window({"eager": True})))]
            if batch in conv_batches:
                for cfg in _candidates(fam, V):
                    rows.append(("conventional", cfg, timed(lambda: case.conventional_window(cfg))))
                    rows.append(("eager", cfg, timed(lambda: case.replay_window(dict(cfg, eager=True)))))
            for kind, cfg, t in rows:
                ok = isinstance(t, float)
                doc["rows"].append(dict(shape=shape, batch=batch, window=W, kind=kind, config=cfg,
                                        input_dtype=args.input_dtype,
                                        us_per_step=t if ok else None, error=None if ok else t,
                                        ratio_vs_conventional_table=t_conv / t if ok and isinstance(t_conv, float) else None))
            case = None      # free this point's tensors before the next one is allocated
            torch.cuda.empty_cache()
            write_results(args.out, doc)
            best = {}
            for kind, cfg, t in rows:
                if isinstance(t, float) and (kind not in best or t < best[kind][1]):
                    best[kind] = (cfg, t)
            print(f"{shape:18} B={batch:3d} conv(table) {t_conv if isinstance(t_conv, str) else f'{t_conv:6.2f}'} us | "
                  + " | ".join(f"{k} {v[1]:6.2f} us {json.dumps(v[0]) if v[0] else 'table'}" for k, v in best.items()),
                  flush=True)
    write_results(args.out, doc)
    print("\nshape               batch  conv us  windowed  eager   (table configs; ratio over conventional)")
    for shape in args.shapes.split(","):
        for batch in map(int, args.batches.split(",")):
            sel = {r["kind"]: r for r in doc["rows"] if r["shape"] == shape and r["batch"] == batch and r["config"] is None}
            c, w, e = (sel.get(k, {}).get("us_per_step") for k in ("conventional", "windowed", "eager"))
            if c and w and e:
                print(f"{shape:18} {batch:5d} {c:8.2f} {c / w:8.3f}x {c / e:6.3f}x")
    return doc


if __name__ == "__main__":
    main()
