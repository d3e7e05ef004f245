"""The dMoE expert feed-forward with MXFP4 weights, dequantized in registers: one launch per layer.

Computes what tinydiff/kernels/moe_ffn.py computes, out[n] = sum_j weights[n, j] *
down_e(silu(gate_e(x[n])) * up_e(x[n])), e = experts[n, j], with each expert's gate, up (E, F, D)
and down (E, D, F) given packed (tinydiff/fp4.py's Packed, format "mxfp4"): codes (E, out, in/2),
two E2M1 values per byte, and scales (E, out, in/block), one E8M0 exponent per block of inputs.
`moe_ffn_fp4_reference` is the spec: dequantize the weights, then moe_ffn.moe_ffn_reference (the
dispatch loop). The kernel never writes a dequantized weight: it reads 4.25 bits per weight.

The kernel is moe_ffn.py's grouped GEMM (same row tiles of (token, slot) pairs sorted by expert,
same group_by_expert, same fixed-order sum of each token's k rows) with one change in how a
weight tile is read. A byte holds the weights of two neighbouring inputs, 2i (low nibble) and
2i + 1 (high nibble). Rather than interleave them back into one tile, the program splits every
reduction into its even and odd halves: x W^T = x[:, even] W[:, even]^T + x[:, odd] W[:, odd]^T.
So a (rows, bytes) tile of codes gives two weight tiles, one per nibble, each a dot with the
matching strided slice of x. Down's reduction runs over F, so gate and up are computed for the
even and the odd hidden units separately too (h_even, h_odd), which meet down's nibbles the same
way. Decoding a nibble: sign = bit 3, exponent field e = bits 1-2, mantissa m = bit 0; the value is
m / 2 when e = 0 and (1 + m / 2) 2^(e - 1) otherwise. The scale 2^(s - 127) is built from its bits
(s << 23 is that float32; s = 0, the subnormal 2^-127, is 1 << 22), so dequantizing is exact.

Leaves out: NVFP4 (its E4M3 block scales and per-matrix scale; the layer dequantizes those),
FP4 activations and FP4 tensor-core instructions (tl.dot_scaled on Blackwell), autotuning.
"""
import torch

from tinydiff.kernels import check_device, use_triton
from tinydiff.kernels.moe_ffn import check_inputs, group_by_expert, moe_ffn_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference below still works, the kernel never runs
    from tinydiff.kernels import no_triton as tl
    from tinydiff.kernels import no_triton as triton


def check_packed(x, gate, up, down):
    for name, p in (("gate", gate), ("up", up), ("down", down)):
        if p.format != "mxfp4" or p.codes.dtype != torch.uint8 or p.scales.dtype != torch.uint8 or p.codes.dim() != 3:
            raise ValueError(f"{name} must be mxfp4-packed (E, out, in/2) uint8 codes with uint8 scales")
        if p.scales.shape[-1] * p.block_size != p.shape[-1]:
            raise ValueError(f"{name}'s scales {tuple(p.scales.shape)} do not cover {p.shape[-1]} inputs in blocks "
                             f"of {p.block_size}")
    if gate.block_size % 2:
        raise ValueError(f"the kernel needs an even block size (a byte's two values share a scale), "
                         f"got {gate.block_size}")


def moe_ffn_fp4_reference(x, weights, experts, gate, up, down):
    """Dequantize the packed weights (into x's dtype), then the dispatch loop: x (N, D), weights/experts (N, k)."""
    check_packed(x, gate, up, down)
    return moe_ffn_reference(x, weights, experts, *(p.dequantize(x.dtype) for p in (gate, up, down)))


@triton.jit
def _fp4_tile(code_ptr, scale_ptr, rows, half, row_ok, half_ok, s_row, s_scale, BLOCK_SIZE: tl.constexpr):
    """Dequantize a tile of bytes: rows (R,) x byte columns half (H,) -> the weights of the even and
    of the odd inputs, both (H, R): the transposed tiles a dot with x needs."""
    mask = half_ok[:, None] & row_ok[None, :]
    byte = tl.load(code_ptr + rows[None, :] * s_row + half[:, None], mask=mask, other=0).to(tl.int32)  # (H, R)
    s = tl.load(scale_ptr + rows[None, :] * s_scale + (2 * half[:, None]) // BLOCK_SIZE, mask=mask, other=127)
    s = s.to(tl.int32)
    scale = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127), exactly
    lo, hi = byte & 0xF, byte >> 4
    return _e2m1(lo) * scale, _e2m1(hi) * scale


