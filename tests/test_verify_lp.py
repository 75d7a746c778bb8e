"""The verify kernels of pools with two checkpoints (ops/<family>/verify_lp.py; SPEC section 5,
Algorithm 3) through the slot pool, on the Triton backend (interpreted on the CPU) against the
same pool on the reference, which is the oracle: an fp32 or stochastically rounded HP
checkpoint beside an fp16, bf16, fp8-e4m3 or NVFP4 copy, rows at staggered cursors (early
flushes and rows that read the copy in one launch), per-row draft counts, a padding row,
poisoned outputs and poisoned records past the cursor; then commit and decode.

What is exact and what is not, and why:
* the copy is `formats.encode(HP, "nearest")` of the kernel's fp32 fold bit for bit, and a
  stochastically rounded HP is `formats.encode(S, hp, "stochastic", seed, stream)` of that
  fold bit for bit (checked where both pools fold the same fp32 values: states on the HP
  format's grid);
* with an fp32 HP the fold does not depend on the LP format (bit-identical across formats), and
  Mamba-2's is the one-checkpoint verify kernel's arithmetic (bit-identical to that pool's);
* against the reference pool the HP checkpoint agrees within fp32 rounding only (the reference
  folds with einsums, the kernels with rank-1 updates), so a copy may differ by a unit of its
  format where a value sits at a rounding boundary, and an SR checkpoint in a few codes where
  the shared uniform falls between the two folds' fractions (tests/test_sround_kernels.py).
"""
import pytest
import torch

from replayssm import SlotPool, formats
from replayssm.pool import backends
from replayssm.testing import make_inputs, make_params

from conftest import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LP_FORMATS = ["fp16", "bf16", "fp8_e4m3", "nvfp4"]
# unit roundoff of each format's elements (nvfp4: e2m1's one mantissa bit)
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8, "fp8_e4m3": 2.0 ** -4, "nvfp4": 2.0 ** -2}
ULP = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7, "fp8_e4m3": 2.0 ** -3}     # relative, at the top
# small shapes (HV, Hk, V, K): two value heads per key head; V = 12 is two programs of 8 rows
# per head (the NVFP4 head counter, the shared fields of an early flush); K = 48 padded to 64
SHAPES = {"mamba2": (2, 1, 12, 48), "gdn": (2, 1, 12, 32), "kda": (2, 1, 12, 16)}
N = 4
# real shapes, on the GPU
GPU_SHAPES = {"mamba2": (128, 8, 64, 128), "gdn": (32, 16, 128, 128), "kda": (32, 16, 128, 128)}
# the batch of each round: slots in another order each time and a padding row
ROWS = ([2, 0, -1, 1, 3], [3, -1, 1, 0, 2], [1, 3, 2, -1, 0])

slow = pytest.mark.slow


def _bits(parts: dict) -> dict:
    return {k: v.view(torch.uint8) for k, v in parts.items()}


def _parts_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(x, _bits(b)[k]) for k, x in _bits(a).items())


def _hp_values(pool) -> torch.Tensor:
    return formats.decode(pool.ckpt, pool.hp_format) if pool.hp_format else pool.ckpt["data"]


def _inputs(params, B, shape, g, steps=None):
    HV, Hk, V, K = shape
    return {k: v.to(DEV) for k, v in make_inputs(params, B, V, K, Hk, steps=steps, dtype=torch.float32,
                                                 generator=g).items()}


def _pools(family, lp, hp, T, window, std, init_grid=None, configs=None, record_dtype=None):
    """Pools on the same state: the kernels', the reference's, and (std) the one-checkpoint fp32
    pool on the standard kernels; `configs` replace the first two's (lp, hp) pairs."""
    shape = SHAPES[family]
    HV, Hk, V, K = shape
    params = make_params(family, HV, K, seed=2)
    kw = dict(window=window, max_draft=T, dtype=torch.float32, device=DEV, eager_max_batch=0, seed=5,
              layer=1, record_dtype=record_dtype)
    configs = configs or [("triton", lp, hp), ("reference", lp, hp)]
    pools = [SlotPool(params, N, V, K, Hk, backend=be, lp_format=l, hp_format=h, **kw) for be, l, h in configs]
    if std:
        pools.append(SlotPool(params, N, V, K, Hk, backend="triton", **kw))
    assert pools[0].backend == "triton" and pools[0].backend_note is None
    g = torch.Generator().manual_seed(0)
    init = 0.3 * torch.randn(N, HV, V, K, generator=g)
    if init_grid:
        init = _on_grid(init, init_grid)
    for p in pools:
        p.load(torch.arange(N, device=DEV), init.to(DEV))
    return params, pools, g, shape


