"""Spec: EAGLE-3 decoding (tinydiff/eagle3.py) is lossless as a chain or a tree: greedy output
is the target's; an oracle head reaches tau == k+1; caches equal a recomputation after every round;
MASK never comes out; sampled output follows the exact joint (chi-square); bad input is a clear error.
"""
import itertools
from dataclasses import asdict

import pytest
import torch
from eagle_models import HeadOracle, MemoHead, models, models64, random_head, small_vocab  # noqa: F401 (fixtures)
from stats_helpers import (
    DFLASH_DIST_CONFIG,
    NEW,
    PROMPT,
    assert_caches_equal,
    assert_follows_the_joint,
    check_block_counts,
    exact_joint,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    random_model,
    recorded_run,
    sample_counts,
)
from table_models import TableTarget, TreeTableTarget

from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.eagle3 import EagleConfig, eagle_generate, eagle_loss
from tinydiff.io.checkpoint import head_from
from tinydiff.model import ModelConfig
from tinydiff.tokenizer import EOT, MASK


def run(target, head, prompt, n, oracle=None, on_round=None, **kwargs):
    """eagle_generate with every round's info recorded (caches left out); the oracle reset first."""
    if oracle is not None:
        oracle.reset(prompt)
    return recorded_run(eagle_generate, target, head, prompt, n, None, on_round, **kwargs)


def check_counts(out, stats, rounds, n, k, budget, prompt_length):
    """The stats agree with the rounds; each round drafts min(k, what remains - 1) deep (nothing in a
    one-token prompt's first round); the head's forwards add up."""
    check_block_counts(out, stats, rounds, k + 1, prompt_length)
    done, forwards = 0, stats.rounds + (prompt_length > 1)  # committed-row reads: each round, the prompt
    for r in rounds:
        depth = 0 if done == 0 and prompt_length == 1 else min(k, n - done - 1)
        forwards += max(0, depth - 1)
        done += len(r["tokens"])
        if budget is None:
            assert len(r["drafts"]) == depth
        else:
            tree, path = r["tree"], r["path"]
            assert tree.size <= budget and int(tree.depths.max()) <= depth and r["accepted"] == len(path)
            assert [int(tree.parents[i]) for i in path] == [0, *path][:len(path)]
    assert stats.draft_forwards == forwards
    assert stats.proposed == sum(len(r["drafts"]) if budget is None else r["tree"].size for r in rounds)
    assert budget is None or stats.nodes_per_round == stats.proposed / stats.rounds


def branch_steps(rounds):
    """Accepted tree nodes that are not their parent's first (best) child: only a tree accepts them."""
    return sum(i != int((r["tree"].parents == r["tree"].parents[i]).nonzero()[0]) for r in rounds for i in r["path"])


SHAPES = ((1, None, 1), (3, None, 1), (5, None, 1), (3, 1, 2), (3, 4, 2), (4, 12, 3))  # k, budget, branch


@torch.no_grad()
def test_greedy_output_equals_the_targets_greedy_decoding(models64, small_vocab):
    """Token for token: chains of k = 1, 3, 5, trees of 1, 4, 12 nodes; 1- and 4-token prompts; with and
    without a stop token emitted mid-way; the decoy oracle (GPT-2's vocabulary), a random head (16 ids)."""
    target, _ = models64
    oracle = HeadOracle(random_head(target, seed=2), target, wrong=lambda position: position % 3 == 0)
    pairs = {"oracle": (target, oracle.head, oracle), "random, 16 ids": (*small_vocab, None)}
    seen = {"rejected": 0, "partial": 0, "full": 0, "branch": 0, "dropped_after_stop": 0}
    greedy = {}  # (seed, name, stop): the stop token and the target's greedy output, the same for every shape
    for seed, (k, budget, branch), name, stop in itertools.product(range(2), SHAPES, pairs, ("none", "mid")):
        model, head, orc = pairs[name]
        prompt = [1 + seed] + torch.randint(0, model.config.vocab_size - 1, (3 * seed,),
                                             generator=torch.Generator().manual_seed(seed)).tolist()
        if (seed, name, stop) not in greedy:
            full, _ = ar_generate(model, prompt, 24, temperature=0, stop_token=None)
            stop_token = None if stop == "none" else full[13]
            expected, _ = ar_generate(model, prompt, 24, temperature=0, stop_token=stop_token)
            greedy[seed, name, stop] = stop_token, expected
        stop_token, expected = greedy[seed, name, stop]
        out, stats, rounds = run(model, head, prompt, 24, orc, k=k, budget=budget, branch=branch, temperature=0,
                                 stop_token=stop_token)
        assert out == expected, (seed, k, budget, name, stop)
        check_counts(out, stats, rounds, 24, k, budget, len(prompt))
        depth = [len(r["drafts"]) if budget is None else int(r["tree"].depths.max()) for r in rounds]
        seen["rejected"] += stats.accepted[0]
        seen["partial"] += sum(0 < r["accepted"] < d for r, d in zip(rounds, depth))
        seen["full"] += sum(0 < r["accepted"] == d for r, d in zip(rounds, depth))
        seen["branch"] += branch_steps(rounds) if budget else 0
        seen["dropped_after_stop"] += len(rounds[-1]["tokens"]) < rounds[-1]["accepted"] + 1
    assert min(seen.values()) > 0, seen  # every kind of round, or the test proves nothing


