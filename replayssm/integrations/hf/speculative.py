"""Speculative generation on ReplaySSM state: a draft proposes `T` tokens, the target checks
them in one forward pass through the pools' `verify`, and the accepted prefix is committed.

transformers' `generate(assistant_model=...)` refuses every stateful model, and its
assisted loop rolls back with `Cache.crop`, which a recurrent state cannot do; this is a
`generate`-like function of its own instead. Rollback is the pools' cursor move (`commit`)
for the recurrent layers and their convolution histories, and for the attention layers a
crop of the key/value cache plus, where rows of one batch accept different counts, mask
zeros over the rejected positions (their keys stay in the cache, never attended to).

One round, per row, with `last` the newest token (not yet in any state) and `T = num_draft`:
the draft proposes `d_1..d_T`; the target verifies `[last, d_1..d_{T-1}]` (`T` tokens), whose
outputs are the distributions `p_1..p_T` that judge `d_1..d_T`. With `m` drafts accepted,
the row gains `c = min(m + 1, T)` tokens: `d_1..d_m` and, when `m < T`, the correction drawn
from `p_{m+1}`; both models commit the first `c` verified tokens. When every draft is
accepted no bonus token is drawn (`d_T` itself starts the next round), which keeps the
verification at `T` tokens, the pools' `max_draft`. Greedy output equals greedy decoding;
sampling is standard speculative sampling (accept `d_j` with probability
`min(1, p_j(d_j) / q_j(d_j))`, else draw from `max(p_j - q_j, 0)` renormalised), so every
token follows the target's distribution.
"""
from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch
from torch import Tensor

from .enable import enable, is_enabled, replay_state


def _crop_attention(cache, n: int) -> None:
    """Drop the last `n` positions of every attention layer's key/value cache."""
    if n <= 0:
        return
    from transformers.cache_utils import DynamicLayer
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and getattr(layer, "keys", None) is not None and layer.keys.numel():
            DynamicLayer.crop(layer, -n)


class _Runner:
    """One model's cache, attention mask and slots during a speculative generation."""

    def __init__(self, model, mask: Tensor):
        self.model, self.mask, self.cache = model, mask.clone(), None
        self.state = replay_state(model)
        args = inspect.signature(model.forward).parameters
        # the pure Mamba-2 model names its cache `cache_params` and has no positions
        self.cache_arg = "past_key_values" if "past_key_values" in args else "cache_params"
        self.positions = "position_ids" in args

    def _forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        kw = {self.cache_arg: self.cache}
        if self.positions:
            kw["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -ids.shape[1]:]
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=True, **kw)
        self.cache = getattr(out, self.cache_arg)
        return out.logits.float()

    def prefill(self, ids: Tensor) -> Tensor:
        logits = self._forward(ids, self.mask)[:, -1]
        self.binding = self.cache._replayssm_binding
        return logits

    def verify(self, ids: Tensor) -> Tensor:
        """Logits `[B, S, vocab]` of `ids` `[B, S]`, their recurrent state left pending."""
        mask = torch.cat([self.mask, torch.ones_like(ids, dtype=self.mask.dtype)], dim=1)
        self.state.verifying = True
        try:
            return self._forward(ids, mask)
        finally:
            self.state.verifying = False

    def commit(self, keep: Tensor, verified: int) -> None:
        """Keep the first `keep[b]` of the `verified` tokens of the last `verify`."""
        self.state.commit(self.binding, keep)
        top = int(keep.max())
        _crop_attention(self.cache, verified - top)
        kept = (torch.arange(top, device=keep.device)[None, :] < keep[:, None]).to(self.mask.dtype)
        self.mask = torch.cat([self.mask, kept], dim=1)

    def propose(self, last: Tensor, T: int, pick):
        """`T` draft tokens after `last` and their distributions (None when greedy). Step `j`
        verifies `[last, d_1..d_{j-1}]` from the committed state (the previous step's
        pending tokens are discarded by the next verify), so the last step leaves exactly
        the `T` tokens the target verifies pending, ready for the same commit."""
        seq, toks, probs = last[:, None], [], []
        for j in range(T):
            _crop_attention(self.cache, j)
            tok, q = pick(self.verify(seq)[:, -1])
            toks.append(tok)
            probs.append(q)
            seq = torch.cat([seq, tok[:, None]], dim=1)
        q = None if probs[0] is None else torch.stack(probs, dim=1)
        return torch.stack(toks, dim=1), q

    def release(self, rows: Optional[Tensor] = None) -> None:
        if self.cache is not None:
            self.binding.release(rows)


