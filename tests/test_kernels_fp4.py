"""The MXFP4 expert kernel (tinydiff/kernels/moe_ffn.py's moe_ffn_fp4) computes what its reference computes,
and the FP4 experts' model path (tinydiff/fp4.py) reaches it where kernels.for_inference.

As in tests/test_kernels.py: on CPU under Triton's interpreter, compiled on a GPU
(scripts/gpu_check.sh), awkward sizes and small tiles so every loop crosses partial tiles, and the
reference in float64 on the same packed weights, so the kernel is held to its own dtype's accuracy.
"""
import pytest
import torch
from kernel_mode import DEVICE, triton_mode  # noqa: F401 (first: sets TRITON_INTERPRET; autouse fixture)

from tinydiff import fp4, kernels
from tinydiff.dmoe import MoEConfig, MoETransformer, moe_layers
from tinydiff.fp4 import quantize_experts
from tinydiff.kernels import moe_ffn as fk

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}  # absolute, on outputs of size ~1


def fp4_inputs(N, D, Fd, E, k, used, dtype, block_size, seed):
    """Random tokens routed to the experts in `used` only, and packed expert weights whose rows span
    very different magnitudes (so the scales matter), with one all-zero block (the scale 2^-127)."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor(used)
    experts = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(N)])  # (N, k) distinct
    weights = torch.rand(N, k, generator=g)
    x = torch.randn(N, D, generator=g).to(DEVICE, dtype)

    def packed(*shape):
        w = torch.randn(*shape, generator=g) * shape[-1] ** -0.5 * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
        w[0, 1, :block_size] = 0
        p = fp4.quantize(w, "mxfp4", block_size)
        return fp4.Packed("mxfp4", p.codes.to(DEVICE), p.scales.to(DEVICE), block_size)

    return x, weights.to(DEVICE), experts.to(DEVICE), packed(E, Fd, D), packed(E, Fd, D), packed(E, D, Fd)


def check(inputs, **tiles):
    x, weights, experts, gate, up, down = inputs
    out = fk.moe_ffn_fp4_triton(*inputs, **tiles)
    want = fk.moe_ffn_fp4_reference(x.double(), weights.double(), experts, gate, up, down)
    assert out.dtype == x.dtype and out.shape == x.shape and torch.isfinite(out).all()
    assert (gate.scales == 0).any()  # the subnormal scale was on the way
    torch.testing.assert_close(out.double(), want, atol=TOL[x.dtype], rtol=TOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_fp4_kernel_matches_dequantize_then_reference_with_empty_experts(dtype, block_size):
    # D = 96: 48 bytes a row, three chunks of 16; F = 64: two chunks of 16 even and 16 odd units
    check(fp4_inputs(N=13, D=96, Fd=64, E=5, k=2, used=[0, 2, 4], dtype=dtype, block_size=block_size, seed=0),
          block_m=16, block_n=32, block_fh=16, block_kh=16)


def test_fp4_kernel_with_a_block_wider_than_a_chunk_and_an_expert_over_several_tiles():
    inputs = fp4_inputs(N=37, D=64, Fd=128, E=3, k=1, used=[1], dtype=torch.float32, block_size=64, seed=1)
    check(inputs, block_m=16, block_kh=16)  # 37 rows: 3 tiles of one expert; a 64-value block spans two 16-byte chunks
    x, w, e, *packed = inputs
    assert torch.equal(fk.moe_ffn_fp4_triton(x[:0], w[:0], e[:0], *packed), x[:0])


def test_the_kernel_refuses_what_it_cannot_read():
    x, w, e, gate, up, down = fp4_inputs(N=4, D=32, Fd=32, E=2, k=1, used=[0], dtype=torch.float32,
                                         block_size=32, seed=2)
    nv = fp4.quantize(torch.randn(2, 32, 32), "nvfp4")
    with pytest.raises(ValueError, match="mxfp4-packed"):
        fk.moe_ffn_fp4_triton(x, w, e, nv, up, down)


@pytest.fixture
def launches(monkeypatch):
    counts = {"fp4": 0}
    kernel = fk.moe_ffn_fp4_triton

    def counted(*args, **kw):
        counts["fp4"] += 1
        return kernel(*args, **kw)
    monkeypatch.setattr(fk, "moe_ffn_fp4_triton", counted)  # the dispatcher looks the name up at each call
    return counts


def tiny_quantized(fmt, routing):
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig(context=32, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False, n_experts=6,
                                     moe_top_k=2, expert_d_ff=32, routing=routing, route_block=4, route_guard=2))
    return quantize_experts(model, fmt).to(DEVICE).eval()


@pytest.mark.parametrize("routing", ["token", "block"])
@torch.no_grad()
def test_the_fp4_model_path_runs_the_kernel_and_equals_the_reference(routing, launches):
    model = tiny_quantized("mxfp4", routing)
    ids = torch.randint(0, 50257, (2, 13), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with kernels.kernels_enabled(True):
        out = model(ids)
    assert launches["fp4"] == 2 * 2  # per layer: the routed experts, then the shared one
    with kernels.kernels_enabled(False):
        want = model(ids)
    assert launches["fp4"] == 4 and (out - want).abs().max() <= 1e-5 * want.abs().max()
    with torch.enable_grad():
        model(ids)  # a forward that records gradients keeps the PyTorch path
    assert launches["fp4"] == 4


@torch.no_grad()
def test_nvfp4_experts_take_the_dequantizing_path(launches):
    model = tiny_quantized("nvfp4", "token")
    model(torch.zeros(1, 8, dtype=torch.long, device=DEVICE))
    assert launches["fp4"] == 0 and moe_layers(model)[0].experts.format == "nvfp4"
