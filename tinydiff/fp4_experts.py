"""FP4 experts: a MoE feed-forward whose experts' weights are stored packed (tinydiff/fp4.py).

MiMo-V2.5-Pro serves its MoE with MXFP4 weights on the experts only: they are nearly all of the
parameters and, with top-k routing, the bytes each token reads; attention, the router, the norms and
the embedding stay in higher precision. `quantize_experts(model)` does that to a trained
`dmoe.MoETransformer` after training (post-training quantization): every MoE layer becomes a
`QuantizedMoEFeedForward`, whose routed experts and shared expert hold, for gate, up and down,
  codes   (E, out, in/2) uint8   two E2M1 values per byte
  scales  (E, out, in/block) uint8   one E8M0 exponent (MXFP4) or E4M3 scale (NVFP4) per block
  tensor_scale (E,) int32        NVFP4 only: one float32 per expert matrix, kept as its bits so that
                                 model.half() (which casts every float buffer) leaves it exact
with blocks along each matrix's input (gate, up: d_model; down: expert_d_ff) and the shared expert
a stack of one. Everything else of the layer (router, routing, stats) is MoEFeedForward's.

Forward: the dispatch loop of MoEFeedForward with each chosen expert's weights dequantized, in
the input's dtype, just before use (an expert no token chose is never read), then the very calls
the float FeedForward makes, so the outputs equal exactly those of a float model that holds the
dequantized weights. Where kernels.for_inference (a GPU, no gradients; or Triton's interpreter)
and the format is MXFP4, tinydiff/kernels/moe_ffn_fp4.py instead runs all routed experts in one
launch that reads the packed bytes and dequantizes in registers (the shared expert: the same
kernel, one expert, every token).

The config records the format (MoEConfig.expert_format, expert_block), so a checkpoint of a
quantized model loads as any other: MoETransformer builds this layer for such a config (with zero
weights, for load_state_dict to fill), and every entry point that takes an mdlm-moe or ar-moe
`--ckpt` takes it. Loading checks the packed tensors' dtypes and that no scale is NaN or negative.

Leaves out: quantization-aware training, activations in FP4 (weights only: the matmuls run in
the input's dtype), calibration (the OCP rule needs none), and a backward pass: the packed weights
are buffers, not parameters.
"""
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff import fp4, kernels
from tinydiff.dmoe import MoEConfig, MoEFeedForward, MoETransformer, dispatch, moe_layers
from tinydiff.errors import UserError

PROJECTIONS = ("gate", "up", "down")


class PackedWeights(nn.Module):
    """n matrices (n, out, in) in FP4, as buffers: saved in the state dict, moved by .to()."""

    def __init__(self, n: int, out_features: int, in_features: int, fmt: str, block_size: int):
        super().__init__()
        self.format, self.block_size = fmt, block_size
        self.register_buffer("codes", torch.zeros(n, out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(n, out_features, in_features // block_size, dtype=torch.uint8))
        self.register_buffer("tensor_scale", torch.ones(n).view(torch.int32) if fmt == "nvfp4" else None)

    @torch.no_grad()
    def store(self, w: torch.Tensor):
        """Quantize float matrices w (n, out, in) into this module's buffers."""
        p = fp4.quantize(w, self.format, self.block_size)
        self.codes.copy_(p.codes)
        self.scales.copy_(p.scales)
        if self.tensor_scale is not None:
            self.tensor_scale.copy_(p.tensor_scale.view(torch.int32))

    def packed(self, e=None) -> fp4.Packed:
        """All n matrices as one fp4.Packed (e None), or matrix e alone."""
        pick = (lambda t: t) if e is None else (lambda t: t[e])
        scale = None if self.tensor_scale is None else pick(self.tensor_scale.view(torch.float32))
        return fp4.Packed(self.format, pick(self.codes), pick(self.scales), self.block_size, scale)

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
        if scales is not None and self.format == "mxfp4" and bool((scales == fp4.E8M0_NAN).any()):
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
        self.n, self.format = n, fmt
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
            from tinydiff.kernels.moe_ffn_fp4 import moe_ffn_fp4  # lazily: see kernels/__init__.py
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
    feed_forward = QuantizedMoEFeedForward


def moe_model(config: MoEConfig) -> MoETransformer:
    """The mixture-of-experts model a config describes: packed experts or float ones."""
    return (MoETransformer if config.expert_format == "float" else QuantizedMoETransformer)(config)


def check_finite(layers):
    """Before any work: every expert weight is a number (fp4.quantize would refuse it mid-way)."""
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if name.startswith(("experts.", "shared.")) and not bool(torch.isfinite(p).all()):
                raise UserError(f"MoE layer {i}: {name} holds NaN or inf, which FP4 cannot store; use an "
                                "earlier checkpoint, or train again with a lower --lr")


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
    block_size = fp4.STANDARD_BLOCK.get(fmt, 0) if block_size is None else block_size
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
