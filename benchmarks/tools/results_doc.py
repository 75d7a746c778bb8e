"""Write docs/results.md (an index) and a page per section under docs/results/ from the result
files that benchmarks/results/README.md indexes.

    python benchmarks/tools/results_doc.py [--check]

For each JSON file named in the index's tables (in the index's order, under its section
headings): the file's own provenance (command, GPU, date, code version) and a compact table of
its rows, with the columns that matter for its benchmark (`decode`, and its `--variants` runs,
`eager_sweep`, `tune`, `records`, `verify`, `model`, `precision`, `precision_study`,
`precision_model_study`, `vllm_ssu`, `cursor_steps`). `--check` writes nothing and exits 1
when a page differs from what would be written or a page under docs/results/ is no longer
generated (benchmarks/tools/test_tools.py runs the same comparison). Reads JSON only: it imports nothing of the package.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "results.md"


# ----------------------------------------------------------------------------------------------
# The index: sections and the JSON files of each table row's first cell

def indexed_files(index: str) -> list:
    """`[(section heading, [json names])]` in the index's order; a file named twice is kept once."""
    sections, seen = [], set()
    for line in index.splitlines():
        if line.startswith("## "):
            sections.append((line[3:].strip(), []))
        elif line.startswith("| `") and sections:
            first = line.split("|")[1]
            for name in re.findall(r"`([^`]+\.json)`", first):
                if name not in seen:
                    seen.add(name)
                    sections[-1][1].append(name)
    return [(title, names) for title, names in sections if names]


# ----------------------------------------------------------------------------------------------
# Formatting

def _table(header: list, rows: list) -> list:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _us(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _config(c) -> str:
    # the table's own config is stored as null
    if not c:
        return "table"
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in c.items())


def _err(x) -> str:
    return f"{x:.2e}"


# ----------------------------------------------------------------------------------------------
# One table per benchmark

def decode_table(rows: list) -> list:
    """One line per (shape, window, cursors): ReplaySSM's speed-up over the conventional
    kernel at each batch ("e": the eager step), and both kernels' TB/s at the largest batch."""
    batches = sorted({r["batch"] for r in rows})
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["shape"], r["window"], r["cursors"])][(r["batch"], r["scheme"])] = r
    top = batches[-1]
    header = ["shape", "window", "rows"] + [f"B={b}" for b in batches] + \
        [f"B={top} conventional / replay TB/s"]
    out = []
    for (shape, window, cursors), c in cells.items():
        line = [shape, window, cursors]
        for b in batches:
            r = c.get((b, "replay"))
            line.append("-" if r is None else
                        f"{r['ratio_vs_conventional']:.2f}x" + (" e" if r.get("path") == "eager" else ""))
        conv, rep = c.get((top, "conventional")), c.get((top, "replay"))
        line.append(f"{conv['tb_per_s']:.2f} / {rep['tb_per_s']:.2f}" if conv and rep else "-")
        out.append(line)
    return _table(header, out)


def variants_table(rows: list) -> list:
    """A decode benchmark's `--variants` run: one line per (shape, window, batch), the
    conventional kernel's time and each replay config's speed-up over it (a config timed twice
    shows both)."""
    configs, cells = [], defaultdict(lambda: defaultdict(list))
    for r in rows:
        c = _config(r["config"])
        if c not in configs:
            configs.append(c)
        cell = cells[(r["shape"], r["window"], r["batch"])]
        cell["conv"].append(r["us_conv"])
        cell[c].append(f"{r['ratio']:.2f}x")
    out = [[shape, window, batch, _us(c["conv"][0])] + [" / ".join(c[k]) or "-" for k in configs]
           for (shape, window, batch), c in cells.items()]
    return _table(["shape", "window", "batch", "conventional us"] + configs, out)


def eager_sweep_table(rows: list) -> list:
    """One line per (shape, batch): the tables' configs (conventional, windowed, eager) and the
    fastest candidate config of the conventional kernel and of the eager step, in us a step."""
    by = defaultdict(list)
    for r in rows:
        by[(r["shape"], r["batch"])].append(r)
    header = ["shape", "batch", "conventional us", "windowed us", "eager us",
              "fastest conventional config (us)", "fastest eager config (us)", "failed configs"]
    out = []
    for (shape, batch), rs in by.items():
        table = {r["kind"]: r["us_per_step"] for r in rs if r["config"] is None}
        line = [shape, batch, _us(table.get("conventional")), _us(table.get("windowed")),
                _us(table.get("eager"))]
        for kind in ("conventional", "eager"):
            ok = [r for r in rs if r["kind"] == kind and r["config"] and r["us_per_step"] is not None]
            best = min(ok, key=lambda r: r["us_per_step"], default=None)
            line.append("-" if best is None else f"{_config(best['config'])} ({_us(best['us_per_step'])})")
        line.append(sum(1 for r in rs if r.get("error")))
        out.append(line)
    return _table(header, out)


