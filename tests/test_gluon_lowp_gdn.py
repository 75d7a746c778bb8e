"""GDN's (and KDA's) split step of the precision decode kernel (ops/gdn/gluon_lowp.py): the flush
rows on the Triton kernel (`ROWS=1`), then every other row on the Gluon kernel of the steady
rows (the default; `{"gluon": False}` keeps the single launch), or on the interpreter the Triton kernel again (`split: true`,
`ROWS=2`).

What is checked, and why it can be exact:
* on the interpreter the split is the single launch bit for bit in everything (checkpoints,
  LP copy, records, cursors, epochs, counters, outputs), step after step: each row runs the same
  Triton code in one launch or the other;
* on the GPU, every step from the same state (the single launch's copy re-synchronised to the
  split's): the checkpoints, LP copy, cursors, epochs, counters, every record but the steady
  rows' new ones, and the flush rows' outputs bit for bit (launch 1 is the single launch's code);
  the steady rows' new records and outputs within fp32 rounding (the Gluon kernel sums `C k`,
  `C q` and the key's norm in another order: `u`, and the key where its norm's sum differs; the
  raw v bit for bit), and the outputs within fp32 rounding of the float64 reference pool;
* a CUDA graph of the two launches replays as the eager split does;
* the Gluon kernel is the default: without `gluon` the step asks for it.
"""
import pytest
import torch

from replayssm import SlotPool
from replayssm.ops.gdn import gluon_lowp, precision
from replayssm.ops.utils.gluon import HAVE_GLUON
from replayssm.ops.utils.lowp import LP_CODES, lowp_config
from replayssm.testing import make_inputs, make_params

from conftest import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda" and HAVE_GLUON
# designs: (family, hp_format, lp_format, hp_rounding); the shared design has no LP copy
DESIGNS = {
    "gdn-fp32-fp16": ("gdn", "fp32", "fp16", "stochastic"),
    "gdn-fp32-bf16": ("gdn", "fp32", "bf16", "stochastic"),
    "gdn-bf16-fp16": ("gdn", "bf16", "fp16", "stochastic"),
    "gdn-fp32-nvfp4": ("gdn", "fp32", "nvfp4", "stochastic"),
    "gdn-shared-fp16-sr": ("gdn", "fp16", None, "stochastic"),
    "gdn-shared-bf16-near": ("gdn", "bf16", None, "nearest"),
    "gdn-shared-nvfp4-near": ("gdn", "nvfp4", None, "nearest"),
    "gdn-fp32-fp8": ("gdn", "fp32", "fp8_e4m3", "stochastic"),
    "gdn-shared-fp8-sr": ("gdn", "fp8_e4m3", None, "stochastic"),
    "kda-fp32-bf16": ("kda", "fp32", "bf16", "stochastic"),
    "kda-fp32-fp8": ("kda", "fp32", "fp8_e4m3", "stochastic"),
    "kda-shared-fp16-sr": ("kda", "fp16", None, "stochastic"),
    "kda-fp32-nvfp4": ("kda", "fp32", "nvfp4", "stochastic"),
    "kda-shared-nvfp4-near": ("kda", "nvfp4", None, "nearest"),
}
# the records a steady row writes at its cursor, with what may differ from the single launch
# (u: arithmetic on the checkpoint; k: the norm's sum; ld, beta: the same formulas)
RECORD_TOL = {"w": 1e-5, "k": 1e-6, "ld": 1e-6, "beta": 1e-6, "v": 0.0}


# ----------------------------------------------------------------------------------------------
# the dispatch, on the CPU


