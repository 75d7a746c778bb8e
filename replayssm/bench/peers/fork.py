"""The public ReplaySSM fork's speculative verify kernels (github.com/Johnny-Liou/ReplaySSM at
FORK_COMMIT: `selective_state_update_replayssm_spec` for Mamba-2, `gdn_replayssm_spec_decode` for
GDN, each followed by its cursor commit), loaded from a checked-out copy over
`vllm_stand_ins` and driven as vLLM drives them with `--use-replayssm-spec`: its verify launches
per layer and step, and the commit of the accepted counts that vLLM's metadata builders run once
per step before them (the fork's mamba_attn.py, gdn_attn.py). The layouts it keeps (packed
tokens, circular rings, flush flags) are built from our inputs, each convention bridged below.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch

from ... import shapes
from ...reference import replay
from . import vllm_stand_ins

FORK_COMMIT = "a84849410ab56cc2b23432969eb2ecfc42a13d9c"
_OPS = "vllm/model_executor/layers/mamba/ops/"
FORK_FILES = (_OPS + "triton_helpers.py", _OPS + "mamba_ssm.py", _OPS + "replayssm_config.py",
              _OPS + "selective_state_update_replayssm_spec.py",
              "vllm/model_executor/layers/fla/ops/gdn_replayssm_spec_decode.py")
SHAPES = "nemotron3-super,nemotron3-nano-4b,qwen3.5-4b,qwen3.5-122b"
NULL_SLOT = -1     # our slot ids start at 0, where vLLM's null block is 0: the fork is told -1


class _TorchWithoutCuda(types.ModuleType):
    cuda = types.SimpleNamespace(device=lambda index: contextlib.nullcontext())

    def __getattr__(self, name):
        return getattr(torch, name)


def load_fork(src: str) -> types.SimpleNamespace:
    """The fork's spec verify and commit functions, loaded from the checkout at `src` (the
    folder holding `vllm/`, with FORK_FILES)."""
    missing = [f for f in FORK_FILES if not os.path.isfile(os.path.join(src, f))]
    if missing:
        raise SystemExit(f"fork source {src}: missing {', '.join(missing)} (the fork at {FORK_COMMIT[:9]})")
    vllm_stand_ins.install()
    mods = {}
    for rel in FORK_FILES:
        # triton_helpers.py and mamba_ssm.py first: the Mamba-2 spec module takes its softplus there
        mod = mods[os.path.basename(rel)[:-3]] = vllm_stand_ins.load(src, rel)
        if not torch.cuda.is_available():
            # the Mamba-2 wrapper enters torch.cuda.device(index), which a CPU build of torch
            # refuses: under the interpreter that context is a no-op
            mod.torch = _TorchWithoutCuda("torch")
    m2, gdn = mods["selective_state_update_replayssm_spec"], mods["gdn_replayssm_spec_decode"]
    return types.SimpleNamespace(m2_verify=m2.selective_state_update_replayssm_spec,
                                 m2_commit=m2.commit_replayssm_spec,
                                 gdn_verify=gdn.gdn_replayssm_spec_decode,
                                 gdn_commit=gdn.commit_gdn_replayssm_spec)


# ---------------------------------------------------------------------------------------------
# The conventions bridged (the fork's side first, ours second):
# - state: both [slot, HV, V, K] fp32 with K contiguous; nothing to bridge.
# - tokens: the fork takes vLLM's packed varlen batch, [Bt * T, channels] with query_start_loc
#   (row b's tokens at b * T .. b * T + T - 1); ours [Bt, T, ...]. Channels: Mamba-2's post-conv
#   x | B | C (x head-major [HV, V], B and C group-major [Hk, K]) plus raw dt [Bt * T, HV];
#   GDN's q | k | v ([Hk, K], [Hk, K], [HV, V]) plus raw a, b [Bt * T, HV].
# - Mamba-2 records: the fork keeps x | B per position in one activation-dtype ring
#   [slot, buf, HV * V + Hk * K] and the raw dt (before bias and softplus, applied on every
#   read) in an fp32 ring [slot, HV, buf]; C is not kept. Ours: ld = A softplus(dt + dt_bias)
#   [N, Lb, HV] fp32, x [N, Lb, HV, V], B [N, Lb, Hk, K].
# - GDN records: the fork's d_cache [slot, HV, buf, V] (u), k_cache [slot, Hk, buf, K] (the
#   L2-normalised key) and g_cache [slot, HV, buf] fp32 (log decay); ours the same values
#   position-major: buf_w [N, Lb, HV, V], buf_k [N, Lb, Hk, K], buf_ld [N, Lb, HV].
# - ring: the fork's is circular, buf = next_pow2(window + T) positions, committed record j at
#   (origin + j) & (buf - 1); a flush moves the origin past the folded records. Ours is linear,
#   Lb = window + T, records from 0; a flush writes the drafts from 0.
# - flush: the fork's commit precomputes the next step's per-slot int8 flag,
#   write_pos + T > window (it is passed max_cache_len = window + T, its "L = B + max_spec_len"
#   with B our window); ours decides h + T > window in the kernel. The same cadence; rows
#   started at staggered cursors need the flag set as a commit would have set it.
# - Mamba-2 parameters as vLLM's mixer hands them: A [HV] expanded to [HV, V, K] (zero
#   strides), dt_bias and D to [HV, V]; softplus in the kernel (threshold 20, as torch's).
#   GDN: A_log, dt_bias [HV]; log a = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b);
#   q, k L2-normalised with eps 1e-6 inside the root, q scaled by K^-0.5: all as ours.
# - padding: vLLM's null block is 0 (Mamba-2 tests ==, GDN <=); our slots start at 0, so the
#   fork is given NULL_SLOT = -1. The batch here has no padding rows.
# - outputs: the fork's [Bt * T, HV, V] packed as the tokens; vLLM allocates them in the
#   activation dtype, as the bench does ours.

def fork_buffer_len(window: int, T: int) -> int:
    """The fork's ring length for a window and draft length: the power of two vLLM allocates,
    `1 << (B + num_spec).bit_length()` with `num_spec = T - 1` (mamba_utils.py)."""
    return 1 << (window + T - 1).bit_length()


def fork_flush_flags(write_pos: torch.Tensor, window: int, T: int) -> torch.Tensor:
    """The fork's per-slot flush flag for the next verify, as its commit sets it
    (`write_pos + 2 T > window + T`): the rule `h + T > window` of ours."""
    return (write_pos + T > window).to(torch.int8)


def ring_positions(origin: int, n: int, buf: int) -> torch.Tensor:
    """Physical positions of the first `n` records of a fork ring whose origin is `origin`."""
    return (origin + torch.arange(n)) & (buf - 1)


def pack_tokens(*parts: torch.Tensor) -> torch.Tensor:
    """Token inputs `[Bt, T, ...]` as the fork's packed varlen channels `[Bt * T, sum of ...]`."""
    Bt, T = parts[0].shape[:2]
    return torch.cat([p.reshape(Bt * T, -1) for p in parts], dim=1)


