"""The dMoE expert feed-forward: every token through its k routed SwiGLU experts, one launch.

Computes out[n] = sum_j weights[n, j] * down_e(silu(gate_e(x[n])) * up_e(x[n])), e = experts[n, j],
for tokens x (N, D), routing weights and expert ids (N, k), and the experts' weights stacked as
gate_w, up_w (E, F, D) and down_w (E, D, F) (nn.Linear's (out, in) layout). Replaces the dispatch
loop of `tinydiff.dmoe.MoEFeedForward.forward` (index_select the tokens routed to each expert, run
it, index_add the weighted result): `moe_ffn_reference` is that loop over explicit tensors.
The router, block routing (which experts a block may use) and the shared expert stay outside.

The kernel is a grouped GEMM, the layout of MegaBlocks and vLLM's fused MoE:
  1. (PyTorch, on the device) the N*k (token, slot) pairs are sorted by expert, and each expert's
     run is padded to a multiple of the row tile BLOCK_M: `group_by_expert` returns the padded list
     of pair ids (-1 = padding) and each tile's expert. An expert no token chose gets no tile, so
     its weights are never read: with block routing only the coreset's experts cost bandwidth.
  2. (Triton, one launch) a program per (row tile, output-column tile) loads its tile's tokens,
     computes silu(x W_gate^T) * (x W_up^T) chunk by chunk over F and immediately multiplies each
     chunk by the matching W_down slice, so the (rows, F) hidden activation stays in registers,
     then scales by the routing weight and writes one row per (token, slot).
  3. (PyTorch) the k rows of each token are summed (a fixed order: deterministic, no atomics).
The grid is sized by an upper bound on the tile count (no device-to-host sync); tiles past the end
return at once.

MXFP4 weights (`moe_ffn_fp4`, below): the experts given packed (tinydiff/fp4.py's Packed: codes
(E, out, in/2), two E2M1 values a byte, one E8M0 scale per block of inputs) and the same grouped
GEMM, with one change in how a weight tile is read: the kernel never writes a dequantized weight,
it reads 4.25 bits per weight. A byte holds inputs 2i (low nibble) and 2i + 1 (high nibble), so
every reduction splits into its even and odd halves, x W^T = x[:, even] W[:, even]^T +
x[:, odd] W[:, odd]^T: a tile of codes gives two weight tiles, each a dot with the matching strided
slice of x (down's reduction runs over F, so the hidden units split the same way). A nibble with
exponent field e (bits 1-2) and mantissa m (bit 0) is m / 2 when e = 0, else (1 + m / 2) 2^(e - 1),
sign bit 3; the scale 2^(s - 127) is built from its bits (s << 23 as float32), so dequantizing is
exact. Its reference dequantizes, then runs moe_ffn_reference.

Leaves out: the shared expert (a dense SwiGLU beside this), capacity limits, expert parallelism,
fusing the final sum into the kernel (atomics), autotuned tile sizes; NVFP4 in the kernel (its E4M3
scales: the layer dequantizes those), FP4 activations and tensor-core FP4 (tl.dot_scaled).
"""
import torch
import torch.nn.functional as F

from tinydiff.kernels import check_device, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference below still works, the kernel never runs
    from tinydiff.kernels import no_triton as tl
    from tinydiff.kernels import no_triton as triton


def check_inputs(x, weights, experts, gate_w, up_w, down_w):
    N, D = x.shape
    E, Fd, _ = gate_w.shape
    if weights.shape != experts.shape or weights.dim() != 2 or weights.shape[0] != N:
        raise ValueError(f"weights and experts must both be (N, k) with N = {N}; got "
                         f"{tuple(weights.shape)} and {tuple(experts.shape)}")
    if gate_w.shape != (E, Fd, D) or up_w.shape != (E, Fd, D) or down_w.shape != (E, D, Fd):
        raise ValueError(f"need gate_w, up_w (E, F, D) and down_w (E, D, F) with D = {D}; got "
                         f"{tuple(gate_w.shape)}, {tuple(up_w.shape)}, {tuple(down_w.shape)}")
    # Checking the ids' range reads them back to the host: a sync per layer, so only on CPU.
    if not experts.is_cuda and experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= E):
        raise ValueError(f"expert ids must lie in [0, {E})")