def test_gluon_lp_unsupported_reasons():
    """What the Gluon kernel covers: GDN and KDA, fp16/bf16/fp8_e4m3/NVFP4 reads, windows 2..32,
    K = 128, 16 rows per warp dividing V."""
    f = gluon_lowp.gluon_lp_unsupported
    for family, fmt in (("gdn", "fp16"), ("gdn", "bf16"), ("kda", "bf16"), ("gdn", "fp8_e4m3"), ("gdn", "nvfp4"),
                        ("kda", "fp8_e4m3"), ("kda", "nvfp4")):
        why = f(family, LP_CODES[fmt], 128, 128, 16, 17, 64)
        assert why is None if HAVE_GLUON else "no Gluon" in why
    assert "mamba2" in f("mamba2", 1, 128, 128, 16, 17, 64)
    assert "code 0" in f("gdn", 0, 128, 128, 16, 17, 64)                       # an fp32 shared checkpoint
    assert "window 1" in f("gdn", 1, 128, 128, 1, 17, 64)
    if HAVE_GLUON:
        assert "K=64" in f("gdn", 1, 128, 64, 16, 17, 64)
        assert "BV" in f("gdn", 1, 128, 128, 16, 17, 48)
        assert "window 40" in f("gdn", 1, 128, 128, 40, 41, 64)


def _tiny(family="gdn", lp="fp16", n=2, window=3):
    HV, Hk, V, K = 2, 1, 8, 16
    params = make_params(family, HV, K, seed=2)
    pool = SlotPool(params, n, V, K, Hk, backend="triton", window=window, max_draft=1, dtype=torch.float32,
                    device=DEV, eager_max_batch=0, lp_format=lp, seed=3)
    g = torch.Generator().manual_seed(0)
    pool.load(torch.arange(n, device=DEV), (0.3 * torch.randn(n, HV, V, K, generator=g)).to(DEV))
    return pool.params, pool


def test_gluon_is_the_default(monkeypatch):
    """Without `gluon` in the config the step asks for the Gluon kernel (`lowp_config`'s default);
    `{"gluon": False}` asks for the single launch; the config is checked as `lowp_config`'s."""
    seen = []

    def spy(cfg, *args):
        seen.append(cfg["gluon"])
        return False

    monkeypatch.setattr(precision, "use_gluon_lp", spy)
    assert lowp_config(8, None, split=True)["gluon"] is True
    params, pool = _tiny()
    st = _clone(pool)
    ids = torch.tensor([0, 1], device=DEV)
    x = {k: v.to(DEV) for k, v in make_inputs(params, 2, 8, 16, 1, dtype=torch.float32).items()}
    design = ("gdn", "fp32", "fp16", "stochastic")
    for config in (None, {"BV": 8}, {"gluon": True}, {"gluon": False}):
        _step(params, st, design, ids, x, 3, config)
    assert seen == [True, True, True, False]
    with pytest.raises(ValueError, match="gluon"):
        _step(params, st, design, ids, x, 3, {"gluon": 1})


# ----------------------------------------------------------------------------------------------
# the split against the single launch


def _pool(design, shape, n, window, backend="triton"):
    family, hp, lp, rounding = design
    HV, Hk, V, K = shape
    params = make_params(family, HV, K, seed=2)
    pool = SlotPool(params, n, V, K, Hk, backend=backend, window=window, max_draft=1, dtype=torch.float32,
                    device=DEV, eager_max_batch=0, hp_format=None if hp == "fp32" else hp,
                    hp_rounding=rounding if hp != "fp32" else None, lp_format=lp, seed=3, layer=1)
    g = torch.Generator().manual_seed(0)
    pool.load(torch.arange(n, device=DEV), (0.3 * torch.randn(n, HV, V, K, generator=g)).to(DEV))
    return pool.params, pool


def _clone(pool):
    lay = pool.layout
    return dict(ckpt={k: v.clone() for k, v in lay.ckpt.items()},
                ckpt_lp={k: v.clone() for k, v in lay.ckpt_lp.items()} if lay.ckpt_lp is not None else None,
                buf={k: v.clone() for k, v in lay.buf.items()}, cursor=lay.cursor.clone(),
                epoch=lay.epoch.clone(), arrive=lay.arrive.clone(), seed=lay.stream_seed)


