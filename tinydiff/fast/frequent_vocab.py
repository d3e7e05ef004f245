"""FR-Spec's frequency-ranked draft vocabulary: the draft's LM head keeps only the N most frequent tokens.

Paper: Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling". In a small draft the tied LM head is most of a decoding step: every drafted
token reads all 50,258 rows of it. Text uses few of them (a few thousand ids cover nearly all of
TinyStories), so the draft scores only the N ids most frequent in a corpus and reads N rows.

Lossless by construction: only the draft changes. It proposes ids of the subset alone (q = 0
elsewhere), the target still scores the whole vocabulary, and the acceptance rule is the same. A token
outside the subset is never drafted but comes back through the residual max(0, p - q), which holds
its full target probability, so the output is still the target's distribution (greedy decoding at
T = 0). What the subset costs is acceptance: the target's mass outside it is never accepted.
The pruned draft's logits are N wide, and `subset_draft_round` warps and samples them there: a draft
step never touches a V-wide row. Its q comes back V wide (zero outside the subset), written once a
round, so the verify of speculative.py runs unchanged.

Leaves out: the paper's fused top-k kernel, and the target's head (pruning it would change the output).
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff.checks import UserError
from tinydiff.sampling import sample, warp
from tinydiff.tokenizer import EOT, MASK


def frequent_ids(tokens, n: int, always=(EOT,)) -> torch.Tensor:
    """The n ids most frequent in `tokens` (a tensor or an array of ids, a token file's memmap too), ties
    to the lower id, always including the ids of `always` (EOT: it ends every story); sorted, (n,) long."""
    if not isinstance(n, int) or isinstance(n, bool) or n < len(always) + 1:
        raise UserError(f"the draft vocabulary must be an integer of at least {len(always) + 1} ids, got {n!r}")
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).flatten()
    counts = torch.bincount(ids, minlength=max(always, default=-1) + 1).double()  # (max id + 1,), `always` included
    counts[list(always)] = float("inf")  # kept first, whatever the text holds
    if n > len(counts):
        raise UserError(f"asked for a draft vocabulary of {n} ids, but the text holds only ids below {len(counts)}")
    # A stable sort on -count keeps equal counts in id order: the lower id wins a tie.
    order = torch.sort(-counts, stable=True).indices
    return order[:n].sort().values


class FrequentVocabDraft(nn.Module):
    """An AR draft (tinydiff.model.Transformer) whose head scores only `ids`: logits (B, T, N), column j
    the draft's own logit for ids[j]. Drafts with `subset_draft_round`. MASK is never an id: a language
    model never generates it (sampling.next_token_probs)."""

    def __init__(self, draft, ids):
        super().__init__()
        V = draft.config.vocab_size
        ids = torch.as_tensor(ids, dtype=torch.long, device=draft.embed.weight.device)
        if ids.dim() != 1 or len(ids) == 0 or ids.min() < 0 or ids.max() >= V or len(ids.unique()) != len(ids):
            raise UserError(f"the draft vocabulary must be distinct ids in [0, {V}), got {len(ids)} ids")
        if V > MASK and bool((ids == MASK).any()):
            raise UserError(f"the draft vocabulary must not hold MASK ({MASK}): a language model never generates it")
        self.draft = draft
        self.config, self.embed = draft.config, draft.embed  # what speculative.py reads of a draft
        self.register_buffer("ids", ids)
        self.register_buffer("rows", draft.embed.weight.detach()[ids].clone())  # (N, d): read contiguously

    def new_cache(self, *args, **kwargs):
        return self.draft.new_cache(*args, **kwargs)

    def forward(self, idx, **kwargs):
        """The draft's forward with its head on the subset: logits (B, T, N); the same keyword arguments."""
        T, n = idx.shape[1], self.draft.config.n_layer
        _, (x,) = self.draft(idx, head_from=T, hidden_layers=[n], **kwargs)  # no full head: (B, 0, V) logits
        return F.linear(self.draft.norm(x), self.rows)  # (B, T, N)


def every_id(draft) -> "FrequentVocabDraft":
    """The plain draft as a FrequentVocabDraft of every id a language model generates (all but MASK):
    subset_draft_round then draws draft_round's tokens, from the same numbers (MASK, the last id, has
    probability 0 in both). The fused rounds of FR-Spec's draft (fused_round.py) so serve plain drafts
    too; the head's copy doubles the draft's embedding in memory."""
    return FrequentVocabDraft(draft, [i for i in range(draft.config.vocab_size) if i != MASK])


def subset_draft_round(draft, cache, seq, n_drafts, warp_args, generator=None):
    """speculative.draft_round for a FrequentVocabDraft: each q is warped and sampled over the N ids.

    The same tokens, from the same random numbers, as sampling the V-wide distribution that is zero
    outside the subset (its cumulative sum only steps at subset ids). Returns drafts (K,) as
    vocabulary ids and q (K, V), zero outside the subset.
    """
    device = draft.embed.weight.device
    x = torch.tensor([seq[cache.length:]], device=device)  # (1, 1 or 2), then (1, 1)
    drafts, qs = [], []
    for _ in range(n_drafts):
        q = warp(draft(x, cache=cache, causal=True)[0, -1], *warp_args)  # (N,)
        token = draft.ids[sample(q, generator)]  # ()
        drafts.append(token)
        qs.append(q)
        x = token.view(1, 1)
    V = draft.config.vocab_size
    if not drafts:  # the last round may have no room for drafts
        return torch.empty(0, dtype=torch.long, device=device), torch.empty(0, V, device=device)
    return torch.stack(drafts), in_vocab(torch.stack(qs), draft.ids, V)  # (K,), (K, V)


def in_vocab(small, ids, vocab_size: int):
    """Probabilities over the subset ids (N,), small (K, N), as (K, V): zero outside the subset."""
    return small.new_zeros(len(small), vocab_size).index_copy_(1, ids, small)
