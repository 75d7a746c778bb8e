"""`enable` / `disable`: run a loaded transformers hybrid model's recurrent layers on
ReplaySSM state.

`enable` walks the model for its recurrent mixers and gives each an instance-level
`forward` (the class's is untouched, so other models and a disabled model run stock code), and
the model an instance-level `generate` that frees a sequence's slots as soon as it emits EOS:

- prefill (the cache has no state for the layer yet) runs the mixer's own forward, then
  seeds the layer's pool (`load`) and convolution history from what it left in the cache;
- a one-token step runs the projections, the convolution on the history, `pool.decode`,
  and the mixer's norm and output projection;
- a multi-token step on a cache with state runs `pool.verify` (in chunks of at most
  `max_draft` tokens) and commits them at once (e.g. a prompt continued on an existing cache);
- while the model is verifying drafts (`speculative_generate`) every step, one token or
  more, runs `pool.verify` and its tokens stay pending until `ReplayState.commit`.
"""
from __future__ import annotations

import types
from typing import Optional

import torch

from ... import formats
from ...ops.utils.launch import capturing
from ...pool import validate as check
from .mixers import ADAPTERS, UNSUPPORTED, UnsupportedModelError, adapter_for
from .state import ReplayState

_ATTR = "_replayssm_state"
# model classes with recurrent layers that this integration has not been written for
_STATEFUL_HINT = ("Mamba", "Rwkv", "Lfm2", "Jamba", "Xlstm", "RecurrentGemma", "Minimax", "Olmo")


def _mixers(model):
    """`[(layer_idx, module)]` of every recurrent mixer; raises for a known recurrent class
    that is not supported."""
    found = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls in UNSUPPORTED:
            raise UnsupportedModelError(f"{type(model).__name__}: mixer {cls} ({name}) is not supported by "
                                        f"ReplaySSM: {UNSUPPORTED[cls]}")
        if cls in ADAPTERS:
            idx = getattr(mod, "layer_idx", None)
            if idx is None:
                raise UnsupportedModelError(f"{type(model).__name__}: mixer {cls} ({name}) has no layer_idx")
            found.append((int(idx), mod))
    return found


SCHEMES = ("replay", "conventional", "snapshot")


