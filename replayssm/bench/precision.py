"""Separate-precision benchmark (SPEC section 5, issue 18): the decode kernels' time when the
non-flush steps read a low-precision checkpoint, against fp32 reads and conventional decoding.

Per shape, batch and window `L`, two timings, each a CUDA graph replayed (median over `--reps`):

1. `timing` "non_flush": `L - 1` steps per replay, every one a non-flush step. The graph first
   resets every row's cursor to 0 (one small copy, amortised over the `L - 1` steps), so each
   replay times cursors 0..L-2 from the same state and no row flushes: the rows step in
   lock-step, which reads the same records in total as a staggered mix over a window. Read
   format fp32 is `replay_decode` with window `L` (never the eager step), the others
   `lowp_decode` (`ops.<family>.precision`). `ratio_vs_fp32_read` = fp32 time / this time;
   `byte_bound` = 4 / `formats.bytes_per_element(fmt, K)` (state reads alone: 2, ~3.9, ~7.1),
   `byte_bound_traffic` the same ratio of the traffic model's bytes per step (records included).
   With `--configs` (`measure(configs=...)`, a JSON list of launch-config overrides of
   `lowp_decode`, `BV` and `num_warps`), every low-precision read format's non-flush timing is
   repeated under each config: rows with `config` (the override) and `launch` (the config it
   resolves to), timed against the default fp32 reads (`ratio_vs_fp32_read`) and the format's
   default launch (`ratio_vs_default`, its time over the default's); a config that does not compile or
   launch is a row with `error` and `us_per_step` None. The default rows stay as they are. A
   config's `switches` (`{"switches": {"lp_read_mma": true}}`, `bench.switches`) are set
   around its steps alone: an experimental switch timed beside the defaults in one process.
2. `timing` "window": whole windows, the flush included, rows staggered (slot `s` at cursor
   `s mod L`, as `bench decode`): `replay` (fp32 single checkpoint, always the windowed path),
   `separate` (an LP read format, fp32 high-precision checkpoint, both written at the flush),
   against `conventional` decoding with an fp32 state (`ratio_vs_conventional`; there
   `ratio_vs_fp32_read` is against the fp32 `replay` window), and against conventional decoding
   with a low-precision state, as serving engines offer it (`conventional_decode_lp` of
   `ops.mamba2` and of `ops.gdn`, which runs KDA too):
   `conventional-<fmt>` (the state rewritten round-to-nearest every step) and
   `conventional-<fmt>-sr` (seeded stochastic rounding), for each read format among fp16, bf16
   and fp8_e4m3 (`read_format` = `hp_format` = the state's format, `rounding`). A separate row's
   `ratio_vs_conventional_lp` is conventional-<its format>'s time over its own. With `--shared`
   (`measure(shared=True)`), the shared design too: `shared-<fmt>` and `shared-<fmt>-sr`, one
   checkpoint in each read format (its own copy), read by every step and rewritten at the flush
   round-to-nearest or with stochastic rounding (`lowp_decode` without an LP copy; `hp_format` =
   `read_format`, `rounding`, `ratio_vs_conventional_lp` where that format has a conventional row).

The high-precision checkpoint of the ReplaySSM rows is fp32 (`hp_format`). Bytes: the state and
record traffic of SPEC section 6 (`replayssm.traffic`), fp8 counting its row scales; GDN/KDA's
separate steps also write the raw `v`, `beta` records that the flush reads instead of `u`; a
conventional step reads and writes its state in its format. Token inputs and outputs have
`--input-dtype`, records `--record-dtype`; layer parameters, the fp32 checkpoint and the
conventional fp32 state are fp32. Results are written after every point (a run cut short keeps
what it measured), then a plot and a table.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from .. import formats, shapes, traffic
from ..ops.utils.lowp import lowp_config
from . import switches
from .common import call_accepting, copy_bandwidth_tbs, graph_time_us, header, write_results
from .decode import SHAPES, Case, _name

LP_FORMATS = ("fp16", "bf16", "fp8_e4m3", "nvfp4")
CONV_LP_FORMATS = ("fp16", "bf16", "fp8_e4m3")      # the formats of conventional_decode_lp's states
BATCHES = (64, 256, 512)


def _lowp_decode(family):
    if family == "mamba2":
        from ..ops.mamba2.precision import lowp_decode
    else:
        from ..ops.gdn.precision import lowp_decode   # KDA through its `family` argument
    return lowp_decode


def _conventional_lp(family):
    if family == "mamba2":
        from ..ops.mamba2 import conventional_decode_lp
    else:
        from ..ops.gdn import conventional_decode_lp   # KDA through its `family` argument
    return conventional_decode_lp


def parse_formats(text: str) -> list:
    """The low-precision read formats of `--formats` (comma-separated, in order, no repeats);
    ValueError naming a bad one. fp32 is always timed (the baseline) and is not one of them."""
    fmts = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in fmts if f not in LP_FORMATS]
    if bad or not fmts:
        raise ValueError(f"--formats: {', '.join(map(repr, bad)) or 'none given'}; expected a comma-separated "
                         f"subset of {', '.join(LP_FORMATS)} (fp32 reads are always timed)")
    return list(dict.fromkeys(fmts))


def _finite_parts(parts: dict) -> bool:
    """Whether stored parts hold finite values only, without decoding them (fp8's NaN is the
    code 0x7F of either sign; it has no infinities)."""
    ok = True
    for t in parts.values():
        if t.dtype == torch.float8_e4m3fn:
            ok = ok and bool(((t.view(torch.uint8) & 0x7F) != 0x7F).all())
        elif t.is_floating_point():
            ok = ok and bool(torch.isfinite(t).all())
    return ok


class PrecisionCase(Case):
    """`bench decode`'s point plus one low-precision checkpoint per read format (encoded
    round-to-nearest from the fp32 checkpoint), GDN/KDA's raw `v`, `beta` records, and per read
    format with a conventional low-precision kernel the conventional state in that format."""

    def __init__(self, shape, batch, window, lp_formats, record_dtype=torch.bfloat16, seed=0, *,
                 input_dtype=torch.bfloat16, device="cuda", shared=False):
        super().__init__(shape, batch, window, "staggered", record_dtype, seed, input_dtype=input_dtype,
                         device=device)
        N, Lb = batch, window + 1
        g = torch.Generator(device=device).manual_seed(seed + 1)
        self.buf_v = (0.1 * torch.randn(N, Lb, self.HV, self.V, device=device, generator=g)).to(record_dtype)
        self.buf_beta = torch.rand(N, Lb, self.HV, device=device, generator=g)
        self.start = self.cursor.clone()
        self.lowp = _lowp_decode(self.family)
        self.conventional_lp = _conventional_lp(self.family)
        self.ckpt_lp = {fmt: self._encoded(self.ckpt, fmt) for fmt in lp_formats}
        self.state_lp = {fmt: self._encoded(self.state, fmt) for fmt in lp_formats if fmt in CONV_LP_FORMATS}
        # the shared design's one checkpoint per format (rewritten by its windows)
        self.ckpt_shared = {fmt: self._encoded(self.ckpt, fmt) for fmt in lp_formats} if shared else {}

    @staticmethod
    def _encoded(x, fmt):
        parts = formats.allocate(fmt, tuple(x.shape), device=x.device)
        for s0 in range(0, x.shape[0], 32):          # in slot chunks: encode works in float64
            for key, t in formats.encode(x[s0:s0 + 32], fmt).items():
                parts[key][s0:s0 + 32] = t
        return parts

    def step(self, i, read_format, config=None):
        """Step `i` of the window with checkpoint reads in `read_format` (fp32: `replay_decode`)."""
        config, sw = switches.split(config)
        with switches.applied(sw):
            self._step(i, read_format, config)

    def _step(self, i, read_format, config):
        kw = dict(self._common(i), ckpt=self.ckpt, buf_ld=self.buf_ld, buf_w=self.buf_w, buf_k=self.buf_k,
                  cursor=self.cursor, epoch=self.epoch, arrive=self.arrive, slot_ids=self.slot_ids,
                  window=self.window, out=self.out[i], config=config, validate=False)
        if read_format == "fp32":
            call_accepting(self.ops.replay_decode, kw)
        else:
            call_accepting(self.lowp, dict(kw, ckpt_lp=self.ckpt_lp[read_format], lp_format=read_format,
                                  buf_v=self.buf_v, buf_beta=self.buf_beta, family=self.family))

    def non_flush_steps(self, read_format, config=None):
        # cursors back to 0 inside the graph: each replay times positions 0..L-2, none a flush
        self.cursor.zero_()
        for i in range(self.window - 1):
            self.step(i, read_format, config)

    def whole_window(self, read_format, config=None):
        for i in range(self.window):
            self.step(i, read_format, config)

    def shared_window(self, fmt, rounding, config=None):
        """`window` steps of the shared design on its `fmt` checkpoint, written with `rounding`."""
        for i in range(self.window):
            call_accepting(self.lowp, dict(self._common(i), ckpt=self.ckpt_shared[fmt], ckpt_lp=None, lp_format=None,
                                           hp_format=fmt, hp_rounding=rounding, seed=0, buf_ld=self.buf_ld,
                                           buf_w=self.buf_w, buf_k=self.buf_k, buf_v=None, buf_beta=None,
                                           cursor=self.cursor, epoch=self.epoch, arrive=self.arrive,
                                           slot_ids=self.slot_ids, window=self.window, out=self.out[i],
                                           config=config, family=self.family, validate=False))

    def conventional_lp_window(self, fmt, rounding, config=None):
        """`window` conventional steps on the `fmt` state, written with `rounding` (step `i`
        seeds the stochastic rounding of step `i`)."""
        for i in range(self.window):
            call_accepting(self.conventional_lp,
                           dict(self._common(i), state=self.state_lp[fmt], slot_ids=self.slot_ids, fmt=fmt,
                                out=self.out[i], config=config, rounding=rounding, seed=0, step=i,
                                family=self.family, validate=False))

    def step_bytes(self, read_format, h, shared=False):
        """Bytes one step at cursor `h` moves for the whole batch (SPEC section 6): the
        checkpoint read in `read_format` (the fp32 one at the flush, which writes fp32 and the
        LP copy), the `h` records, and the step's own record (none at the flush). `shared`: the
        one checkpoint in `read_format`, read by every step and written by the flush."""
        rb = torch.finfo(self.record_dtype).bits // 8
        fp32 = traffic.decode_step_bytes(h, self.window, self.HV, self.V, self.K, self.Hk, value_bytes=rb,
                                         key_bytes=rb, decay_len=self.K if self.family == "kda" else 1)
        if read_format == "fp32":
            return fp32 * self.batch
        lp_state = formats.bytes_per_element(read_format, self.K) * self.V * self.K * self.HV
        fp32_state = traffic.state_bytes(self.V, self.K) * self.HV
        if shared:
            return (fp32 + (lp_state - fp32_state) * (2 if h + 1 >= self.window else 1)) * self.batch
        if h + 1 >= self.window:
            extra = lp_state + (4 * h * self.HV if self.family != "mamba2" else 0)   # beta read
        else:
            # GDN/KDA's separate steps write the raw v (record dtype) and beta (fp32) beside u
            raw = (rb * self.V + 4) * self.HV if self.family != "mamba2" else 0
            extra = lp_state - fp32_state + raw
        return (fp32 + extra) * self.batch

    def finite(self) -> bool:
        return bool(torch.isfinite(self.ckpt).all() and torch.isfinite(self.state).all()) and all(
            _finite_parts(p) for p in (*self.state_lp.values(), *self.ckpt_shared.values()))


def parse_configs(text: str, shape_list) -> list:
    """The launch-config overrides of `--configs`: a JSON list of objects, each accepted by
    `lowp_config` at every shape of `shape_list`; ValueError naming a bad one."""
    import json

    try:
        configs = json.loads(text)
    except ValueError:
        configs = None
    if not isinstance(configs, list) or not configs or not all(isinstance(c, dict) for c in configs):
        raise ValueError(f"--configs must be a non-empty JSON list of objects, e.g. "
                         f"'[{{\"BV\": 64, \"num_warps\": 4}}]', got {text!r}")
    for cfg in configs:
        for spec in shape_list:
            try:
                lowp_config(shapes.parse(spec).V, switches.split(cfg)[0])
            except ValueError as e:
                raise ValueError(f"--configs: {json.dumps(cfg)}: {e}") from None
    return configs


def measure(shape, batch, window, lp_formats, reps, *, record_dtype=torch.bfloat16, input_dtype=torch.bfloat16,
            device="cuda", whole_window=True, shared=False, configs=None):
    """Rows of one (shape, batch, window) point: the non-flush step per read format (fp32
    first), with `configs` (launch-config overrides of `lowp_decode`) each low-precision read
    format's non-flush step again under each config (rows with `config`, the override, and
    `launch`, its resolved config), then (with `whole_window`) conventional (fp32, then each
    low-precision state, nearest and stochastic), replay and each separate design over whole
    windows, and with `shared` the shared design per read format (nearest, then stochastic)
    over whole windows."""
    case = PrecisionCase(shape, batch, window, lp_formats, record_dtype, input_dtype=input_dtype, device=device,
                         shared=shared and whole_window)
    L = window
    base = dict(shape=shape, family=case.family, batch=batch, window=L, record_dtype=_name(record_dtype),
                input_dtype=_name(input_dtype), hp_format="fp32")
    rows = []
    reads = ["fp32"] + list(lp_formats)
    t_nf, b_nf = {}, {}
    for fmt in reads:
        t_nf[fmt] = graph_time_us(lambda: case.non_flush_steps(fmt), reps=reps) / (L - 1)
        b_nf[fmt] = sum(case.step_bytes(fmt, h) for h in range(L - 1)) / (L - 1)
    for fmt in reads:
        rows.append(dict(base, timing="non_flush", scheme="replay" if fmt == "fp32" else "separate",
                         read_format=fmt, cursors="lockstep from 0", us_per_step=t_nf[fmt],
                         ratio_vs_fp32_read=t_nf["fp32"] / t_nf[fmt], bytes_per_step=b_nf[fmt],
                         tb_per_s=b_nf[fmt] / t_nf[fmt] / 1e6,
                         byte_bound=4.0 / formats.bytes_per_element(fmt, case.K),
                         byte_bound_traffic=b_nf["fp32"] / b_nf[fmt]))
    for cfg, fmt in itertools.product(configs or [], lp_formats):
        row = dict(base, timing="non_flush", scheme="separate", read_format=fmt, cursors="lockstep from 0",
                   config=dict(cfg))
        try:
            row["launch"] = lowp_config(case.V, switches.split(cfg)[0])
            t = graph_time_us(lambda: case.non_flush_steps(fmt, cfg), reps=reps) / (L - 1)
        except Exception as e:  # a config that does not compile or launch is a row, not the end of the run
            rows.append(dict(row, us_per_step=None, error=repr(e)[:300]))
            continue
        rows.append(dict(row, us_per_step=t, ratio_vs_fp32_read=t_nf["fp32"] / t, ratio_vs_default=t / t_nf[fmt],
                         bytes_per_step=b_nf[fmt],
                         tb_per_s=b_nf[fmt] / t / 1e6, byte_bound=4.0 / formats.bytes_per_element(fmt, case.K),
                         byte_bound_traffic=b_nf["fp32"] / b_nf[fmt]))
    case.cursor.copy_(case.start)                 # the whole windows start staggered
    if whole_window:
        t_conv = graph_time_us(case.conventional_window, reps=reps) / L
        t_clp = {(fmt, r): graph_time_us(lambda: case.conventional_lp_window(fmt, r), reps=reps) / L
                 for fmt in case.state_lp for r in ("nearest", "stochastic")}
        t_win, b_win = {}, {}
        for fmt in reads:
            t_win[fmt] = graph_time_us(lambda: case.whole_window(fmt), reps=reps) / L
            b_win[fmt] = sum(case.step_bytes(fmt, h) for h in range(L)) / L
        b_conv = 2 * traffic.state_bytes(case.V, case.K) * case.HV * batch
        rows.append(dict(base, timing="window", scheme="conventional", read_format="fp32", cursors="staggered",
                         us_per_step=t_conv, ratio_vs_fp32_read=t_win["fp32"] / t_conv, ratio_vs_conventional=1.0,
                         bytes_per_step=b_conv, tb_per_s=b_conv / t_conv / 1e6))
        for (fmt, r), t in t_clp.items():
            b = 2 * formats.bytes_per_element(fmt, case.K) * case.V * case.K * case.HV * batch
            rows.append(dict(base, timing="window", scheme=f"conventional-{fmt}" + ("-sr" if r == "stochastic" else ""),
                             read_format=fmt, hp_format=fmt, rounding=r, cursors="staggered", us_per_step=t,
                             ratio_vs_fp32_read=t_win["fp32"] / t, ratio_vs_conventional=t_conv / t,
                             bytes_per_step=b, tb_per_s=b / t / 1e6))
        for fmt in reads:
            row = dict(base, timing="window", scheme="replay" if fmt == "fp32" else "separate",
                       read_format=fmt, cursors="staggered", path="windowed", us_per_step=t_win[fmt],
                       ratio_vs_fp32_read=t_win["fp32"] / t_win[fmt],
                       ratio_vs_conventional=t_conv / t_win[fmt], bytes_per_step=b_win[fmt],
                       tb_per_s=b_win[fmt] / t_win[fmt] / 1e6)
            if (fmt, "nearest") in t_clp:
                row["ratio_vs_conventional_lp"] = t_clp[fmt, "nearest"] / t_win[fmt]
            rows.append(row)
        for fmt, r in itertools.product(case.ckpt_shared, ("nearest", "stochastic")):
            t = graph_time_us(lambda: case.shared_window(fmt, r), reps=reps) / L
            b = sum(case.step_bytes(fmt, h, shared=True) for h in range(L)) / L
            row = dict(base, timing="window", scheme=f"shared-{fmt}" + ("-sr" if r == "stochastic" else ""),
                       read_format=fmt, hp_format=fmt, rounding=r, cursors="staggered", path="windowed",
                       us_per_step=t, ratio_vs_fp32_read=t_win["fp32"] / t, ratio_vs_conventional=t_conv / t,
                       bytes_per_step=b, tb_per_s=b / t / 1e6)
            if (fmt, "nearest") in t_clp:
                row["ratio_vs_conventional_lp"] = t_clp[fmt, "nearest"] / t
            rows.append(row)
    finite = case.finite()
    for r in rows:
        r["finite"] = finite
    case = None       # free this point's tensors before the next one is allocated
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = ((axes[0], "non_flush", "ratio_vs_fp32_read", "non-flush step: speed-up over fp32 reads"),
              (axes[1], "window", "ratio_vs_conventional", "whole window: speed-up over conventional fp32"))
    for ax, timing, key, title in panels:
        mine = [r for r in rows if r["timing"] == timing and r["scheme"] in ("replay", "separate")
                and "config" not in r]                  # the default launch configs only
        for shape, fmt in sorted({(r["shape"], r["read_format"]) for r in mine}):
            pts = sorted((r["batch"], r[key]) for r in mine if r["shape"] == shape and r["read_format"] == fmt)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{shape} {fmt}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"ReplaySSM separate precisions ({torch.cuda.get_device_name()})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows) -> str:
    """The printed summary: per point, each read format's non-flush time, its ratio against
    fp32 reads and its byte bound, and its whole-window ratio against conventional decoding
    with an fp32 state and with a state in the read format (round-to-nearest); then each
    `--configs` row's non-flush time and ratio against the default fp32 reads."""
    lines = ["shape              batch  L read      non-flush us  vs fp32  byte bound  window us  vs conv  vs conv-lp"]
    for r in rows:
        if r["timing"] != "non_flush" or "config" in r:
            continue
        w = next((x for x in rows if x["timing"] == "window" and x["scheme"] in ("replay", "separate") and all(
            x[k] == r[k] for k in ("shape", "batch", "window", "read_format"))), None)
        win = f"{w['us_per_step']:9.1f} {w['ratio_vs_conventional']:7.2f}x" if w else ""
        if w and "ratio_vs_conventional_lp" in w:
            win += f" {w['ratio_vs_conventional_lp']:9.2f}x"
        lines.append(f"{r['shape']:18} {r['batch']:5d} {r['window']:2d} {r['read_format']:9} {r['us_per_step']:12.1f} "
                     f"{r['ratio_vs_fp32_read']:7.2f}x {r['byte_bound']:9.2f}x  {win}")
    tried = [r for r in rows if "config" in r]
    if tried:
        lines.append("shape              batch  L read      non-flush us  vs fp32  time/default  config")
    for r in tried:
        vs_default = f"{r['ratio_vs_default']:12.3f}x" if "ratio_vs_default" in r else f"{'-':>13}"  # (older files)
        got = (f"{r['us_per_step']:12.1f} {r['ratio_vs_fp32_read']:7.2f}x {vs_default}"
               if r["us_per_step"] is not None else f"{'failed':>12} {'':8} {'':13}")
        sw = r["config"].get("switches")
        lines.append(f"{r['shape']:18} {r['batch']:5d} {r['window']:2d} {r['read_format']:9} {got}  "
                     f"{r.get('launch') or r['config']}" + (f" switches {sw}" if sw else "")
                     + (f"  {r['error'][:80]}" if "error" in r else ""))
    return "\n".join(lines)


