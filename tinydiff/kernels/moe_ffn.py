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

Leaves out: the shared expert (a dense SwiGLU beside this), capacity limits, expert parallelism,
fusing the final sum into the kernel (atomics), quantised weights, autotuned tile sizes.
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
