"""Per-family decode of a transformers recurrent mixer from its own projections.

Each adapter reads a loaded mixer module (its projections, short convolution, decay
parameters, gated norm and output projection) and splits its token path in three so that
the recurrence in the middle can run on a `SlotPool`:

- `project(h)`: the mixer's input projections of hidden states `[B, S, D]`, returning the
  short convolution's input `[B, S, C]` and the side inputs (gates, raw decays);
- `pool_inputs(u, side)`: the convolved activations `[B, S, C]` split into the pool's raw
  inputs, each `[B, S, ...]` (Mamba-2: `x`, `dt`, `B`, `C`; GDN/KDA: `q`, `k`, `v`, `a`, `b`);
- `output(y, side)`: the pool's outputs `[B, S, HV, V]` through the mixer's gate, norm and
  output projection, `[B, S, D]`.

`prefill_state(layer)` reads the final recurrent state the stock prefill left in a cache
layer as the pool's `[B, HV, V, K]`. The arithmetic of every step matches the stock decode
path of transformers 5.17 (same casts), so that tokens agree with stock generation.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...reference import GDNParams, KDAParams, Mamba2Params


class UnsupportedModelError(TypeError):
    """A model or mixer that ReplaySSM cannot run (raised by `enable`)."""


def _act(name: str):
    from transformers.activations import ACT2FN
    return ACT2FN[name]


class MixerAdapter:
    """Common shape information: `family`, `HV`, `V`, `K`, `Hk`, the short convolution
    (`conv_weight` `[C, Kc]`, `conv_bias` `[C]` or None, `activation`)."""

    family: str

    def __init__(self, mixer):
        self.mixer = mixer
        conv = mixer.conv1d
        self.conv_dim = conv.weight.shape[0]
        self.conv_kernel = conv.weight.shape[-1]
        self.activation = _act(mixer.activation) if isinstance(mixer.activation, str) else mixer.activation

    @property
    def conv_weight(self) -> Tensor:
        # read at call time: weights may move (`.to(device)`) after `enable`
        return self.mixer.conv1d.weight.squeeze(1)

    @property
    def conv_bias(self) -> Optional[Tensor]:
        return self.mixer.conv1d.bias

    def params(self):
        raise NotImplementedError


class Mamba2Adapter(MixerAdapter):
    """The Mamba-2 mixer of NemotronH, Bamba, GraniteMoeHybrid, Zamba2 and the pure Mamba-2
    model (one code path in transformers), and Falcon-H1's variant (input and projection multipliers; gate either in
    the gated norm or as `* silu(z)`)."""

    family = "mamba2"

    def __init__(self, mixer):
        super().__init__(mixer)
        m = mixer
        self.HV, self.V, self.K, self.Hk = m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups
        self.inner = m.num_heads * m.head_dim
        self.in_multiplier = getattr(m, "ssm_in_multiplier", None)
        self.has_mup = hasattr(m, "mup_vector")
        # Falcon-H1 without its gated norm gates with silu(z); every other mixer has the norm
        self.gated_norm = getattr(m, "mamba_rms_norm", True)

    def params(self) -> Mamba2Params:
        m = self.mixer
        return Mamba2Params(A=-torch.exp(m.A_log.detach().float()), dt_bias=m.dt_bias.detach(),
                            D=m.D.detach())

    def project(self, h: Tensor):
        m = self.mixer
        if self.in_multiplier is not None:
            h = h * self.in_multiplier
        proj = m.in_proj(h)
        if self.has_mup:
            proj = proj * m.mup_vector
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.HV], dim=-1)
        return xbc, {"gate": gate, "dt": dt}

    def pool_inputs(self, u: Tensor, side: dict) -> dict:
        B, S = u.shape[:2]
        gk = self.Hk * self.K
        x, Bm, Cm = u.split([self.inner, gk, gk], dim=-1)
        return {"x": x.reshape(B, S, self.HV, self.V), "dt": side["dt"],
                "B": Bm.reshape(B, S, self.Hk, self.K), "C": Cm.reshape(B, S, self.Hk, self.K)}

    def output(self, y: Tensor, side: dict, dtype: torch.dtype) -> Tensor:
        m = self.mixer
        B, S = y.shape[:2]
        y = y.to(dtype).reshape(B, S, self.inner)
        if self.gated_norm:
            y = m.norm(y, side["gate"])
        else:
            y = y * F.silu(side["gate"])
        return m.out_proj(y.to(dtype))

    def prefill_state(self, state: Tensor) -> Tensor:
        return state                                             # [B, HV, P, N] already


class _DeltaAdapter(MixerAdapter):
    def prefill_state(self, state: Tensor) -> Tensor:
        return state.transpose(-1, -2)                           # [B, HV, K, V] -> [B, HV, V, K]


class GDNAdapter(_DeltaAdapter):
    """Gated DeltaNet of Qwen3.5 (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and of
    Qwen3-Next (the fused `in_proj_qkvz` / `in_proj_ba`, unpacked by the mixer's own
    `fix_query_key_value_ordering`)."""

    family = "gdn"

    def __init__(self, mixer):
        super().__init__(mixer)
        m = mixer
        self.HV, self.V, self.K, self.Hk = m.num_v_heads, m.head_v_dim, m.head_k_dim, m.num_k_heads
        self.fused = hasattr(m, "in_proj_qkvz")

    def params(self) -> GDNParams:
        m = self.mixer
        return GDNParams(A_log=m.A_log.detach().float(), dt_bias=m.dt_bias.detach())

    def project(self, h: Tensor):
        m = self.mixer
        B, S = h.shape[:2]
        if self.fused:
            q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
            qkv = torch.cat([t.reshape(B, S, -1) for t in (q, k, v)], dim=-1)
        else:
            qkv, z = m.in_proj_qkv(h), m.in_proj_z(h)
            b, a = m.in_proj_b(h), m.in_proj_a(h)
        return qkv, {"z": z.reshape(B, S, self.HV, self.V), "a": a, "b": b}

    def pool_inputs(self, u: Tensor, side: dict) -> dict:
        B, S = u.shape[:2]
        kd = self.Hk * self.K
        q, k, v = u.split([kd, kd, self.HV * self.V], dim=-1)
        return {"q": q.reshape(B, S, self.Hk, self.K), "k": k.reshape(B, S, self.Hk, self.K),
                "v": v.reshape(B, S, self.HV, self.V), "a": side["a"], "b": side["b"]}

    def output(self, y: Tensor, side: dict, dtype: torch.dtype) -> Tensor:
        m = self.mixer
        B, S = y.shape[:2]
        y = m.norm(y.to(dtype).reshape(-1, self.V), side["z"].reshape(-1, self.V))
        return m.out_proj(y.reshape(B, S, -1))


class KDAAdapter(_DeltaAdapter):
    """Kimi Delta Attention of Kimi Linear: channel-wise decay from the low-rank forget gate
    (`f_a_proj`, `f_b_proj`, `dt_bias` `[HV * K]`, `A_log` one per head)."""

    family = "kda"

    def __init__(self, mixer):
        super().__init__(mixer)
        m = mixer
        self.HV = self.Hk = m.num_heads
        self.V = self.K = m.head_dim

    def params(self) -> KDAParams:
        fg = self.mixer.forget_gate
        return KDAParams(A_log=fg.A_log.detach().float().reshape(self.HV),
                         dt_bias=fg.dt_bias.detach().float().reshape(self.HV, self.K))

    def project(self, h: Tensor):
        m = self.mixer
        B, S = h.shape[:2]
        qkv = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
        fg = m.forget_gate
        a = fg.f_b_proj(fg.f_a_proj(h)).float().reshape(B, S, self.HV, self.K)
        gate = m.g_b_proj(m.g_a_proj(h)).reshape(B, S, self.HV, self.V)
        return qkv, {"a": a, "b": m.b_proj(h), "gate": gate}

    def pool_inputs(self, u: Tensor, side: dict) -> dict:
        B, S = u.shape[:2]
        q, k, v = (t.reshape(B, S, self.HV, self.K) for t in u.split([self.HV * self.K] * 3, dim=-1))
        return {"q": q, "k": k, "v": v, "a": side["a"], "b": side["b"]}

    def output(self, y: Tensor, side: dict, dtype: torch.dtype) -> Tensor:
        m = self.mixer
        B, S = y.shape[:2]
        return m.o_proj(m.o_norm(y.to(dtype), side["gate"]).reshape(B, S, -1))


# mixer class name -> adapter; the names are transformers 5.17's
ADAPTERS = {
    "NemotronHMamba2Mixer": Mamba2Adapter,
    "Mamba2Mixer": Mamba2Adapter,
    "BambaMixer": Mamba2Adapter,
    "GraniteMoeHybridMambaLayer": Mamba2Adapter,
    "Zamba2MambaMixer": Mamba2Adapter,
    "FalconH1Mixer": Mamba2Adapter,
    "Qwen3NextGatedDeltaNet": GDNAdapter,
    "Qwen3_5GatedDeltaNet": GDNAdapter,
    "Qwen3_5MoeGatedDeltaNet": GDNAdapter,
    "KimiLinearDeltaAttention": KDAAdapter,
}

# recurrent mixers of transformers that ReplaySSM does not run (a different recurrence)
UNSUPPORTED = {
    "MambaMixer": "Mamba-1's selective scan has a per-channel state (no shared [V, K] head state)",
    "FalconMambaMixer": "Mamba-1's selective scan has a per-channel state (no shared [V, K] head state)",
    "JambaMambaMixer": "Jamba uses Mamba-1 mixers",
    "Lfm2ShortConv": "LFM2 has a short convolution only, no recurrent state",
}


def adapter_for(mixer) -> MixerAdapter:
    name = type(mixer).__name__
    if name not in ADAPTERS:
        raise UnsupportedModelError(f"no ReplaySSM adapter for mixer class {name}")
    return ADAPTERS[name](mixer)