def _step(params, st, design, ids, x, window, config, out=None, validate=True):
    family, hp, lp, rounding = design
    out = torch.full_like(x["v"], float("nan")) if out is None else out
    buf = st["buf"]
    return precision.lowp_decode(**x, A_log=params.A_log, dt_bias=params.dt_bias, scale=params.scale,
                                 ckpt=st["ckpt"]["data"] if hp == "fp32" else st["ckpt"], ckpt_lp=st["ckpt_lp"],
                                 lp_format=lp, buf_ld=buf["ld"], buf_w=buf["w"], buf_k=buf["k"],
                                 buf_v=buf.get("v"), buf_beta=buf.get("beta"), cursor=st["cursor"],
                                 epoch=st["epoch"], slot_ids=ids, window=window, out=out,
                                 use_qk_l2norm=params.use_qk_l2norm, family=family, arrive=st["arrive"],
                                 config=config, validate=validate, hp_format=hp, seed=st["seed"],
                                 hp_rounding=rounding)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _bits_equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return set(a) == set(b) and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _same_state(split, single, written=None):
    """The split's state against the single launch's: bit for bit, but for the records at
    `written` (`[N, Lb]` bool: the steady rows' new ones) where `RECORD_TOL` allows fp32
    rounding; returns the largest gap there per record."""
    assert _bits_equal(split["ckpt"], single["ckpt"]), "HP checkpoint"
    assert _bits_equal(split["ckpt_lp"], single["ckpt_lp"]), "LP copy"
    for key in ("cursor", "epoch", "arrive"):
        assert torch.equal(split[key], single[key]), key
    assert not split["arrive"].any()
    gaps = {}
    for name, a in split["buf"].items():
        b = single["buf"][name]
        if written is None:
            assert torch.equal(_bits(a), _bits(b)), f"records {name}"
            continue
        keep = ~written
        assert torch.equal(_bits(a[keep]), _bits(b[keep])), f"records {name} outside the steady rows' new ones"
        if written.any():
            gaps[name] = rel_err(a[written].double(), b[written].double())
            assert gaps[name] <= RECORD_TOL[name], (name, gaps[name])
    return gaps


def _sync(dst, src):
    """`dst` (a state dict or a pool's layout) takes `src`'s state."""
    get = (lambda o, k: getattr(o, k)) if not isinstance(dst, dict) else (lambda o, k: o[k])
    for k, t in src["ckpt"].items():
        get(dst, "ckpt")[k].copy_(t)
    for k, t in (src["ckpt_lp"] or {}).items():
        get(dst, "ckpt_lp")[k].copy_(t)
    for k, t in src["buf"].items():
        get(dst, "buf")[k].copy_(t)
    for k in ("cursor", "epoch"):
        get(dst, k).copy_(src[k])


def _poison_past_cursor(st):
    """NaN in every record at and past each slot's cursor, which no read may take into a sum."""
    pos = torch.arange(st["buf"]["w"].shape[1], device=st["cursor"].device)
    past = pos[None, :] >= st["cursor"][:, None].long()
    for t in st["buf"].values():
        if t.is_floating_point():
            t[past] = float("nan")