def _lookup(history: list, T: int, ngram: int, min_ngram: int = 1) -> Tuple[list, bool]:
    """Prompt lookup: the `T` tokens that followed the latest earlier occurrence of the
    history's last `ngram` (down to `min_ngram`) tokens, padded with the last token, and whether
    such a match exists (without one: the last token `T` times)."""
    for n in range(min(ngram, len(history) - 1), min_ngram - 1, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == tail:
                got = history[start + n:start + n + T]
                return got + [history[-1]] * (T - len(got)), True
    return [history[-1]] * T, False


def _accept(logits: Tensor, drafts: Tensor, q: Optional[Tensor], dist, generator):
    """Accepted count `m` `[B]` and the correction token `[B]` (from `p_{m+1}`; meaningless
    where `m == T`). `logits` `[B, T, vocab]`; `q` `[B, T, vocab]` or None (one-hot drafts:
    greedy drafting or prompt lookup)."""
    B, T, _ = logits.shape
    if dist is None:
        best = logits.argmax(-1)
        ok = best == drafts
        m = ok.to(torch.long).cumprod(1).sum(1)
        return m, best.gather(1, m.clamp(max=T - 1)[:, None])[:, 0]
    p = dist(logits)
    if q is None:
        q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype)
    pd = p.gather(2, drafts[..., None])[..., 0]
    qd = q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(B, T, generator=generator, device=p.device)
    ok = u * qd < pd
    m = ok.to(torch.long).cumprod(1).sum(1)
    j = m.clamp(max=T - 1)
    pj = p[torch.arange(B), j]
    resid = (pj - q[torch.arange(B), j]).clamp(min=0)
    norm = resid.sum(-1, keepdim=True)
    # p == q at this position (a rejection there has probability 0): draw from p itself
    resid = torch.where(norm > 0, resid / norm.clamp(min=1e-30), pj)
    return m, torch.multinomial(resid, 1, generator=generator)[:, 0]