@torch.no_grad()
def test_a_head_that_knows_the_target_gives_tau_k_plus_1(models64):
    """Without decoys a chain accepts all k drafts every round. With a decoy ahead of the target's pick at
    every even position a chain stops at one each round; a tree keeping both branches accepts all k."""
    target, _ = models64
    never, even = (lambda position: False), (lambda position: position % 2 == 0)
    for k, prompt in itertools.product((2, 4), ([EOT], [EOT, 7, 8, 9])):
        n = 3 * (k + 1) + (len(prompt) == 1)  # a one-token prompt's first round has nothing to draft from
        expected = ar_generate(target, prompt, n, temperature=0, stop_token=None)[0]
        full = [int(len(prompt) == 1)] + [0] * (k - 1) + [3]
        for name, wrong, budget in (("chain", never, None), ("tree, decoys", even, 16), ("chain, decoys", even, None)):
            oracle = HeadOracle(random_head(target, seed=3), target, wrong)
            out, stats, rounds = run(target, oracle.head, prompt, n, oracle, k=k, budget=budget, branch=4,
                                     temperature=0, stop_token=None)
            assert out == expected
            check_counts(out, stats, rounds, n, k, budget, len(prompt))
            assert (stats.accepted == full) == (name != "chain, decoys"), (name, k, prompt, stats.accepted)
            if budget is not None:
                assert branch_steps(rounds) > 0


@torch.no_grad()
def test_caches_hold_exactly_the_committed_context_after_every_round(models64, small_vocab):
    """After every round the target's cache and the head's cache hold rows for seq[:-1] and equal
    a recomputation from scratch (the head's: the target features of seq[:-1] with tokens seq[1:]),
    to float64 rounding."""
    checked = {"full": 0, "partial": 0, "stopped": 0}

    def check(info):  # model and head: the run's, from the loop below
        seq, tc, hc = info["seq"], info["target_cache"], info["draft_cache"]
        assert tc.length == hc.length == len(seq) - 1
        fresh_t, fresh_h = model.new_cache(), head.new_cache()
        _, hidden = model(torch.tensor([seq[:-1]]), cache=fresh_t, causal=True,
                          hidden_layers=head.config.feature_layers)
        head.extend(fresh_h, torch.tensor([seq[1:]]), hidden)
        assert_caches_equal((tc, fresh_t), (hc, fresh_h))
        depth = len(info["drafts"]) if "drafts" in info else int(info["tree"].depths.max())
        checked["full" if depth and info["accepted"] == depth else "partial"] += 1

    target, _ = models64
    oracle = HeadOracle(random_head(target, seed=3), target, wrong=lambda position: position % 4 == 0)
    big = (target, oracle.head, oracle)
    cases = [(*big, 0, None, [EOT, 3, 4, 5]), (*big, 0, 6, [EOT]), (*small_vocab, None, 1.0, None, [EOT % 16, 3]),
             (*small_vocab, None, 1.0, 8, [2])]
    for model, head, orc, temperature, budget, prompt in cases:
        shape = dict(k=3, budget=budget, temperature=temperature)
        stop = run(model, head, prompt, 20, orc, **shape, generator=torch.Generator().manual_seed(0),
                   stop_token=None)[0][9]
        out, _, _ = run(model, head, prompt, 20, orc, **shape, generator=torch.Generator().manual_seed(0),
                        stop_token=stop, on_round=check)
        checked["stopped"] += out[-1] == stop and len(out) < 20
    assert min(checked.values()) > 0, checked