def _run_split(design, shape, n, window, steps, split_config, exact):
    """`steps` steps, rows joining one per step (staggered cursors) plus a padding row, on two
    copies of one pool's state (NaN in the records past every cursor before each step): the
    single launch and the split, the single launch's copy taking
    the split's state after each step (on the interpreter, where they are equal, a no-op).
    Returns the largest gaps (steady outputs against the single launch, live outputs against the
    synced reference pool, each record) and counts."""
    params, pool = _pool(design, shape, n, window)
    _, ref = _pool(design, shape, n, window, backend="reference")
    single, split = _clone(pool), _clone(pool)
    g = torch.Generator().manual_seed(1)
    HV, Hk, V, K = shape
    gaps = dict(single=0.0, ref=0.0, flushes=0, steady=0, records={})
    for step in range(steps):
        rows = list(range(min(step + 1, n))) + [-1]
        ids = torch.tensor(rows, device=DEV)
        x = {k: v.to(DEV) for k, v in make_inputs(params, len(rows), V, K, Hk, dtype=torch.float32,
                                                    generator=g).items()}
        live = ids >= 0
        for st in (single, split):
            _poison_past_cursor(st)
        h0 = split["cursor"][ids.clamp(min=0).long()]
        flush = live & (h0 + 1 >= window)
        steady = live & ~flush
        written = torch.zeros(n, split["buf"]["w"].shape[1], dtype=torch.bool, device=DEV)
        written[ids[steady].long(), h0[steady].long()] = True
        _sync(ref.layout, split)
        y_ref = ref.decode(ids, **x)
        y_one = _step(params, single, design, ids, x, window, {"gluon": False})
        y_two = _step(params, split, design, ids, x, window, split_config)
        for name, gap in _same_state(split, single, None if exact else written).items():
            gaps["records"][name] = max(gaps["records"].get(name, 0.0), gap)
        assert torch.equal(y_two[-1], torch.zeros_like(y_two[-1]))                       # padding row
        assert torch.isfinite(y_two).all()
        assert torch.equal(y_two[flush], y_one[flush]), step                             # launch 1's code
        if exact:
            assert torch.equal(y_two, y_one), step
        if steady.any():
            gaps["single"] = max(gaps["single"], rel_err(y_two[steady], y_one[steady]))
        gaps["ref"] = max(gaps["ref"], rel_err(y_two[live], y_ref[live]))
        gaps["flushes"] += int(flush.sum())
        gaps["steady"] += int(steady.sum())
        _sync(single, split)
    return gaps


# the interpreter: small shapes (V not a multiple of the block: masked rows), window 4
SMALL = {"gdn": (4, 2, 12, 32), "kda": (4, 2, 12, 16)}
# CI's representative subset: an LP copy of GDN, a shared GDN checkpoint, KDA; the NVFP4 cases slow
INTERP = ["gdn-fp32-fp16", pytest.param("gdn-fp32-nvfp4", marks=pytest.mark.slow), "gdn-shared-bf16-near",
          pytest.param("gdn-shared-nvfp4-near", marks=pytest.mark.slow), "kda-fp32-bf16"]


@pytest.mark.parametrize("name", INTERP)
def test_split_matches_single_launch_interpreter(name):
    """The split in Triton (`split: true`: `ROWS=1` with 3 programs looping over the flush rows'
    items, then `ROWS=2`) is the single launch bit for bit in everything, 10 steps, window 4,
    rows at staggered cursors, a padding row; the outputs within fp32 rounding of the float64
    reference pool from the same state."""
    design = DESIGNS[name]
    gaps = _run_split(design, SMALL[design[0]], 3, 4, 10, {"split": True, "flush_programs": 3}, True)
    assert gaps["flushes"] >= 4 and gaps["steady"] >= 10, gaps
    assert gaps["ref"] < 1e-5, gaps


# ----------------------------------------------------------------------------------------------
# on the GPU: the Gluon kernel


GPU_SHAPES = {"qwen3.5-4b": (32, 16, 128, 128), "qwen3.5-122b": (64, 16, 128, 128),
              "kimi-linear-48b": (32, 32, 128, 128)}
GPU_DESIGNS = ["gdn-fp32-fp16", "gdn-fp32-bf16", "gdn-bf16-fp16", "gdn-shared-fp16-sr", "gdn-shared-bf16-near"]
gpu = pytest.mark.skipif(not GPU, reason="needs CUDA and Gluon")


@pytest.fixture
def gluon_launches(monkeypatch):
    """Counts the Gluon kernel's launches (a split test that silently ran the single launch
    would pass for nothing)."""
    calls = []
    real = precision.launch_gluon_lp

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(precision, "launch_gluon_lp", counting)
    return calls