def _on_grid(x, fmt):
    """`x` rounded onto `fmt`'s grid such that encoding it again, with any rounding, is exact:
    fp8 rows get a power-of-two scale and an element at 448 times it (re-quantizing an fp8
    value with its own row scale would pick a new scale)."""
    if fmt != "fp8_e4m3":
        return formats.quantize(x, fmt)
    s = 2.0 ** torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True) / 448))
    q = (x / s).to(torch.float8_e4m3fn).float() * s
    q[..., 0] = 448 * s[..., 0]
    return q


def _poison_past_cursor(pools, ids):
    """NaN in every record field past each live row's cursor: stale drafts must leave no trace."""
    for p in pools:
        for s in ids.tolist():
            if s >= 0:
                h = int(p.cursor[s])
                for t in p.buf.values():
                    t[s, h:] = float("nan")


def _scenario(family, lp, hp=None, T=3, window=4, rounds=3, std=True, decodes=2, record_dtype=None):
    """Rows join one decode step at a time (cursors 3, 2, 1, 0), then `rounds` verify + commit
    rounds with random per-row counts and acceptances, then `decodes` decode steps; every step
    run on every pool with the same inputs. Returns the pools and a log of each verify."""
    params, pools, g, shape = _pools(family, lp, hp, T, window, std, record_dtype=record_dtype)
    fast, ref = pools[:2]
    for step in range(N - 1):
        ids = torch.arange(step + 1, device=DEV)
        x = _inputs(params, step + 1, shape, g)
        for p in pools:
            p.decode(ids, **x)
    log = []
    HV, V = shape[0], shape[2]
    for r in range(rounds):
        rows = ROWS[r % len(ROWS)]
        ids = torch.tensor(rows, device=DEV)
        live = ids >= 0
        B = len(rows)
        nd = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32).to(DEV)
        h0 = fast.cursor[ids.clamp(min=0).long()]
        flush = (h0 + nd > window) & live
        x = _inputs(params, B, shape, g, steps=T)
        _poison_past_cursor(pools, ids)
        ep0 = fast.epoch.clone()
        outs = []
        for p in pools:
            out = torch.full((B, T, HV, V), float("nan"), device=DEV)
            y = p.verify(ids, num_drafts=nd, out=out, **x)
            assert y is out
            outs.append(y)
        y = outs[0]
        keep = torch.arange(T, device=DEV)[None, :] < nd[:, None]
        assert torch.isfinite(y).all()
        assert torch.equal(y[~live], torch.zeros_like(y[~live]))                    # the padding row
        assert torch.equal(y[~keep], torch.zeros_like(y[~keep]))                    # past each count
        for name in ("cursor", "pending", "epoch"):
            assert torch.equal(getattr(fast, name), getattr(ref, name)), (r, name)
        assert torch.equal(fast.epoch - ep0, torch.zeros_like(ep0).index_add_(
            0, ids[flush].long(), torch.ones_like(ids[flush]).long())), r
        if lp is not None and hp is None:
            # the copy is the round-to-nearest encoding of the fp32 checkpoint, bit for bit
            assert _parts_equal(fast.ckpt_lp, formats.encode(fast.ckpt["data"], lp, "nearest")), r
        log.append(dict(outs=outs, flush=flush, live=live, keep=keep, nd=nd))
        acc = torch.minimum(torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32).to(DEV), nd)
        for p in pools:
            p.commit(ids, acc)
    dec = []
    for _ in range(decodes):
        ids = torch.tensor([3, -1, 0, 1, 2], device=DEV)
        x = _inputs(params, 5, shape, g)
        dec.append([p.decode(ids, **x) for p in pools])
        assert torch.equal(fast.cursor, ref.cursor) and torch.equal(fast.epoch, ref.epoch)
    return pools, log, dec


def _flush_mix(log):
    """(rows that flushed early, live rows that read the copy) over all rounds."""
    fl = sum(int(e["flush"].sum()) for e in log)
    return fl, sum(int(e["live"].sum()) for e in log) - fl


def _out_errors(log, a=0, b=1, rows="all"):
    pick = []
    for e in log:
        m = e["live"] if rows == "all" else (e["flush"] if rows == "flush" else e["live"] & ~e["flush"])
        pick.append((e["outs"][a][m], e["outs"][b][m]))
    return rel_err(torch.cat([x for x, _ in pick]), torch.cat([y for _, y in pick]))


