"""FP4 weights in plain PyTorch: MXFP4 (OCP Microscaling Formats v1.0) and NVIDIA's NVFP4.

A 4-bit float cannot hold a weight on its own: E2M1 (1 sign, 2 exponent and 1 mantissa bit) has
the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} and nothing else. So consecutive values along a weight
row's input (reduction) dimension share one scale per block, and each element is the nearest grid
value of v / scale.

MXFP4 (OCP MX v1.0, section 6.3, its "minimally supported" conversion): blocks of 32, the scale a
power of two 2^X stored as E8M0 (an 8-bit exponent, bias 127, no sign or mantissa; 255 = NaN).
  X = floor(log2(amax)) - 2            (2 = the exponent of E2M1's largest power of two, 4)
  element = round-to-nearest-even(v / 2^X) on the E2M1 grid, saturating at +-6
clamped to E8M0's range [-127, 127]; an all-zero block gets the smallest scale, 2^-127. The
largest value of a block lands in [4, 8) before rounding, so it rounds to 4 or 6, or saturates
to 6 (amax = 7.9 x 2^X is stored as 6 x 2^X: the floor rule trades that clipping for a scale
that needs no rounding). 4 + 8/32 = 4.25 bits per weight. torchao's MX code (ScaleCalculationMode.FLOOR)
computes the same bytes, except in blocks whose scale is 2^-127 (amax < 2^-125): it divides those
by 2^-126, float32's smallest normal, where the rule says 2^-127 (tests/test_fp4.py pins this).

NVFP4 (NVIDIA's two-level scheme, as TensorRT-ModelOpt and torchao compute it): blocks of 16,
one FP32 scale s per matrix, s = amax(matrix) / (6 * 448), and per block an E4M3 scale
b = amax(block) / 6 / s rounded to E4M3 (clamped to [2^-6, 448], torchao's range), and
element = RNE(v / (b s)) on the E2M1 grid.
A zero matrix (or one under float32's normal range) gets s = 1. 4 + 8/16 = 4.5 bits per weight, plus s.

Storage: two E2M1 codes per byte, element 2i in the low nibble and 2i + 1 in the high one
(torchao's order, whose bytes it labels torch.float4_e2m1fn_x2; torch can store that dtype but not
yet convert it on a CPU, so plain uint8 it is here, and `.view(torch.float4_e2m1fn_x2)` relabels it).
A code is sign << 3 | magnitude index, so a negative value that rounds to zero keeps its sign
(0b1000, -0), as a hardware cast does. Scales are uint8: E8M0 exponents, or E4M3 bit patterns.

Leaves out: the other MX element types (FP8, FP6, INT8), scales rounded instead of floored
(torchao's CEIL / EVEN / RCEIL modes, outside OCP v1.0's rule), stochastic rounding, padding of
rows that do not fill a block, and scale swizzling for tensor-core layouts. `quantize` refuses NaN
and inf; the other functions expect finite input.

FP4 experts (MiMo-V2.5-Pro serves its MoE with MXFP4 weights on the experts only: they are nearly all
the parameters and, with top-k routing, the bytes each token reads). `quantize_experts(model)` packs a
trained dmoe.MoETransformer's experts (post-training quantization): every MoE layer becomes a
`QuantizedMoEFeedForward`, whose routed and shared experts hold, for gate, up and down, codes
(E, out, in/2) uint8, scales (E, out, in/block) uint8 and, for NVFP4, a tensor_scale (E,) kept as int32
bits so that model.half() leaves it exact; blocks run along each matrix's input. Attention, the router,
the norms and the embedding stay in float. Forward: MoEFeedForward's dispatch with each chosen expert
dequantized just before use, then the float FeedForward's very calls, so the outputs equal those of a
float model holding the dequantized weights; where kernels.for_inference and the format is MXFP4,
kernels/moe_ffn.py's moe_ffn_fp4 runs all routed experts in one launch that reads the packed bytes. The config
records the format (MoEConfig.expert_format, expert_block), so a packed checkpoint loads as any other.
Leaves out: activations in FP4 (weights only), calibration (the OCP rule needs none), a backward pass
(the packed weights are buffers); quantization-aware training is tinydiff/extras/qat.py.
"""
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff import kernels
from tinydiff.checks import UserError
from tinydiff.dmoe import MoEConfig, MoEFeedForward, MoETransformer, dispatch, moe_layers

