"""Teacher-forced decoding of an enabled hybrid model for the model-level precision study: the
fp32 logits after each decode step, every step fed the sequence's true next token.

`DynamicPass`: the model's own prefill, then one eager forward per token on transformers'
dynamic cache. Each step costs a few milliseconds of host work (tens of kernel launches per
layer), so 131,072 tokens per design would take hours.

`StaticPass`: one stock prefill into a transformers `StaticCache` (the model disabled), shared
by every design: each pass enables its design on that cache (`hf.attach_cache`, which seeds the
pools from the prefill's final states as an enabled prefill does), puts the attention layers'
write position back to the prefill's end and steps with the token and its position in device
tensors. On CUDA (`graphs`) the first step runs eagerly (compiling the kernels) and the second
is captured in a CUDA graph that every later step replays: the pools' flushes and
stochastic-rounding streams follow their device-side cursors and epochs, as in decoding
(`bench.model` times decode steps the same way). Where capture fails the pass steps eagerly and
says why (`StaticPass.timing`).

`Lockstep`: StaticPasses of several copies of one model, each copy with its own cache and
design, stepped together (on CUDA one graph, each copy on a stream of its own): the study's
designs of one model in one pass over the sequence.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch


def cache_arg(model) -> str:
    # the pure Mamba-2 model names its cache `cache_params`
    return "past_key_values" if "past_key_values" in inspect.signature(model.forward).parameters else "cache_params"


class DynamicPass:
    """One teacher-forced pass of an enabled model over `ids` `[B, prefill + tokens]`: yields
    the fp32 logits `[B, vocab]` after each decode step."""

    def __init__(self, model, ids: torch.Tensor, prefill: int):
        self.model, self.ids, self.prefill = model, ids, prefill
        self.cache_arg = cache_arg(model)
        self.timing = "eager: dynamic cache"

    @torch.no_grad()
    def steps(self, tokens: int):
        ids, P = self.ids, self.prefill
        out = self.model(input_ids=ids[:, :P], use_cache=True, logits_to_keep=1)
        cache = getattr(out, self.cache_arg)
        for t in range(P, P + tokens):
            out = self.model(input_ids=ids[:, t:t + 1], use_cache=True, **{self.cache_arg: cache})
            cache = getattr(out, self.cache_arg)
            yield out.logits[:, -1].float()


class StaticPass:
    """Teacher-forced passes over `ids` `[B, prefill + tokens]` from one stock prefill into a
    static cache (`prefill_cache`, with the model disabled), each with whatever design is enabled
    when `steps` runs. The logits a step yields are a buffer the next step overwrites."""

    def __init__(self, model, ids: torch.Tensor, prefill: int, *, graphs: bool = True):
        self.model, self.ids, self.prefill = model, ids, prefill
        self.graphs = graphs and ids.device.type == "cuda"
        self.cache = None
        self.timing: Optional[str] = None

    @staticmethod
    def supports(model) -> bool:
        """Whether the model takes a transformers cache object (`past_key_values`)."""
        return cache_arg(model) == "past_key_values"

    @torch.no_grad()
    def prefill_cache(self) -> None:
        """The stock prefill of the first `prefill` tokens into a cache with room for the rest
        of `ids`; call it with the model disabled."""
        from transformers import StaticCache
        ids, P = self.ids, self.prefill
        self.cache = StaticCache(config=self.model.config, max_cache_len=ids.shape[1])
        self.model(input_ids=ids[:, :P], past_key_values=self.cache, use_cache=True, logits_to_keep=1,
                   cache_position=torch.arange(P, device=ids.device))

    def start(self, tokens: int, out: Optional[torch.Tensor] = None):
        """Enable-time set-up of a pass of `tokens` steps with the design enabled now: the
        pools seeded from the prefill, the cache's write position back at its end. Returns
        `step`, which feeds the next true token (read on the device at the step's position, so
        that a replayed graph moves on like decoding) and writes the fp32 logits into `out`
        (`[B, vocab]`, made when not given), and `out`."""
        from ..integrations import hf
        from .model_cache import rewind
        if self.cache is None:
            raise RuntimeError("StaticPass.start (or steps) before prefill_cache")
        if tokens > self.ids.shape[1] - self.prefill:
            raise ValueError(f"{tokens} steps past a prefill of {self.prefill}: ids hold {self.ids.shape[1]} tokens")
        ids, P, model, cache = self.ids, self.prefill, self.model, self.cache
        hf.attach_cache(model, cache)
        rewind(cache, P)
        tok = ids[:, P:P + 1].clone()
        pos = torch.tensor([P], device=ids.device)
        if out is None:
            out = torch.empty(ids.shape[0], model.config.vocab_size, dtype=torch.float32, device=ids.device)

        @torch.no_grad()
        def step():
            torch.index_select(ids, 1, pos, out=tok)
            logits = model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True,
                           logits_to_keep=1).logits
            pos.add_(1)
            out.copy_(logits[:, -1])
        return step, out

    @torch.no_grad()
    def steps(self, tokens: int):
        step, out = self.start(tokens)
        graph = None
        self.timing = "eager: static cache" + ("" if self.graphs else " (CUDA graphs off)")
        for t in range(tokens):
            if graph is not None:
                graph.replay()
            elif self.graphs and t > 0:
                graph = self._capture(step)
                if graph is not None:
                    graph.replay()
                else:
                    step()
            else:
                step()
            yield out

    def _capture(self, step):
        graph, why = capture(step)
        self.timing = "cuda_graph" if graph is not None else f"eager: graph capture failed ({why})"
        return graph


def capture(step):
    """`step` captured in a CUDA graph (recorded, not run) and None, or None and why not."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as e:         # noqa: BLE001 - any capture failure leaves the eager steps
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return graph, None