# ----------------------------------------------------------------------------------------------
# fp32 HP checkpoint and a low-precision copy


def _check_fp32_hp(family, lp, T, window, rounds, std=True):
    pools, log, dec = _scenario(family, lp, T=T, window=window, rounds=rounds, std=std)
    fast, ref = pools[:2]
    u = UNIT[lp]
    fl, nf = _flush_mix(log)
    out_ref = max(rel_err(e["outs"][0], e["outs"][1]) for e in log)
    dec_ref = max(rel_err(d[0], d[1]) for d in dec)
    hp_ref = rel_err(fast.ckpt["data"], ref.ckpt["data"])
    lp_ref = rel_err(formats.decode(fast.ckpt_lp, lp), formats.decode(ref.ckpt_lp, lp))
    print(f"{family} {lp} T={T}: flush rows {fl}, copy rows {nf}; outputs vs reference {out_ref:.1e}, "
          f"decode {dec_ref:.1e}; HP {hp_ref:.1e}, copy {lp_ref:.1e}")
    assert fl >= 2 and nf >= 2, (fl, nf)
    assert hp_ref < 1e-5, hp_ref
    # (a copy read as if it were the fp32 checkpoint would be about 0.3 units off)
    assert out_ref < 0.1 * u and dec_ref < 0.1 * u, (out_ref, dec_ref)
    assert lp_ref < 0.1 * u, lp_ref
    if not std:
        return pools
    std = pools[2]
    lp_read = _out_errors(log, 0, 2, "read")
    flush_read = _out_errors(log, 0, 2, "flush")
    print(f"  copy reads vs fp32 reads {lp_read / u:.2f} units, flush rows {flush_read:.1e}")
    # rows without a flush read the copy (about a unit of the format from fp32 reads), rows with
    # one read the fold (fp32 reads: the same state within fp32 rounding)
    assert 0.05 * u < lp_read < u, lp_read
    assert flush_read < 1e-5, flush_read
    if family == "mamba2" and T < 5:
        # the one-checkpoint row-dot kernel's fold, bit for bit
        assert torch.equal(fast.ckpt["data"], std.ckpt["data"])
    else:
        assert rel_err(fast.ckpt["data"], std.ckpt["data"]) < 1e-5
    return pools


@pytest.mark.parametrize("lp", LP_FORMATS)
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_verify_lp_matches_reference_pool(family, lp):
    """Window 4, T = 3, three verify rounds after rows joined one step apart: early flushes
    and copy reads in every launch. Bounds (measured here): outputs within 0.1 unit of the
    format of the reference pool's, HP within 1e-5, copies within 0.1 unit; against the
    one-checkpoint fp32 pool too (Mamba-2, and bf16 of GDN and KDA, for time)."""
    _check_fp32_hp(family, lp, T=3, window=4, rounds=3, std=family == "mamba2" or lp == "bf16")


@pytest.mark.parametrize("family,lp", [("mamba2", "fp8_e4m3"), ("gdn", "nvfp4"),
                                       pytest.param("kda", "bf16", marks=slow),
                                       pytest.param("mamba2", "nvfp4", marks=slow)])
def test_verify_lp_one_draft(family, lp):
    """T = 1: a row flushes only when a commit left its cursor at the window (h + 1 > L)."""
    _check_fp32_hp(family, lp, T=1, window=4, rounds=3, std=False)


@pytest.mark.parametrize("family,lp", [("gdn", "fp16"), ("mamba2", "bf16"),
                                       pytest.param("kda", "nvfp4", marks=slow),
                                       pytest.param("mamba2", "fp8_e4m3", marks=slow),
                                       pytest.param("gdn", "fp8_e4m3", marks=slow)])
def test_verify_lp_eight_drafts(family, lp):
    """T = 8 with window 8 (the verify kernels' largest T)."""
    _check_fp32_hp(family, lp, T=8, window=8, rounds=3, std=False)


@pytest.mark.parametrize("family", ["mamba2", "gdn", pytest.param("kda", marks=slow)])
def test_fp32_hp_independent_of_lp_format(family):
    """The fp32 checkpoint after flushes is bit-identical whether the copy is fp16 or NVFP4
    (GDN/KDA: u recomputed from the raw v, beta along C_HP); the outputs are not."""
    runs = {lp: _scenario(family, lp, std=False, decodes=0) for lp in ("fp16", "nvfp4")}
    (pa, la, _), (pb, lb, _) = runs["fp16"], runs["nvfp4"]
    assert _flush_mix(la)[0] >= 2
    assert torch.equal(pa[0].ckpt["data"], pb[0].ckpt["data"])
    assert not all(torch.equal(a["outs"][0], b["outs"][0]) for a, b in zip(la, lb))


