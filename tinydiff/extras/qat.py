"""Quantization-aware training of the MoE experts: MiMo's recovery step for FP4 experts, at our scale.

Post-training quantization (tinydiff/fp4.py) rounds each expert weight to the FP4 grid
once, and the model never sees the error. QAT fine-tunes with the error in the loop: every expert
(routed and shared) computes with fake-quantized weights, dequantize(quantize(w)) in MXFP4 or
NVFP4 (tinydiff/fp4.py), while the optimizer keeps updating the full-precision w underneath. The
rounding has no useful gradient, so the backward pass treats it as the identity (the
straight-through estimator): d fq(w) / dw := I. Attention, router, norms and embeddings train
as they are, unquantized, as MiMo keeps them. The checkpoint holds the float w, whose packed
form (`python -m tinydiff.tools.quantize`) is exactly what the forward computed with.
`train.py --init CKPT --qat mxfp4` (an `mdlm-moe` or `ar-moe` checkpoint); the run records the format and a
resumed run fake-quantizes again.
With `--target CKPT` (ar-moe; usually the --init checkpoint itself) the labels are the frozen
full-precision model's distribution on the same windows instead of the corpus's next tokens:
self-distillation, as LLM-QAT (Liu et al. 2023) recovers a quantized model. A drafter trained on
the full-precision target predicts that target's choices; QAT on corpus tokens recovers the loss
but lets the FP4 model choose differently where the float one was nearly tied, and each such
choice rejects a draft.
Leaves out: learned scales (LSQ), quantizing the activations, QAT for dense models, distillation
targets for the diffusion MoE.
"""
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff import fp4
from tinydiff.checks import UserError
from tinydiff.dmoe import MoEFeedForward, dispatch, moe_layers
from tinydiff.extras.ar_moe import ar_moe_loss
from tinydiff.extras.soft_labels import soft_ar_loss


def straight_through(w, fmt: str, block_size: int | None = None):
    """fq(w) in the forward, gradient 1 to w in the backward."""
    with torch.no_grad():
        rounded = fp4.fake_quantize(w.detach(), fmt, block_size)
    return w + (rounded - w).detach()


class FakeQuantizedExpert(nn.Module):
    """A SwiGLU expert (model.FeedForward) computing with straight-through fq(w): its gate, up and down
    are the float expert's own Linears, so the parameters and their state-dict names stay the same."""

    def __init__(self, expert, fmt: str, block_size: int):
        super().__init__()
        self.gate = expert.gate
        self.up = expert.up
        self.down = expert.down
        self.fmt = fmt
        self.block_size = block_size

    def forward(self, x):
        gate, up, down = (straight_through(lin.weight, self.fmt, self.block_size)
                          for lin in (self.gate, self.up, self.down))
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class FakeQuantizedMoEFeedForward(MoEFeedForward):
    """A MoE layer whose experts are FakeQuantizedExperts: its routed experts always run dispatch's loop,
    since the grouped kernel (kernels/moe_ffn.py) would read w, not fq(w)."""

    def routed(self, flat, mix, chosen):
        return dispatch(flat, mix, chosen, self.n_experts, lambda e, rows: self.experts[e](rows))


def fake_quantize_experts(model, fmt: str, block_size: int | None = None):
    """Make every MoE layer of `model` compute with straight-through fake-quantized expert weights
    (in place; returns the model). Checked before any training: the format, the block size against
    the expert widths, and that the model has experts."""
    layers = moe_layers(model)  # a model without MoE layers: a one-line error
    config = model.config
    block_size = fp4.STANDARD_BLOCK.get(fmt, 0) if block_size is None else block_size
    fp4.check_format(fmt, block_size, {"d_model": config.d_model, "expert_d_ff": config.expert_d_ff})
    if config.expert_format != "float":
        raise UserError(f"--qat fine-tunes full-precision experts; this model's are packed {config.expert_format}. "
                        "Start from the full-precision checkpoint it came from")
    for layer in layers:  # a layer fake-quantized before gets the new format: the Linears are rewrapped
        layer.experts = nn.ModuleList(FakeQuantizedExpert(expert, fmt, block_size) for expert in layer.experts)
        if layer.shared is not None:
            layer.shared = FakeQuantizedExpert(layer.shared, fmt, block_size)
        layer.__class__ = FakeQuantizedMoEFeedForward  # the same module and parameters; its experts run the loop
    return model


def matching_loss(target):
    """The loss of an ar-moe QAT run with --target: H(p, q) of the fake-quantized model's next-token
    distribution q against the frozen full-precision `target`'s p at temperature 1 (the model's own
    distribution, unwarped), on the same windows (B, T+1), plus the balance term; (loss, stats)."""
    return partial(ar_moe_loss, base=partial(soft_ar_loss, target=target, temperature=1.0))


def train_hook(run: dict, model, target, loss_fn, train_tokens, val_tokens, out):
    """train.py's hook for an ar-moe --qat run with --target (train/batches.py): the loss becomes
    matching_loss(target), the full-precision model's distribution the labels; the text is kept."""
    return matching_loss(target), train_tokens, val_tokens
