"""Labels for drafts that will be sampled: the target's whole distribution at the serving temperature.

A draft trained on the target's greedy text with hard labels learns the target's argmax. Verified
at temperature T > 0, a draft token is kept with probability min(1, p(x) / q(x)), so a chain keeps
each draft with probability 1 - TV(p, q) (Leviathan et al. 2023): what pays is q = p at T, not
q's argmax = p's argmax. Here the labels are p_T = softmax(target logits / T), and the draft's own
distribution is read as it is sampled, q_T = softmax(draft logits / T) (sampling.warp divides by T
the same way), so the cross-entropy H(p_T, q_T) = KL(p_T || q_T) + H(p_T) is smallest exactly at
q_T = p_T. Hard labels are the one-hot case: H(onehot(y), q) is the plain cross-entropy.
The AR draft's loss (`soft_ar_loss`) runs the frozen target over the same windows; DFlash's and
EAGLE-3's losses already run it for its features and take their labels from the same forward
(dflash.dflash_loss, eagle.eagle_loss with `temperature`).
Leaves out: top-k / top-p in the labels (the draft is trained for plain temperature sampling),
mixing hard and soft labels.
"""
import torch

from tinydiff.model import wide
from tinydiff.sampling import next_token_probs
from tinydiff.tokenizer import MASK


def draftable(logits):
    """Float32 (float64 stays float64) logits (..., V) with MASK at -inf: never drafted, as
    next_token_probs never generates it."""
    logits = logits.to(wide(logits.dtype))
    if logits.shape[-1] > MASK:
        logits = logits.clone()
        logits[..., MASK] = float("-inf")
    return logits


def without_mask(x):
    """x (..., V) without the MASK column, which is never a label (p = 0) and never drafted."""
    if x.shape[-1] <= MASK:
        return x
    return x[..., :MASK] if x.shape[-1] == MASK + 1 else torch.cat([x[..., :MASK], x[..., MASK + 1:]], -1)


def soft_ce(logits, p):
    """Cross-entropy -sum_v p_v log q_v of q = softmax(logits) (..., V), MASK left out as in
    `draftable`, against the distribution p (..., V): logsumexp(z) - <p, z> (p sums to 1), which
    never materialises log q, a saving on 50,258-wide rows."""
    z, p = without_mask(logits.to(wide(logits.dtype))), without_mask(p)
    return torch.logsumexp(z, -1) - (p * z).sum(-1)


def tempered_ce(logits, target_logits, temperature: float):
    """H(p_T, q_T) per position (...): p_T the target's distribution as the sampler warps it at
    `temperature` (> 0), q_T the draft's logits read at the same temperature."""
    return soft_ce(logits / temperature, next_token_probs(target_logits, temperature))


def soft_ar_loss(model, windows, generator=None, target=None, temperature: float = 1.0):
    """An AR draft's mean H(p_T, q_T) over windows (B, T+1), p_T from the frozen `target` reading the
    same tokens; returns (loss, stats). `generator` is unused (train.py's one loss signature)."""
    x = windows[:, :-1]  # (B, T)
    with torch.no_grad():
        target_logits = target(x, causal=True)  # (B, T, V)
    logits = model(x, causal=True)  # (B, T, V)
    loss = tempered_ce(logits, target_logits, temperature).mean()
    # the same column left out of both: equal argmaxes are equal ids, and no 50,258-wide copy is made
    agree = (without_mask(logits.detach()).argmax(-1) == without_mask(target_logits).argmax(-1)).float().mean()
    return loss, {"ce": loss.detach(), "acc": agree}