def tune_table(rows: list, tuned: dict) -> list:
    """One line per (batch, scheme): the candidates timed and the fastest; then the entries
    that the tuning wrote."""
    by = defaultdict(list)
    for r in rows:
        by[(r["batch"], r["scheme"])].append(r)
    header = ["batch", "scheme", "candidates", "failed", "fastest config", "us"]
    out = []
    for (batch, scheme), rs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ok = [r for r in rs if r.get("us_per_step") is not None]
        best = min(ok, key=lambda r: r["us_per_step"], default=None)
        out.append([batch, scheme, len(rs), len(rs) - len(ok),
                    "-" if best is None else _config(best["config"]),
                    "-" if best is None else _us(best["us_per_step"])])
    lines = _table(header, out)
    if tuned:
        lines.append("")
        lines.append(f"Tuned entries (`eager_max_batch` {tuned.get('eager_max_batch')}; "
                     "up to batch: config; 1073741824 stands for every larger batch):")
        lines.append("")
        for scheme in ("eager", "replay", "conventional"):
            entries = tuned.get(scheme) or []
            text = "; ".join(f"{b}: {_config(c)}" for b, c in entries) if entries else "none"
            lines.append(f"- {scheme}: {text}")
    return lines


def records_table(rows: list) -> list:
    """One line per (shape, scheme): the mean relative output error against the float64
    recurrence in the first and the last bin of steps (equal: no drift) and over all bins."""
    header = ["shape", "family", "heads", "batch", "steps", "scheme", "first bin", "last bin", "mean"]
    out = []
    for r in rows:
        for scheme, errs in r["output_rel_err_by_bin"].items():
            out.append([r["shape"], r["family"], r["heads"], r["batch"], r["steps"], f"`{scheme}`",
                        _err(errs[0]), _err(errs[-1]), _err(sum(errs) / len(errs))])
    return _table(header, out)


def verify_table(rows: list) -> list:
    """One line per (shape, batch, T): the conventional step's time, and each verify scheme's
    step time over it from all drafts rejected to all accepted, with its bytes per sequence, at
    the file's first window (16 where timed); replay at any other window in the last column."""
    header = ["shape", "batch", "T", "L", "conventional us", "replay", "snapshot", "replay MB/seq",
              "snapshot MB/seq", "replay at other L"]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["shape"], r["batch"], r["T"])].append(r)

    def span(rs, scheme):
        ratios = [r["ratio_vs_conventional_step"] for r in rs if r["scheme"] == scheme and "config" not in r
                  and "ratio_vs_conventional_step" in r]
        return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else ""

    out = []
    for (shape, batch, T), rs in groups.items():
        windows = sorted({r.get("window", "") for r in rs}, key=lambda w: (w != 16, str(w)))
        main = [r for r in rs if r.get("window", "") == windows[0]]
        conv = next(r for r in main if r["scheme"] == "conventional")
        mb = [next((r["bytes_per_sequence"] / 2 ** 20 for r in main if r["scheme"] == s_ and "config" not in r), None)
              for s_ in ("replay", "snapshot")]
        other = "; ".join(f"L={w}: {span([r for r in rs if r.get('window', '') == w], 'replay')}" for w in windows[1:])
        out.append([shape, batch, T, windows[0], _us(conv["us_per_step"]), span(main, "replay"), span(main, "snapshot"),
                    *(f"{m:.2f}" if m is not None else "" for m in mb), other])
    return _table(header, out)