class _Fork:
    """One batch of the fork's state for one layer: cursors (per slot: write_pos, the ring's
    origin, the flush flag), the packed token inputs, the output."""

    def __init__(self, fork, N, batch, window, T, slot_ids, device):
        self.fork, self.window, self.T, self.batch = fork, window, T, batch
        self.L = window + T
        self.buf = fork_buffer_len(window, T)
        self.slot_ids = slot_ids.to(torch.int32)
        self.write_pos = torch.zeros(N, dtype=torch.int32, device=device)
        self.origin = torch.zeros(N, dtype=torch.int32, device=device)
        self.is_flush = torch.zeros(N, dtype=torch.int8, device=device)
        self.qsl = torch.arange(0, batch * T + 1, T, dtype=torch.int32, device=device)
        self.accepted = torch.ones(batch, dtype=torch.int32, device=device)

    def set_cursors(self, write_pos, origin):
        self.write_pos.copy_(write_pos)
        self.origin.copy_(origin)
        self.is_flush.copy_(fork_flush_flags(self.write_pos, self.window, self.T))

    def positions(self, slot: int, n=None):
        n = int(self.write_pos[slot]) if n is None else n
        return ring_positions(int(self.origin[slot]), n, self.buf).to(self.origin.device)

    def step(self):
        self.verify()
        self.commit(self.accepted)

    def materialize(self, slot: int, refp) -> torch.Tensor:
        """Slot `slot`'s committed state in float64 on the CPU (`refp`: the layer's float64
        parameters there): its checkpoint and committed records folded."""
        ld, w, k = self.history(slot, refp)
        return replay(self.ckpt[slot].double().cpu(), ld, w, k)


