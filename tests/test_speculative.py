"""Spec: speculative sampling is lossless and honestly counted.

Greedy output equals the target's own greedy decoding token for token; sampled output follows the
target's exact joint distribution (chi-square against an enumeration); the residual completes p;
tau and the acceptance histogram add up; both KV caches equal a recomputation after every round;
bad input is a clear error.
"""
import copy
import itertools
import math
from typing import Callable, NamedTuple

import pytest
import torch
from stats_helpers import (  # noqa: F401 (fixtures; one_thread is autouse)
    DIST_CONFIG,
    NEW,
    PROMPT,
    V,
    assert_acceptance,
    assert_follows_the_joint,
    assert_same,
    exact_joint,
    greedy_models,
    one_hot,
    one_thread,
    perturbed,
    random_model,
    recorder,
)
from table_models import TableModel, TokenCache

from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.fast.frequent_vocab import FrequentVocabDraft, subset_draft_round
from tinydiff.model import ModelConfig, Transformer
from tinydiff.sampling import residual, warp
from tinydiff.speculative import draft_round, expected_tokens_per_round, leviathan_speedup, speculative_generate
from tinydiff.tokenizer import MASK


def check_counts(out, stats, rounds, k):
    """The stats agree with each other and with what every round reported."""
    assert len(stats.accepted) == k + 1 and sum(stats.accepted) == stats.rounds == len(rounds)
    assert stats.forwards == stats.rounds and stats.new_tokens == len(out)
    assert sum(len(r["tokens"]) for r in rounds) == len(out)
    assert [t for r in rounds for t in r["tokens"]] == out
    assert stats.proposed == stats.draft_forwards == sum(len(r["drafts"]) for r in rounds)
    accepted = sum(r["accepted"] for r in rounds)
    assert accepted == sum(n * c for n, c in enumerate(stats.accepted))
    assert_acceptance(stats, rounds, accepted)
    assert stats.tau == len(out) / stats.forwards
    assert 0 < stats.draft_seconds + stats.verify_seconds <= stats.seconds  # both inside the timed loop
    assert all(1 <= len(r["tokens"]) <= r["accepted"] + 1 <= len(r["drafts"]) + 1 <= k + 1 for r in rounds)


