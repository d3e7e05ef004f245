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
(dflash.dflash_loss, eagle3.eagle_loss with `temperature`). train.py's hook (`train_hook`,
train/batches.py) gives a --draft-temperature run these labels.
Leaves out: top-k / top-p in the labels (the draft is trained for plain temperature sampling),
mixing hard and soft labels.
"""
from functools import partial

import torch

from tinydiff.checks import UserError
from tinydiff.sampling import tempered_ce, without_mask


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


def train_hook(run: dict, model, target, loss_fn, train_tokens, val_tokens, out):
    """train.py's hook for --draft-temperature T (train/batches.py): the labels become the frozen `target`'s
    distribution at T. A drafter's loss (DFlash's, EAGLE-3's) takes `temperature`; an AR draft's becomes
    soft_ar_loss. A diffusion target's left-to-right conditionals would cost a forward per position: an AR
    draft learns one from the stories it samples at T (--regenerate), their tokens the labels. The text is
    kept. Returns (loss_fn, train_tokens, val_tokens)."""
    temperature = run["draft_temperature"]
    if run["model"] != "ar":
        return partial(loss_fn, temperature=temperature), train_tokens, val_tokens
    if not target.config.causal:
        if run["regenerate"] is None:
            raise UserError("an AR draft learns a diffusion --target from the stories it writes: add --regenerate N")
        return loss_fn, train_tokens, val_tokens
    return partial(soft_ar_loss, target=target, temperature=temperature), train_tokens, val_tokens