class ForkMamba2(_Fork):
    def __init__(self, fork, shape, A, dt_bias, D, N, batch, window, T, slot_ids, dtype, out_dtype,
                 gate, device):
        super().__init__(fork, N, batch, window, T, slot_ids, device)
        _, HV, Hk, V, K = shape
        self.HV, self.Hk, self.V, self.K, self.d_inner = HV, Hk, V, K, HV * V
        f32 = dict(dtype=torch.float32, device=device)
        self.ckpt = torch.zeros(N, HV, V, K, **f32)
        self.post_conv = torch.zeros(N, self.buf, HV * V + Hk * K, dtype=dtype, device=device)
        self.dt_cache = torch.zeros(N, HV, self.buf, **f32)
        self.conv_out = torch.zeros(batch * T, HV * V + 2 * Hk * K, dtype=dtype, device=device)
        self.dt_spec = torch.zeros(batch * T, HV, dtype=dtype, device=device)
        self.z = torch.zeros(batch * T, HV, V, dtype=dtype, device=device) if gate else None
        self.out = torch.zeros(batch * T, HV, V, dtype=out_dtype, device=device)
        # the key-product scratch as vLLM's metadata builder allocates it (fp32)
        self.bc_pre = torch.zeros(batch, Hk, self.buf, 1 << (T - 1).bit_length(), **f32)
        self.A = A[:, None, None].expand(HV, V, K)
        self.dt_bias, self.D = dt_bias[:, None].expand(HV, V), D[:, None].expand(HV, V)

    def set_tokens(self, x, dt, B, C, z=None):
        self.conv_out.copy_(pack_tokens(x, B, C))
        self.dt_spec.copy_(pack_tokens(dt))
        if self.z is not None:
            self.z.copy_(pack_tokens(z).view_as(self.z))

    def set_history(self, slot, x, dt, B):
        """Committed records `x` `[h, HV, V]`, raw `dt` `[h, HV]`, `B` `[h, Hk, K]` of a slot whose
        write_pos is h, from its origin on."""
        p = self.positions(slot, x.shape[0])
        self.post_conv[slot, p] = torch.cat([x.flatten(1), B.flatten(1)], 1).to(self.post_conv.dtype)
        self.dt_cache[slot, :, p] = dt.t().float()

    def history(self, slot, refp):
        p = self.positions(slot)
        n = p.numel()
        rec = self.post_conv[slot, p].double().cpu()
        x, B = rec[:, :self.d_inner].view(n, self.HV, self.V), rec[:, self.d_inner:].view(n, self.Hk, self.K)
        ld = refp.prepare(x, self.dt_cache[slot, :, p].t().double().cpu(), B, B)["ld"]
        return ld, refp.record_values(ld, x), B

    def verify(self):
        self.fork.m2_verify(
            self.ckpt, self.post_conv, self.dt_cache, self.conv_out, self.dt_spec, self.A,
            write_pos=self.write_pos, post_conv_state_pos=self.origin, is_flush=self.is_flush,
            query_start_loc=self.qsl, state_batch_indices=self.slot_ids, max_cache_len=self.L,
            max_spec_len=self.T, d_inner=self.d_inner, ngroups=self.Hk, dstate=self.K, D=self.D, z=self.z,
            dt_bias=self.dt_bias, dt_softplus=True, out=self.out, bc_pre=self.bc_pre, null_block_id=NULL_SLOT)

    def commit(self, accepted):
        self.fork.m2_commit(self.write_pos, self.origin, self.is_flush, accepted, self.slot_ids,
                            max_cache_len=self.L, max_spec_len=self.T, cache_buf_len=self.buf,
                            null_block_id=NULL_SLOT)


