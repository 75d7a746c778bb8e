"""Prefix caching of replayssm state in vLLM's `all` mode (Mamba-2; replayssm.integrations.vllm
.prefix), on the CPU without vLLM: metadata as vLLM 0.25's Mamba-2 builder makes it (each
request's block table, the blocks of its last computed, first and last scheduled tokens), page
views as vLLM lays them out, the reference executor against an oracle pool that decodes each
sequence in one slot. A decode step that starts a block moves the page there and leaves the
block behind it with the state at its boundary; prefill marks the blocks it wrote as states."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from replayssm.integrations.vllm import batch, prefix, state
from replayssm.ops.utils.pages import copy_pages

from test_vllm_plugin import HV, K, V, _pair, tokens

BS = 3                                          # tokens per block (vLLM's mamba_block_size)


def _decode_md(tables, position):
    """A decode step of `tables` `[B, blocks]` at token `position` (0-based) for every row."""
    n = tables.shape[0]
    return NS(num_decodes=n, state_indices_tensor_d=tables,
              block_idx_last_computed_token=torch.full((n,), (position - 1) // BS),
              block_idx_last_scheduled_token=torch.full((n,), position // BS))


@pytest.mark.parametrize("interpret", [True, False])
def test_decode_across_blocks_equals_one_slot(interpret, monkeypatch):
    # two requests (block tables [1, 3, 5] and [2, 4, 6]) and a padding row, prefilled with 3
    # tokens (one block), decode tokens 3..8: at 3 and 6 the page moves on. Outputs equal the
    # oracle's, which decodes each sequence in one slot; each block left behind holds the state
    # at its boundary, and the padding row's block 0 and unused blocks stay as they were
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")      # the kernel, or the host copy
    g = torch.Generator().manual_seed(3)
    st, ex, oracle, params = _pair("mamba2", 1, g)
    A = params["A"]
    tables = torch.tensor([[1, 3, 5], [2, 4, 6], [0, 0, 0]], dtype=torch.int32)
    S0 = torch.randn(2, HV, V, K, generator=g) * 0.3
    st.ckpt[[1, 2]] = S0
    prefix.seed_prefilled(st, NS(num_decodes=0, state_indices_tensor_p=tables[:2],
                                 block_idx_first_scheduled_token_p=torch.zeros(2),
                                 block_idx_last_scheduled_token=torch.zeros(2)))
    seq = torch.tensor([1, 2], dtype=torch.int32)
    oracle.load(seq, S0)
    null = state.page_view(st)[0].clone()
    at_boundary = {0: oracle.materialize(seq)}
    for position in range(3, 9):
        md = _decode_md(tables, position)
        slots = prefix.move_decoding(st, md)
        assert slots.tolist() == tables[:2, position // BS].tolist() + [-1]
        one = tokens("mamba2", 2, g)
        three = {k: torch.cat([v, v[:1]]) for k, v in one.items()}
        out = torch.empty(3, HV, V)
        batch.run_decode(ex, st, slots, three, out)
        want = oracle.decode(seq, **one)
        assert torch.allclose(out[:2], want, rtol=1e-5, atol=1e-6), position
        if position % BS == BS - 1:
            at_boundary[position // BS] = oracle.materialize(seq)
    oracle_state = state.BlockState.allocate_paged(st.spec, st.N)        # materialize blocks through a pool
    for col in (0, 1):                     # blocks left behind: the state after their last token
        blocks = tables[:2, col]
        got = _materialize(st, blocks, A, oracle_state)
        assert torch.allclose(got, at_boundary[col], rtol=1e-4, atol=1e-5), col
    assert torch.equal(state.page_view(st)[0], null)


def _materialize(st, blocks, A, scratch):
    # fold a copy of the blocks' records (the plugin's flush) and read the checkpoints
    state.page_view(scratch)[blocks.long()] = state.page_view(st)[blocks.long()]
    state.flush(scratch, blocks, A)
    return scratch.ckpt[blocks.long()].clone()


def test_prefill_marks_the_blocks_it_wrote():
    # one decode row, then two prefills: one from block 0 to 2 of its table, one inside its
    # block 1; only those blocks get empty records (vLLM wrote their checkpoints)
    g = torch.Generator().manual_seed(4)
    st, _, _, _ = _pair("mamba2", 1, g)
    st.cursor.fill_(3)
    md = NS(num_decodes=1, state_indices_tensor_p=torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
            block_idx_first_scheduled_token_p=torch.tensor([0, 1]),
            block_idx_last_scheduled_token=torch.tensor([0, 2, 1]),
            block_idx_last_computed_token=torch.tensor([0, 0, 0]))
    prefix.seed_prefilled(st, md)
    assert st.cursor.tolist() == [3, 0, 0, 0, 3, 0, 3]
    assert prefix.prefill_sources(md).tolist() == [1, 4]
    only = prefix.prefill_only(NS(num_decodes=1, block_idx_last_computed_token=torch.tensor([5, 6, 7]),
                                  block_idx_last_scheduled_token=torch.tensor([5, 8, 9]),
                                  block_idx_last_scheduled_token_prev_step=None))
    assert only["block_idx_last_computed_token"].tolist() == [6, 7]
    assert only["block_idx_last_scheduled_token"].tolist() == [8, 9]
    assert only["block_idx_last_scheduled_token_prev_step"] is None
    assert prefix.all_mode(md) and not prefix.all_mode(NS(block_idx_last_scheduled_token=None))


@pytest.mark.parametrize("interpret", [True, False])
def test_copy_pages_moves_the_differing_rows_only(interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    pages = torch.arange(6 * 5000, dtype=torch.int32).reshape(6, 5000)[:, :4100]     # strided rows
    before = pages.clone()
    copy_pages(pages, torch.tensor([1, 2, -1, 4], dtype=torch.int32), torch.tensor([3, 2, 5, -1], dtype=torch.int32),
               block=256, parts=3)
    want = before.clone()
    want[3] = before[1]
    assert torch.equal(pages, want)
    with pytest.raises(ValueError, match="unit word stride"):
        copy_pages(pages.t(), torch.tensor([1]), torch.tensor([2]))


def test_all_mode_is_a_switch_for_mamba2_without_drafts(monkeypatch):
    monkeypatch.delenv(prefix.ALL_SWITCH, raising=False)
    with pytest.raises(NotImplementedError, match="--mamba-cache-mode align"):
        prefix.check_cache_mode("all", 0)
    monkeypatch.setenv(prefix.ALL_SWITCH, "1")
    prefix.check_cache_mode("all", 0)
    with pytest.raises(NotImplementedError, match="speculative"):
        prefix.check_cache_mode("all", 3)
    with pytest.raises(NotImplementedError, match="gdn"):
        prefix.check_cache_mode("all", 0, "gdn")