# ----------------------------------------------------------------------------------------------
# a stochastically rounded HP checkpoint


def _code_distance(a, b, hp: str) -> dict:
    """As tests/test_sround_kernels.py: the fraction of HP codes that differ and the largest
    difference in units of the format at the row's top magnitude."""
    int_dtype = torch.uint8 if hp == "fp8_e4m3" else torch.int16
    va, vb = formats.decode(a.ckpt, hp).double(), formats.decode(b.ckpt, hp).double()
    top = torch.maximum(va.abs(), vb.abs()).amax(dim=-1, keepdim=True).clamp(min=1e-30)
    return dict(frac=(a.ckpt["data"].view(int_dtype) != b.ckpt["data"].view(int_dtype)).double().mean().item(),
                units=((va - vb).abs() / (ULP[hp] * top)).max().item())


@pytest.mark.parametrize("family,hp,lp", [("mamba2", "bf16", "fp16"), ("gdn", "fp8_e4m3", "bf16"),
                                          ("kda", "fp16", "fp8_e4m3"),
                                          pytest.param("mamba2", "fp8_e4m3", "bf16", marks=slow),
                                          pytest.param("gdn", "bf16", "fp16", marks=slow)])
def test_sr_hp_verify_matches_reference_pool(family, hp, lp):
    """HP in bf16/fp16/fp8 with stochastic rounding (same seed and layer in both pools): after
    the rounds the HP codes agree but for a few, by at most one unit at their row's top;
    outputs within a few units of the HP format (the copy is read from slightly different
    folds)."""
    pools, log, dec = _scenario(family, lp, hp=hp, std=False)
    fast, ref = pools
    d = _code_distance(fast, ref, hp)
    out_ref = max(max(rel_err(e["outs"][0], e["outs"][1]) for e in log), max(rel_err(a, b) for a, b in dec))
    print(f"{family} hp={hp} lp={lp}: codes differing {d['frac']:.4f} by <= {d['units']:.2f} unit(s); "
          f"outputs {out_ref:.1e}")
    assert _flush_mix(log)[0] >= 2 and int(fast.epoch.min()) >= 2
    assert d["frac"] < 0.02 and d["units"] <= 1, d
    assert out_ref < 40 * ULP[hp], out_ref


@pytest.mark.parametrize("family,hp", [("mamba2", "bf16"), ("gdn", "fp16"), ("kda", "fp8_e4m3"),
                                       pytest.param("mamba2", "fp8_e4m3", marks=slow),
                                       pytest.param("gdn", "bf16", marks=slow)])
def test_sr_hp_write_is_formats_encode_of_the_fold(family, hp):
    """A state on the HP format's grid is loaded exactly into an SR pool and an fp32-HP pool
    (same copy format): both fold the same fp32 values, so the SR pool's HP after an early
    flush is `formats.encode(fp32 pool's HP, hp, "stochastic", seed, stream=s * 2**32 +
    epoch)` bit for bit, its copy is the fp32 pool's, and every output is the same."""
    lp = "fp16" if hp != "fp16" else "bf16"
    T, window = 3, 4
    params, pools, g, shape = _pools(family, None, None, T, window, False, init_grid=hp,
                                     configs=[("triton", lp, hp), ("triton", lp, None)])
    sr, f32 = pools
    flushed = 0
    # cursors 0 (after the load) -> 2, 2, 1, 1 -> slots 0 and 1 flush -> slots 2 and 3 flush:
    # each slot's first flush (a second one would fold from the SR pool's rounded HP)
    rounds = (([0, 1, -1, 2, 3], [3, 2, 1, 1, 1]), ([3, 2, 1, -1, 0], [3, 3, 3, 1, 3]),
              ([1, 3, 2, -1, 0], [1, 2, 3, 1, 1]))
    for r, (rows, nd) in enumerate(rounds):
        ids = torch.tensor(rows, device=DEV)
        nd = torch.tensor(nd, dtype=torch.int32, device=DEV)
        x = _inputs(params, len(rows), shape, g, steps=T)
        ep0 = sr.epoch.clone()
        h0 = sr.cursor.clone()
        ys = [p.verify(ids, num_drafts=nd, **x) for p in pools]
        assert torch.equal(ys[0], ys[1]), r
        for s, n in zip(rows, nd.tolist()):
            if s >= 0 and int(h0[s]) + n > window:
                flushed += 1
                want = formats.encode(f32.ckpt["data"][s:s + 1], hp, "stochastic", seed=sr.stream_seed,
                                      stream=torch.tensor([s * 2 ** 32 + int(ep0[s])], device=DEV))
                assert _parts_equal({k: v[s:s + 1] for k, v in sr.ckpt.items()}, want), (r, s)
        assert _parts_equal(sr.ckpt_lp, f32.ckpt_lp), r
        for p in pools:
            p.commit(ids, torch.full((len(rows),), 2, dtype=torch.int32, device=DEV).minimum(nd))
    assert flushed == 4 and not torch.equal(formats.decode(sr.ckpt, hp), f32.ckpt["data"])


