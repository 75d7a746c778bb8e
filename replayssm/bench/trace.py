"""GPU busy time per step from a torch-profiler trace (the Chrome-trace JSON that
`torch.profiler` and vLLM's `profiler_config` write, `.json` or `.json.gz`).

The serving benchmark's question is where a decode step's wall time goes: the GPU's kernels,
or the gaps between them while the host drafts, schedules and launches. From the trace's
device events (kernels, memory copies and sets):

- `busy`: the union of their intervals (overlapping kernels on several streams count once);
- `span`: from the first device event's start to the last one's end;
- per step: both over the `steps` the profiler recorded (vLLM's `max_iterations`), and the idle
  share `1 - busy / span`;
- the kernels by total time, each named and put into a kind (`KINDS`: replayssm's kernels,
  attention, MoE, matrix products, vLLM's own recurrent kernels, other), per step.

    python -m replayssm.bench.trace DIR_OR_FILE [--steps 16] [--top 12]
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path
from typing import Iterable, List, Tuple

# the device-side event categories of a torch-profiler trace
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

# (kind, pattern on the kernel's name): the first that matches names the kind. replayssm's
# kernels are its Triton and Gluon functions' names (replayssm/ops), which a trace shows as they are
KINDS: Tuple[Tuple[str, str], ...] = (
    ("replayssm", r"^_(gluon_|replay_|lowp_|snapshot_|conventional_|short_conv_kernel|uniform_kernel|"
                  r"clear_pending_kernel|commit_kernel|key_products_kernel|verify_key_products_kernel|"
                  r"gdn_verify_key_products_kernel)"),
    ("recurrent (vLLM)", r"selective_state|ssd_|chunk_scan|chunk_state|state_passing|bmm_chunk|"
                         r"gated_delta|delta_rule|fused_recurrent|chunk_gated|causal_conv1d|conv1d"),
    ("attention", r"flash|fmha|attn|attention|paged"),
    ("MoE", r"moe|expert|topk|align_block_size|permute"),
    ("matrix products", r"gemm|matmul|xmma|cutlass|nvjet|sm90_|cublas|wgmma"),
    ("memory", r"^Memcpy|^Memset|memcpy|memset"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return kind
    return "other"


def _load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def trace_files(path) -> List[Path]:
    """The trace files under `path` (a file, or a folder searched recursively)."""
    p = Path(path)
    if p.is_file():
        return [p]
    found = sorted(x for x in p.rglob("*") if x.is_file() and (x.name.endswith(".json") or x.name.endswith(".json.gz")))
    if not found:
        raise FileNotFoundError(f"no trace (.json or .json.gz) under {p}")
    return found


def device_events(trace) -> List[Tuple[float, float, str]]:
    """`(start_us, end_us, name)` of every device event of a trace (a `{"traceEvents": [...]}`
    document, or the bare list of events)."""
    events = trace if isinstance(trace, list) else trace.get("traceEvents", [])
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES and "dur" in e:
            start = float(e["ts"])
            out.append((start, start + float(e["dur"]), str(e.get("name", ""))))
    return out


def union_length(intervals: Iterable[Tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarise(path, steps: int, top: int = 12) -> dict:
    """Busy time, span and idle share per step, and the kernels by total time, from the traces
    under `path` (one process's trace per file: their figures add up, each with its own span).
    `steps`: the decode steps the profiler recorded."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    busy = span = 0.0
    kernels: dict = {}
    files = trace_files(path)
    for f in files:
        ev = device_events(_load(f))
        if not ev:
            continue
        busy += union_length((a, b) for a, b, _ in ev)
        span += max(b for _, b, _ in ev) - min(a for a, _, _ in ev)
        for a, b, name in ev:
            k = kernels.setdefault(name, [0.0, 0])
            k[0] += b - a
            k[1] += 1
    if span == 0:
        raise ValueError(f"no device events in {', '.join(map(str, files))}")
    by_kind: dict = {}
    for name, (t, _) in kernels.items():
        kind = kind_of(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + t
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps,
        "step_ms": span / steps / 1e3,
        "gpu_busy_ms_per_step": busy / steps / 1e3,
        "gpu_idle_share": 1.0 - busy / span,
        "kinds_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:120], "kind": kind_of(n), "ms_per_step": t / steps / 1e3,
                         "calls_per_step": c / steps} for n, (t, c) in ranked],
    }


def report(summary: dict) -> str:
    s = summary
    lines = [f"{s['steps']} steps: {s['step_ms']:.2f} ms a step, the GPU busy {s['gpu_busy_ms_per_step']:.2f} ms "
             f"({100 * (1 - s['gpu_idle_share']):.0f}%), idle {100 * s['gpu_idle_share']:.0f}%", "",
             "| kind | ms / step |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in s["kinds_ms_per_step"].items()]
    lines += ["", "| kernel | kind | ms / step | calls / step |", "|---|---|---|---|"]
    lines += [f"| {k['name'][:70]} | {k['kind']} | {k['ms_per_step']:.3f} | {k['calls_per_step']:.1f} |"
              for k in s["top_kernels"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m replayssm.bench.trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a trace file, or a folder of them")
    ap.add_argument("--steps", type=int, default=16, help="decode steps the profiler recorded (vLLM's max_iterations)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed")
    args = ap.parse_args(argv)
    try:
        print(report(summarise(args.path, args.steps, args.top)))
    except (FileNotFoundError, ValueError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