def model_table(data: dict) -> list:
    """Whole-model decode steps (one line per model, context, batch: each scheme's step time,
    its ratio to the conventional step) and the speculative rounds' tokens per second."""
    schemes = list(dict.fromkeys(r["scheme"] for r in data["rows"]))
    header = ["model", "context", "batch", *(f"`{s_}` us (vs conventional)" for s_ in schemes), "timing"]
    groups = defaultdict(dict)
    for r in data["rows"]:
        groups[(r["model"], r["context"], r["batch"])][r["scheme"]] = r
    out = []
    for (model, context, batch), by in groups.items():
        cells = []
        for s_ in schemes:
            r = by.get(s_)
            if r is None or not r.get("us_per_step"):
                cells.append("")
                continue
            ratio = f" ({r['ratio_vs_conventional']:.2f}x)" if r.get("ratio_vs_conventional") else ""
            cells.append(_us(r["us_per_step"]) + ratio)
        out.append([model, context, batch, *cells, ", ".join(sorted({r["timing"] for r in by.values()}))])
    lines = _table(header, out)
    spec = data.get("speculative_rows") or []
    if spec:
        header = ["model", "context", "batch", "scheme", "us/round", "tokens/s", "vs snapshot", "MB/seq", "timing"]
        out = [[r["model"], r["context"], r["batch"], f"`{r['scheme']}`", _us(r["us_per_round"]) if r["us_per_round"] else "",
                f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "",
                f"{r['ratio_vs_snapshot']:.2f}x" if r.get("ratio_vs_snapshot") else "",
                f"{r['bytes_per_sequence'] / 2 ** 20:.0f}" if r.get("bytes_per_sequence") else "", r["timing"]]
               for r in spec]
        lines += ["", f"Speculative rounds ({data.get('speculative', '')}):", ""] + _table(header, out)
    return lines


def precision_table(rows: list) -> list:
    """One line per row of the separate-precision benchmark."""
    header = ["shape", "batch", "timing", "scheme", "read", "config", "us/step", "vs fp32 read", "byte bound",
              "vs conventional"]
    out = [[r["shape"], r["batch"], r["timing"], f"`{r['scheme']}`", r["read_format"],
            f"`{json.dumps(r['config'])}`" if r.get("config") else "", _us(r["us_per_step"]) if r["us_per_step"] else "",
            f"{r['ratio_vs_fp32_read']:.2f}x" if r.get("ratio_vs_fp32_read") else "",
            f"{r['byte_bound']:.2f}x" if r.get("byte_bound") else "",
            f"{r['ratio_vs_conventional']:.2f}x" if r.get("ratio_vs_conventional") else ""] for r in rows]
    return _table(header, out)


def _study_bins(rows: list, first: str) -> list:
    """The studies' rows grouped by (`first`, design, formats, rounding), each group's
    log-spaced bins: (key, rows by token count, last count, first count past 1024 (else the
    last), first non-finite token or None)."""
    groups = defaultdict(dict)
    for r in rows:
        groups[(r[first], r["design"], r["read_format"], r["hp_format"], r["rounding"])][r["tokens"]] = r
    out = []
    for key, by in groups.items():
        ts = sorted(by)
        near = next((t for t in ts if t >= 1024), ts[-1])
        bad = next((by[t]["first_nonfinite"] for t in ts if by[t]["first_nonfinite"] is not None), None)
        out.append((key, by, ts[-1], near, bad))
    return out


def precision_study_table(rows: list) -> list:
    """One line per (family, design, formats, rounding): the mean relative output error over
    the first log-spaced bin past 1024 tokens and over the last bin, and the first non-finite
    token."""
    header = ["family", "design", "read", "HP", "rounding", "tokens", "error near 1K", "error at the end", "non-finite"]
    return _table(header, [[*key, last, _err(by[near]["rel_error"]), _err(by[last]["rel_error"]), bad or ""]
                           for key, by, last, near, bad in _study_bins(rows, "family")])


def precision_model_table(rows: list) -> list:
    """One line per (model, design, formats, rounding): the mean next-token KL divergence over
    the first log-spaced bin past 1024 steps and over the last bin, top-1 agreement over the
    last bin, and the first non-finite step."""
    header = ["model", "design", "read", "HP", "rounding", "steps", "KL near 1K", "KL at the end", "top-1",
              "non-finite"]
    return _table(header, [[*key, last, _err(by[near]["kl"]), _err(by[last]["kl"]),
                            f"{by[last]['top1_agree']:.3f}", bad or ""]
                           for key, by, last, near, bad in _study_bins(rows, "model")])


# ----------------------------------------------------------------------------------------------
# The document

