"""The AR and MDLM training losses with the head and its cross-entropy fused, a chunk of rows at a time.

A small model's step is mostly its 50,258-wide head. ar.ar_loss and diffusion.mdlm_loss, the readable
references, write the batch's logits (B, T, V); cross-entropy's backward then adds a log-softmax and two
gradients of that size: about 6 GB resident for `--preset tiny`'s 32 windows of 256 tokens. Here
`LinearCrossEntropy` forms the loss AND its gradients in the forward, ROWS rows at a time: a chunk's
logits, their log-sum-exp, softmax minus the one-hot, and the two products that are the gradients of the
hidden states (N, D) and of the head (V, D). The backward only scales those. One chunk's logits are alive
at a time and none is computed twice (Liger-Kernel's fused linear cross-entropy; Apple's Cut
Cross-Entropy goes further, with kernels that never write a chunk out). The rows' weights must be known
in the forward, so this serves losses linear in their rows' cross-entropies, as both of these are.
MDLM scores masked positions only: only their rows go through the head, about half its work.
train.py trains with these (`faster` swaps them in for the core's); tests/train/test_fused_loss.py holds
them to the references in float64: the same loss, stats and gradient of every parameter.
Leaves out: block diffusion's loss, the drafters' (dflash.checkpointed_chunks), Triton kernels.
"""
import functools
import inspect

import torch

from tinydiff import ar, diffusion
from tinydiff.diffusion import block_diffusion_loss, noise, sample_t, scored_tokens
from tinydiff.model import wide
from tinydiff.tokenizer import MASK

ROWS = 512  # rows of logits a chunk holds: 512 x 50,258 x 4 bytes = 103 MB


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i . head^T, y_i) and each row's CE, for h (N, D), head (V, D), y (N,), w (N,): the head's
    first `classes` rows are the classes (the rest, padding or MASK, have -inf logits)."""

    @staticmethod
    def forward(ctx, h, head, y, w, classes: int):
        device = h.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else h.dtype  # the matmuls' dtype, as F.linear's
        with torch.autocast(device, enabled=False):
            hc, wc = h.to(dtype), head.to(dtype)
            ce = torch.empty(len(h), dtype=wide(dtype), device=h.device)  # (N,)
            grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None  # (N, D)
            grad_head = torch.zeros_like(head) if ctx.needs_input_grad[1] else None  # (V, D)
            w = w.to(ce.dtype)
            # The rows' weights scale the narrow (n, D) side of each product, never the (n, V) one; under
            # autocast divided by their largest, so that a half dtype keeps them, and multiplied back after.
            scale = w.max() if len(w) and dtype != head.dtype else w.new_ones(())
            for i in range(0, len(h), ROWS):
                rows = slice(i, i + ROWS)
                logits = (hc[rows] @ wc.T).to(ce.dtype)  # (n, V): the chunk's, in float32 (float64 stays)
                logits[:, classes:] = float("-inf")  # no mass, so no gradient: the head's shape kept for the matmul
                # CE = logsumexp - the target's logit, with one exponential pass: logsumexp itself would write
                # a temporary (n, V) and the softmax would take a second pass.
                top, picked = logits.amax(-1, keepdim=True), logits.gather(1, y[rows, None])  # (n, 1) each
                g = logits.sub_(top).exp_()  # (n, V): exp(logit - max), in place of the logits
                total = g.sum(-1, keepdim=True)  # (n, 1)
                ce[rows] = (top + total.log() - picked)[:, 0]
                if grad_h is None and grad_head is None:
                    continue
                g.div_(total)  # the softmax
                g[torch.arange(len(g), device=g.device), y[rows]] -= 1  # d CE / d logits, unweighted
                g = g.to(dtype)
                if grad_h is not None:
                    grad_h[rows] = ((g @ wc).to(ce.dtype) * w[rows, None]).to(h.dtype)
                if grad_head is not None:
                    hw = (hc[rows] * (w[rows, None] / scale)).to(dtype)  # (n, D): each row's weight
                    if dtype == head.dtype:
                        grad_head.addmm_(g.T, hw)
                    else:
                        grad_head += (g.T @ hw).to(head.dtype) * scale.to(head.dtype)
        ctx.save_for_backward(grad_h, grad_head)
        ctx.mark_non_differentiable(ce)
        return (ce * w).sum(), ce

    @staticmethod
    def backward(ctx, grad_loss, _):
        grad_h, grad_head = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype),
                None if grad_head is None else grad_head * grad_loss.to(grad_head.dtype), None, None, None)


def head_loss(model, h, y, w, never_mask: bool):
    """LinearCrossEntropy through model's norm and tied head: h (N, D) the last block's residual streams,
    y (N,) targets, w (N,) weights. never_mask: MASK's column left out, as diffusion.subs_logits' -inf.
    Returns the weighted sum and each row's CE (N,). The head keeps its padded rows (model.padded_vocab),
    which the matmuls tile evenly; their logits, and MASK's, are -inf."""
    V = model.config.vocab_size
    classes = MASK if never_mask and V > MASK else V  # MASK is the last id
    return LinearCrossEntropy.apply(model.norm(h), model.embed.weight, y, w, classes)


def last_hidden(model, idx, causal: bool):
    """The residual streams (B, T, D) after model's last block for idx (B, T): a forward without its head."""
    _, (h,) = model(idx, causal=causal, head_from=idx.shape[1], hidden_layers=[model.config.n_layer])
    return h


def ar_loss(model, windows, generator=None):
    """ar.ar_loss, the head fused with the cross-entropy: (loss, stats)."""
    x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each
    h = last_hidden(model, x, causal=True).flatten(0, 1)  # (B*T, D)
    w = torch.full((len(h),), 1 / len(h), dtype=torch.float64, device=h.device)  # (B*T,): the mean
    loss, _ = head_loss(model, h, y.flatten(), w, False)
    return loss, {"ce": loss.detach()}


def mdlm_loss(model, x, generator=None):
    """diffusion.mdlm_loss, the head fused with the cross-entropy and run on the masked positions only:
    the same noise from the same generator, the same (loss, stats)."""
    t = sample_t(len(x), generator, x.device)
    noisy, masked = noise(model, x, t, generator)
    h = last_hidden(model, noisy, causal=False)  # (B, T, D)
    # A shifted model's output i scores token i + 1: an output is read where the token after it is masked.
    target, read = (x.roll(-1, 1), masked.roll(-1, 1)) if model.config.shift else (x, masked)  # (B, T) each
    w = 1 / (t.double()[:, None].expand_as(x)[read] * scored_tokens(model, x))  # (N,): the bound's 1/t, a token
    loss, ce = head_loss(model, h[read], target[read], w, True)
    masked_ce = ce.sum() / masked.sum().clamp(min=1)
    return loss, {"elbo": loss.detach(), "masked_ce": masked_ce.detach()}


def diffusion_loss(model, x, generator=None):
    """diffusion.diffusion_loss with mdlm_loss above; block diffusion's is the reference's."""
    block = model.config.noise_block
    return block_diffusion_loss(model, x, block, generator) if block else mdlm_loss(model, x, generator)


def faster(loss):
    """The loss train.py runs for the core's `loss`: ar.ar_loss and diffusion.diffusion_loss computed here; a
    loss built on one of them through its `base` (the MoEs': base + the balance term) given this file's form of
    it; any other loss as it is."""
    base = inspect.signature(loss).parameters.get("base")
    if base is not None:
        return functools.partial(loss, base=faster(base.default))
    return {ar.ar_loss: ar_loss, diffusion.diffusion_loss: diffusion_loss}.get(loss, loss)