def enable(model, *, window: int = 16, record_dtype: Optional[torch.dtype] = None, max_draft: int = 8,
           backend: str = "auto", num_slots: int = 8, scheme: str = "replay", lp_format: Optional[str] = None,
           hp_format: Optional[str] = None, hp_rounding: Optional[str] = None, seed: int = 0,
           eager_max_batch: Optional[int] = None):
    """Run `model`'s recurrent layers on ReplaySSM slot pools. Returns the model.

    Args:
        model: a loaded transformers causal LM (NemotronH, Qwen3.5, Qwen3-Next, Kimi Linear,
            Falcon-H1, GraniteMoeHybrid, Bamba, Zamba2).
        scheme: "replay" (checkpoint + window of records, `SlotPool`) or "conventional" (one
            full fp32 state per sequence and layer rewritten every token, by the project's
            tuned conventional kernels on CUDA and the reference recurrence elsewhere: the
            baseline of `replayssm bench model`; no speculative generation, and `window`,
            `record_dtype` do not apply), or "snapshot" (`max_draft + 1` full fp32 states per
            sequence and layer, verification writing one per token and commit keeping the
            accepted one, as serving engines do: the baseline of speculative generation;
            `window`, `record_dtype` do not apply).
        window: `L`, the replay window of every pool.
        record_dtype: storage dtype of the buffered records (default: fp32, the pools'
            compute dtype); bf16 on a bf16 model halves record traffic.
        max_draft: `T`, the most tokens one verification takes (`speculative_generate`'s
            `num_draft` is at most this); `window >= max_draft`.
        backend: the pools' backend ("auto": the GPU kernels on CUDA, the reference elsewhere).
        num_slots: initial slots per pool (sequences in flight); pools grow on demand.
        lp_format: a low-precision checkpoint copy that non-flush steps read (`SlotPool`'s
            `lp_format`: "fp16", "bf16", "fp8_e4m3", "nvfp4"; the separate design, SPEC
            section 5); None: none.
        hp_format: the storage format of the checkpoint that carries the recurrence (None: fp32);
            alone (no `lp_format`) a narrow one is the shared design, with `window=1` a
            conventional low-precision state rounded every token.
        hp_rounding: "nearest" or "stochastic", the rounding of `hp_format` (default: stochastic
            for formats narrower than fp32); needs a narrow `hp_format`.
        seed: keys the stochastic-rounding streams with each layer's index (`SlotPool`'s `seed`,
            `layer`), so that a run is reproducible from it.
        eager_max_batch: decode batches of at most this many rows take the eager step (window 1;
            `SlotPool`'s option, None: the kernels' measured choice for the shape). 0 keeps
            every batch on the window, as a precision study at batch 1 needs (the eager step
            flushes every token, so a low-precision copy would never be read).

    The precision options and `eager_max_batch` belong to the replay scheme: with another
    scheme a value other than None is a `ValueError` naming it. Every option is checked (and
    the new pools built) before anything changes: a refused call leaves the model as it was.

    Raises `UnsupportedModelError` (a `TypeError`) naming the class for a model without a
    supported recurrent mixer. Enabling twice replaces the state (sequences in flight are lost).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a loaded transformers model (a torch.nn.Module, e.g. hf.build(name) or "
                        f"AutoModelForCausalLM.from_pretrained(...)), got {type(model).__name__} {model!r:.60}")
    check.positive_ints(window=window, max_draft=max_draft)
    mixers = _mixers(model)
    if not mixers:
        cls = type(model).__name__
        hint = " (a recurrent model this integration does not cover)" if any(h in cls for h in _STATEFUL_HINT) else ""
        raise UnsupportedModelError(f"{cls} has no recurrent mixer ReplaySSM supports{hint}; supported mixers: "
                                    f"{sorted(ADAPTERS)}")
    if max_draft > window:
        raise ValueError(f"max_draft {max_draft} needs window >= max_draft, got window {window}")
    adapters = {idx: adapter_for(mod) for idx, mod in mixers}
    precision = dict(lp_format=lp_format, hp_format=hp_format, hp_rounding=hp_rounding,
                     eager_max_batch=eager_max_batch)
    _check_precision(scheme, adapters, seed, **precision)
    param = next(model.parameters())
    # built before the old state goes: the pools' own checks (backend, formats) refuse here too
    state = ReplayState(adapters, window=window, record_dtype=record_dtype, max_draft=max_draft,
                        backend=backend, num_slots=num_slots, device=param.device, dtype=param.dtype,
                        scheme=scheme, seed=seed, **precision)
    if is_enabled(model):
        disable(model)
    for idx, mod in mixers:
        mod.forward = types.MethodType(_replay_forward(state.layers[idx]), mod)
    if hasattr(model, "generate"):
        model.generate = types.MethodType(_freeing_generate(state), model)
    setattr(model, _ATTR, state)
    return model


def _check_precision(scheme: str, adapters: dict, seed, *, lp_format, hp_format, hp_rounding,
                     eager_max_batch) -> None:
    """`enable`'s precision options, checked before anything is built or changed."""
    given = {"lp_format": lp_format, "hp_format": hp_format, "hp_rounding": hp_rounding,
             "eager_max_batch": eager_max_batch}
    if scheme != "replay":
        for name, val in given.items():
            if val is not None:
                raise ValueError(f"{name}={val!r} applies to scheme 'replay' only, not {scheme!r}")
    for name in ("lp_format", "hp_format"):
        if given[name] is not None:
            try:
                formats.check_format(given[name])
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    if hp_rounding is not None:
        try:
            formats.check_rounding(hp_rounding)
        except ValueError as e:
            raise ValueError(f"hp_rounding: {e}") from None
        if hp_rounding == "stochastic" and hp_format in (None, "fp32"):
            # an fp32 checkpoint is stored exactly: the rounding would silently do nothing
            raise ValueError(f"hp_rounding='stochastic' needs a narrower hp_format, got hp_format={hp_format!r}")
    check.count("seed", seed)
    check.count("eager_max_batch", eager_max_batch, optional=True)
    if "nvfp4" in (lp_format, hp_format):
        for idx, a in sorted(adapters.items()):
            if a.K % 16:
                raise ValueError(f"nvfp4 needs a head_k_dim divisible by 16; layer {idx} "
                                 f"({type(a.mixer).__name__}) has {a.K}")


def disable(model):
    """Restore the stock decode path of every recurrent mixer and drop the ReplaySSM state.
    Returns the model; a model that is not enabled is left as it is."""
    state = getattr(model, _ATTR, None)
    if state is None:
        return model
    for layer in state.layers.values():
        mod = layer.adapter.mixer
        if "forward" in vars(mod):
            del mod.forward
    if "generate" in vars(model):
        del model.generate
    delattr(model, _ATTR)
    return model


def is_enabled(model) -> bool:
    return getattr(model, _ATTR, None) is not None


def replay_state(model) -> ReplayState:
    state = getattr(model, _ATTR, None)
    if state is None:
        raise ValueError(f"ReplaySSM is not enabled on {type(model).__name__}; call enable(model) first")
    return state


def attach_cache(model, cache) -> None:
    """Continue from `cache`, prefilled by the model with ReplaySSM disabled (stock code) or
    under another `enable`: every recurrent layer's final state and convolution inputs in
    the cache seed the current state's slots, one per row, as after an enabled prefill."""
    state = replay_state(model)
    for layer in state.layers.values():
        cl = cache.layers[layer.index]
        if cl.recurrent_states[0] is None:
            raise ValueError(f"the cache holds no recurrent state for layer {layer.index}: prefill it first")
        batch, device = cl.recurrent_states[0].shape[0], cl.recurrent_states[0].device
        _seed(layer, cache, batch, device)


