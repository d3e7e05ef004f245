"""A whole drafting round as one compiled graph: FR-Spec's pruned draft, k forwards, warps and draws.

Compiling each draft forward alone (compiled.compiled) leaves a round's host work in Python: per
draft, the call into the compiled step (guards, wrappers), the warp, the inverse-CDF draw and the
bookkeeping around them. On a CPU that host work costs as much as the pruned draft's forward itself.
`draft_chain` is frequent_vocab.subset_draft_round unrolled: the k forwards of the round, each
followed by its warp and its draw, the next forward reading the token just drawn. Its random
numbers are drawn before the graph runs, one float64 uniform per draft in one call, which gives the
very numbers `sampling.sample` draws one at a time; so the round commits the eager round's tokens.
(One exception: `sample` spends no number on a distribution that is exactly one-hot, which a
tempered float32 softmax can be; the chain always spends k. Both stay exact draws from q.)
At temperature 0 the draw is the argmax and no number is spent, as in `sample`.

Leaves out: the target's verify (its forward is compiled.compiled's; its rule stays eager here,
fused_round.py puts both in the round's graph), and batches. A plain draft runs here as the subset of
every id (frequent_vocab.every_id).
"""
import torch

from tinydiff.checks import UserError
from tinydiff.fast.compiled import Compiled, compiled, forward_at
from tinydiff.fast.frequent_vocab import FrequentVocabDraft, in_vocab, subset_draft_round
from tinydiff.sampling import inverse_cdf, warp


def draft_chain(model, head, ids, cache, idx, rows, u, n_drafts: int, warp_args):
    """subset_draft_round's n_drafts forwards after idx (1, T0) at rows (T0,), in one graph.

    model: the draft Transformer, head (N, D) its pruned head rows, ids (N,) their vocabulary ids;
    u (n_drafts, 1) float64 uniforms (unread at temperature 0). Returns drafts (K,), their places in
    the subset (K,) and the draft's probabilities over the subset (K, N) (`in_vocab` widens them to
    the vocabulary). The cache rows are the positions: the chain reads T0 + K - 1 tokens.
    """
    greedy = warp_args[0] == 0
    drafts, picks, qs = [], [], []
    for j in range(n_drafts):
        logits, _ = forward_at(model, cache, idx, rows, rows, head=head)  # (1, T, N)
        q = warp(logits[0, -1], *warp_args)  # (N,)
        if greedy:
            pick = q.argmax().view(1)  # (1,)
        else:  # sampling.sample's inverse CDF, with the uniform it would draw
            pick = inverse_cdf(q[None], u[j:j + 1])  # (1,)
        token = ids.index_select(0, pick)  # (1,): a tensor index, never a host integer
        drafts.append(token)
        picks.append(pick)
        qs.append(q)
        idx, rows = token.view(1, 1), rows[-1:] + 1  # (1, 1), (1,)
    return torch.cat(drafts), torch.cat(picks), torch.stack(qs)  # (K,), (K,), (K, N)


def drafting_round(model, head, ids, *args):
    """draft_chain with the draft's probabilities over the whole vocabulary: the drafts (K,) and q (K, V)
    that speculative.verify reads."""
    drafts, _, small = draft_chain(model, head, ids, *args)
    return drafts, in_vocab(small, ids, model.config.vocab_size)


class StaticSubsetDraft(FrequentVocabDraft):
    """A FrequentVocabDraft whose rounds of k drafts run as one compiled draft_chain (one graph for each
    count of catch-up tokens, 1 or 2), its own forward compiled for the token counts in `hot` (a prefill
    chunk too, for fused_round.py). `propose` is the round, a drop-in for subset_draft_round in
    speculative_generate; a round of another length runs that eager round."""

    def __init__(self, draft: FrequentVocabDraft, k: int, compile=True, hot=(1, 2)):
        if not isinstance(draft, FrequentVocabDraft):
            raise UserError("a compiled drafting round needs FR-Spec's pruned draft (FrequentVocabDraft)")
        super().__init__(compiled(draft.draft, hot, compile), draft.ids)
        self.rows = draft.rows  # the head's rows: the pruned draft's own buffer, not a second copy
        self.module, self.k = draft, k
        self.chain = Compiled(lambda *a: drafting_round(draft.draft, draft.rows, draft.ids, *a),
                              draft.embed.weight.device, (1, 2), compile)

    @property
    def compile_seconds(self) -> float:
        return self.draft.compiled_step.compile_seconds + self.chain.compile_seconds

    def propose(self, draft, cache, seq, n_drafts, warp_args, generator=None):
        """subset_draft_round's arguments and returns; `draft` is this model."""
        if n_drafts != self.k:
            return subset_draft_round(self, cache, seq, n_drafts, warp_args, generator)
        device = self.embed.weight.device
        T0 = len(seq) - cache.length  # 1, or 2 after a full acceptance
        idx = torch.tensor([seq[cache.length:]], device=device)  # (1, T0)
        rows = torch.arange(cache.length, len(seq), device=device)  # (T0,)
        if warp_args[0] == 0:  # greedy: no random number is spent
            u = torch.zeros(n_drafts, 1, dtype=torch.float64, device=device)
        else:
            u = torch.rand(n_drafts, 1, generator=generator, device=device, dtype=torch.float64)
        out = self.chain(T0, (T0, tuple(warp_args)), cache, idx, rows, u, n_drafts, tuple(warp_args))
        cache.advance(T0 + n_drafts - 1)
        return out
