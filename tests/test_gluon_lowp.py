"""The split step of the precision decode kernels (ops/mamba2/gluon_lowp.py): the flush rows on
the Triton kernel (`ROWS=1`), then every other row on the Gluon kernel of the steady rows, which
reads the low-precision checkpoint's raw bytes through shared memory (ops/utils/gluon_lowp.py).

What is checked, and why it can be exact:
* the NVFP4 decode trick (codes placed into fp16 bits two per 32-bit word) against
  `formats.decode`, over every code in every position of a word, on the CPU; the Gluon decode
  itself on the GPU (a probe kernel on the same helpers, unit vectors as the query: every
  decoded element bit for bit, as the products by exact zeros add nothing);
* the split against the single Triton launch (`gluon: false`), every step from the same state:
  the HP checkpoint, the LP copy, the records, cursors, epochs and arrival counters bit for bit
  (the flush rows run the same Triton code, a steady row's record is copied or formed by the same
  operations), and the outputs bit for bit on the interpreter (there the second launch is the
  Triton kernel, `split: true`, `ROWS=2`), within fp32 rounding on the GPU (the Gluon kernel sums
  in another order and applies scales to partial sums), and against the float64 reference pool
  re-synchronised to the same state;
* a CUDA graph of the two launches replays as the eager step does.
"""
import numpy as np
import pytest
import torch

from replayssm import SlotPool, formats
from replayssm.ops.mamba2 import precision
from replayssm.ops.utils.gluon import HAVE_GLUON
from replayssm.ops.utils.gluon_lowp import E2M1_PAIRS, e2m1_pair_bits, lp_gluon_views
from replayssm.ops.utils.lowp import LP_CODES, default_gluon_bv, flush_programs, lowp_config, lp_views
from replayssm.testing import make_inputs, make_params

from conftest import rel_err, spy_launches

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda" and HAVE_GLUON
FORMATS = ["fp16", "bf16", "fp8_e4m3", "nvfp4"]
# designs: (hp_format, lp_format, hp_rounding); the shared design has no LP copy
DESIGNS = [("fp32", lp, "stochastic") for lp in FORMATS] + [("bf16", "fp8_e4m3", "stochastic")] + \
          [(fmt, None, "stochastic") for fmt in FORMATS] + [("nvfp4", None, "nearest")]
DESIGN_IDS = [f"{hp}-{lp or 'shared'}-{r[:4]}" for hp, lp, r in DESIGNS]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ----------------------------------------------------------------------------------------------
# the decode trick and the config, on the CPU


