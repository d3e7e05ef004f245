"""Turning logits into tokens: temperature, top-k and top-p warping, and seeded sampling.

Every decoding method warps its distributions through `warp` so that a draft and a target are warped identically
(speculative sampling is lossless only for the distributions it compares). Temperature 0 is greedy decoding written as
a distribution: all mass on the argmax (first index on ties), so greedy and sampled decoding run through the same code.
`residual` is what speculative sampling draws from after it rejects a draft token.
Leaves out: repetition penalties, min-p, typical sampling.
"""
import torch

from tinydiff.checks import UserError
from tinydiff.model import wide
from tinydiff.tokenizer import MASK


def warp(logits, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """Probabilities (..., V) in float32 from logits (..., V) (float64 logits: in float64)."""
    check_warp_args(temperature, top_k, top_p)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token if the mass before it is still below top_p: the smallest such set.
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def forbid_mask(logits, inplace: bool = False):
    """logits (..., V) with MASK's logit at -inf: never sampled, drafted or predicted (only an input; tiny
    test models may lack the id). A copy, or in place where the caller owns the logits (a copy costs time)."""
    if logits.shape[-1] > MASK:
        logits = logits if inplace else logits.clone()
        logits[..., MASK] = float("-inf")
    return logits


def next_token_probs(logits, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """Warped next-token probabilities (..., V) of a language model: MASK is never generated."""
    return warp(forbid_mask(logits), temperature, top_k, top_p)


def sample(probs, generator: torch.Generator | None = None):
    """One token id per row of probs (..., V) -> (...), by inverse CDF: one uniform per row.

    The same distribution as torch.multinomial, which on a CPU costs about a millisecond per
    50k-wide row; a cumulative sum in float64 costs that for a whole batch of rows.
    """
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    top = flat.max(-1)
    if bool((top.values == 1).all()):  # greedy rows: their id is certain, spend no random number
        return top.indices.view(probs.shape[:-1])
    u = torch.rand(len(flat), 1, generator=generator, device=flat.device, dtype=torch.float64)  # (N, 1)
    return inverse_cdf(flat, u).view(probs.shape[:-1])


def inverse_cdf(probs, u):
    """The ids (N,) that uniforms u (N, 1) in [0, 1) pick from probs (N, V) (any scale): the first id whose
    float64 cumulative sum passes u times the row's total. `sample`'s draw, and the compiled graphs' (fast/)."""
    cdf = probs.double().cumsum(-1)  # (N, V)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_max(probs.shape[-1] - 1)  # (N,)


def residual(p, q):
    """norm(max(0, p - q)) over the last dim of p, q (..., V): the correction after a rejection.

    Accepting a draft x ~ q with probability min(1, p(x)/q(x)) yields token y with probability min(p(y), q(y)); the
    rejection mass 1 - sum(min(p, q)) times this residual supplies the rest of p. Where p == q nothing is ever
    rejected and the residual is never sampled: we return p there so the result is still a distribution.
    """
    r = (p - q).clamp_min(0)  # (..., V)
    mass = r.sum(-1, keepdim=True)  # (..., 1)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def draftable(logits):
    """Float32 (float64 stays float64) logits (..., V) with MASK at -inf: never drafted (forbid_mask)."""
    return forbid_mask(logits.to(wide(logits.dtype)))


def without_mask(x):
    """x (..., V) without the MASK column, which is never a label (p = 0) and never drafted."""
    if x.shape[-1] <= MASK:
        return x
    return x[..., :MASK] if x.shape[-1] == MASK + 1 else torch.cat([x[..., :MASK], x[..., MASK + 1:]], -1)


def soft_ce(logits, p):
    """Cross-entropy -sum_v p_v log q_v of q = softmax(logits) (..., V), MASK left out as in `draftable`, against
    the distribution p (..., V): logsumexp(z) - <p, z> (p sums to 1), never materialising log q (50,258 wide)."""
    z, p = without_mask(logits.to(wide(logits.dtype))), without_mask(p)
    return torch.logsumexp(z, -1) - (p * z).sum(-1)


def tempered_ce(logits, target_logits, temperature: float):
    """H(p_T, q_T) per position (...): p_T the target's distribution as the sampler warps it at
    `temperature` (> 0), q_T the draft's logits read at the same temperature."""
    return soft_ce(logits / temperature, next_token_probs(target_logits, temperature))


def check_warp_args(temperature: float, top_k: int | None, top_p: float | None):
    if not 0 <= temperature < float("inf"):  # NaN fails too: it would turn every probability into NaN
        raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"top-k must be >= 1 (or unset), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top-p must lie in (0, 1] (or be unset), got {top_p}")
