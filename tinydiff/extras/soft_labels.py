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
(dflash.dflash_loss, eagle3.eagle_loss with `temperature`).
Leaves out: top-k / top-p in the labels (the draft is trained for plain temperature sampling),
mixing hard and soft labels.
"""
import torch

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
