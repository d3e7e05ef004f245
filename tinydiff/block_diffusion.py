"""Block diffusion (BD3-LM, Arriola et al. 2025): a noise level per block, behind a clean prefix.

The semi-autoregressive samplers (tinydiff/sampler.py: `generate_cached`) fill a sequence block by
block: each block starts all-MASK and is denoised with the finished blocks before it clean, seen
block-causally. MDLM's loss (tinydiff/diffusion.py) draws one t for the whole window, so that
state (a clean prefix, then a heavily masked block) is rare in training. Block diffusion trains it:
    -log p(x) = sum over blocks b of -log p(x_b | x_<b)
              <= sum over b of E_{t_b} [ (1/t_b) * sum over masked i in b of -log p(x_i | x_<b, noisy x_b) ]
each term MDLM's bound for one block given its clean prefix, so the sum (divided by T) is again
an upper bound on the NLL per token, and the sampler's states are the ones trained.

One forward covers every block (BD3-LM's vectorised form): the model reads [clean x; noisy x]
(2T positions, the second copy at the same position ids). A clean block sees the clean blocks up
to itself (the keys the sampler's prefix cache holds); a noisy block sees the clean blocks before
it and itself, never another noisy block. Only the noisy half is scored, and only it goes through
the LM head (`head_from`), the largest cost of a small model.
A model trained this way records its block in `config.noise_block` (0: MDLM's one t per window);
`diffusion_loss` and `diffusion_elbo` pick the bound that matches it.
For a MoE model the routing blocks (counted back from the end, tinydiff/dmoe.py) fall on the
same boundaries when they divide the window: each routes one clean or one noisy block.

Leaves out: BD3-LM's clipped noise schedules and data-driven variance reduction, shifted
(AR-adapted) models, whose first-token prediction crosses the block boundary.
"""
import torch
import torch.nn.functional as F

from tinydiff.diffusion import bound_summary, check_elbo_input, elbo, mdlm_loss, sample_t, subs_logits
from tinydiff.errors import UserError
from tinydiff.model import wide
from tinydiff.tokenizer import MASK


def check_blocks(model, x, block: int):
    if model.config.shift:
        raise UserError("block diffusion needs an unshifted diffusion LM; this one was adapted from an AR model")
    if block < 1 or x.shape[1] % block:
        raise UserError(f"the window of {x.shape[1]} tokens must split into whole noise blocks of {block}; "
                        f"pick a block that divides the context")


def clean_and_noisy_mask(T: int, block: int, device=None):
    """(2T, 2T) bool for the sequence [clean; noisy]: True = may attend."""
    ids = torch.arange(T, device=device) // block
    earlier_or_same = ids[None, :] <= ids[:, None]  # (T, T) key block <= query block
    same = ids[None, :] == ids[:, None]
    clean_rows = torch.cat([earlier_or_same, torch.zeros_like(same)], 1)  # clean never sees noisy
    noisy_rows = torch.cat([earlier_or_same & ~same, same], 1)  # clean blocks before, its own noisy block
    return torch.cat([clean_rows, noisy_rows], 0)


def block_noise(x, block: int, generator=None):
    """Noise every block of x (B, T) at its own t; returns (noisy, masked, t per position (B, T)).

    t is stratified over all B * T/block blocks of the batch (sample_t), then one uniform per position
    as in diffusion.add_noise: with block = T this is MDLM's draw exactly, random numbers included.
    """
    B, T = x.shape
    t = sample_t(B * (T // block), generator, x.device).view(B, -1).repeat_interleave(block, 1)  # (B, T)
    masked = torch.rand(x.shape, generator=generator, device=x.device) < t
    return torch.where(masked, torch.full_like(x, MASK), x), masked, t


def block_masked_ce(model, x, noisy, masked, block: int):
    """-log p(x_i | clean blocks before i's, noisy block of i) at masked positions, else 0: (B, T)."""
    B, T = x.shape
    pos = torch.arange(T, device=x.device).repeat(2)  # (2T,) the noisy copy reuses the positions
    mask = clean_and_noisy_mask(T, block, x.device)
    logits = model(torch.cat([x, noisy], 1), pos=pos, mask=mask, head_from=T)  # (B, T, V): the noisy half
    logits = subs_logits(logits.to(wide(logits.dtype)), inplace=True)  # float64 stays (exact tests)
    return F.cross_entropy(logits.flatten(0, 1), x.flatten(), reduction="none").view(B, T) * masked


def block_diffusion_loss(model, x, block: int, generator=None):
    """The block-diffusion bound as a training loss on clean windows x (B, T); (loss, stats) as mdlm_loss."""
    check_blocks(model, x, block)
    noisy, masked, t = block_noise(x, block, generator)
    ce = block_masked_ce(model, x, noisy, masked, block)
    loss = (ce / t).sum() / x.numel()
    masked_ce = ce.sum() / masked.sum().clamp(min=1)
    return loss, {"elbo": loss.detach(), "masked_ce": masked_ce.detach()}


@torch.no_grad()
def block_diffusion_elbo(model, x, block: int, mc: int = 8, generator=None, n_bytes: int | None = None) -> dict:
    """diffusion.elbo's bound and fields, for the block-diffusion factorisation."""
    check_elbo_input(x, mc)
    check_blocks(model, x, block)
    draws = []
    for _ in range(mc):
        noisy, masked, t = block_noise(x, block, generator)
        draws.append(float((block_masked_ce(model, x, noisy, masked, block) / t).sum() / x.numel()))
    return bound_summary(draws, x.numel(), n_bytes)


def diffusion_loss(model, x, generator=None):
    """The training loss the model is built for: block diffusion when config.noise_block, else MDLM."""
    block = model.config.noise_block
    return block_diffusion_loss(model, x, block, generator) if block else mdlm_loss(model, x, generator)


def diffusion_elbo(model, x, mc: int = 8, generator=None, n_bytes: int | None = None) -> dict:
    """The held-out bound of the model's own factorisation (see diffusion_loss)."""
    block = model.config.noise_block
    if block:
        return block_diffusion_elbo(model, x, block, mc, generator, n_bytes)
    return elbo(model, x, mc, generator, n_bytes)
