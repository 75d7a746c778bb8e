"""The study's split-position decode attention (replayssm.bench.decode_attention) against a
float64 softmax attention: the interpreter at small shapes (chunks and blocks smaller than the
prefix, padded head counts), the GPU at the study's shapes."""
import pytest
import torch

pytest.importorskip("triton")

from replayssm.bench.decode_attention import decode_attention, supports  # noqa: E402


def _reference(q, k, v, mask, scale):
    s = torch.einsum("bhgd,bhnd->bhgn", q.double(), k.double()) * scale
    s = s.masked_fill(~mask[:, :, :1, :].expand(s.shape[0], 1, 1, -1), float("-inf"))
    return torch.einsum("bhgn,bhnd->bhgd", torch.softmax(s, -1), v.double())


def _case(B, kv, g, D, S, n, device, seed=0, per_row=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, kv * g, 1, D, generator=gen).reshape(B, kv, g, D)
    cache_k, cache_v = (torch.randn(B, kv, S, D, generator=gen) for _ in range(2))
    mask = torch.rand(B if per_row else 1, 1, 1, S, generator=gen) < 0.8      # holes, as padding leaves
    mask[..., 0] = True                      # every row attends somewhere
    cache_k[:, :, n:] = 1e4                  # past the prefix: never passed in, never read
    to = dict(device=device)
    return (q.to(**to), cache_k[:, :, :n].to(**to), cache_v[:, :, :n].to(**to), mask[..., :n].to(**to))


@pytest.mark.interpret
@pytest.mark.parametrize("g,D,per_row", [(2, 8, True), (3, 12, False)])
def test_decode_attention_equals_float64(g, D, per_row):
    q, k, v, mask = _case(2, 2, g, D, S=96, n=70, device="cpu", per_row=per_row)
    assert supports(q, mask)
    want = _reference(q, k, v, mask, 0.3)
    got = decode_attention(q, k, v, mask, 0.3, chunk=32, block_n=16)      # 3 chunks, the last partial
    assert got.shape == q.shape and got.dtype == q.dtype
    err = (got.double() - want).norm() / want.norm()
    assert err < 1e-6, err
    masked_off = mask.clone()
    masked_off[..., 5] = ~masked_off[..., 5]          # one position more or less must move the output
    assert not torch.allclose(decode_attention(q, k, v, masked_off, 0.3, chunk=32, block_n=16), got)


def test_decode_attention_refuses_what_it_does_not_take():
    q, k, v, mask = _case(1, 2, 2, 8, S=40, n=20, device="cpu")
    assert not supports(q, mask.float())                       # additive masks go elsewhere
    assert not supports(q, mask.expand(1, 2, 1, 20))           # per-head masks too
    with pytest.raises(ValueError, match="do not match"):
        decode_attention(q, k[:, :, :10], v, mask, 0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("g,D,n", [(2, 64, 5000), (4, 16, 70000)])
def test_decode_attention_on_the_gpu(g, D, n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q, k, v, mask = _case(1, 2, g, D, S=n + 64, n=n, device="cuda")
    want = _reference(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), D ** -0.5)
    got = decode_attention(q, k, v, mask, D ** -0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D ** -0.5)
    err = (got.double().cpu() - want).norm() / want.norm()
    err_sdpa = (sdpa.double().cpu() - want).norm() / want.norm()
    assert err <= max(1.5 * err_sdpa, 1e-7), (err, err_sdpa)
