"""Triton kernels for the hot spots, and the one switch that decides whether they run.

One file per kernel, each with the plain PyTorch function it replaces right beside it (its spec):
  masked_attention.py  attention of new queries over a KV prefix + themselves, any boolean mask
  moe_ffn.py           the dMoE expert feed-forward: tokens grouped by expert, one launch per layer;
                       moe_ffn_fp4, the same with MXFP4 expert weights read packed
  sampler_step.py      the diffusion sampler's argmax + confidence over the vocabulary, in chunks
Each file's public function (`masked_attention`, `moe_ffn`, `moe_ffn_fp4`, `sampler_step`) dispatches: the Triton
kernel when `use_triton(tensor)` says so, the reference otherwise. tinydiff/bench/kernels.py times them.
The model paths call them where `for_inference(tensor)`: attention with an explicit mask (`attention`
below, for model.Attention: DDTree verification, the block-causal sampler), dmoe.MoEFeedForward's
experts (MXFP4 ones: fp4.QuantizedSwiGLU), and the diffusion samplers' proposal with low_confidence
remasking (`proposal` below, chosen where a sampler starts). The kernels have no backward pass, so a
forward that records gradients (training) always takes the PyTorch path.

When do kernels run? On a CUDA tensor when Triton is installed; on a CPU tensor only under Triton's
interpreter (TRITON_INTERPRET=1 in the environment at the call), which runs the same kernel code
with NumPy, slowly, so tests and lessons can check kernels on a laptop. Triton decides between
compiled and interpreted code when it and the kernel files are *imported*, so TRITON_INTERPRET must
be set before that (tests/kernel_mode.py does it first thing). Library code therefore imports a
kernel module lazily, inside `if kernels.for_inference(x):`; importing this package imports no
Triton. So on CPU the models run the references unless TRITON_INTERPRET=1 is set (slow: for tests).
Under the interpreter use float32 or float16 (bfloat16 is silently wrong there) and small grids.
`TINYDIFF_KERNELS=0` in the environment, or `with kernels_enabled(False):`, forces the references
everywhere (what the agreement tests compare against).

Without Triton (macOS, Windows) the kernel files still import, through the stand-in below, so the
references work everywhere; the kernels just never run.
"""
import importlib.util
import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F

HAVE_TRITON = importlib.util.find_spec("triton") is not None
_enabled = os.environ.get("TINYDIFF_KERNELS", "1") != "0"


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (read now, from the environment)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def use_triton(x: torch.Tensor) -> bool:
    """Run the Triton kernel on tensor x? CUDA: yes (with Triton); CPU: only under the interpreter."""
    return _enabled and HAVE_TRITON and (x.is_cuda or interpreting())


def for_inference(x: torch.Tensor) -> bool:
    """Should a model path call a kernel on tensor x? use_triton(x), and autograd off (torch.no_grad,
    torch.inference_mode): the kernels compute no gradients, so training keeps the PyTorch path."""
    return use_triton(x) and not torch.is_grad_enabled()


def attention(q, k, v, mask, is_causal: bool):
    """F.scaled_dot_product_attention of q (B, H, T, D) over k, v (B, H, S, D), or where for_inference(q)
    and a mask is given, masked_attention.py's flash kernel, which skips the key tiles the mask hides."""
    if mask is not None and for_inference(q):
        from tinydiff.kernels.masked_attention import masked_attention  # lazily: see above
        return masked_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def proposal(propose, remasking: str, x):
    """The diffusion sampler's proposal function for a run on x's device: `propose` (tinydiff/sampler.py),
    or where for_inference(x) and remasking is low_confidence, fused_propose in its place."""
    if remasking == "low_confidence" and for_inference(x):
        return fused_propose
    return propose


def fused_propose(logits, temperature: float, remasking: str, generator=None):
    """sampler.propose for low_confidence remasking in one fused pass over the vocabulary
    (sampler_step.py): it draws propose's uniforms (same generator, shape and dtype), so the same
    tokens, and never writes the (N, V) float64 logits, scores and probabilities."""
    from tinydiff.kernels.sampler_step import sampler_step  # lazily: see above
    u = None
    if temperature > 0:
        u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
    return sampler_step(logits, temperature, u)


@contextmanager
def kernels_enabled(flag: bool):
    """`with kernels_enabled(False):` runs the PyTorch references even where Triton would run."""
    global _enabled
    before, _enabled = _enabled, flag
    try:
        yield
    finally:
        _enabled = before


def check_device(kernel, x: torch.Tensor):
    """Fail clearly when a kernel compiled for the GPU is handed CPU tensors."""
    if not x.is_cuda and type(kernel).__name__ != "InterpretedFunction":
        name = getattr(kernel, "fn", kernel).__name__
        raise RuntimeError(f"{name} was compiled for the GPU but got CPU tensors: set TRITON_INTERPRET=1 "
                           "*before* Triton and the tinydiff.kernels modules are imported")


class _NoTriton:
    """Stands in for `triton` and `triton.language` where Triton is not installed: `@triton.jit`
    leaves the function as it is and `tl.constexpr` annotations evaluate, so a kernel file imports
    and its reference runs. use_triton() is False there, so no kernel is ever launched."""

    @staticmethod
    def jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    def __getattr__(self, name):
        return None


no_triton = _NoTriton()