FORMATS = ("mxfp4", "nvfp4")
STANDARD_BLOCK = {"mxfp4": 32, "nvfp4": 16}  # the block size each format's spec fixes
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0..7; code | 8 is the negative
E2M1_MAX = 6.0  # the largest magnitude
E2M1_EMAX = 2  # the exponent of the largest power of two in it, 4
E8M0_BIAS = 127
E8M0_NAN = 255
E4M3_MAX = 448.0  # NVFP4's block scales: the largest E4M3 ...
E4M3_MIN = 2.0 ** -6  # ... and its smallest normal
# The midpoint between magnitudes i and i + 1. A value exactly on it goes to the even code: up when
# i is odd (0.75 -> 1.0, code 2), down when i is even (0.25 -> 0, 1.25 -> 1.0, 5 -> 4).
MIDPOINTS = tuple((lo + hi) / 2 for lo, hi in zip(E2M1, E2M1[1:]))


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15, same shape) of float y: round to nearest, ties to even, saturating at +-6."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for i, m in enumerate(MIDPOINTS):  # the magnitude index is the number of midpoints below a
        code += (a >= m if i % 2 else a > m).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The values of E2M1 codes (uint8 0..15)."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=dtype, device=codes.device)  # (16,)
    return table[codes.long()]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) codes 0..15 -> (..., K/2) bytes: element 2i in the low nibble, 2i + 1 in the high one."""
    if codes.shape[-1] % 2:
        raise UserError(f"packing needs an even number of values per row, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) bytes -> (..., K) codes 0..15; the inverse of pack."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # (..., K/2, 2) -> (..., K)


def mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """OCP's shared exponent X (int32) of blocks with largest magnitude amax: floor(log2(amax)) - 2,
    clamped to E8M0's [-127, 127]; 0 -> -127, the smallest scale."""
    _, e = torch.frexp(amax.float())  # amax = m * 2^e with m in [0.5, 1), exact for subnormals too
    x = (e - 1 - E2M1_EMAX).masked_fill(amax == 0, -E8M0_BIAS)
    return x.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def e8m0_value(scales: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) in float32 for E8M0 codes s (uint8 0..254), built from its bits, so exactly:
    s in 1..254 is a normal float32 (the biased exponents line up); s = 0 is the subnormal 2^-127."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 1 << 22), s << 23)
    return bits.view(torch.float32)


