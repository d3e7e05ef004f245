"""Spec: FP4 weights (tinydiff/fp4.py). MXFP4 is checked three ways: exhaustively where the space is small
(every E2M1 value at every normal scale, every byte, every E8M0 code), against a brute-force
oracle of OCP's rule (the scale by search over powers of two, each element by distance to all 16
grid values) on adversarial blocks, and against torchao, the library implementation people use,
bit for bit."""
import math
import random

import pytest
import torch

from tinydiff import fp4
from tinydiff.errors import UserError

GRID = fp4.E2M1 + tuple(-v for v in fp4.E2M1)  # the value of each code 0..15


# --- the format ---------------------------------------------------------------------------------

def test_every_e2m1_value_times_every_normal_scale_round_trips_exactly():
    exps = torch.arange(-126, 128)  # every power of two in float32's normal range
    codes = torch.arange(16).repeat(2)  # (32,) each code twice: one block holds all of them
    values = torch.tensor(GRID, dtype=torch.float64)[codes][None, :] * torch.exp2(exps.double())[:, None]  # (254, 32)
    finite = values.abs() <= torch.finfo(torch.float32).max  # 6 x 2^126 is past float32's largest
    w = torch.where(finite, values, 0.0).float()
    assert torch.equal(w.double(), torch.where(finite, values, 0.0))  # every product is a float32 exactly
    p = fp4.quantize(w)
    assert torch.equal(p.dequantize(), w)
    full = finite.all(1)  # the rows that hold 6 x 2^X: their scale is 2^X itself
    assert torch.equal(p.scales[full, 0].long() - 127, exps[full]) and int(full.sum()) == 252
    assert torch.equal(fp4.unpack(p.codes)[full], codes.expand(int(full.sum()), 32).to(torch.uint8))


def test_pack_and_unpack_are_inverse_bijections_over_all_256_bytes():
    every = torch.arange(256, dtype=torch.uint8)
    codes = fp4.unpack(every)  # (512,): (low, high) of each byte
    pairs = {(int(lo), int(hi)) for lo, hi in codes.view(256, 2)}
    assert len(pairs) == 256 and all(0 <= lo < 16 and 0 <= hi < 16 for lo, hi in pairs)
    assert torch.equal(fp4.pack(codes), every)
    assert codes.view(256, 2)[0x21].tolist() == [1, 2]  # element 2i in the low nibble (torch's float4_e2m1fn_x2)


def test_e8m0_codes_are_exact_powers_of_two_and_decoding_is_exact():
    s = torch.arange(255, dtype=torch.uint8)
    assert fp4.e8m0_value(s).double().tolist() == [2.0 ** (i - 127) for i in range(255)]  # 2^-127: subnormal
    assert fp4.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist() == list(GRID)


def random_blocks(n, size, seed):
    """n adversarial blocks of `size` float32 values: a random common exponent (subnormal to huge),
    values on the grid, on the midpoints between grid values, a ulp beside either, above 6 (to
    saturate), random, zero and -0; some blocks all zero, some in the subnormal range."""
    rng = random.Random(seed)
    specials = list(fp4.E2M1) + list(fp4.MIDPOINTS) + [6.5, 7.0, 7.999, 4.0001]
    blocks = []
    for _ in range(n):
        k = rng.choice([rng.randint(-149, 124), rng.randint(-160, -120), rng.randint(-4, 4)])
        block = []
        for _ in range(size):
            kind = rng.random()
            m = rng.choice(specials) if kind < 0.6 else rng.uniform(0, 8) if kind < 0.9 else 0.0
            v = math.ldexp(m, k) * rng.choice([1, -1])
            if rng.random() < 0.2:  # a float32 ulp beside it
                v = float(torch.nextafter(torch.tensor(v, dtype=torch.float32),
                                          torch.tensor(rng.choice([-1e39, 1e39]), dtype=torch.float32)))
            block.append(v)
        blocks.append([0.0] * size if rng.random() < 0.03 else block)
    w = torch.tensor(blocks, dtype=torch.float32)
    return torch.where(w.isfinite(), w, 0.0)


def oracle(block):
    """OCP MX's conversion of one block by brute force: the scale by search over the powers of two,
    each element the nearest of the grid values of its sign, a tie to the even code."""
    amax = max(abs(v) for v in block)
    x = -127
    if amax > 0:
        k = 127
        while 2.0 ** k > amax:  # the largest power of two <= amax (down into float32's subnormals)
            k -= 1
        x = max(k - 2, -127)
    codes = []
    for v in block:
        y = v / 2.0 ** x  # exact in float64
        sign = 8 if math.copysign(1, v) < 0 else 0
        codes.append(min(range(sign, sign + 8), key=lambda c: (abs(GRID[c] - y), c % 2)))
    return x + 127, codes


@pytest.mark.parametrize("size", [2, 4, 32])
def test_quantize_is_the_ocp_rule_by_brute_force(size):
    w = random_blocks(1200 if size < 32 else 150, size, seed=size)
    p = fp4.quantize(w, block_size=size)
    got_codes = fp4.unpack(p.codes)
    for i, block in enumerate(w.tolist()):
        scale, codes = oracle(block)
        assert (int(p.scales[i, 0]), got_codes[i].tolist()) == (scale, codes), block
    assert (p.scales == 0).any() and (p.scales > 200).any()  # the subnormal and huge ranges were reached
    dq = p.dequantize()
    assert torch.equal(dq, fp4.fake_quantize(w, "mxfp4", size))
    assert bool((dq.abs() <= 6 * fp4.e8m0_value(p.scales)).all())