def _gpu_split(name, shape, n, window, steps, config, launches):
    gaps = _run_split(DESIGNS[name], GPU_SHAPES[shape], n, window, steps, dict({"gluon": True}, **config), False)
    print(name, shape, gaps)
    assert len(launches) == steps, "the Gluon kernel did not run"
    assert gaps["flushes"] >= n and gaps["steady"] >= 4 * n, gaps
    assert gaps["single"] < 1e-5 and gaps["ref"] < 1e-4, gaps
    return gaps


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", GPU_DESIGNS)
@pytest.mark.parametrize("shape", ["qwen3.5-4b", "qwen3.5-122b"])
def test_split_matches_single_launch_gpu(shape, name, gluon_launches):
    """Qwen3.5 shapes, window 16, 8 slots, 40 steps (two windows and more at staggered cursors),
    a padding row: the split with the Gluon kernel against the single launch (state bit for bit
    but the steady rows' new records, within `RECORD_TOL`; steady outputs within 1e-5) and the
    reference pool (1e-4)."""
    _gpu_split(name, shape, 8, 16, 40, {}, gluon_launches)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name, shape", [(n, s) for n in ("gdn-fp32-fp8", "gdn-fp32-nvfp4", "gdn-shared-fp8-sr",
                                                              "gdn-shared-nvfp4-near")
                                          for s in ("qwen3.5-4b", "qwen3.5-122b")]
                         + [("kda-fp32-fp8", "kimi-linear-48b")])
def test_split_fp8_nvfp4_matches_single_launch_gpu(shape, name, gluon_launches):
    """fp8_e4m3 and NVFP4 reads in the Gluon kernel: as `test_split_matches_single_launch_gpu`."""
    _gpu_split(name, shape, 8, 16, 40, {}, gluon_launches)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name, shape", [("gdn-fp32-fp16", "qwen3.5-4b"), ("gdn-fp32-bf16", "qwen3.5-122b"),
                                         ("gdn-fp32-fp8", "qwen3.5-4b"), ("gdn-shared-fp16-sr", "qwen3.5-4b"),
                                         ("kda-fp32-bf16", "kimi-linear-48b"), ("kda-fp32-fp8", "kimi-linear-48b")])
def test_split_gpu_read_mma(shape, name, gluon_launches, monkeypatch):
    """REPLAYSSM_GLUON_LP_READ_MMA (`utils.gluon_lowp.READ_MMA`, read at each launch): the rows'
    products with the key and the query on the tensor cores, as `test_split_matches_single_launch_gpu`."""
    from replayssm.ops.utils import gluon_lowp
    monkeypatch.setattr(gluon_lowp, "READ_MMA", True)
    _gpu_split(name, shape, 8, 16, 40, {}, gluon_launches)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("name, shape", [("gdn-fp32-fp16", "qwen3.5-4b"), ("gdn-fp32-fp8", "qwen3.5-122b"),
                                         ("gdn-fp32-nvfp4", "qwen3.5-4b"), ("kda-fp32-bf16", "kimi-linear-48b")])
def test_split_gpu_rows(shape, name, rows, gluon_launches, monkeypatch):
    """REPLAYSSM_GLUON_LP_ROWS (`utils.gluon_lowp.ROWS`): the default 64-row block in 4 warps
    grows to 128 rows in 4 warps (rows 2) or 2 warps (rows 4) at V = 128 (`lp_launch_rows`), as
    `test_split_matches_single_launch_gpu`."""
    from replayssm.ops.utils import gluon_lowp
    monkeypatch.setattr(gluon_lowp, "ROWS", rows)
    _gpu_split(name, shape, 8, 16, 40, {}, gluon_launches)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["kda-fp32-nvfp4", "kda-shared-nvfp4-near"])
def test_split_kda_nvfp4_matches_single_launch_gpu(name, gluon_launches):
    """KDA's NVFP4 reads in the Gluon kernel, its vector table rearranged from registers: as
    `test_split_matches_single_launch_gpu`."""
    _gpu_split(name, "kimi-linear-48b", 8, 16, 40, {}, gluon_launches)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["gdn-fp32-fp16", "gdn-fp32-bf16", "gdn-shared-fp16-sr"])
@pytest.mark.parametrize("shape", ["qwen3.5-4b", "qwen3.5-122b"])
def test_split_gpu_key_products(shape, name, gluon_launches):
    """The key head's record products formed once per row and key head before the Gluon kernel
    (`gluon_kq`), as the test above."""
    _gpu_split(name, shape, 8, 16, 40, {"gluon_kq": True}, gluon_launches)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["kda-fp32-bf16", "kda-shared-fp16-sr"])