def per_block(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(..., K) -> (..., K/block_size, block_size): the blocks that share a scale."""
    return x.unflatten(-1, (x.shape[-1] // block_size, block_size))


@dataclass
class Packed:
    """A weight in FP4: what is stored, and enough to turn it back into numbers."""
    format: str                  # "mxfp4" or "nvfp4"
    codes: torch.Tensor          # (..., K/2) uint8: two E2M1 codes per byte
    scales: torch.Tensor         # (..., K/block_size) uint8: E8M0 exponents (mxfp4) or E4M3 bits (nvfp4)
    block_size: int              # consecutive values along K that share a scale
    tensor_scale: torch.Tensor | None = None  # nvfp4: float32, one per matrix (shape: codes' dims but the last two)

    @property
    def shape(self) -> tuple:
        return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

    @property
    def nbytes(self) -> int:
        extra = 0 if self.tensor_scale is None else self.tensor_scale.numel() * 4
        return self.codes.numel() + self.scales.numel() + extra

    def block_scales(self) -> torch.Tensor:
        """(..., K/block_size) float32: each block's scale as a number."""
        if self.format == "mxfp4":
            return e8m0_value(self.scales)
        b = self.scales.view(torch.float8_e4m3fn).float()
        return b * self.tensor_scale[..., None, None].float()

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The values (..., K): code x its block's scale, exact in float32 for MXFP4 (a power of two)."""
        values = per_block(e2m1_decode(unpack(self.codes)), self.block_size)  # (..., K/b, b)
        if self.format == "mxfp4":
            out = values * e8m0_value(self.scales)[..., None]
        else:  # (code x b) is exact in float32; x s rounds once
            b = self.scales.view(torch.float8_e4m3fn).float()
            out = values * b[..., None] * self.tensor_scale[..., None, None, None].float()
        return out.flatten(-2).to(dtype)


def quantize(w: torch.Tensor, fmt: str = "mxfp4", block_size: int | None = None) -> Packed:
    """w (..., K), blocks along the last dimension (nn.Linear's input) -> Packed. NVFP4's tensor scale
    is one per matrix (the last two dimensions), so stacked experts (E, F, D) get one each."""
    block_size = STANDARD_BLOCK.get(fmt, 0) if block_size is None else block_size
    check_format(fmt, block_size, {"K": w.shape[-1]})
    if not bool(torch.isfinite(w).all()):
        raise UserError("cannot quantize NaN or inf; the weights are damaged (a diverged training run?)")
    return (_quantize_mx if fmt == "mxfp4" else _quantize_nv)(w.float(), block_size)


def _quantize_mx(w: torch.Tensor, block_size: int) -> Packed:
    blocks = per_block(w, block_size)  # (..., K/b, b)
    x = mx_exponent(blocks.abs().amax(-1))  # (..., K/b)
    scales = (x + E8M0_BIAS).to(torch.uint8)
    # v / 2^X is exact in float32: a power of two, and |v| / 2^X < 8, so it neither overflows nor
    # loses a bit that could change the rounding (a result small enough to lose bits rounds to 0)
    codes = e2m1_encode(blocks / e8m0_value(scales)[..., None]).flatten(-2)
    return Packed("mxfp4", pack(codes), scales, block_size)


def _quantize_nv(w: torch.Tensor, block_size: int) -> Packed:
    if w.dim() < 2:
        raise UserError(f"NVFP4 scales whole matrices: pass a weight of 2 or more dimensions, got {tuple(w.shape)}")
    s = w.abs().amax(dim=(-2, -1)) / (E4M3_MAX * E2M1_MAX)  # (...,) one per matrix
    # a zero or vanishing matrix (1 / s would overflow): s = 1, at which every element rounds to 0
    s = torch.where(s >= torch.finfo(torch.float32).tiny, s, torch.ones_like(s))
    blocks = per_block(w, block_size)  # (..., R, K/b, b)
    sb = s[..., None, None]
    b = (blocks.abs().amax(-1) / E2M1_MAX / sb).clamp(E4M3_MIN, E4M3_MAX).to(torch.float8_e4m3fn)  # RNE cast
    # v x ((1 / s) / b), the order torchao and NVIDIA's kernels use, so the codes agree bit for bit
    codes = e2m1_encode(blocks * ((1.0 / sb) / b.float())[..., None]).flatten(-2)
    return Packed("nvfp4", pack(codes), b.view(torch.uint8), block_size, s.float())


def fake_quantize(w: torch.Tensor, fmt: str = "mxfp4", block_size: int | None = None) -> torch.Tensor:
    """dequantize(quantize(w)) in w's dtype: the values a quantized weight stands for."""
    return quantize(w, fmt, block_size).dequantize(w.dtype)


def bits_per_weight(fmt: str, block_size: int | None = None) -> float:
    """4 bits per element plus one 8-bit scale per block (NVFP4's per-matrix scale left out)."""
    return 4 + 8 / (STANDARD_BLOCK[fmt] if block_size is None else block_size)


PROJECTIONS = ("gate", "up", "down")


class PackedWeights(nn.Module):
    """n matrices (n, out, in) in FP4, as buffers: saved in the state dict, moved by .to()."""

    def __init__(self, n: int, out_features: int, in_features: int, fmt: str, block_size: int):
        super().__init__()
        self.format = fmt
        self.block_size = block_size
        self.register_buffer("codes", torch.zeros(n, out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(n, out_features, in_features // block_size, dtype=torch.uint8))
        self.register_buffer("tensor_scale", torch.ones(n).view(torch.int32) if fmt == "nvfp4" else None)

    @torch.no_grad()
    def store(self, w: torch.Tensor):
        """Quantize float matrices w (n, out, in) into this module's buffers."""
        p = quantize(w, self.format, self.block_size)
        self.codes.copy_(p.codes)
        self.scales.copy_(p.scales)
        if self.tensor_scale is not None:
            self.tensor_scale.copy_(p.tensor_scale.view(torch.int32))

    def packed(self, e=None) -> Packed:
        """All n matrices as one Packed (e None), or matrix e alone."""
        pick = (lambda t: t) if e is None else (lambda t: t[e])
        scale = None if self.tensor_scale is None else pick(self.tensor_scale.view(torch.float32))
        return Packed(self.format, pick(self.codes), pick(self.scales), self.block_size, scale)

    def weight(self, e: int, dtype) -> torch.Tensor:
        """Matrix e dequantized, (out, in)."""
        return self.packed(e).dequantize(dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # load_state_dict would cast a float tensor into the uint8 buffers without a word: check first
        for name, dtype in (("codes", torch.uint8), ("scales", torch.uint8), ("tensor_scale", torch.int32)):
            t = state_dict.get(prefix + name)
            if t is not None and t.dtype != dtype:
                errors.append(f"{prefix}{name} is {t.dtype}, packed FP4 weights need {dtype}")
                return
        scales = state_dict.get(prefix + "scales")
        if scales is not None and self.format == "mxfp4" and bool((scales == E8M0_NAN).any()):
            errors.append(f"{prefix}scales holds E8M0 code 255 (NaN)")
        elif scales is not None and self.format == "nvfp4" and not bool(
                (scales.view(torch.float8_e4m3fn).float() >= 0).all()):
            errors.append(f"{prefix}scales holds negative or NaN E4M3 scales")
        ts = state_dict.get(prefix + "tensor_scale")
        if ts is not None and not bool(((ts.view(torch.float32) > 0) & ts.view(torch.float32).isfinite()).all()):
            errors.append(f"{prefix}tensor_scale holds a scale that is not a positive number")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)


class QuantizedSwiGLU(nn.Module):
    """n SwiGLU experts in FP4: gate, up (n, F, D) and down (n, D, F), each blocked along its input."""

    def __init__(self, n: int, d_model: int, d_ff: int, fmt: str, block_size: int):
        super().__init__()
        self.n = n
        self.format = fmt
        self.gate = PackedWeights(n, d_ff, d_model, fmt, block_size)
        self.up = PackedWeights(n, d_ff, d_model, fmt, block_size)
        self.down = PackedWeights(n, d_model, d_ff, fmt, block_size)

    def store(self, experts):
        """Pack the weights of float experts (a list of n model.FeedForward)."""
        for name in PROJECTIONS:
            getattr(self, name).store(torch.stack([getattr(x, name).weight.detach() for x in experts]))

    def packed(self) -> tuple:
        return tuple(getattr(self, name).packed() for name in PROJECTIONS)

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Rows h (n_e, D) through expert e: FeedForward.forward's calls, on its dequantized weights."""
        gate, up, down = (getattr(self, name).weight(e, h.dtype) for name in PROJECTIONS)
        return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)

    def forward(self, x, weights=None, experts=None):
        """Tokens x (N, D) through their experts (ids and mixing weights (N, k)); without them every
        token through expert 0 at weight 1 (the shared expert is a stack of one). Returns (N, D)."""
        if kernels.for_inference(x) and self.format == "mxfp4":  # one launch, weights read packed
            from tinydiff.kernels.moe_ffn import moe_ffn_fp4  # lazily: see kernels/__init__.py
            if experts is None:
                weights = torch.ones(len(x), 1, device=x.device)
                experts = torch.zeros(len(x), 1, dtype=torch.long, device=x.device)
            return moe_ffn_fp4(x, weights, experts, *self.packed())
        if experts is None:
            return self.expert(0, x)
        return dispatch(x, weights, experts, self.n, self.expert)  # an expert no token chose is never read

    def expert_bytes(self) -> int:
        """Bytes of one expert's packed weights: codes, scales (and NVFP4's per-matrix scale)."""
        return sum(getattr(self, name).packed(0).nbytes for name in PROJECTIONS)


class QuantizedMoEFeedForward(MoEFeedForward):
    """MoEFeedForward with its routed experts and shared expert packed in FP4 (zeros until loaded
    or stored); the router, routing and stats are the float layer's."""

    def __init__(self, config: MoEConfig):
        if config.expert_format == "float":
            raise UserError("QuantizedMoEFeedForward needs a config with an FP4 expert_format (see quantize_experts)")
        super().__init__(config)
        dims = (config.d_model, config.expert_d_ff, config.expert_format, config.expert_block)
        self.experts = QuantizedSwiGLU(config.n_experts, *dims)  # replaces the float experts
        self.shared = QuantizedSwiGLU(1, *dims) if config.shared_expert else None

    def routed(self, flat, mix, chosen):
        return self.experts(flat, mix, chosen)

    def expert_bytes(self) -> int:
        return self.experts.expert_bytes()


class QuantizedMoETransformer(MoETransformer):
    """MoETransformer whose MoE layers hold their experts packed (config.expert_format mxfp4 / nvfp4)."""

    def __init__(self, config: MoEConfig):
        widths = {"d_model": config.d_model, "expert_d_ff": config.expert_d_ff}  # gate and up's inputs, down's
        check_format(config.expert_format, config.expert_block, widths)
        super().__init__(replace(config, expert_format="float"))  # attention, routers, norms: the float model's
        self.config = config
        for block in self.blocks:
            packed = QuantizedMoEFeedForward(config)  # zeros until stored or loaded
            packed.router = block.ffn.router  # initialised as the float model's
            block.ffn = packed


def moe_model(config: MoEConfig) -> MoETransformer:
    """The mixture-of-experts model a config describes: packed experts or float ones."""
    return (MoETransformer if config.expert_format == "float" else QuantizedMoETransformer)(config)


def quantize_experts(model: MoETransformer, fmt: str = "mxfp4", block_size: int | None = None) -> MoETransformer:
    """A new model: `model`'s weights, with every MoE layer's experts (routed and shared) packed in
    `fmt` (block_size: values per scale; default the format's standard, 32 for MXFP4)."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers or not isinstance(model.config, MoEConfig):
        raise UserError("this model has no mixture-of-experts layers, so no experts to quantize; pass an "
                        "mdlm-moe or ar-moe model (train.py --model mdlm-moe or ar-moe)")
    if model.config.expert_format != "float":
        raise UserError(f"this model's experts are already {model.config.expert_format}; quantize the "
                        "full-precision checkpoint it came from")
    block_size = STANDARD_BLOCK.get(fmt, 0) if block_size is None else block_size
    config = replace(model.config, expert_format=fmt, expert_block=block_size)  # checks format and block size
    check_finite(layers)
    weight = model.embed.weight
    quantized = QuantizedMoETransformer(config).to(weight.device, weight.dtype)
    quantized.load_state_dict(model.state_dict(), strict=False)  # everything but the experts, as it is
    for q, f in zip(moe_layers(quantized), layers):
        q.experts.store(list(f.experts))
        if f.shared is not None:
            q.shared.store([f.shared])
    return quantized.train(model.training)


def dequantized_copy(model: MoETransformer) -> MoETransformer:
    """The float MoETransformer holding the dequantized expert weights of a quantized `model` (what
    the quantized model stands for: the tests compare the two)."""
    config = replace(model.config, expert_format="float")
    weight = model.embed.weight
    plain = MoETransformer(config).to(weight.device, weight.dtype)
    plain.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for f, q in zip(moe_layers(plain), moe_layers(model)):
            for stack, experts in ((q.experts, f.experts), (q.shared, [f.shared] if f.shared else [])):
                for e, expert in enumerate(experts):
                    for name in PROJECTIONS:
                        getattr(expert, name).weight.copy_(getattr(stack, name).weight(e, weight.dtype))
    return plain.train(model.training)


def check_format(fmt: str, block_size: int, widths: dict):
    """Before any work: a known format, and a block size that divides every input width (name -> size)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown FP4 format {fmt!r}; choose one of {', '.join(FORMATS)}")
    is_int = isinstance(block_size, int) and not isinstance(block_size, bool)
    if not is_int or not 2 <= block_size <= 4096 or block_size % 2:
        raise UserError(f"the FP4 block size must be an even number from 2 to 4096 (the {fmt} standard: "
                        f"{STANDARD_BLOCK[fmt]}), got {block_size!r}")
    for name, width in widths.items():
        if width % block_size:
            raise UserError(f"the {fmt} block size {block_size} does not divide the input width {name} = {width} "
                            f"(blocks run along it); pick a block size that divides it")


def check_finite(layers):
    """Before any work: every expert weight is a number (quantize would refuse it mid-way)."""
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if name.startswith(("experts.", "shared.")) and not bool(torch.isfinite(p).all()):
                raise UserError(f"MoE layer {i}: {name} holds NaN or inf, which FP4 cannot store; use an "
                                "earlier checkpoint, or train again with a lower --lr")
