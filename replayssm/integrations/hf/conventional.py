"""The conventional scheme of the integration (`enable(model, scheme="conventional")`): each
recurrent layer keeps one full `[N, HV, V, K]` fp32 state per slot, read, updated and written
every token.

It is the baseline of `replayssm bench model`: the same model code around the recurrence as
the replay scheme, with the project's tuned conventional kernels
(`replayssm.ops.<family>.conventional_decode`) on CUDA instead of transformers' PyTorch
fallback, and the reference's conventional recurrence (`params.step`) elsewhere. It has no
speculative verification: rolling back a rewritten state needs snapshots (`snapshot.py`).
"""
from __future__ import annotations

import os
import torch
from torch import Tensor

from ...ops.utils.launch import capturing
from ...pool.pool import _params_to


class ConventionalUnsupported(ValueError):
    """An operation the conventional scheme does not have (verification, commit)."""


def pick_backend(backend: str, device: torch.device) -> str:
    """The backend a scheme's pool runs: "auto" (the kernels on CUDA, the reference elsewhere),
    "triton" (the kernels; on the CPU only under TRITON_INTERPRET=1) or "reference"."""
    if backend not in ("auto", "reference", "triton"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'triton', got {backend!r}")
    kernels_here = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton" and not kernels_here:
        raise ValueError(f"backend 'triton' unavailable: device {device} is not CUDA "
                         "(on the CPU: TRITON_INTERPRET=1)")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return backend


class ConventionalPool:
    """The subset of `SlotPool` the integration calls (`decode`, `load`, `materialize`,
    `reset`), on a plain state per slot. Padding rows (negative slot ids) get zero outputs
    and touch nothing. `backend`: "auto" (the kernels on CUDA, the reference elsewhere),
    "triton" (the kernels; on the CPU only under TRITON_INTERPRET=1) or "reference"."""

    def __init__(self, params, num_slots: int, head_v_dim: int, head_k_dim: int, num_k_heads: int, *,
                 device=None, backend: str = "auto"):
        self.device = torch.device(device if device is not None else "cpu")
        self.params = _params_to(params, torch.float32, self.device)
        self.family = params.family
        self.HV, self.V, self.K, self.Hk = params.num_heads, head_v_dim, head_k_dim, num_k_heads
        self.dtype = torch.float32
        self.N = num_slots
        # one spare row past the slots: padding rows of the reference path read and write it
        self._rows = torch.zeros(num_slots + 1, self.HV, self.V, self.K, dtype=torch.float32, device=self.device)
        self.state = self._rows[:num_slots]
        self.backend = pick_backend(backend, self.device)

    @torch.no_grad()
    def decode(self, slot_ids: Tensor, *, validate: bool = True, **inputs: Tensor) -> Tensor:
        """One conventional step for `[B]` rows; inputs as `SlotPool.decode` (any float dtype,
        computed in fp32). Returns `[B, HV, V]` fp32."""
        inputs = {k: v.to(self.device, torch.float32).contiguous() for k, v in inputs.items()}
        slot_ids = slot_ids.to(self.device).contiguous()
        if self.backend == "triton":
            return self._kernel(slot_ids, inputs, validate and not capturing())
        ok = slot_ids >= 0
        s = torch.where(ok, slot_ids.long(), self.N)
        y, new = self.params.step(self._rows[s], **inputs)
        self._rows[s] = new
        return y * ok[:, None, None].to(y.dtype)

    def _kernel(self, slot_ids: Tensor, inputs: dict, validate: bool) -> Tensor:
        p = self.params
        if self.family == "mamba2":
            from ...ops import mamba2
            return mamba2.conventional_decode(inputs["x"], inputs["dt"], inputs["B"], inputs["C"], p.A, p.dt_bias,
                                              p.D, inputs.get("z"), self.state, slot_ids, validate=validate)
        from ...ops import gdn, kda
        ops = gdn if self.family == "gdn" else kda
        return ops.conventional_decode(inputs["q"], inputs["k"], inputs["v"], inputs["a"], inputs["b"], p.A_log,
                                       p.dt_bias, p.scale, self.state, slot_ids,
                                       use_qk_l2norm=p.use_qk_l2norm, validate=validate)

    def extend(self, slot_ids: Tensor, inputs: dict) -> Tensor:
        """`S` tokens `[B, S, ...]` continuing each row (committed): one step per token."""
        S = next(iter(inputs.values())).shape[1]
        return torch.stack([self.decode(slot_ids, **{k: v[:, t] for k, v in inputs.items()})
                            for t in range(S)], dim=1)

    def verify(self, *_, **__):
        raise ConventionalUnsupported("the conventional scheme has no speculative verification (a rewritten "
                                      "state cannot roll back); enable(model, scheme='replay' or 'snapshot')")

    commit = verify

    @torch.no_grad()
    def load(self, slot_ids: Tensor, state: Tensor) -> None:
        """Install `[B, HV, V, K]` states (after prefill)."""
        ok = slot_ids >= 0
        self.state[slot_ids[ok].long().to(self.device)] = state[ok.to(state.device)].to(self.device, torch.float32)

    @torch.no_grad()
    def materialize(self, slot_ids: Tensor) -> Tensor:
        ok = (slot_ids >= 0).to(self.device)
        return self.state[slot_ids.clamp(min=0).long().to(self.device)] * ok[:, None, None, None]

    @torch.no_grad()
    def reset(self, slot_ids: Tensor) -> None:
        self.state[slot_ids[slot_ids >= 0].long().to(self.device)] = 0

    free = reset

    def memory_per_sequence(self) -> dict:
        return {"conventional": self.HV * self.V * self.K * 4}

