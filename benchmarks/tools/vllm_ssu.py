"""The most-used serving engine's Mamba-2 decode kernel beside ours, in one run: vLLM's
`selective_state_update` (its Triton kernel with the launch configs vLLM ships for the H200)
against the project's conventional kernel and the slot pool's step (the eager step at small
batches, the window beyond), the same token inputs, fp32 state, window 16, whole windows
replayed from CUDA graphs as `replayssm bench decode` times them.

vLLM is not a dependency: the kernel's module is loaded from an unpacked vLLM source tree
(`--vllm-src DIR`, the folder holding `vllm/`; e.g. the wheel unzipped), with vLLM's package
imports that the module only touches for logging, config lookup and device queries stood in by
small modules (`import vllm` would need its whole start-up). With vLLM installed, `--vllm-src`
may be left out.

    python benchmarks/tools/vllm_ssu.py --vllm-src /tmp/vsrc --out vllm_ssu.json
"""
from __future__ import annotations

import argparse

import torch

from replayssm import shapes
from replayssm.bench.common import graph_time_us, header, positive_ints, write_results
from replayssm.bench.decode import Case
from replayssm.bench.peers import vllm_stand_ins

_SSU = "vllm/model_executor/layers/mamba/ops/mamba_ssm.py"
_HELPERS = "vllm/model_executor/layers/mamba/ops/triton_helpers.py"


def load_ssu(src: str | None):
    """vLLM's `selective_state_update`: from an installed vLLM when `src` is None, else from
    the source tree at `src` with stand-ins for the package modules it imports."""
    if src is None:
        from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update
        return selective_state_update
    vllm_stand_ins.install()
    vllm_stand_ins.load(src, _HELPERS)
    return vllm_stand_ins.load(src, _SSU).selective_state_update


def _vllm_window(ssu, case: Case):
    """`case.window` steps of vLLM's kernel on the case's conventional state and inputs, called
    as vLLM's Mamba-2 mixer calls it (per-head dt, A, D and dt_bias broadcast over the head's
    rows, softplus in the kernel, slot-indexed state). Its null block (padding) is given as -1,
    as our padding rows are: the case has none, and vLLM's default, block 0, is one of its slots."""
    p = case.params
    HV, V, K = case.HV, case.V, case.K
    A = p.A[:, None, None].expand(HV, V, K)
    dt_bias = p.dt_bias[:, None].expand(HV, V)
    D = p.D[:, None].expand(HV, V)
    slots = case.slot_ids.to(torch.int32)

    def run():
        for i, s in enumerate(case.steps):
            ssu(case.state, s["x"], s["dt"][:, :, None].expand(-1, HV, V), A, s["B"], s["C"], D, dt_bias,
                z=s.get("z"), dt_softplus=True, state_batch_indices=slots, null_block_id=-1, out=case.out[i])
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-src", default=None, help="folder holding vllm/ (unpacked source); default: import vllm")
    ap.add_argument("--shapes", default="nemotron3-super,nemotron3-nano-30b,nemotron3-nano-4b")
    ap.add_argument("--batches", type=positive_ints, default=[1, 2, 4, 8, 64, 256])
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="timings of each scheme, interleaved; the median is kept")
    ap.add_argument("--out", default="vllm_ssu.json")
    args = ap.parse_args(argv)
    ssu = load_ssu(args.vllm_src)
    doc = header("vllm_ssu")
    rows = []
    for name in args.shapes.split(","):
        fam = shapes.parse(name).family
        if fam != "mamba2":
            raise SystemExit(f"{name}: vLLM's selective_state_update is Mamba-2's kernel")
        for batch in args.batches:
            case = Case(name, batch, args.window)
            ref = case.state.clone()
            # first the same window from the same state through both kernels: their states and
            # outputs must agree (the rows record how closely)
            _vllm_window(ssu, case)()
            y_vllm, s_vllm = case.out.clone(), case.state.clone()
            case.state.copy_(ref)
            case.conventional_window()
            err = float((case.state - s_vllm).norm() / s_vllm.norm())
            yerr = float((case.out.float() - y_vllm.float()).norm() / y_vllm.float().norm())
            fns = {"vllm": _vllm_window(ssu, case), "conventional": case.conventional_window,
                   "replay": case.replay_window}
            times = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    times[k].append(graph_time_us(fn, reps=args.reps) / args.window)
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            path = "eager" if case.eager() else "windowed"
            for k in fns:
                rows.append(dict(shape=name, family=fam, batch=batch, window=args.window,
                                 scheme={"vllm": "vllm_conventional"}.get(k, k),
                                 path=path if k == "replay" else None, us_per_step=med[k],
                                 us_rounds=times[k], ratio_vs_vllm=med["vllm"] / med[k],
                                 state_rel_diff_vs_vllm=err, out_rel_diff_vs_vllm=yerr))
            print(f"{name:20} B={batch:4d}  vLLM {med['vllm']:8.2f} us  conventional {med['conventional']:8.2f} us  "
                  f"replay ({path}) {med['replay']:8.2f} us  replay/vLLM {med['vllm'] / med['replay']:.2f}x  "
                  f"state diff {err:.1e} out diff {yerr:.1e}", flush=True)
            del case
            torch.cuda.empty_cache()
    doc["rows"] = rows
    write_results(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