PREFIX_ATTENTION = "replayssm_prefix"


def _prefix_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention for one decoded token over the first `module.prefix_keys`
    positions of a static cache (the rest not yet written), the query heads of each key head
    grouped so that the keys are read once: the stock function reads the whole cache and, with
    the mask a static cache needs, first copies the keys and values once per query head. On
    CUDA `decode_attention` splits the positions over programs (stock kernels for one query
    split by heads only, so a long prefix ran on a couple of SMs); elsewhere two matmuls."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    n = getattr(module, "prefix_keys", None)
    if query.shape[2] != 1 or attention_mask is None or n is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, H, _, D = query.shape
    kv = key.shape[1]
    q = query.reshape(B, kv, H // kv, D)       # head h reads key head h // (H / kv), as repeat_kv
    k, v, mask = key[:, :, :n], value[:, :, :n], attention_mask[..., :n]
    scale = D ** -0.5 if scaling is None else scaling
    if dropout:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
    elif query.is_cuda and (kernel := _decode_kernel()).supports(q, mask):
        out = kernel.decode_attention(q, k, v, mask, scale)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale     # [B, kv, H // kv, n]
        # the mask [B, 1, 1, n] broadcasts over the grouped heads: True (or 0) attends
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def _decode_kernel():
    from . import decode_attention      # Triton: imported where a CUDA step needs it
    return decode_attention


def use_prefix_attention(model) -> list:
    """Switch `model`'s attention layers to `_prefix_attention` (registered with transformers
    under `PREFIX_ATTENTION`, with SDPA's mask); returns the attention modules, whose
    `prefix_keys` says how many cache positions a decode step reads."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(PREFIX_ATTENTION, _prefix_attention)
    AttentionMaskInterface.register(PREFIX_ATTENTION, sdpa_mask)
    model.set_attn_implementation(PREFIX_ATTENTION)
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups")]


def prefix_length(needed: int, capacity: int, least: int = 1024) -> int:
    """The cache positions a step that needs `needed` reads: the next power of two (at least
    `least`, at most `capacity`), so that a pass recaptures its graph a few times only."""
    return min(capacity, max(least, 1 << max(0, needed - 1).bit_length()))


class Lockstep:
    """Teacher-forced passes of several copies of one model stepped together, one step of every
    copy per token: `passes`, StaticPasses over the same ids, each prefilled, each copy with its
    own design enabled. On CUDA (`graphs`) every copy's step runs on a stream of its own inside
    one CUDA graph: a tiny model's step is a few hundred small kernels that leave most of the
    GPU idle, so the copies' kernels run side by side rather than each copy's pass in turn (or
    processes side by side, which the GPU time-slices). Attention reads the cache positions
    written so far rounded up to a power of two (`use_prefix_attention`, `prefix_length`), not
    the whole static cache: a few graphs a pass, one per length."""

    def __init__(self, passes: list, *, graphs: bool = True, least_keys: int = 1024):
        if not passes:
            raise ValueError("Lockstep of no passes")
        self.passes, self.least_keys = passes, least_keys
        self.graphs = graphs and passes[0].ids.device.type == "cuda"
        self.timing: Optional[str] = None

    @torch.no_grad()
    def steps(self, tokens: int, after=None):
        """Yields the logits `[copies, B, vocab]` after each step (a buffer the next step
        overwrites); `after(outs)`, where given, runs after every step of the copies (inside the
        graph where one replays: keep it free of host syncs)."""
        p0 = self.passes[0]
        outs = torch.empty(len(self.passes), p0.ids.shape[0], p0.model.config.vocab_size,
                           dtype=torch.float32, device=p0.ids.device)
        fns = [p.start(tokens, out=outs[i])[0] for i, p in enumerate(self.passes)]
        streams = [torch.cuda.Stream(device=outs.device) for _ in fns] if self.graphs else []
        attention = [m for p in self.passes for m in use_prefix_attention(p.model)]
        P, capacity = p0.prefill, p0.ids.shape[1]

        def eager():
            for fn in fns:
                fn()
            if after is not None:
                after(outs)

        def forked():
            cur = torch.cuda.current_stream()
            for s, fn in zip(streams, fns):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    fn()
            for s in streams:
                cur.wait_stream(s)
            if after is not None:
                after(outs)

        graph, keys, n, failed = None, 0, len(fns), False
        self.timing = f"eager: static cache, {n} copies in turn" + ("" if self.graphs else " (CUDA graphs off)")
        for t in range(tokens):
            want = prefix_length(P + t + 1, capacity, self.least_keys)
            if want != keys:          # past the keys the graph reads: a longer prefix, a new graph
                keys = want
                for m in attention:
                    m.prefix_keys = keys
                graph = None
            if graph is not None:
                graph.replay()
            elif self.graphs and t > 0 and not failed:
                graph, why = capture(forked)
                if graph is None:
                    failed = True
                    self.timing = f"eager: graph capture failed ({why}), {n} copies in turn"
                    eager()
                else:
                    self.timing = f"cuda_graph, {n} copies side by side"
                    graph.replay()
            else:
                eager()
            yield outs
