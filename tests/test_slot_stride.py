"""The windowed decode and verify kernels on slot-strided state (ops/utils/launch.py
`slot_pads`): each state tensor a view whose rows lie one page apart, the page holding one
row of every tensor side by side, as vLLM lays out a request's state. The outputs and every
byte of state equal those of the same call on contiguous tensors (on the GPU the floats to
rounding: `_same`), on each kernel path (the
Triton decode kernels, Mamba-2's rows kernel, GDN's materialising kernel, the FMA and
tensor-core verify kernels; on a GPU the Gluon ones too); the page's bytes outside the
tensors are untouched. The eager step (window 1) takes no slot stride and refuses such views.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from replayssm.ops import gdn, kda, mamba2  # noqa: E402
from replayssm.ops.utils.launch import gluon_aligned, slot_pads, slot_strided  # noqa: E402
from replayssm.ops.utils.gluon import HAVE_GLUON  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
N, L = 5, 4
PAD = 64                       # bytes of each page no tensor owns (vLLM pads pages too)
ROUND = 256                    # pages a multiple of this: vLLM sizes them by attention blocks
STATE = ("ckpt", "buf_ld", "buf_w", "buf_k", "cursor", "pending")


def _paged(tensors: dict):
    """Copies of `tensors` (each `[N, ...]`) as views into one buffer of `N` pages, each page
    one row of every tensor in turn plus PAD bytes; returns (views, raw pages)."""
    sizes = {n: t[0].numel() * t.element_size() for n, t in tensors.items()}
    page = -(-(sum(sizes.values()) + PAD) // ROUND) * ROUND
    raw = torch.full((N * page,), 0xA5, dtype=torch.uint8, device=DEV)
    views, off = {}, 0
    for n, t in tensors.items():
        es = t.element_size()
        assert page % es == 0 and off % es == 0
        inner = t[0].contiguous().stride()
        v = torch.as_strided(raw.view(t.dtype), t.shape, (page // es, *inner), off // es)
        v.copy_(t)
        views[n] = v
        off += sizes[n]
    return views, raw, page


def _state(family, HV, Hk, V, K, T, g, rec=torch.float32):
    ld_shape = (N, L + T, HV, K) if family == "kda" else (N, L + T, HV)
    st = {"ckpt": torch.randn(N, HV, V, K, generator=g) * 0.3,
          "buf_ld": -torch.rand(*ld_shape, generator=g) * 0.2,
          "buf_w": (torch.randn(N, L + T, HV, V, generator=g) * 0.3).to(rec),
          "buf_k": (torch.randn(N, L + T, Hk, K, generator=g) * 0.3).to(rec),
          # cursors 0, L-1 (a decode flush), spread; verify's early flush where h + T > L
          "cursor": torch.tensor([0, L - 1, 1, 2, L - 1], dtype=torch.int32)[:N],
          "pending": torch.zeros(N, dtype=torch.int32)}
    return {n: t.to(DEV) for n, t in st.items()}


def _inputs(family, HV, Hk, V, K, lead, g):
    def r(*s):
        return torch.randn(*lead, *s, generator=g).to(DEV)
    if family == "mamba2":
        return dict(x=r(HV, V), dt=r(HV), B=r(Hk, K), C=r(Hk, K))
    return dict(q=r(Hk, K), k=r(Hk, K), v=r(HV, V), a=r(HV, K) if family == "kda" else r(HV), b=r(HV))


def _params(family, HV, K, g):
    if family == "mamba2":
        return dict(A=(-torch.rand(HV, generator=g) - 0.5).to(DEV), dt_bias=(torch.randn(HV, generator=g) * 0.1).to(DEV),
                    D=torch.randn(HV, generator=g).to(DEV), z=None)
    dt_bias = torch.randn(HV, K, generator=g) if family == "kda" else torch.randn(HV, generator=g)
    return dict(A_log=(torch.randn(HV, generator=g) * 0.3).to(DEV), dt_bias=(dt_bias * 0.1).to(DEV), scale=None)


_OPS = {"mamba2": mamba2, "gdn": gdn, "kda": kda}


def _call(family, op, inp, prm, st, ids, T, config):
    ops = _OPS[family]
    epoch, arrive = st["epoch"], st["arrive"]
    args = dict(**inp, **prm, ckpt=st["ckpt"], buf_ld=st["buf_ld"], buf_w=st["buf_w"], buf_k=st["buf_k"],
                cursor=st["cursor"], epoch=epoch, slot_ids=ids, window=L, config=config, arrive=arrive)
    if op == "decode":
        return ops.replay_decode(**args)
    nd = torch.tensor([T, 1, T, max(1, T - 1)][:ids.numel()], dtype=torch.int32, device=DEV)
    return ops.replay_verify(**args, pending=st["pending"], num_drafts=nd)


SHAPE = dict(HV=4, Hk=2, V=16, K=16)
CASES = [  # (family, op, T, config): each kernel path the plugin can reach
    ("mamba2", "decode", 1, {"gluon": False}),
    ("mamba2", "decode", 1, {"gluon": False, "rows": True, "BV": 16}),
    ("mamba2", "verify", 2, {"gluon": False}),
    ("mamba2", "verify", 6, {"gluon": False}),                       # T >= TC_MIN_T: tensor cores
    ("gdn", "decode", 1, {"gluon": False}),
    ("gdn", "decode", 1, {"gluon": False, "mat": True, "BKT": 16}),
    ("gdn", "verify", 3, {"gluon": False}),
    ("kda", "decode", 1, {"gluon": False}),
    ("kda", "verify", 2, {"gluon": False}),
]
GLUON_CASES = [
    ("mamba2", "decode", 1, {"gluon": True}),
    ("mamba2", "decode", 1, {"gluon": True, "kq": True}),              # the group's products first
    ("mamba2", "verify", 3, {"gluon": True}),
    ("mamba2", "verify", 3, {"gluon": True, "kq": True}),              # the group's products first
    ("gdn", "decode", 1, {"gluon": True}),
    ("gdn", "verify", 3, {"gluon": True}),
    ("mamba2", "verify", 4, {"gluon": True, "mma": True}),             # the tile's products on the tensor cores
    ("gdn", "verify", 4, {"gluon": True, "mma": True}),
    ("kda", "decode", 1, {"gluon": True, "BC": 4}),                  # KDA's flush, 4 records an iteration
]


def _same(a, b, name):
    """Bit-equal under the interpreter. On the GPU the compiler picks load widths and register
    layouts from the alignment it can prove, which the page's slot strides change, and with
    them the order of the reductions: the floats then agree to rounding, the integers exactly."""
    if GPU and a.is_floating_point():
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, (a - b).abs().max())
    else:
        assert torch.equal(a, b), (name, (a.double() - b.double()).abs().max())


def _check(family, op, T, config, shape=SHAPE, rec=torch.float32, gluon=False):
    g = torch.Generator().manual_seed(7)
    HV, Hk, V, K = shape["HV"], shape["Hk"], shape["V"], shape["K"]
    flat = _state(family, HV, Hk, V, K, T, g, rec)
    paged, raw, page = _paged({n: flat[n] for n in STATE})
    assert all(slot_strided(paged[n]) for n in STATE) and not paged["ckpt"].is_contiguous()
    assert slot_pads(paged["ckpt"], paged["buf_ld"], paged["buf_w"], paged["buf_k"], paged["cursor"])["pad_ckpt"] > 0
    # the Gluon cases' pages keep the alignment the Gluon kernels need, so that they run
    assert gluon_aligned(paged["ckpt"], paged["buf_ld"], paged["buf_w"], paged["buf_k"]) or not gluon
    for st in (flat, paged):
        st["epoch"] = torch.zeros(N, dtype=torch.int64, device=DEV)
        st["arrive"] = torch.zeros(N, dtype=torch.int32, device=DEV)
    prm = _params(family, HV, K, g)
    ids = torch.tensor([3, -1, 0, 4], dtype=torch.int32, device=DEV)    # a padding row, slots out of order
    for _ in range(2):                                                   # twice: flushed rows go on
        inp = _inputs(family, HV, Hk, V, K, (4,) if op == "decode" else (4, T), g)
        y0 = _call(family, op, inp, prm, flat, ids, T, config)
        y1 = _call(family, op, inp, prm, paged, ids, T, config)
        _same(y0, y1, "out")
        for n in STATE + ("epoch",):
            _same(flat[n], paged[n], n)
        if op == "verify":                                               # accept one draft per row
            for st in (flat, paged):
                live = ids[ids >= 0].long()
                st["cursor"][live] += st["pending"][live]
                st["pending"][live] = 0
    tail = raw.view(N, page)[:, sum(t[0].numel() * t.element_size() for t in (paged[n] for n in STATE)):]
    assert bool((tail == 0xA5).all())                                   # bytes no tensor owns


@pytest.mark.interpret
@pytest.mark.parametrize("family,op,T,config", CASES, ids=lambda c: str(c))
def test_strided_state_equals_contiguous(family, op, T, config):
    _check(family, op, T, config)


@pytest.mark.gpu
@pytest.mark.skipif(not (GPU and HAVE_GLUON), reason="needs a CUDA device and Triton's Gluon")
@pytest.mark.parametrize("family,op,T,config", GLUON_CASES, ids=lambda c: str(c))
def test_gluon_strided_state_equals_contiguous(family, op, T, config):
    shape = dict(HV=16, Hk=2, V=64, K=128)          # rows of 16-element multiples: Gluon-aligned pages
    _check(family, op, T, config, shape=shape, gluon=True)


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_eager_step_refuses_slot_strided_state(family):
    g = torch.Generator().manual_seed(8)
    HV, Hk, V, K = SHAPE.values()
    flat = _state(family, HV, Hk, V, K, 1, g)
    paged, _, _ = _paged({n: flat[n] for n in STATE})
    st = dict(paged, epoch=torch.zeros(N, dtype=torch.int64, device=DEV),
              arrive=torch.zeros(N, dtype=torch.int32, device=DEV))
    inp = _inputs(family, HV, Hk, V, K, (2,), g)
    prm = _params(family, HV, K, g)
    ids = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    ops = _OPS[family]
    kw = dict(ckpt=st["ckpt"], buf_ld=st["buf_ld"], buf_w=st["buf_w"], buf_k=st["buf_k"], cursor=st["cursor"],
              epoch=st["epoch"], slot_ids=ids, window=1, arrive=st["arrive"], validate=False)
    with pytest.raises(ValueError, match="eager step"):
        ops.replay_decode(**inp, **prm, **kw)
