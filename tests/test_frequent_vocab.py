"""Spec: FR-Spec's frequency-ranked draft vocabulary (tinydiff/frequent_vocab.py). The subset is the n
most frequent ids (ties to the lower id, EOT always in); the pruned draft's logits are the draft's own
at the subset and -inf elsewhere, through its KV cache too (float64, both paths); speculative decoding
with it is still the target's greedy decoding token for token, including tokens the draft can never
propose (its chi-square case is in test_speculative.py); bad input is a one-line error."""
import pytest
import torch
from stats_helpers import greedy_models, one_thread  # noqa: F401 (fixtures; one_thread is autouse)

from tinydiff.ar import ar_generate
from tinydiff.errors import UserError
from tinydiff.frequent_vocab import FrequentVocabDraft, frequent_ids
from tinydiff.speculative import speculative_generate
from tinydiff.tokenizer import EOT


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
def test_pruned_logits_are_the_drafts_own_at_the_subset_and_minus_inf_elsewhere(greedy_models):
    _, drafts = greedy_models
    draft = drafts["small"]  # float64: two products of different widths, equal to float64 rounding
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(draft.config.vocab_size, generator=g)[:300]
    pruned = FrequentVocabDraft(draft, ids)
    outside = torch.ones(draft.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    x = torch.randint(0, 50257, (2, 9), generator=g)
    full, small = draft(x, causal=True), pruned(x, causal=True)
    assert small.shape == full.shape and torch.isneginf(small[..., outside]).all()
    torch.testing.assert_close(small[..., ids], full[..., ids], rtol=1e-12, atol=1e-12)
    cache, pruned_cache = draft.new_cache(1), pruned.new_cache(1)  # through the KV cache, step by step
    for t in range(x.shape[1]):
        step, pruned_step = draft(x[:1, t:t + 1], cache=cache, causal=True), pruned(x[:1, t:t + 1], cache=pruned_cache)
        torch.testing.assert_close(pruned_step[..., ids], step[..., ids], rtol=1e-12, atol=1e-12)
    assert pruned_cache.length == cache.length == x.shape[1]


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
                                      on_round=rounds.append)
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
