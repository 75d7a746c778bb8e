"""Shared pieces of the benchmark drivers: CUDA-graph timing and the results file."""
from __future__ import annotations

import datetime
import inspect
import json
import os
import platform
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch


def graph_time_us(fn, reps: int = 20, warmup: int = 2) -> float:
    """Capture `fn()` (any number of launches) in a CUDA graph and return the median replay
    time in microseconds, timed with CUDA events around each replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    del g
    return times[len(times) // 2]


def copy_bandwidth_tbs(nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written per second, TB/s)."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    b = torch.empty_like(a)
    t = graph_time_us(lambda: b.copy_(a), reps=20, warmup=10)
    return 2 * nbytes / (t * 1e-6) / 1e12


def git_commit() -> str:
    """REPLAYSSM_COMMIT when set (a copied working tree may carry a stale .git), else HEAD."""
    if os.environ.get("REPLAYSSM_COMMIT"):
        return os.environ["REPLAYSSM_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def tree_note() -> str:
    """A note for results whose code is not `git_commit()`'s: tracked files that differ from
    HEAD (a GPU machine's copy of the working tree can carry a .git older than the files), else
    ''. Empty where REPLAYSSM_COMMIT names the commit or git cannot tell."""
    if os.environ.get("REPLAYSSM_COMMIT"):
        return ""
    try:
        changed = subprocess.check_output(["git", "diff", "--name-only", "HEAD", "--"], text=True,
                                          stderr=subprocess.DEVNULL).split()
    except Exception:
        return ""
    if not changed:
        return ""
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    files = f"{len(changed)} tracked file{'s' * (len(changed) > 1)}"
    return f"the tree that ran differs from this commit in {files} ({shown})"


def _command_name() -> str:
    """`python -m replayssm.bench.<name>` when run as a module of the package, else argv[0]."""
    path = Path(sys.argv[0])
    if path.suffix == ".py" and path.parent.name == "bench" and path.parent.parent.name == "replayssm":
        return f"python -m replayssm.bench.{path.stem}"
    if path.name == "cli.py" and path.parent.name == "replayssm":
        return "python -m replayssm.cli"
    return sys.argv[0]


def cpu_name() -> str:
    """The host CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows: on Linux
    `platform.processor()` is often empty, which left CPU results naming no machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def header(benchmark: str) -> dict:
    import triton

    return {"benchmark": benchmark,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU: {cpu_name()}",
            "command": " ".join([_command_name()] + sys.argv[1:]),
            "git_commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__,
            **({"git_commit_note": note} if (note := tree_note()) else {})}


def positive_ints(text: str) -> list:
    """argparse type: comma-separated positive integers (`"64,256"` -> `[64, 256]`)."""
    import argparse
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def write_results(path: str | os.PathLike, doc: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return path


def family_ops(family: str):
    """The kernel package of a family (`replayssm.ops.mamba2`, `.gdn`, `.kda`), imported when asked."""
    import importlib

    if family not in ("mamba2", "gdn", "kda"):
        raise ValueError(f"unknown family {family!r}")
    return importlib.import_module(f"replayssm.ops.{family}")


def layer_kwargs(family: str, p) -> dict:
    """A layer's parameters as the kernels of `family` take them (`p`: its params object)."""
    if family == "mamba2":
        return dict(A=p.A, dt_bias=p.dt_bias, D=p.D)
    return dict(A_log=p.A_log, dt_bias=p.dt_bias, scale=None, use_qk_l2norm=True)


def call_accepting(fn, kwargs):
    """Call `fn` with the keyword arguments its signature accepts (families differ slightly)."""
    names = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in names})


@contextmanager
def recording_slow_reads(doc: dict):
    """Record in `doc["slow_read_warnings"]` (once each, in order) the `SlowReadWarning`s that
    pools raise inside the block (a low-precision copy read slower than fp32 on this device:
    `pool.backends.SLOW_LP_READS`), and print them; other warnings pass as usual. A study's
    result then says which of its designs served from such a copy."""
    from ..pool import SlowReadWarning
    seen = doc.setdefault("slow_read_warnings", [])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SlowReadWarning)
            yield seen
    finally:
        # outside the recording block: the others are re-issued to the filters in force
        for w in caught:
            if issubclass(w.category, SlowReadWarning):
                text = str(w.message)
                if text not in seen:
                    seen.append(text)
                    print(f"warning: {text}", flush=True)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
