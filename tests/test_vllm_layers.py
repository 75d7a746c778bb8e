"""The plugin's layer forwards (`layers.mamba2_forward`, `layers.gdn_forward`) on the CPU, with
stand-ins for what vLLM hands them (metadata, the conv kernel) and an executor that records
what reaches the kernels: the token inputs of decode and verify rows are the packed
projections split and gathered as `batch.pad_tokens` lays them out, with rows of equal and of
unequal token counts, and the step's layers share the slot ids and index maps (`batch.STEP`).
"""
from __future__ import annotations

import types

import torch

from replayssm.integrations.vllm import _compat, batch, layers

HV, Hk, V, K = 4, 2, 8, 16


class Recorder:
    """An executor that records its calls' inputs and writes a known output per (row, token)."""

    def __init__(self):
        self.calls = []

    def commit(self, slots, accepted):
        self.calls.append(("commit", slots, accepted))

    def verify(self, slots, inputs, num_drafts, out):
        self.calls.append(("verify", slots, {k: v.clone() for k, v in inputs.items()}, num_drafts))
        B, T = out.shape[:2]
        out.copy_(torch.arange(B * T, dtype=out.dtype).view(B, T, 1, 1).expand_as(out))
        return out

    def decode(self, slots, inputs, out):
        self.calls.append(("decode", slots, {k: v.clone() for k, v in inputs.items()}))
        return out.zero_()


def _ns():
    # vLLM's conv kernel stand-in passes the tokens through, so the split is what is checked
    return types.SimpleNamespace(causal_conv1d_update=lambda x, *a, **k: x, is_conv_state_dim_first=lambda: True)


def _rows(qlen):
    qlen = torch.tensor(qlen)
    return torch.cat([torch.zeros(1, dtype=torch.long), qlen.cumsum(0)]).to(torch.int32)


def _mamba2_layer(num_spec):
    split = [HV * V, Hk * K, Hk * K]
    return types.SimpleNamespace(
        prefix="m", num_spec=num_spec, tp_size=1, num_heads=HV, head_dim=V, n_groups=Hk, ssm_state_size=K,
        tped_intermediate_size=5, tped_conv_size=sum(split), tped_dt_size=HV, conv_weights=None,
        conv1d=types.SimpleNamespace(bias=None), activation="silu",
        split_hidden_states_B_C_fn=lambda t: torch.split(t, split, dim=-1))


def _mamba2_step(ex, layer, qlen, g):
    T = 1 + layer.num_spec
    qsl = _rows(qlen)
    ntok = int(qsl[-1])
    proj = torch.randn(ntok, 5 + 2 * Hk * K + HV * V + HV, generator=g)
    md = types.SimpleNamespace(state_indices_tensor_d=torch.tensor([[3] * T, [5] * T, [0] * T], dtype=torch.int32),
                               query_start_loc_d=qsl, num_accepted_tokens=torch.tensor([1, 2, 1], dtype=torch.int32))
    out = torch.full((ntok, HV * V), float("nan"))
    st = types.SimpleNamespace(conv=torch.zeros(1))
    layers._mamba2_decode(_ns(), layer, md, st, ex, proj, out)
    xbc, dt = proj[:, 5:5 + 2 * Hk * K + HV * V], proj[:, -HV:]
    x, B, C = torch.split(xbc, [HV * V, Hk * K, Hk * K], dim=-1)
    flat = {"x": x.reshape(ntok, HV, V), "dt": dt, "B": B.reshape(ntok, Hk, K), "C": C.reshape(ntok, Hk, K)}
    return md, qsl, flat, out


def test_mamba2_rows_reach_the_kernels_as_padded_rows():
    g = torch.Generator().manual_seed(0)
    layer = _mamba2_layer(num_spec=2)
    for qlen in ([3, 3, 3], [2, 3, 1]):              # uniform (in place), then unequal rows (gathered)
        ex = Recorder()
        md, qsl, flat, out = _mamba2_step(ex, layer, qlen, g)
        (_, slots, acc), (_, vslots, got, n) = ex.calls
        assert slots.tolist() == vslots.tolist() == [3, 5, -1] and acc.tolist() == [1, 2, 1]
        want, want_n = batch.pad_tokens(flat, qsl, 3)
        for k in want:
            assert torch.equal(got[k], want[k]), (qlen, k)
        assert (n is None) == (qlen == [3, 3, 3])
        if n is not None:
            assert n.tolist() == want_n.tolist()
        # outputs scattered back: token t of row b holds b * T + t
        idx = [b * 3 + t for b, q in enumerate(qlen) for t in range(q)]
        assert out[:, 0].tolist() == [float(i) for i in idx]


