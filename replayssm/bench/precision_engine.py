"""The precision study's batched engine (`replayssm study precision --engine batched`): every
variant of one layer as rows of one tensor, stepped a token at a time (`BatchedEngine.step`) or a
window at a time (`WindowLoop`), eagerly or replayed from a CUDA graph.

A window of `n` tokens (a multiple of the replay window, starting on a window boundary) runs
as one function of device data only: the first token's index is a tensor (`WindowLoop.t0`), so
that the stochastic-rounding streams and the conventional kernels' `step` are computed on the
device; a token flushes at a fixed position of the window; the inputs are copied into static
buffers before each call and the squared errors land in static buffers copied out after it. On
CUDA the second full window captures that function once (the first runs eagerly: kernels
compiled, allocator warm), later windows replay it: a few host calls per window instead of a
few hundred torch calls per token. On the CPU the same function runs eagerly. Every loop draws
the same inputs (`StudyInputs`) and computes the same numbers as the per-token step.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..formats import allocate, quantize
from ..testing import make_inputs, make_params

__all__ = ["layer_seed", "BatchedEngine", "StudyInputs", "WindowLoop"]

INPUT_CHUNK = 256        # tokens of inputs drawn and moved to the device at once


def layer_seed(seed: int, layer: int) -> int:
    return seed * 1_000_003 + layer


class BatchedEngine:
    """Every variant of one layer as rows of one tensor, stepped by one conventional step per
    token: the same mathematics as the pools, with no loop over rows or variants.

    A pool design has an output path `O` (from the checkpoint its non-flush steps read, with
    records whose GDN `u` came from it) and a high-precision path `H` (from `C_HP`; for GDN the
    `u` a flush recomputes from the raw records). Between flushes both step conventionally in
    fp32 (equal to the pool's unrolled sums within fp32 rounding); a flush outputs from `H`,
    then sets `H <- Q_HP(H)` and `O <- Q_LP(H)` (shared: `O <- H`), as `SlotPool._write`
    stores `S`. Stochastic roundings draw other random numbers than the pools' streams: stream
    `(t * variants + i) * B + row` for variant `i` at token `t`. The flush rounds the rows of
    every variant that share a format and rounding in one `quantize` call (the same numbers:
    each row's rounding depends on its own elements and stream only).
    With `kernels`, the conventional low-precision designs are not rows of that tensor: each
    keeps its state in its format, stepped by `conventional_decode_lp` (the serving engines'
    kernel, its outputs from the fp32 update as `params.step`'s).
    """

    def __init__(self, vars_, shape, batch, window, device, seed, layer, kernels=False):
        self.vars, self.B, self.window = vars_, batch, window
        self.pools = [i for i, v in enumerate(vars_) if not v["design"].startswith("conventional")]
        conv = [i for i, v in enumerate(vars_) if v["design"].startswith("conventional")]
        self.lp_kernels = [i for i in conv if kernels and vars_[i]["hp_format"] != "fp32"]
        self.convs = [i for i in conv if i not in self.lp_kernels]
        self.params = make_params(shape.family, shape.HV, shape.K, dtype=torch.float32, device=device,
                                  seed=layer_seed(seed, layer))
        self.rows = 2 * len(self.pools) + len(self.convs)      # O rows, H rows, conventional rows
        self.S = torch.zeros(self.rows * batch, shape.HV, shape.V, shape.K, device=device)
        self.seed = layer_seed(seed, layer)
        self.ar = torch.arange(batch, device=device, dtype=torch.int64)
        self.lp_states = {i: allocate(vars_[i]["hp_format"], (batch, shape.HV, shape.V, shape.K), device)
                          for i in self.lp_kernels}
        if self.lp_kernels:
            from ..ops import gdn, mamba2

            self.lp_step = mamba2.conventional_decode_lp if shape.family == "mamba2" else gdn.conventional_decode_lp

        def idx(seq):
            return torch.tensor(list(seq), dtype=torch.int64, device=device)

        # index tensors made once: a Python list as an index would be copied from the host per call
        self._pool_idx, self._conv_idx = idx(self.pools), idx(self.convs)
        nP, groups = len(self.pools), {}
        for j, i in enumerate(self.pools):
            v = self.vars[i]
            if v["design"] != "shared":
                groups.setdefault((v["read_format"], "nearest"), []).append((j, i, [j]))
            if v["hp_format"] != "fp32":
                groups.setdefault((v["hp_format"], v["rounding"]), []).append(
                    (j, i, [nP + j, j] if v["design"] == "shared" else [nP + j]))
        # per (format, rounding): the H rows read, their variants (for the streams), the rows
        # written and the member each of them takes
        self._flush_groups = []
        for (fmt, rnd), members in groups.items():
            dest = [(d, a) for a, (_, _, ds) in enumerate(members) for d in ds]
            self._flush_groups.append((fmt, rnd, idx(nP + j for j, _, _ in members), idx(i for _, i, _ in members),
                                       idx(d for d, _ in dest), idx(a for _, a in dest)))

    def _kernel_step(self, t, i: int, inp: dict, out: Tensor) -> Tensor:
        """Token `t` (an int or a 0-d int64 tensor) of conventional low-precision variant `i` on
        the kernel: its outputs `[B, HV, V]` into `out`."""
        v, p = self.vars[i], self.params
        # one seed per variant and layer: no two variants share random numbers
        kw = dict(rounding=v["rounding"], seed=(self.seed * 1009 + i) % 2 ** 64, step=t, out=out)
        if p.family == "mamba2":
            return self.lp_step(inp["x"], inp["dt"], inp["B"], inp["C"], p.A, p.dt_bias, p.D, inp.get("z"),
                                self.lp_states[i], self.ar, v["hp_format"], **kw)
        return self.lp_step(inp["q"], inp["k"], inp["v"], inp["a"], inp["b"], p.A_log, p.dt_bias, p.scale,
                            self.lp_states[i], self.ar, v["hp_format"], use_qk_l2norm=p.use_qk_l2norm,
                            family=p.family, **kw)

    def _rows(self, j: int) -> slice:
        return slice(j * self.B, (j + 1) * self.B)

    def _streams(self, t, variants: Tensor) -> Tensor:
        """The streams of `variants` (`[m]`) at token `t`: `[m * B]`, one per variant and row."""
        return ((t * len(self.vars) + variants[:, None]) * self.B + self.ar).flatten()

    def _round(self, x, fmt, rounding, t, i):
        if fmt == "fp32":
            return x
        # one stream per token, row and variant: no two roundings share random numbers
        stream = (t * len(self.vars) + i) * self.B + self.ar
        return quantize(x, fmt, rounding, seed=self.seed, stream=stream)

    def _flush(self, S: Tensor, t) -> None:
        """The pools' flush at token `t`, in place in `S`: every rounding from the H rows as they
        were, then the writes."""
        S3 = S.view(self.rows, self.B, *S.shape[1:])
        done = []
        for fmt, rnd, src, variants, dest, member in self._flush_groups:
            x = S3.index_select(0, src).flatten(0, 1)
            stream = self._streams(t, variants) if rnd == "stochastic" else None
            q = quantize(x, fmt, rnd, seed=self.seed, stream=stream).view(len(src), *S3.shape[1:])
            done.append((dest, q.index_select(0, member)))
        for dest, q in done:
            S3.index_copy_(0, dest, q)

    def token(self, S: Tensor, t, flush: bool, inp: dict):
        """Token `t` (an int, or a 0-d int64 tensor on the device) for every variant from the
        rows `S`: `(outputs [variants, B, HV, V], the new rows)`. `flush`: the window's last
        token (a Python bool: fixed where a window starts on a window boundary)."""
        rep = {k: v.repeat(self.rows, *([1] * (v.dim() - 1))) for k, v in inp.items()}
        y, S = self.params.step(S, **rep)
        y = y.view(self.rows, self.B, *y.shape[1:])
        nP = len(self.pools)
        out = torch.empty(len(self.vars), *y.shape[1:], dtype=y.dtype, device=y.device)
        if self.pools:
            out.index_copy_(0, self._pool_idx, y[nP:2 * nP] if flush else y[:nP])
        if self.convs:
            out.index_copy_(0, self._conv_idx, y[2 * nP:])
        for i in self.lp_kernels:
            self._kernel_step(t, i, inp, out[i])
        if flush and self.pools:
            self._flush(S, t)
        for j, i in enumerate(self.convs):
            v = self.vars[i]
            r = self._rows(2 * nP + j)
            S[r] = self._round(S[r], v["hp_format"], v["rounding"], t, i)
        return out, S

    def step(self, t: int, inp: dict) -> Tensor:
        """Token `t` (from 0) for every variant: outputs `[variants, B, HV, V]`."""
        out, self.S = self.token(self.S, t, (t + 1) % self.window == 0, inp)
        return out


class StudyInputs:
    """The study's fixed random inputs, token by token: `make_inputs` of `INPUT_CHUNK` tokens
    (fewer at the end) at every multiple of it, from one generator, whatever the caller's steps;
    tokens are taken in order."""

    def __init__(self, params64, batch: int, shape, tokens: int, generator, device):
        self.p, self.B, self.shape, self.tokens, self.g, self.device = params64, batch, shape, tokens, generator, device
        self.start, self.cur = None, None

    def _draw(self, t: int) -> None:
        if t != (0 if self.start is None else self.start + INPUT_CHUNK):
            raise ValueError(f"the inputs are taken in order: token {t} after the chunk at {self.start}")
        s = self.shape
        # all drawn on the host first, then moved: the first copy waits for the device's queue,
        # which the drawing overlaps
        host = make_inputs(self.p, self.B, s.V, s.K, s.Hk, steps=min(INPUT_CHUNK, self.tokens - t),
                           generator=self.g, device="cpu")
        self.cur = {k: v.to(self.device) for k, v in host.items()}
        self.start = t

    def take(self, t0: int, n: int) -> dict:
        """Tokens `[t0, t0 + n)`: float64 `[B, n, ...]` per input, on the device."""
        parts, t = [], t0
        while t < t0 + n:
            c0 = t - t % INPUT_CHUNK
            if self.start != c0:
                self._draw(c0)
            e = min(t0 + n, c0 + INPUT_CHUNK)
            parts.append({k: v[:, t - c0:e - c0] for k, v in self.cur.items()})
            t = e
        return parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts], 1) for k in parts[0]}


class WindowLoop:
    """`n` tokens of the study per call of `run` (a multiple of the engine's window, starting on
    a window boundary), all on the device: the float64 reference step, the engine's token for
    every variant and the squared errors. `graphs`: replay the full windows from a CUDA graph
    (captured at the second full window), else run them eagerly."""

    def __init__(self, engine: BatchedEngine, p64, S64: Tensor, n: int, graphs: bool = False):
        if n < 1 or n % engine.window:
            raise ValueError(f"a window loop steps a multiple of the window {engine.window}, got {n}")
        self.eng, self.p64, self.S64, self.n, self.graphs = engine, p64, S64, n, graphs
        dev = S64.device
        self.t0 = torch.zeros((), dtype=torch.int64, device=dev)
        self.err = torch.zeros(len(engine.vars), n, dtype=torch.float64, device=dev)
        self.ref = torch.zeros(n, dtype=torch.float64, device=dev)
        self.inp: Optional[dict] = None
        self.graph, self.warm, self.stream = None, False, None

    def _window(self, m: int) -> None:
        """Tokens `t0 .. t0 + m - 1` from the static buffers; reads no device value back."""
        S64, S = self.S64, self.eng.S
        for k in range(m):
            t = self.t0 + k
            inp64 = {name: b[:, k] for name, b in self.inp.items()}
            y64, S64 = self.p64.step(S64, **inp64)
            self.ref[k] = (y64 * y64).sum()
            out, S = self.eng.token(S, t, (k + 1) % self.eng.window == 0,
                                    {name: v.float() for name, v in inp64.items()})
            self.err[:, k] = ((out.double() - y64) ** 2).flatten(1).sum(1)
        self.S64.copy_(S64)
        self.eng.S.copy_(S)

    def run(self, t0: int, inputs: dict):
        """Tokens `[t0, t0 + m)` from `inputs` (`[B, m, ...]` float64 on the device, `m <= n`):
        `(err [variants, m], ref [m])`, each token's squared output error per variant and the
        reference's squared norm (views of static buffers: copy them before the next call)."""
        m = next(iter(inputs.values())).shape[1]
        if t0 % self.eng.window or not 0 < m <= self.n:
            raise ValueError(f"a window loop call starts on a window boundary and takes 1 to {self.n} "
                             f"tokens, got t0={t0}, {m} tokens")
        if self.inp is None:
            self.inp = {k: torch.zeros(v.shape[0], self.n, *v.shape[2:], dtype=v.dtype, device=v.device)
                        for k, v in inputs.items()}
        for k, v in inputs.items():
            self.inp[k][:, :m].copy_(v)
        self.t0.fill_(t0)
        full = m == self.n
        if full and self.graph is not None:
            self.graph.replay()
        elif full and self.graphs and self.warm:
            self._capture()
            self.graph.replay()
        elif full and self.graphs:
            # the warm-up on the capture's stream: its lazy set-ups (cuBLAS workspace) are then done
            self.stream = torch.cuda.Stream(device=self.S64.device)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self._window(m)
            torch.cuda.current_stream().wait_stream(self.stream)
            self.warm = True
        else:
            self._window(m)
        return self.err[:, :m], self.ref[:m]

    def _capture(self) -> None:
        torch.cuda.synchronize(self.S64.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self._window(self.n)