class ForkGDN(_Fork):
    def __init__(self, fork, shape, A_log, dt_bias, N, batch, window, T, slot_ids, dtype, out_dtype, device):
        super().__init__(fork, N, batch, window, T, slot_ids, device)
        _, HV, Hk, V, K = shape
        self.HV, self.Hk, self.V, self.K = HV, Hk, V, K
        self.A_log, self.dt_bias = A_log, dt_bias
        f32 = dict(dtype=torch.float32, device=device)
        self.ckpt = torch.zeros(N, HV, V, K, **f32)
        self.d_cache = torch.zeros(N, HV, self.buf, V, dtype=dtype, device=device)
        self.k_cache = torch.zeros(N, Hk, self.buf, K, dtype=dtype, device=device)
        self.g_cache = torch.zeros(N, HV, self.buf, **f32)
        self.mixed_qkv = torch.zeros(batch * T, 2 * Hk * K + HV * V, dtype=dtype, device=device)
        self.a = torch.zeros(batch * T, HV, dtype=dtype, device=device)
        self.b = torch.zeros(batch * T, HV, dtype=dtype, device=device)
        self.out = torch.zeros(batch * T, HV, V, dtype=out_dtype, device=device)

    def set_tokens(self, q, k, v, a, b):
        self.mixed_qkv.copy_(pack_tokens(q, k, v))
        self.a.copy_(pack_tokens(a))
        self.b.copy_(pack_tokens(b))

    def set_history(self, slot, ld, u, k):
        """Committed records `ld` `[h, HV]`, `u` `[h, HV, V]`, normalised `k` `[h, Hk, K]`."""
        p = self.positions(slot, ld.shape[0])
        self.g_cache[slot, :, p] = ld.t().float()
        self.d_cache[slot, :, p] = u.transpose(0, 1).to(self.d_cache.dtype)
        self.k_cache[slot, :, p] = k.transpose(0, 1).to(self.k_cache.dtype)

    def history(self, slot, refp):
        p = self.positions(slot)
        return tuple(t.double().cpu() for t in (self.g_cache[slot, :, p].t(), self.d_cache[slot, :, p].transpose(0, 1),
                                                self.k_cache[slot, :, p].transpose(0, 1)))

    def verify(self):
        self.fork.gdn_verify(
            mixed_qkv=self.mixed_qkv, a=self.a, b=self.b, A_log=self.A_log, dt_bias=self.dt_bias,
            checkpoint_state=self.ckpt, d_cache=self.d_cache, k_cache=self.k_cache, g_cache=self.g_cache,
            out=self.out, query_start_loc=self.qsl, ssm_state_indices=self.slot_ids, write_pos=self.write_pos,
            cache_base=self.origin, is_flush=self.is_flush, max_cache_len=self.L, max_spec_len=self.T,
            scale=self.K ** -0.5, use_qk_l2norm_in_kernel=True, null_block_id=NULL_SLOT)

    def commit(self, accepted):
        self.fork.gdn_commit(self.write_pos, self.origin, self.is_flush, accepted, self.slot_ids,
                             max_cache_len=self.L, max_spec_len=self.T, cache_buf_len=self.buf,
                             null_block_id=NULL_SLOT)


def make_fork(fork, shape, params, N, batch, window, T, slot_ids, dtype, out_dtype, gate, device):
    """The fork's state for a shape (`shapes.Shape`) and layer (fp32 parameters on `device`)."""
    if shape.family == "mamba2":
        return ForkMamba2(fork, shape, params.A, params.dt_bias, params.D, N, batch, window, T, slot_ids,
                          dtype, out_dtype, gate, device)
    if shape.family == "gdn":
        return ForkGDN(fork, shape, params.A_log, params.dt_bias, N, batch, window, T, slot_ids, dtype,
                       out_dtype, device)
    raise SystemExit(f"the fork has no spec verify kernel for {shape.family}")


def fork_for_case(fork, case, gate: bool, seed: int = 0):
    """The fork's state beside a `replayssm.bench.verify.Case`: the same layer, token inputs,
    slots, checkpoint and staggered cursors (write_pos of slot s = s mod window), random records
    in its own layout; the gate `z` given to it when `gate` (Mamba-2)."""
    dev = case.ckpt.device
    sh = shapes.parse(case.shape)
    dtype = case.drafts["v" if case.family == "gdn" else "x"].dtype
    fk = make_fork(fork, sh, case.params, case.ckpt.shape[0], case.batch, case.window, case.T, case.slot_ids,
                   dtype, dtype, gate, dev)
    fk.ckpt.copy_(case.ckpt)
    g = torch.Generator(device=dev).manual_seed(seed)
    if case.family == "mamba2":
        fk.post_conv.copy_(0.1 * torch.randn(fk.post_conv.shape, generator=g, device=dev))
        fk.dt_cache.copy_(0.5 * torch.randn(fk.dt_cache.shape, generator=g, device=dev))
        fk.set_tokens(*(case.drafts[n] for n in ("x", "dt", "B", "C")), case.drafts.get("z") if gate else None)
    else:
        fk.d_cache.copy_(0.1 * torch.randn(fk.d_cache.shape, generator=g, device=dev))
        k = torch.randn(fk.k_cache.shape, generator=g, device=dev)
        fk.k_cache.copy_(k / k.norm(dim=-1, keepdim=True))
        fk.g_cache.copy_(-0.05 * torch.rand(fk.g_cache.shape, generator=g, device=dev))
        fk.set_tokens(*(case.drafts[n] for n in ("q", "k", "v", "a", "b")))
    fk.set_cursors(case.cursor, torch.randint(0, fk.buf, case.cursor.shape, generator=g, device=dev,
                                              dtype=torch.int32))
    return fk
