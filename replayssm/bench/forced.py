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

    @torch.no_grad()
    def steps(self, tokens: int):
        from ..integrations import hf
        from .model_cache import rewind
        if self.cache is None:
            raise RuntimeError("StaticPass.steps before prefill_cache")
        if tokens > self.ids.shape[1] - self.prefill:
            raise ValueError(f"{tokens} steps past a prefill of {self.prefill}: ids hold {self.ids.shape[1]} tokens")
        ids, P, model, cache = self.ids, self.prefill, self.model, self.cache
        hf.attach_cache(model, cache)
        rewind(cache, P)
        tok = ids[:, P:P + 1].clone()
        pos = torch.tensor([P], device=ids.device)
        out = torch.empty(ids.shape[0], model.config.vocab_size, dtype=torch.float32, device=ids.device)

        def step():
            logits = model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True,
                           logits_to_keep=1).logits
            pos.add_(1)                 # on the device: a replayed graph moves on like decoding
            out.copy_(logits[:, -1])

        graph = None
        self.timing = "eager: static cache" + ("" if self.graphs else " (CUDA graphs off)")
        for t in range(P, P + tokens):
            tok.copy_(ids[:, t:t + 1])
            if graph is not None:
                graph.replay()
            elif self.graphs and t > P:
                graph = self._capture(step)
                if graph is not None:
                    graph.replay()
                else:
                    step()
            else:
                step()
            yield out

    def _capture(self, step):
        """`step` captured in a CUDA graph (recorded, not run), or None with the reason kept."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step()
        except Exception as e:         # noqa: BLE001 - any capture failure leaves the eager steps
            torch.cuda.synchronize()
            self.timing = f"eager: graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
            return None
        self.timing = "cuda_graph"
        return graph
