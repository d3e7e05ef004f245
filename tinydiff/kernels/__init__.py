"""Triton kernels for the hot spots, and the one switch that decides whether they run.

One file per kernel, each with the plain PyTorch function it replaces right beside it (its spec):
  masked_attention.py  attention of new queries over a KV prefix + themselves, any boolean mask
  moe_ffn.py           the dMoE expert feed-forward: tokens grouped by expert, one launch per layer;
                       moe_ffn_fp4, the same with MXFP4 expert weights read packed
  sampler_step.py      the diffusion sampler's argmax + confidence over the vocabulary, in chunks
Each file's public function dispatches: the Triton kernel when `use_triton(tensor)` says so, the
reference otherwise (tinydiff/bench/kernels.py times them). The model paths call them where
`for_inference(tensor)`: `attention` below, dmoe's and fp4's MoE layers, and sampler.proposer. No
kernel has a backward pass, so training always takes the PyTorch path.

When do kernels run? On a CUDA tensor when Triton is installed; on a CPU tensor only under Triton's
interpreter (TRITON_INTERPRET=1), which runs the same kernel code with NumPy, slowly, so tests and
lessons check kernels on a laptop (in float32 or float16: bfloat16 is silently wrong there). Triton
reads TRITON_INTERPRET when the kernel files are *imported* (tests/kernel_mode.py sets it first), so
library code imports a kernel module lazily, where `for_inference(x)`: this package imports no Triton.
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
    """Should a model path call a kernel on x? use_triton(x) and autograd off: the kernels have no backward."""
    return use_triton(x) and not torch.is_grad_enabled()


def attention(q, k, v, mask, is_causal: bool):
    """F.scaled_dot_product_attention, or given a mask where for_inference(q), the flash kernel (skips hidden tiles)."""
    if mask is not None and for_inference(q):
        from tinydiff.kernels.masked_attention import masked_attention  # lazily: see above
        return masked_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


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
    """`triton` and `triton.language` where Triton is not installed: `@triton.jit` leaves a function as it is
    and `tl.constexpr` evaluates, so a kernel file imports and its reference runs (no kernel ever launches)."""

    @staticmethod
    def jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    def __getattr__(self, name):
        return None


no_triton = _NoTriton()
