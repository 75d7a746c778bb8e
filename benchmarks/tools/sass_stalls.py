"""Stall samples per SASS instruction from a source-level Nsight Compute CSV
(`benchmarks/tools/ncu_source.sh` writes `ncu_<tag>_sass.csv`): totals by stall reason, the
instructions with the most samples (index, samples, share, executions, SASS, top reasons) and,
with `--split i,j,...`, the samples and executed instructions of the index ranges between them.

    python benchmarks/tools/sass_stalls.py $OUT/ncu_nemotron3-super_256_replay_sass.csv \
        --top 25 --split 352,590,1098

(data/ncu_source_sass.csv beside it is a small synthetic file of the same shape.)
"""
import argparse
import csv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--split", default="", help="comma-separated instruction indices")
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    hdr, data = rows[1], rows[2:]
    i_src = hdr.index("Source")
    i_s = hdr.index("Warp Stall Sampling (All Samples)")
    i_e = hdr.index("Instructions Executed")
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, i: int(r[i] or 0)                      # noqa: E731
    total = sum(num(r, i_s) for r in data)
    print(f"{len(data)} instructions, {total} samples, {sum(num(r, i_e) for r in data) / 1e6:.1f}M executed")
    by_reason = {hdr[c][6:]: sum(num(r, c) for r in data) for c in reasons}
    print("by reason:", ", ".join(f"{k} {100 * v / total:.1f}%"
                                  for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:8]))
    top = sorted(range(len(data)), key=lambda k: -num(data[k], i_s))[:args.top]
    for k in sorted(top):
        r = data[k]
        why = sorted(((num(r, c), hdr[c][6:]) for c in reasons), reverse=True)[:2]
        print(f"{k:5d} {num(r, i_s):6d} {100 * num(r, i_s) / total:5.1f}%  exec {num(r, i_e):9d}  "
              f"{r[i_src].strip()[:56]:56s} {', '.join(f'{n} {w}' for w, n in why)}")
    if args.split:
        cuts = [0] + [int(c) for c in args.split.split(",")] + [len(data)]
        for a, b in zip(cuts, cuts[1:]):
            s = sum(num(r, i_s) for r in data[a:b])
            e = sum(num(r, i_e) for r in data[a:b])
            print(f"[{a:5d}, {b:5d}) samples {s:6d} ({100 * s / total:4.1f}%), {e / 1e6:6.1f}M executed")


if __name__ == "__main__":
    main()