def test_nvfp4_blocks_are_the_rounded_e4m3_scale_and_the_nearest_grid_values():
    w = torch.randn(3, 8, 64) * torch.exp(torch.randn(3, 1, 1) * 3)  # three matrices, three tensor scales
    w[1, 2, :16] = 0  # a zero block
    p = fp4.quantize(w, "nvfp4")
    s = w.abs().amax(dim=(1, 2)) / (448 * 6)
    assert torch.equal(p.tensor_scale, s) and p.block_size == 16 and p.scales.shape == (3, 8, 4)
    b = (fp4.per_block(w, 16).abs().amax(-1) / 6 / s[:, None, None]).clamp(2 ** -6, 448).to(torch.float8_e4m3fn)
    assert torch.equal(p.scales, b.view(torch.uint8))
    scaled = fp4.per_block(w, 16) * ((1 / s[:, None, None]) / b.float())[..., None]
    nearest = torch.tensor(GRID)[(scaled[..., None] - torch.tensor(GRID)).abs().argmin(-1)]  # ties aside
    got = fp4.e2m1_decode(fp4.unpack(p.codes)).view_as(scaled)
    untied = ((scaled.abs()[..., None] - torch.tensor(fp4.MIDPOINTS)).abs() > 1e-6).all(-1)
    assert torch.equal(got[untied].abs(), nearest[untied].abs())
    # the error: at most half the widest grid step (4 -> 6: 2 x the block's scale), or what saturation clips
    # when b was rounded down (amax / (b s) <= 6 x (1 + 1/16)): under one block scale, block by block
    assert bool(((fp4.per_block(p.dequantize() - w, 16)).abs() <= p.block_scales()[..., None]).all())
    with pytest.raises(UserError, match="2 or more dimensions"):
        fp4.quantize(torch.ones(16), "nvfp4")


@pytest.mark.parametrize("fmt, block, message", [
    ("int4", 32, "unknown FP4 format 'int4'"), ("mxfp4", 3, "even number"), ("mxfp4", 64, "does not divide"),
])
def test_bad_formats_and_block_sizes_fail_with_a_message(fmt, block, message):
    with pytest.raises(UserError, match=message):
        fp4.quantize(torch.ones(4, 96), fmt, block)


def test_nan_and_inf_cannot_be_quantized():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(UserError, match="NaN or inf"):
            fp4.quantize(torch.tensor([[1.0, bad] * 16]))


# --- torchao, bit for bit -----------------------------------------------------------------------

def torchao_mx(w):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    scales, codes = to_mx(w, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)  # FLOOR: OCP's rule
    return scales.view(torch.uint8), codes.view(torch.uint8)


@pytest.mark.parametrize("case", ["random", "bfloat16", "adversarial"])
def test_mxfp4_equals_torchaos_mx_quantization_bit_for_bit(case):
    g = torch.Generator().manual_seed(0)
    if case == "adversarial":
        w = random_blocks(512, 32, seed=7).view(64, 256)
    else:
        w = torch.randn(64, 256, generator=g) * torch.exp(4 * torch.randn(64, 1, generator=g))
        w = w.bfloat16() if case == "bfloat16" else w
    ours = fp4.quantize(w)
    scales, codes = torchao_mx(w)
    assert torch.equal(ours.scales, scales)
    # One difference, by design on torchao's side: for a block whose scale is 2^-127 (E8M0 code 0,
    # amax < 2^-125) it divides by 2^-126, float32's smallest normal ("it would be more correct to
    # set the minimum to 2**-127", its source says). Elsewhere the bytes agree exactly.
    tiny = (scales == 0).repeat_interleave(16, -1)  # (64, 128): the bytes of such blocks
    assert torch.equal(ours.codes[~tiny], codes[~tiny])
    theirs = fp4.pack(fp4.e2m1_encode(fp4.per_block(w.float(), 32) / 2.0 ** -126).flatten(-2))
    assert torch.equal(theirs[tiny], codes[tiny])
    assert bool(tiny.any()) == (case == "adversarial")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    if case != "adversarial":  # torchao's dequantized values are ours too
        back = MXTensor.to_mx(w, torch.float4_e2m1fn_x2, 32).dequantize(torch.float32)
        assert torch.equal(back, ours.dequantize())


def test_nvfp4_equals_torchaos_nvfp4_quantization_bit_for_bit():
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    g = torch.Generator().manual_seed(1)
    for w in (torch.randn(64, 256, generator=g) * torch.exp(3 * torch.randn(64, 1, generator=g)),
              random_blocks(512, 32, seed=8).view(64, 256).clamp(-1e30, 1e30)):
        ours = fp4.quantize(w, "nvfp4")
        scales, codes = nvfp4_quantize(w, 16, per_tensor_amax_to_scale(w.abs().amax()))
        assert torch.equal(ours.scales, scales.view(torch.uint8)) and torch.equal(ours.codes, codes.view(torch.uint8))
