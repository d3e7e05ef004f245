"""Masked attention: new queries over a KV prefix plus themselves, with any boolean mask.

Computes, per batch row and head, softmax(q k^T / sqrt(d) where allowed, -inf elsewhere) v for
q (B, H, T, d) and k, v (B, H, S, d), S = cached rows + T, with a boolean mask (T, S), (B, T, S)
or (B|1, H|1, T, S), True = may attend. Replaces `F.scaled_dot_product_attention(q, k, v,
attn_mask=mask)` as tinydiff/model.py calls it for DDTree verification (tree ancestor masks) and
the semi-autoregressive diffusion sampler (block-causal masks): `masked_attention_reference`.

The kernel is flash attention (Dao et al. 2022) with the mask read tile by tile: a program owns
BLOCK_T query rows of one (batch, head), walks the keys in tiles of BLOCK_S, and keeps per row a
running max m, a running sum l of exp(score - m) and an output accumulator, rescaling both when the
max grows ("online softmax"). The (T, S) score matrix never exists in memory. A key tile that no
query of the program may see is skipped outright: its keys and values are never read (the future
blocks of a block-causal mask, the other branches of a tree). Two rules keep masked rows finite:
while a row has seen nothing its max stays -inf and exponentials are taken relative to 0 instead
(exp(-inf - (-inf)) would be NaN), and a row that sees no key at all returns 0 (what SDPA returns
there depends on the PyTorch version and backend; the model never asks for such a row).

Leaves out: causal / no-mask fast paths (model.py keeps SDPA's is_causal for those), dropout,
the backward pass (inference only), GQA, a mask stored as bits or as a tree parent list (the mask
is one byte per entry, read once per head), autotuning of the tile sizes.
"""
import math

import torch
import torch.nn.functional as F

from tinydiff.kernels import check_device, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference below still works, the kernel never runs
    from tinydiff.kernels import no_triton as tl
    from tinydiff.kernels import no_triton as triton


def broadcast_mask(mask, q, S: int):
    """The mask as (B|1, H|1, T, S): (T, S) and (B, T, S) are shared by all heads."""
    B, H, T, _ = q.shape
    if mask.dtype != torch.bool:
        raise ValueError(f"the mask must be boolean (True = may attend), got {mask.dtype}")
    if mask.dim() in (2, 3):
        mask = mask[None, None] if mask.dim() == 2 else mask[:, None]
    if mask.dim() != 4 or mask.shape[-2:] != (T, S) or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, H):
        raise ValueError(f"mask must be (T, S), (B, T, S) or (B|1, H|1, T, S) with B={B}, H={H}, T={T}, "
                         f"S={S}; got {tuple(mask.shape)}")
    return mask


def masked_attention_reference(q, k, v, mask):
    """The PyTorch path the kernel replaces: SDPA with a boolean mask, as in model.Attention."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=broadcast_mask(mask, q, k.shape[2]))


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, T, S, H, d, scale,
                      sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, smb, smh, smt, sob, soh, sot,
                      BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                      PRECISION: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # this program's query rows
    dims = tl.arange(0, BLOCK_D)  # head dim, padded to a power of two
    row_ok, dim_ok = rows < T, dims < d
    q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqt + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_T, BLOCK_D)
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)  # running max of each row's scores
    l = tl.zeros((BLOCK_T,), tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)  # running sum of exp(score - m) * v
    for start in range(0, S, BLOCK_S):
        cols = start + tl.arange(0, BLOCK_S)  # this tile's key positions
        col_ok = cols < S
        allowed = tl.load(mask_ptr + b * smb + h * smh + rows[:, None] * smt + cols[None, :],
                          mask=row_ok[:, None] & col_ok[None, :], other=0) != 0  # (BLOCK_T, BLOCK_S)
        if tl.max(allowed.to(tl.int32)) > 0:  # a tile no row may see: skip, its K/V are never read
            k = tl.load(k_ptr + b * skb + h * skh + cols[:, None] * sks + dims[None, :],
                        mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_T, BLOCK_S) fp32
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # A row that has seen nothing yet has m_new = -inf: measure from 0 so exp gives 0, not NaN.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])  # (BLOCK_T, BLOCK_S), 0 where masked
            alpha = tl.exp(m - shift)  # rescales what was summed under the old max (0 if none)
            v = tl.load(v_ptr + b * svb + h * svh + cols[:, None] * svs + dims[None, :],
                        mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # a row that sees no key at all: 0
    tl.store(out_ptr + b * sob + h * soh + rows[:, None] * sot + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def masked_attention_triton(q, k, v, mask, block_t: int = 16, block_s: int | None = None, precision: str = "ieee"):
    """The kernel: q (B, H, T, d), k, v (B, H, S, d), mask as in `broadcast_mask` -> (B, H, T, d).

    block_t, block_s: query rows and keys per tile, powers of 2 >= 16. block_s defaults to 128 for
    16-bit inputs and 64 for float32: the fastest tiles of `python -m tinydiff.bench.kernels
    --sweep` on an H200 (dev/LOG.md).

    precision: "ieee" (exact float32 products, the default) or "tf32" (faster float32 on a GPU).
    """
    B, H, T, d = q.shape
    S = k.shape[2]
    block_s = block_s or (64 if q.dtype == torch.float32 else 128)
    if k.shape != (B, H, S, d) or v.shape != k.shape:
        raise ValueError(f"k, v must be (B, H, S, d) = ({B}, {H}, S, {d}); got {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_device(_attention_kernel, q)
    if mask.device != q.device:
        raise ValueError(f"the mask is on {mask.device}, q on {q.device}: move the mask")
    mask = broadcast_mask(mask, q, S)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8).expand(B, H, T, S)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    precision = precision if q.dtype == torch.float32 else "tf32"  # 16-bit inputs: Triton's default
    grid = (triton.cdiv(T, block_t), B * H)
    _attention_kernel[grid](q, k, v, mask, out, T, S, H, d, 1.0 / math.sqrt(d),
                            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *mask.stride()[:3],
                            *out.stride()[:3], BLOCK_T=block_t, BLOCK_S=block_s,
                            BLOCK_D=max(16, triton.next_power_of_2(d)), PRECISION=precision)
    return out


def masked_attention(q, k, v, mask):
    """Dispatch: the kernel where `use_triton(q)`, else the reference. Same arguments and result."""
    if use_triton(q):
        return masked_attention_triton(q, k, v, mask)
    return masked_attention_reference(q, k, v, mask)