@triton.jit
def _e2m1(c):
    """E2M1 codes (int32 0..15) -> float32 values."""
    e, m = (c >> 1) & 3, (c & 1).to(tl.float32)
    magnitude = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((c & 8) != 0, -magnitude, magnitude)


@triton.jit
def _gate_up(x_even, x_odd, gc_ptr, gs_ptr, uc_ptr, us_ptr, rows, kh, f_ok, k_ok, s_row, s_scale,
             BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    """x W_gate^T and x W_up^T (M, R) for hidden units `rows`, over the inputs of byte columns kh:
    the even inputs' weights (low nibbles) meet x_even, the odd ones' (high nibbles) x_odd."""
    g_lo, g_hi = _fp4_tile(gc_ptr, gs_ptr, rows, kh, f_ok, k_ok, s_row, s_scale, BLOCK_SIZE)  # (KH, R) each
    u_lo, u_hi = _fp4_tile(uc_ptr, us_ptr, rows, kh, f_ok, k_ok, s_row, s_scale, BLOCK_SIZE)
    g = tl.dot(x_even, g_lo.to(x_even.dtype), input_precision=PRECISION)
    g += tl.dot(x_odd, g_hi.to(x_odd.dtype), input_precision=PRECISION)
    u = tl.dot(x_even, u_lo.to(x_even.dtype), input_precision=PRECISION)
    u += tl.dot(x_odd, u_hi.to(x_odd.dtype), input_precision=PRECISION)
    return g, u


@triton.jit
def _moe_ffn_fp4_kernel(x_ptr, w_ptr, pairs_ptr, tile_expert_ptr, gc_ptr, gs_ptr, uc_ptr, us_ptr, dc_ptr, ds_ptr,
                        out_ptr, D, Fd, K, sxn, sgce, sgcf, sgse, sgsf, sdce, sdcd, sdse, sdsd, son,
                        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_FH: tl.constexpr, BLOCK_KH: tl.constexpr, PRECISION: tl.constexpr):
    tile, col = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)  # this tile's expert
    if e < 0:
        return  # past the last real tile (the grid is an upper bound)
    pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,) n*k + j, -1 = padding
    real = pair >= 0
    token = tl.where(real, pair // K, 0)
    n = col * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's output columns
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # gate and up share their layout (E, F, D/2) and (E, F, D/block): one set of strides serves both
    for f0 in range(0, Fd // 2, BLOCK_FH):  # hidden units 2(f0 + i) (even) and 2(f0 + i) + 1 (odd)
        fh = f0 + tl.arange(0, BLOCK_FH)
        f_ok = fh < Fd // 2
        f_even, f_odd = 2 * fh, 2 * fh + 1
        g_even = tl.zeros((BLOCK_M, BLOCK_FH), tl.float32)
        g_odd = tl.zeros((BLOCK_M, BLOCK_FH), tl.float32)
        u_even = tl.zeros((BLOCK_M, BLOCK_FH), tl.float32)
        u_odd = tl.zeros((BLOCK_M, BLOCK_FH), tl.float32)
        for k0 in range(0, D // 2, BLOCK_KH):  # byte columns k0.., i.e. inputs 2k (even) and 2k + 1 (odd)
            kh = k0 + tl.arange(0, BLOCK_KH)
            k_ok = kh < D // 2
            x_mask = real[:, None] & k_ok[None, :]
            x_even = tl.load(x_ptr + token[:, None] * sxn + 2 * kh[None, :], mask=x_mask, other=0.0)  # (M, KH)
            x_odd = tl.load(x_ptr + token[:, None] * sxn + 2 * kh[None, :] + 1, mask=x_mask, other=0.0)
            g, u = _gate_up(x_even, x_odd, gc_ptr + e * sgce, gs_ptr + e * sgse, uc_ptr + e * sgce, us_ptr + e * sgse,
                            f_even, kh, f_ok, k_ok, sgcf, sgsf, BLOCK_SIZE, PRECISION)
            g_even += g
            u_even += u
            g, u = _gate_up(x_even, x_odd, gc_ptr + e * sgce, gs_ptr + e * sgse, uc_ptr + e * sgce, us_ptr + e * sgse,
                            f_odd, kh, f_ok, k_ok, sgcf, sgsf, BLOCK_SIZE, PRECISION)
            g_odd += g
            u_odd += u
        h_even = g_even * tl.sigmoid(g_even) * u_even  # silu(x W_gate^T) * (x W_up^T), never stored
        h_odd = g_odd * tl.sigmoid(g_odd) * u_odd
        # W_down^T's rows f_even and f_odd are the low and high nibbles of down's byte columns fh
        dw_e, dw_o = _fp4_tile(dc_ptr + e * sdce, ds_ptr + e * sdse, n, fh, n < D, f_ok, sdcd, sdsd,
                               BLOCK_SIZE)  # (FH, BLOCK_N) each
        acc += tl.dot(h_even.to(x_ptr.dtype.element_ty), dw_e.to(x_ptr.dtype.element_ty), input_precision=PRECISION)
        acc += tl.dot(h_odd.to(x_ptr.dtype.element_ty), dw_o.to(x_ptr.dtype.element_ty), input_precision=PRECISION)
    acc = acc * tl.load(w_ptr + pair, mask=real, other=0.0)[:, None]  # the routing weight
    tl.store(out_ptr + pair[:, None] * son + n[None, :], acc, mask=real[:, None] & (n < D)[None, :])


def moe_ffn_fp4_triton(x, weights, experts, gate, up, down, block_m: int = 32, block_n: int = 128,
                       block_fh: int = 64, block_kh: int = 32, precision: str = "ieee"):
    """The kernel; same arguments and result as `moe_ffn_fp4_reference`. Tiles (powers of 2 >= 16):
    block_m (token, slot) rows, block_n output columns, block_fh even (and as many odd) hidden
    units, block_kh bytes (twice as many inputs) of the reduction at a time. The defaults were the
    fastest of `python -m tinydiff.bench.kernels --kernels moe-fp4 --sweep` on an H200."""
    check_packed(x, gate, up, down)
    check_inputs(x, weights, experts, torch.empty(gate.shape, device="meta"), torch.empty(up.shape, device="meta"),
                 torch.empty(down.shape, device="meta"))
    check_device(_moe_ffn_fp4_kernel, x)
    (N, D), (E, Fd, _), k = x.shape, gate.shape, experts.shape[1]
    if N * k == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    gc, gs, uc, us, dc, ds = (t.contiguous() for p in (gate, up, down) for t in (p.codes, p.scales))
    pairs, tile_expert = group_by_expert(experts, E, block_m)
    out = torch.empty(N * k, D, dtype=torch.float32, device=x.device)  # one row per (token, slot)
    block_n = min(block_n, max(16, triton.next_power_of_2(D)))
    block_kh = min(block_kh, max(16, triton.next_power_of_2(D // 2)))
    block_fh = min(block_fh, max(16, triton.next_power_of_2(Fd // 2)))
    grid = (len(tile_expert), triton.cdiv(D, block_n))
    _moe_ffn_fp4_kernel[grid](x, weights.float().contiguous(), pairs, tile_expert, gc, gs, uc, us, dc, ds, out,
                              D, Fd, k, x.stride(0), gc.stride(0), gc.stride(1), gs.stride(0), gs.stride(1),
                              dc.stride(0), dc.stride(1), ds.stride(0), ds.stride(1), out.stride(0),
                              BLOCK_SIZE=gate.block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_FH=block_fh,
                              BLOCK_KH=block_kh, PRECISION=precision if x.dtype == torch.float32 else "tf32",
                              num_warps=8)
    return out.view(N, k, D).sum(1).to(x.dtype)  # (N, D): each token's k weighted expert outputs


def moe_ffn_fp4(x, weights, experts, gate, up, down):
    """Dispatch: the kernel where `use_triton(x)`, else the reference. Same arguments and result."""
    if use_triton(x):
        return moe_ffn_fp4_triton(x, weights, experts, gate, up, down)
    return moe_ffn_fp4_reference(x, weights, experts, gate, up, down)