# ----------------------------------------------------------------------------------------------
# one narrow checkpoint and no copy (the shared design): the kernels called on a reference pool's
# tensors until the pool takes such pools to the kernels


@pytest.mark.parametrize("family,hp,rounding", [("mamba2", "bf16", "stochastic"), ("gdn", "fp16", "nearest"),
                                                ("mamba2", "nvfp4", "nearest"), ("gdn", "nvfp4", "stochastic"),
                                                ("kda", "nvfp4", "nearest"),
                                                pytest.param("mamba2", "nvfp4", "stochastic", marks=slow),
                                                pytest.param("kda", "fp8_e4m3", "stochastic", marks=slow),
                                                pytest.param("mamba2", "fp8_e4m3", "nearest", marks=slow)])
def test_verify_lp_one_narrow_checkpoint(family, hp, rounding):
    """`verify_lp` of a pool whose one checkpoint is fp16/bf16/fp8/NVFP4: non-flush rows read it,
    an early flush folds it (GDN/KDA: with the buffered u) and writes it with the pool's
    rounding (NVFP4: the head's scale from the whole fold; Mamba-2's last program of the head
    refolds it, GDN/KDA take it from a launch before); against the reference on the same
    inputs, two verify + commit rounds."""
    HV, Hk, V, K = shape = SHAPES[family]
    T, window = 3, 4
    params = make_params(family, HV, K, seed=2)
    kw = dict(window=window, max_draft=T, dtype=torch.float32, device=DEV, eager_max_batch=0, seed=5, layer=1,
              hp_format=hp, hp_rounding=rounding, backend="reference")
    fast, ref = (SlotPool(params, N, V, K, Hk, **kw) for _ in range(2))
    assert backends.verify_lp_covers(hp, rounding, None, family)
    g = torch.Generator().manual_seed(0)
    init = (0.3 * torch.randn(N, HV, V, K, generator=g)).to(DEV)
    run = backends.get(family, "verify_lp")
    flushed = 0
    for p in (fast, ref):
        p.load(torch.arange(N, device=DEV), init)
    for r, rows in enumerate(ROWS[:2]):
        ids = torch.tensor(rows, device=DEV)
        nd = torch.tensor([3, 2, 1, 3, 2], dtype=torch.int32, device=DEV)
        x = _inputs(params, len(rows), shape, g, steps=T)
        flushed += int(((fast.cursor[ids.clamp(min=0).long()] + nd > window) & (ids >= 0)).sum())
        out = torch.full((len(rows), T, HV, V), float("nan"), device=DEV)
        y = run(fast.params, fast.layout, ids, x, window, nd, out, None, rounding)
        want = ref.verify(ids, num_drafts=nd, **x)
        # (NVFP4: both read the same codes until a flush; then a code may flip where the
        # tensor scales, from two folds' amax, differ in the last bit)
        bound = 2.0 ** -5 if hp == "nvfp4" else 40 * ULP[hp]
        assert torch.isfinite(y).all() and rel_err(y, want) < bound, (r, rel_err(y, want))
        for name in ("cursor", "pending", "epoch"):
            assert torch.equal(getattr(fast, name), getattr(ref, name)), (r, name)
        for p in (fast, ref):
            p.commit(ids, nd)      # cursors 3, 2, 3, 2: round 2 flushes three rows
    if hp == "nvfp4":
        va, vb = formats.decode(fast.ckpt, hp).double(), formats.decode(ref.ckpt, hp).double()
        top = torch.maximum(va.abs(), vb.abs()).amax(dim=(-1, -2), keepdim=True)
        frac = (fast.ckpt["data"] != ref.ckpt["data"]).double().mean().item()
        assert flushed >= 2 and frac < 0.02 and ((va - vb).abs() / top).max() < 2.0 ** -3, (flushed, frac)
    else:
        d = _code_distance(fast, ref, hp)
        assert flushed >= 2 and d["frac"] < 0.02 and d["units"] <= 1, (flushed, d)
    if family == "mamba2":
        # the records are copies of the inputs: the drafts behind each cursor, bit for bit
        for name in ("w", "k"):
            assert torch.equal(fast.layout.buf[name], ref.layout.buf[name]), name