@torch.no_grad()
def test_mask_never_comes_out(models):
    mask_target = random_model(models[0].config, seed=0)
    mask_head = random_head(mask_target, seed=1)
    bias = torch.zeros(mask_target.config.vocab_size).index_fill_(0, torch.tensor([MASK]), 100.0)  # MASK wins
    for model in (mask_target, mask_head):  # both return (logits, ...) here
        model.register_forward_hook(lambda module, args, output: (output[0] + bias, *output[1:]))
    for temperature, budget in itertools.product((0, 1.0), (None, 8)):
        out, _, rounds = run(mask_target, mask_head, [EOT, 3], 12, k=3, budget=budget, temperature=temperature,
                             stop_token=None, generator=torch.Generator().manual_seed(0))
        assert len(out) == 12 and MASK not in out
        assert all(MASK not in (r["drafts"] if budget is None else r["tree"].tokens.tolist()) for r in rounds)


def test_bad_input_is_a_clear_error(models):
    target, head = models
    other = random_model(ModelConfig(context=40, n_layer=4, n_head=2, d_model=32, d_ff=64), seed=0)
    zeros = torch.zeros(2, 3, dtype=torch.long)
    cases = [(lambda: eagle_generate(target, head, [1, 2], 5, k=k), "k ") for k in (0, 2.5, True)] + [
        (lambda: eagle_generate(target, head, [1, 2], 5, budget=0), "budget"),
        (lambda: eagle_generate(target, head, [1, 2], 5, budget=2.5), "budget"),
        (lambda: eagle_generate(target, head, [1, 2], 5, budget=4, branch=0), "branch"),
        (lambda: eagle_generate(target, target, [1, 2], 5), "EagleHead"),
        (lambda: eagle_generate(other, head, [1, 2], 5), "built for a target"),
        (lambda: eagle_generate(target, head, [], 5), "empty"),
        (lambda: eagle_generate(target, head, [1, 2], 5, temperature=-1), "temperature"),
        (lambda: eagle_generate(target, head, [1, 2], 39), "max new tokens"),
        (lambda: eagle_loss(head, zeros, steps=3), "too short"),
        (lambda: eagle_loss(head, zeros, steps=0), "steps"),
        (lambda: EagleConfig.for_target(target.config, feature_layers=[1, 2]), "feature_layers"),
        (lambda: EagleConfig.for_target(target.config, steps_ahead=0), "steps_ahead"),
        (lambda: head_from({"kind": "dflash", "config": {}, "model": {}}, target), "not an EAGLE-3 head"),
        (lambda: head_from({"config": {"depth": 3}, "model": {}}, target), "not an EAGLE-3 head config")]
    for call, message in cases:
        with pytest.raises(UserError, match=message):
            call()
    assert asdict(EagleConfig.for_target(target.config))["feature_layers"] == [1, 3, 5]


# Distribution: test_dflash's design (V = 6, 3 new tokens after a 2-token prompt, chi-square at significance
# 1e-3, power asserted), the target read through TableTarget / TreeTableTarget (real caches: proven above).
DIST_CASES = {  # budget (None: chain), k, branch, temperature, top_k, top_p, samples
    "chain, k 2": (None, 2, 1, 0.7, None, 0.9, 7_000),
    "tree, budget 3, branch 3": (3, 2, 3, 0.7, None, 0.9, 7_000),
}


@pytest.mark.parametrize("case", DIST_CASES)
@torch.no_grad()
def test_sampled_tokens_follow_the_exact_target_distribution(case):
    """At temperature 0.7 and top-p 0.9 (drafts and target must be warped alike): 40 bins, the heaviest
    0.046, so 7,000 samples catch one continuation off by 2 points with probability 0.93. Each case
    must see rejections, full acceptances and (trees) branch acceptances, or it proves nothing."""
    budget, k, branch, temperature, top_k, top_p, n = DIST_CASES[case]
    model = random_model(DFLASH_DIST_CONFIG, seed=1, embed_std=0.1)
    head = random_head(model, seed=5, kind=MemoHead)
    head.register_forward_hook(lambda module, args, output: (output[0] * 4, *output[1:]))  # sharper drafts
    probs = exact_joint(model, temperature, top_k, top_p)  # (V^NEW,)
    target = (TableTarget if budget is None else TreeTableTarget)(model, head.config.feature_layers)
    rounds = []
    counts, hist = sample_counts(lambda generator: eagle_generate(
        target, head, PROMPT, NEW, k, budget, branch, temperature, top_k, top_p, generator, stop_token=None,
        on_round=rounds.append), n, None, seed=1234)
    assert hist[0] > 0 and hist[NEW - 1] > 0 and (budget is None or branch_steps(rounds) > 0), hist
    assert_follows_the_joint(probs, counts, n)