def moe_ffn_reference(x, weights, experts, gate_w, up_w, down_w):
    """MoEFeedForward's dispatch loop, over explicit tensors: x (N, D), weights/experts (N, k)."""
    check_inputs(x, weights, experts, gate_w, up_w, down_w)
    out = torch.zeros_like(x)  # (N, D)
    for e in range(gate_w.shape[0]):
        rows, slot = (experts == e).nonzero(as_tuple=True)  # tokens routed to e, and which of their k
        if len(rows) == 0:
            continue  # this expert's weights are never read
        h = x.index_select(0, rows)  # (n_e, D)
        y = F.linear(F.silu(F.linear(h, gate_w[e])) * F.linear(h, up_w[e]), down_w[e])  # (n_e, D)
        out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
    return out


def group_by_expert(experts, n_experts: int, block_m: int):
    """Sort the (token, slot) pairs by expert, each expert's run padded to a multiple of block_m.

    experts (N, k) -> pairs (n_tiles_max * block_m,) pair ids n*k + j, -1 for padding, and
    tile_expert (n_tiles_max,) each tile's expert, -1 for the unused tiles at the end.
    n_tiles_max = ceil(N*k / block_m) + n_experts bounds the tile count without reading it back.
    """
    flat = experts.flatten()  # (N*k,) expert of each pair
    # (E,) pairs per expert, 0 for empty experts; a scatter, since CUDA's bincount reads flat.max() back
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + block_m - 1) // block_m  # (E,) row tiles per expert
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    first_padded = (torch.cumsum(tiles, 0) - tiles) * block_m  # ... and in the padded layout
    e_sorted = flat[order]
    dest = first_padded[e_sorted] + torch.arange(len(order), device=flat.device) - first[e_sorted]
    n_tiles_max = -(-len(flat) // block_m) + min(n_experts, len(flat))
    pairs = torch.full((n_tiles_max * block_m,), -1, dtype=torch.int64, device=flat.device)
    pairs[dest] = order
    tile_end = torch.cumsum(tiles, 0)  # (E,) one past each expert's last tile
    tile_expert = torch.searchsorted(tile_end, torch.arange(n_tiles_max, device=flat.device), right=True)
    return pairs, tile_expert.masked_fill(tile_expert >= n_experts, -1)  # (n_tiles_max,)


@triton.jit
def _moe_ffn_kernel(x_ptr, w_ptr, pairs_ptr, tile_expert_ptr, gate_ptr, up_ptr, down_ptr, out_ptr,
                    D, Fd, K, sxn, sge, sgf, sue, suf, sde, sdd, son,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    tile, col = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)  # this tile's expert
    if e < 0:
        return  # past the last real tile (the grid is an upper bound)
    pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,) n*k + j, -1 = padding
    real = pair >= 0
    token = tl.where(real, pair // K, 0)
    n = col * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's output columns
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for f0 in range(0, Fd, BLOCK_F):  # the hidden width, a chunk at a time
        f = f0 + tl.arange(0, BLOCK_F)
        gate = tl.zeros((BLOCK_M, BLOCK_F), tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_F), tl.float32)
        for k0 in range(0, D, BLOCK_K):  # x W^T, summed over the model width a chunk at a time
            kk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + token[:, None] * sxn + kk[None, :],
                         mask=real[:, None] & (kk < D)[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            w_mask = (kk < D)[:, None] & (f < Fd)[None, :]
            # (BLOCK_K, BLOCK_F) slices of W_gate^T and W_up^T: expert e's rows f, columns kk
            gw = tl.load(gate_ptr + e * sge + f[None, :] * sgf + kk[:, None], mask=w_mask, other=0.0)
            uw = tl.load(up_ptr + e * sue + f[None, :] * suf + kk[:, None], mask=w_mask, other=0.0)
            gate += tl.dot(xt, gw, input_precision=PRECISION)
            up += tl.dot(xt, uw, input_precision=PRECISION)
        h = gate * tl.sigmoid(gate) * up  # silu(x W_gate^T) * (x W_up^T), (BLOCK_M, BLOCK_F), never stored
        dw = tl.load(down_ptr + e * sde + n[None, :] * sdd + f[:, None],
                     mask=(f < Fd)[:, None] & (n < D)[None, :], other=0.0)  # (BLOCK_F, BLOCK_N) W_down^T
        acc += tl.dot(h.to(dw.dtype), dw, input_precision=PRECISION)
    acc = acc * tl.load(w_ptr + pair, mask=real, other=0.0)[:, None]  # the routing weight
    tl.store(out_ptr + pair[:, None] * son + n[None, :], acc, mask=real[:, None] & (n < D)[None, :])


def moe_ffn_triton(x, weights, experts, gate_w, up_w, down_w, block_m: int = 16, block_n: int = 128,
                   block_f: int = 32, block_k: int = 32, precision: str = "ieee"):
    """The kernel; same arguments and result as `moe_ffn_reference`.

    Tiles (powers of 2 >= 16): block_m (token, slot) rows, block_n output columns, block_f hidden
    units and block_k input columns at a time. The defaults compile for sm_80 and sm_90 with 8
    warps and no register spills; a dMoE block routes few tokens per expert, so rows stay at 16.
    """
    check_inputs(x, weights, experts, gate_w, up_w, down_w)
    check_device(_moe_ffn_kernel, x)
    (N, D), (E, Fd, _), k = x.shape, gate_w.shape, experts.shape[1]
    if N * k == 0:
        return torch.zeros_like(x)
    x, gate_w, up_w, down_w = (t.contiguous() for t in (x, gate_w, up_w, down_w))  # no-ops when stacked once
    pairs, tile_expert = group_by_expert(experts, E, block_m)
    out = torch.empty(N * k, D, dtype=torch.float32, device=x.device)  # one row per (token, slot)
    block_n = min(block_n, max(16, triton.next_power_of_2(D)))
    block_k = min(block_k, max(16, triton.next_power_of_2(D)))
    block_f = min(block_f, max(16, triton.next_power_of_2(Fd)))
    grid = (len(tile_expert), triton.cdiv(D, block_n))
    _moe_ffn_kernel[grid](x, weights.float().contiguous(), pairs, tile_expert, gate_w, up_w, down_w, out,
                          D, Fd, k, x.stride(0), gate_w.stride(0), gate_w.stride(1), up_w.stride(0),
                          up_w.stride(1), down_w.stride(0), down_w.stride(1), out.stride(0),
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_F=block_f, BLOCK_K=block_k,
                          PRECISION=precision if x.dtype == torch.float32 else "tf32",  # 16-bit: the default
                          num_warps=8)
    return out.view(N, k, D).sum(1).to(x.dtype)  # (N, D): each token's k weighted expert outputs


def moe_ffn(x, weights, experts, gate_w, up_w, down_w):
    """Dispatch: the kernel where `use_triton(x)`, else the reference. Same arguments and result."""
    if use_triton(x):
        return moe_ffn_triton(x, weights, experts, gate_w, up_w, down_w)
    return moe_ffn_reference(x, weights, experts, gate_w, up_w, down_w)


def stack_experts(layer):
    """A MoEFeedForward's routed experts as (gate_w, up_w, down_w): (E, F, D), (E, F, D), (E, D, F).
    This copies every expert's weights: do it once per model (eval), not per forward."""
    return tuple(torch.stack([getattr(expert, name).weight for expert in layer.experts])
                 for name in ("gate", "up", "down"))


def stacked_experts(layer):
    """stack_experts(layer), kept in `layer.stacked` while the weights stay what they were stacked from.

    Stacking reads every expert, so doing it per forward would cost more than the loop it replaces.
    The copy is reused while each weight has the same storage (.to() or .half() makes new storage)
    and the same version (autograd's count of in-place writes: load_state_dict, nn.init, a plain
    optimizer step). A fused optimizer step writes without counting, so MoEFeedForward also drops
    the copy in every forward that records gradients: an optimizer step needs one first. While
    cached, the experts' weights are held twice."""
    weights = [getattr(expert, name).weight for name in ("gate", "up", "down") for expert in layer.experts]
    key = [(w.data_ptr(), w._version) for w in weights]
    if layer.stacked is None or layer.stacked[0] != key:
        layer.stacked = (key, stack_experts(layer))
    return layer.stacked[1]


# ---- MXFP4 expert weights, read packed and dequantized in registers

def check_packed(gate, up, down):
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
    check_packed(gate, up, down)
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
    check_packed(gate, up, down)
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
