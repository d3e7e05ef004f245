"""Small models whose exact sampling joint the tests can enumerate: a diffusion LM over V = 6 ids
(SmallVocab; with causal=True an AR draft over the same ids), and the joint of the one-token-per-step
sampler over NEW = 4 tokens after a 2-token prompt (exact_joint), walked with plain uncached
forwards. Used by test_self_speculative.py and test_drafted_diffusion.py."""
import torch
from stats_helpers import random_model

from tinydiff.model import ModelConfig
from tinydiff.sampler import block_causal_mask, position_entropy
from tinydiff.sampling import next_token_probs
from tinydiff.tokenizer import MASK

V, NEW, SMALL_PROMPT = 6, 4, [1, 2]


class SmallVocab(torch.nn.Module):
    """A random diffusion LM over V ids: MASK reads as the extra id V, and the logits are the V real
    ids' (the model never predicts MASK). Cheap enough for thousands of seeded generations.
    causal=True makes it an AR model over the same ids (a draft for the diffusion one)."""

    def __init__(self, shift: bool, seed: int, causal: bool = False):
        super().__init__()
        config = ModelConfig(vocab_size=V + 1, context=8, n_layer=1, n_head=2, d_model=16, d_ff=32, causal=causal,
                             shift=shift)
        self.inner = random_model(config, seed)
        self.config, self.embed = self.inner.config, self.inner.embed

    def new_cache(self, batch_size=1):
        return self.inner.new_cache(batch_size)

    def forward(self, idx, **kwargs):
        out = self.inner(torch.where(idx == MASK, V, idx), **kwargs)
        if isinstance(out, tuple):  # hidden_layers given: (logits, hidden states)
            return out[0][..., :V], out[1]
        return out[..., :V]

    def logits(self, x):
        return self.inner.logits(x)[..., :V]


@torch.no_grad()
def exact_joint(model, order, temperature, block):
    """P(x_1..x_NEW) of one token per step in `order`, blocks of `block` left to right, for all V^NEW
    continuations: every path walked with full uncached block-causal forwards."""
    P, shift = len(SMALL_PROMPT), int(model.config.shift)
    ids = torch.cat([torch.zeros(P, dtype=torch.long), 1 + torch.arange(NEW) // block])
    mask = block_causal_mask(ids)
    probs = torch.zeros(V ** NEW, dtype=torch.float64)

    def walk(canvas, mass):
        open_ = [i for i in range(P, P + NEW) if canvas[i] == MASK]
        if not open_:
            probs[sum(int(t) * V ** (NEW - 1 - i) for i, t in enumerate(canvas[P:]))] += mass
            return
        lo = P + (open_[0] - P) // block * block
        logits = model(canvas[None], causal=False, mask=mask)[0, lo - shift:lo - shift + block].double()
        here = torch.tensor([i - lo for i in open_ if i < lo + block])
        if order == "low_entropy":
            here = here[torch.argsort(position_entropy(logits[here], temperature), stable=True)]
        p = next_token_probs(logits[here[0]], temperature)
        for v in range(V):
            if p[v] > 0:
                walk(torch.cat([canvas[:lo + here[0]], torch.tensor([v]), canvas[lo + here[0] + 1:]]), mass * float(p[v]))

    walk(torch.tensor(SMALL_PROMPT + [MASK] * NEW), 1.0)
    return probs