@pytest.mark.parametrize("family,rounding", [("mamba2", "nearest"), ("mamba2", "stochastic"),
                                             ("gdn", "nearest"), ("kda", "stochastic")])
def test_shared_nvfp4_pool_verifies_on_the_kernel(family, rounding, monkeypatch):
    """A pool whose one checkpoint is NVFP4, on the Triton backend: `verify` takes the kernel (the
    reference's verify_step is never called), and decode, verify and commit rounds with early
    flushes track the reference pool."""
    _shared_nvfp4_rounds(family, rounding, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_shared_nvfp4_pool_verifies_on_the_kernel_gpu(family, monkeypatch):
    """The same at real head shapes (Nemotron-3-Super's 64-row heads: four programs each), compiled."""
    monkeypatch.setitem(SHAPES, family, GPU_SHAPES[family])
    _shared_nvfp4_rounds(family, "stochastic", monkeypatch)


def _shared_nvfp4_rounds(family, rounding, monkeypatch):
    from replayssm.reference import algorithms
    HV, Hk, V, K = shape = SHAPES[family]
    params = make_params(family, HV, K, seed=2)
    kw = dict(window=4, max_draft=3, dtype=torch.float32, device=DEV, eager_max_batch=0, seed=5, layer=1,
              hp_format="nvfp4", hp_rounding=rounding)
    fast, ref = SlotPool(params, N, V, K, Hk, backend="triton", **kw), SlotPool(params, N, V, K, Hk, **kw,
                                                                              backend="reference")
    g = torch.Generator().manual_seed(1)
    init = (0.3 * torch.randn(N, HV, V, K, generator=g)).to(DEV)
    for p in (fast, ref):
        p.load(torch.arange(N, device=DEV), init)
    calls = []
    step = algorithms.verify_step
    monkeypatch.setattr(algorithms, "verify_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    flushes = 0
    for r, rows in enumerate(ROWS):
        ids = torch.tensor(rows, device=DEV)
        x = _inputs(params, len(rows), shape, g)
        assert rel_err(fast.decode(ids, **x), ref.decode(ids, **x)) < 2.0 ** -5, r
        n_ref = len(calls)
        nd = torch.tensor([3, 1, 2, 3, 2], dtype=torch.int32, device=DEV)
        flushes += int(((fast.cursor[ids.clamp(min=0).long()] + nd > 4) & (ids >= 0)).sum())
        d = _inputs(params, len(rows), shape, g, steps=3)
        y = fast.verify(ids, num_drafts=nd, **d)
        assert len(calls) == n_ref                # the kernel, not the reference's verify_step
        want = ref.verify(ids, num_drafts=nd, **d)
        assert torch.isfinite(y).all() and rel_err(y, want) < 2.0 ** -5, (r, rel_err(y, want))
        acc = torch.tensor([2, 1, 1, 3, 1], dtype=torch.int32, device=DEV).minimum(nd)
        for p in (fast, ref):
            p.commit(ids, acc)
        assert torch.equal(fast.cursor, ref.cursor) and torch.equal(fast.epoch, ref.epoch), r
    va, vb = formats.decode(fast.ckpt, "nvfp4"), formats.decode(ref.ckpt, "nvfp4")
    assert flushes >= 2 and rel_err(va, vb) < 2.0 ** -5
    slots = torch.arange(N, device=DEV)
    assert rel_err(fast.materialize(slots), ref.materialize(slots)) < 2.0 ** -5


def test_verify_lp_covers():
    assert backends.verify_lp_covers(None, "nearest", "nvfp4")
    assert backends.verify_lp_covers("bf16", "stochastic", "fp8_e4m3")
    assert not backends.verify_lp_covers(None, "nearest", None)          # the fp32 verify kernels'
    assert not backends.verify_lp_covers("bf16", "stochastic", "nvfp4")  # needs the fp32 matrix
    # one NVFP4 checkpoint, either rounding, every family
    assert backends.verify_lp_covers("nvfp4", "nearest", None, "mamba2")
    assert backends.verify_lp_covers("nvfp4", "stochastic", None, "gdn")
    assert backends.verify_lp_covers("nvfp4", "nearest", None, "kda")
    assert not backends.verify_lp_covers("nvfp4", "toward_zero", None, "gdn")
    assert not backends.verify_lp_covers("fp32", "nearest", "fp8_e5m2")


# ----------------------------------------------------------------------------------------------
# real shapes, on the GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hp,lp", [(None, "nvfp4"), (None, "fp8_e4m3"), ("bf16", "fp16")])
@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_verify_lp_real_shapes_gpu(family, hp, lp, monkeypatch):
    """SPEC shapes (Nemotron-3-Super, Qwen3.5-4B; KDA at 128 x 128), window 16, T = 8, 4 slots,
    six rounds (four early flushes, twenty copy reads): the interpreter tests' checks and bounds
    (the copy bit-exact from the fp32 HP compiled; SR codes as close)."""
    monkeypatch.setitem(SHAPES, family, GPU_SHAPES[family])
    if hp is None:
        _check_fp32_hp(family, lp, T=8, window=16, rounds=6)
    else:
        pools, log, dec = _scenario(family, lp, hp=hp, T=8, window=16, rounds=6, std=False)
        d = _code_distance(pools[0], pools[1], hp)
        assert d["frac"] < 0.02 and d["units"] <= 1, d
        assert max(rel_err(e["outs"][0], e["outs"][1]) for e in log) < 40 * ULP[hp]


def _gluon_lp_codes(monkeypatch, vlp, mmas=None, refolds=None) -> list:
    """The `lp_code` of every Gluon verify launch of the module `vlp` (a family's verify_lp),
    appended as they run (and to `mmas` their `mma`, to `refolds` their `refold_mma`, where the
    launch names it)."""
    codes = []
    launch = vlp.launch_gluon_verify

    def counted(*args, **kw):
        codes.append(kw["lp_code"])
        if mmas is not None:
            mmas.append(kw.get("mma"))
        if refolds is not None:
            refolds.append(kw.get("refold_mma"))
        return launch(*args, **kw)

    monkeypatch.setattr(vlp, "launch_gluon_verify", counted)
    return codes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,window", [(4, 8), (8, 16)])
@pytest.mark.parametrize("lp", ["fp16", "bf16"])
@pytest.mark.parametrize("model", ["super", "nano"])
def test_verify_lp_gluon_real_shapes_gpu(model, lp, T, window, monkeypatch):
    """Mamba-2's Gluon verify kernel on an fp16/bf16 copy beside an fp32 checkpoint (the GPU's
    default; Nemotron-3-Super's and Nano-4B's shapes): `_check_fp32_hp`'s checks and bounds (the copy bit for
    bit the round-to-nearest encoding of the fp32 checkpoint, copy reads about a unit of the
    format from fp32 reads, flush rows as fp32 reads), every launch of the fast pool on that
    kernel."""
    from replayssm.ops.mamba2 import verify_lp as vlp
    from replayssm.ops.utils.lowp import LP_CODES

    codes = _gluon_lp_codes(monkeypatch, vlp)
    # Nano-4B: 16-row programs with the key products' launch
    monkeypatch.setitem(SHAPES, "mamba2", GPU_SHAPES["mamba2"] if model == "super" else (96, 8, 80, 128))
    _check_fp32_hp("mamba2", lp, T=T, window=window, rounds=6)
    assert len(codes) == 6 and set(codes) == {LP_CODES[lp]}, codes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,window,mma", [(4, 8, False), (8, 16, False), (8, 16, True), (8, 32, True)])
@pytest.mark.parametrize("lp", ["fp16", "bf16"])
@pytest.mark.parametrize("refold_mma", [False, True])
def test_verify_lp_gluon_gdn_real_shapes_gpu(lp, T, window, mma, refold_mma, monkeypatch):
    """GDN's Gluon verify kernel on an fp16/bf16 copy beside an fp32 checkpoint (the GPU's
    default, `GLUON_LP_GDN`; Qwen3.5-4B's shape): `_check_fp32_hp`'s checks and bounds (the copy bit
    for bit the round-to-nearest encoding of the fp32 checkpoint, the HP refold with u recomputed
    from the raw records, copy reads about a unit of the format from fp32 reads), every launch of
    the fast pool on that kernel; `mma`: with `LP_MMA`, its products on the tensor cores;
    `refold_mma`: with `REFOLD_MMA`, an early flush's refold on them (asserted to reach the kernel)."""
    from replayssm.ops.gdn import gluon_verify_host as gv, verify_lp as vlp
    from replayssm.ops.utils.lowp import LP_CODES

    monkeypatch.setattr(vlp, "LP_MMA", mma)      # both products whatever the default
    monkeypatch.setattr(vlp, "REFOLD_MMA", refold_mma)
    mmas, refolds, rfm, constexprs = [], [], set(), gv.gluon_verify_constexprs

    def spy(*a, **k):
        d = constexprs(*a, **k)
        if d["LPT"]:                             # (the fp32 pool beside it launches the kernel too)
            rfm.add(d["RFM"])
        return d
    monkeypatch.setattr(gv, "gluon_verify_constexprs", spy)
    codes = _gluon_lp_codes(monkeypatch, vlp, mmas, refolds)
    monkeypatch.setitem(SHAPES, "gdn", GPU_SHAPES["gdn"])
    rounds = 6 if window <= 16 else 16           # (window 32: about 3 records a round, 2 flushes a row)
    _check_fp32_hp("gdn", lp, T=T, window=window, rounds=rounds)
    assert len(codes) == rounds and set(codes) == {LP_CODES[lp]}, codes
    assert set(mmas) == {mma} and set(refolds) == {refold_mma} and rfm == {refold_mma}, (mmas, refolds, rfm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,window", [(4, 8), (8, 16)])
@pytest.mark.parametrize("lp", ["fp16", "bf16"])
def test_verify_lp_gluon_kda_real_shapes_gpu(lp, T, window, monkeypatch):
    """KDA's pools with an fp16/bf16 copy on the Gluon verify kernel (`GLUON_LP_KDA`: its refold
    with per-channel decays): the checks and bounds of the GDN case above, every launch on it."""
    from replayssm.ops.gdn import verify_lp as vlp
    from replayssm.ops.utils.lowp import LP_CODES

    monkeypatch.setattr(vlp, "GLUON_LP_KDA", True)
    codes = _gluon_lp_codes(monkeypatch, vlp)
    monkeypatch.setitem(SHAPES, "kda", GPU_SHAPES["kda"])
    _check_fp32_hp("kda", lp, T=T, window=window, rounds=6)
    assert len(codes) == 6 and set(codes) == {LP_CODES[lp]}, codes


def test_verify_lp_gluon_only_where_it_applies():
    """`lowp_verify` keeps the Triton kernel off the GPU, and for copies other than fp16/bf16
    or an HP checkpoint other than fp32 (the Gluon kernel's contract)."""
    from replayssm.ops.mamba2 import verify_lp as vlp
    from replayssm.ops.utils.lowp import LP_CODES
    from replayssm.ops.utils.sround import HP_CODES

    x = torch.zeros(1, 2, 2, 16)
    args = (torch.zeros(1, 2, 1, 128), None, None, None, None, None, 4)
    for hp, lp in (("fp32", "fp16"), ("fp32", "fp8_e4m3"), ("bf16", "fp16")):
        ck = dict(HAS_LP=True, HP=HP_CODES[hp], LP=LP_CODES[lp], ckpt=torch.zeros(1, 2, 16, 128))
        assert vlp._gluon_lp_config(x, args[0], ck, *args[1:]) is None, (hp, lp)
    # GDN off the GPU (CPU tensors), KDA, other copies, or the switch off: the Triton kernel
    from replayssm.ops.gdn import verify_lp as gvlp

    q, v = torch.zeros(1, 2, 1, 128), torch.zeros(1, 2, 2, 128)
    rest = (None,) * 6 + (4,)
    for family, hp, lp in (("gdn", "fp32", "fp16"), ("kda", "fp32", "fp16"), ("gdn", "fp32", "fp8_e4m3"),
                           ("gdn", "bf16", "fp16")):
        ck = dict(HAS_LP=True, HP=HP_CODES[hp], LP=LP_CODES[lp], ckpt=torch.zeros(1, 2, 128, 128))
        assert gvlp._gluon_lp_config(family, q, v, ck, *rest) is None, (family, hp, lp)


def test_verify_lp_refold_rows_switch_refuses_bad_values():
    """`REPLAYSSM_GLUON_LP_REFOLD_ROWS` is read at import: a value the kernel cannot take is named there."""
    import os
    import subprocess
    import sys
    for bad in ("abc", "24", "-8"):
        r = subprocess.run([sys.executable, "-c", "import replayssm.ops.gdn.verify_lp"], capture_output=True,
                           text=True, env=dict(os.environ, REPLAYSSM_GLUON_LP_REFOLD_ROWS=bad))
        assert r.returncode != 0 and f"REPLAYSSM_GLUON_LP_REFOLD_ROWS='{bad}'" in r.stderr, r.stderr[-500:]
