"""Spec: DSpark's confidence-scheduled verify length on DFlash (extras/dflash_reject.py: confident_prefix).

The target verifies the drafts before the first slot the drafter gives under min_confidence (at
least one). The cut is computed by hand from the drafter's own logits; every rule stays lossless
with it (greedy equality with and without a Markov head, chi-square at T > 0 in test_dflash's
design); min_confidence 0 is plain DFlash round for round; bad values are refused before any work.
"""
import itertools

import pytest
import torch
from dflash_models import dflash_with_rule as dflash_generate
from stats_helpers import (
    DFLASH_DIST_CONFIG,
    NEW,
    PROMPT,
    assert_follows_the_joint,
    exact_joint,
    float64,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    random_drafter,
    random_model,
    recorded_run,
    sample_counts,
)
from table_models import Oracle, TableTarget

from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.extras.dflash_reject import confident_prefix
from tinydiff.model import ModelConfig
from tinydiff.tokenizer import EOT, MASK


@pytest.fixture(scope="module")
def models():
    target = random_model(ModelConfig(context=48, n_layer=5, n_head=2, d_model=32, d_ff=64), seed=0)
    plain = random_drafter(target, seed=1, n_layer=2, block_size=8, n_features=2, std=0.3)
    markov = random_drafter(target, seed=2, n_layer=2, block_size=8, n_features=2, std=0.3, markov_rank=4)
    return float64(target, plain, markov)


def test_the_prefix_ends_before_the_first_unsure_slot_and_keeps_one():
    rows = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1], [0.3, 0.3, 0.4], [0.9, 0.05, 0.05]]))
    drafts = torch.tensor([0, 1, 2, 0])  # the drafter's probabilities of its drafts: 0.7, 0.4, 0.4, 0.9
    assert confident_prefix(rows, drafts, 0.5) == 1  # slot 2 (0.4) is the first under 0.5
    assert confident_prefix(rows, drafts, 0.35) == 4  # none under
    assert confident_prefix(rows, drafts, 0.4) == 4  # "under" is strict
    assert confident_prefix(rows, drafts, 0.8) == 1  # slot 1 already: still one draft verified
    assert confident_prefix(rows, drafts, 0.0) == 4


@torch.no_grad()
def test_each_round_verifies_exactly_the_confident_prefix_and_stays_greedy(models):
    target, plain, _ = models
    block_logits = []
    hook = plain.register_forward_hook(lambda module, args, out: block_logits.append(out[0, 1:]))
    seen = {"cut": 0, "whole": 0}
    try:
        for seed, c in itertools.product(range(3), (0.05, 0.2, 0.5)):
            prompt = [EOT] + torch.randint(0, 50257, (2 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            expected, _ = ar_generate(target, prompt, 30, temperature=0, stop_token=None)
            block_logits.clear()
            out, stats, rounds = recorded_run(dflash_generate, target, plain, prompt, 30, temperature=0,
                                              stop_token=None, min_confidence=c)
            assert out == expected
            available = [min(7, 30 - sum(len(r["tokens"]) for r in rounds[:i]) - 1) for i in range(len(rounds))]
            for r, logits, k in zip(rounds, block_logits, available):
                p = torch.softmax(logits[:k, :MASK], -1).max(-1).values  # the drafter's belief in its argmax
                low = (p < c).nonzero().flatten().tolist()
                want = max(1, low[0]) if low else k
                assert len(r["drafts"]) == want, (seed, c)
                seen["cut" if want < k else "whole"] += 1
            assert stats.proposed == sum(len(r["drafts"]) for r in rounds)
    finally:
        hook.remove()
    assert min(seen.values()) > 0, seen  # rounds cut short and rounds verified whole, or it proves nothing


@torch.no_grad()
def test_min_confidence_zero_is_plain_dflash_and_every_cut_stays_greedy(models):
    target, plain, markov = models
    prompt = [EOT, 464, 3290]
    expected, _ = ar_generate(target, prompt, 30, temperature=0, stop_token=None)
    for drafter, rule in itertools.product((plain, markov), ("match", "reject")):
        base = recorded_run(dflash_generate, target, drafter, prompt, 30, temperature=0, stop_token=None, rule=rule)
        zero = recorded_run(dflash_generate, target, drafter, prompt, 30, temperature=0, stop_token=None, rule=rule,
                            min_confidence=0.0)
        assert zero[0] == base[0] == expected and zero[2] == base[2]
        for c in (0.3, 1.0):
            out, stats, rounds = recorded_run(dflash_generate, target, drafter, prompt, 30, temperature=0,
                                              stop_token=None, rule=rule, min_confidence=c)
            assert out == expected, (rule, c)
        # 1.0: no slot is certain, so one draft a round (none in a last round with one token left)
        assert [len(r["drafts"]) for r in rounds[:-1]] == [1] * (len(rounds) - 1) and len(rounds[-1]["drafts"]) <= 1


@pytest.mark.parametrize("rule, markov_rank", [("match", 0), ("reject", 3)])
@torch.no_grad()
def test_a_scheduled_verify_keeps_every_rule_lossless(rule, markov_rank):
    """test_dflash's chi-square design (significance 1e-3, power asserted from the joint): the
    target's exact joint over V^NEW continuations, the verify cut by confidence. The match rule
    drafts from the target itself (table_models.Oracle), as in test_dflash, or it never keeps a draft."""
    target = random_model(DFLASH_DIST_CONFIG, seed=1, embed_std=0.1)
    drafter = random_drafter(target, seed=5, block_size=4, markov_rank=markov_rank)
    probs, n = exact_joint(target, 1.0, None, None), 5_500
    oracle = Oracle(drafter, target) if rule == "match" else None
    target = TableTarget(target, drafter.config.taps)
    seen = {"cut": 0, "rejected": 0, "all kept": 0}

    def generate(generator):
        out, stats, rounds = recorded_run(dflash_generate, target, drafter, PROMPT, NEW, oracle, temperature=1.0,
                                          generator=generator, stop_token=None, rule=rule, min_confidence=0.3)
        seen["cut"] += len(rounds[0]["drafts"]) < NEW - 1  # the first round could verify NEW - 1 drafts
        seen["rejected"] += sum(r["accepted"] < len(r["drafts"]) for r in rounds)
        seen["all kept"] += sum(0 < r["accepted"] == len(r["drafts"]) for r in rounds)
        return out, stats
    counts, _ = sample_counts(generate, n, oracle, 1234)
    assert min(seen.values()) > 0, seen  # cut verifies, rejections and full acceptances, or it proves nothing
    assert_follows_the_joint(probs, counts, n)


def test_a_min_confidence_outside_0_to_1_is_refused_before_any_work(models):
    target, plain, _ = models
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(UserError, match="min_confidence must be"):
            dflash_generate(target, plain, [EOT], 4, min_confidence=bad)
