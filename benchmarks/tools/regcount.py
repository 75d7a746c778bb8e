"""Compile the replay decode kernel for sm_90a on a machine without a GPU and report its
registers and stack (cuobjdump on the cubin), for register-pressure checks without a GPU.
Use the GPU machine's Triton (3.6): other versions differ by tens of registers (GDN's verify
kernel: 168 under 3.9, 221 under 3.6) and in what compiles at all; with a Triton 3.6 wheel
installed under a folder, `PYTHONPATH=<folder> python benchmarks/tools/regcount.py ...`.

    python benchmarks/tools/regcount.py [mamba2|mamba2-rows|mamba2-gluon|mamba2-verify|gdn|kda|gdn-mat|gdn-gluon|kda-gluon|
                                         gdn-verify|kda-verify|gdn-gluon-verify|kda-gluon-verify|mamba2-gluon-verify|mamba2-gluon-lp|
                                         gdn-gluon-lp|kda-gluon-lp] [key=value ...]

(mamba2-verify: `mma=0/1` the row-dot or the tensor-core kernel; mamba2: `inputs=bf16` compiles for bf16 token inputs and outputs, fp32 by default; `keys=fp32`
for fp32 key records, bf16 by default; the Gluon kernels: `values=fp32` for fp32 value records;
the LP Gluon kernels: `lp=1..4` the read format, fp16, bf16, fp8, NVFP4. `REGCOUNT_DUMP=<path>`
writes the TTGIR, PTX and cubin beside: `cuobjdump -sass` of two cubins shows whether a refactor
changed the machine code.)
"""
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.autotuner import Autotuner, Heuristics  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


CUOBJDUMP = os.path.join(os.path.dirname(PTXAS), "cuobjdump")