@torch.no_grad()
def speculative_generate(model, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None, draft=None,
                         num_draft: int = 4, max_new_tokens: int = 32, do_sample: bool = False,
                         temperature: float = 1.0, top_k: Optional[int] = None,
                         eos_token_id=None, pad_token_id: Optional[int] = None, ngram: int = 3,
                         min_ngram: int = 1,
                         generator: Optional[torch.Generator] = None, return_stats: bool = False):
    """Speculative generation with a ReplaySSM-enabled target.

    Args:
        model: the target, after `enable(model, max_draft >= num_draft)` (scheme "replay", or
            "snapshot" for the baseline serving engines use).
        input_ids, attention_mask: `[B, L]` prompts, left-padded (mask 0 on padding).
        draft: a small causal LM with the same vocabulary (a hybrid model of a supported
            family: enabled here with the target's settings if it is not), or None for prompt
            lookup (n-gram match over the row's tokens, `ngram` longest, `min_ngram` shortest:
            a row without such a match proposes nothing that round, and a round where no live
            row has one is a plain decode step, as vLLM's n-gram proposer does; byte-level
            vocabularies want a longer match than subword ones).
        num_draft: `T`, tokens proposed per round.
        do_sample, temperature, top_k: greedy by default; sampling keeps the target's
            distribution after the same temperature / top-k.
        eos_token_id, pad_token_id: as in `generate` (default: the model's generation config);
            a row that emits EOS stops and frees its slots, later positions get `pad_token_id`.
        generator: randomness of sampling and acceptance.
        return_stats: also return `{"rounds", "proposed", "accepted"}`: verify rounds, drafts
            proposed (a row without a lookup match proposes none), drafts accepted.

    Returns `[B, L + n]` token ids (`n <= max_new_tokens`, the longest row), like `generate`.
    """
    if draft is not None and not isinstance(draft, torch.nn.Module):
        hint = f" (a loaded model: draft=hf.build({draft!r}))" if isinstance(draft, str) else ""
        raise TypeError(f"draft must be a loaded causal LM or None (prompt lookup), got {type(draft).__name__} "
                        f"{draft!r:.60}{hint}")
    state = replay_state(model)
    if state.scheme == "conventional" or (draft is not None and is_enabled(draft)
                                          and replay_state(draft).scheme == "conventional"):
        raise ValueError("speculative_generate needs scheme='replay' or 'snapshot' on the target and the draft: "
                         "the conventional scheme rewrites its state every token and cannot roll back drafts")
    if not 1 <= num_draft <= state.max_tokens:
        raise ValueError(f"num_draft must be in 1..{state.max_tokens} (enable(max_draft=...)), got {num_draft}")
    if draft is None and not 1 <= min_ngram <= ngram:
        raise ValueError(f"prompt lookup needs 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}")
    if draft is not None and getattr(draft.config, "vocab_size", 0) > getattr(model.config, "vocab_size", 0):
        # its drafts would index past the target's embedding
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) is larger than the target's "
                         f"({model.config.vocab_size}): speculative generation needs the same vocabulary")
    if draft is not None and not is_enabled(draft):
        enable(draft, window=state.opts["window"], record_dtype=state.opts["record_dtype"],
               max_draft=state.max_tokens, backend=state.opts["backend"], scheme=state.scheme)
    if draft is not None and replay_state(draft).max_tokens < num_draft:
        raise ValueError(f"the draft's max_draft {replay_state(draft).max_tokens} is below num_draft {num_draft}")
    gen = model.generation_config
    eos = gen.eos_token_id if eos_token_id is None else eos_token_id
    eos = set([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    pad = pad_token_id if pad_token_id is not None else (gen.pad_token_id if gen.pad_token_id is not None
                                                         else (min(eos) if eos else 0))
    B = input_ids.shape[0]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device).long()

    def dist(logits: Tensor) -> Tensor:
        z = logits / temperature
        if top_k is not None:
            kth = z.topk(min(top_k, z.shape[-1]), dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        return torch.softmax(z, dim=-1)

    def pick(logits: Tensor):
        if not do_sample:
            return logits.argmax(-1), None
        p = dist(logits)
        return torch.multinomial(p, 1, generator=generator)[:, 0], p

    target = _Runner(model, mask)
    helper = _Runner(draft, mask) if draft is not None else None
    out: list = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    stats = {"rounds": 0, "proposed": 0, "accepted": 0}
    try:
        last = pick(target.prefill(input_ids))[0]
        if helper is not None:
            helper.prefill(input_ids)
        history = [input_ids[b][mask[b].bool()].tolist() for b in range(B)]
        _append(out, history, done, last.tolist(), [1] * B, eos, max_new_tokens)
        while not bool(done.all()):
            T = num_draft
            proposing = ~done
            if helper is not None:
                drafts, q = helper.propose(last, T, pick)
            else:
                found = [_lookup(h, T, ngram, min_ngram) for h in history]
                proposing &= torch.tensor([f for _, f in found])
                if not bool(proposing.any()):
                    T = 1             # nothing to propose: one decode step (its one "draft" is never counted)
                drafts = torch.tensor([d[:T] for d, _ in found], device=input_ids.device)
                q = None
            logits = target.verify(torch.cat([last[:, None], drafts[:, :T - 1]], dim=1))
            m, fix = _accept(logits, drafts, q, dist if do_sample else None, generator)
            keep = torch.clamp(m + 1, max=T)
            new = torch.where(torch.arange(T, device=m.device)[None, :] < m[:, None], drafts,
                              fix[:, None].expand(-1, T))
            target.commit(keep, T)
            if helper is not None:
                helper.commit(keep, T)
            stats["rounds"] += 1
            # rows without a lookup match ran padding drafts: their tokens count, not as drafts
            stats["proposed"] += T * int(proposing.sum())
            stats["accepted"] += int(m[proposing.to(m.device)].sum())
            last = new.gather(1, (keep - 1)[:, None])[:, 0]
            finished = _append(out, history, done, new.tolist(), keep.tolist(), eos, max_new_tokens)
            if bool(finished.any()):
                target.release(finished)
                if helper is not None:
                    helper.release(finished)
    finally:
        target.release()
        if helper is not None:
            helper.release()
    n = max(len(o) for o in out)
    gen_ids = torch.full((B, n), pad, dtype=input_ids.dtype, device=input_ids.device)
    for b, o in enumerate(out):
        gen_ids[b, :len(o)] = torch.tensor(o, dtype=input_ids.dtype)
    result = torch.cat([input_ids, gen_ids], dim=1)
    return (result, stats) if return_stats else result


def _append(out: list, history: list, done: Tensor, new: list, counts: list, eos: set, limit: int) -> Tensor:
    """Add each live row's first `counts[b]` new tokens, stopping at EOS or `limit`; marks
    and returns the rows that finished now."""
    finished = torch.zeros_like(done)
    for b, (toks, c) in enumerate(zip(new, counts)):
        if done[b]:
            continue
        row = toks if isinstance(toks, list) else [toks]
        for t in row[:c]:
            out[b].append(t)
            history[b].append(t)
            if t in eos or len(out[b]) >= limit:
                finished[b] = True
                break
    done |= finished
    return finished
