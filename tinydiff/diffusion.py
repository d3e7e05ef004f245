"""Masked diffusion (MDLM / LLaDA): the forward process, the training loss, and the likelihood bound.

Forward process: draw t ~ U(eps, 1) and replace each token by MASK independently with
probability t. MASK is absorbing: once masked, a token stays masked as t grows.
The model sees the noisy sequence with bidirectional attention and predicts the clean token at
every masked position. No timestep input: the fraction of MASKs tells the model t.

Loss (the continuous-time ELBO, MDLM eq. 10 / LLaDA eq. 3):
    bound = E_t [ (1/t) * sum over masked positions of -log p(x_i | noisy) ] / T
an upper bound on the negative log-likelihood per token, so exp(bound) bounds the perplexity.
The unweighted mean cross-entropy over masked tokens is logged as `masked_ce`: a training
signal only, not a likelihood.
SUBS parameterisation: the MASK logit is -inf (the clean data has no MASKs), and unmasked
positions carry no loss (their prediction is the input, copied through).

Shifted models (`config.shift`, Dream 7B's "shift operation"): a diffusion LM adapted from an AR
checkpoint (train.py --init AR_CKPT) keeps the AR head's alignment, so the prediction for position
i is read at output i-1. Position 0 then has no output to predict it: it is never masked, and the
bound covers positions 1..T-1 (the first token is context, as in an AR model's window).

Leaves out: timestep conditioning, other noise schedules (this is the linear one, alpha_t = 1 - t),
the low-variance "exact count" estimator for training (used here only to test the bound).
Samplers live in tinydiff/sampler.py; a noise level per block (block diffusion) below.

Block diffusion (BD3-LM, Arriola et al. 2025): a noise level per block, behind a clean prefix.

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
import math

import torch
import torch.nn.functional as F

from tinydiff.checks import UserError
from tinydiff.model import wide
from tinydiff.sampling import forbid_mask
from tinydiff.tokenizer import MASK

EPS = 1e-3  # t is drawn from (EPS, 1): the 1/t weight stays finite


def sample_t(batch_size: int, generator=None, device="cpu", eps: float = EPS):
    """Stratified t (B,): one uniform offset, spread evenly over the batch (lower variance)."""
    u = torch.rand((), generator=generator, device=device)
    strata = (u + torch.arange(batch_size, device=device) / batch_size) % 1.0
    return eps + (1 - eps) * strata


def add_noise(x, t, uniforms=None, generator=None):
    """Mask each token of x (B, T) with probability t (B,); returns (noisy, masked) both (B, T).

    Masking is `uniform < t` for one uniform per position, so with shared `uniforms` a larger t
    masks a superset: the process is monotone, as an absorbing state must be.
    """
    if uniforms is None:
        uniforms = torch.rand(x.shape, generator=generator, device=x.device)
    masked = uniforms < t[:, None]
    return torch.where(masked, torch.full_like(x, MASK), x), masked


def subs_logits(logits, inplace: bool = False):
    """SUBS: the model never predicts MASK (B, T, V). In place when the caller owns the logits:
    training's (B, T, 50258) float32 logits are the largest tensor in the step, a copy costs time."""
    return forbid_mask(logits, inplace)


def noise(model, x, t, generator=None):
    """add_noise for this model: a shifted model's position 0 stays clean (nothing predicts it)."""
    noisy, masked = add_noise(x, t, generator=generator)
    if model.config.shift:
        noisy[:, 0], masked[:, 0] = x[:, 0], False
    return noisy, masked


def scored_tokens(model, x) -> int:
    """How many tokens of x (B, T) the bound covers: all, or all but each row's first when shifted."""
    B, T = x.shape
    return B * (T - 1 if model.config.shift else T)


def masked_token_ce(model, x, noisy, masked):
    """-log p(x_i | noisy) at masked positions, 0 elsewhere: (B, T) float32 (float64 for a float64 model)."""
    logits = model(noisy, causal=False)  # (B, T, V)
    logits = subs_logits(logits.to(wide(logits.dtype)), inplace=True)
    # A shifted model's output i scores token i+1; rolling the targets (not the large logits) avoids
    # a copy. The wrapped-around target of the last output lands on position 0, which is never masked.
    target = x.roll(-1, 1) if model.config.shift else x
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(x.shape)
    return (ce.roll(1, 1) if model.config.shift else ce) * masked


def mdlm_loss(model, x, generator=None):
    """The ELBO training loss on clean windows x (B, T); returns (loss, stats).

    stats: elbo (the bound, nats/token; equal to the loss) and masked_ce (unweighted CE over
    the masked tokens; not a likelihood).
    """
    t = sample_t(len(x), generator, x.device)
    noisy, masked = noise(model, x, t, generator)
    ce = masked_token_ce(model, x, noisy, masked)  # (B, T)
    loss = (ce / t[:, None]).sum() / scored_tokens(model, x)
    masked_ce = ce.sum() / masked.sum().clamp(min=1)
    return loss, {"elbo": loss.detach(), "masked_ce": masked_ce.detach()}


@torch.no_grad()
def elbo(model, x, mc: int = 8, generator=None, n_bytes: int | None = None) -> dict:
    """The per-token NLL bound of sequences x (B, T), averaged over `mc` noise draws.

    Returns bound (nats/token), stderr (its Monte-Carlo standard error over the draws),
    ppl_bound (exp(bound): perplexity <= this), and, given the byte length of the text the
    scored tokens encode (scored_tokens: a shifted model's rows minus their first), bits_per_byte
    (an upper bound too).
    """
    check_elbo_input(x, mc)
    draws = []
    for _ in range(mc):
        t = sample_t(len(x), generator, x.device)
        noisy, masked = noise(model, x, t, generator)
        ce = masked_token_ce(model, x, noisy, masked)
        draws.append(float((ce / t[:, None]).sum() / scored_tokens(model, x)))
    return bound_summary(draws, scored_tokens(model, x), n_bytes)


def bound_summary(draws: list[float], scored: int, n_bytes: int | None) -> dict:
    """elbo's fields from its per-draw bounds (nats/token over `scored` tokens)."""
    draws = torch.tensor(draws, dtype=torch.float64)
    bound = draws.mean().item()
    stderr = (draws.std() / math.sqrt(len(draws))).item()  # of the mean over the draws
    out = {"bound": bound, "stderr": stderr, "ppl_bound": math.exp(bound)}
    if n_bytes is not None:
        out["bits_per_byte"] = bound * scored / (n_bytes * math.log(2))
    return out


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


def check_elbo_input(x, mc: int):
    if mc < 2:
        raise UserError(f"mc must be >= 2 to estimate the standard error, got {mc}")
    if x.dim() != 2 or x.numel() == 0:
        raise UserError(f"elbo takes token ids of shape (B, T), got {tuple(x.shape)}")
    if (x == MASK).any():
        raise UserError("elbo scores clean text; the input holds MASK tokens")


def check_blocks(model, x, block: int):
    if model.config.shift:
        raise UserError("block diffusion needs an unshifted diffusion LM; this one was adapted from an AR model")
    if block < 1 or x.shape[1] % block:
        raise UserError(f"the window of {x.shape[1]} tokens must split into whole noise blocks of {block}; "
                        f"pick a block that divides the context")
