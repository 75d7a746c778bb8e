"""The snapshot scheme of the integration (`enable(model, scheme="snapshot")`): what serving
engines do for speculative decoding today. Each recurrent layer keeps `T + 1` full fp32 states
per slot (`[N, T + 1, HV, V, K]`) and a `base` index; verification runs the conventional
recurrence token by token from `states[s, base]` and writes the state after every draft into
the next positions, and commit moves `base` to the accepted token's state. Rollback is free,
memory and state traffic are `T + 1` times the conventional scheme's.

It is the baseline of `replayssm bench model`'s speculative rows: the same model code, the
same `speculative_generate`, and on CUDA the project's snapshot kernels
(`replayssm.ops.<family>.snapshot_verify`, `ops.utils.snapshot.snapshot_commit`, tuned to move
state at the conventional kernel's bandwidth); elsewhere the reference's conventional
recurrence (`params.step`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...pool.pool import _params_to
from ...ops.utils.launch import capturing
from .conventional import pick_backend


class SnapshotPool:
    """The subset of `SlotPool` the integration calls (`decode`, `verify`, `commit`, `load`,
    `materialize`, `reset`; a committed multi-token step is the integration's verify + commit) on `T + 1` states per slot. Padding rows (negative slot
    ids) get zero outputs and touch nothing. `backend` as `ConventionalPool`'s."""

    def __init__(self, params, num_slots: int, head_v_dim: int, head_k_dim: int, num_k_heads: int, *,
                 max_draft: int, device=None, backend: str = "auto"):
        self.device = torch.device(device if device is not None else "cpu")
        self.params = _params_to(params, torch.float32, self.device)
        self.family = params.family
        self.HV, self.V, self.K, self.Hk = params.num_heads, head_v_dim, head_k_dim, num_k_heads
        self.dtype = torch.float32
        self.N, self.T1 = num_slots, max_draft + 1
        # one spare row past the slots: padding rows of the reference path read and write it
        self._states = torch.zeros(num_slots + 1, self.T1, self.HV, self.V, self.K, dtype=torch.float32,
                                   device=self.device)
        self._base = torch.zeros(num_slots + 1, dtype=torch.int32, device=self.device)
        self.states, self.base = self._states[:num_slots], self._base[:num_slots]
        self._ones = torch.ones(num_slots, dtype=torch.int32, device=self.device)
        self.backend = pick_backend(backend, self.device)

    # -- verification and commit -------------------------------------------------------------

    @torch.no_grad()
    def verify(self, slot_ids: Tensor, *, validate: bool = True, **inputs: Tensor) -> Tensor:
        """`T` tokens `[B, T, ...]` per row from each slot's accepted state; the state after
        each is kept until `commit`. Returns `[B, T, HV, V]` fp32."""
        inputs = {k: v.to(self.device, torch.float32).contiguous() for k, v in inputs.items()}
        slot_ids = slot_ids.to(self.device).contiguous()
        T = next(iter(inputs.values())).shape[1]
        if not 1 <= T < self.T1:
            raise ValueError(f"{T} tokens in one verification; this pool keeps {self.T1} states per slot "
                             f"(at most {self.T1 - 1} tokens)")
        if self.backend == "triton":
            return self._kernel(slot_ids, inputs, validate and not capturing())
        ok = slot_ids >= 0
        s = torch.where(ok, slot_ids.long(), self.N)
        b = self._base[s].long()
        S = self._states[s, b]
        ys = []
        for t in range(T):
            y, S = self.params.step(S, **{k: v[:, t] for k, v in inputs.items()})
            self._states[s, (b + 1 + t) % self.T1] = S
            ys.append(y * ok[:, None, None].to(y.dtype))
        return torch.stack(ys, dim=1)

    def _kernel(self, slot_ids: Tensor, inputs: dict, validate: bool) -> Tensor:
        p = self.params
        if self.family == "mamba2":
            from ...ops import mamba2
            return mamba2.snapshot_verify(inputs["x"], inputs["dt"], inputs["B"], inputs["C"], p.A, p.dt_bias, p.D,
                                          inputs.get("z"), self.states, self.base, slot_ids, validate=validate)
        from ...ops import gdn, kda
        ops = gdn if self.family == "gdn" else kda
        return ops.snapshot_verify(inputs["q"], inputs["k"], inputs["v"], inputs["a"], inputs["b"], p.A_log,
                                   p.dt_bias, p.scale, self.states, self.base, slot_ids,
                                   use_qk_l2norm=p.use_qk_l2norm, validate=validate)

    @torch.no_grad()
    def commit(self, slot_ids: Tensor, accepted: Tensor, *, validate: bool = True) -> None:
        """Keep the state after each row's first `accepted[b]` verified tokens (`>= 1`)."""
        slot_ids = slot_ids.to(self.device).contiguous()
        accepted = accepted.to(self.device, torch.int32).contiguous()
        if self.backend == "triton":
            from ...ops.utils.snapshot import snapshot_commit
            snapshot_commit(self.base, slot_ids, accepted, self.T1, validate=validate and not capturing())
            return
        ok = slot_ids >= 0
        s = slot_ids[ok].long()
        self.base[s] = (self.base[s] + accepted[ok]) % self.T1

    # -- decoding ------------------------------------------------------------------------------

    def decode(self, slot_ids: Tensor, *, validate: bool = True, **inputs: Tensor) -> Tensor:
        """One token per row, committed: `[B, HV, V]` fp32."""
        y = self.verify(slot_ids, validate=validate, **{k: v[:, None] for k, v in inputs.items()})
        B = slot_ids.shape[0]
        if self._ones.shape[0] < B:         # kept: no allocation per decoded token once grown
            self._ones = torch.ones(B, dtype=torch.int32, device=self.device)
        self.commit(slot_ids, self._ones[:B], validate=validate)
        return y[:, 0]

    # -- states --------------------------------------------------------------------------------

    @torch.no_grad()
    def load(self, slot_ids: Tensor, state: Tensor) -> None:
        """Install `[B, HV, V, K]` states (after prefill) as each slot's accepted state."""
        ok = slot_ids >= 0
        s = slot_ids[ok].long().to(self.device)
        self.base[s] = 0
        self.states[s, 0] = state[ok.to(state.device)].to(self.device, torch.float32)

    @torch.no_grad()
    def materialize(self, slot_ids: Tensor) -> Tensor:
        ok = (slot_ids >= 0).to(self.device)
        s = slot_ids.clamp(min=0).long().to(self.device)
        return self.states[s, self.base[s].long()] * ok[:, None, None, None]

    @torch.no_grad()
    def reset(self, slot_ids: Tensor) -> None:
        s = slot_ids[slot_ids >= 0].long().to(self.device)
        self.states[s] = 0
        self.base[s] = 0

    free = reset

    def memory_per_sequence(self) -> dict:
        return {"snapshot": self.T1 * self.HV * self.V * self.K * 4}
