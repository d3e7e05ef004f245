"""Spec: speculative speculative decoding is speculative decoding whose next speculation may come
from a cache the draft filled during verification, and nothing about the output changes.

A hit hands over exactly what drafting after the true outcome would give (temperature 0); the
output is the target's greedy decoding token for token, or its exact joint distribution
(chi-square); a fan-out that covers the vocabulary always hits; threaded and sequential runs agree
draw for draw; the modelled times follow from the counted forwards; bad input is a clear error.
"""
import itertools
import math
from typing import Callable, NamedTuple

import pytest
import torch
from stats_helpers import (  # noqa: F401 (fixtures; one_thread is autouse)
    DELTA,
    Z_ALPHA,
    assert_acceptance,
    assert_follows_the_joint,
    chi2_quantile,
    exact_joint,
    greedy_models,
    noncentral_chi2_sf,
    one_hot,
    one_thread,
    perturbed,
    random_model,
    recorder,
)
from table_models import TableModel

from tinydiff.ar import ar_generate
from tinydiff.bench.methods import forward_seconds, modelled_seconds
from tinydiff.checks import UserError
from tinydiff.model import ModelConfig
from tinydiff.sampling import sample, warp
from tinydiff.speculative import draft_round
from tinydiff.ssd import geometric_fan_out, ssd_generate


def check_counts(out, stats, rounds, k, full_context=False):
    """The stats agree with each other and with what every round reported, and every lookup was
    answered by the cache exactly when the round's outcome was among the keys it stored (only if,
    when the run fills the context: the last run-aheads then have no room for whole speculations)."""
    assert len(stats.accepted) == k + 1 and sum(stats.accepted) == stats.rounds == len(rounds)
    assert stats.forwards == stats.rounds and stats.new_tokens == len(out)
    assert [t for r in rounds for t in r["tokens"]] == out
    assert stats.proposed == sum(len(r["drafts"]) for r in rounds)
    assert stats.jit_forwards == sum(r["jit_forwards"] for r in rounds)
    assert stats.ahead_forwards == sum(r["ahead_forwards"] for r in rounds)
    assert stats.draft_forwards == stats.jit_forwards + stats.ahead_forwards
    assert stats.branches == sum(len(r["keys"]) for r in rounds)
    assert rounds[0]["cached"] is None
    hits, lookups = [0] * (k + 1), [0] * (k + 1)
    for r in rounds:  # drafting just in time happens exactly when the speculation was not cached
        assert r["jit_forwards"] == (0 if r["cached"] else len(r["drafts"]))
        assert r["ahead_forwards"] <= 1 + k  # catch-up, then one batched forward per next-round draft
    for r, nxt in zip(rounds, rounds[1:]):
        if nxt["cached"] is not None:
            lookups[r["accepted"]] += 1
            hits[r["accepted"]] += nxt["cached"]
            stored = (r["accepted"], r["tokens"][-1]) in r["keys"]
            assert nxt["cached"] <= stored if full_context else nxt["cached"] == stored
    assert stats.hits == hits and stats.lookups == lookups
    assert stats.hit_rate == (sum(hits) / sum(lookups) if sum(lookups) else None)
    accepted = sum(n * c for n, c in enumerate(stats.accepted))
    assert_acceptance(stats, rounds, accepted)
    assert stats.tau == len(out) / stats.rounds
    assert all(1 <= len(r["tokens"]) <= r["accepted"] + 1 <= len(r["drafts"]) + 1 <= k + 1 for r in rounds)