def main(argv=None):
    # an explicit prog: the default, sys.argv[0], reads "cli.py" when run through `replayssm bench`
    ap = argparse.ArgumentParser(prog="replayssm bench precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="model names or family/HV/Hk/V/K specs, comma-separated (default: %(default)s)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--windows", default="16", help="windows L, comma-separated (each at least 2)")
    ap.add_argument("--formats", default=",".join(LP_FORMATS),
                    help="low-precision read formats, comma-separated (default: %(default)s; fp32 reads "
                         "are always timed)")
    ap.add_argument("--record-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the buffered records")
    ap.add_argument("--input-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the token inputs and outputs (layer parameters stay fp32)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-window", dest="whole_window", action="store_false",
                    help="time the non-flush steps only (no whole windows, no conventional kernels)")
    ap.add_argument("--shared", action="store_true",
                    help="also time whole windows of the shared design (one checkpoint in each read format, "
                         "round-to-nearest and stochastic rounding)")
    ap.add_argument("--configs", default=None,
                    help="JSON list of launch-config overrides of the precision kernels (keys BV, num_warps), "
                         'e.g. \'[{"BV": 64, "num_warps": 4}, {"BV": 32, "num_warps": 8}]\': every low-precision '
                         "read format's non-flush timing is repeated for each, rows carrying `config`; a "
                         'config\'s "switches" (e.g. {"switches": {"lp_read_mma": true}}) are experimental '
                         "switches set around its steps (replayssm.bench.switches)")
    ap.add_argument("--out", default="precision.json", help="the JSON results file (a plot beside it)")
    args = ap.parse_args(argv)
    try:
        lp_formats = parse_formats(args.formats)
        shape_list = args.shapes.split(",")
        for spec in shape_list:
            K = shapes.parse(spec).K
            if "nvfp4" in lp_formats and K % formats.NVFP4_BLOCK:
                raise ValueError(f"shape {spec!r}: nvfp4 needs K divisible by {formats.NVFP4_BLOCK}, got K={K}")
        batches = [int(b) for b in args.batches.split(",")]
        windows = [int(w) for w in args.windows.split(",")]
        configs = parse_configs(args.configs, shape_list) if args.configs is not None else None
    except ValueError as e:
        ap.error(str(e))
    if min(batches) < 1 or min(windows) < 2:
        ap.error("--batches must be positive and --windows at least 2 (a window of 1 has no non-flush step)")
    if not torch.cuda.is_available():
        raise SystemExit(f"{ap.prog}: error: the precision benchmark needs a CUDA device "
                         "(torch.cuda.is_available() is False on this machine)")
    rdt, idt = getattr(torch, args.record_dtype), getattr(torch, args.input_dtype)
    doc = header("precision")
    doc.update(record_dtype=args.record_dtype, input_dtype=args.input_dtype, formats=lp_formats,
               copy_tb_per_s=copy_bandwidth_tbs())
    if configs:
        doc["configs"] = configs
    print(f"{doc['device']}: device-to-device copy {doc['copy_tb_per_s']:.2f} TB/s; records "
          f"{args.record_dtype}, token inputs {args.input_dtype}; read formats fp32,{','.join(lp_formats)}", flush=True)
    rows = []
    for shape, window, batch in itertools.product(shape_list, windows, batches):
        r = measure(shape, batch, window, lp_formats, args.reps, record_dtype=rdt, input_dtype=idt,
                    whole_window=args.whole_window, shared=args.shared, configs=configs)
        rows += r
        doc["rows"] = rows
        write_results(args.out, doc)      # after every point: a run cut short keeps what it measured
        print(table(r), flush=True)
    doc["rows"] = rows
    path = write_results(args.out, doc)
    try:
        _plot(rows, path.with_suffix(".png"))
    except Exception as e:  # plotting is a convenience; the JSON is the result
        print("plot failed:", e)
    print("\n" + table(rows))
    return doc


if __name__ == "__main__":
    main()
