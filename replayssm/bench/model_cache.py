"""The whole-model benchmark's prefilled cache (`replayssm bench model`, model.py): a stock
prefill of random tokens into a transformers `StaticCache` that every scheme then decodes from,
in chunks that shrink when a forward runs out of memory, and the bookkeeping around it (the
key/value cache's size, the room a point needs, the write position each scheme starts at)."""
from __future__ import annotations

import contextlib
import gc

import torch


def kv_bytes(model, batch: int, positions: int) -> int:
    """Bytes of the attention layers' key/value cache for `batch` rows of `positions`."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer
    cfg = model.config
    layers = sum(isinstance(layer, StaticLayer) for layer in StaticCache(config=cfg, max_cache_len=1).layers)
    per_token = layers * 2 * cfg.num_key_value_heads * cfg.head_dim * next(model.parameters()).element_size()
    return per_token * batch * positions


def _no_room(need: int, device, kv_budget: float) -> str:
    """Why a point is skipped ("" when its key/value cache of `need` bytes fits the budget)."""
    if not (torch.cuda.is_available() and str(device).startswith("cuda")):
        return ""
    free = torch.cuda.mem_get_info()[0]
    if need <= kv_budget * free:
        return ""
    return f"skipped: key/value cache {need / 2**30:.1f} GiB > {kv_budget:.0%} of free {free / 2**30:.1f} GiB"


def step_budget(reps: int) -> int:
    """Decode steps one scheme may run on a cache: the first eager step, a capture's warm-up and
    replays, and an eager fallback's (the static cache must hold them all)."""
    return 2 * reps + 16


def rewind(cache, context: int) -> None:
    """Put the attention layers' write position back to `context` (each scheme starts there)."""
    from transformers.cache_utils import StaticLayer
    for layer in cache.layers:
        if isinstance(layer, StaticLayer) and layer.is_initialized:
            layer.cumulative_length.fill_(context)


@torch.no_grad()
def prefill(model, batch: int, context: int, *, prefill_tokens: int = 131072, seed: int = 0, steps: int = 1,
            real: int = 0):
    """A stock prefill of random tokens into a static cache with room for `steps` decode steps:
    `(cache, first_token [batch, 1])`.

    `real` (0: all of `context`): prefill only the first `real` positions through the model and
    fill the attention layers' keys and values at positions `real..context` with random values
    of the prefilled ones' spread. The decode step then reads `context` positions as after a
    full prefill, at the cost of its timing only: a decode step's work does not depend on the
    cached values, and the recurrent states (fixed size) come from the `real` tokens. Without
    fast prefill kernels (fla-core, mamba-ssm) a full prefill of 256 x 16384 tokens through
    transformers' torch path takes minutes.

    At most `prefill_tokens // batch` tokens a forward, halved (from a fresh cache) each time a
    forward runs out of memory; the cache's `_replayssm_prefill_tokens` says what ran."""
    device = next(model.parameters()).device
    if real < 0:
        raise ValueError(f"real must be >= 0, got {real}")
    real = context if real == 0 else min(real, context)
    ids = torch.randint(3, model.config.vocab_size, (batch, real),
                        generator=torch.Generator().manual_seed(seed)).to(device)
    chunk = max(1, min(real, prefill_tokens // batch))
    while True:
        try:
            return _prefill_chunks(model, ids, context, steps, chunk, seed)
        except torch.OutOfMemoryError:
            # transformers' torch paths of the recurrent layers (no mamba-ssm / fla-core here)
            # build products that grow with batch x chunk^2 (Mamba-2's scan asked for 768 GiB at
            # batch 256 with 512 tokens a forward): fewer tokens a forward, from a fresh cache
            # (the layers before the failing one already advanced their states). The retry
            # happens outside this handler so that the traceback's frames, which hold the
            # partial cache, are gone first.
            if chunk == 1:
                raise
        chunk //= 2
        _free()
        print(f"prefill: out of memory at batch {batch}; retrying with {chunk} tokens a forward")


def _prefill_chunks(model, ids, context: int, steps: int, chunk: int, seed: int):
    """`prefill`'s work at `chunk` tokens per forward (the first `ids.shape[1]` positions
    through the model, the rest of `context` random keys and values)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer
    device = ids.device
    real = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=context + steps)
    with _short_scan_chunks(model, chunk):
        for start in range(0, real, chunk):
            end = min(real, start + chunk)
            out = model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1,
                        cache_position=torch.arange(start, end, device=device))
    if real < context:
        g = torch.Generator(device=device).manual_seed(seed + 1)
        for layer in cache.layers:
            if isinstance(layer, StaticLayer) and layer.is_initialized:
                for buf in (layer.keys, layer.values):
                    fill = buf[:, :, real:context]       # [batch, kv heads, positions, head dim]
                    std = buf[:, :, :real].float().std().clamp_min(1e-3)
                    fill.copy_(torch.randn(fill.shape, generator=g, device=device) * std)
        rewind(cache, context)
    cache._replayssm_prefill_tokens = chunk          # tokens a forward: the rows record it
    return cache, out.logits[:, -1:].argmax(-1)


PREFILL_OOM = "skipped: out of memory in the stock prefill, even at one token a forward"


def _prefill_or_none(model, batch: int, context: int, prefill_tokens: int, steps: int, real: int):
    """`prefill`, or `(None, None)` when it cannot fit at one token a forward (the point is
    skipped with `PREFILL_OOM`, as a cache that does not fit is, not a traceback)."""
    try:
        return prefill(model, batch, context, prefill_tokens=prefill_tokens, steps=steps, real=real)
    except torch.OutOfMemoryError:
        pass
    _free()                                # outside the handler: its frames held the cache
    return None, None


@contextlib.contextmanager
def _short_scan_chunks(model, tokens: int):
    """Mamba-2 mixers' chunked torch scan (transformers' path without mamba-ssm) pads every
    forward to its chunk length and builds `[batch, chunk, chunk, heads, state]` products: 48
    GiB at batch 64 for a 128-token chunk. A forward of fewer tokens runs with a chunk just
    covering them (the same result: the chunk length only splits the scan)."""
    changed = []
    for m in model.modules():
        size = getattr(m, "chunk_size", None)
        if isinstance(size, int) and hasattr(m, "ssm_state_size") and size > tokens:
            changed.append((m, size))
            m.chunk_size = max(1, tokens)
    try:
        yield
    finally:
        for m, size in changed:
            m.chunk_size = size


def _free() -> None:
    """Return a finished point's cache and pools to the device: the bindings between caches and
    the recurrent state form reference cycles, which only the collector frees."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