def test_e2m1_pairs_decode_every_code_in_every_position():
    """Each of the eight codes of a word through its pair (`E2M1_PAIRS`, as the kernel shifts and
    masks), read as fp16 and times 2**14: `formats.decode`'s e2m1 value, for all 16 codes in all
    8 positions (the other codes of the word random, so no position leaks into another)."""
    rng = np.random.default_rng(0)
    assert len(E2M1_PAIRS) == 4
    for pos in range(8):
        for code in range(16):
            others = rng.integers(0, 16, size=8)
            others[pos] = code
            word = sum(int(c) << (4 * i) for i, c in enumerate(others))
            pair = e2m1_pair_bits(word, pos % 4)
            half = np.array([pair & 0xFFFF, pair >> 16], dtype=np.uint16).view(np.float16)
            got = float(half[pos // 4]) * 2.0 ** 14
            # the reference: one byte holding the code in its nibble, scale 1, tensor scale 1
            parts = {"data": torch.tensor([[[[code | (code << 4)]]]], dtype=torch.uint8).repeat(1, 1, 1, 8),
                     "scale": torch.ones(1, 1, 1, 1).to(torch.float8_e4m3fn),
                     "tensor_scale": torch.ones(1, 1)}
            want = formats.decode(parts, "nvfp4")[0, 0, 0, 0].item()
            assert want == (-1.0 if code & 8 else 1.0) * E2M1[code & 7]
            assert got == want and np.signbit(got) == np.signbit(want), (pos, code, got, want)


def test_e4m3_convert_matches_formats_over_every_code():
    """The fp8 and NVFP4-scale decode is the e4m3 convert (`bitcast` to float8e4nv, to float32):
    bit for bit `formats.decode`'s value for all 256 codes (NaN for 0x7F and 0xFF)."""
    codes = torch.arange(256, dtype=torch.uint8)
    conv = codes.view(torch.float8_e4m3fn).float()
    parts = {"data": codes.view(torch.float8_e4m3fn).reshape(1, 1, 1, 256), "scale": torch.ones(1, 1, 1)}
    ref = formats.decode(parts, "fp8_e4m3").flatten()
    nan = (codes & 0x7F) == 0x7F
    assert torch.isnan(conv[nan]).all() and torch.isnan(ref[nan]).all()
    assert torch.equal(conv[~nan].view(torch.int32), ref[~nan].view(torch.int32))


def test_lowp_config_split_keys():
    """The split's keys: defaults (Gluon on, its block as the fp32 Gluon tables choose), bad values
    refused with the key named, `flush_programs` capped by the items."""
    assert lowp_config(64, None) == {"BV": 16, "num_warps": 4}          # the Triton launch's alone
    assert lowp_config(64, {"gluon": False}) == {"BV": 16, "num_warps": 4, "gluon": False}
    cfg = lowp_config(64, None, split=True)
    assert cfg["gluon"] is True and cfg["gluon_BV"] == 64 and cfg["split"] is False
    assert cfg["flush_programs"] is None and cfg["gluon_maxnreg"] == 0
    assert default_gluon_bv(80) == 16 and default_gluon_bv(96) == 32 and default_gluon_bv(128) == 64
    assert cfg["gluon_recmask"] is None and cfg["gluon_kq"] is None
    for bad in ({"gluon": 1}, {"split": "yes"}, {"gluon_BV": 48}, {"gluon_BV": True}, {"gluon_maxnreg": 300},
                {"flush_programs": 0}, {"flush_programs": 2.0}, {"gluon_recmask": 1}, {"gluon_kq": 1},
                {"glon": True}):
        with pytest.raises(ValueError, match=next(iter(bad)) if "glon" not in bad else "unknown"):
            lowp_config(64, bad)
    assert flush_programs({"flush_programs": 7}, 100, "cpu") == 7
    assert flush_programs({"flush_programs": 700}, 100, "cpu") == 100
    assert flush_programs({"flush_programs": None}, 100, "cpu") == 8


@pytest.mark.parametrize("nvec,strided", [(1, False), (2, False), (1, True)])
@pytest.mark.parametrize("rec", [torch.float32, torch.bfloat16])
def test_key_products_match_torch(rec, nvec, strided):
    """`gluon_kq`'s (and the fp32 Mamba-2 decode's `kq`) first launch (utils/key_products.py;
    Triton, so the interpreter runs it): each row's key records below its cursor dotted with its
    one (Mamba-2) or two (GDN) vectors per key head; zeros from the cursor on and for a padding
    row, whatever the records past the cursor hold (NaN here). `strided`: keys and cursors in
    slot-strided views (vLLM's pages; `utils.launch.slot_pads`), the padding between slots NaN."""
    from replayssm.ops.utils.key_products import key_products
    from replayssm.ops.utils.launch import slot_pads
    g = torch.Generator().manual_seed(3)
    N, Lb, Hk, K, BL, Bt = 5, 9, 2, 16, 16, 5
    buf_k = torch.randn(N, Lb, Hk, K, generator=g).to(rec)
    cursor = torch.tensor([0, 3, 8, 5, 1], dtype=torch.int32)
    for s, h in enumerate(cursor.tolist()):
        buf_k[s, h:] = float("nan")
    slot_ids = torch.tensor([4, 2, -1, 1, 0])
    xs = [torch.randn(Bt, Hk, K, generator=g) for _ in range(nvec)]
    buf_kd, cursor_d, pads = buf_k.to(DEV), cursor.to(DEV), {}
    if strided:
        page_k = torch.full((N, Lb * Hk * K + 24), float("nan"), dtype=rec, device=DEV)
        page_k[:, :Lb * Hk * K] = buf_kd.reshape(N, -1)
        buf_kd = page_k[:, :Lb * Hk * K].view(N, Lb, Hk, K)
        page_c = torch.full((N, 3), 99, dtype=torch.int32, device=DEV)
        page_c[:, 0] = cursor_d
        cursor_d = page_c[:, 0]
        p = slot_pads(buf_kd, buf_kd, buf_kd, buf_kd, cursor_d)
        pads = dict(pad_k=p["pad_k"], pad_cur=p["pad_cur"])
        assert pads == dict(pad_k=24, pad_cur=2)
    kq = key_products([x.to(DEV) for x in xs], buf_kd, cursor_d, slot_ids.to(DEV), BL, **pads)
    kq = kq.cpu().reshape(Bt, Hk, nvec, BL)
    for b, s in enumerate(slot_ids.tolist()):
        want = torch.zeros(Hk, nvec, BL)
        if s >= 0:
            h = int(cursor[s])
            for i, x in enumerate(xs):
                want[:, i, :h] = torch.einsum("jgk,gk->gj", buf_k[s, :h].float(), x[b])
        assert torch.allclose(kq[b], want, rtol=1e-5, atol=1e-6), (b, kq[b], want)


# ----------------------------------------------------------------------------------------------
# the split against the single launch


def _pool(design, shape, n, window, backend="triton"):
    hp, lp, rounding = design
    HV, Hk, V, K = shape
    params = make_params("mamba2", HV, K, seed=2)
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
    hp, lp, rounding = design
    out = torch.full_like(x["x"], float("nan")) if out is None else out
    inputs = dict(x)
    z = inputs.pop("z", None)
    return precision.lowp_decode(A=params.A, dt_bias=params.dt_bias, D=params.D, z=z, **inputs,
                                 ckpt=st["ckpt"]["data"] if hp == "fp32" else st["ckpt"], ckpt_lp=st["ckpt_lp"],
                                 lp_format=lp, buf_ld=st["buf"]["ld"], buf_w=st["buf"]["w"], buf_k=st["buf"]["k"],
                                 cursor=st["cursor"], epoch=st["epoch"], slot_ids=ids, window=window, out=out,
                                 arrive=st["arrive"], config=config, validate=validate, hp_format=hp,
                                 seed=st["seed"], hp_rounding=rounding)


def _bits_equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def _same_state(a, b):
    assert _bits_equal(a["ckpt"], b["ckpt"]), "HP checkpoint"
    assert _bits_equal(a["ckpt_lp"], b["ckpt_lp"]), "LP copy"
    for k in a["buf"]:
        assert torch.equal(a["buf"][k].view(torch.uint8), b["buf"][k].view(torch.uint8)), f"records {k}"
    for k in ("cursor", "epoch", "arrive"):
        assert torch.equal(a[k], b[k]), k
    assert not a["arrive"].any()


def _poison_past_cursor(st):
    """NaN in every record at and past each slot's cursor: what a step may find there (drafts
    not committed, an earlier window's records), which no read may take into a sum."""
    pos = torch.arange(next(iter(st["buf"].values())).shape[1], device=st["cursor"].device)
    past = pos[None, :] >= st["cursor"][:, None].long()
    for t in st["buf"].values():
        if t.is_floating_point():
            t[past] = float("nan")


def _sync(ref, st):
    """The reference pool takes the split's state, so that a step compares from one state."""
    lay = ref.layout
    for k, t in st["ckpt"].items():
        lay.ckpt[k].copy_(t)
    for k, t in (st["ckpt_lp"] or {}).items():
        lay.ckpt_lp[k].copy_(t)
    for k, t in st["buf"].items():
        lay.buf[k].copy_(t)
    lay.cursor.copy_(st["cursor"])
    lay.epoch.copy_(st["epoch"])


def _run_split(design, shape, n, window, steps, split_config, exact, ref_every=1):
    """`steps` steps, rows joining one per step (staggered cursors) plus a padding row, on two
    copies of one pool's state (NaN in the records past every cursor before each step): the
    single launch and the split. Returns the largest output gaps
    (split against single on the steady rows, against the synced reference pool every
    `ref_every` steps: by reading the code, the reference pool's per-row float64 step is most
    of a GPU case's time) and counts."""
    params, pool = _pool(design, shape, n, window)
    _, ref = _pool(design, shape, n, window, backend="reference")
    single, split = _clone(pool), _clone(pool)
    g = torch.Generator().manual_seed(1)
    HV, Hk, V, K = shape
    gaps = dict(single=0.0, ref=0.0, flushes=0, steady=0)
    for step in range(steps):
        rows = list(range(min(step + 1, n))) + [-1]
        ids = torch.tensor(rows, device=DEV)
        x = {k: v.to(DEV) for k, v in make_inputs(params, len(rows), V, K, Hk, dtype=torch.float32,
                                                    generator=g).items()}
        for st in (single, split):
            _poison_past_cursor(st)
        h0 = split["cursor"][ids.clamp(min=0).long()]
        live = ids >= 0
        flush = live & (h0 + 1 >= window)
        check_ref = step % ref_every == 0
        if check_ref:
            _sync(ref, split)
            y_ref = ref.decode(ids, **x)
        y_one = _step(params, single, design, ids, x, window, {"gluon": False})
        y_two = _step(params, split, design, ids, x, window, split_config)
        _same_state(split, single)
        assert torch.equal(y_two[-1], torch.zeros_like(y_two[-1]))                       # padding row
        assert torch.isfinite(y_two).all()
        # the flush rows are the same Triton code's in both
        assert torch.equal(y_two[flush], y_one[flush]), step
        steady = live & ~flush
        if exact:
            assert torch.equal(y_two, y_one), step
        if steady.any():
            gaps["single"] = max(gaps["single"], rel_err(y_two[steady], y_one[steady]))
        if check_ref:
            gaps["ref"] = max(gaps["ref"], rel_err(y_two[live], y_ref[live]))
            gaps["ref_steps"] = gaps.get("ref_steps", 0) + 1
        gaps["flushes"] += int(flush.sum())
        gaps["steady"] += int(steady.sum())
    return gaps


# CI runs an LP copy (fp16) and a shared NVFP4 checkpoint; the other designs slow
@pytest.mark.parametrize("design", [pytest.param(DESIGNS[i], id=DESIGN_IDS[i], marks=() if i in (0, 9) else pytest.mark.slow)
                                    for i in (0, 3, 4, 7, 9)])
def test_split_matches_single_launch_interpreter(design):
    """The split in Triton (`split: true`: `ROWS=1` with 3 programs looping over the flush rows'
    items, then `ROWS=2`) is the single launch bit for bit in everything, 10 steps, window 4,
    rows at staggered cursors, a padding row; the outputs within fp32 rounding of the float64
    reference pool from the same state (measured 1e-7)."""
    gaps = _run_split(design, (4, 2, 12, 48), 3, 4, 10, {"split": True, "flush_programs": 3}, True)
    assert gaps["flushes"] >= 4 and gaps["steady"] >= 10, gaps
    assert gaps["ref"] < 1e-5, gaps


# ----------------------------------------------------------------------------------------------
# on the GPU: the Gluon kernel


GPU_SHAPES = {"super": (128, 8, 64, 128), "nano4b": (96, 8, 80, 128)}
gpu = pytest.mark.skipif(not GPU, reason="needs CUDA and Gluon")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("design", DESIGNS, ids=DESIGN_IDS)
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_split_matches_single_launch_gpu(shape, design):
    """SPEC shapes, window 16, 8 slots, 40 steps (two windows and more at staggered cursors), a
    padding row: the split with the Gluon kernel against the single launch (state bit for bit,
    steady outputs within 1e-5: fp32 rounding in another order) at every step, and the
    reference pool (1e-4) at every third step."""
    gaps = _run_split(design, GPU_SHAPES[shape], 8, 16, 40, {"gluon": True}, False, ref_every=3)
    print(shape, design, gaps)
    assert gaps["flushes"] >= 8 and gaps["steady"] >= 200 and gaps["ref_steps"] == 14, gaps
    assert gaps["single"] < 1e-5 and gaps["ref"] < 1e-4, gaps


def _lp_launches(monkeypatch) -> list:
    """`(NH, RMMA, BV, num_warps)` of every Mamba-2 Gluon read launch, appended as they run (NH 1:
    the one-head kernel): what a switch's test asserts reached the kernel."""
    from replayssm.ops.mamba2 import gluon_lowp, gluon_lowp_heads
    seen = []

    def record(kw):
        seen.append((kw.get("NH", 1), kw["RMMA"], kw["BV"], kw["num_warps"]))
    spy_launches(monkeypatch, gluon_lowp, "_gluon_lp_kernel", record)
    spy_launches(monkeypatch, gluon_lowp_heads, "_gluon_lp_heads_kernel", record)
    return seen


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("design", [DESIGNS[i] for i in (0, 1, 2, 7)], ids=[DESIGN_IDS[i] for i in (0, 1, 2, 7)])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_split_gpu_read_mma(shape, design, monkeypatch):
    """REPLAYSSM_GLUON_LP_READ_MMA (`utils.gluon_lowp.READ_MMA`, read at each launch): fp16, bf16
    and fp8 rows summed on the tensor cores, as `test_split_matches_single_launch_gpu`."""
    from replayssm.ops.utils import gluon_lowp
    monkeypatch.setattr(gluon_lowp, "READ_MMA", True)
    seen = _lp_launches(monkeypatch)
    gaps = _run_split(design, GPU_SHAPES[shape], 8, 16, 40, {"gluon": True}, False, ref_every=3)
    assert gaps["flushes"] >= 8 and gaps["steady"] >= 200 and gaps["single"] < 1e-5 and gaps["ref"] < 1e-4, gaps
    assert seen and {x[1] for x in seen} == {True}, seen


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize("design", [DESIGNS[i] for i in (0, 2, 3, 7, 9)], ids=[DESIGN_IDS[i] for i in (0, 2, 3, 7, 9)])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_split_gpu_heads(shape, design, heads, monkeypatch):
    """REPLAYSSM_GLUON_LP_HEADS (`mamba2.gluon_lowp.HEADS`, read at each launch): several heads of
    a group per program (gluon_lowp_heads.py), as `test_split_matches_single_launch_gpu`."""
    from replayssm.ops.mamba2 import gluon_lowp
    monkeypatch.setattr(gluon_lowp, "HEADS", heads)
    seen = _lp_launches(monkeypatch)
    gaps = _run_split(design, GPU_SHAPES[shape], 8, 16, 40, {"gluon": True}, False, ref_every=3)
    assert gaps["flushes"] >= 8 and gaps["steady"] >= 200 and gaps["single"] < 1e-5 and gaps["ref"] < 1e-4, gaps
    assert seen and {x[0] for x in seen} == {heads}, seen


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("design", [DESIGNS[i] for i in (0, 2, 7)], ids=[DESIGN_IDS[i] for i in (0, 2, 7)])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_split_gpu_heads_read_mma(shape, design, monkeypatch):
    """Both switches: two heads per program, their rows summed on the tensor cores."""
    from replayssm.ops.mamba2 import gluon_lowp
    from replayssm.ops.utils import gluon_lowp as utils_lowp
    monkeypatch.setattr(gluon_lowp, "HEADS", 2)
    monkeypatch.setattr(utils_lowp, "READ_MMA", True)
    seen = _lp_launches(monkeypatch)
    gaps = _run_split(design, GPU_SHAPES[shape], 8, 16, 40, {"gluon": True}, False, ref_every=3)
    assert gaps["flushes"] >= 8 and gaps["steady"] >= 200 and gaps["single"] < 1e-5 and gaps["ref"] < 1e-4, gaps
    assert seen and set(x[:2] for x in seen) == {(2, True)}, seen


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("design", [DESIGNS[i] for i in (0, 2, 3, 7)], ids=[DESIGN_IDS[i] for i in (0, 2, 3, 7)])
@pytest.mark.parametrize("bv", [64, 16])
def test_split_gpu_rows(bv, design, rows, monkeypatch):
    """REPLAYSSM_GLUON_LP_ROWS (`utils.gluon_lowp.ROWS`, read at each launch), as
    `test_split_matches_single_launch_gpu`, at Super's shape (`lp_launch_rows`): 64-row blocks
    keep their rows in 2 or 1 warps; 16-row blocks (one warp, 4 a head) grow to 32 or 64 rows."""
    from replayssm.ops.utils import gluon_lowp
    monkeypatch.setattr(gluon_lowp, "ROWS", rows)
    seen = _lp_launches(monkeypatch)
    gaps = _run_split(design, GPU_SHAPES["super"], 8, 16, 40, {"gluon": True, "gluon_BV": bv}, False, ref_every=3)
    assert gaps["flushes"] >= 8 and gaps["steady"] >= 200 and gaps["single"] < 1e-5 and gaps["ref"] < 1e-4, gaps
    want = (64, 4 // rows) if bv == 64 else (16 * rows, 1)
    assert seen and {x[2:] for x in seen} == {want}, seen


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lp", FORMATS)
def test_split_gpu_recmask(lp):
    """The Gluon kernel's record loads predicated on the cursor (`gluon_recmask`, off by default
    for Mamba-2): the same state and steady outputs as the single launch."""
    gaps = _run_split(("fp32", lp, "stochastic"), GPU_SHAPES["super"], 8, 16, 40,
                      {"gluon": True, "gluon_recmask": True}, False)
    assert gaps["flushes"] >= 8 and gaps["single"] < 1e-5 and gaps["ref"] < 1e-4, gaps


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lp", FORMATS)
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_split_gpu_key_products_off(shape, lp):
    """The Gluon kernel forming the group's key products itself (`gluon_kq: false`; by default a
    launch before it forms them once per row and group): the same state and steady outputs as the
    single launch."""
    gaps = _run_split(("fp32", lp, "stochastic"), GPU_SHAPES[shape], 8, 16, 40,
                      {"gluon": True, "gluon_kq": False}, False)
    assert gaps["flushes"] >= 8 and gaps["single"] < 1e-5 and gaps["ref"] < 1e-4, gaps


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lp", FORMATS)
def test_split_gpu_long_window_few_flush_programs(lp):
    """Window 20 (record tiles of 32 positions), 24 slots, two flush programs looping over every
    flush item of a step, Gluon blocks of 32 rows (2 warps)."""
    gaps = _run_split(("fp32", lp, "stochastic"), GPU_SHAPES["super"], 24, 20, 48,
                      {"gluon": True, "flush_programs": 2, "gluon_BV": 32}, False)
    assert gaps["flushes"] >= 24 and gaps["single"] < 1e-5 and gaps["ref"] < 1e-4, gaps


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("design,kq", [(DESIGNS[0], None), (DESIGNS[3], None), (DESIGNS[8], None), (DESIGNS[0], False)],
                         ids=[DESIGN_IDS[i] for i in (0, 3, 8)] + [DESIGN_IDS[0] + "-no-kq"])
def test_split_cuda_graph_equals_eager(design, kq):
    """The two launches captured in a CUDA graph and replayed for a window of steps (rows at
    staggered cursors, so some flush each step): the state and outputs bit for bit the eager
    split's."""
    shape, n, window = GPU_SHAPES["super"], 16, 16
    params, pool = _pool(design, shape, n, window)
    HV, Hk, V, K = shape
    ids = torch.tensor(list(range(n)) + [-1], device=DEV)
    pool.layout.cursor.copy_(torch.arange(n, device=DEV, dtype=torch.int32) % window)
    eager, graphed = _clone(pool), _clone(pool)
    g = torch.Generator().manual_seed(1)
    xs = [{k: v.to(DEV) for k, v in make_inputs(params, n + 1, V, K, Hk, dtype=torch.float32,
                                                 generator=g).items()} for _ in range(window)]
    x_in = {k: v.clone() for k, v in xs[0].items()}
    y_g = torch.empty_like(x_in["x"])
    cfg = {"gluon": True, "gluon_kq": kq}
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
    assert int((eager["epoch"] - pool.layout.epoch).sum()) == n                 # every row flushed once


# the decode itself, through the kernel's helpers (defined wherever Gluon is, so that an offline
# compile for sm_90a can keep this GPU-only probe in step with the helpers' signatures)
if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

    from replayssm.ops.utils.gluon import _barrier
    from replayssm.ops.utils.gluon_lowp import (lp_block_scales, lp_row_factor, lp_row_sums, lp_tile_to_shared,
                                               lp_vector)

    @gluon.jit
    def _probe_kernel(lp_data, lp_scale, lp_tscale, eye, out, V: gl.constexpr, K: gl.constexpr, BV: gl.constexpr,
                      LP: gl.constexpr, NW: gl.constexpr):
        # program (matrix, column k, row block): the rows' products with the unit vector e_k
        i_m = gl.program_id(0)
        i_k = gl.program_id(1)
        v0 = gl.program_id(2) * BV
        KE: gl.constexpr = K // 8 if LP == 4 else K
        s_T = lp_tile_to_shared(lp_data + i_m * (V * KE) + v0 * KE, BV, K, LP, NW)
        LY: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        o_k = gl.arange(0, K, layout=LY)
        b_e = gl.load(eye + i_k * K + o_k)
        b_v = lp_vector(b_e, eye + i_k * K, K, LP, NW, True)
        if LP == 4:
            sc_a = lp_block_scales(lp_scale, i_m, v0, V, K, 8 * NW, NW)
            sc_b = lp_block_scales(lp_scale, i_m, v0 + 8 * NW, V, K, 8 * NW, NW)
        else:
            sc_a = 0
            sc_b = 0
        cp.wait_group(0)
        _barrier()
        s_y = gl.allocate_shared_memory(gl.float32, [BV], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        lp_row_sums(s_T, b_v, s_y, sc_a, sc_b, BV, K, LP, NW)
        _barrier()
        o_y = gl.arange(0, BV, layout=LY)
        b_y = s_y.load(LY) * lp_row_factor(lp_scale, lp_tscale, i_m, v0 + o_y, V, LP)
        gl.store(out + (i_m * V + v0 + o_y) * K + i_k, b_y)


def _probe_parts(fmt, M, V, K, g):
    """Parts holding every finite code of the format (fp16/bf16: all 65536 bit patterns but the
    non-finite, as zeros; fp8: all 254 finite codes at every column, random row scales, one row
    of NaN codes; NVFP4: all 16 codes at every position, random finite block scales with
    subnormals, random tensor scales)."""
    n = M * V * K
    if fmt in ("fp16", "bf16"):
        bits = torch.arange(n, dtype=torch.int32) % 65536
        dt = torch.float16 if fmt == "fp16" else torch.bfloat16
        vals = bits.to(torch.int16).view(dt)
        vals = torch.where(torch.isfinite(vals.float()), vals, torch.zeros_like(vals))
        return {"data": vals.reshape(M, 1, V, K)}
    if fmt == "fp8_e4m3":
        codes = torch.randint(0, 256, (M, 1, V, K), generator=g, dtype=torch.int32)
        codes[0, 0, :2] = torch.arange(256).reshape(2, 128)
        codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)
        codes[0, 0, V - 1] = 0x7F                                                   # a NaN row
        scale = torch.exp(4 * torch.randn(M, 1, V, generator=g))
        return {"data": codes.to(torch.uint8).view(torch.float8_e4m3fn), "scale": scale}
    codes = torch.randint(0, 16, (M, 1, V, K), generator=g)
    codes[0, 0, :16] = torch.arange(16).reshape(16, 1).expand(16, K)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    sb = torch.randint(1, 127, (M, 1, V, K // 16), generator=g, dtype=torch.int32)
    sb[0, 0, 0, :7] = torch.arange(1, 8)                                            # subnormal scales
    return {"data": packed, "scale": sb.to(torch.uint8).view(torch.float8_e4m3fn),
            "tensor_scale": torch.exp(2 * torch.randn(M, 1, generator=g))}


def _probe_equal(out, want):
    """The probe's comparison: bit for bit, but for the sign of a zero. A row's product with a
    unit vector e_i is `value_i + sum of value_k * 0`, and a +0 term turns -0 into +0: a -0
    element (e4m3 0x80, e2m1 code 8) comes out -0 only in a row whose other elements are all
    negative (the fp16/bf16 probe's rows are; the fp8 and NVFP4 rows are random, so the H200's
    strict comparison failed there on exactly those elements)."""
    def unsigned(t):
        return torch.where(t == 0, torch.zeros_like(t), t)
    return torch.equal(unsigned(out).view(torch.int32), unsigned(want).view(torch.int32))


def test_probe_comparison_blind_to_the_sign_of_zero_only():
    # an fp8 row with -0 (0x80) among positive codes: its product with e_0, summed in fp32 as
    # the probe's kernel sums it, is +0; the comparison takes it and nothing else
    row = torch.tensor([0x80, 0x38, 0x01, 0xB8], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    got = torch.stack([(row * torch.eye(4)[i]).sum() for i in range(4)])
    assert torch.signbit(row[0]) and not torch.signbit(got[0])
    assert not torch.equal(got.view(torch.int32), row.view(torch.int32)) and _probe_equal(got, row)
    # one ulp off in one element, a sign flipped, a zero made the smallest subnormal: refused
    one_ulp = got.clone()
    one_ulp[2] = one_ulp[2].nextafter(torch.tensor(1.0))
    tiny = got.clone()
    tiny[0] = 2.0 ** -149
    assert not _probe_equal(one_ulp, row) and not _probe_equal(-got, row) and not _probe_equal(tiny, row)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("nw", [1, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gluon_decode_bit_exact(fmt, nw):
    """The Gluon read of every format (copy, read-back, decode, scales): each element's decoded
    value bit for bit `formats.decode`'s (rows' products with unit vectors), NaN rows NaN, but
    for the sign of zero (`_probe_equal`). The fp8 and NVFP4 formats stay on the Triton kernel
    (`gluon_lp_unsupported`) until this has passed on the GPU."""
    g = torch.Generator().manual_seed(0)
    K, BV = 128, 16 * nw
    M, V = (8, 64) if fmt in ("fp16", "bf16") else (2, 2 * BV)
    parts = {k: v.to(DEV) for k, v in _probe_parts(fmt, M, V, K, g).items()}
    want = formats.decode(parts, fmt)[:, 0]
    d, s, t = lp_views(parts, fmt, M, 1, V, K)
    code = LP_CODES[fmt]
    out = torch.full((M, V, K), 12345.0, device=DEV)
    eye = torch.eye(K, device=DEV)
    _probe_kernel[(M, K, V // BV)](lp_gluon_views(d, code), s, t, eye, out, V=V, K=K, BV=BV, LP=code, NW=nw,
                                   num_warps=nw)
    nan = torch.isnan(want).any(dim=-1, keepdim=True).expand_as(want)
    assert torch.isnan(out[nan]).all()
    assert _probe_equal(out[~nan], want[~nan])


def test_heads_unsupported_reasons():
    # the several-heads kernel's cover (gluon_lowp_heads.py): heads of one group, every read format
    from replayssm.ops.mamba2.gluon_lowp_heads import heads_unsupported
    assert heads_unsupported(2, 3, 128, 8) == "" and heads_unsupported(4, 4, 96, 8) == ""
    assert "power of two" in heads_unsupported(3, 1, 128, 8)
    assert "nvfp4" in heads_unsupported(2, 5, 128, 8)
    assert "divide" in heads_unsupported(8, 1, 96, 8)          # Nano-4B: 12 heads a group
    # Super's 64-row fp16 tiles: 4 heads are 64 KB a program, 16 would not fit an SM
    assert heads_unsupported(4, 1, 128, 8, 64, 128) == "" and heads_unsupported(8, 3, 128, 8, 64, 128) == ""
    assert "256 KB of tiles" in heads_unsupported(16, 1, 128, 8, 64, 128)


def test_lp_launch_rows():
    # more rows per thread: the block grows while it divides V, then the warps shrink
    from replayssm.ops.utils.gluon_lowp import lp_launch_rows
    assert lp_launch_rows(32, 128, 1, 1) == (32, 2) and lp_launch_rows(32, 128, 3, 2) == (64, 2)
    assert lp_launch_rows(32, 128, 1, 4) == (128, 2) and lp_launch_rows(32, 128, 2, 8) == (128, 1)
    assert lp_launch_rows(64, 64, 3, 2) == (64, 2) and lp_launch_rows(64, 64, 1, 4) == (64, 1)
    assert lp_launch_rows(16, 80, 1, 4) == (16, 1) and lp_launch_rows(32, 128, 4, 4) == (128, 2)
