"""Spec: fused_dflash.py's round (the block drafted, verified, judged and the drafter's context extended in
one graph) decides exactly what dflash_generate decides. `match_verdict` is dflash.match given the
numbers it draws, for any p, drafts and verified prefix, greedy included; `pick_drafts` picks what
extras/markov_head.py's markov_drafts picks (argmax, or sampled), with a Markov head too. The fused loop, run here
uncompiled (compile=False: the same functions, eagerly; tests/test_compiled.py runs it compiled), commits
dflash_generate's tokens from the same seeds under both rules at every warp, with the same counts and the
same cache rows after every round, full acceptances included (an oracle drafter), after a one-token
prompt and up to the context's end, stops where it stops, and refuses what it refuses. Being that
loop's tokens draw for draw, its samples follow the target's distribution as those do
(test_dflash_decode.py's chi-square tests). The models are float64: two paths differ by float64 rounding
only, far below any sampling boundary."""
from types import SimpleNamespace

import pytest
import torch
from dflash_models import dflash_with_rule as dflash_generate
from stats_helpers import (
    float64,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    random_drafter,
    random_model,
    recorded_with_caches,
)
from table_models import Oracle

from tinydiff.checks import UserError
from tinydiff.dflash import match
from tinydiff.extras.markov_head import MarkovHead, markov_drafts
from tinydiff.fast.fused_dflash import FusedDFlash, fused_dflash_generate, match_verdict, pick_drafts, target_picks
from tinydiff.model import ModelConfig
from tinydiff.sampling import next_token_probs
from tinydiff.tokenizer import MASK

PROMPT, NEW, B = [3, 1, 4, 1, 5], 20, 4
WARPS = [(0.0, None, None), (1.0, None, None), (0.8, 5, None), (1.3, None, 0.9)]


def fused(target, drafter):
    """FusedDFlash uncompiled: the graph's functions run eagerly."""
    return FusedDFlash(target, drafter, compile=False)


@pytest.fixture(scope="module")
def models():
    target = random_model(ModelConfig(vocab_size=64, context=40, n_layer=4, n_head=2, d_model=32, d_ff=64), seed=0)
    plain = random_drafter(target, seed=2, n_layer=1, block_size=B, n_features=1)
    markov = random_drafter(target, seed=3, n_layer=1, block_size=B, n_features=1, markov_rank=4)
    torch.nn.init.normal_(markov.markov.up.weight, 0, 0.5, generator=torch.Generator().manual_seed(4))
    # Drafts from the target itself (a hook on the drafter), wrong at every seventh position: full
    # acceptances at T = 0 and near them at T > 0, and rejections.
    knowing = random_drafter(target, seed=5, n_layer=1, block_size=B, n_features=1)
    target, plain, markov, knowing = float64(target, plain, markov, knowing)
    oracle = Oracle(knowing, target, wrong=lambda position: position % 7 == 0)
    return target, {"plain": (plain, None), "markov": (markov, None), "oracle": (knowing, oracle)}


