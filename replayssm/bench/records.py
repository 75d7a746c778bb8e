"""Record precision study: the effect of bf16 records (values/`u` and keys) against fp32
records over a long decode, measured against the float64 conventional recurrence.

For each family at a real shape, `steps` decode steps of the same random inputs run through
the conventional fp32 kernel, the ReplaySSM kernel with fp32 records and with bf16 records,
and the float64 reference (on the GPU). `--inputs-on bf16` draws inputs that are bf16 values
(a bf16 model's activations): Mamba-2's records (`x`, `B`) are then exact in bf16. Reported
per bin of steps: the mean relative error of the outputs, and at the end the relative error of
the state. The replay kernels run with the
window given (never the eager step, which keeps no records); `--bf16-configs` adds bf16-record
runs with other launch configs (e.g. GDN's `{"matprec": "bf16"}`).
"""
from __future__ import annotations

import argparse
import json

import torch

from .. import traffic
from ..testing import make_inputs, make_params
from .common import header, write_results
from .common import call_accepting, family_ops

SHAPES = {"mamba2": "nemotron3-nano-4b", "gdn": "qwen3.5-4b", "kda": "kimi-linear-48b"}


def run(family, steps, batch, heads, window, bins, seed=0, bf16_configs=(), inputs_on=None):
    shape = SHAPES[family]
    _, HV_full, Hk_full, V, K = traffic.MODEL_SHAPES[shape]
    HV = heads or HV_full
    Hk = max(1, HV * Hk_full // HV_full)
    dev = "cuda"
    p64 = make_params(family, HV, K, dtype=torch.float64, device=dev, seed=seed)
    p32 = make_params(family, HV, K, dtype=torch.float32, device=dev, seed=seed)
    ops = family_ops(family)
    N, Lb = batch, window + 1
    slots = torch.arange(N, device=dev)
    S64 = torch.zeros(N, HV, V, K, dtype=torch.float64, device=dev)
    conv = torch.zeros(N, HV, V, K, device=dev)
    schemes, configs = {}, {}
    runs = [(torch.float32, None), (torch.bfloat16, None)] + [(torch.bfloat16, c) for c in bf16_configs if c]
    for rd, cfg in runs:
        ld_shape = (N, Lb, HV, K) if family == "kda" else (N, Lb, HV)
        name = str(rd).replace("torch.", "") + ("" if cfg is None else " " + json.dumps(cfg, sort_keys=True))
        configs[name] = cfg
        schemes[name] = dict(
            ckpt=torch.zeros(N, HV, V, K, device=dev), buf_ld=torch.zeros(ld_shape, device=dev),
            buf_w=torch.zeros(N, Lb, HV, V, dtype=rd, device=dev), buf_k=torch.zeros(N, Lb, Hk, K, dtype=rd, device=dev),
            cursor=torch.zeros(N, dtype=torch.int32, device=dev), epoch=torch.zeros(N, dtype=torch.int64, device=dev),
            arrive=torch.zeros(N, dtype=torch.int32, device=dev))
    names = ["conventional_fp32"] + [f"replay_{k}_records" for k in schemes]
    acc = {n: [0.0] * bins for n in names}
    per_bin = steps // bins
    g = torch.Generator(device=dev).manual_seed(seed)
    for t in range(steps):
        inp64 = {k: v if inputs_on is None else v.to(inputs_on).double()
                 for k, v in make_inputs(p64, N, V, K, Hk, dtype=torch.float64, device=dev,
                                         generator=_CpuGen(g)).items()}
        y64, S64 = p64.step(S64, **inp64)
        inp = {k: v.float() for k, v in inp64.items()}
        if family == "mamba2":
            common = dict(inp, A=p32.A, dt_bias=p32.dt_bias, D=p32.D, z=inp.get("z"))
        else:
            common = dict(inp, A_log=p32.A_log, dt_bias=p32.dt_bias, scale=None, use_qk_l2norm=True)
        outs = {"conventional_fp32": call_accepting(ops.conventional_decode,
                                                    dict(common, state=conv, slot_ids=slots, validate=False))}
        for k, st in schemes.items():
            outs[f"replay_{k}_records"] = call_accepting(ops.replay_decode,
                                                         dict(common, **st, slot_ids=slots, window=window,
                                                              config=configs[k], validate=False))
        den = y64.norm().item()
        for n, y in outs.items():
            acc[n][min(t // per_bin, bins - 1)] += (y.double() - y64).norm().item() / den / per_bin
    return {"shape": shape, "family": family, "heads": HV, "batch": batch, "window": window, "steps": steps,
            "inputs_on": None if inputs_on is None else str(inputs_on).replace("torch.", ""),
            "bin_steps": per_bin, "output_rel_err_by_bin": acc,
            "final_state_rel_err": {"conventional_fp32": ((conv.double() - S64).norm() / S64.norm()).item()}}


class _CpuGen:
    """make_inputs draws on the CPU; a per-step CPU generator seeded from a device one."""

    def __new__(cls, g):
        return torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), device=g.device, generator=g)))


def main(argv=None):
    # an explicit prog: the default, sys.argv[0], reads "cli.py" when run through `replayssm bench`
    ap = argparse.ArgumentParser(prog="replayssm bench records", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="mamba2,gdn,kda")
    ap.add_argument("--steps", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8, help="value heads (real head dims); 0: the model's")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--bins", type=int, default=8)
    ap.add_argument("--bf16-configs", default="[]",
                    help="JSON list of launch configs for further bf16-record runs (as replay_decode's config=)")
    ap.add_argument("--inputs-on", default="", choices=["", "bf16"],
                    help="round every token input to these values (a bf16 model's activations; "
                         "passed to the kernels as fp32, the reference sees the same values)")
    ap.add_argument("--out", default="benchmarks/results/records_h200.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        # checked here: header() and the runs would fail deep in torch with a traceback
        raise SystemExit(f"{ap.prog}: error: the records study needs a CUDA device "
                         "(torch.cuda.is_available() is False on this machine)")
    doc = header("records")
    doc["rows"] = []
    for fam in args.families.split(","):
        r = run(fam, args.steps, args.batch, args.heads, args.window, args.bins,
                bf16_configs=json.loads(args.bf16_configs),
                inputs_on=torch.bfloat16 if args.inputs_on == "bf16" else None)
        doc["rows"].append(r)
        print(f"{fam}: mean output rel. error per {r['bin_steps']}-step bin")
        for n, v in r["output_rel_err_by_bin"].items():
            print(f"  {n:44} " + " ".join(f"{x:.1e}" for x in v), flush=True)
    write_results(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
