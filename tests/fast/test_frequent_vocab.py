"""Spec: FR-Spec's frequency-ranked draft vocabulary (tinydiff/fast/frequent_vocab.py). The subset is the n
most frequent ids (ties to the lower id, EOT always in); the pruned draft's logits are the draft's own
at the subset, through its KV cache too (float64, both paths); drafting in the subset gives the tokens
and the q of drafting from the V-wide distribution that is zero outside it, from the same random
numbers; speculative decoding with it is still the target's greedy decoding token for token,
including tokens the draft can never propose (its chi-square case is in test_speculative.py); bad
input is a one-line error."""
import pytest
import torch
from stats_helpers import greedy_models, one_thread  # noqa: F401 (fixtures; one_thread is autouse)

from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.fast.frequent_vocab import FrequentVocabDraft, frequent_ids, subset_draft_round
from tinydiff.speculative import draft_round, speculative_generate
from tinydiff.tokenizer import EOT, MASK


def test_frequent_ids_are_the_most_frequent_with_ties_to_the_lower_id_and_eot_always_in():
    tokens = torch.tensor([7, 7, 7, 3, 3, 9, 9, 1, 0, 0, 0, 0])
    assert frequent_ids(tokens, 4, always=()).tolist() == [0, 3, 7, 9]  # 0: 4, 7: 3, then 3 and 9 tie at 2
    assert frequent_ids(tokens, 3, always=()).tolist() == [0, 3, 7]  # the tie goes to 3
    assert frequent_ids(tokens, 3).tolist() == [0, 7, EOT]  # EOT first, though the text never holds it
    assert frequent_ids(torch.tensor([EOT, 5]), 2).tolist() == [5, EOT]
    for n in (0, 1, 2.0, True):
        with pytest.raises(UserError, match="draft vocabulary"):
            frequent_ids(tokens, n)
    with pytest.raises(UserError, match="only ids below"):
        frequent_ids(tokens, 11, always=())


@torch.no_grad()
def test_pruned_logits_are_the_drafts_own_at_the_subset(greedy_models):
    _, drafts = greedy_models
    draft = drafts["small"]  # float64: two products of different widths, equal to float64 rounding
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(draft.config.vocab_size - 1, generator=g)[:300]  # MASK (the last id) is never one
    pruned = FrequentVocabDraft(draft, ids)
    x = torch.randint(0, 50257, (2, 9), generator=g)
    full, small = draft(x, causal=True), pruned(x, causal=True)
    assert small.shape == (2, 9, 300)
    torch.testing.assert_close(small, full[..., ids], rtol=1e-12, atol=1e-12)
    cache, pruned_cache = draft.new_cache(1), pruned.new_cache(1)  # through the KV cache, step by step
    for t in range(x.shape[1]):
        step, pruned_step = draft(x[:1, t:t + 1], cache=cache, causal=True), pruned(x[:1, t:t + 1], cache=pruned_cache)
        torch.testing.assert_close(pruned_step, step[..., ids], rtol=1e-12, atol=1e-12)
    assert pruned_cache.length == cache.length == x.shape[1]


class MaskedOutside(torch.nn.Module):
    """The reference for drafting in the subset: the draft's full V-wide logits, -inf outside `ids`."""

    def __init__(self, draft, ids):
        super().__init__()
        self.draft, self.config, self.embed = draft, draft.config, draft.embed
        self.outside = torch.ones(draft.config.vocab_size, dtype=torch.bool)
        self.outside[ids] = False

    def new_cache(self, batch_size=1):
        return self.draft.new_cache(batch_size)

    def forward(self, idx, **kwargs):
        return self.draft(idx, **kwargs).masked_fill(self.outside, float("-inf"))


@pytest.mark.parametrize("warp_args", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.0, None, None)])
@torch.no_grad()
def test_drafting_in_the_subset_draws_what_the_v_wide_distribution_draws(greedy_models, warp_args):
    _, drafts = greedy_models
    draft = drafts["close"]
    ids = torch.arange(0, 50257, 61)  # 824 ids; the draft prefers few of them, so top-k and top-p cut
    seq = [EOT, 464, 3290]
    for seed in range(20):
        (ours, q), (theirs, reference) = [
            propose(model, model.new_cache(1), seq, 4, warp_args, torch.Generator().manual_seed(seed))
            for propose, model in ((subset_draft_round, FrequentVocabDraft(draft, ids)),
                                   (draft_round, MaskedOutside(draft, ids)))]
        assert ours.tolist() == theirs.tolist() and set(ours.tolist()) <= set(ids.tolist())
        torch.testing.assert_close(q, reference, rtol=1e-12, atol=1e-15)  # zero outside the subset, both


@torch.no_grad()
def test_speculative_decoding_with_a_pruned_draft_is_the_targets_greedy_decoding(greedy_models):
    """The subset holds half of the target's greedy tokens, so some rounds accept drafts and some
    commit a token the draft could never propose."""
    target, drafts = greedy_models
    prompt = [EOT, 464, 3290]
    greedy, _ = ar_generate(target, prompt, 24, temperature=0, stop_token=None)
    unseen = sorted(set(greedy))[::2]
    ids = torch.tensor(sorted((set(range(0, 50257, 97)) | set(greedy)) - set(unseen)))
    pruned = FrequentVocabDraft(drafts["close"], ids)
    for k in (1, 4):
        rounds = []
        out, _ = speculative_generate(target, pruned, prompt, 24, k, temperature=0, stop_token=None,
                                      on_round=rounds.append, propose=subset_draft_round)
        assert out == greedy, k
        drafted = {t for r in rounds for t in r["drafts"]}
        assert drafted <= set(ids.tolist()) and not drafted & set(unseen)  # the subset alone is ever drafted
        assert sum(r["accepted"] for r in rounds) > 0  # and some drafts were kept


def test_a_bad_subset_is_a_clear_error(greedy_models):
    _, drafts = greedy_models
    V = drafts["small"].config.vocab_size
    for ids in ([], [0, 0, 1], [-1, 2], [V], [[1, 2]]):
        with pytest.raises(UserError, match="distinct ids"):
            FrequentVocabDraft(drafts["small"], ids)
    with pytest.raises(UserError, match="must not hold MASK"):
        FrequentVocabDraft(drafts["small"], [0, MASK])