def test_match_verdict_is_sample_and_match_with_the_numbers_it_draws():
    """With live = the first m slots, match_verdict on target_picks decides as sample_and_match on those m
    drafts and the m + 1 rows that read them, given sample_and_match's numbers (one per position it
    judges, the same stream as m + 1 drawn at once); greedy too, where no number is read."""
    g = torch.Generator().manual_seed(0)
    K, V, outcomes = B - 1, 8, set()
    for trial in range(600):
        m, greedy = trial % B, trial % 5 == 0
        logits = (0.5 + 3 * torch.rand((), generator=g)) * torch.randn(K + 1, V, generator=g, dtype=torch.float64)
        p = next_token_probs(logits, 0.0 if greedy else 1.0)  # (K + 1, V)
        # drafts near the target's likeliest ids: long runs of matches, full acceptances included
        guesses = torch.randint(0, V, (K,), generator=g)
        drafts = torch.where(torch.rand(K, generator=g) < 0.8, logits[:K].argmax(-1), guesses)
        state = g.get_state()
        n, token = match(p[:m + 1], drafts[:m], g, greedy)
        g.set_state(state)
        u = torch.cat([torch.rand(m + 1, 1, generator=g, dtype=torch.float64),
                       torch.zeros(K - m, 1, dtype=torch.float64)])
        y = target_picks(logits, (0.0 if greedy else 1.0, None, None), u)
        ours = match_verdict(y, drafts, torch.arange(K) < m)
        assert (int(ours[0]), int(ours[1])) == (n, token)
        outcomes.add((m, n))
    assert outcomes == {(m, n) for m in range(B) for n in range(m + 1)}  # every count, full acceptances included
    # A language model's vocabulary holds MASK, which the target never samples, greedy or not.
    logits = torch.randn(3, MASK + 1, generator=g, dtype=torch.float64)
    logits[:, MASK] = 50.0
    greedy = target_picks(logits, (0.0, None, None), None)
    assert torch.equal(greedy, next_token_probs(logits, 0.0).argmax(-1)) and MASK not in greedy.tolist()
    assert MASK not in target_picks(logits, (1.0, None, None), torch.rand(3, 1, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("rank", [0, 4])
def test_pick_drafts_picks_what_the_eager_draws_pick(rank):
    g = torch.Generator().manual_seed(1)
    K, V = 5, 16
    head = None
    if rank:
        torch.manual_seed(rank)
        head = MarkovHead(V, rank).double()
        torch.nn.init.normal_(head.up.weight, 0, 0.3)
    for trial in range(60):
        logits = torch.randn(K, V, generator=g, dtype=torch.float64)
        first = int(torch.randint(0, V, (), generator=g))
        warp = WARPS[trial % len(WARPS)]
        expected, _ = markov_drafts(SimpleNamespace(markov=head), logits, first, warp)
        ours, _ = pick_drafts(logits, torch.tensor([first]), None, (0.0, None, None), head)
        assert torch.equal(ours, expected)
        state = g.get_state()
        expected, q = markov_drafts(SimpleNamespace(markov=head), logits, first, warp, g, sampled=True)
        g.set_state(state)
        u = torch.rand(K, 1, generator=g, dtype=torch.float64)
        ours, ours_q = pick_drafts(logits, torch.tensor([first]), u, warp, head)
        assert torch.equal(ours, expected) and torch.equal(ours_q, q)
        # No row was one-hot at T > 0, where sampling.sample would have spent no number (the module's exception).
        assert warp[0] == 0 or (q.max(-1).values < 1).all()


@pytest.mark.parametrize("rule", ["match", "reject"])
@pytest.mark.parametrize("drafter", ["plain", "markov", "oracle"])
def test_the_fused_round_commits_dflash_generates_tokens_counts_and_caches(models, drafter, rule):
    target, drafters = models
    drafter, oracle = drafters[drafter]
    full = set()
    for warp in WARPS:
        for seed in range(2):
            common = {"generator": torch.Generator().manual_seed(seed), "stop_token": None, "rule": rule,
                      "oracle": oracle, "prompt": PROMPT}
            ours, ours_result, ours_rounds = recorded_with_caches(fused_dflash_generate, fused(target, drafter),
                                                                  PROMPT, NEW, *warp, **common)
            common["generator"] = torch.Generator().manual_seed(seed)
            theirs, result, rounds = recorded_with_caches(dflash_generate, target, drafter, PROMPT, NEW, None, *warp,
                                                          **common)
            assert ours == theirs and len(ours) == NEW
            assert ours_result.accepted == result.accepted and ours_result.slot_kept == result.slot_kept
            assert ours_result.forwards == result.forwards and ours_result.draft_forwards == result.draft_forwards
            assert ours_result.draft_seconds is None  # a fused round has no stages to clock
            assert 0 < ours_result.graph_seconds < ours_result.seconds  # its graphs' calls, inside the timed loop
            for (drafts, n, tokens, caches), (their_drafts, m, their_tokens, reference) in zip(ours_rounds, rounds,
                                                                                                strict=True):
                assert (drafts, n, tokens) == (their_drafts, m, their_tokens)
                for (length, rows), (reference_length, reference_rows) in zip(caches, reference):
                    assert length == reference_length
                    for a, b in zip(rows, reference_rows):
                        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
            full |= {n for drafts, n, _, _ in ours_rounds if n == len(drafts) == B - 1}
    assert full or oracle is None  # with the oracle, some rounds kept every draft


def test_the_fused_loop_stops_and_reaches_the_context_where_the_eager_loop_does(models, monkeypatch):
    """A stop token (tokens past it in its round dropped), a one-token prompt (no prefill), and stories
    that fill the context, whose last rounds have no room for the graph's B rows and run the eager pieces."""
    target, drafters = models
    drafter, _ = drafters["markov"]
    ours = fused(target, drafter)
    graph_rounds, run_round = [], ours.run_round
    monkeypatch.setattr(ours, "run_round", lambda *a: graph_rounds.append(1) or run_round(*a))
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    story = dflash_generate(target, drafter, PROMPT, NEW, None, 1.0, generator=g(), stop_token=None)[0]
    stop = story[NEW // 2]
    stopped = fused_dflash_generate(ours, PROMPT, NEW, 1.0, generator=g(), stop_token=stop)[0]
    assert stopped == dflash_generate(target, drafter, PROMPT, NEW, None, 1.0, generator=g(), stop_token=stop)[0] \
        == story[:story.index(stop) + 1]
    eager_rounds = 0
    for prompt, new in (([7], NEW), (PROMPT, target.config.context - len(PROMPT))):
        for rule in ("match", "reject"):
            graph_rounds.clear()
            out, result = fused_dflash_generate(ours, prompt, new, 1.0, generator=g(), stop_token=None, rule=rule)
            theirs, their_result = dflash_generate(target, drafter, prompt, new, None, 1.0, generator=g(),
                                                   stop_token=None, rule=rule)
            assert out == theirs and len(out) == new and result.accepted == their_result.accepted
            eager_rounds += result.rounds - len(graph_rounds)
    assert eager_rounds > 0  # the context's end was reached inside a round


def test_bad_input_is_a_one_line_error(models):
    target, drafters = models
    drafter, _ = drafters["plain"]
    ours = fused(target, drafter)
    for prompt, n, kwargs, message in (([], 4, {}, "empty"), (PROMPT, 4, {"temperature": -1.0}, "temperature"),
                                       (PROMPT, 1000, {}, "max new tokens"), ([1, MASK], 4, {}, "MASK"),
                                       (PROMPT, 4, {"rule": "accept"}, "rule must be one of")):
        with pytest.raises(UserError, match=message):
            fused_dflash_generate(ours, prompt, n, **kwargs)
    with pytest.raises(UserError, match="block size"):
        FusedDFlash(target, drafter, B + 1, False)
