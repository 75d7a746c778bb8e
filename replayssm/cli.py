"""The `replayssm` command line: `demo`, `traffic`, `bench`, `study`, `tune`, `train`."""
from __future__ import annotations

import argparse
import sys

import torch

from . import formats, traffic
from .argtypes import positive_int as _positive_int
from .testing import make_inputs, make_params

EPILOG = """\
The test suite is not a sub-command: `./run.sh test [pytest args]` runs it (pytest), e.g.
`./run.sh test -q tests/test_traffic.py`. `replayssm <command> --help` lists a command's options."""


def _fail(msg: str):
    """A user error found after parsing (the machine, the library's checks): one line on stderr
    and exit status 1, where argparse's own errors exit with 2."""
    raise SystemExit(f"replayssm: error: {msg}")


def _device(text: str) -> torch.device:
    # The demo's tensors and kernels exist for the CPU and CUDA only; torch accepts more device
    # strings ("meta", "mps", ...) that would fail later with a traceback.
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return dev


def _resolve_device(dev) -> torch.device:
    """`--device`, or CUDA where present; a CUDA device this machine lacks is a user error
    (torch would fail deep inside with "Torch not compiled with CUDA enabled")."""
    if dev is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            _fail(f"--device {dev}: CUDA is not available on this machine (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            _fail(f"--device {dev}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


DEMO_SHAPES = {"mamba2": "nemotron3-super", "gdn": "qwen3.5-4b", "kda": "kimi-linear-48b"}


def _demo(args) -> int:
    device = _resolve_device(args.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # small per-step tensors: intra-op threads only contend, and on a loaded 2-core machine
        # badly (the table took 45 s with 2 threads, 2.5 s with one)
        torch.set_num_threads(1)
    try:
        return _demo_run(args, device)
    finally:
        torch.set_num_threads(threads)


def _demo_run(args, device) -> int:
    families = list(DEMO_SHAPES) if args.family == "all" else [args.family]
    print(f"ReplaySSM demo on {device}: {args.steps} decode steps per family, window {args.window}, "
          f"{args.heads} heads of each model's real head shape, fp32 state\n")
    header = (f"{'family':7} {'shape':16} {'HVxV,K':>12} {'max rel diff':>13} {'conv err':>9} "
              f"{'replay err':>10} {'conv B/tok':>11} {'replay B/tok':>12} {'ratio':>6} {'L*':>4}")
    print(header)
    print("-" * len(header))
    for fam in families:
        try:
            print(_demo_row(args, device, fam))
        except ValueError as e:
            # The library checks its arguments (SlotPool's heads, window, ...) with ValueErrors
            # that name the value: from the command line they are user errors, not crashes.
            _fail(f"demo, {fam} ({DEMO_SHAPES[fam]}) with --heads {args.heads} --window {args.window}: {e}")
    print("\nmax rel diff: largest per-step ||y_replay - y_conv|| / ||y_conv|| (both fp32);")
    # The mean, not the largest: one step's error is a single small vector's rounding, so the
    # largest of a few hundred is noise (either scheme's can be 1.5x the other's at some step)
    print("errors: mean per-step relative error against the float64 conventional recurrence;")
    print("B/tok: state bytes moved per token (records: bf16 value/key, fp32 decay; keys once per key head);")
    print("L*: the traffic model's best window sqrt(2 (M_S/r - 1)) for standard decoding (SPEC section 6).")
    if args.models:
        from .integrations.hf.demo import run_demo

        print()
        run_demo(args.new_tokens, families=families, device=device)
    return 0


def _demo_row(args, device, fam) -> str:
    """Decode `args.steps` steps of one family both ways; its row of the demo's table."""
    from .pool import SlotPool

    name = DEMO_SHAPES[fam]
    _, HV_full, HK_full, V, K = traffic.MODEL_SHAPES[name]
    HV = args.heads
    Hk = max(1, HV * HK_full // HV_full)
    params = make_params(fam, HV, K, seed=1)
    pool = SlotPool(params, 1, V, K, Hk, window=args.window, dtype=torch.float32, device=device)
    p32 = pool.params
    S32 = torch.zeros(1, HV, V, K, device=device)
    S64 = torch.zeros(1, HV, V, K, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    slot = torch.zeros(1, dtype=torch.int64, device=device)
    worst = conv_err = rep_err = 0.0      # the errors: sums over the steps, shown as means
    conv_bytes = rep_bytes = 0.0
    for _ in range(args.steps):
        inp = make_inputs(params, 1, V, K, Hk, generator=g)
        y64, S64 = params.step(S64, **inp)
        inp32 = {k: v.float().to(device) for k, v in inp.items()}
        yc, S32 = p32.step(S32, **inp32)
        h = int(pool.cursor[0])
        yr = pool.decode(slot, **inp32)
        rep_bytes += traffic.decode_step_bytes(h, args.window, HV, V, K, Hk,
                                               decay_len=K if fam == "kda" else 1)
        conv_bytes += 2 * traffic.state_bytes(V, K) * HV
        den = y64.norm().item() or 1.0
        worst = max(worst, (yr.double().cpu() - yc.double().cpu()).norm().item() / (yc.norm().item() or 1.0))
        conv_err += (yc.double().cpu() - y64).norm().item() / den
        rep_err += (yr.double().cpu() - y64).norm().item() / den
    r = traffic.record_bytes(V, K, decay_len=K if fam == "kda" else 1)
    lstar = traffic.l_star(V, K, r=r)
    return (f"{fam:7} {name:16} {f'{HV}x{V},{K}':>12} {worst:13.2e} {conv_err / args.steps:9.1e} {rep_err / args.steps:10.1e} "
            f"{conv_bytes / args.steps:11.0f} {rep_bytes / args.steps:12.0f} "
            f"{conv_bytes / rep_bytes:6.2f} {lstar:4.0f}")


def _traffic(args) -> int:
    print(f"{'shape':20} {'family':7} {'dv':>4} {'dk':>4} {'M_S/r':>6} {'L* (T=1)':>9} "
          f"{'L* (T=4,A=3.5)':>15} {'M_conv/M_replay @L=16':>22}")
    for name, (fam, HV, Hk, dv, dk) in traffic.MODEL_SHAPES.items():
        r = traffic.record_bytes(dv, dk, decay_len=dk if fam == "kda" else 1)
        ms = traffic.state_bytes(dv, dk, args.format)
        print(f"{name:20} {fam:7} {dv:4d} {dk:4d} {ms / r:6.1f} {traffic.l_star(dv, dk, args.format, r):9.1f} "
              f"{traffic.l_star(dv, dk, args.format, r, T=4, A=3.5):15.1f} "
              f"{traffic.m_conv(16, dv, dk, args.format) / traffic.m_replay(16, dv, dk, args.format, r):22.2f}")
    return 0


BENCHES = {"decode": "replayssm.bench.decode", "records": "replayssm.bench.records",
           "verify": "replayssm.bench.verify", "model": "replayssm.bench.model",
           "precision": "replayssm.bench.precision", "vllm": "replayssm.bench.vllm_serving"}


def _bench(args) -> int:
    import importlib

    if args.which is None:
        # `which` is optional only so that this message, not argparse's "required: which, rest"
        args.parser.error(f"choose a benchmark: {', '.join(sorted(BENCHES))}")
    importlib.import_module(BENCHES[args.which]).main(args.rest)
    return 0


# precision-model: its own study, not a `--level` of the layer study: the two share the designs
# but no other option (shapes, layers, engines against models, prefill, weights' dtype)
STUDIES = {"precision": "replayssm.bench.precision_study",
           "precision-model": "replayssm.bench.precision_model_study"}


def _study(args) -> int:
    import importlib

    if args.which is None:
        args.parser.error(f"choose a study: {', '.join(sorted(STUDIES))}")
    importlib.import_module(STUDIES[args.which]).main(args.rest)
    return 0


def _tune(args) -> int:
    from .bench import tune

    tune.main(args.rest)
    return 0


def _train(args, argv) -> int:
    from .train import command

    # the card records the command as typed (main's argv, which is not sys.argv when called)
    return command.run(args, argv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="replayssm", description=__doc__, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="decode each family conventionally and with ReplaySSM, side by side",
                       description="Decode each family conventionally and with ReplaySSM, side by side.")
    d.add_argument("--steps", type=_positive_int, default=300,
                   help="decode steps per family (default %(default)s)")
    d.add_argument("--window", type=_positive_int, default=16,
                   help="ReplaySSM window L: steps buffered between flushes (default %(default)s)")
    d.add_argument("--heads", type=_positive_int, default=4,
                   help="value heads per layer (real head dims; default %(default)s)")
    d.add_argument("--family", default="all", choices=["all", "mamba2", "gdn", "kda"],
                   help="the family to decode (and whose tiny model generates; default %(default)s)")
    d.add_argument("--device", type=_device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda where available, else cpu)")
    d.add_argument("--new-tokens", type=_positive_int, default=64,
                   help="tokens each tiny hybrid model generates per run (default %(default)s)")
    d.add_argument("--no-models", dest="models", action="store_false",
                   help="skip the tiny hybrid models (generation with transformers)")
    d.set_defaults(func=_demo)
    t = sub.add_parser("traffic", help="the traffic model (SPEC section 6) for the model shapes",
                       description="The traffic model (SPEC section 6) for the model shapes.")
    t.add_argument("--format", default="fp32", choices=formats.FORMATS,
                   help="the state's storage format (default %(default)s)")
    t.set_defaults(func=_traffic)
    b = sub.add_parser("bench", help="GPU benchmarks: decode (kernel sweep), verify (speculative verification), model (whole transformers models), records (record precision study), precision (low-precision checkpoint reads) or vllm (serving throughput with the vLLM plugin)",
                       description="GPU benchmarks. Arguments after the benchmark's name go to it: "
                                   "`replayssm bench decode --help`.")
    b.add_argument("which", nargs="?", choices=sorted(BENCHES), metavar="{" + ",".join(sorted(BENCHES)) + "}",
                   help="decode: the kernel sweep; verify: speculative verification against the snapshot "
                        "scheme; model: whole transformers models; records: the record precision study; "
                        "precision: separate state precisions, non-flush reads per format; vllm: serving "
                        "throughput with the vLLM plugin against stock vLLM")
    b.add_argument("rest", nargs=argparse.REMAINDER, metavar="...",
                   help="the benchmark's own arguments")
    b.set_defaults(func=_bench, parser=b)
    st = sub.add_parser("study", help="error studies: precision (low-precision state designs against float64, "
                                      "layer level) and precision-model (a whole model's next-token KL)",
                        description="Error studies. Arguments after the study's name go to it: "
                                    "`replayssm study precision --help`.")
    st.add_argument("which", nargs="?", choices=sorted(STUDIES), metavar="{" + ",".join(sorted(STUDIES)) + "}",
                    help="precision: layer-level output error of each low-precision state design; "
                         "precision-model: a whole model's next-token KL divergence against the fp32 state")
    st.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the study's own arguments")
    st.set_defaults(func=_study, parser=st)
    tu = sub.add_parser("tune", help="GPU: time launch configs for one shape and write table entries to keep",
                        description="Arguments go to the tuner: `replayssm tune --help` after `tune`.",
                        add_help=False)
    tu.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the tuner's arguments")
    tu.set_defaults(func=_tune)
    tr = sub.add_parser("train", help="train a small byte-level hybrid model of one family on the Python stdlib's sources",
                        description="Train a small byte-level hybrid model (NemotronH, Qwen3.5 or Kimi Linear classes) "
                                    "on the running interpreter's standard library sources; writes safetensors, "
                                    "config, tokenizer, a model card and a loss plot into --out. GPU; CPU too, slowly.")
    from .train.command import add_arguments as _train_arguments
    _train_arguments(tr)
    tr.set_defaults(func=lambda a: _train(a, argv))
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["test"]:
        # `./run.sh test` is the documented way in; typed here it deserves the way, not "invalid choice"
        ap.error("`test` is not a replayssm command: `./run.sh test [pytest args]` runs the test suite")
    if argv[:1] == ["tune"]:
        # every argument belongs to the tuner (argparse's REMAINDER drops a leading option)
        return _tune(argparse.Namespace(rest=argv[1:]))
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
