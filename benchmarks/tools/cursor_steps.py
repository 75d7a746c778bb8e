"""Decode step time by cursor position: where a window's time goes (GPU only).

Times the replay kernel of one shape with every row held at cursor `h` (the cursor refilled
before each step, so every step reads `h` records, or flushes at `h = window - 1`), beside the
whole window with staggered rows and the conventional step, for each launch config given. A
flush step that costs several conventional steps shows in the last column; the staggered time
is about the mean of the per-cursor ones. At batches the tables give to the eager step (window
1), pass `{"eager": false}` in a config to time the window kernel.

    python benchmarks/tools/cursor_steps.py kimi-linear-48b --batch 256 --cursors 0,7,14,15 \
        --variants '[{}, {"BC": 4}]' --out /tmp/cursor_steps.json
"""
import argparse
import json
import sys

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", help="a model name or family/HV/Hk/V/K (replayssm.shapes)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--cursors", default=None, help="comma-separated cursors (default: 0, L/2, L-2, L-1)")
    ap.add_argument("--variants", default="[{}]", help="JSON list of replay configs ({}: the table's)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="a JSON file for the rows")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"{ap.prog}: error: needs a CUDA device")
    from replayssm.bench.common import graph_time_us, header
    from replayssm.bench.decode import Case

    W, B = args.window, args.batch
    cursors = [int(c) for c in args.cursors.split(",")] if args.cursors else [0, W // 2, W - 2, W - 1]
    if any(not 0 <= c < W for c in cursors):
        ap.error(f"cursors must lie in [0, {W - 1}]")
    case = Case(args.shape, B, W)
    staggered = case.cursor.clone()

    def steps(cfg, h):
        for i in range(W):
            if h is not None:
                case.cursor.fill_(h)
            case.replay_step(i, cfg)

    # the refill's own time, taken off the per-cursor figures
    fill = graph_time_us(lambda: [case.cursor.fill_(0) for _ in range(W)], reps=args.reps) / W
    conv = graph_time_us(case.conventional_window, reps=args.reps) / W
    doc = dict(header("cursor_steps"), shape=args.shape, batch=B, window=W, conventional_us=conv, rows=[])
    for cfg in json.loads(args.variants):
        case.cursor.copy_(staggered)
        row = dict(config=cfg, staggered_us=graph_time_us(lambda: steps(cfg, None), reps=args.reps) / W)
        for h in cursors:
            row[f"h{h}_us"] = graph_time_us(lambda: steps(cfg, h), reps=args.reps) / W - fill
        case.cursor.copy_(staggered)
        doc["rows"].append(row)
    print(f"{doc['device']}, {args.shape}, batch {B}, window {W}: conventional step {conv:.1f} us")
    print(f"{'config':44} {'staggered':>9} " + " ".join(f"{'h=' + str(h):>8}" for h in cursors)
          + "  flush / conventional")
    for r in doc["rows"]:
        print(f"{json.dumps(r['config']):44} {r['staggered_us']:9.1f} "
              + " ".join(f"{r[f'h{h}_us']:8.1f}" for h in cursors)
              + (f"  {r[f'h{W - 1}_us'] / conv:.2f}x" if W - 1 in cursors else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    sys.exit(main() and 0)