def test_step_memo_shares_within_a_step_only(monkeypatch):
    g = torch.Generator().manual_seed(1)
    layer = _mamba2_layer(num_spec=2)
    ex = Recorder()
    md, qsl, flat, _ = _mamba2_step(ex, layer, [2, 3, 1], g)
    made = []
    orig = batch.Rows.__init__

    def counting(self, *a, **k):
        made.append(1)
        orig(self, *a, **k)
    monkeypatch.setattr(batch.Rows, "__init__", counting)
    step = object()                                   # a new step's metadata
    for _ in range(3):                                # three layers of one step: one index map
        out = torch.empty(6, HV, V)
        batch.run_decode(ex, None, md.state_indices_tensor_d[:, 0], flat, out, spec_tokens=2,
                         query_start_loc=qsl, step=step)
    assert len(made) == 1
    md2 = types.SimpleNamespace(**vars(md))           # the next step
    batch.run_decode(ex, None, md.state_indices_tensor_d[:, 0], flat, torch.empty(6, HV, V), spec_tokens=2,
                     query_start_loc=qsl, step=md2)
    batch.run_decode(ex, None, md.state_indices_tensor_d[:, 0], flat, torch.empty(6, HV, V), spec_tokens=2,
                     query_start_loc=qsl, step=None)
    assert len(made) == 3
    # a capture that starts within the step (vLLM's warm-up, then the capture, of one batch)
    # computes its own values, and so does the step after it
    monkeypatch.setattr(batch, "_capturing", lambda: True)
    batch.run_decode(ex, None, md.state_indices_tensor_d[:, 0], flat, torch.empty(6, HV, V), spec_tokens=2,
                     query_start_loc=qsl, step=md2)
    monkeypatch.setattr(batch, "_capturing", lambda: False)
    batch.run_decode(ex, None, md.state_indices_tensor_d[:, 0], flat, torch.empty(6, HV, V), spec_tokens=2,
                     query_start_loc=qsl, step=md2)
    assert len(made) == 5
    # a different row split in the same step gets its own map
    qsl2 = _rows([1, 1, 3])
    y = batch.run_decode(ex, None, md2.state_indices_tensor_d[:, 0], flat, torch.empty(5, HV, V), spec_tokens=2,
                         query_start_loc=qsl2, step=md2)
    assert y[:, 0, 0].tolist() == [0.0, 3.0, 6.0, 7.0, 8.0]


def _gdn_layer():
    return types.SimpleNamespace(prefix="g", num_spec=2, tp_size=1, num_v_heads=HV, num_k_heads=Hk, head_v_dim=V,
                                 head_k_dim=K, activation="silu",
                                 conv1d=types.SimpleNamespace(weight=torch.zeros(2 * Hk * K + HV * V, 1, 4), bias=None))


def test_gdn_speculative_rows_reach_the_kernels_as_padded_rows(monkeypatch):
    g = torch.Generator().manual_seed(2)
    layer = _gdn_layer()
    monkeypatch.setattr(layers, "_gdn_dims", lambda lyr: (HV, Hk, V, K))
    ex = Recorder()
    monkeypatch.setattr(layers, "bound_state", lambda *a, **k: (types.SimpleNamespace(conv=torch.zeros(1)), ex))
    qlen = [2, 3, 1]
    qsl = _rows(qlen)
    ntok = int(qsl[-1])
    md = types.SimpleNamespace(num_actual_tokens=ntok, spec_sequence_masks=torch.ones(3, dtype=torch.bool),
                               num_prefills=0, num_decodes=0, num_spec_decodes=3, spec_query_start_loc=qsl,
                               spec_state_indices_tensor=torch.tensor([[2] * 3, [4] * 3, [0] * 3], dtype=torch.int32),
                               num_accepted_tokens=torch.tensor([2, 1, 1], dtype=torch.int32))
    monkeypatch.setattr(_compat, "metadata_for", lambda ns, prefix: md)
    qkv = torch.randn(ntok, 2 * Hk * K + HV * V, generator=g)
    a, b = torch.randn(ntok, HV, generator=g), torch.randn(ntok, HV, generator=g)
    out = torch.full((ntok, HV, V), float("nan"))
    fwd = layers.gdn_forward(_ns(), settings=None)(orig=None)
    fwd(layer, qkv, b, a, out)
    (_, slots, acc), (_, _, got, n) = ex.calls
    assert slots.tolist() == [2, 4, -1] and acc.tolist() == [2, 1, 1]
    q, k, v = torch.split(qkv, [Hk * K, Hk * K, HV * V], dim=-1)
    flat = {"q": q.reshape(ntok, Hk, K), "k": k.reshape(ntok, Hk, K), "v": v.reshape(ntok, HV, V), "a": a, "b": b}
    want, want_n = batch.pad_tokens(flat, qsl, 3)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert n.tolist() == want_n.tolist() == qlen
    assert out[:, 0, 0].tolist() == [0.0, 1.0, 3.0, 4.0, 5.0, 6.0]
