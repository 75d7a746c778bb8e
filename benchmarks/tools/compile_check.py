"""Compile, for sm_90a and without a GPU, every kernel launch a set of tests makes: compile
errors, registers and stack of the kernels as the tests launch them.

    python benchmarks/tools/compile_check.py [--triton DIR] tests/test_verify_mamba2.py [pytest args]

The tests run under the CPU interpreter, which records each distinct launch (kernel, argument
types, constexprs, warps, stages); a second process, without the interpreter, compiles each
recorded launch with Triton's bundled ptxas. `--triton DIR`: compile with the Triton installed
under DIR (e.g. the GPU machine's 3.6: `pip install --no-deps --target DIR triton==3.6.0`),
recording still with this environment's, since versions differ by tens of registers and in what
compiles at all. Constexprs derived from the interpreter itself (e.g. GDN's EXACT_BF16) keep
their interpreter values. Exit status 1 if any launch fails to compile. `COMPILE_CHECK_DUMP=<dir>`
writes each launch's cubin there (`NNN_<kernel>.cubin`, in launch order): `cuobjdump -sass` of
two such folders shows whether a change of the kernels' source changed their machine code.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _record(pytest_args, path):
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    import torch
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    names = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16",
             torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
    seen, records = set(), []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        if fn.__module__.startswith("replayssm"):
            jf = JITFunction(fn)
            given = dict(zip(jf.arg_names, args), **{k: v for k, v in kwargs.items() if k in jf.arg_names})
            sig, const = {}, []
            for i, p in enumerate(jf.params):
                v = given.get(p.name, None if p.default is inspect.Parameter.empty else p.default)
                if p.is_constexpr or v is None:
                    sig[p.name] = "constexpr"
                    const.append([i, v])
                elif isinstance(v, torch.Tensor):
                    sig[p.name] = "*" + names[v.dtype]
                elif isinstance(v, bool):
                    sig[p.name] = "i1"
                elif isinstance(v, int):
                    sig[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
                else:
                    sig[p.name] = "fp32"
            nw, ns = kwargs.get("num_warps", 4), kwargs.get("num_stages", 3)
            key = json.dumps([fn.__module__, fn.__name__, sig, const, nw, ns], default=str)
            if key not in seen:
                seen.add(key)
                records.append(dict(module=fn.__module__, name=fn.__name__, sig=sig, const=const, nw=nw, ns=ns))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    rc = pytest.main(list(pytest_args) + ["-q", "-p", "no:cacheprovider"])
    with open(path, "w") as f:
        json.dump(records, f, default=str)
    return rc


def _compile(path) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, HERE)
    from regcount import jit_function, report

    failed = 0
    print(f"triton {triton.__version__} ({os.path.dirname(triton.__file__)})")
    for n_done, r in enumerate(json.load(open(path))):
        consts = {(i,): v for i, v in r["const"]}
        label = f"{r['module']}.{r['name']} warps={r['nw']} " + " ".join(
            f"{n}={consts[(i,)]}" for i, n in enumerate(r["sig"]) if (i,) in consts and n.isupper())
        try:
            fn = jit_function(getattr(importlib.import_module(r["module"]), r["name"]))
            k = triton.compile(ASTSource(fn=fn, signature=r["sig"], constexprs=consts),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": r["nw"], "num_stages": r.get("ns", 3)})
            print("ok  ", report(k.asm["cubin"], label))
            if os.environ.get("COMPILE_CHECK_DUMP"):
                with open(os.path.join(os.environ["COMPILE_CHECK_DUMP"], f"{n_done:03d}_{r['name']}.cubin"), "wb") as f:
                    f.write(k.asm["cubin"])
        except Exception as e:  # report every launch, then fail
            failed += 1
            print("FAIL", label, type(e).__name__, str(e)[:400].replace("\n", " | "))
    print(f"{failed} of {len(json.load(open(path)))} launches failed to compile for sm_90a")
    return 1 if failed else 0


def main(argv) -> int:
    if argv[:1] == ["--compile"]:
        return _compile(argv[1])
    triton_dir = None
    if argv[:1] == ["--triton"]:
        triton_dir, argv = os.path.abspath(argv[1]), argv[2:]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "launches.json")
        env = dict(os.environ, TRITON_INTERPRET="1")
        rc = subprocess.run([sys.executable, __file__, "--record", path, *argv], env=env).returncode
        if rc not in (0, 5) or not os.path.exists(path):
            print(f"the tests failed (pytest exit {rc}); launches not compiled")
            return 1
        env.pop("TRITON_INTERPRET")
        if triton_dir:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [triton_dir, env.get("PYTHONPATH")]))
        return subprocess.run([sys.executable, __file__, "--compile", path], env=env).returncode


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        sys.exit(_record(sys.argv[3:], sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