def vllm_ssu_table(rows: list) -> list:
    """One line per (shape, batch): vLLM's Mamba-2 kernel, our conventional kernel and the pool's
    step (path), in microseconds a step, and the step's speed-up over vLLM's kernel."""
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["shape"], r["batch"])][r["scheme"]] = r
    out = []
    for (shape, batch), c in cells.items():
        v, conv, rep = c["vllm_conventional"], c["conventional"], c["replay"]
        out.append([shape, batch, _us(v["us_per_step"]), _us(conv["us_per_step"]),
                    f"{_us(rep['us_per_step'])} ({rep['path']})", f"{rep['ratio_vs_vllm']:.2f}x"])
    return _table(["shape", "batch", "vLLM us", "conventional us", "replay us (path)", "replay vs vLLM"], out)


def cursor_steps_table(data: dict) -> list:
    """benchmarks/tools/cursor_steps.py: per config (and code, where a file holds two trees), the
    staggered window's mean step and the step with every row held at each cursor, in
    microseconds, and the flush step over the conventional one."""
    hs = sorted({int(k[1:-3]) for r in data["rows"] for k in r if re.fullmatch(r"h\d+_us", k)})
    out = []
    for r in data["rows"]:
        conv = r.get("conventional_us", data["conventional_us"])
        flush = r.get(f"h{data['window'] - 1}_us")
        out.append([r.get("code", "-"), _config(r["config"]), _us(conv), _us(r["staggered_us"]),
                    f"{conv / r['staggered_us']:.2f}x"] + [_us(r.get(f"h{h}_us")) for h in hs]
                   + ["-" if flush is None else f"{flush / conv:.2f}x"])
    return _table(["code", "config", "conventional us", "staggered us", "staggered vs conventional"]
                  + [f"h={h} us" for h in hs] + ["flush / conventional"], out)


def vllm_table(rows: list) -> list:
    # rows timed under vLLM's profiler (`--profile`) are perturbed by it: the table leaves them out
    by = {(r["speculative"], r["batch"], r["scheme"]): r for r in rows if not r.get("profiled")}
    fp32 = any(r["scheme"] == "stock-fp32" for r in rows)
    state = any(r.get("ssm_cache_dtype") for r in rows)
    held = any(r.get("max_concurrency") for r in rows)
    head = (["speculative", "batch", "plugin scheme"] + (["stock SSM state"] if state else []) + ["stock tokens/s"]
            + (["stock, fp32 state"] if fp32 else []) + ["replayssm tokens/s", "vs stock"]
            + (["vs stock, fp32 state"] if fp32 else []) + ["draft acceptance (stock / plugin)"]
            + (["requests held (stock / plugin)"] if held else []))
    body = []
    for (spec, batch, scheme), r in sorted(by.items()):
        if not scheme.startswith("replayssm"):         # a plugin scheme: `replayssm`, `replayssm-one-block`
            continue
        bases = [by.get((spec, batch, "stock"), {})] + ([by.get((spec, batch, "stock-fp32"), {})] if fp32 else [])
        # both engines' acceptance: a ratio compares like with like only where they match
        accept = " / ".join(_acceptance(x) for x in (bases[0], r))
        tps = [x.get("tokens_per_s") for x in bases + [r]]
        ratios = [r.get("ratio_vs_stock")] + ([r.get("ratio_vs_stock_fp32")] if fp32 else [])
        dtype = [str(bases[0].get("ssm_cache_dtype") or "-")] if state else []
        cap = ([" / ".join(f"{x:.1f}" if x else "-" for x in (bases[0].get("max_concurrency"), r.get("max_concurrency")))]
               if held else [])
        body.append([spec, batch, scheme] + dtype + [f"{x:.0f}" if x else "-" for x in tps] +
                    [f"{x:.2f}x" if x else "-" for x in ratios] + [accept] + cap)
    return _table(head, body)


def _acceptance(row: dict) -> str:
    drafts, acc = row.get("spec_decode_num_draft_tokens_delta"), row.get("spec_decode_num_accepted_tokens_delta")
    return f"{acc / drafts:.1%}" if drafts else "-"


