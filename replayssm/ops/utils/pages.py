"""Copy whole state pages between blocks, only for the rows whose source and destination
differ: vLLM's prefix caching in `all` mode moves a decoding request to a new block at every
block boundary, which a step must carry over without a host sync (inside a CUDA graph). A
masked torch copy would read and write every row's page every step, the traffic ReplaySSM
exists to avoid; here a program whose row stays in its block returns after two loads."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _replay_copy_pages_kernel(pages, src, dst, words, stride, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    # a fixed number of programs per row, each striding over its part of the page: rows that
    # stay cost PARTS programs that exit after two loads, however large the page
    row = tl.program_id(0)
    part = tl.program_id(1)
    s = tl.load(src + row).to(tl.int64)
    d = tl.load(dst + row).to(tl.int64)
    if (s != d) & (s >= 0) & (d >= 0):
        for start in range(part * BLOCK, words, PARTS * BLOCK):
            o = start + tl.arange(0, BLOCK)
            m = o < words
            tl.store(pages + d * stride + o, tl.load(pages + s * stride + o, mask=m), mask=m)


def copy_pages(pages: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, block: int = 1024,
               parts: int = 16) -> None:
    """`pages[dst[i]] = pages[src[i]]` for every row `i` with `src[i] != dst[i]`, both `>= 0`
    (padding rows: -1). `pages` `[N, W]` with a unit last stride (any dtype: a page's words);
    `src`, `dst` `[B]` integer block ids. On the CPU without the interpreter, a host-indexed
    copy of the same rows."""
    if pages.dim() != 2 or pages.stride(1) != 1:
        raise ValueError(f"pages must be [N, words] with a unit word stride, got {tuple(pages.shape)} "
                         f"strides {pages.stride()}")
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be the same [B]")
    if src.numel() == 0:
        return
    if pages.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        W = pages.shape[1]
        parts = max(1, min(parts, triton.cdiv(W, block)))
        _replay_copy_pages_kernel[(src.numel(), parts)](pages, src, dst, W, pages.stride(0), PARTS=parts, BLOCK=block)
        return
    live = (src != dst) & (src >= 0) & (dst >= 0)
    pages[dst[live].long()] = pages[src[live].long()]