def report(cubin: bytes, name: str) -> str:
    """Registers and stack from the compiled cubin (cuobjdump's resource usage)."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        open(p, "wb").write(cubin)
        text = subprocess.run([CUOBJDUMP, "--dump-resource-usage", p], capture_output=True, text=True).stdout
    if os.environ.get("REGCOUNT_DEBUG"):
        print(text[-2000:])
    regs = re.findall(r"REG:(\d+)", text)
    stack = re.findall(r"STACK:(\d+)", text)
    return f"{name}: registers {regs[-1] if regs else '?'}, stack {stack[-1] if stack else '?'} bytes"


def jit_function(kernel):
    """The JIT function under a kernel's `@triton.heuristics` / `@triton.autotune` wrappers: the
    offline compile takes the constexprs those would set from the caller (every one given)."""
    while isinstance(kernel, (Heuristics, Autotuner)):
        kernel = kernel.fn
    return kernel


def compile_kernel(fn, signature, constexprs, num_warps, source=ASTSource, maxnreg=0):
    # the JIT specialises 16-byte aligned pointers and integers divisible by 16 (strides, the
    # window, the state's slot paddings, which the Gluon launchers require to be): without
    # these hints the offline compile cannot vectorise the loads
    hinted = ("pad_ckpt", "pad_ld", "pad_w", "pad_k", "window")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if signature[n].startswith("*") or (signature[n] == "i32" and (n.startswith("stride") or n in hinted))}
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps}
    if os.environ.get("REGCOUNT_MAXNREG") or maxnreg:
        opts["maxnreg"] = int(os.environ.get("REGCOUNT_MAXNREG") or maxnreg)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    if os.environ.get("REGCOUNT_DUMP"):
        for ext in ("ttgir", "ptx"):
            open(f"{os.environ['REGCOUNT_DUMP']}.{ext}", "w").write(k.asm[ext])
        open(f"{os.environ['REGCOUNT_DUMP']}.cubin", "wb").write(k.asm["cubin"])
    print(f"shared memory: {k.metadata.shared} bytes")
    return k.asm["cubin"]


def signature(fn, ptr: dict, constexprs: dict, floats=()):
    """Triton signature and constexpr map for `fn`: pointer types from `ptr`, the named
    constexpr values, fp32 for `floats`, i32 for every other scalar."""
    names = fn.arg_names
    sig, const = {}, {}
    for n in names:
        if n in ptr:
            sig[n] = ptr[n]
        elif n in constexprs:
            sig[n] = "constexpr"
            const[(names.index(n),)] = constexprs[n]
        else:
            sig[n] = "fp32" if n in floats else "i32"
    return sig, const


def mamba2(cfg):
    from replayssm.ops.mamba2 import decode as m

    HV, G, V, K, L = 128, 8, 64, 128, 16
    c = dict(BV=64, num_warps=4, recmask=1)
    c.update(cfg)
    fn = jit_function(m._replay_decode_kernel)
    ptr = {"x": "*fp32", "dt": "*fp32", "B": "*fp32", "C": "*fp32", "A": "*fp32", "dt_bias": "*fp32",
           "D": "*fp32", "z": "*fp32", "out": "*fp32", "ckpt": "*fp32", "buf_ld": "*fp32",
           "buf_w": "*bf16", "buf_k": "*" + c.get("keys", "bf16"), "cursor": "*i32", "epoch": "*i64",
           "arrive": "*i32", "slot_ids": "*i64"}
    ptr.update({n: f"*{c.get('inputs', 'fp32')}" for n in ("x", "dt", "B", "C", "z", "out")})
    LB = L + 1
    vals = dict(HV=HV, Hk=G, V=V, K=K, LB=LB, WINDOW=L, BV=c["BV"], BK=K,
                BL=max(16, triton.next_power_of_2(min(L, LB))), NVB=triton.cdiv(V, c["BV"]),
                HAS_D=True, HAS_Z=True, RECMASK=bool(c["recmask"]), EVEN=bool(c.get("even", 1)),
                RC=min(16, c["BV"]), KS=c.get("KS", 1), WS=c["num_warps"] if c.get("warpsum") else 0)
    sig, const = signature(fn, ptr, vals)
    return report(compile_kernel(fn, sig, const, c["num_warps"]), f"mamba2 replay {c}")


def _gluon(kernel, label, ptr, vals, c):
    """Compile a Gluon kernel (ops/*/gluon_decode.py) with its token inputs of dtype `inputs`,
    value records `values` and key records `keys` (bf16 by default), record tiles of `BL`
    positions (16, or 32 for windows above 16),
    the tile read and folded in chunks of 4 * num_warps rows."""
    from triton.experimental.gluon._runtime import GluonASTSource

    ptr = dict(ptr, **{n: "*fp32" for n in ("ckpt", "buf_ld")})
    ptr.update(buf_w="*" + c.get("values", "bf16"), buf_k="*" + c.get("keys", "bf16"), cursor="*i32",
               epoch="*i64", arrive="*i32", slot_ids="*i64")
    vals = dict(vals, BV=c["BV"], BL=c.get("BL", 16), RC=c.get("RC", 4 * c["num_warps"]), NW=c["num_warps"],
                RECMASK=bool(c.get("recmask", 1)))
    kernel = jit_function(kernel)
    sig, const = signature(kernel, ptr, vals, floats=("scale",))
    return report(compile_kernel(kernel, sig, const, c["num_warps"], GluonASTSource), f"{label} {c}")


def mamba2_gluon(cfg):
    """Mamba-2's Gluon kernel (ops/mamba2/gluon_decode.py) at Super's shape (`model=nano`:
    Nano-4B's, one-warp 16-row programs); `kq=1` with the group's key products loaded (`kq`)."""
    from replayssm.ops.mamba2 import gluon_decode as m

    nano = cfg.pop("model", "super") == "nano"
    c = dict(BV=16 if nano else 64, num_warps=1 if nano else 4, kq=0)
    c.update(cfg)
    ptr = {n: f"*{c.get('inputs', 'fp32')}" for n in ("x", "dt", "B", "C", "z", "out")}
    ptr.update({n: "*fp32" for n in ("A", "dt_bias", "D", "kq")})
    vals = dict(HV=96 if nano else 128, Hk=8, V=80 if nano else 64, K=128, LB=17, WINDOW=16, HAS_D=True,
                HAS_Z=True, KQ=bool(int(c.pop("kq"))))
    return _gluon(m._gluon_replay_kernel, f"mamba2 gluon{' nano' if nano else ''}{' kq' if vals['KQ'] else ''}",
                  ptr, vals, c)


def gdn_gluon(cfg):
    """GDN's Gluon kernel (ops/gdn/gluon_decode.py) at Qwen3.5-4B's shape (`HV=`, `HK=` other
    head counts)."""
    from replayssm.ops.gdn import gluon_decode as m

    c = dict(BV=64, num_warps=4)
    c.update(cfg)
    ptr = {n: f"*{c.get('inputs', 'fp32')}" for n in ("q", "k", "v", "a", "b", "o")}
    ptr.update({n: "*fp32" for n in ("A_log", "dt_bias")})
    vals = dict(HV=c.pop("HV", 32), HK=c.pop("HK", 16), V=128, K=128, LBCAP=17, USE_QK_L2NORM=True, IS_KDA=False,
                FOLD_GROUP=1)
    return _gluon(m._gluon_gdn_kernel, "gdn gluon", ptr, vals, c)


def kda_gluon(cfg):
    """KDA through GDN's Gluon kernel (IS_KDA) at Kimi Linear's shape."""
    from replayssm.ops.gdn import gluon_decode as m

    c = dict(BV=64, num_warps=4)
    c.update(cfg)
    ptr = {n: f"*{c.get('inputs', 'fp32')}" for n in ("q", "k", "v", "a", "b", "o")}
    ptr.update({n: "*fp32" for n in ("A_log", "dt_bias")})
    vals = dict(HV=32, HK=32, V=128, K=128, LBCAP=17, USE_QK_L2NORM=True, IS_KDA=True, FOLD_GROUP=int(c.pop("BC", 1)))
    return _gluon(m._gluon_gdn_kernel, "kda gluon", ptr, vals, c)


def mamba2_gluon_verify(cfg):
    """Mamba-2's Gluon verify kernel (ops/mamba2/gluon_verify.py) at Super's shape (`model=nano`:
    Nano-4B's, one-warp programs of 16 rows), `T` drafts (8), bf16 records and token inputs,
    window 16; `kq=1` with the group's key products loaded (`kq`); `mma=1` the tile's products
    on the tensor cores (bf16 queries: one piece); `lp=1`/`2` a pool's fp16/bf16 copy read by rows without a flush;
    `kg=1` (with mma and kq) the flush's keys from global memory, none staged (`KEYS_GLOBAL`)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from replayssm.ops.mamba2 import gluon_verify as m

    nano = cfg.get("model") == "nano"
    HV, G, V, K = (96, 8, 80, 128) if nano else (128, 8, 64, 128)
    c = dict(BV=16 if nano else 64, num_warps=1 if nano else 4, T=8, window=16, kq=0, mma=0)
    c.update(cfg)
    T, L = int(c["T"]), int(c["window"])
    LB = L + T
    tiles, mma = m._tiles(T, L, LB, c["num_warps"]), bool(int(c["mma"]))
    nq = max(8, tiles["TP"])
    ptr = {n: "*bf16" for n in ("x", "dt", "B", "C", "z", "out")}
    ptr.update({n: "*fp32" for n in ("A", "dt_bias", "D", "ckpt", "buf_ld", "kq")})
    ptr.update(buf_w="*bf16", buf_k="*bf16", cursor="*i32", pending="*i32", epoch="*i64", arrive="*i32",
               slot_ids="*i64", num_drafts="*i32", ckpt_lp="*i16" if int(c.get("lp", 0)) else "*fp32")
    vals = dict(tiles, HV=HV, Hk=G, V=V, K=K, LB=LB, WINDOW=L, T=T, BV=c["BV"],
                NW=c["num_warps"], VK=8, VW=8, HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(G),
                HAS_D=True, HAS_Z=True, HAS_N=True, RECMASK=False, KQ=bool(int(c["kq"])), MMA=mma, NQ=nq, QP=1,
                YN=nq if mma else tiles["TP"], KP=1, LPT=int(c.get("lp", 0)), KG=bool(int(c.get("kg", 0))))
    fn = jit_function(m._gluon_verify_kernel)
    sig, const = signature(fn, ptr, vals)
    return report(compile_kernel(fn, sig, const, c["num_warps"], GluonASTSource), f"mamba2 gluon verify {c}")


def mamba2_rows(cfg):
    """Mamba-2's row-block kernel (rows=True), Nano-4B's large-batch table config by default."""
    from replayssm.ops.mamba2 import decode as m

    HV, G, V, K, L = 96, 8, 80, 128, 16
    c = dict(BV=32, num_warps=1, recmask=1)
    c.update(cfg)
    fn = jit_function(m._replay_decode_rows_kernel)
    ptr = {n: "*fp32" for n in ("x", "dt", "B", "C", "A", "dt_bias", "D", "z", "out", "ckpt", "buf_ld")}
    ptr.update(buf_w="*bf16", buf_k="*bf16", cursor="*i32", epoch="*i64", arrive="*i32", slot_ids="*i64")
    LB = L + 1
    vals = dict(HV=HV, Hk=G, V=V, K=K, LB=LB, WINDOW=L, BV=c["BV"], BK=K,
                BL=max(16, triton.next_power_of_2(min(L, LB))), HAS_D=True, HAS_Z=True,
                RECMASK=bool(c["recmask"]), RC=min(16, c["BV"]), WS=c["num_warps"] if c.get("warpsum") else 0)
    sig, const = signature(fn, ptr, vals)
    return report(compile_kernel(fn, sig, const, c["num_warps"]), f"mamba2 rows {c}")


def mamba2_verify(cfg):
    """Mamba-2's verify kernel (ops/mamba2/verify.py) at Super's shape (`model=nano`: Nano-4B's),
    `T` drafts (the mma kernel from `TC_MIN_T`, `mma=0` the row-dot kernel), bf16 records, bf16 token inputs
    (`inputs=fp32`), window 16, the default config for T."""
    from replayssm.ops.mamba2 import verify as m

    HV, G, V, K = (96, 8, 80, 128) if cfg.get("model") == "nano" else (128, 8, 64, 128)
    c = dict(m.verify_config(HV, V, K, G, cfg.get("T", 8)), T=8, window=16)
    c.update(cfg)
    mma = bool(c.pop("mma"))
    kq = bool(c.pop("kq"))
    fn = jit_function(m._replay_verify_mma_kernel if mma else m._replay_verify_kernel)
    tok = "*" + c.get("inputs", "bf16")
    ptr = {n: tok for n in ("x", "dt", "B", "C", "z", "out")}
    ptr.update({n: "*fp32" for n in ("A", "dt_bias", "D", "ckpt", "buf_ld")})
    ptr.update(buf_w="*" + c.get("values", "bf16"), buf_k="*" + c.get("keys", "bf16"), cursor="*i32",
               pending="*i32", epoch="*i64", arrive="*i32", slot_ids="*i64", num_drafts="*i32", kq="*fp32")
    T, L = c["T"], c["window"]
    LB = L + T
    tiles = (dict(TP=max(16, triton.next_power_of_2(T)), BKC=32, WIDEN=False, KQ=kq) if mma else
             dict(TP=triton.next_power_of_2(T), KI=min(32, K)))
    vals = dict(tiles, HV=HV, Hk=G, V=V, K=K, LB=LB, WINDOW=L, T=T,
                BV=c["BV"], BK=K, BL=max(16, triton.next_power_of_2(min(L, LB))), NVB=triton.cdiv(V, c["BV"]),
                HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(G), HAS_D=True, HAS_Z=True,
                HAS_N=True, EVEN=V % c["BV"] == 0)
    if mma:
        del vals["EVEN"]
        n = {"*bf16": 1, "*fp16": 2, "*fp32": 3}
        vals.update(NKB=n[ptr["buf_k"]], NKD=n[ptr["B"]], NQ=n[ptr["C"]], NW=n[ptr["buf_w"]], NX=n[ptr["x"]])
    vals.update({k: v for k, v in c.items() if k.isupper() and k not in ("BV", "T")})
    sig, const = signature(fn, ptr, vals)
    return report(compile_kernel(fn, sig, const, c["num_warps"]), f"mamba2 verify {c}")


# pointer arguments of the GDN/KDA replay kernels (bf16 records)
_DELTA_PTRS = dict({n: "*fp32" for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "o", "ckpt", "buf_ld")},
                   buf_w="*bf16", buf_k="*bf16", cursor="*i32", epoch="*i64", arrive="*i32", slot_ids="*i64")


def gdn(cfg, family="gdn"):
    from replayssm.ops.gdn import decode as m

    HV, HK, V, K, L = (32, 16, 128, 128, 16) if family == "gdn" else (32, 32, 128, 128, 16)
    c = dict(BV=32, num_warps=4, window=L, HPP=1, recmask=1, prefetch=0, BC=8 if family == "gdn" else 0)
    c.update(cfg)
    fn = jit_function(m._replay_decode_kernel)
    ptr = _DELTA_PTRS
    Lb = c["window"] + 1
    vals = dict(HV=HV, HK=HK, V=V, K=K, LBCAP=Lb, LB=max(2, triton.next_power_of_2(min(c["window"], Lb))),
                BV=c["BV"], BK=K, HPP=c["HPP"], IS_KDA=family == "kda", USE_QK_L2NORM=True,
                RECMASK=bool(c["recmask"]), PREFETCH=bool(c["prefetch"]), EXACT_BF16=False,
                RC=min(16, c["BV"]), BC=c.get("BC", 0) or 16, CHUNK=0 < c.get("BC", 0) < 16,
                KS=c.get("KS", 1), FLUSH=int(c.get("flush", 0)), LF=max(16, Lb - 1))
    sig, const = signature(fn, ptr, vals, floats=("scale",))
    return report(compile_kernel(fn, sig, const, c["num_warps"]), f"{family} replay {c}")


def gdn_mat(cfg):
    """GDN's materialising kernel (bf16 records), the large-batch table config by default."""
    from replayssm.ops.gdn import decode as m

    HV, HK, V, K, L = 32, 16, 128, 128, 16
    c = dict(BV=64, num_warps=1, BKT=64, matprec="bf16x2")
    c.update(cfg)
    fn = jit_function(m._replay_decode_mat_kernel)
    ptr = _DELTA_PTRS
    vals = dict(HV=HV, HK=HK, V=V, K=K, LBCAP=L + 1, LR=16, BV=c["BV"], BK=K, BKT=c["BKT"],
                USE_QK_L2NORM=True, EXACT_BF16=False, MP=m._MAT_PRECISIONS[c["matprec"]])
    sig, const = signature(fn, ptr, vals, floats=("scale",))
    return report(compile_kernel(fn, sig, const, c["num_warps"]), f"gdn materialising {c}")


def delta_verify(cfg, family="gdn"):
    """The GDN/KDA verify kernel (ops/gdn/verify.py) at Qwen3.5-4B's (`HV=64` for 122B's) or
    Kimi-Linear's shape, `T` drafts, window 16, bf16 records by default (`rec=fp32`)."""
    from replayssm.ops.gdn import verify as m

    c = dict(BV=32, num_warps=4, KS=8, T=8, HV=32, rec="bf16")
    c.update(cfg)
    HV, HK, V, K, L, T = c["HV"], 16 if family == "gdn" else c["HV"], 128, 128, 16, c["T"]
    fn = jit_function(m._replay_verify_kernel)
    ptr = dict({n: "*fp32" for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "o", "ckpt", "buf_ld")},
               buf_w="*" + c["rec"], buf_k="*" + c["rec"], cursor="*i32", pending="*i32", epoch="*i64",
               arrive="*i32", slot_ids="*i32", num_drafts="*i32")
    vals = dict(T=T, TP=max(2, triton.next_power_of_2(T)), HV=HV, HK=HK, V=V, K=K, LBCAP=L + T,
                LB=max(2, triton.next_power_of_2(max(L, T))), BV=c["BV"], BK=K, KS=c["KS"],
                HVP=triton.next_power_of_2(HV), HKP=triton.next_power_of_2(HK), IS_KDA=family == "kda",
                USE_QK_L2NORM=True, HAS_NDRAFT=True, EXACT_BF16=False)
    sig, const = signature(fn, ptr, vals, floats=("scale",))
    return report(compile_kernel(fn, sig, const, c["num_warps"]), f"{family} verify {c}")


def delta_gluon_verify(cfg, family="gdn"):
    """The GDN/KDA Gluon verify kernel (ops/gdn/gluon_verify.py) at Qwen3.5-4B's shape (`HV=`, `HK=`
    other head counts; Kimi Linear's for KDA), `T` drafts, window 16, bf16 records and token
    inputs (`inputs=fp32`, `rec=fp32`), the default register cap (128 above T = 4; `maxnreg=`);
    `kq=1` (GDN) with the key head's products loaded; `mma=1` (GDN) the tile's products on the
    tensor cores; `lp=1/2` (GDN) a pool's fp16/bf16 copy beside the fp32 checkpoint, `rfl=` the
    rows its flush refolds at a time, `rfm=1` that refold on the tensor cores; `w=` the window;
    `lean=1` (GDN, with `mma`) the drafts' own products on the tensor cores too
    (gluon_verify_host.LEAN)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from replayssm.ops.gdn import gluon_verify as m, gluon_verify_host as h

    c = dict(BV=64, num_warps=4, T=8, HV=32, HK=16 if family == "gdn" else 32, rec="bf16", inputs="bf16")
    c.update(cfg)
    c.setdefault("maxnreg", 128 if c["T"] > 4 else 0)
    ptr = {n: "*" + c["inputs"] for n in ("q", "k", "v", "a", "b", "o")}
    ptr.update({n: "*fp32" for n in ("A_log", "dt_bias", "ckpt", "buf_ld")}, buf_w="*" + c["rec"],
               buf_k="*" + c["rec"], cursor="*i32", pending="*i32", epoch="*i64", arrive="*i32",
               slot_ids="*i64", num_drafts="*i32", kq="*fp32", ckpt_lp="*i16", buf_v="*" + c["rec"],
               buf_beta="*fp32")
    rb = 4 if c["rec"] == "fp32" else 2
    w = int(c.get("w", 16))
    vals = h.gluon_verify_constexprs(c["T"], c["HV"], c["HK"], 128, 128, w, w + c["T"], c["BV"], c["num_warps"],
                                     w_bytes=rb, k_bytes=rb, family=family, kq=bool(int(c.get("kq", 0))),
                                     mma=bool(int(c.get("mma", 0))), x_pieces=3 if c["inputs"] == "fp32" else 1,
                                     k_pieces=3 if c["rec"] == "fp32" else 1, lp_code=int(c.get("lp", 0)),
                                     refold_rows=int(c.get("rfl", 0)), refold_mma=bool(int(c.get("rfm", 0))),
                                     lean=bool(int(c.get("lean", 0))))
    kernel = jit_function(m._gluon_verify_kernel)
    sig, const = signature(kernel, ptr, vals, floats=("scale",))
    return report(compile_kernel(kernel, sig, const, c["num_warps"], GluonASTSource, c["maxnreg"]),
                  f"{family} gluon verify {c}")


_LP_PTR = {1: ("*i16", "*fp32"), 2: ("*i16", "*fp32"), 3: ("*u8", "*fp32"), 4: ("*i32", "*u8")}


def _lp_ptr(c):
    """The LP checkpoint's parts as the Gluon kernels take them (`lp=1..4`: fp16, bf16, fp8,
    NVFP4; utils/gluon_lowp.lp_gluon_views)."""
    data, sc = _LP_PTR[c["lp"]]
    return dict(lp_data=data, lp_scale=sc, lp_tscale="*fp32")


def mamba2_gluon_lp(cfg):
    """Mamba-2's low-precision Gluon kernel (ops/mamba2/gluon_lowp.py) at Super's shape (`HV=`,
    `V=` others), `lp=` the read format's code (fp16 by default), `kq=1` with the group's key
    products loaded (`gluon_kq`), `rmma=1` the rows summed on the tensor cores (`READ_MMA`)."""
    from replayssm.ops.mamba2 import gluon_lowp as m

    c = dict(BV=64, num_warps=4, lp=1)
    c.update(cfg)
    ptr = {n: f"*{c.get('inputs', 'fp32')}" for n in ("x", "dt", "B", "C", "z", "out")}
    ptr.update({n: "*fp32" for n in ("A", "dt_bias", "D", "kq")}, **_lp_ptr(c))
    vals = dict(HV=c.pop("HV", 128), Hk=8, V=c.pop("V", 64), K=128, LB=17, WINDOW=16, HAS_D=True, HAS_Z=True,
                LP=c["lp"], KQ=bool(c.pop("kq", 0)), RMMA=bool(c.pop("rmma", 0)))
    return _gluon(m._gluon_lp_kernel, "mamba2 gluon lp", ptr, vals, c)


def mamba2_gluon_lp_heads(cfg):
    """Mamba-2's low-precision Gluon kernel over `heads=` heads per program
    (ops/mamba2/gluon_lowp_heads.py), as `mamba2_gluon_lp` (`lp=`, `kq=1`, `rmma=1`)."""
    from replayssm.ops.mamba2 import gluon_lowp_heads as m

    c = dict(BV=64, num_warps=4, lp=1, heads=2)
    c.update(cfg)
    ptr = {n: f"*{c.get('inputs', 'fp32')}" for n in ("x", "dt", "B", "C", "z", "out")}
    ptr.update({n: "*fp32" for n in ("A", "dt_bias", "D", "kq")}, **_lp_ptr(c))
    vals = dict(HV=c.pop("HV", 128), Hk=8, V=c.pop("V", 64), K=128, LB=17, WINDOW=16, HAS_D=True, HAS_Z=True,
                LP=c["lp"], KQ=bool(c.pop("kq", 0)), NH=int(c.pop("heads")), RMMA=bool(c.pop("rmma", 0)))
    return _gluon(m._gluon_lp_heads_kernel, "mamba2 gluon lp heads", ptr, vals, c)


def delta_gluon_lp(cfg, family="gdn"):
    """GDN's (KDA's) low-precision Gluon kernel (ops/gdn/gluon_lowp.py) at Qwen3.5-4B's (Kimi
    Linear's) shape, fp16 reads beside an fp32 checkpoint by default (`raw=1`: the raw v, beta
    records; `kq=1`: the record products loaded, `gluon_kq`; `rmma=1`: the rows summed on the
    tensor cores, `READ_MMA`)."""
    from replayssm.ops.gdn import gluon_lowp as m

    c = dict(BV=32, num_warps=2, lp=1, raw=1)
    c.update(cfg)
    ptr = {n: f"*{c.get('inputs', 'fp32')}" for n in ("q", "k", "v", "a", "b", "o")}
    ptr.update({n: "*fp32" for n in ("A_log", "dt_bias", "buf_v", "buf_beta", "kq")}, **_lp_ptr(c))
    vals = dict(HV=32, HK=16 if family == "gdn" else 32, V=128, K=128, LBCAP=17, WINDOW=16, LP=c["lp"],
                USE_QK_L2NORM=True, IS_KDA=family == "kda", RAW=bool(c["raw"]), KQ=bool(c.pop("kq", 0)),
                RMMA=bool(c.pop("rmma", 0)))
    return _gluon(m._gluon_lp_kernel, f"{family} gluon lp", ptr, vals, c)


if __name__ == "__main__":
    fam = sys.argv[1] if len(sys.argv) > 1 else "mamba2"
    cfg = {}
    for kv in sys.argv[2:]:
        k, v = kv.split("=")
        cfg[k] = v if not v.lstrip("-").isdigit() else int(v)
    print({"mamba2": mamba2, "gdn": gdn, "kda": lambda c: gdn(c, "kda"), "gdn-mat": gdn_mat,
           "mamba2-rows": mamba2_rows, "mamba2-gluon": mamba2_gluon, "mamba2-verify": mamba2_verify,
           "mamba2-gluon-verify": mamba2_gluon_verify,
           "gdn-gluon": gdn_gluon, "kda-gluon": kda_gluon, "gdn-verify": delta_verify,
           "kda-verify": lambda c: delta_verify(c, "kda"), "mamba2-gluon-lp": mamba2_gluon_lp,
           "mamba2-gluon-lp-heads": mamba2_gluon_lp_heads,
           "gdn-gluon-lp": delta_gluon_lp, "kda-gluon-lp": lambda c: delta_gluon_lp(c, "kda"),
           "gdn-gluon-verify": delta_gluon_verify,
           "kda-gluon-verify": lambda c: delta_gluon_verify(c, "kda")}[fam](cfg))
