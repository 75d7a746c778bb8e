"""The fused short convolution (ops/shortconv.py) against the integration's PyTorch path."""
import pytest
import torch

from replayssm.integrations.hf.state import ConvHistory

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pair(C, Kc, T, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ref = ConvHistory(N, C, Kc, T, dtype, "cpu")
    ref.buf.copy_(torch.randn(ref.buf.shape, generator=g).to(dtype))
    ref.pending.copy_(torch.randint(0, T + 1, ref.pending.shape, generator=g))
    dut = ConvHistory(N, C, Kc, T, dtype, DEV)
    dut.buf.copy_(ref.buf)
    dut.pending.copy_(ref.pending)
    return ref, dut, g


@pytest.mark.interpret
@pytest.mark.parametrize("commit_all,S", [(False, 1), (False, 3), (True, 1), (True, 2), (True, 6)])
@pytest.mark.parametrize("act", ["silu", "none"])
def test_fused_convolution_equals_the_torch_path(commit_all, S, act):
    from replayssm.ops.shortconv import short_conv_update
    C, Kc, T, N = 37, 4, 3, 5                   # C not a multiple of the block: masked channels
    ref, dut, g = _pair(C, Kc, T, N, torch.float32, seed=S + 10 * commit_all)
    slots = torch.tensor([3, -1, 0, 4], dtype=torch.int32)     # a padding row among them
    x = torch.randn(4, S, C, generator=g)
    weight = torch.randn(C, Kc, generator=g)
    for bias in (torch.randn(C, generator=g), None):
        fn = torch.nn.functional.silu if act == "silu" else None
        want = ref.run(slots, x, weight, bias, fn or torch.nn.Identity(), commit_all=commit_all)
        got = short_conv_update(dut.buf, dut.pending, slots.to(DEV), x.to(DEV), weight.to(DEV),
                                None if bias is None else bias.to(DEV), act, commit_all=commit_all, block=16)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
        # the slots' histories and pending counts agree exactly (the spare row is scratch)
        assert torch.equal(dut.buf[:-1].cpu(), ref.buf[:-1]) and torch.equal(dut.pending[:-1].cpu(), ref.pending[:-1])
        assert int(dut.pending[-1]) == (0 if commit_all else S)


@pytest.mark.interpret
def test_pending_inputs_then_commit_match_the_torch_path():
    # a verification of 3 tokens (pending), a commit of 2, then a decode step: the fused
    # convolution reads only the committed history, as the torch path does
    from replayssm.ops.shortconv import short_conv_update
    C, Kc, T, N = 20, 4, 3, 3
    ref, dut, g = _pair(C, Kc, T, N, torch.bfloat16, seed=7)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    weight, bias = torch.randn(C, Kc, generator=g), torch.randn(C, generator=g)
    x3, x1 = torch.randn(2, 3, C, generator=g).bfloat16(), torch.randn(2, 1, C, generator=g).bfloat16()
    ref.run(slots, x3, weight, bias, torch.nn.functional.silu)
    short_conv_update(dut.buf, dut.pending, slots.to(DEV), x3.to(DEV), weight.to(DEV), bias.to(DEV), "silu",
                      commit_all=False)
    acc = torch.tensor([2, 1])
    ref.commit(slots, acc)
    dut.commit(slots.to(DEV), acc.to(DEV))
    want = ref.run(slots, x1, weight, bias, torch.nn.functional.silu, commit_all=True)
    got = short_conv_update(dut.buf, dut.pending, slots.to(DEV), x1.to(DEV), weight.to(DEV), bias.to(DEV), "silu",
                            commit_all=True)
    # bf16 inputs, fp32 arithmetic in the kernel against the torch path's bf16 convolution
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(dut.buf[:-1].cpu(), ref.buf[:-1])


def test_bad_arguments_are_refused():
    from replayssm.ops.shortconv import short_conv_update
    h = ConvHistory(2, 8, 4, 2, torch.float32, "cpu")
    s, w = torch.tensor([0]), torch.zeros(8, 4)
    with pytest.raises(ValueError, match="activation"):
        short_conv_update(h.buf, h.pending, s, torch.zeros(1, 1, 8), w, None, "gelu", commit_all=True)
    with pytest.raises(ValueError, match="pending positions"):
        short_conv_update(h.buf, h.pending, s, torch.zeros(1, 3, 8), w, None, "silu", commit_all=False)
    with pytest.raises(ValueError, match="shapes disagree"):
        short_conv_update(h.buf, h.pending, s, torch.zeros(1, 1, 8), torch.zeros(7, 4), None, "silu",
                          commit_all=True)