# Greedy: lossless means token for token. Target and drafts (greedy_models, from stats_helpers) use
# GPT-2's full vocabulary (and MASK), in float64.
@torch.no_grad()
def test_greedy_output_equals_the_targets_greedy_decoding(greedy_models):
    target, drafts = greedy_models
    seen = {"partial": 0, "dropped_after_stop": 0}
    for seed in range(4):
        prompt = torch.randint(0, 50257, (2 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        full, _ = ar_generate(target, prompt, 20, temperature=0, stop_token=None)
        stop = full[11]  # a token greedy decoding emits mid-way: the run ends there
        greedy = {stop_token: ar_generate(target, prompt, 20, temperature=0, stop_token=stop_token)[0]
                  for stop_token in (None, stop)}
        for k, (name, draft), stop_token in itertools.product((1, 2, 4, 8), drafts.items(), (None, stop)):
            expected = greedy[stop_token]
            rounds, on_round = recorder()
            out, stats = speculative_generate(target, draft, prompt, 20, k, temperature=0,
                                              stop_token=stop_token, on_round=on_round)
            assert out == expected, (seed, k, name, stop_token)
            check_counts(out, stats, rounds, k)
            seen["partial"] += sum(0 < r["accepted"] < len(r["drafts"]) for r in rounds)
            seen["dropped_after_stop"] += len(rounds[-1]["tokens"]) < rounds[-1]["accepted"] + 1
    # The cases above must include partial acceptances and a stop inside a round, or prove nothing.
    assert seen["partial"] > 0 and seen["dropped_after_stop"] > 0


@torch.no_grad()
def test_draft_equal_to_target_accepts_every_draft(greedy_models):
    target, _ = greedy_models
    prompt = [11, 22, 33]
    for k in (1, 2, 4, 8):
        n = 3 * (k + 1)  # three full rounds
        rounds, on_round = recorder()
        out, stats = speculative_generate(target, target, prompt, n, k, temperature=0, stop_token=None,
                                          on_round=on_round)
        assert out == ar_generate(target, prompt, n, temperature=0, stop_token=None)[0]
        assert stats.accepted == [0] * k + [3] and stats.tau == k + 1 and stats.alpha == 1
        assert all(len(r["tokens"]) == k + 1 for r in rounds)
        check_counts(out, stats, rounds, k)


@torch.no_grad()
def test_always_wrong_draft_commits_one_token_per_round(greedy_models):
    target, drafts = greedy_models
    prompt = [5, 6, 7, 8]
    expected, _ = ar_generate(target, prompt, 20, temperature=0, stop_token=None)
    wrong = next(t for t in range(100) if t not in expected)  # a token the target never picks here
    draft = copy.deepcopy(drafts["close"])
    draft.register_forward_hook(lambda module, inputs, logits: logits.index_fill_(-1, torch.tensor([wrong]), 1e4))
    for k in (1, 4):
        rounds, on_round = recorder()
        out, stats = speculative_generate(target, draft, prompt, 20, k, temperature=0, stop_token=None,
                                          on_round=on_round)
        assert out == expected
        assert stats.tau == 1 and stats.alpha == 0 and stats.accepted[0] == stats.rounds == 20
        assert all(set(r["drafts"]) <= {wrong} for r in rounds)
        check_counts(out, stats, rounds, k)


@torch.no_grad()
def test_never_overshoots_and_never_returns_mask(greedy_models):
    target, drafts = greedy_models
    for n in (1, 2, 3, 5, 9):
        rounds, on_round = recorder()
        out, stats = speculative_generate(target, target, [1, 2], n, 4, temperature=0, stop_token=None,
                                          on_round=on_round)
        assert len(out) == n
        done = 0
        for r in rounds:  # a full acceptance plus the bonus never passes n
            assert len(r["drafts"]) == min(4, n - done - 1)
            done += len(r["tokens"])
    out, _ = speculative_generate(target, drafts["small"], [1, 2], None, 8, temperature=0, stop_token=None)
    assert len(out) == target.config.context - 2  # None: fill the context

    def favour_mask(module, inputs, logits):  # MASK now dominates every logit either model returns
        logits[..., MASK] += 100.0
    target, draft = copy.deepcopy(target), copy.deepcopy(drafts["close"])
    for model in (target, draft):
        model.register_forward_hook(favour_mask)
    for temperature in (0, 1.0):
        out, _ = speculative_generate(target, draft, [1, 2], 20, 4, temperature=temperature, stop_token=None,
                                      generator=torch.Generator().manual_seed(0))
        assert MASK not in out


@torch.no_grad()
def test_caches_equal_a_recomputation_after_every_round(greedy_models):
    """Target cache: every committed token but the newest. Draft cache: the same, one shorter after
    a full acceptance (it never read its last draft), unchanged by a round without drafts. Each equals
    a recomputation to float64 rounding."""
    target, drafts = greedy_models
    checked = {"full": 0, "partial": 0}

    def check_cache(model, cache, seq):
        fresh = model.new_cache(1)
        model(torch.tensor([seq[:cache.length]]), cache=fresh, causal=True)
        for layer in range(model.config.n_layer):
            for ours, theirs in ((cache.k, fresh.k), (cache.v, fresh.v)):
                assert_same(ours[layer][:, :, :cache.length], theirs[layer][:, :, :cache.length])

    for seed, k, stop in itertools.product(range(3), (2, 4), (None, "mid")):
        prompt = torch.randint(0, 50257, (3,), generator=torch.Generator().manual_seed(seed)).tolist()
        draft_length = 0

        def on_round(info):
            nonlocal draft_length
            seq, n_drafts = info["seq"], len(info["drafts"])
            assert info["target_cache"].length == len(seq) - 1
            full = n_drafts > 0 and info["accepted"] == n_drafts and len(info["tokens"]) == n_drafts + 1
            if n_drafts:
                draft_length = len(seq) - 2 if full else len(seq) - 1
            assert info["draft_cache"].length == draft_length
            check_cache(target, info["target_cache"], seq)
            check_cache(draft, info["draft_cache"], seq)
            checked["full" if full else "partial"] += 1

        draft = drafts["close"]
        generator = torch.Generator().manual_seed(seed)
        stop_token = None
        if stop == "mid":
            stop_token = speculative_generate(target, draft, prompt, 16, k, generator=generator, stop_token=None)[0][7]
            generator.manual_seed(seed)
        speculative_generate(target, draft, prompt, 16, k, temperature=1.0, generator=generator,
                             stop_token=stop_token, on_round=on_round)
    assert checked["full"] > 0 and checked["partial"] > 0


def test_bad_input_is_a_clear_error(greedy_models):
    target, drafts = greedy_models
    other_vocab = Transformer(ModelConfig(vocab_size=1000, context=32, n_layer=1, n_head=2, d_model=16, d_ff=32))
    with pytest.raises(UserError, match="vocabulary"):
        speculative_generate(target, other_vocab, [1, 2], 5, 2)
    short = Transformer(ModelConfig(context=8, n_layer=1, n_head=2, d_model=16, d_ff=32))
    with pytest.raises(UserError, match="draft's context"):
        speculative_generate(target, short, [1, 2], 10, 2)
    for k in (0, -1, 2.5):
        with pytest.raises(UserError, match="k "):
            speculative_generate(target, drafts["small"], [1, 2], 5, k)
    with pytest.raises(UserError, match="empty"):
        speculative_generate(target, drafts["small"], [], 5, 2)
    with pytest.raises(UserError, match="context is 32"):
        speculative_generate(target, drafts["small"], list(range(32)), 5, 2)
    with pytest.raises(UserError, match="temperature"):
        speculative_generate(target, drafts["small"], [1, 2], 5, 2, temperature=-1)


def test_residual_completes_p():
    """Accepting x ~ q with probability min(1, p(x)/q(x)) gives y with probability min(p(y), q(y));
    the rejected mass times the residual must supply exactly the rest of p (in float64: to its rounding)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, 10, generator=g, dtype=torch.float64) * 3  # (pairs, rows, V)
    cases = [(warp(logits[0]), warp(logits[1])),
             (warp(logits[0], top_k=3), warp(logits[1])),             # p is zero where q is not
             (warp(logits[2]), warp(logits[3], top_k=2)),             # q is zero where p is not
             (warp(logits[2], 0), warp(logits[3], 0)),                # greedy: both one-hot
             (warp(logits[0], top_p=0.5), warp(logits[0], top_p=0.9))]
    for p, q in cases:
        r = residual(p, q)  # (rows, V)
        assert (r >= 0).all()
        assert r.dtype == torch.float64  # warp and residual keep float64
        torch.testing.assert_close(r.sum(-1), torch.ones(len(r), dtype=torch.float64), atol=5e-14, rtol=0)
        accepted = torch.minimum(p, q)  # q(y) * min(1, p(y)/q(y))
        rejected = 1 - accepted.sum(-1, keepdim=True)
        torch.testing.assert_close(accepted + rejected * r, p, atol=5e-14, rtol=0)


def test_residual_where_p_equals_q_is_p():
    p = warp(torch.randn(3, 7))
    assert torch.equal(residual(p, p), p)


def test_leviathan_formulas():
    for k in (1, 2, 4, 8):
        for alpha in (0.0, 0.3, 0.8, 0.999):
            series = sum(alpha ** i for i in range(k + 1))  # draft i+1 is reached with probability alpha^i
            assert math.isclose(expected_tokens_per_round(alpha, k), series)
            assert math.isclose(leviathan_speedup(alpha, k, 0.25), series / (0.25 * k + 1))
        assert expected_tokens_per_round(1.0, k) == k + 1 and leviathan_speedup(1.0, k, 0) == k + 1
    with pytest.raises(UserError):
        expected_tokens_per_round(1.5, 2)
    with pytest.raises(UserError):
        leviathan_speedup(0.5, 2, -1)


class Constant(torch.nn.Module):
    """The same next-token distribution after every prefix: drafts are then accepted independently,
    each with probability sum(min(p, q)), exactly the model behind Leviathan's formula."""

    def __init__(self, probs):
        super().__init__()
        self.config, self.embed = ModelConfig(context=2048), torch.nn.Embedding(1, 1)
        self.logits = torch.full((self.config.vocab_size,), float("-inf"))
        self.logits[:len(probs)] = torch.tensor(probs).log()

    def new_cache(self, batch_size=1):
        return TokenCache()

    def forward(self, x, cache, causal=True):
        cache.tokens += x[0].tolist()
        cache.length = len(cache.tokens)
        return self.logits.expand(1, x.shape[1], -1)


def test_alpha_estimates_the_per_draft_acceptance_probability():
    """With independent acceptances at beta = 0.6, alpha (accepted / judged) lands within 4 standard
    errors of beta at k = 8, and tau of Leviathan's (1 - beta^9) / (1 - beta); accepted / proposed
    (drafts after a rejection counted as rejected) would be about 0.18."""
    target, draft = Constant([0.7, 0.1, 0.1, 0.1]), Constant([0.3, 0.5, 0.1, 0.1])
    beta, k = 0.6, 8
    _, stats = speculative_generate(target, draft, [0], 1500, k, temperature=1.0,
                                    generator=torch.Generator().manual_seed(0), stop_token=None)
    judged = sum(n * c for n, c in enumerate(stats.accepted)) + stats.rejected
    assert abs(stats.alpha - beta) < 4 * math.sqrt(beta * (1 - beta) / judged)
    per_round = [n + 1 for n, c in enumerate(stats.accepted) for _ in range(c)]
    spread = torch.tensor(per_round, dtype=torch.float64).std().item() / math.sqrt(len(per_round))
    assert abs(stats.tau - expected_tokens_per_round(beta, k)) < 4 * spread


# Distribution: at temperature > 0 the committed tokens must follow the target's joint exactly.
class Case(NamedTuple):
    draft: Callable              # builds the draft from the target
    k: int                       # drafts per round (NEW - 1 = 2 at most are ever proposed)
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    samples: int = 8_000         # seeded generations: enough for POWER on this case's target
    table: bool = True           # TableModel lookups (fast) or the Transformers' real KV caches
    propose: Callable = draft_round  # the draft step


def random_draft(target):
    return random_model(DIST_CONFIG, seed=1)


def good_draft(target):
    return perturbed(target, seed=3, noise=0.1)


CASES = {
    "good draft": Case(good_draft, k=2),
    "random draft": Case(random_draft, k=1),
    "one-hot draft": Case(lambda target: one_hot(good_draft(target)), k=2),
    "temperature 0.7": Case(random_draft, k=3, temperature=0.7, samples=10_000),
    "top-k 3, top-p 0.9": Case(random_draft, k=2, top_k=3, top_p=0.9, samples=12_000),
    # FR-Spec's draft: ids 3 and 5 are never drafted, so they reach the output only through the residual.
    "frequent-vocab draft": Case(lambda target: FrequentVocabDraft(good_draft(target), [0, 1, 2, 4]), k=2,
                                 propose=subset_draft_round),
    # End to end through the real KV caches: a flatter target (T 1.5) needs fewer samples.
    "real caches": Case(random_draft, k=2, temperature=1.5, samples=6_000, table=False),
}


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_sampled_tokens_follow_the_exact_target_distribution(case):
    """Chi-square goodness of fit of seeded generations against the enumerated joint.

    Significance 1e-3: a correct implementation fails with probability 1e-3 per case should the
    seed, the models or torch's random streams change (the test is deterministic otherwise).
    Power: let one continuation's probability be off by DELTA (2 percentage points) and the others
    absorb it in proportion (the least detectable way, by Cauchy-Schwarz). The bin of mass P
    holding it is then off by DELTA (1 - P) / (1 - p_cell), so the statistic is noncentral
    chi-square with lam >= N DELTA^2 (1 - P) / P, smallest for the heaviest bin. Here the heaviest
    bins weigh 0.04-0.09 and there are 23-41 bins, so 6,000-12,000 samples catch such an error
    with probability 0.93-0.98 (per case: good, random, one-hot 0.98; temperature 0.7 0.93;
    top-k/top-p 0.96; real caches 0.94; frequent-vocab draft 0.98). The power is computed from the exact joint and asserted,
    so a change that weakens the test fails loudly instead of passing silently. (Rare
    continuations share bins, so mass moved only among the members of one bin goes unseen.)
    """
    make_draft, k, temperature, top_k, top_p, n, table, propose = CASES[case]
    target = random_model(DIST_CONFIG, seed=0)
    draft = make_draft(target)
    probs = exact_joint(target, temperature, top_k, top_p)  # (V^NEW,)
    if table:
        target, draft = TableModel(target), TableModel(draft)
    counts = torch.zeros(V ** NEW, dtype=torch.long)
    generator = torch.Generator().manual_seed(1234)
    for _ in range(n):
        out, _ = speculative_generate(target, draft, PROMPT, NEW, k, temperature, top_k, top_p,
                                      generator=generator, stop_token=None, propose=propose)
        counts[sum(t * V ** (NEW - 1 - i) for i, t in enumerate(out))] += 1
    assert_follows_the_joint(probs, counts, n)