# Greedy and cache contents: GPT-2's full vocabulary (and MASK), as in test_speculative.py (greedy_models).
def prompt_for(seed, length):
    return torch.randint(0, 50257, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def test_greedy_output_equals_the_targets_greedy_decoding(greedy_models):
    target, drafts = greedy_models
    seen = {"hit": 0, "miss": 0, "partial": 0, "dropped_after_stop": 0}
    for seed in range(2):
        prompt = prompt_for(seed, 2 + 3 * seed)
        full, _ = ar_generate(target, prompt, 20, temperature=0, stop_token=None)
        greedy = {None: full, full[11]: ar_generate(target, prompt, 20, temperature=0, stop_token=full[11])[0]}
        for k, (fan_out, name), stop_token in itertools.product(
                (1, 4), ((1, "close"), (3, "close"), (2, "small"), ("last", "close"), ("middle", "close")),
                (None, full[11])):
            draft = drafts[name]
            # Branches only after a full acceptance (the catch-up skips rows), or only after a partial one.
            fan_out = {"last": [0] * k + [2], "middle": [0] * (k // 2) + [2] + [0] * (k - k // 2)}.get(fan_out, fan_out)
            expected = greedy[stop_token]
            rounds, on_round = recorder()
            out, stats = ssd_generate(target, draft, prompt, 20, k, fan_out, temperature=0, stop_token=stop_token,
                                      on_round=on_round)
            assert out == expected, (seed, k, fan_out, name, stop_token)
            check_counts(out, stats, rounds, k)
            seen["hit"] += sum(r["cached"] is True for r in rounds)
            seen["miss"] += sum(r["cached"] is False for r in rounds)
            seen["partial"] += sum(0 < r["accepted"] < len(r["drafts"]) for r in rounds)
            seen["dropped_after_stop"] += len(rounds[-1]["tokens"]) < rounds[-1]["accepted"] + 1
    assert all(seen.values()), seen  # the cases above must include each of these, or prove nothing


@torch.no_grad()
def test_a_hit_is_the_speculation_drafting_after_the_outcome_gives(greedy_models):
    """At temperature 0, every cached speculation equals draft_round's on a fresh cache after the
    committed sequence: the batched, masked pre-draft reads exactly that sequence."""
    target, drafts = greedy_models
    hits = capped = 0
    greedy = {}  # (seed, n_new): the target's greedy decoding
    for seed, k, n_new, fan in itertools.product(range(2), (2, 4), (16, None), ("all", "last")):  # None: full context
        prompt = prompt_for(seed, 3)
        if (seed, n_new) not in greedy:
            greedy[seed, n_new] = ar_generate(target, prompt, n_new, temperature=0, stop_token=None)[0]
        rounds, on_round = recorder()
        fan_out = 3 if fan == "all" else [0] * k + [1]  # "last": the catch-up starts at x_n
        out, stats = ssd_generate(target, drafts["close"], prompt, n_new, k, fan_out, stop_token=None,
                                  on_round=on_round)
        assert out == greedy[seed, n_new]
        check_counts(out, stats, rounds, k, full_context=n_new is None)
        before = prompt
        for r in rounds:
            if r["cached"]:
                fresh, q = draft_round(drafts["close"], drafts["close"].new_cache(1), before, len(r["drafts"]),
                                       (0.0, None, None))
                assert r["drafts"] == fresh.tolist() and torch.equal(r["q"], q)
                hits += 1
            before = r["seq"]
        capped += sum(nxt["cached"] is False and (r["accepted"], r["tokens"][-1]) in r["keys"]
                      for r, nxt in zip(rounds, rounds[1:]))
    assert hits > 20 and capped > 0  # capped: a stored speculation cut short by the full context, a miss


# A fan-out as large as the vocabulary: tiny vocabularies, real Transformers and KV caches.
V, NEW, PROMPT = 5, 4, [1, 2]      # 5^4 = 625 continuations; a round can be followed by 1-2 lookups
TINY = ModelConfig(vocab_size=V, context=12, n_layer=1, n_head=2, d_model=16, d_ff=32)


@torch.no_grad()
def test_a_fan_out_covering_the_vocabulary_always_hits():
    """A bonus after k < n accepted drafts is never x_{k+1} (residual(p, q) is 0 where a draft can be
    rejected), so V - 1 candidates cover it; after all n pass, any of the V tokens can follow."""
    target = random_model(TINY, seed=0)
    draft = random_model(TINY, seed=1)
    for k, temperature, seed in itertools.product((1, 2, 3), (0.0, 1.0), range(3)):
        for fan_out in (V, [V - 1] * k + [V]):
            rounds, on_round = recorder()
            out, stats = ssd_generate(target, draft, PROMPT, 8, k, fan_out, temperature, stop_token=None,
                                      generator=torch.Generator().manual_seed(seed), on_round=on_round)
            check_counts(out, stats, rounds, k)
            assert sum(stats.lookups) > 0 and stats.hit_rate == 1
            assert stats.jit_forwards == len(rounds[0]["drafts"])  # only the first round drafts just in time


@torch.no_grad()
def test_threaded_and_sequential_runs_agree_draw_for_draw(greedy_models):
    """The run-ahead draws only from its own stream, so running it in a second thread changes no
    token, no cache decision and no count. Tiny-vocabulary models make hits common at T > 0."""
    target, drafts = greedy_models
    tiny_target, tiny_draft = random_model(TINY, seed=0), random_model(TINY, seed=1)
    ignore = ("seconds", "tokens_per_s", "threaded")
    for models, warping in (((target, drafts["close"]), (0.0,)), ((tiny_target, tiny_draft), (1.0,)),
                            ((tiny_target, tiny_draft), (0.7, 3, 0.9))):
        used_cache = 0
        for seed in range(2):
            runs = []
            for threaded in (False, True):
                rounds, on_round = recorder()
                out, stats = ssd_generate(*models, [3, 4, 1, 2], 8, 3, 2, *warping,
                                          generator=torch.Generator().manual_seed(seed), stop_token=None,
                                          threaded=threaded, on_round=on_round)
                counts = {key: value for key, value in stats.row().items() if not key.startswith(ignore)}
                trace = [(r["drafts"], r["cached"], r["keys"], r["accepted"]) for r in rounds]
                runs.append((out, counts, trace))
                assert stats.threaded == threaded
            assert runs[0] == runs[1], (warping, seed)
            used_cache += sum(r[1] is True for r in runs[0][2])
        assert used_cache > 0, warping


@torch.no_grad()
def test_modelled_times_follow_from_the_counted_forwards(greedy_models):
    """The bench's price of SSD with its draft on its own device (bench.methods.modelled_seconds): SD drafts
    every proposed token (one forward each) and then verifies; SSD drafts only after a miss, and its
    run-ahead costs time only where it outlasts the verification it overlaps."""
    target, drafts = greedy_models
    for draft_s, target_s in ((0.1, 1.0), (0.7, 1.0), (0.0, 2.0)):  # 0.7: some run-aheads outlast verification
        rounds, on_round = recorder()
        out, stats = ssd_generate(target, drafts["close"], prompt_for(0, 3), 24, 4, 2, stop_token=None,
                                  on_round=on_round)
        sd = stats.rounds * target_s + stats.proposed * draft_s
        ssd = sum(r["jit_forwards"] * draft_s + max(target_s, r["ahead_forwards"] * draft_s) for r in rounds)
        assert all(math.isclose(a, b) for a, b in zip(modelled_seconds(stats, rounds, draft_s, target_s), (sd, ssd)))
        if draft_s == 0:
            assert math.isclose(ssd, stats.rounds * target_s)
        assert any(r["ahead_forwards"] * draft_s > target_s for r in rounds) == (draft_s == 0.7)
    assert forward_seconds(drafts["close"], prompt_for(0, 3)) > 0 and forward_seconds(target, prompt_for(0, 3)) > 0


def test_geometric_fan_out_is_the_best_split_of_its_budget():
    """Greedy allocation maximises sum_n P(n) (1 - (1 + F_n)^-r): checked against every split."""
    k, budget = 2, 6
    for alpha, r in itertools.product((0.2, 0.6, 0.9), (0.5, 1.0, 2.0)):
        chance = [alpha ** n * (1 - alpha) for n in range(k)] + [alpha ** k]

        def hit(fan):
            return sum(c * (1 - (1 + f) ** -r) for c, f in zip(chance, fan))
        fan = geometric_fan_out(budget, k, alpha, r)
        assert sum(fan) == budget
        best = max(hit(s) for s in itertools.product(range(budget + 1), repeat=k + 1) if sum(s) == budget)
        assert math.isclose(hit(fan), best)
    assert geometric_fan_out(10, 3, 0.5, cap=2) == [2, 2, 2, 2]  # capped: budget left unspent
    assert geometric_fan_out(12, 4, 0.3)[:4] == sorted(geometric_fan_out(12, 4, 0.3)[:4], reverse=True)


def test_sample_draws_from_q():
    """sampling.sample's inverse-CDF draws (the batched run-ahead leans on them) against q itself: 100,000 draws per row, chi-square at
    significance 1e-3 (power: a cell off by DELTA gives lam >= 1e5 DELTA^2 (1 - P) / P >= 40 on
    <= 6 df here, caught with probability > 0.99); ids of probability 0 are never drawn."""
    g = torch.Generator().manual_seed(0)
    q = warp(torch.randn(4, 7, generator=g) * 2)  # (4, V)
    q[0, 0] = q[1, -1] = q[2, 3] = 0.0  # zeros first, last and inside
    q = q / q.sum(-1, keepdim=True)
    q[3] = torch.nn.functional.one_hot(torch.tensor(5), 7).float()
    n = 100_000
    draws = sample(q.repeat_interleave(n, 0), g).view(4, n)  # (4, n)
    for row, probs in zip(draws, q):
        counts = torch.bincount(row, minlength=7)
        assert counts[probs == 0].sum() == 0
        p, o = probs[probs > 0].double(), counts[probs > 0].double()
        if len(p) > 1:
            df = len(p) - 1
            assert float(((o - n * p) ** 2 / (n * p)).sum()) < chi2_quantile(df, Z_ALPHA)
            heaviest = float(p.max())
            assert noncentral_chi2_sf(chi2_quantile(df, Z_ALPHA), df, n * DELTA ** 2 * (1 - heaviest) / heaviest) > 0.99


def test_bad_input_is_a_clear_error(greedy_models):
    target, drafts = greedy_models
    for fan_out in (0, -1, 2.5, True, [1, 1], [0, 0, 0], [1, -1, 1], "3"):
        with pytest.raises(UserError, match="fan-out"):
            ssd_generate(target, drafts["small"], [1, 2], 5, 2, fan_out)
    for k in (0, -1, 2.5):
        with pytest.raises(UserError, match="k "):
            ssd_generate(target, drafts["small"], [1, 2], 5, k, 1)
    with pytest.raises(UserError, match="empty"):
        ssd_generate(target, drafts["small"], [], 5, 2, 1)
    with pytest.raises(UserError, match="temperature"):
        ssd_generate(target, drafts["small"], [1, 2], 5, 2, 1, temperature=-1)
    for args in ((0, 2, 0.5), (4, 2, 1.5), (4, 2, 0.5, 0), (4, 2, 0.5, 1.0, 0)):
        with pytest.raises(UserError):
            geometric_fan_out(*args)


# Distribution: at temperature > 0 the committed tokens must follow the target's joint exactly.
class TableCache:
    """KVCache's interface over token ids: row i of k[0] (and v[0], the same tensor) holds the id
    the model read at cache row i, so the run-ahead's fork copies ids the way it copies keys."""

    def __init__(self, batch_size, capacity):
        ids = torch.full((batch_size, 1, capacity, 1), -1)  # (B, 1, capacity, 1)
        self.k, self.v, self.length = [ids], [ids], 0

    def crop(self, n):
        assert 0 <= n <= self.length
        self.length = n

    def advance(self, n):
        self.length += n


class ForkTableModel(TableModel):
    """A Transformer's conditionals after PROMPT from full forwards, looked up by the tokens each
    query attends to: its mask row (or, causally, every row up to it). A generation costs a few
    table lookups instead of ~10 forwards, so a powerful test fits in seconds. A wrong mask, fork,
    crop or position id gives a wrong lookup key (a wrong distribution) or fails its assertions;
    the real KV cache path is proven by the greedy, hit and real-caches tests."""

    def __init__(self, model):
        super().__init__(model, V, NEW, PROMPT)

    def new_cache(self, batch_size=1):
        return TableCache(batch_size, self.config.context)

    def forward(self, x, *, pos=None, mask=None, causal=True, cache=None):
        B, T = x.shape
        past = cache.length
        ids = cache.k[0][:, 0, :, 0]  # (B, capacity)
        ids[:, past:past + T] = x
        cache.advance(T)
        rows = ids[:, :past + T].tolist()
        if mask is None:
            assert causal
            mask = torch.ones(T, past + T, dtype=torch.bool).tril(past)
        mask = mask.expand(B, T, past + T).tolist()
        pos = None if pos is None else pos.expand(B, T).tolist()
        out = []
        for b, t in itertools.product(range(B), range(T)):
            seen = tuple(i for i, visible in zip(rows[b], mask[b][t]) if visible)
            assert seen[-1] == rows[b][past + t] and (pos is None or pos[b][t] == len(seen) - 1)
            out.append(self.table[seen])
        return torch.stack(out).view(B, T, -1)


class Case(NamedTuple):
    draft: Callable              # builds the draft from the target
    k: int                       # drafts per round
    fan_out: object              # int or per-k list
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    samples: int = 4_000         # seeded generations: enough for POWER on this case's target
    table: bool = True           # TableModel lookups (fast) or the Transformers' real KV caches


def flat_target():
    """Smaller weights than random_model's default: a flatter joint, so fewer samples reach POWER."""
    return random_model(TINY, seed=1, embed_std=0.1, std=0.2)


def good_draft(target):
    return perturbed(target, seed=3, noise=0.05)


def random_draft(target):
    return random_model(TINY, seed=2)


CASES = {
    "good draft, fan-out 2": Case(good_draft, k=2, fan_out=2),
    "random draft, geometric fan-out": Case(random_draft, k=3, fan_out=geometric_fan_out(6, 3, 0.5)),
    "whole vocabulary (every lookup hits)": Case(random_draft, k=2, fan_out=V),
    "one-hot draft": Case(lambda target: one_hot(good_draft(target)), k=2, fan_out=2),
    # End to end through the real KV caches, the batched masked pre-draft included.
    "real caches, top-p 0.9": Case(random_draft, k=2, fan_out=2, top_p=0.9, table=False),
}


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_sampled_tokens_follow_the_exact_target_distribution(case):
    """Chi-square goodness of fit of seeded generations against the enumerated joint, with the
    design of test_speculative.py. Significance 1e-3 per case (deterministic for fixed seeds).
    Power: one continuation off by DELTA = 2 points, the others absorbing it in proportion, makes
    the statistic noncentral chi-square with lam >= N DELTA^2 (1 - P) / P for the heaviest bin P.
    Here (one flat target; T = 1, and T = 1 with top-p 0.9: the same bins) there are 46 bins, the
    heaviest 0.026, so 4,000 generations catch such an error with probability 0.92 in every case.
    The power is computed from the exact joint and asserted >= POWER. Each case must also hit the
    cache more than N / 20 times (at every lookup, for the whole vocabulary), or it tests only SD.
    """
    make_draft, k, fan_out, temperature, top_k, top_p, n, table = CASES[case]
    target = flat_target()
    draft = make_draft(target)
    probs = exact_joint(target, temperature, top_k, top_p, V, NEW, PROMPT)  # (V^NEW,)
    if table:
        target, draft = ForkTableModel(target), ForkTableModel(draft)
    counts = torch.zeros(V ** NEW, dtype=torch.long)
    hits = lookups = 0
    generator = torch.Generator().manual_seed(1234)
    for _ in range(n):
        out, stats = ssd_generate(target, draft, PROMPT, NEW, k, fan_out, temperature, top_k, top_p,
                                  generator=generator, stop_token=None)
        counts[sum(t * V ** (NEW - 1 - i) for i, t in enumerate(out))] += 1
        hits, lookups = hits + sum(stats.hits), lookups + sum(stats.lookups)
    assert hits > 0.05 * n  # the cached speculations are exercised, not only just-in-time drafting
    if case.startswith("whole vocabulary"):
        assert hits == lookups
    assert_follows_the_joint(probs, counts, n)
