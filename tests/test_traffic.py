"""The traffic model of SPEC section 6 reproduces the paper's figures and its own algebra."""
import pytest

from replayssm import traffic


def test_nemotron3_super_figures():
    dv, dk = 64, 128
    r = traffic.record_bytes(dv, dk)
    assert r == 2 * 64 + 2 * 128 + 4
    assert round(traffic.state_bytes(dv, dk) / r) == 84
    assert round(traffic.l_star(dv, dk)) == 13
    assert round(traffic.l_star(dv, dk, T=4, A=3.5)) == 24


def test_closed_forms():
    dv, dk, L = 64, 128, 16
    r = traffic.record_bytes(dv, dk)
    assert traffic.m_conv(L, dv, dk) == 8 * L * dv * dk
    assert traffic.m_replay(L, dv, dk) == 4 * (L + 1) * dv * dk + (L - 1) * (L + 2) / 2 * r
    # standard decoding: f(L) is the window's traffic per token
    assert traffic.f(L, dv, dk) == pytest.approx(traffic.m_replay(L, dv, dk) / L)
    # L* minimises f over real L (checked on a fine grid) for several settings
    for T, A in ((1, 1.0), (4, 3.5), (8, 5.0)):
        ls = traffic.l_star(dv, dk, T=T, A=A)
        grid = [ls * (1 + e) for e in (-0.2, -0.05, 0.05, 0.2)]
        assert all(traffic.f(ls, dv, dk, T=T, A=A) < traffic.f(x, dv, dk, T=T, A=A) for x in grid)


def test_precisions_and_shapes():
    dv, dk = 128, 128
    assert traffic.state_bytes(dv, dk, "bf16") == 2 * dv * dk
    assert traffic.state_bytes(dv, dk, "nvfp4") == pytest.approx(dv * dk * (0.5 + 1 / 16))
    # a smaller state makes replay worth less: L* shrinks with the state's bytes
    assert traffic.l_star(dv, dk, "fp8_e4m3") < traffic.l_star(dv, dk, "fp32")
    # replay cannot pay when a record is as large as the state per draft token
    assert traffic.l_star(64, 128, T=100) == 0.0
    # two checkpoints: L-1 low-precision reads, one HP read and one write of each
    L = 16
    ms, lp = 4 * dv * dk, dv * dk
    rec = (L - 1) * (L + 2) / 2 * traffic.record_bytes(dv, dk)
    assert traffic.m_replay(L, dv, dk, "fp32", lp_format="fp8_e4m3") == (L - 1) * lp + 2 * ms + lp + rec


def test_decode_step_bytes_sum_to_window_model():
    """Per-step byte counts over one window equal M_replay when keys are per head."""
    dv, dk, L = 64, 128, 16
    total = sum(traffic.decode_step_bytes(h, L, 1, dv, dk, 1) for h in range(L))
    assert total == pytest.approx(traffic.m_replay(L, dv, dk))
    # sharing keys across a group of 16 heads moves fewer bytes than per-head keys
    shared = sum(traffic.decode_step_bytes(h, L, 16, dv, dk, 1) for h in range(L))
    assert shared < 16 * total