def test_split_matches_single_launch_gpu_kda(name, gluon_launches):
    """KDA through the kernel's IS_KDA (per-channel decays, G(0) folded into the vectors), Kimi
    Linear's shape, as the GDN test."""
    _gpu_split(name, "kimi-linear-48b", 8, 16, 40, {}, gluon_launches)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["gdn-fp32-fp16", "gdn-shared-bf16-near"])
def test_split_gpu_long_window_few_flush_programs(name, gluon_launches):
    """Window 20 (record tiles of 32 positions), 24 slots, two flush programs looping over every
    flush item of a step, Gluon blocks of 32 rows (2 warps), no register cap and a cap of 80."""
    for maxnreg in (0, 80):
        gluon_launches.clear()
        _gpu_split(name, "qwen3.5-4b", 24, 20, 48,
                   {"flush_programs": 2, "gluon_BV": 32, "gluon_maxnreg": maxnreg}, gluon_launches)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["gdn-fp32-fp16", "gdn-shared-fp16-sr", "kda-fp32-bf16"])
def test_split_cuda_graph_equals_eager(name, gluon_launches):
    """The two launches captured in a CUDA graph and replayed for a window of steps (rows at
    staggered cursors, so some flush each step): the state and outputs bit for bit the eager
    split's."""
    design = DESIGNS[name]
    shape = GPU_SHAPES["kimi-linear-48b" if design[0] == "kda" else "qwen3.5-4b"]
    n, window = 16, 16
    params, pool = _pool(design, shape, n, window)
    HV, Hk, V, K = shape
    ids = torch.tensor(list(range(n)) + [-1], device=DEV)
    pool.layout.cursor.copy_(torch.arange(n, device=DEV, dtype=torch.int32) % window)
    eager, graphed = _clone(pool), _clone(pool)
    g = torch.Generator().manual_seed(1)
    xs = [{k: v.to(DEV) for k, v in make_inputs(params, n + 1, V, K, Hk, dtype=torch.float32,
                                                 generator=g).items()} for _ in range(window)]
    x_in = {k: v.clone() for k, v in xs[0].items()}
    y_g = torch.empty_like(x_in["v"])
    cfg = {"gluon": True}
    _step(params, _clone(pool), design, ids, x_in, window, cfg)          # compiles, allocates counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):                      # records the launches, runs nothing
        _step(params, graphed, design, ids, x_in, window, cfg, out=y_g, validate=False)
    for t in range(window):
        for k, v in xs[t].items():
            x_in[k].copy_(v)
        graph.replay()
        y_e = _step(params, eager, design, ids, xs[t], window, cfg)
        torch.cuda.synchronize()
        assert torch.equal(y_g, y_e), t
        _same_state(graphed, eager)
    assert len(gluon_launches) == 2 + window
    assert int((eager["epoch"] - pool.layout.epoch).sum()) == n                 # every row flushed once


@pytest.mark.gpu
@gpu
def test_gpu_gluon_by_default(gluon_launches):
    """On CUDA the step without `gluon` (and with `gluon: true`) runs the Gluon kernel, with
    `gluon: false` the single launch, and not for a format it does not cover (fp8_e4m3)."""
    for lp, config, launches in (("fp16", None, 1), ("fp16", {"gluon": False}, 0), ("bf16", {"gluon": True}, 1),
                                 ("fp8_e4m3", {"gluon": True}, 0)):
        design = ("gdn", "fp32", lp, "stochastic")
        params, pool = _pool(design, GPU_SHAPES["qwen3.5-4b"], 4, 16)
        x = {k: v.to(DEV) for k, v in make_inputs(params, 4, 128, 128, 16, dtype=torch.float32).items()}
        gluon_launches.clear()
        y = _step(params, _clone(pool), design, torch.arange(4, device=DEV), x, 16, config)
        assert len(gluon_launches) == launches and torch.isfinite(y).all(), (lp, config)