def _freeing_generate(state):
    """The model's `generate` while enabled: stock, with one more stopping criterion that never
    stops a row but frees the slots of each row that has just emitted EOS (its later tokens are
    padding, which the pools skip), so that finished sequences leave the pools at once."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _FreeFinished(StoppingCriteria):
        def __init__(self, eos):
            self.eos, self.done = eos, None

        def __call__(self, input_ids, scores, **kwargs):
            never = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            binding = state.latest()
            if binding is None or binding.slots.shape[0] != input_ids.shape[0]:
                return never                    # not this generation's rows (e.g. beams): leave them
            fin = torch.isin(input_ids[:, -1], self.eos.to(input_ids.device))
            new = fin if self.done is None else fin & ~self.done
            self.done = fin if self.done is None else self.done | fin
            if bool(new.any()):
                binding.release(new)
            return never

    def generate(self, *args, **kwargs):
        stock = type(self).generate
        cfg = kwargs.get("generation_config") or self.generation_config
        eos = kwargs.get("eos_token_id", cfg.eos_token_id)
        if eos is None or kwargs.get("num_beams", cfg.num_beams or 1) > 1:
            return stock(self, *args, **kwargs)
        eos = torch.tensor([eos] if isinstance(eos, int) else list(eos))
        crit = StoppingCriteriaList(list(kwargs.pop("stopping_criteria", None) or []) + [_FreeFinished(eos)])
        return stock(self, *args, stopping_criteria=crit, **kwargs)

    return generate


def _replay_forward(layer):
    """The mixer's forward while enabled (bound to the mixer module)."""

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        stock = type(self).forward
        if cache_params is None or not cache_params.has_previous_state(layer.index):
            out = stock(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
            if cache_params is not None:
                _seed(layer, cache_params, hidden_states.shape[0], hidden_states.device)
            return out
        state = layer.state_ref()
        binding = getattr(cache_params, "_replayssm_binding", None)
        if state is None or binding is None or binding.state_ref() is not state:
            raise RuntimeError("this cache was prefilled without the current ReplaySSM state "
                               "(enable or disable was called since); start a new generation")
        if attention_mask is not None and attention_mask.dim() == 2:
            # the stock path zeroes padded inputs of multi-token forwards the same way
            hidden_states = (hidden_states * attention_mask[:, -hidden_states.shape[1]:, None]).to(hidden_states.dtype)
        return _step(layer, state, binding.slots, hidden_states)

    return forward


def _seed(layer, cache, batch: int, device) -> None:
    """After the stock prefill: the layer's final state and last convolution inputs, left in
    the cache, become the slots' checkpoint and history."""
    binding = layer.state_ref().bind(cache, batch, device)
    cl = cache.layers[layer.index]
    slots = binding.slots.to(layer.pool.device)
    final = layer.adapter.prefill_state(cl.recurrent_states[0])
    layer.pool.load(slots, final.to(layer.pool.device, torch.float32))
    layer.conv.load(binding.slots, cl.conv_states[0])


def _step(layer, state, slots, hidden_states):
    """Decode (`S == 1`), verification (pending) or continuation (committed) of `S` tokens."""
    adapter, pool = layer.adapter, layer.pool
    S = hidden_states.shape[1]
    conv_in, side = adapter.project(hidden_states)
    # verification leaves even one token pending: a draft model's first proposal step verifies
    # `[last]` alone, and committing it there would feed `last` twice to its next step
    pending = state.verifying
    if pending and S > state.max_tokens:
        raise ValueError(f"verification of {S} tokens exceeds max_draft {state.max_tokens} "
                         f"(enable(model, max_draft=...))")
    u = layer.conv.run(slots, conv_in, adapter.conv_weight, adapter.conv_bias, adapter.activation,
                       commit_all=not pending)
    inputs = {k: v.to(pool.device) for k, v in adapter.pool_inputs(u, side).items()}
    pslots = slots.to(pool.device)
    if pending:
        if capturing():
            y = pool.verify(pslots, validate=False, **{k: v.to(pool.dtype) for k, v in inputs.items()})
        else:
            y = pool.verify(pslots, **inputs)
    elif S == 1:
        step = {k: v[:, 0] for k, v in inputs.items()}
        if capturing():
            # in a CUDA graph: no host reads (the slot checks), inputs cast here instead
            y = pool.decode(pslots, validate=False, **{k: v.to(pool.dtype) for k, v in step.items()})
        else:
            y = pool.decode(pslots, **step)
        y = y[:, None]
    elif state.scheme == "conventional":
        y = pool.extend(pslots, inputs)
    else:
        y = _extend(pool, pslots, inputs, state.max_tokens, S)
    return adapter.output(y.to(hidden_states.device), side, hidden_states.dtype)


def _extend(pool, slots, inputs, T: int, S: int):
    """`S` tokens continuing a sequence outside verification: chunks of at most `T` tokens,
    each verified and committed in full."""
    live = bool((slots >= 0).any())
    ys = []
    for start in range(0, S, T):
        n = min(T, S - start)
        ys.append(pool.verify(slots, **{k: v[:, start:start + n] for k, v in inputs.items()}))
        if live:
            pool.commit(slots, torch.full_like(slots, n))
    return torch.cat(ys, dim=1)