def file_section(name: str, data: dict) -> list:
    out = [f"### `{name}`", ""]
    note = f" ({data['git_commit_note']})" if data.get("git_commit_note") else ""
    out.append(f"- command: `{data['command']}`")
    where = "machine" if data["device"].startswith("CPU") else "GPU"
    out.append(f"- {where}: {data['device']} (torch {data['torch']}, triton {data['triton']}); "
               f"date: {data['date']}; code: {data['git_commit']}{note}")
    dtypes = [f"{k.replace('_', ' ')} {data[k]}" for k in ("record_dtype", "input_dtype") if k in data]
    if "copy_tb_per_s" in data:
        dtypes.append(f"device-to-device copy {data['copy_tb_per_s']:.2f} TB/s")
    if dtypes:
        out.append("- " + ", ".join(dtypes))
    out.append("")
    kind = data["benchmark"]
    if kind == "decode" and "variants" in data:
        out += variants_table(data["variants"])
    elif kind == "decode":
        out += decode_table(data["rows"])
    elif kind == "eager_sweep":
        out += eager_sweep_table(data["rows"])
    elif kind == "tune":
        out += tune_table(data["rows"], data.get("tuned") or {})
    elif kind == "records":
        out += records_table(data["rows"])
    elif kind == "verify":
        out += verify_table(data["rows"])
    elif kind == "model":
        out += model_table(data)
    elif kind == "precision":
        out += precision_table(data["rows"])
    elif kind == "vllm_ssu":
        out += vllm_ssu_table(data["rows"])
    elif kind == "vllm":
        out += vllm_table(data["rows"])
        if any(r.get("profiled") for r in data["rows"]):
            out += ["", "(Rows timed under vLLM's profiler, `profiled: true` in the file, are left out.)"]
    elif kind == "precision_study":
        out += precision_study_table(data["rows"])
    elif kind == "precision_model_study":
        out += precision_model_table(data["rows"])
    elif kind == "cursor_steps":
        out += cursor_steps_table(data)
    else:
        out.append(f"{len(data['rows'])} rows of benchmark `{kind}` (no table for it here).")
    return out + [""]


def section_slug(title: str) -> str:
    """The file name of a section's page: its heading up to the command in brackets, lower case,
    words joined by hyphens."""
    words = re.findall(r"[a-z0-9]+", title.split("(")[0].lower())
    return "-".join(words) + ".md"


def render(results_dir: pathlib.Path = RESULTS) -> dict:
    """`{path under docs/: text}`: docs/results.md, an index of the sections, and one page per
    section of benchmarks/results/README.md under docs/results/ (one page for all of them
    outgrew the house's limit on a file's length)."""
    index = (results_dir / "README.md").read_text()
    intro = ["Generated by `python benchmarks/tools/results_doc.py` from the JSON files indexed in",
             "[`benchmarks/results/README.md`]({up}benchmarks/results/README.md), which says what each",
             "run measured; do not edit by hand (benchmarks/tools/test_tools.py checks that this file",
             "is what the script writes). Each file's command is as recorded: its `--out` pointed at a",
             "scratch folder on the GPU machine. Times are microseconds a decode step; speed-ups are",
             "the conventional kernel's time over ReplaySSM's, timed in the same run.", ""]
    top = ["# Results", ""] + [line.format(up="../") for line in intro]
    pages = {}
    for title, names in indexed_files(index):
        slug = section_slug(title)
        top.append(f"- [{title}](results/{slug}): " + ", ".join(f"`{n}`" for n in names))
        out = [f"# {title}", ""] + [line.format(up="../../") for line in intro]
        for name in names:
            out += file_section(name, json.loads((results_dir / name).read_text()))
        pages[f"results/{slug}"] = "\n".join(out).rstrip("\n") + "\n"
    return {"results.md": "\n".join(top).rstrip("\n") + "\n", **pages}


def stale_pages(pages: dict, docs: pathlib.Path = DOC.parent) -> list:
    """The generated files that differ from `pages` on disk, and pages on disk no longer generated."""
    bad = [name for name, text in pages.items() if not (docs / name).exists() or (docs / name).read_text() != text]
    extra = [f"results/{p.name}" for p in (docs / "results").glob("*.md") if f"results/{p.name}" not in pages]
    return bad + extra


def main(argv: list) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    unknown = [a for a in argv if a != "--check"]
    if unknown:
        print(f"results_doc.py: unknown arguments {unknown}; usage: python benchmarks/tools/results_doc.py [--check]",
              file=sys.stderr)
        return 2
    pages = render()
    docs = DOC.parent
    if "--check" in argv:
        bad = stale_pages(pages, docs)
        if bad:
            print(f"not what results_doc.py writes (run it): {', '.join(bad)}")
            return 1
        return 0
    (docs / "results").mkdir(exist_ok=True)
    for p in (docs / "results").glob("*.md"):
        if f"results/{p.name}" not in pages:
            p.unlink()
    for name, text in pages.items():
        (docs / name).write_text(text)
    print(f"wrote {len(pages)} pages under {docs.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
